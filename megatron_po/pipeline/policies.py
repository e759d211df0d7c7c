"""Weight-version policies: which weights each forward and backward of an asynchronous pipeline uses.

The asynchronous methods of docs/ASYNC_PIPELINES.md all run the same no-flush 1F1B stream
(`schedules.async_one_f_one_b`); they differ only in the weights a micro-batch's forward and backward
see. A policy is one object per pipeline rank, managing all of its model chunks; the StageRunner calls
its hooks around every pass and step (executor.py) and never knows which method runs:

| method         | forward of mb j                 | backward of mb j                | copies per chunk     |
|----------------|---------------------------------|---------------------------------|----------------------|
| async-naive    | live                            | live (newer)                    | 1                    |
| pipedream      | live, stashed as a version      | the stashed version             | s_max + 1 (D-r)      |
| pipedream-2bw  | W(g-1), g = steps before B(j)   | W(g-1) (the older version)      | 2                    |
| spectrain      | W - s_f·η·v (momentum buffer)   | W - s_b·η·v                     | 2 (live + cache)     |
| pipeoptim      | W - s·η·ΔW, s = s(j) + s_offset | live                            | 2 (live + cache)     |
| pipenag        | w + γ(w − w_prev) at F(j)       | the same look-ahead point       | s_max + 2            |

(pipenag lives in pipenag.py, which registers itself in POLICIES. Every method also takes
`error_feedback` (--async-error-feedback, error_feedback.py): the stage corrects each step by
−s·(u_t − u_{t−1}) with s = `gradient_delay(chunk)`, which each policy answers from the schedule.)

Every staleness a policy uses comes from the schedule's op list (`schedules.staleness`) or, for
SpecTrain's backward, from the schedule's unit-cost timeline; nothing assumes D-r-1.

Beyond the paper (options; defaults reproduce the methods above): PipeOptim's `weight_predictor`,
`prediction_horizon`, `rollout_gradient` choose how far along ΔW it predicts (optim/predictors.py: the LR
schedule's future lrs, a rollout of the optimizer's recurrences, a √s horizon), still one fused pass per
forward; `delay_compensation` (PipeDream, PipeOptim) corrects each gradient toward the live weights,
g + λ·g⊙g⊙(W_live − W_used), before the step; `staleness_lr_scaling` (every method) divides the lr of a
step by a function of its gradients' staleness s(j), read from the schedule like everything else.

The pieces: what every policy shares (the schedule's quantities, moving weights without autograd
noticing, the base class `AsyncPolicy`, delay compensation) is async_policy.py; the predicting policies
(SpecTrain, PipeOptim) are predicting_policies.py; the stashing ones (PipeDream, 2BW), async-naive and the
registry `POLICIES` / `build_policy` are here.
"""

from __future__ import annotations

import torch

from megatron_po.config import ASYNC_METHODS  # the flag choices live in the config
from megatron_po.errors import ConfigError
from megatron_po.pipeline.async_policy import (AsyncPolicy, _clone, _copy_into, _DelayCompensating, _swap,
                                               check_untied, delay_compensate, update_interval_of)
from megatron_po.pipeline.predicting_policies import PipeOptimPolicy, SpecTrainPolicy
from megatron_po.pipeline.schedules import Schedule


class AsyncNaivePolicy(AsyncPolicy):
    """Forward on the live weights, backward on whatever is live then (newer): inconsistent and stale."""


