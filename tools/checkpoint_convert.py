"""Convert megatron_po checkpoints: consolidate to one safetensors file, export to / import from Hugging Face.

    python tools/checkpoint_convert.py consolidate --load ckpt [--ckpt-step N] --out model.safetensors
    python tools/checkpoint_convert.py export-hf   --load ckpt [--ckpt-step N] --out hf_dir [--model-type mistral]
                                                   [--max-shard-size 5GB] [--tokenizer-model DIR]
    python tools/checkpoint_convert.py import-hf   --hf hf_dir --out ckpt [--make-vocab-size-divisible-by 128]
                                                   [--tokenizer-model DIR]
    python tools/checkpoint_convert.py export-te   --load ckpt [--ckpt-step N] --out te_dir [--tensor-model-parallel-size 2]
    python tools/checkpoint_convert.py import-te   --te te_dir --out ckpt
    python tools/checkpoint_convert.py verify      CKPT [--ckpt-step N]

All of them run in ONE process without torch.distributed, whatever TP/PP/DP layout wrote the checkpoint:
DCP stores global tensors, so each is assembled from every rank's shards on read.

- consolidate: every parameter under its global name (`layers.3.attention.qkv.weight`, ...) plus a JSON
  next to it (model.safetensors -> model.json) with the run's config, iteration and vocabulary sizes.
- import-hf / export-hf: Hugging Face model directories (config.json + safetensors, sharded or not) of the
  families GPT-2, Llama (3.x rope scaling), Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5
  (megatron_po/models/hf/families.py; docs/checkpoints.md, "From and to Hugging Face"), both ways, streamed
  one tensor at a time (megatron_po/distributed/checkpoint_hf.py). import-hf writes our checkpoint of
  iteration 0 (it loads at any TP, PP, EP, ETP, CP and DP) and prints the flags that train from it
  (`--load OUT --finetune` and the model flags read from config.json, and `--tokenizer-type
  HuggingFaceTokenizer --tokenizer-model DIR` when the directory holds a tokenizer). export-hf writes the
  family that holds the model (or --model-type's), model.safetensors or shards of --max-shard-size with
  model.safetensors.index.json, and copies the run's Hugging Face tokenizer.
- export-te / import-te: the layers as Transformer Engine's `te.pytorch.TransformerLayer` state dicts (fused
  QKV, SwiGLU's fused [gate; up] fc1 per TP rank, empty `_extra_state`), one safetensors file per TP rank,
  plus te_config.json (this checkpoint's config and the TransformerLayer constructor arguments); and back.
  Checkpoints of --transformer-impl transformer_engine runs need no conversion: they hold the local layout.
- verify: every file of a checkpoint against its checksums.json (CKPT: a --save directory, its latest
  or --ckpt-step checkpoint, or one iter_N directory); exit 0, or 2 with one line naming the bad file.
Bad input ends with one `error:` line and exit code 2.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only

if not __package__:  # run as `python tools/checkpoint_convert.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json

import torch

from megatron_po.errors import UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    readers = {name: sub.add_parser(name, help=help_) for name, help_ in [
        ("consolidate", "one safetensors file + JSON config"),
        ("export-hf", "a Hugging Face transformers model directory")]}
    for p in readers.values():
        p.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
        p.add_argument("--ckpt-step", type=int, default=None, help="iteration to read (default: the latest)")
        p.add_argument("--out", required=True, help="output file (consolidate) or directory (export-hf; new or empty)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = readers["export-hf"]
    p.add_argument("--model-type", default=None, help="the HF family (config.json's model_type) to write, e.g. "
                   "mistral (default: the one an imported checkpoint came from, else the first that holds the model)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB, bytes); "
                   "more than one file: model-0000k-of-0000n.safetensors + model.safetensors.index.json")
    p.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer directory to copy into the "
                   "export (default: the run's --tokenizer-model with --tokenizer-type HuggingFaceTokenizer)")
    p = sub.add_parser("verify", help="check a checkpoint's files against its checksums.json")
    p.add_argument("ckpt", help="a --save directory (its latest checkpoint) or one iter_N directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to verify (default: the latest)")
    p = sub.add_parser("import-hf", help="a Hugging Face model directory into our checkpoint format")
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to write (iteration 0); new or empty")
    p.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer directory the printed flags "
                   "name (default: --hf, when it holds a tokenizer)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the run's padding of the vocabulary (in the printed flags; the checkpoint holds the HF "
                        "rows, padded by the run when it loads them)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("export-te", help="Transformer Engine te.pytorch.TransformerLayer state dicts, one per TP rank")
    p.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to read (default: the latest)")
    p.add_argument("--out", required=True, help="directory for tp_rank_<r>.safetensors and te_config.json")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP ranks to shard for")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("import-te", help="an export-te directory back into our checkpoint format")
    p.add_argument("--te", required=True, help="directory written by export-te")
    p.add_argument("--out", required=True, help="checkpoint directory to write (iteration 0)")
    return parser


def verify(args) -> None:
    """`verify CKPT`: one `path: N files OK` line, or UserError naming the first bad file."""
    from megatron_po.distributed.checkpoint_format import checkpoint_dir, find_checkpoint
    from megatron_po.distributed.checkpoint_integrity import read_manifest, verify_checkpoint
    path = args.ckpt
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such directory")
    if not os.path.exists(os.path.join(path, ".metadata")):  # a --save directory
        iteration = find_checkpoint(path, args.ckpt_step)
        if iteration is None:
            raise UserError(f"{path}: no checkpoint there")
        path = checkpoint_dir(path, iteration)
    problem = verify_checkpoint(path)
    if problem:
        raise UserError(problem)
    print(f"{path}: {len(read_manifest(path))} files match checksums.json")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli({"consolidate": consolidate, "export-hf": export_hf, "import-hf": import_hf,
                    "export-te": export_te, "import-te": import_te, "verify": verify}[args.command], args)


# --------------------------------------------------------------------------------------------------
# Reading our checkpoints
# --------------------------------------------------------------------------------------------------


def read_checkpoint(load: str, step: int | None, progress: bool = True):
    """(weights {global name: tensor}, info dict) of a checkpoint, in this process alone."""
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    weights, extra, iteration = read_full_checkpoint(load, step, "model.", progress=progress)
    config = extra.get("config")
    if not config or "model" not in config:
        raise UserError(f"--load {load}: the checkpoint carries no model config (not written by megatron_po?)")
    padded = weights["embedding.word_embeddings.weight"].shape[0]
    vocab = extra.get("vocab_size") or padded  # older checkpoints do not say: keep every row
    info = {"iteration": iteration, "vocab_size": vocab, "padded_vocab_size": padded, "config": config}
    return weights, info


def consolidate(args) -> None:
    from safetensors.torch import save_file
    weights, info = read_checkpoint(args.load, args.ckpt_step, not args.no_progress)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, args.out,
              metadata={"format": "pt", "iteration": str(info["iteration"])})
    config_path = config_path_of(args.out)
    with open(config_path, "w") as f:
        json.dump(info, f, indent=2)
    print(f"wrote {len(weights)} tensors of iteration {info['iteration']} to {args.out} (config: {config_path})")


def config_path_of(safetensors_path: str) -> str:
    """model.safetensors -> model.json (the JSON config written next to a consolidated file)."""
    root, ext = os.path.splitext(safetensors_path)
    return (root if ext == ".safetensors" else safetensors_path) + ".json"


# --------------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------------


def export_hf(args) -> None:
    from megatron_po.distributed.checkpoint_hf import export_hf as export
    export(args.load, args.out, args.ckpt_step, args.model_type, parse_size(args.max_shard_size),
           args.tokenizer_model, not args.no_progress)


def parse_size(text: str) -> int:
    """5GB, 500MB, 10KB (powers of ten, as Hugging Face's max_shard_size) or a number of bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "B")
    try:
        size = int(float(t[:len(t) - len(unit)] if t.endswith(unit) else t) * units[unit])
    except ValueError:
        size = 0
    if size <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size (e.g. 5GB, 500MB or bytes)")
    return size


def import_hf(args) -> None:
    from megatron_po.distributed.checkpoint_hf import import_hf as import_
    import_(args.hf, args.out, args.make_vocab_size_divisible_by, args.tokenizer_model, not args.no_progress)


def write_weights_checkpoint(out: str, weights: dict, cfg: dict, vocab: int, padded: int, source: str) -> None:
    """`weights` ({global name: full tensor}) as our checkpoint of iteration 0 under `out`, with the run
    config `cfg` (a Config dict) and the vocabulary sizes; training continues from it with --finetune."""
    from megatron_po.distributed.checkpoint_data import JsonEntry
    from megatron_po.distributed.checkpoint_format import checkpoint_dir
    from megatron_po.distributed.checkpoint_save import save_in_one_process
    extra = {"train_state": {"iteration": 0, "consumed_samples": 0}, "config": cfg, "vocab_size": vocab,
             "padded_vocab_size": padded, "imported_from": os.path.abspath(source)}
    state = {f"model.{k}": v for k, v in weights.items()}
    state["extra"] = JsonEntry(extra)
    os.makedirs(out, exist_ok=True)
    save_in_one_process(state, out)
    from megatron_po.distributed.checkpoint_hf import model_flags
    print(f"wrote {len(weights)} tensors to {checkpoint_dir(out, 0)}; train from it with\n"
          f"  --load {out} --finetune {model_flags(cfg['model'])}")


# --------------------------------------------------------------------------------------------------
# Transformer Engine's TransformerLayer layout (megatron_po/models/te_layout.py)
# --------------------------------------------------------------------------------------------------


def export_te(args) -> None:
    from safetensors.torch import save_file

    from megatron_po.models.te_layout import to_transformer_layer, transformer_layer_kwargs
    tp = args.tensor_model_parallel_size
    if tp < 1:
        raise UserError(f"--tensor-model-parallel-size must be >= 1 (got {tp})")
    weights, info = read_checkpoint(args.load, args.ckpt_step, not args.no_progress)
    model = info["config"]["model"]
    try:
        shards = to_transformer_layer(weights, model["swiglu"], tp)
    except (KeyError, ValueError) as e:  # not a GPT checkpoint; a vocabulary that does not split over tp
        raise UserError(f"export-te: {e.args[0]}") from None
    os.makedirs(args.out, exist_ok=True)
    for r, shard in enumerate(shards):
        save_file(shard, os.path.join(args.out, f"tp_rank_{r}.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "te_config.json"), "w") as f:
        json.dump(dict(info, tensor_model_parallel_size=tp, transformer_layer=transformer_layer_kwargs(model)), f,
                  indent=2)
    print(f"wrote te.pytorch.TransformerLayer state dicts of iteration {info['iteration']} for {tp} TP rank(s) "
          f"to {args.out} (constructor arguments: te_config.json)")


def import_te(args) -> None:
    from safetensors.torch import load_file

    from megatron_po.models.te_layout import from_transformer_layer
    config_file = os.path.join(args.te, "te_config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"--te {args.te}: no te_config.json there (not written by export-te?)")
    with open(config_file) as f:
        info = json.load(f)
    files = [os.path.join(args.te, f"tp_rank_{r}.safetensors") for r in range(info["tensor_model_parallel_size"])]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise UserError(f"--te {args.te}: {missing[0]} is missing")
    try:
        weights = from_transformer_layer([load_file(f) for f in files], info["config"]["model"]["swiglu"])
    except (KeyError, ValueError) as e:
        raise UserError(f"--te {args.te}: {e.args[0]}") from None
    write_weights_checkpoint(args.out, weights, info["config"], info["vocab_size"], info["padded_vocab_size"],
                             args.te)


if __name__ == "__main__":
    sys.exit(main())
