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

How weights move: a micro-batch's forward saves the parameters themselves for its backward (autograd
keeps references, not copies), so whatever the parameter storage holds when the backward runs is what
the backward uses, while the activations come from the forward. Stashing swaps therefore write the
values in place through `.data` under no_grad (views saved by in-flight micro-batches see them, and the
parameters' autograd version counters are not bumped, so backwards of micro-batches in flight do not
fail). Swapping two full copies goes parameter by parameter through a one-parameter scratch tensor,
which is not counted as a weight copy. The predicting policies (SpecTrain, PipeOptim) instead point each
parameter at its predicted tensor for one pass and back after it, where every module of the chunk saves
the parameter itself rather than a view of its storage (our layers do: `tensor_parallel.layers.linear`),
and fall back to in-place writes with a cache otherwise; see `_PredictingPolicy`.

Activation recomputation (--recompute-*) reruns parts of F(j) inside B(j) on the weights F(j) ran on:
every policy says whether B(j) already runs on them or the forward's weights must be kept until then
(`_backward_sees_forward_weights`; pipeline/recompute_weights.py, docs/recomputation.md).
"""

from __future__ import annotations

import torch

from megatron_po.errors import ConfigError
from megatron_po.optim.predictors import build_predictor
from megatron_po.pipeline.error_feedback import ErrorFeedback
from megatron_po.pipeline.executor import WeightPolicy
from megatron_po.pipeline.fused_steps import StepFusedPrediction
from megatron_po.pipeline.recompute_weights import RecomputeWeights
from megatron_po.pipeline.schedules import Backward, Forward, Schedule, Step, staleness
from megatron_po.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from megatron_po.config import ASYNC_METHODS  # noqa: E402  (the flag choices live in the config)

STALENESS_LR_SCALINGS = ("none", "inverse", "inverse-sqrt")

# --------------------------------------------------------------------------------------------------
# Quantities derived from the schedule
# --------------------------------------------------------------------------------------------------


def shift_microbatches(schedule: Schedule, offset: int) -> Schedule:
    """The same schedule with every micro-batch id increased by `offset` (a segment of a longer stream:
    batches, p2p tags and staleness are then keyed by global micro-batch ids)."""
    def shift(op):
        if isinstance(op, Forward):
            return Forward(op.microbatch + offset, op.chunk)
        if isinstance(op, Backward):
            return Backward(op.microbatch + offset, op.chunk)
        return op
    ops = {r: [shift(op) for op in ops] for r, ops in schedule.ops.items()}
    return Schedule(schedule.name, schedule.num_stages, schedule.num_chunks, schedule.num_microbatches, ops)


def first_microbatch(schedule: Schedule) -> int:
    """The smallest micro-batch id in the schedule (0 unless it was shifted)."""
    return min(op.microbatch for ops in schedule.ops.values() for op in ops if not isinstance(op, Step))


def update_interval_of(schedule: Schedule) -> int:
    """k: backwards of a chunk per Step of that chunk, read from the op list (the first step's group)."""
    intervals = []
    for ops in schedule.ops.values():
        count: dict[int, int] = {}
        done: set[int] = set()
        for op in ops:
            if isinstance(op, Backward):
                count[op.chunk] = count.get(op.chunk, 0) + 1
            elif isinstance(op, Step):
                for c in (list(count) if op.chunk is None else [op.chunk]):
                    if c not in done:
                        done.add(c)
                        intervals.append(count[c])
    return min(intervals)


def spectrain_staleness(schedule: Schedule) -> dict[tuple[int, int], dict[int, tuple[int, int]]]:
    """(s_f, s_b) per (rank, chunk) and micro-batch: the steps a chunk takes from F(j), resp. B(j), until
    micro-batch j's round trip ends (the end of its backward on virtual stage 0).

    SpecTrain predicts every pass to the weights the stage will hold when the micro-batch completes. The
    steps between F(j) and B(j) are s(j) from the op list; those after B(j) are counted on the schedule's
    timeline with unit forward and backward costs (the timing SpecTrain's derivation assumes). For the
    straight pipeline with k = 1 this gives the paper's s_f = ⌊r/2⌋ + D-r-1 and s_b = ⌊r/2⌋ in the
    steady state; interleaved schedules and k > 1 get their own values the same way.
    """
    from megatron_po.pipeline.simulator import simulate
    offset = first_microbatch(schedule)
    local = shift_microbatches(schedule, -offset)  # the simulator checks ids are 0..M-1
    timeline = simulate(local, 1.0, 1.0)
    done = {e.op.microbatch: e.end for e in timeline.events
            if e.rank == 0 and isinstance(e.op, Backward) and e.op.chunk == 0}
    backward_end = {(e.rank, e.op.chunk, e.op.microbatch): e.end for e in timeline.events
                    if isinstance(e.op, Backward)}
    step_times: dict[tuple[int, int], list[float]] = {}
    for e in timeline.events:
        if isinstance(e.op, Step):
            chunks = range(local.num_chunks) if e.op.chunk is None else [e.op.chunk]
            for c in chunks:
                step_times.setdefault((e.rank, c), []).append(e.end)
    out = {}
    for (r, c), per_mb in staleness(local).items():
        times = step_times.get((r, c), [])
        out[(r, c)] = {}
        for mb, s in per_mb.items():
            after_backward = sum(1 for t in times if backward_end[(r, c, mb)] < t <= done[mb])
            out[(r, c)][mb + offset] = (s + after_backward, after_backward)
    return out


# --------------------------------------------------------------------------------------------------
# Moving weights without autograd noticing
# --------------------------------------------------------------------------------------------------


def chunk_parameters(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(chunk.parameters())


@torch.no_grad()
def _clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.data.clone() for p in params]


@torch.no_grad()
def _copy_into(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    torch._foreach_copy_([p.data for p in params], values)


@torch.no_grad()
def _swap(params: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    """Exchange the parameters' values with `other` in place, one parameter-sized scratch at a time."""
    for p, o in zip(params, other):
        scratch = p.data.clone()
        p.data.copy_(o)
        o.copy_(scratch)


def check_untied(chunks) -> None:
    """Tied input/output embeddings are kept equal by a cross-stage gradient all-reduce before a common
    step, which asynchronous stages do not have."""
    for chunk in chunks:
        if any(getattr(p, "shared_embedding", False) for p in chunk.parameters()):
            raise ConfigError("asynchronous pipeline methods need --untie-embeddings-and-output-weights")


# --------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------


class AsyncPolicy(RecomputeWeights, WeightPolicy):
    """Shared bookkeeping: the chunks' parameters, their optimizers, the steps each chunk has taken,
    the schedule's staleness for this rank, and the weight copies alive per chunk.

    `use_schedule(schedule)` installs the schedule of the segment about to run (its micro-batch ids may
    be global); policy state that must outlive a segment (2BW's older version, step counts) is kept.
    """

    options: tuple[str, ...] = ("staleness_lr_scaling", "error_feedback")
    lr_fn = None  # lr_fn(i) = the base lr of a chunk's i-th applied update; set by the stage (and predictors)

    def __init__(self, rank: int, chunks, optimizers, schedule: Schedule | None = None,
                 staleness_lr_scaling: str = "none", error_feedback: bool = False):
        if len(optimizers) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(optimizers)} optimizers (one per chunk)")
        if staleness_lr_scaling not in STALENESS_LR_SCALINGS:
            raise ConfigError(f"unknown staleness lr scaling {staleness_lr_scaling!r}; valid: "
                              f"{', '.join(STALENESS_LR_SCALINGS)}")
        self.staleness_lr_scaling = staleness_lr_scaling
        self.rank = rank
        self.chunks = list(chunks)
        self.optimizers = list(optimizers)
        self.params = [chunk_parameters(c) for c in self.chunks]
        self.steps = [0] * len(self.chunks)  # optimizer steps taken by each chunk
        # Of them, the updates applied (not skipped for inf/NaN gradients): the chunk's lr clock, lr_fn(lr_steps[c]),
        # advanced by the stage (a skipped fp16 step leaves the lr as it was, as Megatron-LM's scheduler does).
        self.lr_steps = [0] * len(self.chunks)
        self._max_copies = [1] * len(self.chunks)
        self.schedule = None
        self.staleness: dict[int, dict[int, int]] = {}
        self._step_staleness: list[list[list[int]]] = [[] for _ in self.chunks]  # chunk -> step -> s of its mbs
        self._segment_first_step = [0] * len(self.chunks)
        # --async-error-feedback: the stage applies it around each optimizer step with `gradient_delay`
        self.error_feedback = ErrorFeedback(self.params) if error_feedback else None
        if schedule is not None:
            self.use_schedule(schedule)

    def use_schedule(self, schedule: Schedule) -> None:
        if schedule.num_chunks != len(self.chunks):
            raise ValueError(f"schedule has {schedule.num_chunks} chunks per rank, policy {len(self.chunks)}")
        self.schedule = schedule
        self.staleness = {c: s for (r, c), s in staleness(schedule).items() if r == self.rank}
        # The micro-batches whose gradients each Step(c) of this segment applies: the backwards of chunk
        # c since its previous step, in the op list.
        self._step_staleness = [[] for _ in self.chunks]
        pending: dict[int, list[int]] = {c: [] for c in range(len(self.chunks))}
        for op in schedule.ops.get(self.rank, []):
            if isinstance(op, Backward):
                pending[op.chunk].append(self.staleness[op.chunk][op.microbatch])
            elif isinstance(op, Step):
                for c in (range(len(self.chunks)) if op.chunk is None else [op.chunk]):
                    self._step_staleness[c].append(pending[c])
                    pending[c] = []
        self._segment_first_step = list(self.steps)

    def gradient_staleness(self, chunk: int) -> list[int]:
        """s(j) of each micro-batch whose gradient the chunk's next step applies (from the schedule)."""
        return self._step_staleness[chunk][self.steps[chunk] - self._segment_first_step[chunk]]

    def lr_scale(self, chunk: int) -> float:
        """Factor on the lr of the chunk's next step (staleness-aware step scaling, `staleness_lr_scaling`):
        the mean over the step's micro-batches of 1/(1+s) ("inverse", Zhang et al.'s staleness-aware
        async SGD, lr/τ with τ = s+1 the gradient's age in steps) or 1/√(1+s) ("inverse-sqrt"); 1 for "none"."""
        if self.staleness_lr_scaling == "none":
            return 1.0
        power = 1.0 if self.staleness_lr_scaling == "inverse" else 0.5
        ages = self.gradient_staleness(chunk)
        return sum((1 + s) ** -power for s in ages) / len(ages)

    def gradient_delay(self, chunk: int) -> float:
        """Steps between the weights the chunk's next step's gradients were taken at and the weights it
        updates (error feedback's s): the mean s(j) of the step's micro-batches, from the schedule."""
        ages = self.gradient_staleness(chunk)
        return sum(ages) / len(ages)

    def after_step(self, chunk: int) -> None:
        self.steps[chunk] += 1

    def state_dict(self) -> dict:
        """What a checkpoint taken at a drain must keep: the steps every chunk has taken (equal at a
        drain), each chunk's lr clock `lr_steps` (its applied updates) and, per live parameter, the extra
        weight versions held ({param: {key: tensor like it}}).
        Nothing is in flight at a drain, so PipeDream's stash is empty and the predicting policies' cache
        holds nothing the live weights do not: only 2BW keeps a version (its older one)."""
        weights = self.error_feedback.state_dict() if self.error_feedback is not None else {}
        return {"steps": max(self.steps, default=0), "weights": weights, "lr_steps": list(self.lr_steps)}

    def load_targets(self, keys: dict) -> dict:
        """{param: {key: tensor}}: the weight versions this policy keeps that a checkpoint holding the
        entries `keys` ({param: key names}) loads into in place: the tensors held, or, where none is held
        yet, created now as the policy's own code creates them (like the live weights). Versions this
        policy does not keep are not loaded."""
        return self.error_feedback.load_targets(keys) if self.error_feedback is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [state["steps"]] * len(self.chunks)
        self.lr_steps[:] = state.get("lr_steps") or self.steps  # in place (the stage shares it); none: no skips
        if self.error_feedback is not None:
            self.error_feedback.load_state_dict(state["weights"])

    def copies(self, chunk: int) -> int:
        """Full weight copies of `chunk` alive right now, the live weights included."""
        return 1 + self._recompute_copies(chunk)

    def _note_copies(self, chunk: int) -> None:
        self._max_copies[chunk] = max(self._max_copies[chunk], self.copies(chunk))

    def copies_per_chunk(self) -> dict[int, int]:
        """The most weight copies (live weights included) each chunk has held at once so far."""
        return dict(enumerate(self._max_copies))


class AsyncNaivePolicy(AsyncPolicy):
    """Forward on the live weights, backward on whatever is live then (newer): inconsistent and stale."""


class _DelayCompensating:
    """Delay compensation's options for the policies that know the weights each forward ran on."""

    def _set_delay_compensation(self, lam: float, adaptive: bool) -> None:
        if not lam >= 0:
            raise ConfigError(f"the delay-compensation lambda must be >= 0, got {lam!r}")
        self.delay_compensation, self.delay_compensation_adaptive = float(lam), bool(adaptive)

    def use_schedule(self, schedule):
        k = update_interval_of(schedule)
        if self.delay_compensation and k != 1:
            raise ConfigError(f"delay compensation corrects each micro-batch's gradient with its own weight "
                              f"difference, which needs one micro-batch per step (update interval k = 1, got {k})")
        super().use_schedule(schedule)


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


def _backward_reads_parameters(chunk: torch.nn.Module) -> bool:
    """Whether every module of the chunk that owns parameters is one whose autograd saves the parameters
    themselves (not views of their storage) for the backward, so that pointing a parameter at other
    storage for a forward and back before the backward makes the backward read the live weights: our
    tensor-parallel linears (`tensor_parallel.layers.linear`), embeddings (whose backward reads no
    weight) and torch's LayerNorm / RMSNorm. F.linear, for one, saves a transposed view instead."""
    known = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, torch.nn.Embedding,
             torch.nn.LayerNorm, torch.nn.RMSNorm)
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
        self.swaps = [_backward_reads_parameters(c) for c in chunks]
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
            opt.start_gathers(async_op=opt.ddp.overlap_param_gather)
        opt.point_model_at(slot)
        self.predicted[chunk] = True
        self._note_copies(chunk)

    def _wait_for_live(self, chunk: int) -> None:
        """A backward reads the weights outside any forward pre-hook: wait for a pending all-gather."""
        if self.gathers[chunk]:
            self.optimizers[chunk].finish_param_sync()

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
        if hasattr(opt, "predict_model_params"):
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
            elif hasattr(opt, "restore_model_params"):
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


@torch.no_grad()
def delay_compensate(params, live, used, lam: float, adaptive: bool = False) -> None:
    """g ← g + λ·g⊙g⊙(W_live − W_used) for every parameter with a gradient (DC-ASGD, Zheng et al. 2017:
    g⊙g is the diagonal outer-product approximation of the Hessian). `adaptive`: λ/RMS(g) per tensor.
    One parameter-sized temporary at a time."""
    for p, w_live, w_used in zip(params, live, used):
        g = p.grad
        if g is None:
            continue
        scale = lam
        if adaptive:
            rms = g.float().pow(2).mean().sqrt().item()
            if rms == 0:
                continue
            scale = lam / rms
        correction = (w_live - w_used).mul_(g)
        g.addcmul_(correction, g, value=scale)


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
