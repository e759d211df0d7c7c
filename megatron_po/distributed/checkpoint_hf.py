"""Hugging Face model directories to and from our checkpoints, streamed (tools/checkpoint_convert.py import-hf and
export-hf; the mapping: megatron_po/models/hf/).

import-hf reads config.json through its transformers config class, builds the model it describes on the meta
device (which tensors our checkpoint must hold, and their shapes), matches them with the family's table, and
checks every shape against the safetensors headers before writing anything: a missing shard or tensor, a shape
that disagrees with config.json, a tensor nothing reads, an architecture not served, a tokenizer directory
without a tokenizer: one line each. Then DCP writes the checkpoint of iteration 0 one tensor at a time
(`Deferred` entries: each made from its HF tensors when written, then released), global tensors as a
one-process save writes them, so it loads at any TP, PP, EP, ETP, CP and DP (the vocabulary rows as the HF
checkpoint has them: the run pads them to its multiple when it loads them). Peak host memory: about the largest
of our tensors (a layer's stacked experts) and the HF tensors it is made of, plus DCP's serialized copy of it
(bench/results/hf_convert_memory.md).

export-hf reads a checkpoint saved at any layout one layer at a time and writes HF's sharded safetensors one
tensor at a time (models/hf/files.py), config.json from the family's config class and the tokenizer's files.
Each tensor is read straight into the one returned (checkpoint_read_into.py: no second copy while it is read),
and each layer is released, its memory handed back to the system, before the next is read. Peak host memory:
the largest tensor, or one layer and the largest of its HF pieces being written (bench/results/hf_convert_memory.md).

Both write into `<out>.partial` and rename it to `<out>` at the end: the output directory is never half made.
Tensors keep their dtype both ways (a bf16 Hub checkpoint imports as bf16 weights; the run's fp32 main params
take them exactly), so import then export reproduces every tensor bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil

import torch

from megatron_po.config import ModelConfig, model_config_from_dict, num_query_groups
from megatron_po.distributed.checkpoint_data import JsonEntry
from megatron_po.distributed.checkpoint_dcp import Deferred
from megatron_po.distributed.checkpoint_format import (checkpoint_dir, named_buffers_global,
                                                       named_parameters_global)
from megatron_po.distributed.checkpoint_load import CheckpointReader
from megatron_po.distributed.checkpoint_save import save_in_one_process
from megatron_po.errors import UserError
from megatron_po.models.hf.configs import (export_family, family_of, hf_config, latent_norm_note, model_config,
                                           model_fields)
from megatron_po.models.hf.files import HFTensors, ShardedWriter
from megatron_po.models.hf.families import MTP_SHARED
from megatron_po.models.hf.tensors import Layout, Mapping, expand, to_ours, to_theirs

# The files of a Hugging Face tokenizer (any of the first four makes a directory a tokenizer's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "chat_template.jinja")


# The MTP block's own copy of the embedding, which a one-process model does not have (docs/mtp.md).
MTP_OWN_EMBEDDING = "mtp.embedding.word_embeddings.weight"


def meta_model_tensors(m: ModelConfig, padded_vocab: int) -> dict[str, torch.Tensor]:
    """{global name: meta tensor} of what a checkpoint of this model holds (weights, persistent buffers)."""
    from megatron_po.models.gpt import GPTModel
    with torch.device("meta"):
        model = GPTModel(m, padded_vocab, seed=0)
    return dict(named_parameters_global([model]) + named_buffers_global([model]))


def layout_of(m: ModelConfig, hf_vocab: int) -> Layout:
    return Layout(heads=m.num_attention_heads, groups=num_query_groups(m), num_experts=m.num_experts or 0,
                  hf_vocab=hf_vocab, one_p=m.apply_layernorm_1p)


def mappings_of(family, m: ModelConfig, ours: list[str]) -> list:
    """The family's table applied to our tensors `ours`, adjusted (families.py), with the Hub's copies of the
    embedding and the head in each multi-token prediction depth: the main ones, or the MTP block's own embedding
    where it keeps one (the last stage's copy under an asynchronous pipeline, docs/mtp.md)."""
    own = MTP_OWN_EMBEDDING
    mappings = expand(family.tensors, [n for n in ours if n != own], m.num_experts or 0, family.architecture,
                      m.num_layers)
    mappings = family.adjust(mappings, m) if family.adjust else mappings
    if any(n.startswith("mtp.") for n in ours):
        sources = {"embedding.word_embeddings.weight": own if own in ours else "embedding.word_embeddings.weight",
                   "output_layer.weight": "output_layer.weight" if m.untie_embeddings_and_output_weights
                   else "embedding.word_embeddings.weight"}
        mappings += [Mapping(sources[name], [theirs.replace("{i}", str(m.num_layers + d))], "shared")
                     for d in range(m.mtp_num_layers) for name, theirs in MTP_SHARED]
    return mappings


def tokenizer_of(directory: str | None, explicit: bool) -> tuple[str | None, int | None]:
    """(absolute directory, vocabulary size) of a Hugging Face tokenizer; (None, None) when `directory` holds none
    and was not named explicitly (--tokenizer-model), a UserError when it was."""
    from megatron_po.data.tokenizer import HuggingFaceTokenizer
    from megatron_po.errors import DataError
    present = directory is not None and any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES[:4])
    if not present:
        if explicit:
            raise UserError(f"--tokenizer-model {directory}: no tokenizer there (none of "
                            f"{', '.join(TOKENIZER_FILES[:4])})")
        return None, None
    try:
        return os.path.abspath(directory), HuggingFaceTokenizer(directory).vocab_size
    except DataError as e:
        raise UserError(str(e)) from None


