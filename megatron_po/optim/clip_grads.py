"""Global gradient norm and clipping, counting every parameter exactly once.

A tensor-parallel shard (`tensor_model_parallel=True`) is counted on every TP rank (the shards are
disjoint); a TP-replicated parameter only on TP rank 0; the last pipeline stage's copy of a tied
embedding (`embedding_copy`) not at all, since the first stage counts it. The
squared sums are then all-reduced over `group`: the model-parallel group (TP x PP) in synchronous
training, which covers one full replica; data-parallel replicas hold identical gradients after the
reduction, so they are not summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps


def counts_toward_norm(p: torch.Tensor) -> bool:
    if getattr(p, "embedding_copy", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def global_grad_norm(params, group=None) -> float:
    grads = [p.grad for p in params if p.grad is not None and counts_toward_norm(p)]
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads], 2.0)
        sq = torch.stack(norms).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=ps.get_device())
    sq = sq.to(torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


def clip_grad_norm_(params, max_norm: float, group=None) -> float:
    """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before."""
    params = list(params)
    total = global_grad_norm(params, group)
    if max_norm > 0 and total > max_norm:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total
