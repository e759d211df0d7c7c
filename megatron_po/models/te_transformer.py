"""Transformer layers on NVIDIA Transformer Engine (`--transformer-impl transformer_engine`), with FP8.

The only module that imports `transformer_engine`, and only when a TE layer or FP8 context is built: a
`--transformer-impl local` run never imports it. Written against Transformer Engine 2.20.2 (its Python
source was read; no GPU was available to run it), using these APIs of `transformer_engine.pytorch`:

  LayerNormLinear  norm + QKV projection (column parallel); SwiGLU's norm + [gate; up] projection, its
                   weight buffer split into two parameters with `parameters_split` (one GEMM)
  Linear           attention output and SwiGLU down projections (row parallel)
  LayerNormMLP     norm + GELU MLP, fused (activation="gelu": tanh approximation, as the local MLP)
  DotProductAttention  causal attention on [s, b, heads, head_dim] ("sbhd"); RoPE is applied before it
                   by the local `apply_rotary` (same math as the local layer)
  autocast (fp8_autocast before it was renamed), is_fp8_available
  transformer_engine.common.recipe.DelayedScaling, Format

Every module gets the TP group, the TP size and `sequence_parallel`, so TE does the column/row-parallel
communication (all-gather / reduce-scatter along the sequence under sequence parallelism) itself; the
layer keeps the local block's structure x + drop(attn(x)), x + drop(mlp(x)) with the residuals and hidden
dropout outside TE. TE sets the parameter attributes the rest of the code reads (`tensor_model_parallel`,
`partition_dim`, `sequence_parallel` on norm weights and row-parallel biases), and each TE parameter has a
local twin of the same shape and partition (te_layout.py), so DDP, the optimizers, the weight policies and
checkpoints treat both implementations alike. A TE layer starts from the weights of a local layer built
from the same seed, so `local` and `transformer_engine` runs start identical.

FP8 (`--fp8-format`): the layers of a model chunk run under one autocast with a DelayedScaling recipe; the
amaxes are reduced over the TP x DP ranks of the pipeline stage, the ranks that hold the same layers and
run the same sequence of micro-batches. Pipeline stages never reduce together: asynchronous stages run
different micro-batches at any moment.

Why `is_first_microbatch` is None under the asynchronous methods. In the forward TE casts each weight to
FP8 and keeps that cast for the backward's input gradient. With is_first_microbatch True/False a module
keeps the cast in ONE cached workspace, which a later forward re-quantizes in place (True) or reuses as is
(False). Asynchronous methods change the weights between micro-batches without a flush: PipeOptim and
SpecTrain predict weights before a pass and restore the live ones after it, PipeDream swaps stashed
versions in and out, 2BW swaps its two versions, and every method steps mid-stream. Reusing the cache
would run a forward on the weights of another version; re-quantizing it would change the weights that the
backward of a micro-batch still in flight multiplies by. With None every forward quantizes into a fresh
buffer that only its own backward keeps. Synchronous methods change the weights only at the optimizer
step, after the flush, so the cache is valid from the first forward after a step until the next step:
there (`enable_fp8_weight_cache`) is_first_microbatch is True exactly when an optimizer step happened since
the module's last cast (an optimizer step hook counts the weight versions).

What TE's FP8 backward means for the asynchronous methods: the input gradient of a TE layer multiplies by
the FP8 cast made in the forward, not by the weights live at the backward (without FP8 TE uses the live
weights, like the local layers). PipeDream and 2BW are unaffected (their backward uses the forward's
version anyway); PipeOptim's input gradients use the quantized prediction Ŵ instead of the live W, and
SpecTrain's the forward's prediction; weight gradients never involve the weights. See docs/recomputation.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import (ModelConfig, ffn_hidden_size, fp8_backend, kv_channels, num_query_groups,
                                 recompute_granularity, recomputes_core_attention)
from megatron_po.config_check import Check, Ctx, Rule, raised
from megatron_po.errors import ConfigError
from megatron_po.models.recompute import maybe_recompute
from megatron_po.models.te_layout import layer_name_pairs
from megatron_po.models.transformer import apply_rotary, dropout, split_qkv
from megatron_po.tensor_parallel import get_rng_tracker

# --------------------------------------------------------------------------------------------------
# Import guard, FP8 recipe and autocast
# --------------------------------------------------------------------------------------------------


def _gpu_visible() -> bool:
    return torch.cuda.is_available()


_HINT = " (docs/transformer_engine.md; --transformer-impl local runs without it)"


def import_te():
    """(transformer_engine.pytorch, transformer_engine.common.recipe), or one ConfigError line saying why
    Transformer Engine cannot be used. Without CUDA libraries TE's import raises RuntimeError (libraries
    not found), OSError (a shared object that fails to load) or AssertionError (package version checks),
    not only ImportError."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except (ImportError, RuntimeError, OSError, AssertionError) as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"Transformer Engine requested but not usable: {reason}{_HINT}") from None
    if not _gpu_visible():
        raise ConfigError(f"Transformer Engine requested but not usable: no CUDA device is visible{_HINT}")
    return te, recipe


