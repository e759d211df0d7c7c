"""The predicting weight policies: SpecTrain and PipeOptim run a pass on weights predicted from the
chunk's optimizer (Ŵ = W - s·η·ΔW, s read from the schedule) and go back to the live weights after it
(the method table: policies.py).

They point each parameter at its predicted tensor for one pass and back after it, where every module of
the chunk saves the parameter itself rather than a view of its storage (our layers do:
`tensor_parallel.layers.linear`), and fall back to in-place writes with a cache otherwise; see
`_PredictingPolicy`. Where the chunk's next op after a step is the predicted forward, the step itself
writes Ŵ (fused_steps.py, optim/fused_prediction.py).
"""

from __future__ import annotations

import torch

from megatron_po.distributed.fsdp import is_fully_sharded
from megatron_po.errors import ConfigError
from megatron_po.models.moe.experts import GroupedExperts
from megatron_po.models.moe.router import TopKRouter
from megatron_po.optim.predictors import build_predictor
from megatron_po.pipeline.async_policy import (AsyncPolicy, _clone, _copy_into, _DelayCompensating, delay_compensate,
                                               spectrain_staleness)
from megatron_po.pipeline.fused_steps import StepFusedPrediction
from megatron_po.pipeline.schedules import Backward, Forward, Step
from megatron_po.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _backward_reads_parameters(chunk: torch.nn.Module) -> bool:
    """Whether every module of the chunk that owns parameters is one whose autograd saves the parameters
    themselves (not views of their storage) for the backward, so that pointing a parameter at other
    storage for a forward and back before the backward makes the backward read the live weights: our
    tensor-parallel linears (`tensor_parallel.layers.linear`), embeddings (whose backward reads no
    weight), torch's LayerNorm / RMSNorm, and the MoE router (`linear`) and experts (`ExpertProjection`,
    which saves the stacked parameter, not the per-expert views it multiplies by). F.linear, for one,
    saves a transposed view instead."""
    known = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, torch.nn.Embedding,
             torch.nn.LayerNorm, torch.nn.RMSNorm, TopKRouter, GroupedExperts)
    return all(type(m) in known for m in chunk.modules() if next(m.parameters(recurse=False), None) is not None)


