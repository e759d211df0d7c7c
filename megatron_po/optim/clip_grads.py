"""Global gradient norm and clipping, counting every parameter exactly once.

A tensor-parallel shard (`tensor_model_parallel=True`) is counted on every TP rank (the shards are
disjoint); a TP-replicated parameter only on TP rank 0; the last pipeline stage's copy of a tied
embedding (`embedding_copy`) not at all, since the first stage counts it. The
squared sums are then all-reduced over `group`: the model-parallel group (TP x PP) in synchronous
training, which covers one full replica; data-parallel replicas hold identical gradients after the
reduction, so they are not summed.

MoE experts (`expert_parallel`) are split over the expert-parallel ranks, which are data-parallel ranks, so
one model-parallel group does not hold them all: their squares are summed on every rank and all-reduced over
`expert_group`, the expert model-parallel group (expert TP x EP x PP, Megatron's), which holds every expert
slice once; expert-data-parallel replicas hold identical (reduced) gradients. The norm is
sqrt(dense over `group` + experts over `expert_group`). Every rank of the model passes `expert_group` when the
model has experts (a stage without MoE layers too: it joins the collective with zero).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps


def expert_norm_group(cfg):
    """The group a model's MoE experts' squares are summed over (`expert_group` below): the expert model-parallel
    group where `cfg` (a Config) has experts; None without."""
    return ps.get_expert_tensor_model_pipeline_parallel_group() if cfg.model.num_experts is not None else None


def counts_toward_norm(p: torch.Tensor) -> bool:
    if getattr(p, "embedding_copy", False):
        return False
    if getattr(p, "expert_parallel", False):
        return True  # every expert slice once over the expert model-parallel group
    return getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def squared_sums(pairs, device=None) -> torch.Tensor:
    """[dense, expert] float64 sums of squares of the (gradient, parameter) pairs that count toward the norm."""
    out = torch.zeros(2, dtype=torch.float64, device=device if device is not None else ps.get_device())
    for k, expert in enumerate((False, True)):
        grads = [g for g, p in pairs if counts_toward_norm(p) and getattr(p, "expert_parallel", False) == expert]
        if grads:
            out[k] = torch.stack(torch._foreach_norm([g.float() for g in grads], 2.0)).square().sum()
    return out


def _multi(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def sum_dense_and_experts(dense: torch.Tensor, expert: torch.Tensor, group=None, expert_group=None) -> torch.Tensor:
    """This rank's sums over the dense parameters, reduced over `group`, plus those over the experts, reduced
    over `expert_group` (see module docstring); without `expert_group` both over `group`."""
    if expert_group is None:
        total = dense + expert
        if _multi(group):
            dist.all_reduce(total, group=group)
        return total
    dense, expert = dense.clone(), expert.clone()
    if _multi(group):
        dist.all_reduce(dense, group=group)
    if _multi(expert_group):
        dist.all_reduce(expert, group=expert_group)
    return dense + expert


def reduce_squared_sums(sums: torch.Tensor, group=None, expert_group=None) -> float:
    """The global norm from this rank's `squared_sums`."""
    return float(sum_dense_and_experts(sums[0], sums[1], group, expert_group).sqrt())


def global_grad_norm(params, group=None, expert_group=None) -> float:
    pairs = [(p.grad, p) for p in params if p.grad is not None]
    return reduce_squared_sums(squared_sums(pairs), group, expert_group)


def clip_grad_norm_(params, max_norm: float, group=None, expert_group=None) -> float:
    """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before."""
    params = list(params)
    total = global_grad_norm(params, group, expert_group)
    if max_norm > 0 and total > max_norm:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total
