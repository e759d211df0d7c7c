"""A pure-PyTorch stand-in for the part of NVIDIA Transformer Engine's PyTorch API megatron_po uses, so the
`--transformer-impl transformer_engine` path runs in CPU tests. `install()` puts it in sys.modules as
`transformer_engine`, `transformer_engine.pytorch`, `transformer_engine.common.recipe`; `uninstall()`
removes it.

What it reproduces of Transformer Engine 2.20.2 (whose Python source it was written from):
- the constructor and forward keyword names of LayerNormLinear, Linear, LayerNormMLP, DotProductAttention,
  autocast and DelayedScaling / Format (an unknown keyword is a TypeError, as in TE);
- parameter names (`layer_norm_weight`, `weight`, `fc1_weight`, `<name>_weight` with parameters_split,
  the split parameters being views of one buffer), shapes under tensor parallelism (column: out/tp rows,
  row: in/tp columns) and the attributes TE sets on them (`tensor_model_parallel`, `partition_dim`,
  `partition_stride`, `sequence_parallel` on norm weights and row-parallel biases);
- the math of TE's modules, written with the same ops as megatron_po's local layers (so a TE model built
  from a local one must compute the same thing); GELU is the tanh approximation, swiglu silu(first half) *
  second half; zero_centered_gamma norms scale by 1 + weight; DotProductAttention forks the RNG tracker
  for dropout except under sequence parallelism, and with num_gqa_groups query head i reads key/value
  head i // (heads / groups);
- FP8 weight casting under `autocast(enabled=True)`: each GEMM multiplies by a cast of the weight (identity
  quantization) and the backward's input gradient multiplies by that cast, not by the live weight.
  is_first_microbatch=None casts into a fresh buffer; True re-casts into the module's cached workspace
  in place; False reuses the workspace as it is. A wrong is_first_microbatch gives wrong numbers here as
  it would on a GPU. Without FP8 the GEMMs use the live weights (F.linear), as TE does.

Every forward records (module class, is_first_microbatch) in CALLS; every autocast entry its arguments
in AUTOCASTS; with $FAKE_TRANSFORMER_ENGINE_TRACE set, every module construction appends its class name
to that file (forked ranks).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_po.tensor_parallel import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                         reduce_from_tensor_model_parallel_region,
                                         reduce_scatter_to_sequence_parallel_region)

TRACE_ENV = "FAKE_TRANSFORMER_ENGINE_TRACE"  # a file every module construction appends its class name to
CALLS: list[tuple[str, bool | None]] = []
AUTOCASTS: list[dict] = []
_FP8 = {"enabled": False}

# --------------------------------------------------------------------------------------------------
# transformer_engine.common.recipe
# --------------------------------------------------------------------------------------------------


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclasses.dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


# --------------------------------------------------------------------------------------------------
# transformer_engine.pytorch
# --------------------------------------------------------------------------------------------------


class autocast:  # noqa: N801  (TE's name)
    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None,
                 _graph: bool = False):
        self.args = dict(enabled=enabled, calibrating=calibrating, recipe=recipe,
                         amax_reduction_group=amax_reduction_group)

    def __enter__(self):
        AUTOCASTS.append(self.args)
        self.previous = _FP8["enabled"]
        _FP8["enabled"] = self.args["enabled"]
        return self

    def __exit__(self, *exc):
        _FP8["enabled"] = self.previous


def is_fp8_available(return_reason: bool = False):
    return (True, "") if return_reason else True


class _CastGemm(torch.autograd.Function):
    """x @ w_cast^T. The input gradient multiplies by `w_cast` as it is when the backward runs (TE keeps
    the forward's cast, or its cached workspace, for the backward); the weight gradient goes to `w`."""

    @staticmethod
    def forward(ctx, x, w, w_cast):
        ctx.save_for_backward(x)
        ctx.w_cast = w_cast  # not save_for_backward: TE's workspace may be re-cast in place meanwhile
        return F.linear(x, w_cast)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ ctx.w_cast, grad_w, None


class _NoopCat(torch.autograd.Function):
    """TE's noop_cat: parameters that are consecutive views of one buffer are joined as a view of it (the
    GEMM then reads the live weights, in the backward too); otherwise by an out-of-place torch.cat."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.sizes = [p.shape[0] for p in parts]
        first, end = parts[0], parts[0].data_ptr()
        for p in parts:
            if p.data_ptr() != end or p.stride() != first.stride() or p.dtype != first.dtype:
                return torch.cat(parts)
            end += p.numel() * p.element_size()
        return first.as_strided((sum(ctx.sizes), *first.shape[1:]), first.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.sizes)


class _Module(nn.Module):
    """What the fake modules share: TP settings, the FP8 weight cast and cache, the parameter attributes."""

    def _parallel(self, tp_group, tp_size, sequence_parallel, parallel_mode):
        if os.environ.get(TRACE_ENV):  # forked ranks tell the test which modules they built
            with open(os.environ[TRACE_ENV], "a") as f:
                f.write(type(self).__name__ + "\n")
        self.tp_size = tp_size if tp_group is None else dist.get_world_size(tp_group)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.parallel_mode = parallel_mode
        self._workspaces: dict[str, torch.Tensor] = {}

    def _linear(self, x, w, bias, cache_name, is_first_microbatch):
        if not _FP8["enabled"]:
            return F.linear(x, w, bias)
        if is_first_microbatch is None:
            cast = w.detach().clone()
        elif cache_name not in self._workspaces:
            cast = self._workspaces[cache_name] = w.detach().clone()
        else:
            cast = self._workspaces[cache_name]
            if is_first_microbatch:
                cast.copy_(w.detach())
        out = _CastGemm.apply(x, w, cast)
        return out if bias is None else out + bias

    def _enter(self, x):
        """Input of a column-parallel GEMM: gather the sequence (sequence parallel) or mark the copy."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(x)

    def _leave(self, partial):
        """Output of a row-parallel GEMM: sum the partial results (reduce-scatter under sequence parallel)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial)
        return reduce_from_tensor_model_parallel_region(partial)

    def _norm_params(self, features, normalization, device, zero_centered_gamma=False):
        assert normalization in ("LayerNorm", "RMSNorm"), normalization
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.layer_norm_weight = nn.Parameter((torch.zeros if zero_centered_gamma else torch.ones)(features,
                                                                                                 device=device))
        self.layer_norm_bias = nn.Parameter(torch.zeros(features, device=device)) if normalization == "LayerNorm" \
            else None
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel

    def _norm(self, x):
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def _register_split(self, kind, full, sizes, names, dim, init_method):
        """Parameters `<name>_<kind>` as views of the one buffer `full` (TE's parameters_split)."""
        start = 0
        for name, size in zip(names, sizes):
            p = nn.Parameter(full[start:start + size])
            start += size
            if init_method is not None:
                init_method(p)
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
            self.register_parameter(f"{name}_{kind}" if name else kind, p)


def _split(parameters_split, out_features, tp):
    if parameters_split is None:
        return [""], [out_features // tp]
    return [n.rstrip("_") for n in parameters_split], [s // tp for s in parameters_split.values()]


class LayerNormLinear(_Module):
    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, parameters_split=None,
                 zero_centered_gamma=False, device="cuda", name=None):
        super().__init__()
        assert parallel_mode in (None, "column"), "Normalization does not support tensor-parallel distribution."
        self._parallel(tp_group, tp_size, sequence_parallel, parallel_mode)
        self.eps = eps
        self._norm_params(in_features, normalization, device, zero_centered_gamma)
        tp = self.tp_size if parallel_mode == "column" else 1
        self.names, sizes = _split(parameters_split, out_features, tp)
        self._register_split("weight", torch.empty(sum(sizes), in_features, device=device), sizes, self.names, 0,
                             init_method)
        self.use_bias = bias
        if bias:
            self._register_split("bias", torch.zeros(sum(sizes), device=device), sizes, self.names, 0, None)

    def _joined(self, kind):
        parts = [getattr(self, f"{n}_{kind}" if n else kind) for n in self.names]
        return parts[0] if len(parts) == 1 else _NoopCat.apply(*parts)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        CALLS.append((type(self).__name__, is_first_microbatch))
        x = self._enter(self._norm(inp)) if self.parallel_mode == "column" else self._norm(inp)
        return self._linear(x, self._joined("weight"), self._joined("bias") if self.use_bias else None, "weight",
                            is_first_microbatch)


class Linear(_Module):
    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None, parameters_split=None,
                 device="cuda", name=None):
        super().__init__()
        assert parameters_split is None, "not used by megatron_po"
        self._parallel(tp_group, tp_size, sequence_parallel, parallel_mode)
        out_local = out_features // self.tp_size if parallel_mode == "column" else out_features
        in_local = in_features // self.tp_size if parallel_mode == "row" else in_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=device))
        if init_method is not None:
            init_method(self.weight)
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim, self.weight.partition_stride = (1 if parallel_mode == "row" else 0), 1
        self.bias = nn.Parameter(torch.zeros(out_local, device=device)) if bias else None
        if bias and parallel_mode == "row":
            self.bias.sequence_parallel = self.sequence_parallel
        elif bias:
            self.bias.tensor_model_parallel, self.bias.partition_dim, self.bias.partition_stride = True, 0, 1

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        CALLS.append((type(self).__name__, is_first_microbatch))
        if self.parallel_mode == "row":  # bias after the reduction (it is replicated)
            out = self._leave(self._linear(inp, self.weight, None, "weight", is_first_microbatch))
            return out if self.bias is None else out + self.bias
        x = self._enter(inp) if self.parallel_mode == "column" else inp
        return self._linear(x, self.weight, self.bias, "weight", is_first_microbatch)


class LayerNormMLP(_Module):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, sequence_parallel=False, return_bias=False,
                 get_rng_state_tracker=None, tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", activation="gelu", activation_params=None, output_layer_init_method=None,
                 fuse_wgrad_accumulation=False, params_dtype=None, return_layernorm_output=False,
                 return_layernorm_output_gathered=False, seq_length=None, micro_batch_size=None,
                 set_parallel_mode=False, zero_centered_gamma=False, device="cuda", name=None):
        super().__init__()
        assert activation in ("gelu", "swiglu"), activation
        self._parallel(tp_group, tp_size, sequence_parallel, "column" if set_parallel_mode else None)
        self.eps, self.activation, self.set_parallel_mode = eps, activation, set_parallel_mode
        self._norm_params(hidden_size, normalization, device, zero_centered_gamma)
        f = ffn_hidden_size // self.tp_size
        rows = 2 * f if activation == "swiglu" else f
        self.fc1_weight = nn.Parameter(torch.empty(rows, hidden_size, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, f, device=device))
        for p, init in ((self.fc1_weight, init_method), (self.fc2_weight, output_layer_init_method)):
            if init is not None:
                init(p)
        self.fc1_bias = nn.Parameter(torch.zeros(rows, device=device)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size, device=device)) if bias else None
        for p, dim in ((self.fc1_weight, 0), (self.fc2_weight, 1), (self.fc1_bias, 0)):
            if p is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        if bias and set_parallel_mode:
            self.fc2_bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp, is_first_microbatch=None):
        CALLS.append((type(self).__name__, is_first_microbatch))
        x = self._norm(inp)
        if self.set_parallel_mode:
            x = self._enter(x)
        h = self._linear(x, self.fc1_weight, self.fc1_bias, "fc1_weight", is_first_microbatch)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        out = self._linear(h, self.fc2_weight, None, "fc2_weight", is_first_microbatch)
        if self.set_parallel_mode:
            out = self._leave(out)
        return out if self.fc2_bias is None else out + self.fc2_bias