class _PredictingPolicy(StepFusedPrediction, AsyncPolicy):
    """Predict a chunk's weights for a pass from its optimizer and go back to the live ones after it.

    Two ways, picked per chunk at construction (bit-for-bit the same results):
    - pointer swap, when the chunk's backward reads weights through the parameters themselves
      (`_backward_reads_parameters`): Ŵ is computed out of place in one fused pass, each parameter is
      pointed at its Ŵ (`p.data = Ŵ`) for the pass and back at its live tensor after it: no copy at all.
      Passes in flight saved the parameters, not Ŵ, so their backwards read whatever the parameter holds
      then (the live weights, or SpecTrain's backward prediction).
    - copies, for any other module (e.g. Transformer Engine's, which may keep views or casts of the
      weights): the live weights go to ONE cache per chunk (allocated at the first prediction, reused
      after), Ŵ is written in place, and the live weights are copied back from the cache.
    Prediction is skipped (s treated as 0) while the optimizer has no state, i.e. before the chunk's first
    step. With pointer swaps the prediction of the pass right after a step is written by the step itself
    (fused_steps.py); the others are predicted right before their pass."""

    def __init__(self, rank, chunks, optimizers, schedule=None, **options):
        for opt in optimizers:
            if not hasattr(opt, "predict") and not hasattr(opt, "predict_model_params"):
                raise ConfigError(f"{type(self).__name__} needs predictive optimizers "
                                  f"(megatron_po.optim), got {type(opt).__name__}")
        for opt in optimizers:
            # Predictions reuse the ΔW the step computed (Adam's √v̂ + ε, ...) instead of rebuilding it from
            # the state; off where the step writes them itself (fused_steps.py `before_step`).
            getattr(opt, "optimizer", opt).keep_direction = True
        # FSDP2 gathers from its own shard storage: a prediction there is written in place (copies)
        self.swaps = [_backward_reads_parameters(c) and not is_fully_sharded(c) for c in chunks]
        self.cache: list[list[torch.Tensor] | None] = [None] * len(chunks)  # copies: the live weights
        self.live: list[list[tuple] | None] = [None] * len(chunks)  # swaps: (parameter, live tensor)
        self.predicted = [False] * len(chunks)
        # Distributed optimizer with pointer swaps: one packed all-gather per micro-batch (`_gathered`).
        self.gathers = [hasattr(opt, "predict_shard") and swap for opt, swap in zip(optimizers, self.swaps)]
        for opt, gathers in zip(optimizers, self.gathers):
            if gathers:
                opt.defer_param_gather = True
        self.prefetched: dict[tuple[str, int, int], str] = {}  # (pass, mb, chunk) -> its gathered buffer
        self._passes_between_steps: list[list[list]] = [[] for _ in chunks]
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def use_schedule(self, schedule):
        super().use_schedule(schedule)
        # Per chunk: the forwards and backwards between its i-th and (i+1)-th step of this segment.
        between = [[[]] for _ in self.chunks]
        for op in schedule.ops.get(self.rank, []):
            if isinstance(op, Step):
                for c in (range(len(self.chunks)) if op.chunk is None else [op.chunk]):
                    between[c].append([])
            else:
                between[op.chunk][-1].append(op)
        self._passes_between_steps = between

    def prefetch_passes(self, chunk: int, ops: list) -> list[tuple[str, int, float, bool]]:
        """(pass "F"/"B", mb, steps, include_weight_decay) of the predicted passes among `ops` (a chunk's
        passes up to its next step) whose shards a step gathers with the updated weights."""
        return []

    def after_step(self, chunk):
        super().after_step(chunk)
        fused = self._take_fused(chunk)  # the predictions the step wrote
        if not self.gathers[chunk]:
            return
        opt = self.optimizers[chunk]
        ops = self._ops_after_step(chunk, self.steps[chunk] - self._segment_first_step[chunk])
        for kind, mb, steps, include_wd in self.prefetch_passes(chunk, ops):
            request = fused.get((kind, mb))
            if request is not None and request.done:
                self.prefetched[(kind, mb, chunk)] = kind
            elif steps != 0 and opt.has_state():
                self._plan_predictor(chunk, self.lr_steps[chunk])
                opt.predict_shard(kind, steps, include_wd)
                self.prefetched[(kind, mb, chunk)] = kind
        opt.start_gathers(async_op=opt.ddp.overlap_param_gather)  # the live shard and the predicted ones

    def _gathered(self, chunk: int, key: tuple[str, int], steps: float, include_weight_decay: bool) -> None:
        """Point the chunk at Ŵ for pass `key` = (kind, mb): gathered with the last step's update, or now
        (one all-gather, the live shard too if it changed)."""
        opt = self.optimizers[chunk]
        slot = self.prefetched.pop((*key, chunk), None)
        if slot is None:
            if steps == 0 or not opt.has_state():
                return
            slot = key[0]
            opt.predict_shard(slot, steps, include_weight_decay)
            # --overlap-param-gather: a forward's pre-hooks wait for the gather; a backward (SpecTrain's) has no
            # pre-hook to wait in, so its weights are gathered before it starts.
            opt.start_gathers(async_op=opt.ddp.overlap_param_gather and key[0] == "F")
        opt.point_model_at(slot)
        self.predicted[chunk] = True
        self._note_copies(chunk)

    def _wait_for_live(self, chunk: int) -> None:
        """A backward reads the weights outside any forward pre-hook: wait for a pending all-gather."""
        if self.gathers[chunk]:
            self.optimizers[chunk].finish_param_sync()

    def _keep_for_recompute(self, chunk, params):
        # A recomputed region's weights are copied as its forward starts, before its modules' pre-hooks wait for
        # an overlapped all-gather (--overlap-param-gather): wait for it here, or the copy holds the old values.
        self._wait_for_live(chunk)
        return super()._keep_for_recompute(chunk, params)

    def copies(self, chunk):
        if self.gathers[chunk]:
            held = 1 + len(self.optimizers[chunk].predicted_buffers)
        else:
            held = 2 if (self.cache[chunk] is not None or self.live[chunk] is not None
                         or self._fused_pending(chunk)) else 1
        return held + self._recompute_copies(chunk)

    def _backward_sees_forward_weights(self, mb, chunk):
        # Asked right after before_forward: a forward on a prediction needs it back for a recomputation
        # (PipeOptim's B(j) runs on the live weights); without prediction and step in between, live = live.
        return self.staleness[chunk][mb] == 0 and not self.predicted[chunk]

    def _predict(self, chunk: int, steps: float, include_weight_decay: bool = False,
                 key: tuple[str, int] | None = None) -> None:
        opt = self.optimizers[chunk]
        if self.gathers[chunk]:
            self._gathered(chunk, key, steps, include_weight_decay)
            return
        if self._install_fused(chunk, key):  # written by the step (fused_steps.py)
            self.predicted[chunk] = True
            self._note_copies(chunk)
            return
        if steps == 0 or not opt.has_state():
            return
        if getattr(opt, "predicts_into_model_weights", False):
            # Mixed precision: the fp32 main params are the live weights already, so predict straight
            # into the low-precision model weights and restore by the usual main -> model copy. No cache.
            opt.predict_model_params(steps, include_weight_decay)
            self.predicted[chunk] = True
            return
        if self.swaps[chunk]:
            pairs = opt.predicted(steps, include_weight_decay=include_weight_decay)
            self.live[chunk] = [(p, p.data) for p, _ in pairs]
            for p, w in pairs:
                p.data = w if w.dtype == p.dtype else w.to(p.dtype)
            self.predicted[chunk] = True
            self._note_copies(chunk)
            return
        if self.cache[chunk] is None:
            self.cache[chunk] = _clone(self.params[chunk])
        else:
            _copy_into(self.cache[chunk], [p.data for p in self.params[chunk]])
        opt.predict(steps, include_weight_decay=include_weight_decay)
        self.predicted[chunk] = True
        self._note_copies(chunk)

    def _restore(self, chunk: int) -> None:
        if self.predicted[chunk]:
            opt = self.optimizers[chunk]
            if self.gathers[chunk]:
                opt.point_model_at(None)
            elif self.live[chunk] is not None:  # pointer swaps (also a fused Ŵ in mixed precision)
                for p, w in self.live[chunk]:
                    p.data = w
                self.live[chunk] = None
            elif getattr(opt, "predicts_into_model_weights", False):
                opt.restore_model_params()
            else:
                _copy_into(self.params[chunk], self.cache[chunk])
            self.predicted[chunk] = False


