"""Fully sharded data parallelism: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`, DTensor parameters)
applied to this code's model chunks, and the data-parallel interface the step and the asynchronous stage use.

Where it applies (the one place, as torchtitan's parallelize): every model chunk of every pipeline stage, over
the data-parallel x context-parallel ranks of its tensor-parallel rank and stage (`shard_chunks`); tensor
parallelism stays this code's layers (each TP rank shards its own TP slice). Units, each gathered whole while it
runs and freed after (reshard-after-forward), so a rank holds 1/DP of every weight plus the unit in flight:
  - every transformer layer;
  - MoE experts (`GroupedExperts`) over their own expert-data-parallel group (the ranks holding the same
    experts, as torchtitan shards them), inside their layer's unit; their gradients are divided by the dense
    DP x CP size, as the DDP buckets divide them (each expert gradient already sums every EP rank's tokens);
  - the first stage's word/position embedding when it is not tied to the output layer;
  - the chunk itself (its root): what is left (the final norm, the output layer, a tied embedding). The chunked
    output loss reads the output layer's weight without calling the layer, so the output layer must live in a
    unit gathered around the whole last-stage forward: the root.
Within a chunk each unit prefetches the next one's gather, in the forward and in the backward
(`_prefetch_in_order`), never across chunks: an asynchronous policy puts a chunk's weights in place just before
that chunk runs. So every unit is gathered exactly once per forward and once per backward.

Parameters: FSDP2 replaces each parameter by a DTensor whose local tensor is this rank's rows (dim 0, padded
evenly); the attributes this code reads off parameters (tensor_model_parallel, sequence_parallel,
expert_parallel, shared_embedding, ...) are copied onto the new ones. `local_shard(p)` is the rank's part, a
view of the storage FSDP2 all-gathers from: writing it in place (an optimizer step, a predicted or stashed
version) changes what the next gather of that unit delivers. The sharded parameters keep fp32: with --bf16 or
--fp16 FSDP2's MixedPrecisionPolicy casts them to the model dtype when it gathers them (compute) and reduces the
gradients in fp32 (--grad-reduce-in-bf16: in bf16), so the fp32 shards are the main params.

Gradients: FSDP2 reduce-scatters each unit's gradients at the end of its backward, every micro-batch (the mean
over DP x CP lands in the sharded `p.grad`, which accumulates over the micro-batches of a step): no full-size
gradient outlives a unit's backward. Zero-bubble schedules defer the linear weights' gradients to the W op
(tensor_parallel/weight_grads.py); they accumulate into the gathered parameter's `.grad` there and
`FullyShardedDataParallel.weight_grads_done` reduce-scatters them right after the W op, as
torch.distributed.pipelining's `perform_reduce_grad` runs FSDP2's post-backward by hand.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.distributed.ddp import grad_of, is_expert
from megatron_po.models.moe.experts import GroupedExperts
from megatron_po.models.transformer import TransformerLayer


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP2-sharded parameter (a view of the storage its all-gather reads), else `p`."""
    return p._local_tensor if ps.is_dtensor(p) else p


def _forget_sharding_propagation() -> None:
    """As the groups are released (parallel_state.on_release): DTensor's sharding-propagation caches (Python's and
    the C++ fast path's) key on specs whose DeviceMesh compares equal to any mesh over the same ranks, whatever its
    process group, so a run that builds its groups again (a launch running layout after layout,
    tools/layout_sweep.py) got specs carrying the released groups' meshes: FSDPOptimizer's `shard_offset` then
    asked a destroyed group for its rank (RuntimeError: could not resolve the process group)."""
    if "torch.distributed.tensor" in sys.modules:  # no DTensor made, nothing cached (and no sympy import)
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        _clear_sharding_prop_cache()


ps.on_release(_forget_sharding_propagation)


