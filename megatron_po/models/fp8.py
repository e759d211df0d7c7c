"""FP8 training behind Megatron's flags: which backend runs it, its config rules, where its GEMMs go.

`--fp8-format {hybrid,e4m3}` turns FP8 on; `--fp8-backend` picks who runs it (config.fp8_backend): Transformer
Engine's layers (`te`, models/te_transformer.py, its DelayedScaling recipe) or torchao's float8 GEMMs in the
local layers (`torchao`, tensor_parallel/fp8.py, recipes tensorwise and rowwise); `auto` is te with
--transformer-impl transformer_engine, else torchao. With torchao, `enable_fp8` gives the linears Megatron runs
in FP8 (QKV, attention projection, MLP fc1 / gate / fc2) an FP8 GEMM; the embedding and the output layer stay
in the model's dtype, as Megatron's default. Without --fp8-format nothing here runs and torchao is never
imported: the model is the same modules with the same numerics.

On a CPU torchao emulates the FP8 GEMMs (the FP8 roundings, dequantized into fp32 matmuls): slow, but every
path runs, and the tests run it.
"""

from __future__ import annotations

import functools

import torch

from megatron_po.config import ModelConfig, ffn_hidden_size, fp8_backend, fp8_recipe, kv_channels, num_query_groups
from megatron_po.config_check import Check, Ctx, Rule
from megatron_po.models.mla import mla_sizes

BACKEND_RECIPES = {"te": ("delayed",), "torchao": ("tensorwise", "rowwise")}
BACKEND_NAMES = {"te": "Transformer Engine", "torchao": "torchao"}
FORMATS = {"hybrid": "E4M3 forward, E5M2 gradients", "e4m3": "E4M3 forward and gradients"}
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


# --------------------------------------------------------------------------------------------------
# The device: FP8 GEMMs on a GPU of compute capability >= 8.9, emulated on a CPU
# --------------------------------------------------------------------------------------------------


def _cuda_capability() -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of this rank's GPU, or None on a CPU run (a test fakes it here)."""
    from megatron_po.parallel_state import get_device  # the one place that picks the device
    device = get_device()
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


def emulated() -> bool:
    """FP8 emulated: no GPU, so torchao runs the FP8 roundings through fp32 matmuls."""
    return _cuda_capability() is None


def _capability_error(c: Ctx) -> str | None:
    gpu = _cuda_capability()
    if gpu is None or tuple(gpu[1]) >= FP8_MIN_CAPABILITY:
        return None
    name, (major, minor) = gpu
    return (f"--fp8-format {c.m.fp8_format} needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer) for its "
            f"FP8 GEMMs; this one ({name}) is {major}.{minor}: drop --fp8-format")


# --------------------------------------------------------------------------------------------------
# Config rules (rows of config_rules.RULES, before Transformer Engine's)
# --------------------------------------------------------------------------------------------------


def _fp8(c: Ctx) -> bool:
    return c.m.fp8_format is not None


def _torchao(c: Ctx) -> bool:
    return fp8_backend(c.m) == "torchao"


