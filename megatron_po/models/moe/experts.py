"""The experts a rank holds: one MLP each (SwiGLU with --swiglu, else GELU, as the dense MLP), their weights
stacked expert-major as torchtitan's GroupedExperts stores them:

    fc1, fc1_gate  [local experts, ffn / ETP, hidden]    column-parallel over the expert TP ranks
    fc2            [local experts, hidden, ffn / ETP]    row-parallel (partial sums, reduced by the dispatcher)

and biases (--add-bias-linear, expert TP 1 only, as Megatron) fc1_bias [local, ffn], fc2_bias [local, hidden].
The tokens come grouped by expert (`counts[e]` rows for local expert e, in order). --moe-grouped-gemm runs
each projection as one `torch._grouped_mm` (`grouped_mm_error` says where it cannot run: config_rules refuses
the flag there); otherwise a loop over the local experts runs one matmul each. Both add the biases after the
matmul, so they give the same numbers (bitwise in fp32 on a CPU: tests/test_moe_layer.py).

Initialization does not depend on the layout: one draw of the default generator (the same on every rank of a
stage) is the layer's expert seed, and each expert's fc1, gate and fc2 come from a generator seeded by it and the
expert's index. A rank draws its own experts only, one whole matrix at a time, keeping its expert-TP slice, so
the EP = 4 x ETP = 2 model holds exactly the pieces of the one-process model and a 256-expert layer never
materializes the experts of other ranks.

The projections' backward reads the stacked weight through the Parameter itself (`ExpertProjection`, as
`tensor_parallel.layers.linear` does for the dense layers), never through a view of the storage the forward
read (`weight[e]`, `weight.transpose(-2, -1)`): a weight policy that points the parameters at other storage for
a forward (PipeOptim's prediction, pipeline/predicting_policies.py) and back before the backward has the
backward read the live weights, and a predicted buffer reused for the next prediction is never read by a
backward in flight.

Parameter attributes: `expert_parallel` (and Megatron's `allreduce = False`): DDP reduces these gradients over
the expert-data-parallel group, the gradient norm counts each expert slice once over the expert model-parallel
group; `tensor_model_parallel` / `partition_dim` when split over ETP = TP ranks (as the dense TP shards).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig
from megatron_po.models.moe.layout import expert_ffn_hidden_size


@functools.cache
def grouped_mm_error(device_type: str, dtype: torch.dtype, dims: tuple[int, ...]) -> str | None:
    """Why `torch._grouped_mm` cannot run the expert GEMMs here (None: it can): it needs 16-byte aligned rows
    (every GEMM dimension times the element size a multiple of 16) and a kernel for the device and dtype,
    which a tiny product on the device finds out."""
    size = torch.empty((), dtype=dtype).element_size()
    bad = [d for d in dims if (d * size) % 16]
    if bad:
        return f"dimensions {bad} x {size} bytes are not multiples of 16 bytes"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        x = torch.ones(16, 16, dtype=dtype, device=device_type)
        w = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm has no {dtype} kernel on {device_type} ({str(e).splitlines()[0][:80]})"
    return None


def _mark(p: nn.Parameter, etp: int, partition_dim: int) -> nn.Parameter:
    p.expert_parallel = True
    p.allreduce = False  # Megatron's mark of expert parameters
    p.expert_tp_dim = partition_dim if etp > 1 else -1  # the dim split over the expert TP ranks (dim 0: experts)
    p.sequence_parallel = False
    sharded = etp > 1 and etp == ps.get_tensor_model_parallel_world_size()
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = sharded, partition_dim if sharded else -1, 1
    return p


class GroupedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: range, etp: int, etp_rank: int, grouped_gemm: bool = False):
        super().__init__()
        self.experts, self.swiglu, self.grouped_gemm = experts, cfg.swiglu, grouped_gemm
        h, f = cfg.hidden_size, expert_ffn_hidden_size(cfg)
        rows = slice(etp_rank * f // etp, (etp_rank + 1) * f // etp)
        # One draw of the default generator (the same on every rank of the stage) seeds the layer's experts; each
        # expert's matrices come from a generator of their own, so a rank draws only its experts, one matrix at a
        # time, and every expert gets the same weights at any EP and expert TP (module docstring). Drawn on the
        # generator's own device, so a model built on the meta device (import-hf's plan) draws it too.
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64, generator=torch.default_generator,
                                 device=torch.default_generator.device))

        def draw(matrix: int, shape: tuple[int, int], std: float, cut) -> torch.Tensor:
            """The local experts' `matrix` (0 fc1, 1 gate, 2 fc2), each drawn whole and cut to this expert-TP slice."""
            out = []
            for e in experts:
                g = torch.Generator().manual_seed((base + (3 * e + matrix + 1) * 0x9E3779B97F4A7C15) % 2**63)
                out.append(torch.empty(shape).normal_(0.0, std, generator=g)[cut])
            return torch.stack(out)

        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.fc1 = _mark(nn.Parameter(draw(0, (f, h), cfg.init_method_std, rows)), etp, 1)
        self.fc1_gate = None
        if cfg.swiglu:
            self.fc1_gate = _mark(nn.Parameter(draw(1, (f, h), cfg.init_method_std, rows)), etp, 1)
        self.fc2 = _mark(nn.Parameter(draw(2, (h, f), out_std, (slice(None), rows))), etp, 2)
        self.fc1_bias = self.fc1_gate_bias = self.fc2_bias = None
        if cfg.add_bias_linear:  # expert TP 1 (config rule): whole experts
            self.fc1_bias = _mark(nn.Parameter(torch.zeros(len(experts), f)), 1, -1)
            if cfg.swiglu:
                self.fc1_gate_bias = _mark(nn.Parameter(torch.zeros(len(experts), f)), 1, -1)
            self.fc2_bias = _mark(nn.Parameter(torch.zeros(len(experts), h)), 1, -1)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], grouped by local expert (`counts` [local experts] rows each) -> [N, hidden]: each
        row through its expert's MLP (a partial sum over the ffn slices under expert TP)."""
        def project(inp, weight, bias):
            out = ExpertProjection.apply(inp, weight, counts, self.grouped_gemm)
            return out if bias is None else out + bias.repeat_interleave(counts, dim=0, output_size=inp.shape[0])
        up = project(x, self.fc1, self.fc1_bias)
        if self.swiglu:
            act = F.silu(project(x, self.fc1_gate, self.fc1_gate_bias)) * up
        else:
            act = F.gelu(up, approximate="tanh")
        return project(act, self.fc2, self.fc2_bias)