def shard_offset(p: torch.Tensor) -> int:
    """Where this rank's shard of an FSDP2 parameter starts in the flattened (TP-local) parameter: FSDP2 cuts
    dim 0 as torch.chunk does (ceil(rows / ranks) rows per rank, the last ranks' shards shorter or empty)."""
    mesh = p.device_mesh
    rows = -(-p.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * rows, p.shape[0]) * (p.numel() // max(p.shape[0], 1))


def is_fully_sharded(chunk: nn.Module) -> bool:
    # torch.distributed.fsdp is imported where FSDP2 is applied (as DTensor's module: ps.is_dtensor)
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(chunk, module.FSDPModule)


def fsdp_precision(precision):
    """FSDP2's mixed precision for the precision flags (config PrecisionConfig): gather the fp32 shards in the
    model dtype of --bf16/--fp16 (fp32: no cast), reduce the gradients in fp32 (--grad-reduce-in-bf16: bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if not (precision.bf16 or precision.fp16):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision.bf16 else torch.float16,
                                reduce_dtype=torch.bfloat16 if precision.grad_reduce_in_bf16 else torch.float32)


def _units(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's modules gathered on their own, in forward order (the root holds the rest)."""
    units = []
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None and not any(getattr(p, "shared_embedding", False) for p in embedding.parameters()):
        units.append(embedding)
    units += [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
    return units


def shard_chunks(chunks: list[nn.Module], reshard_after_forward: bool = True,
                 mp_policy=None) -> list[nn.Module]:
    """Apply FSDP2 to every chunk in place (see the module docstring); returns the chunks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # The last stage returns its per-token losses transposed (a view); FSDP2 warns that an in-place op on a
    # view would lose its backward hook. Nothing writes a chunk's output in place (pipeline/executor.py).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    mesh = ps.device_mesh(group)
    dense_size = ps.get_data_parallel_world_size(with_context_parallel=True)
    for chunk in chunks:
        attributes = {name: dict(vars(p)) for name, p in chunk.named_parameters()}
        expert_units = [m for m in chunk.modules() if isinstance(m, GroupedExperts)]
        if expert_units:
            expert_group = ps.get_expert_data_parallel_group()
            expert_mesh = ps.device_mesh(expert_group)
            for experts in expert_units:
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=mp_policy)
                _set_divide_factor(experts, dense_size, expert_group)
        units = _units(chunk)
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        _prefetch_in_order(chunk, units)
        _gathers_follow_writes(chunk)
        for name, p in chunk.named_parameters():
            for key, value in attributes[name].items():
                setattr(p, key, value)
    return chunks


def _prefetch_in_order(root, units: list) -> None:
    """Each unit's gather starts while the one before it runs: in the forward root -> units[0] -> units[1] ...,
    in the backward root -> units[-1] -> ... -> units[0] (-> root, which is gathered then: nothing). Explicit
    for every unit: FSDP2's default backward prefetch follows the order of the last forwards, which in a
    pipeline (forwards of later micro-batches before a backward) gathers units that do not run next."""
    order = [root, *units]
    for unit, following in zip(order, order[1:]):
        unit.set_modules_to_forward_prefetch([following])
    backward = [root, *reversed(units), root]
    for unit, following in zip(backward, backward[1:]):
        unit.set_modules_to_backward_prefetch([following])


def _gathers_follow_writes(root: FSDPModule) -> None:
    """Every pass of the chunk orders FSDP2's gathers after what the current stream has written into the shards.
    FSDP2 copies the shards in and gathers them on streams of its own in the forward and the backward (CUDA), and
    orders those after the current stream only at the first forward of an iteration; an asynchronous weight policy
    writes a chunk's shards (a prediction, a stashed version swapped in) right before any of its passes. So before
    FSDP2's own hooks: a forward pre-hook for the forward, and for the backward a hook on the chunk's outputs,
    registered before FSDP2's pre-backward hook on them (tensor hooks run in the order registered). No-ops on a CPU."""
    state = root._get_fsdp_state()

    def wait() -> None:
        ctx = state._comm_ctx
        streams = [getattr(ctx, name, None) for name in ("all_gather_copy_in_stream", "all_gather_stream")]
        if None in streams:  # before FSDP2's lazy initialisation (the first forward): nothing gathered yet
            return
        current = ctx.device_handle.current_stream()
        for stream in streams:
            stream.wait_stream(current)

    def before_backward(grad):
        wait()
        return grad

    def after_forward(_module, _args, output):
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(before_backward)

    root.register_forward_pre_hook(lambda _module, _args: wait(), prepend=True)
    root.register_forward_hook(after_forward, prepend=True)


def _set_divide_factor(module: FSDPModule, factor: float, group) -> None:
    """Divide the module's reduced gradients by `factor` instead of its group's size. NCCL does it in the
    reduce-scatter (PREMUL_SUM); gloo has no such op, so there FSDP2 sums and divides after. Over a group of one
    rank (experts no other rank holds: expert-DP 1 under dense DP > 1) nothing is reduced and FSDP2 divides as it
    copies; with the summing reduction forced it divided again after (torch 2.13: the experts' gradients were
    1/factor of DDP's, the grad norm 2e-4 low at DP 2 = EP 2, tools/layout_sweep.py), so it is forced only where
    a reduction runs."""
    setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    setter(float(factor))
    if dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1:
        module.set_force_sum_reduction_for_comms(True)


def _param_groups(module: nn.Module) -> list:
    """FSDP2's parameter groups of every fully sharded module under `module` (its private state: the way
    torch.distributed.pipelining runs the post-backward by hand)."""
    groups = []
    for m in module.modules():
        if is_fully_sharded(m):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append(group)
    return groups


class FullyShardedDataParallel:
    """The data-parallel interface of distributed/ddp.py's DistributedDataParallel over FSDP2 chunks, for the
    synchronous step and the asynchronous stage: `params` (the DTensor parameters), `zero_grad`,
    `finish_grad_sync`, `sync_enabled` (kept for the executor; FSDP2 reduce-scatters every micro-batch) and,
    for zero-bubble schedules, `weight_grads_done`."""

    use_distributed_optimizer = False

    def __init__(self, chunks: list[nn.Module]):
        self.chunks = chunks
        seen, self.params = set(), []
        for chunk in chunks:
            for p in chunk.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.expert_group = ps.get_expert_data_parallel_group() if any(map(is_expert, self.params)) else None
        self.sync_enabled = True
        self._groups = [_param_groups(chunk) for chunk in chunks]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finish_grad_sync(self) -> None:
        """FSDP2's reduce-scatters end with each backward (its root's final callback waits for them)."""

    def weight_grads_done(self, chunk: int) -> None:
        """After a zero-bubble W op of `chunk`: reduce-scatter the weight gradients it accumulated into the
        gathered parameters (FSDP2's post-backward, which only takes parameters holding a gradient)."""
        for group in self._groups[chunk]:
            group.post_backward()
        for group in self._groups[chunk]:
            group.finalize_backward()

    @property
    def grad_buffer(self) -> torch.Tensor:
        """This rank's gradient shards, flat (to look for inf/NaN: training_step.check_finite)."""
        grads = [grad_of(p).reshape(-1) for p in self.params if p.grad is not None]
        return torch.cat(grads) if grads else torch.zeros(0, device=ps.get_device())