class SpecTrainPolicy(_PredictingPolicy):
    """SpecTrain: both passes run on weights predicted from the momentum buffer v ("smoothed gradient"),
    Ŵ = W - s·η·v, with s_f for the forward and s_b for the backward (`spectrain_staleness`); the live
    weights are restored after each pass. Momentum SGD only (megatron_po.optim.SGD, momentum > 0, not
    Nesterov, direction="buffer" so that ΔW is v)."""

    def __init__(self, rank, chunks, optimizers, schedule=None, **options):
        from megatron_po.optim import SGD
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)  # the predictive optimizer inside a mixed-precision wrapper
            ok = isinstance(inner, SGD) and all(g["momentum"] > 0 and not g["nesterov"] and
                                                g["direction"] == "buffer" for g in inner.param_groups)
            if not ok:
                raise ConfigError("spectrain predicts from the momentum buffer and needs SGD with momentum "
                                  f"(--optimizer sgd, --sgd-momentum > 0, no Nesterov); got {type(opt).__name__}")
        self.spectrain: dict[int, dict[int, tuple[int, int]]] = {}
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def use_schedule(self, schedule):
        super().use_schedule(schedule)
        self.spectrain = {c: s for (r, c), s in spectrain_staleness(schedule).items() if r == self.rank}

    def _backward_sees_forward_weights(self, mb, chunk):
        # With s(j) = 0 no step separates the passes, and s_f = s_b: B(j) predicts the very same weights.
        return self.staleness[chunk][mb] == 0

    def prefetch_passes(self, chunk, ops):
        f = next((op.microbatch for op in ops if isinstance(op, Forward)), None)
        b = next((op.microbatch for op in ops if isinstance(op, Backward)), None)
        return ([("F", f, self.spectrain[chunk][f][0], False)] if f is not None else []) + \
            ([("B", b, self.spectrain[chunk][b][1], False)] if b is not None else [])

    def _predicted_passes(self, chunk, ops):
        return [("F" if isinstance(op, Forward) else "B", op.microbatch,
                 self.spectrain[chunk][op.microbatch][0 if isinstance(op, Forward) else 1], False) for op in ops]

    def before_forward(self, mb, chunk):
        self._predict(chunk, self.spectrain[chunk][mb][0], key=("F", mb))

    def after_forward(self, mb, chunk):
        self._restore(chunk)

    def before_backward(self, mb, chunk):
        self._wait_for_live(chunk)
        self._predict(chunk, self.spectrain[chunk][mb][1], key=("B", mb))

    def after_backward(self, mb, chunk):
        self._restore(chunk)


