"""FP8 GEMMs of the column- and row-parallel linears, on torchao's float8 training (--fp8-backend torchao).

With FP8 on (models/fp8.py marks the transformer layers' linears) a linear's local GEMM runs in FP8 and
everything around it stays as it was: the tensor-parallel communication (all-gather / reduce-scatter under
sequence parallelism) moves bf16 activations, the weights are stored, stepped, predicted and checkpointed in
high precision, and each GEMM casts its operands at the matmul. The casts are torchao's
(`hp_tensor_to_float8_dynamic`: dynamic scaling from the amax of the tensor itself, per tensor or per row;
no amax history, so there is no FP8 state to checkpoint) and the GEMMs are `torch.mm` on its
`Float8TrainingTensor`s, which torchao runs as `torch._scaled_mm` on a GPU of compute capability >= 8.9 and
emulates elsewhere (dequantized fp32 matmuls of the FP8 values: the same rounding, slowly).

Why not torchao's `Float8Linear` / `matmul_with_hp_or_float8_args` as they are: their backward computes the
input and weight gradients together, from the forward's view of the weight. Our linears (layers._Linear)
need two things more: zero bubble's B op computes the input gradient alone and defers the weight gradient to
the W op (weight_grads.py), and the backward reads the weight through the Parameter, so that a weight policy
(PipeOptim's predicted weights, PipeDream's stashes) can point the parameter at other storage for the
forward and back before the backward. `_FP8Linear` is `_Linear` with torchao's three casts and GEMMs in it,
the casts configured as torchao's `Float8LinearConfig` recipes (same operands, dims and dtypes as
`matmul_with_hp_or_float8_args`): forward  output = cast(input) @ cast(weight)^T,  backward
grad_input = cast(grad_output) @ cast(weight)  (B) and  grad_weight = cast(grad_output)^T @ cast(input)  (W).
Under torch.compile (a compiled layer) dynamo traces the same function into the layer's graph.

torchao is imported only when an FP8 GEMM is built: a run without FP8 never imports it (its import costs
seconds, and on machines without its CUDA extensions it logs that their .so files fail to load: harmless for
float8 training, which uses PyTorch's `_scaled_mm`, so `import_torchao` keeps those lines quiet).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from megatron_po.tensor_parallel import weight_grads

RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training recipes offered by --fp8-recipe


def import_torchao():
    """torchao.float8, imported with its harmless start-up noise silenced: the "Failed to load ... .so" lines of
    its optional CUDA extensions (built for another Python), and torch's pytree deprecation line about an enum
    torchao registers."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for logger, level in zip(noisy, levels):
            logger.setLevel(level)
    return float8


def float8_config(recipe: str, fp8_format: str, emulate: bool):
    """torchao's Float8LinearConfig of --fp8-recipe and --fp8-format: `tensorwise` is torchao's default recipe
    (one scale per tensor), `rowwise` its ROWWISE recipe (one scale per row of each GEMM operand, power-of-2
    scales). `fp8_format` is Megatron's: hybrid = E4M3 inputs and weights, E5M2 gradients; e4m3 = E4M3 all
    through. torchao's rowwise recipe is E4M3 all through, so config rules pair rowwise with e4m3 only."""
    float8 = import_torchao()
    from torchao.float8.config import CastConfig, e4m3_dtype, e5m2_dtype
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    go = config.cast_config_grad_output
    go = CastConfig(go.scaling_type, go.scaling_granularity, e5m2_dtype if fp8_format == "hybrid" else e4m3_dtype)
    # Both GEMMs that read grad_output cast it alike (torchao requires it).
    config = dataclasses.replace(config, cast_config_grad_output=go, cast_config_grad_output_for_grad_weight=go,
                                 emulate=emulate)
    return config


