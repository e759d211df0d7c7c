"""The optimizer of FSDP2-sharded parameters (distributed/fsdp.py): every predictive optimizer, stepping each
rank's shard in place.

FSDP2 keeps the sharded parameters in fp32 (with --bf16/--fp16 it casts them when it gathers them), so the
local shards ARE the main params: the inner PredictiveOptimizer is built over `local_shard(p)` of every
parameter (views of the storage FSDP2 gathers from), with the model's param groups, and steps them in place;
its state is 1/DP of the unsharded one. A step (`MainParamsOptimizer.step`):
  1. the gradients: each parameter's sharded `p.grad` (FSDP2 reduce-scattered the DP x CP mean into it during
     the backward, in fp32 or --grad-reduce-in-bf16's bf16), its local tensor attached to the shard;
  2. unscale (fp16), found-inf and the squared norm summed over the shards' group (DP x CP; experts: their
     expert-DP group) and then the model-parallel group (synchronous: TP x PP; asynchronous: the stage's TP), so
     every element counts once; clipping. The parameters' squares are added in the model's order (`model_order`),
     the order the plain fp32 path adds them in (clip_grads.clip_grad_norm_ over DDP's or a chunk's parameters),
     not the param groups' (decay, then no decay): the fp32 sum of squares rounds differently in another order,
     and with clipping active that last bit moved every weight (sharded over one rank, k >= 2 or interleaved:
     up to 7e-8 off the emulator, tools/layout_sweep.py). Over one rank the norm is then the plain path's bit for
     bit; over several, each rank sums its shards' squares and the ranks' sums are added, which is a grouping
     no unsharded run has (docs/fsdp.md);
  3. the inner step on the shards. Nothing is copied back: the next gather of each unit delivers the update.
Every per-element optimizer (Adam, AdamW, SGD and its momentum, Nesterov, RMSprop, Adagrad, Lion, NAdamW, NAG)
takes exactly the step the unsharded one takes on those elements.

Prediction (PipeOptim, SpecTrain) is in place on the shards: the weight policy caches the live shard, writes
Ŵ = W - s·lr·ΔW into it from this rank's own optimizer state (`predict`), the unit's next gather delivers the
predicted weights, and the policy copies the live shard back (pipeline/predicting_policies.py, `copies` path):
two shard-sized copies, 2/DP of the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_po.distributed.ddp import Bucket, is_expert
from megatron_po.distributed.fsdp import local_shard, shard_offset
from megatron_po.errors import ConfigError
from megatron_po.optim.mixed_precision import MainParamsOptimizer, MixedPrecisionOptimizer
from megatron_po.optim.optimizers import PredictiveOptimizer


class FSDPOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose main params are the local shards of FSDP2 parameters themselves: no copy,
    nothing copied back after a step (the next gather delivers it).

    inner_optimizer_factory: called once with the shards' groups (one per model param group, same keys).
    model_param_groups: the FSDP2 (DTensor) parameters, as torch.optim takes them.
    grad_scaler, clip_grad, model_parallel_group, expert_group: as for MixedPrecisionOptimizer.
    shard_group: the ranks the dense parameters are sharded over (DP x CP); expert_shard_group: the experts'
        (expert DP). Their squares are summed over these first, then over `model_parallel_group` (dense) and
        `expert_group` (experts: the expert model-parallel group, optim/clip_grads.py).
    model_order: the model's parameters in module order (FullyShardedDataParallel.params; a superset of
        model_param_groups' is fine): the order their squares are added in, as the plain optimizer's path does.
    """

    predicts_into_model_weights = False  # the shards are the live weights: a policy caches them to predict

    def __init__(self, inner_optimizer_factory: Callable[[list[dict]], PredictiveOptimizer], model_param_groups,
                 grad_scaler=None, clip_grad: float = 0.0, shard_group=None, model_parallel_group=None,
                 expert_group=None, expert_shard_group=None, *, model_order):
        self.shard_group, self.expert_shard_group = shard_group, expert_shard_group
        super().__init__(inner_optimizer_factory, model_param_groups, grad_scaler, clip_grad, model_parallel_group,
                         expert_group=expert_group)
        position = {id(p): i for i, p in enumerate(model_order)}
        self._norm_order = sorted(range(len(self.model_params)), key=lambda i: position[id(self.model_params[i])])

    def _main_params_of(self, model_params):
        dtypes = {local_shard(p).dtype for p in model_params}
        if dtypes != {torch.float32}:
            raise ConfigError(f"FSDP2 keeps fp32 sharded parameters (the main params); got {sorted(map(str, dtypes))}")
        return [local_shard(p) for p in model_params]

    def _norm_pieces(self):
        """(shard's grad, parameter) in the model's order (see the module docstring, step 2)."""
        pieces = [(self.main_params[i].grad, self.model_params[i]) for i in self._norm_order]
        return [(g, p) for g, p in pieces if g is not None]

    def _attach_shards(self, attach, groups):
        """Muon orthogonalises whole matrices: each assembled by one owner rank from the shards (optim/muon_dp.py)."""
        attach([(local_shard(p), p, shard_offset(p), shard_offset(p) + local_shard(p).numel())
                for p in self.model_params], groups,
               _ShardLayout(self.model_params, self.shard_group, self.expert_shard_group, self.main_params[0].device))

    def _copy_main_to_model(self):
        pass  # the shards are the model weights

    def _step_and_write(self, requests):
        MainParamsOptimizer._step_and_write(self, requests)  # nothing to write into other model weights

    def _agreement_groups(self):
        return [self.shard_group, self.model_parallel_group]

    def _expert_agreement_groups(self):
        return [self.expert_shard_group, self.expert_group]

    def _prediction_targets(self):
        return [[local_shard(p) for p in g] for g in self.model_groups]

    def predict(self, steps, include_weight_decay: bool = False, out=None) -> None:
        """Ŵ of the shards, in place (or into `out`): PredictiveOptimizer.predict of the inner optimizer."""
        self.optimizer.predict(steps, include_weight_decay=include_weight_decay, out=out)


class _ShardLayout:
    """What Muon's sharded step (optim/muon.py with optim/muon_dp.py) reads of the distributed optimizer's DDP,
    for FSDP2 shards: every parameter a 'bucket' of its own in a virtual flat buffer, cut into equal ranges of
    ceil(rows / ranks) rows, rank r holding range r (FSDP2's dim-0 cut), over its shards' group (experts: their
    expert-DP group). Each matrix is then assembled by its owner rank from the others' rows (one all-to-all),
    orthogonalised there, and its update's rows sent back (one all-to-all), as under the distributed optimizer."""

    def __init__(self, params, dp_group, expert_group, device):
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.param_range, self.buckets, offset = {}, [], 0
        for p in params:
            group = expert_group if is_expert(p) and expert_group is not None else dp_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            per_rank = -(-p.shape[0] // size) * (p.numel() // max(p.shape[0], 1))
            self.buckets.append(Bucket(start=offset, end=offset + per_rank * size, params=[p], expert=is_expert(p),
                                       group=group, size=size, rank=rank))
            self.param_range[id(p)] = (offset, offset + p.numel())
            offset += per_rank * size
        self.grad_buffer = torch.empty(0, device=device)  # only its device is read