def gemm_dims(m: ModelConfig, tp: int, micro_batch_size: int, sequence_parallel: bool = False) -> dict[str, int]:
    """The dimensions of the FP8 GEMMs on one TP rank, by what they are. Each is an inner or outer dimension of
    one of a linear's three GEMMs, which `torch._scaled_mm` takes only in multiples of 16. The tokens of a
    micro-batch are the inner dimension of the weight-gradient GEMMs: the full sequence even under sequence
    parallelism, whose linears multiply the gathered sequence, except multi-latent attention's down-projections,
    which multiply this rank's tokens."""
    tokens = {"tokens per micro-batch (--seq-length x --micro-batch-size)": m.seq_length * micro_batch_size}
    mlp = {"MLP size per TP rank": ffn_hidden_size(m) // tp}
    if m.multi_latent_attention:
        z, nh = mla_sizes(m), m.num_attention_heads
        latents = {} if z.q_lora_rank is None else {"--q-lora-rank": z.q_lora_rank}
        latents.update({"--kv-lora-rank": z.kv_lora_rank,
                        "--kv-lora-rank + --qk-pos-emb-head-dim": z.kv_lora_rank + z.qk_pos_emb_head_dim})
        heads = {"query outputs per TP rank": nh * z.q_head_dim // tp,
                 "key/value up-projection outputs per TP rank": nh * (z.qk_head_dim + z.v_head_dim) // tp,
                 "attention-projection inputs per TP rank": nh * z.v_head_dim // tp}
        if sequence_parallel:
            tokens["tokens per micro-batch per TP rank (sequence parallel)"] = m.seq_length * micro_batch_size // tp
        return {"--hidden-size": m.hidden_size, **latents, **heads, **mlp, **tokens}
    nh, groups, hd = m.num_attention_heads, num_query_groups(m), kv_channels(m)
    return {"--hidden-size": m.hidden_size, "QKV outputs per TP rank": (nh + 2 * groups) * hd // tp,
            "attention-projection inputs per TP rank": nh * hd // tp, **mlp, **tokens}


def _bad_dims(c: Ctx) -> str:
    dims = gemm_dims(c.m, c.tp, c.t.micro_batch_size, c.p.sequence_parallel)
    return ", ".join(f"{name} {n}" for name, n in dims.items() if n % 16)


def _recipe_message(c: Ctx) -> str:
    backend = fp8_backend(c.m)
    return (f"--fp8-recipe {c.m.fp8_recipe} is not available with --fp8-backend {backend} "
            f"({BACKEND_NAMES[backend]} runs {', '.join(BACKEND_RECIPES[backend])} here)")


FP8_RULES = [
    Rule("fp8-flags-need-format", lambda c: c.m.fp8_recipe is None and c.m.fp8_backend == "auto",
         lambda c: f"{'--fp8-recipe' if c.m.fp8_recipe is not None else '--fp8-backend'} applies to FP8 training: add "
                   f"--fp8-format hybrid (or e4m3)", when=lambda c: not _fp8(c)),
    Rule("fp8-not-fp16", lambda c: not c.pr.fp16,
         lambda c: f"--fp8-format {c.m.fp8_format} with --fp16: FP8 training here keeps bf16 (or fp32) weights and "
                   f"activations around its FP8 GEMMs; use --bf16", when=_fp8),
    Rule("fp8-te-needs-te-impl", lambda c: c.m.transformer_impl == "transformer_engine",
         "--fp8-backend te runs FP8 inside Transformer Engine's layers: add --transformer-impl transformer_engine, "
         "or use --fp8-backend torchao (FP8 GEMMs in the local layers)", when=lambda c: fp8_backend(c.m) == "te"),
    Rule("fp8-torchao-needs-local", lambda c: c.m.transformer_impl == "local",
         "--fp8-backend torchao runs FP8 in the local layers' GEMMs: it needs --transformer-impl local (Transformer "
         "Engine's layers run their own FP8: --fp8-backend te)", when=_torchao),
    Rule("fp8-recipe-vs-backend", lambda c: fp8_recipe(c.m) in BACKEND_RECIPES[fp8_backend(c.m)], _recipe_message,
         when=_fp8),
    Rule("fp8-rowwise-e4m3", lambda c: c.m.fp8_format == "e4m3",
         "--fp8-recipe rowwise (torchao's) casts gradients to E4M3 as well: use --fp8-format e4m3 with it",
         when=lambda c: _torchao(c) and fp8_recipe(c.m) == "rowwise"),
    Rule("fp8-torchao-gpt-only", lambda c: c.workload == "gpt",
         "--fp8-format with --fp8-backend torchao is wired for GPT (pretrain_gpt.py) only: the NMT batches' token "
         "counts vary, and FP8 GEMMs take multiples of 16 alone", when=_torchao),
    Rule("fp8-dims-by-16", lambda c: not _bad_dims(c),
         lambda c: f"--fp8-format needs every FP8 GEMM dimension divisible by 16; not: {_bad_dims(c)}", when=_torchao),
    Check("fp8-gpu-capability", _capability_error, when=_torchao),  # Transformer Engine checks its own (FP8Autocast)
]


# --------------------------------------------------------------------------------------------------
# The model: which linears run their GEMMs in FP8
# --------------------------------------------------------------------------------------------------


@functools.cache
def _gemm(recipe: str, fp8_format: str, emulate: bool):
    from megatron_po.tensor_parallel.fp8 import FP8Gemm, float8_config  # imports torchao
    return FP8Gemm(float8_config(recipe, fp8_format, emulate))


def uses_torchao(cfg: ModelConfig) -> bool:
    return fp8_backend(cfg) == "torchao"


def enable_fp8(layer: torch.nn.Module, cfg: ModelConfig) -> None:
    """Give the linears of a local TransformerLayer that Megatron runs in FP8 (QKV, attention projection, MLP; under
    multi-latent attention its down- and up-projections) the FP8 GEMM of --fp8-recipe / --fp8-format. Their
    parameters, names and initialization stay as they are."""
    gemm = _gemm(fp8_recipe(cfg), cfg.fp8_format, emulated())
    attention, mlp = layer.attention, layer.mlp
    if hasattr(mlp, "experts"):  # a mixture of experts: its shared experts in FP8, the routed ones not (fp8_summary)
        mlp = mlp.shared_experts
    mlp_linears = (mlp.fc1, mlp.fc1_gate, mlp.fc2) if mlp is not None else ()
    attention_linears = attention.linears() if hasattr(attention, "linears") else (attention.qkv, attention.proj)
    for linear in (*attention_linears, *mlp_linears):
        if linear is not None:
            linear.fp8 = gemm


def fp8_summary(cfg: ModelConfig) -> str | None:
    """The start-up line saying which backend and recipe run FP8 (None: FP8 off)."""
    backend = fp8_backend(cfg)
    if backend is None:
        return None
    line = (f"> FP8: {BACKEND_NAMES[backend]}, recipe {fp8_recipe(cfg)}, format {cfg.fp8_format} "
            f"({FORMATS[cfg.fp8_format]}), in the QKV, attention-projection and MLP GEMMs; embedding and output "
            f"layer unchanged")
    if backend == "torchao" and emulated():
        line += "; emulated on the CPU (FP8 roundings through fp32 matmuls: slow)"
    if cfg.multi_latent_attention:
        line += "; MLA: its down-projections, up-projections and output projection in FP8, the latent norms not"
    if cfg.num_experts is not None:
        line += ("; MoE: the shared experts' GEMMs in FP8, the routed experts' and the router's stay in bf16 (FP8 "
                 "GEMMs take token counts in multiples of 16, and torchao's FP8 grouped GEMM is not wired here)")
    return line
