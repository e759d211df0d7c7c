"""What every asynchronous weight policy shares (the policies: policies.py, predicting_policies.py,
pipenag.py): the quantities they read off the schedule, moving weights without autograd noticing, and the
base class `AsyncPolicy` with its bookkeeping (steps, staleness, weight copies, staleness lr scaling,
error feedback), plus delay compensation, which PipeDream and PipeOptim both take.

How weights move: a micro-batch's forward saves the parameters themselves for its backward (autograd
keeps references, not copies), so whatever the parameter storage holds when the backward runs is what
the backward uses, while the activations come from the forward. Stashing swaps therefore write the
values in place through `.data` under no_grad (views saved by in-flight micro-batches see them, and the
parameters' autograd version counters are not bumped, so backwards of micro-batches in flight do not
fail). Swapping two full copies goes parameter by parameter through a one-parameter scratch tensor,
which is not counted as a weight copy.

Activation recomputation (--recompute-*) reruns parts of F(j) inside B(j) on the weights F(j) ran on:
every policy says whether B(j) already runs on them or the forward's weights must be kept until then
(`_backward_sees_forward_weights`; pipeline/recompute_weights.py, docs/recomputation.md).
"""

from __future__ import annotations

import torch

from megatron_po.distributed.fsdp import local_shard
from megatron_po.errors import ConfigError
from megatron_po.pipeline.error_feedback import ErrorFeedback
from megatron_po.pipeline.executor import WeightPolicy
from megatron_po.pipeline.recompute_weights import RecomputeWeights
from megatron_po.pipeline.schedules import Backward, Forward, Schedule, Step, staleness

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


def chunk_parameters(chunk: torch.nn.Module) -> list[torch.Tensor]:
    """The weights a policy moves: the parameters, or of an FSDP2 chunk this rank's shards of them (what the
    gathers of the chunk's next forward or backward deliver: distributed/fsdp.py)."""
    return [local_shard(p) for p in chunk.parameters()]


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


# --------------------------------------------------------------------------------------------------
# Delay compensation (PipeDream, PipeOptim)
# --------------------------------------------------------------------------------------------------


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