class DotProductAttention(_Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, bottom_right_diagonal=None,
                 softcap=0.0, sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None,
                 layer_number=None, attention_type="self", softmax_scale=None, name=None):
        super().__init__()
        assert qkv_format == "sbhd" and attn_mask_type in ("causal", "no_mask"), (qkv_format, attn_mask_type)
        self._parallel(tp_group, tp_size, sequence_parallel, None)
        self.attention_dropout, self.attn_mask_type = attention_dropout, attn_mask_type
        self.tracker = None
        if get_rng_state_tracker is not None and not sequence_parallel:  # TE: no fork under sequence parallel
            self.tracker = get_rng_state_tracker()
            self.tracker.get_states()  # TE reads the states at construction

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, **unused):
        CALLS.append((type(self).__name__, None))
        s, b, h, d = query_layer.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        if k.shape[1] != h:  # grouped-query attention: query head i reads key/value group i // (h / groups)
            k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // k.shape[1], dim=1)
        p = self.attention_dropout if self.training else 0.0
        causal = self.attn_mask_type == "causal"
        if p > 0.0 and self.tracker is not None:
            with self.tracker.fork():
                ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, h * d)


# --------------------------------------------------------------------------------------------------
# Installing it
# --------------------------------------------------------------------------------------------------

_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
          "transformer_engine.common.recipe")


def install() -> None:
    modules = {name: types.ModuleType(name) for name in _NAMES}
    te, pytorch, common, recipe = (modules[n] for n in _NAMES)
    for mod in (te, common):
        mod.__path__ = []  # packages
    te.pytorch, te.common, common.recipe = pytorch, common, recipe
    for name in ("LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention", "autocast", "is_fp8_available"):
        setattr(pytorch, name, globals()[name])
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    sys.modules.update(modules)
    CALLS.clear()
    AUTOCASTS.clear()


def uninstall() -> None:
    for name in _NAMES:
        sys.modules.pop(name, None)