class ExpertProjection(torch.autograd.Function):
    """y = x_e · W[e]ᵀ for the rows of each local expert e: one `torch._grouped_mm` (`grouped`) or a loop of
    matmuls, the same numbers either way. Saves the stacked Parameter itself (module docstring); its backward
    computes what autograd computes for the same ops (bitwise on a CPU: tests/test_moe_async.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.grouped = counts, grouped
        if grouped:
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=_offsets(counts))
        outs = [piece @ weight[e].t() for e, piece in enumerate(x.split(counts.tolist()))]
        return torch.cat(outs) if outs else x.new_empty(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        counts = ctx.counts
        grad_x = grad_w = None
        if ctx.grouped:
            offs = _offsets(counts)
            if ctx.needs_input_grad[0]:
                grad_x = torch._grouped_mm(grad_out, weight, offs=offs)
            if ctx.needs_input_grad[1]:
                grad_w = torch._grouped_mm(grad_out.t(), x, offs=offs)  # [experts, out, in], contiguous
                # An expert without tokens: its block of the output may be left unwritten or wrong by the kernel
                # (pytorch#172439, B200 GPUs); its gradient is exactly zero (no host sync: a device mask).
                grad_w.masked_fill_((counts == 0).view(-1, 1, 1), 0.0)
            return grad_x, grad_w, None, None
        sizes = counts.tolist()
        grads, pieces = grad_out.split(sizes), x.split(sizes)
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([g.mm(weight[e]) for e, g in enumerate(grads)]) if grads else torch.zeros_like(x)
        if ctx.needs_input_grad[1]:
            grad_w = torch.stack([g.t().mm(piece) for piece, g in zip(pieces, grads)]) if grads \
                else torch.zeros_like(weight)
        return grad_x, grad_w, None, None


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32)