def te_attention_backend_env(backend: str) -> dict[str, str]:
    """Transformer Engine's attention kernel choice for --attention-backend, as Megatron-LM sets it: the
    NVTE_*_ATTN switches DotProductAttention reads (auto: TE decides; local: TE's unfused kernel)."""
    on = {"flash": "NVTE_FLASH_ATTN", "fused": "NVTE_FUSED_ATTN", "unfused": "NVTE_UNFUSED_ATTN",
          "local": "NVTE_UNFUSED_ATTN"}.get(backend)
    if on is None:
        return {}
    return {name: "1" if name == on else "0" for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")}


def fp8_recipe(cfg: ModelConfig, recipe_module):
    """The DelayedScaling recipe of the --fp8-* flags (Megatron-LM's mapping)."""
    formats = {"hybrid": recipe_module.Format.HYBRID, "e4m3": recipe_module.Format.E4M3}
    return recipe_module.DelayedScaling(margin=cfg.fp8_margin, fp8_format=formats[cfg.fp8_format],
                                        amax_history_len=cfg.fp8_amax_history_len,
                                        amax_compute_algo=cfg.fp8_amax_compute_algo)


def autocast(te, recipe, group):
    """TE's FP8 autocast: `autocast` since TE 2.x renamed it, `fp8_autocast` (deprecated) before."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


class FP8Autocast:
    """Calling it gives the FP8 autocast context for the transformer layers of one model chunk."""

    def __init__(self, cfg: ModelConfig):
        te, recipe_module = import_te()
        if hasattr(te, "is_fp8_available"):
            ok, reason = te.is_fp8_available(return_reason=True)
        else:  # TE before is_fp8_available
            from transformer_engine.pytorch.fp8 import check_fp8_support
            ok, reason = check_fp8_support()
        if not ok:
            raise ConfigError(f"--fp8-format {cfg.fp8_format} needs FP8-capable GPUs (compute capability "
                              f">= 8.9): {reason}")
        self.te, self.recipe = te, fp8_recipe(cfg, recipe_module)

    def __call__(self):
        # The TP x DP ranks of this pipeline stage (one process: no reduction).
        group = ps.get_tensor_and_data_parallel_group() if ps.model_parallel_is_initialized() else None
        return autocast(self.te, self.recipe, group)


# --------------------------------------------------------------------------------------------------
# is_first_microbatch: cached FP8 weight casts only where the weights stay put (see the module docstring)
# --------------------------------------------------------------------------------------------------

_weight_version = 0  # optimizer steps taken in this process since the hook was registered
_step_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _weight_version
    _weight_version += 1


class FP8WeightCache:
    """The `is_first_microbatch` a TE layer passes to its modules on each forward: None (no cache; the
    default, and always under the asynchronous methods), or with the cache enabled (synchronous methods)
    True on the first forward after an optimizer step and False until the next step."""

    def __init__(self):
        self.enabled = False
        self.cast_version: int | None = None  # the weight version of the cached casts

    def is_first_microbatch(self) -> bool | None:
        if not self.enabled:
            return None
        first = self.cast_version != _weight_version
        self.cast_version = _weight_version
        return first


def enable_fp8_weight_cache(chunks) -> None:
    """Let the TE layers of `chunks` cache their FP8 weight casts between optimizer steps. Only for
    synchronous training, where weights change at optimizer steps alone and only after a flush."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _step_hook = register_optimizer_step_post_hook(_count_step)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TETransformerLayer):
                module.fp8_weights.enabled = True


# --------------------------------------------------------------------------------------------------
# Config rules (rows of config_rules.RULES)
# --------------------------------------------------------------------------------------------------


def _fp8(c: Ctx) -> bool:
    return fp8_backend(c.m) == "te"


def _te(c: Ctx) -> bool:
    return c.m.transformer_impl == "transformer_engine"


def _fp8_tokens(c: Ctx) -> tuple[int, int]:
    """(tokens of a micro-batch per rank, sequence per rank)."""
    seq = c.m.seq_length // c.tp if c.p.sequence_parallel else c.m.seq_length
    return seq * c.t.micro_batch_size, seq


def _te_error(c: Ctx) -> str | None:
    """Whether TE can be imported: one line on every rank before any process group exists, instead of a
    failure inside model build."""
    return raised(import_te)


# --transformer-impl and --fp8-* with --fp8-backend te: the flag rules and FP8's shape rules come before the import,
# so they hold without TE. config_rules.RULES checks them after the Megatron switches and models/fp8.py's FP8_RULES
# (which choose the backend and its recipe).
TE_RULES = [
    Rule("fp8-amax-history>=1", lambda c: c.m.fp8_amax_history_len >= 1,
         lambda c: f"--fp8-amax-history-len must be >= 1 (got {c.m.fp8_amax_history_len})", when=_fp8),
    Rule("fp8-margin>=0", lambda c: c.m.fp8_margin >= 0, lambda c: f"--fp8-margin must be >= 0 (got {c.m.fp8_margin})",
         when=_fp8),
    # TE's FP8 GEMMs need the last dim of every operand divisible by 16 and the others' product by 8.
    Rule("fp8-sizes-by-16", lambda c: (c.m.hidden_size % 16 == 0 and (c.m.hidden_size // c.tp) % 16 == 0
                                       and (ffn_hidden_size(c.m) // c.tp) % 16 == 0),
         lambda c: f"--fp8-format needs --hidden-size ({c.m.hidden_size}) and the hidden and MLP sizes per TP rank "
                   f"({c.m.hidden_size // c.tp}, {ffn_hidden_size(c.m) // c.tp}) divisible by 16", when=_fp8),
    Rule("fp8-tokens-by-8", lambda c: _fp8_tokens(c)[0] % 8 == 0,
         lambda c: "--fp8-format needs the tokens of a micro-batch per rank ({}: sequence {} x --micro-batch-size {}) "
                   "divisible by 8".format(*_fp8_tokens(c), c.t.micro_batch_size), when=_fp8),
    Rule("fp8-no-full-recompute", lambda c: recompute_granularity(c.m) != "full",
         "--recompute-granularity full with --fp8-format is not supported: the recomputation runs in the backward, "
         "outside the FP8 autocast (Transformer Engine's own checkpoint would be needed); use "
         "--recompute-granularity selective", when=_fp8),
    Rule("te-no-qk-layernorm", lambda c: not c.m.qk_layernorm,
         "--qk-layernorm is not wired into the Transformer Engine layer: use --transformer-impl local", when=_te),
    Rule("te-gpt-only", lambda c: c.workload == "gpt",
         "--transformer-impl transformer_engine is wired for GPT (pretrain_gpt.py) only so far; the NMT model runs "
         "with --transformer-impl local", when=_te),
    Rule("te-no-torch-compile", lambda c: not c.m.torch_compile,
         "--torch-compile compiles the local transformer layers; Transformer Engine's layers bring their own fused "
         "kernels (and their autograd functions are not traced by torch.compile): use one or the other", when=_te),
    Check("te-importable", _te_error, when=_te),
]


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------


def _no_init(weight: torch.Tensor) -> None:
    """TE's weight init is skipped: the layer copies a local layer's weights right after construction."""


def _parallel_kwargs(sequence_parallel: bool) -> dict:
    """What every TE linear module needs to know about tensor parallelism and where to allocate."""
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
    return dict(sequence_parallel=sequence_parallel, tp_group=group, tp_size=tp, device=ps.get_device())


class TESelfAttention(nn.Module):
    """Norm + QKV (te.LayerNormLinear), RoPE, te.DotProductAttention, output projection (te.Linear).
    `causal=False` (no mask) is the hook for an encoder; a padding mask would be passed to
    `core_attention` as TE's `attention_mask` (True = masked out, the opposite of SDPA's boolean mask)."""

    def __init__(self, te, cfg: ModelConfig, sequence_parallel: bool, causal: bool = True):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        h, nh, groups, self.head_dim = cfg.hidden_size, cfg.num_attention_heads, num_query_groups(cfg), kv_channels(cfg)
        self.num_local_groups, self.heads_per_group = groups // tp, nh // groups
        parallel = _parallel_kwargs(sequence_parallel)
        os.environ.update(te_attention_backend_env(cfg.attention_backend))
        self.layernorm_qkv = te.LayerNormLinear(h, (nh + 2 * groups) * self.head_dim, eps=cfg.norm_epsilon,
                                                bias=cfg.add_bias_linear, normalization=cfg.normalization,
                                                zero_centered_gamma=cfg.apply_layernorm_1p, parallel_mode="column",
                                                init_method=_no_init, **parallel)
        self.core_attention = te.DotProductAttention(
            nh, self.head_dim, num_gqa_groups=groups, attention_dropout=cfg.attention_dropout, qkv_format="sbhd",
            attn_mask_type="causal" if causal else "no_mask", sequence_parallel=sequence_parallel,
            tp_size=tp, tp_group=parallel["tp_group"], get_rng_state_tracker=get_rng_tracker)
        self.proj = te.Linear(nh * self.head_dim, h, bias=cfg.add_bias_linear, parallel_mode="row",
                              init_method=_no_init, **parallel)
        self.recompute_core = recomputes_core_attention(cfg)

    def forward(self, x: torch.Tensor, rotary=None, is_first_microbatch: bool | None = None) -> torch.Tensor:
        qkv = self.layernorm_qkv(x, is_first_microbatch=is_first_microbatch)  # [s, b, (nh + 2g) hd/tp], whole sequence
        q, k, v = split_qkv(qkv, self.num_local_groups, self.heads_per_group, self.head_dim)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        ctx = maybe_recompute(self.recompute_core, self.core_attention, q, k, v)  # [s, b, h/tp]
        return self.proj(ctx, is_first_microbatch=is_first_microbatch)


class TESwiGLUMLP(nn.Module):
    """Norm + [gate; up] projection in one te.LayerNormLinear GEMM whose weight is split into the gate and
    up parameters (so each is a column-parallel shard of the local twin), silu(gate) * up, te.Linear down."""

    def __init__(self, te, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size(cfg)
        parallel = _parallel_kwargs(sequence_parallel)
        self.fc1 = te.LayerNormLinear(h, 2 * f, eps=cfg.norm_epsilon, bias=cfg.add_bias_linear,
                                      normalization=cfg.normalization, zero_centered_gamma=cfg.apply_layernorm_1p,
                                      parallel_mode="column",
                                      parameters_split={"gate": f, "up": f}, init_method=_no_init, **parallel)
        self.fc2 = te.Linear(f, h, bias=cfg.add_bias_linear, parallel_mode="row", init_method=_no_init, **parallel)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        gate, up = self.fc1(x, is_first_microbatch=is_first_microbatch).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up, is_first_microbatch=is_first_microbatch)

    def _apply(self, fn, *args, **kwargs):
        """After .to()/dtype casts, which give every parameter its own tensor, make gate and up consecutive
        views of one buffer again. TE joins them into one GEMM weight as a view of that buffer only then;
        otherwise it copies them (torch.cat) every forward, and the backward would multiply by that copy,
        not by the live weights (which the weight policies swap between passes)."""
        out = super()._apply(fn, *args, **kwargs)
        with torch.no_grad():
            for kind in ("weight", "bias"):
                gate, up = getattr(self.fc1, f"gate_{kind}", None), getattr(self.fc1, f"up_{kind}", None)
                if gate is None or up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size():
                    continue
                buffer = torch.cat([gate.data, up.data])
                gate.data, up.data = buffer[:gate.shape[0]], buffer[gate.shape[0]:]
        return out


class TETransformerLayer(nn.Module):
    """The local pre-norm block on TE modules: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))), the
    norms fused into the following projections. Starts from `initial`'s weights (a local TransformerLayer)."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, initial: nn.Module):
        super().__init__()
        te, _ = import_te()
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        self.swiglu = cfg.swiglu
        self.self_attention = TESelfAttention(te, cfg, sequence_parallel)
        if cfg.swiglu:
            self.layernorm_mlp = TESwiGLUMLP(te, cfg, sequence_parallel)
        else:
            parallel = _parallel_kwargs(sequence_parallel)
            self.layernorm_mlp = te.LayerNormMLP(cfg.hidden_size, ffn_hidden_size(cfg), eps=cfg.norm_epsilon,
                                                 bias=cfg.add_bias_linear, normalization=cfg.normalization,
                                                 zero_centered_gamma=cfg.apply_layernorm_1p,
                                                 activation="gelu", set_parallel_mode=True, init_method=_no_init,
                                                 output_layer_init_method=_no_init, **parallel)
        self.fp8_weights = FP8WeightCache()
        self.load_local_weights(initial.state_dict())

    @torch.no_grad()
    def load_local_weights(self, local: dict) -> None:
        """Copy a local layer's state dict in (names per te_layout; shapes and partitions are the same)."""
        names = dict(layer_name_pairs(self.swiglu))
        params = dict(self.named_parameters())
        state = {names.get(k, k): v for k, v in local.items()}
        if set(state) != set(params):
            raise RuntimeError(f"local and Transformer Engine layer parameters do not match: only local "
                               f"{sorted(set(state) - set(params))}, only TE {sorted(set(params) - set(state))}")
        for name, p in params.items():
            if state[name].shape != p.shape:
                raise RuntimeError(f"{name}: local shape {tuple(state[name].shape)}, TE shape {tuple(p.shape)}")
            p.copy_(state[name])

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        first = self.fp8_weights.is_first_microbatch()
        drop = lambda t: dropout(t, self.hidden_dropout, self.training, self.sequence_parallel)  # noqa: E731
        x = x + drop(self.self_attention(x, rotary, first))
        x = x + drop(self.layernorm_mlp(x, is_first_microbatch=first))
        return x
