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
     every element counts once; clipping;
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
from torch import Tensor

from megatron_po.distributed.ddp import Bucket, is_expert
from megatron_po.distributed.fsdp import local_shard, shard_offset
from megatron_po.errors import ConfigError
from megatron_po.optim.mixed_precision import MainParamsOptimizer, normalize_param_groups
from megatron_po.optim.optimizers import PredictiveOptimizer


class FSDPOptimizer(MainParamsOptimizer):
    """A PredictiveOptimizer over the local shards of FSDP2 parameters, with the mixed-precision step's
    unscaling, skipping, clipping and agreement.

    inner_optimizer_factory: called once with the shards' groups (one per model param group, same keys).
    model_param_groups: the FSDP2 (DTensor) parameters, as torch.optim takes them.
    grad_scaler, clip_grad: as for MixedPrecisionOptimizer.
    shard_group: the ranks the dense parameters are sharded over (DP x CP); expert_shard_group: the experts'
        (expert DP). Their squares are summed over these first, then over `model_parallel_group` (dense) and
        `expert_group` (experts: the expert model-parallel group, optim/clip_grads.py).
    """

    predicts_into_model_weights = False  # the shards are the live weights: a policy caches them to predict

    def __init__(self, inner_optimizer_factory: Callable[[list[dict]], PredictiveOptimizer], model_param_groups,
                 grad_scaler=None, clip_grad: float = 0.0, shard_group=None, model_parallel_group=None,
                 expert_group=None, expert_shard_group=None):
        groups = normalize_param_groups(model_param_groups)
        self.model_groups = [g["params"] for g in groups]
        self.model_params = [p for g in self.model_groups for p in g]
        if len({id(p) for p in self.model_params}) != len(self.model_params):
            raise ValueError("a parameter appears in more than one param group")
        dtypes = {local_shard(p).dtype for p in self.model_params}
        if dtypes != {torch.float32}:
            raise ConfigError(f"FSDP2 keeps fp32 sharded parameters (the main params); got {sorted(map(str, dtypes))}")
        self.main_params = [local_shard(p) for p in self.model_params]
        self.optimizer = inner_optimizer_factory([{**g, "params": [local_shard(p) for p in g["params"]]}
                                                  for g in groups])
        if not isinstance(self.optimizer, PredictiveOptimizer):
            raise TypeError(f"the inner optimizer must be a PredictiveOptimizer, got {type(self.optimizer).__name__}")
        attach = getattr(self.optimizer, "attach_shards", None)
        if attach is not None:  # Muon orthogonalises whole matrices: each assembled by one owner (optim/muon_dp.py)
            attach([(local_shard(p), p, shard_offset(p), shard_offset(p) + local_shard(p).numel())
                    for p in self.model_params], groups,
                   _ShardLayout(self.model_params, shard_group, expert_shard_group, self.main_params[0].device))
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.shard_group, self.expert_shard_group = shard_group, expert_shard_group
        self.model_parallel_group = model_parallel_group
        self.expert_group = expert_group
        self.predict_chunk_numel = 1 << 20
        self._device = self.main_params[0].device

    # -- MainParamsOptimizer hooks --------------------------------------------------------------

    def _main_grads(self):
        for p, shard in zip(self.model_params, self.main_params):
            grad = None if p.grad is None else local_shard(p.grad)
            shard.grad = None if grad is None else grad if grad.dtype == torch.float32 else grad.float()
        return [m.grad for m in self.main_params if m.grad is not None]

    def _norm_pieces(self):
        return [(m.grad, p) for m, p in zip(self.main_params, self.model_params) if m.grad is not None]

    def _release_main_grads(self):
        for m in self.main_params:
            m.grad = None

    def _copy_main_to_model(self):
        pass  # the shards are the model weights

    def _agreement_groups(self):
        return [self.shard_group, self.model_parallel_group]

    def _expert_agreement_groups(self):
        return [self.expert_shard_group, self.expert_group]

    def _prediction_targets(self):
        return [[local_shard(p) for p in g] for g in self.model_groups]

    # -- what the weight policies and checkpoints read ---------------------------------------------

    def predict(self, steps, include_weight_decay: bool = False, out=None) -> None:
        """Ŵ of the shards, in place (or into `out`): PredictiveOptimizer.predict of the inner optimizer."""
        self.optimizer.predict(steps, include_weight_decay=include_weight_decay, out=out)

    def update_direction(self, include_weight_decay: bool = False) -> list[list[Tensor | None]]:
        """ΔW of this rank's shards, per group aligned with the model params."""
        return self.optimizer.update_direction(include_weight_decay)

    @property
    def state(self) -> dict:
        """{model param: the inner optimizer's state of its shard}."""
        return {p: self.optimizer.state[m] for p, m in zip(self.model_params, self.main_params)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """This rank's shard state, saved under the same layout (checkpoints reshard: distributed/checkpoint_*)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


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