class PipeDreamPolicy(_DelayCompensating, AsyncPolicy):
    """Weight stashing: F(j) runs on the live weights and remembers their version (the chunk's step
    count); B(j) swaps that version in, computes the gradients, and swaps the live weights back.

    A version is copied only when a step is about to overwrite it while a micro-batch that saw it is
    still in flight, and freed once the last such micro-batch has run its backward. Micro-batches that
    saw the same version share one copy, so a chunk holds at most s_max + 1 copies (D-r in the straight
    pipeline with k = 1). Update: W_{t+1} = W_t - η·U(∇f(W_{t-s})).
    """

    options = AsyncPolicy.options + ("delay_compensation", "delay_compensation_adaptive")

    def __init__(self, rank, chunks, optimizers, schedule=None, delay_compensation: float = 0.0,
                 delay_compensation_adaptive: bool = False, **options):
        self.version_of: dict[tuple[int, int], int] = {}  # (mb, chunk) in flight -> version it saw
        self.stash: list[dict[int, list[torch.Tensor]]] = [{} for _ in chunks]  # chunk -> version -> W
        self._set_delay_compensation(delay_compensation, delay_compensation_adaptive)
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def copies(self, chunk):
        return 1 + len(self.stash[chunk])

    def _backward_sees_forward_weights(self, mb, chunk):
        return True  # B(j) swaps in the version F(j) ran on

    def _in_flight_versions(self, chunk: int) -> set[int]:
        return {v for (_, c), v in self.version_of.items() if c == chunk}

    def before_forward(self, mb, chunk):
        self.version_of[(mb, chunk)] = self.steps[chunk]

    def before_step(self, chunk):
        live = self.steps[chunk]
        if live in self._in_flight_versions(chunk) and live not in self.stash[chunk]:
            self.stash[chunk][live] = _clone(self.params[chunk])
            self._note_copies(chunk)

    def before_backward(self, mb, chunk):
        version = self.version_of[(mb, chunk)]
        if version != self.steps[chunk]:
            _swap(self.params[chunk], self.stash[chunk][version])

    def after_backward(self, mb, chunk):
        version = self.version_of.pop((mb, chunk))
        if version != self.steps[chunk]:
            if self.delay_compensation:  # the stash slot holds the live weights while `version` is in
                delay_compensate(self.params[chunk], self.stash[chunk][version], [p.data for p in self.params[chunk]],
                                 self.delay_compensation, self.delay_compensation_adaptive)
            _swap(self.params[chunk], self.stash[chunk][version])
            if version not in self._in_flight_versions(chunk):
                del self.stash[chunk][version]