@dataclass(frozen=True, eq=False)
class FP8Gemm:
    """The three FP8 GEMMs of one recipe (`config`: a torchao Float8LinearConfig), as the linears call them."""

    config: object

    @functools.cached_property
    def mm_config(self):
        """torchao's LinearMMConfig of `config`: per GEMM, emulated or not and fast accumulation, as Float8Linear
        builds it."""
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
        c = self.config
        gemm = lambda g: ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)  # noqa: E731
        return LinearMMConfig(gemm(c.gemm_config_output), gemm(c.gemm_config_grad_input),
                              gemm(c.gemm_config_grad_weight))

    def _cast(self, t: torch.Tensor, cast, role: str, axis: int):
        """torchao's dynamic cast of `t` for one GEMM operand (`cast`: a CastConfig; `axis` the dim its rowwise
        scales reduce over), or `t` itself where the recipe keeps that operand in high precision."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole
        if cast.scaling_type is ScalingType.DISABLED:
            return t
        return hp_tensor_to_float8_dynamic(t, cast.target_dtype, self.mm_config, gemm_input_role=GemmInputRole[role],
                                           scaling_granularity=cast.scaling_granularity,
                                           axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
                                           round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)

    def output(self, input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """input [tokens, in] @ weight [out, in]^T."""
        c = self.config
        return torch.mm(self._cast(input_2d, c.cast_config_input, "INPUT", -1),
                        self._cast(weight.t(), c.cast_config_weight, "WEIGHT", 0))

    def grad_input(self, grad_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad_output [tokens, out] @ weight [out, in]."""
        c = self.config
        # torchao casts weight.t() here along its last dim: the same scales and values as `weight` cast along dim 0.
        # Written on `weight` itself, the cast is no expression of the forward's, so a compiled layer cannot share
        # the forward's weight scale with the backward (which would cast the live weights with the scale of the
        # weights the forward ran on: PipeOptim's prediction).
        return torch.mm(self._cast(grad_2d, c.cast_config_grad_output, "GRAD_OUTPUT", -1),
                        self._cast(weight, c.cast_config_weight_for_grad_input, "WEIGHT", 0))

    def grad_weight(self, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
        """grad_output [tokens, out]^T @ input [tokens, in] = the weight's gradient [out, in]."""
        c = self.config
        return torch.mm(self._cast(grad_2d, c.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0).t(),
                        self._cast(input_2d, c.cast_config_input_for_grad_weight, "INPUT", 0))


class _FP8Linear(torch.autograd.Function):
    """layers._Linear with its three GEMMs in FP8 (module docstring): saves the Parameter, not a view of the
    forward's weight, so the backward casts the weights live at the backward; defers the weight gradient to
    the W op inside zero bubble's B op."""

    @staticmethod
    def forward(ctx, input_, weight, bias, gemm: FP8Gemm):
        ctx.save_for_backward(input_, weight)
        ctx.has_bias, ctx.gemm = bias is not None, gemm
        ctx.weight, ctx.bias = weight, bias  # the deferred W op accumulates into these (see layers._Linear)
        out = gemm.output(input_.reshape(-1, input_.shape[-1]), weight).reshape(*input_.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        gemm = ctx.gemm
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = gemm.grad_input(grad_2d, weight).reshape(*grad_output.shape[:-1], weight.shape[1])
        need_w, need_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        bias = ctx.bias if need_b else None
        if (weight_grads.deferring() and need_w and ctx.weight.grad_fn is None
                and (bias is None or bias.grad_fn is None)):
            weight_grads.defer(functools.partial(_FP8Linear._weight_grads, gemm, input_, grad_output, ctx.weight, bias))
            return grad_input, None, None, None
        grad_weight = gemm.grad_weight(grad_2d, input_.reshape(-1, input_.shape[-1])) if need_w else None
        grad_bias = grad_2d.sum(0) if need_b else None
        return grad_input, grad_weight, grad_bias, None

    @staticmethod
    def _weight_grads(gemm, input_, grad_output, weight, bias):
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        out = [(weight, gemm.grad_weight(grad_2d, input_.reshape(-1, input_.shape[-1])))]
        if bias is not None:
            out.append((bias, grad_2d.sum(0)))
        return out


def fp8_linear(input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: FP8Gemm) -> torch.Tensor:
    """input_ [..., in] @ weight [out, in]^T + bias, the GEMMs in FP8 (`gemm`'s recipe)."""
    return _FP8Linear.apply(input_, weight, bias, gemm)