def _staging(out: str) -> str:
    """`<out>.partial`, empty; UserError when `out` exists and is not an empty directory."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"--out {out} exists and is not empty")
    staging = os.path.normpath(out) + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def _publish(staging: str, out: str) -> None:
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked by _staging)
    os.replace(staging, out)


# --------------------------------------------------------------------------------------------------
# import-hf
# --------------------------------------------------------------------------------------------------


def read_config_json(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--hf {hf_dir}: no config.json there")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--hf {hf_dir}: config.json is not readable JSON ({e})") from None


def _skipped(name: str, c) -> bool:
    """HF tensors no model here needs: rotary caches of old checkpoints, a tied head written anyway, and the
    multi-token prediction layers after the last layer (GLM-4.5 and DeepSeek-V3 Hub checkpoints hold them)."""
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_word_embeddings):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(layer and int(layer.group(1)) >= c.num_hidden_layers and getattr(c, "num_nextn_predict_layers", 0))


def _planned_dtypes(mappings: list, tensors: HFTensors, expected: dict, layout: Layout) -> dict:
    """{our name: dtype} of the tensors the import makes, every shape checked from the headers alone (the
    transforms run on meta tensors) before anything is written; UserError (one line) at the first disagreement."""
    dtypes = {}
    for mp in mappings:
        if mp.kind == "shared":  # the Hub's copies of our embedding or head in an MTP layer: not read
            continue
        where = f"--hf {tensors.dir}: shapes disagree with config.json: " + ", ".join(
            f"{n} {tuple(tensors.meta(n).shape)}" for n in mp.theirs[:3])
        if mp.ours is None:  # an HF tensor with nothing to hold here (Qwen2-MoE's empty shared expert)
            if tuple(tensors.meta(mp.theirs[0]).shape) != tuple(mp.shape):
                raise UserError(f"{where}, config.json makes it {tuple(mp.shape)}")
            continue
        try:
            planned = to_ours(mp, tensors.meta, layout)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"{where} ({e})") from None
        if planned.shape != expected[mp.ours].shape:
            raise UserError(f"{where} make our {mp.ours} {tuple(planned.shape)}, config.json "
                            f"{tuple(expected[mp.ours].shape)}")
        dtypes[mp.ours] = planned.dtype
    return dtypes


def import_hf(hf_dir: str, out: str, divisible_by: int = 128, tokenizer_model: str | None = None,
              progress: bool = True) -> str:
    """Write the HF model in `hf_dir` as our checkpoint of iteration 0 under `out`; return the flag line that
    trains from it (`divisible_by`: its --make-vocab-size-divisible-by)."""
    import transformers

    from megatron_po.config import Config
    raw = read_config_json(hf_dir)
    family = family_of(raw)
    try:
        c = transformers.CONFIG_MAPPING[family.model_type].from_dict(raw)
    except Exception as e:  # the config class's own validation
        reason = " ".join(str(e).split())[:300]
        raise UserError(f"--hf {hf_dir}: config.json is not a valid {family.architecture} config ({reason})") from None
    fields = model_fields(family, c)
    fields["make_vocab_size_divisible_by"] = divisible_by
    tensors = HFTensors(hf_dir)
    depths = fields.get("mtp_num_layers") or 0
    if depths and not all(f"model.layers.{c.num_hidden_layers + d}.eh_proj.weight" in tensors.entries
                          for d in range(depths)):  # config.json names depths the files do not hold
        print(f"config.json names {depths} multi-token prediction depth(s) the checkpoint does not hold: "
              "imported without them")
        del fields["mtp_num_layers"]
    m = model_config(fields)
    tok_dir, tok_vocab = tokenizer_of(tokenizer_model or hf_dir, explicit=tokenizer_model is not None)
    hf_vocab = c.vocab_size
    vocab = min(hf_vocab, tok_vocab) if tok_vocab else hf_vocab  # rows the run's tokenizer can produce
    expected = meta_model_tensors(m, hf_vocab)  # the vocabulary unpadded: the run pads it when it loads
    layout = layout_of(m, hf_vocab)
    mappings = mappings_of(family, m, list(expected))
    dtypes = _planned_dtypes(mappings, tensors, expected, layout)
    read = {n for mp in mappings for n in mp.theirs}
    skipped = [n for n in tensors.entries if n not in read and _skipped(n, c)]
    unread = [n for n in tensors.entries if n not in read and n not in skipped]
    if unread:
        raise UserError(f"--hf {hf_dir}: tensor {unread[0]} has no place in the {family.architecture} config.json "
                        f"describes ({len(unread)} such)")

    from tqdm import tqdm
    bar = tqdm(total=len(dtypes), unit="tensor", desc="importing", disable=not progress)

    def make(mp):
        t = to_ours(mp, tensors.read, layout)
        bar.update(1)
        return t

    state = {f"model.{mp.ours}": Deferred(expected[mp.ours].shape, dtypes[mp.ours], lambda mp=mp: make(mp))
             for mp in mappings if mp.ours is not None and mp.kind != "shared"}
    cfg = Config().to_dict()
    cfg["model"] = {**cfg["model"], **fields}
    cfg["data"]["vocab_size"] = vocab
    if tok_dir is not None:
        cfg["data"].update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    state["extra"] = JsonEntry({"train_state": {"iteration": 0, "consumed_samples": 0}, "config": cfg,
                                "vocab_size": vocab, "padded_vocab_size": hf_vocab, "hf_vocab_size": hf_vocab,
                                "hf_model_type": family.model_type, "imported_from": os.path.abspath(hf_dir)})
    staging = _staging(out)
    try:
        save_in_one_process(state, staging)
        bar.close()
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if skipped:
        print(f"skipped {len(skipped)} tensors no model here holds (e.g. {skipped[0]}; multi-token prediction "
              "layers, rotary caches, a tied head)")
    line = f"--load {shlex.quote(out)} --finetune {model_flags(cfg['model'])}"
    if tok_dir is not None:
        line += f" --tokenizer-type HuggingFaceTokenizer --tokenizer-model {shlex.quote(tok_dir)}"
    print(f"wrote {family.architecture} ({len(state) - 1} tensors, vocabulary {hf_vocab}) to {checkpoint_dir(out, 0)}; "
          f"train from it with\n  {line}")
    return line


def model_flags(model: dict) -> str:
    """The command-line flags that build `model` (its non-default values), quoted for a shell."""
    import dataclasses
    default = dataclasses.asdict(ModelConfig())
    flags = []
    for k, v in model.items():
        if k not in default or v == default[k]:
            continue
        name = k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(f"--{name}" if v else f"--no-{name}")
        else:
            flags.append(f"--{name} {shlex.quote(str(v))}")
    return " ".join(flags)


# --------------------------------------------------------------------------------------------------
# export-hf
# --------------------------------------------------------------------------------------------------


def _by_layer(mappings: list) -> list[list]:
    """Consecutive mappings of one layer together (an HF-only tensor goes with the one before it)."""
    groups, key = [], None
    for mp in mappings:
        if mp.ours is not None:
            found = re.match(r"layers\.(\d+)\.", mp.ours)
            new = found.group(1) if found else mp.ours
            if not groups or new != key:
                groups.append([])
            key = new
        groups[-1].append(mp)
    return groups


def export_hf(load: str, out: str, step: int | None = None, model_type: str | None = None,
              max_shard_bytes: int = 5 * 10**9, tokenizer_model: str | None = None, progress: bool = True) -> str:
    """Write the checkpoint under `load` (its latest, or iteration `step`) as an HF model directory `out`; return
    the class name."""
    reader = CheckpointReader(load, step)
    config = reader.extra.get("config")
    if not config or "model" not in config:
        raise UserError(f"--load {load}: the checkpoint carries no model config (not written by megatron_po?)")
    m = model_config_from_dict(config["model"])
    family = export_family(m, model_type or reader.extra.get("hf_model_type"))
    specs = {k[len("model."):]: v for k, v in reader.specs.items() if k.startswith("model.")}
    padded = specs["embedding.word_embeddings.weight"].size[0]
    vocab = reader.extra.get("vocab_size") or padded  # older checkpoints do not say: keep every row
    hf_vocab = reader.extra.get("hf_vocab_size") or vocab
    expected = meta_model_tensors(m, padded)
    if m.mtp_num_layers and MTP_OWN_EMBEDDING in specs:  # an asynchronous run's (mappings_of): kept by its last stage
        expected[MTP_OWN_EMBEDDING] = expected["embedding.word_embeddings.weight"]
    missing = [n for n in expected if n not in specs] + [n for n in specs if n not in expected]
    if missing:
        raise UserError(f"--load {reader.path}: {missing[0]} is in the checkpoint or its model config but not in both")
    tok_dir, _ = tokenizer_of(tokenizer_model or _run_tokenizer(config), explicit=tokenizer_model is not None)
    layout = layout_of(m, hf_vocab)
    # The depths of --mtp-num-layers, in a family whose Hub checkpoints hold none, are left out: the LM alone.
    left_out = [n for n in expected if n.startswith("mtp.") and not family.mtp]
    groups = _by_layer(mappings_of(family, m, [n for n in expected if n not in left_out]))  # a layer read at a time
    dtype = specs["embedding.word_embeddings.weight"].properties.dtype
    plan = []
    for mp in (mp for group in groups for mp in group):  # every HF tensor's name, shape and dtype: the headers
        meta = None if mp.ours is None else torch.empty(tuple(specs[mp.ours].size),
                                                        dtype=specs[mp.ours].properties.dtype, device="meta")
        plan += [(n, tuple(t.shape), t.dtype) for n, t in zip(mp.theirs, to_theirs(mp, meta, layout, dtype, "meta"))]

    staging = _staging(out)
    try:
        config_obj = hf_config(family, m, hf_vocab)
        config_obj.dtype = dtype
        config_obj.save_pretrained(staging)
        writer = ShardedWriter(staging, plan, max_shard_bytes)
        from tqdm import tqdm
        for group in tqdm(groups, unit="part", desc="exporting", disable=not progress):
            _export_group(reader, group, writer, layout, dtype)
            _hand_back_freed_memory()
        writer.close()
        for f in TOKENIZER_FILES if tok_dir else ():
            if os.path.isfile(os.path.join(tok_dir, f)):
                shutil.copy(os.path.join(tok_dir, f), os.path.join(staging, f))
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if latent_norm_note(m):
        print(latent_norm_note(m))
    depths = f"; its {m.mtp_num_layers} multi-token prediction depth(s) (mtp.*) left out" if left_out else ""
    print(f"wrote {family.architecture} (vocabulary {hf_vocab}, iteration {reader.iteration}, {len(writer.files)} "
          f"safetensors file(s){', tokenizer from ' + tok_dir if tok_dir else ', no tokenizer'}) to {out}{depths}")
    return family.architecture


def _export_group(reader: CheckpointReader, group: list, writer: ShardedWriter, layout: Layout,
                  dtype: torch.dtype) -> None:
    """Read one layer's tensors (each straight into its own, CheckpointReader.read) and write their HF tensors;
    all of them released on return, before the next layer is read: the peak is one layer, or the largest tensor."""
    ours = reader.read([f"model.{mp.ours}" for mp in group if mp.ours is not None])
    for mp in group:
        t = ours.pop(f"model.{mp.ours}") if mp.ours is not None else None
        for name, x in zip(mp.theirs, to_theirs(mp, t, layout, dtype)):
            writer.write(name, x)


def _hand_back_freed_memory() -> None:
    """Return the memory of freed tensors to the system (glibc's malloc_trim; elsewhere nothing). After the first
    large free glibc serves allocations up to 32 MiB (a layer's tensors) from its heap, and keeps them there when
    freed: a layer's worth of memory would stay resident under the next tensor, the largest one included."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def _run_tokenizer(config: dict) -> str | None:
    """The run's Hugging Face tokenizer directory, if it had one."""
    data = config.get("data", {})
    model = data.get("tokenizer_model")
    if data.get("tokenizer_type") == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        return model
    return None