class PipeDream2BWPolicy(AsyncPolicy):
    """Two weight versions and a delay of exactly one step: W(t+1) = W(t) - η·U(∇f(W(t-1))).

    Each chunk steps after every m = k of its backwards (m >= D). Micro-batch j, whose backward falls
    between step g and step g+1 (g = the chunk's step count at B(j)), runs both passes on W(g-1)
    (W(-1) = W(0)): at B(j) that is the older of the two versions; at F(j) it is the live one if the
    next step comes before B(j) (s(j) = 1), else the older one. This needs s(j) <= 1 for every
    micro-batch, which m >= D guarantees for the straight pipeline; interleaved schedules may need a
    larger m, and any schedule that violates it is rejected (ConfigError).
    """

    def __init__(self, rank, chunks, optimizers, schedule=None, **options):
        self.older: list[list[torch.Tensor] | None] = [None] * len(chunks)  # W(t-1) once t >= 1
        self.version_of: dict[tuple[int, int], int] = {}
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def use_schedule(self, schedule):
        m, D = update_interval_of(schedule), schedule.num_stages
        if m < D:
            raise ConfigError(f"pipedream-2bw accumulates gradients over m >= D micro-batches per step: "
                              f"got update interval m={m} < D={D} pipeline stages")
        super().use_schedule(schedule)
        worst = max((s for per_mb in self.staleness.values() for s in per_mb.values()), default=0)
        if worst > 1:
            raise ConfigError(f"pipedream-2bw needs every micro-batch's forward and backward within one "
                              f"step of each other, but this schedule (D={D}, v={schedule.num_chunks}, "
                              f"m={m}) has staleness {worst} on rank {self.rank}: use a larger update "
                              "interval")

    def copies(self, chunk):
        return 1 if self.older[chunk] is None else 2

    def gradient_delay(self, chunk):
        return 1 if self.steps[chunk] > 0 else 0  # W(t-1) every step, W(0) itself at the first

    def _backward_sees_forward_weights(self, mb, chunk):
        return True  # both passes of micro-batch j run on W(g-1)

    def state_dict(self):
        state = super().state_dict()
        for params, older in zip(self.params, self.older):
            for p, o in zip(params, older if older is not None else []):
                state["weights"].setdefault(p, {})["older"] = o
        return state

    def load_targets(self, keys):
        out = super().load_targets(keys)
        for c, params in enumerate(self.params):
            if all("older" in keys.get(p, ()) for p in params):
                if self.older[c] is None:
                    self.older[c] = _clone(params)  # as the first step creates it
                for p, o in zip(params, self.older[c]):
                    out.setdefault(p, {})["older"] = o
        return out

    @torch.no_grad()
    def load_state_dict(self, state):
        """W(t-1) copied into the version held (`load_targets`: the same tensors when a checkpoint load
        filled them already)."""
        super().load_state_dict(state)
        weights = state["weights"]
        self.load_targets({p: tuple(w) for p, w in weights.items()})
        for c, params in enumerate(self.params):
            if all("older" in weights.get(p, {}) for p in params):
                for o, p in zip(self.older[c], params):
                    if weights[p]["older"] is not o:
                        o.copy_(weights[p]["older"])
            elif self.steps[c] > 0:  # saved by another method: W(t-1) unknown, take W(t) as at the start
                if self.older[c] is None:
                    self.older[c] = _clone(params)
                else:
                    _copy_into(self.older[c], [p.data for p in params])
            self._note_copies(c)

    def _swap_in(self, chunk: int, version: int) -> None:
        if version == self.steps[chunk]:
            return  # the live weights
        assert version == self.steps[chunk] - 1, "2BW keeps only the live and the previous version"
        _swap(self.params[chunk], self.older[chunk])  # the same call swaps back

    def before_forward(self, mb, chunk):
        version = max(self.steps[chunk] + self.staleness[chunk][mb] - 1, 0)
        self.version_of[(mb, chunk)] = version
        self._swap_in(chunk, version)

    def after_forward(self, mb, chunk):
        self._swap_in(chunk, self.version_of[(mb, chunk)])

    def before_backward(self, mb, chunk):
        self._swap_in(chunk, self.version_of[(mb, chunk)])

    def after_backward(self, mb, chunk):
        self._swap_in(chunk, self.version_of.pop((mb, chunk)))

    def before_step(self, chunk):
        if self.older[chunk] is None:
            self.older[chunk] = _clone(self.params[chunk])
            self._note_copies(chunk)
        else:
            _copy_into(self.older[chunk], [p.data for p in self.params[chunk]])


POLICIES = {
    "async-naive": AsyncNaivePolicy,
    "pipedream": PipeDreamPolicy,
    "pipedream-2bw": PipeDream2BWPolicy,
    "spectrain": SpecTrainPolicy,
    "pipeoptim": PipeOptimPolicy,
}


def build_policy(method: str, rank: int, chunks, optimizers, schedule: Schedule | None, **options) -> AsyncPolicy:
    """The weight policy of an asynchronous `method` for pipeline rank `rank` (all of its chunks, one
    optimizer per chunk). `schedule` is the async schedule it runs (replace it per segment with
    `use_schedule`). Unknown methods, options a method does not take and tied embeddings are ConfigErrors."""
    if method not in POLICIES:
        raise ConfigError(f"unknown asynchronous pipeline method {method!r}; valid: {', '.join(ASYNC_METHODS)}")
    cls = POLICIES[method]
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        valid = ", ".join(cls.options) or "none"
        raise ConfigError(f"option(s) {', '.join(unknown)} do not apply to {method} (its options: {valid})")
    check_untied(chunks)
    return cls(rank, chunks, optimizers, schedule, **options)