class PipeOptimPolicy(_DelayCompensating, _PredictingPolicy):
    """PipeOptim: F(j) runs on Ŵ = W - s·η·ΔW with s = s(j) + s_offset, ΔW the optimizer's own update
    direction (SGD's `direction` picks buffer or lookahead); the live weights are restored from the cache
    right after the forward, so B(j) and the step run on the live weights.

    s_offset: 0 = the paper (s = D-r-1 in the straight pipeline), 1 = the reference code (D-r).
    include_weight_decay: also extrapolate decoupled weight decay (AdamW, Lion); the paper does not.
    weight_predictor, prediction_horizon, rollout_gradient: how far along ΔW to go (optim/predictors.py;
        "linear" with the "full" horizon is the paper's s·η). They read the LR schedule from `lr_fn`.
    delay_compensation: λ > 0 corrects each gradient toward the live weights before the step,
        g + λ·g⊙g⊙(W_live − W_used) (DC-ASGD's first-order Taylor term), W_used = the predicted Ŵ_j its
        forward ran on; `delay_compensation_adaptive` divides λ by the gradient's RMS per tensor (DC-ASGD-a's
        normalisation, stateless). Ŵ_j is not recoverable from the live weights and the optimizer state
        (it depends on the s steps taken since F(j)), so it is kept from F(j) to B(j) for every
        micro-batch with s(j) > 0: up to s_max extra weight copies per chunk (D-r-1 in the straight
        pipeline), PipeDream's memory, counted in `copies()`. Needs k = 1 (one gradient per step).
    """

    options = AsyncPolicy.options + ("s_offset", "include_weight_decay", "weight_predictor", "prediction_horizon",
                                     "rollout_gradient", "delay_compensation", "delay_compensation_adaptive")

    def __init__(self, rank, chunks, optimizers, schedule=None, s_offset: int = 0,
                 include_weight_decay: bool = False, weight_predictor: str = "linear",
                 prediction_horizon: str = "full", rollout_gradient: str = "first-moment",
                 delay_compensation: float = 0.0, delay_compensation_adaptive: bool = False, **options):
        if not isinstance(s_offset, int) or s_offset < 0:
            raise ConfigError(f"pipeoptim s_offset must be an integer >= 0, got {s_offset!r}")
        self.s_offset = s_offset
        self.include_weight_decay = bool(include_weight_decay)
        inner = [getattr(opt, "optimizer", opt) for opt in optimizers]  # inside mixed-precision wrappers
        self.predictors = [build_predictor(weight_predictor, prediction_horizon, rollout_gradient, o) for o in inner]
        if (weight_predictor, prediction_horizon) != ("linear", "full"):  # else the optimizer's own linear path
            for o, predictor in zip(inner, self.predictors):
                o.predictor = predictor
        self._set_delay_compensation(delay_compensation, delay_compensation_adaptive)
        self.used: dict[tuple[int, int], list[torch.Tensor]] = {}  # (mb, chunk) -> Ŵ its forward ran on (DC)
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def copies(self, chunk):
        return super().copies(chunk) + sum(1 for (_, c) in self.used if c == chunk)

    def prefetch_passes(self, chunk, ops):
        return self._predicted_passes(chunk, [next((op for op in ops if isinstance(op, Forward)), None)])

    def _predicted_passes(self, chunk, ops):
        return [("F", op.microbatch, self.staleness[chunk][op.microbatch] + self.s_offset, self.include_weight_decay)
                for op in ops if isinstance(op, Forward)]

    def _plan_predictor(self, chunk, lr_steps):
        self.predictors[chunk].plan(self.lr_fn, lr_steps)  # as before_forward does

    def before_backward(self, mb, chunk):
        self._wait_for_live(chunk)

    def before_forward(self, mb, chunk):
        self.predictors[chunk].plan(self.lr_fn, self.lr_steps[chunk])
        self._predict(chunk, self.staleness[chunk][mb] + self.s_offset, self.include_weight_decay, key=("F", mb))
        if self.delay_compensation and self.staleness[chunk][mb] > 0:
            self.used[(mb, chunk)] = _clone(self.params[chunk])
            self._note_copies(chunk)

    def after_forward(self, mb, chunk):
        self._restore(chunk)

    def after_backward(self, mb, chunk):
        used = self.used.pop((mb, chunk), None)
        if used is not None:
            live = [p.data for p in self.params[chunk]]
            delay_compensate(self.params[chunk], live, used, self.delay_compensation,
                             self.delay_compensation_adaptive)
