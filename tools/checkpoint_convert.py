"""Convert megatron_po checkpoints: consolidate to one safetensors file, export to / import from Hugging Face.

    python tools/checkpoint_convert.py consolidate --load ckpt [--ckpt-step N] --out model.safetensors
    python tools/checkpoint_convert.py export-hf   --load ckpt [--ckpt-step N] --out hf_dir
    python tools/checkpoint_convert.py import-hf   --hf hf_dir --out ckpt [--make-vocab-size-divisible-by 128]
    python tools/checkpoint_convert.py export-te   --load ckpt [--ckpt-step N] --out te_dir [--tensor-model-parallel-size 2]
    python tools/checkpoint_convert.py import-te   --te te_dir --out ckpt
    python tools/checkpoint_convert.py verify      CKPT [--ckpt-step N]

All of them run in ONE process without torch.distributed, whatever TP/PP/DP layout wrote the checkpoint:
DCP stores global tensors, so each is assembled from every rank's shards on read.

- consolidate: every parameter under its global name (`layers.3.attention.qkv.weight`, ...) plus a JSON
  next to it (model.safetensors -> model.json) with the run's config, iteration and vocabulary sizes.
- export-hf: `GPT2LMHeadModel` (LayerNorm + GELU + learned positions) or `LlamaForCausalLM` (RMSNorm +
  SwiGLU + RoPE; grouped-query attention as `num_key_value_heads`, --kv-channels as `head_dim`) as
  config.json + model.safetensors, loadable with `AutoModelForCausalLM.from_pretrained`
  (see megatron_po/models/hf_export.py for the layout mapping). A mixture of experts (--num-experts) exports to
  `MixtralForCausalLM`, `Qwen2MoeForCausalLM` or `Qwen3MoeForCausalLM`, whichever can hold it
  (megatron_po/models/hf_export_moe.py), experts per expert as the Hub's checkpoints store them. The tokenizer
  is not converted.
- import-hf: a GPT-2 or Llama HF checkpoint (safetensors) as our checkpoint at iteration 0; train from
  it with `--load OUT --finetune` and the model flags the tool prints.
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
import dataclasses
import json

import torch

from megatron_po.errors import UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("consolidate", "one safetensors file + JSON config"),
                        ("export-hf", "a Hugging Face transformers model directory")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
        p.add_argument("--ckpt-step", type=int, default=None, help="iteration to read (default: the latest)")
        p.add_argument("--out", required=True, help="output file (consolidate) or directory (export-hf)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("verify", help="check a checkpoint's files against its checksums.json")
    p.add_argument("ckpt", help="a --save directory (its latest checkpoint) or one iter_N directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to verify (default: the latest)")
    p = sub.add_parser("import-hf", help="a Hugging Face GPT-2 / Llama directory into our checkpoint format")
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to write (iteration 0)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary like the training run will (x --tensor-model-parallel-size)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP size of the run that loads it (only the vocabulary padding depends on it)")
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
    from safetensors.torch import save_file

    from megatron_po.models import hf_export, hf_export_moe
    weights, info = read_checkpoint(args.load, args.ckpt_step, not args.no_progress)
    model = info["config"]["model"]
    if model.get("num_experts") is not None:  # a mixture of experts: Mixtral, Qwen2-MoE or Qwen3-MoE
        architecture, hf_config, to_hf = (hf_export_moe.moe_architecture, hf_export_moe.moe_hf_config,
                                          hf_export_moe.moe_to_hf)
    else:
        architecture, hf_config, to_hf = hf_export.hf_architecture, hf_export.hf_config, hf_export.to_hf
    architecture(model)  # refuse unsupported combinations before writing anything
    config = hf_config(model, info["vocab_size"])
    state = to_hf(weights, model, info["vocab_size"])
    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    left_out = ""
    if model.get("mtp_num_layers"):  # the HF classes have no MTP: the export computes the LM alone
        left_out = f"; its {model['mtp_num_layers']} multi-token prediction depth(s) (mtp.*) left out"
    print(f"wrote {config.architectures[0]} (vocabulary {info['vocab_size']}, iteration {info['iteration']}) "
          f"to {args.out}{left_out}")


def read_hf(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of an HF model directory (single or sharded safetensors)."""
    from safetensors.torch import load_file
    config_file = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"--hf {hf_dir}: no config.json there")
    with open(config_file) as f:
        config = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"--hf {hf_dir}: no model.safetensors (or model.safetensors.index.json); "
                        "only safetensors checkpoints are read")
    state = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(hf_dir, name)))
        except Exception as e:
            raise UserError(f"--hf {hf_dir}: cannot read {name}: {e}") from None
    return config, state


def import_hf(args) -> None:
    from megatron_po.config import Config, ModelConfig
    from megatron_po.models.hf_export import from_hf, model_config_from_hf
    from megatron_po.tensor_parallel import pad_vocab_size
    hf, hf_state = read_hf(args.hf)
    model = dataclasses.asdict(ModelConfig(**model_config_from_hf(hf)))
    model["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
    vocab = hf["vocab_size"]
    padded = pad_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    weights = from_hf(hf_state, model, padded)
    cfg = Config().to_dict()
    cfg["model"] = model
    cfg["data"]["vocab_size"] = vocab
    write_weights_checkpoint(args.out, weights, cfg, vocab, padded, args.hf)


def write_weights_checkpoint(out: str, weights: dict, cfg: dict, vocab: int, padded: int, source: str) -> None:
    """`weights` ({global name: full tensor}) as our checkpoint of iteration 0 under `out`, with the run
    config `cfg` (a Config dict) and the vocabulary sizes; training continues from it with --finetune."""
    from megatron_po.distributed.checkpoint_data import JsonEntry
    from megatron_po.distributed.checkpoint_dcp import dcp_save
    from megatron_po.distributed.checkpoint_format import checkpoint_dir
    from megatron_po.distributed.checkpoint_save import publish
    from megatron_po.distributed.checkpoint_integrity import checksum_checkpoint
    extra = {"train_state": {"iteration": 0, "consumed_samples": 0}, "config": cfg, "vocab_size": vocab,
             "padded_vocab_size": padded, "imported_from": os.path.abspath(source)}
    state = {f"model.{k}": v for k, v in weights.items()}
    state["extra"] = JsonEntry(extra)
    os.makedirs(out, exist_ok=True)
    partial = checkpoint_dir(out, 0) + ".partial"
    import warnings
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp_save(state, partial)
    checksum_checkpoint(partial)  # checksums.json, verified when training loads it
    publish(out, 0)
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


def model_flags(model: dict) -> str:
    """The command-line flags that build `model` (non-default values only)."""
    from megatron_po.config import ModelConfig
    default = dataclasses.asdict(ModelConfig())
    flags = []
    for k, v in model.items():
        if v == default[k]:
            continue
        name = k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(f"--{name}" if v else f"--no-{name}")
        else:
            flags.append(f"--{name} {v}")
    return " ".join(flags)


if __name__ == "__main__":
    sys.exit(main())
