"""Timeline simulator: how long a schedule takes, where its bubbles are, how much it keeps in flight.

Each rank runs its ops in list order. An op starts when its rank is free and its input message has
arrived (the sender's finish + t_p2p); sends never block (the executor's isend). A hand-off between two
chunks of the same rank (ZB-V's turn of the V: `comm_of` names the rank itself as the peer) is no
transfer (the executor keeps it in the rank's memory): it arrives at the sender's finish. Costs are per virtual
stage: a scalar (every virtual stage the same) or a list of D*v values indexed by `c*D + r`. A model
split into v chunks per rank therefore costs t/v per chunk when a whole stage costs t.

Zero-bubble ops (zero_bubble.py): `BackwardInput` costs t_backward, `BackwardWeight` costs t_weight, and
a fused `Backward` costs t_backward + t_weight (t_weight defaults to 0, so callers that give the whole
backward as t_backward are unchanged).

Optimizer steps: a scalar `t_step` is the cost of every Step op (as before); a list gives one value per
virtual stage, so Step(c) on rank r costs t_step[c*D + r] and Step(None) (the synchronous end of an
iteration, every chunk of the rank) the sum over the rank's chunks.

Bubble fraction = 1 - (sum of busy time over ranks) / (D * makespan): the share of rank-time spent idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedules import (BackwardInput, BackwardWeight, Forward, Op, Schedule, Step, check_schedule, comm_of,
                                            execution_order, op_label, virtual_stage)

Cost = Union[float, Sequence[float]]


@dataclass(frozen=True)
class TimelineEvent:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    schedule: Schedule
    events: list[TimelineEvent]  # in a valid execution order; per rank in op-list order
    makespan: float
    busy: dict[int, float]  # rank -> time spent computing
    bubble_fraction: float
    peak_activations: dict[int, int]  # rank -> max forwards whose backward (split: W) has not run yet

    def table(self, events: bool = False) -> str:
        """Per-rank summary (and, with events=True, every op with its start and end)."""
        s = self.schedule
        lines = [f"{s.name}: D={s.num_stages} v={s.num_chunks} M={s.num_microbatches}  "
                 f"makespan {self.makespan:.4g}  bubble {self.bubble_fraction:.4f}",
                 f"{'rank':>4} {'ops':>5} {'busy':>10} {'idle':>10} {'bubble':>7} {'peak act':>8}"]
        for r in sorted(self.busy):
            idle = self.makespan - self.busy[r]
            frac = idle / self.makespan if self.makespan > 0 else 0.0
            lines.append(f"{r:>4} {len(s.ops[r]):>5} {self.busy[r]:>10.4g} {idle:>10.4g} {frac:>7.4f} "
                         f"{self.peak_activations[r]:>8}")
        if events:
            lines.append(f"{'rank':>4} {'op':>6} {'start':>10} {'end':>10}")
            for e in sorted(self.events, key=lambda e: (e.rank, e.start, e.end)):
                lines.append(f"{e.rank:>4} {op_label(e.op, s.num_chunks):>6} {e.start:>10.4g} {e.end:>10.4g}")
        return "\n".join(lines)


def _per_virtual_stage(cost: Cost, name: str, num_virtual_stages: int) -> list[float]:
    values = [float(cost)] * num_virtual_stages if isinstance(cost, (int, float)) else [float(c) for c in cost]
    if len(values) != num_virtual_stages:
        raise ConfigError(f"{name} needs one value per virtual stage ({num_virtual_stages}), got {len(values)}")
    if any(c < 0 for c in values):
        raise ConfigError(f"{name} must be >= 0, got {values}")
    return values


def simulate(schedule: Schedule, t_forward: Cost, t_backward: Cost, t_p2p: float = 0.0,
             t_step: Cost = 0.0, t_weight: Cost = 0.0) -> Timeline:
    """Run `schedule` on an idealised machine; `t_step` is the cost of a Step op (a scalar: any Step; a
    list: per virtual stage), `t_weight` that of a BackwardWeight (a fused Backward costs t_backward + t_weight)."""
    stats = check_schedule(schedule)
    D, v = schedule.num_stages, schedule.num_chunks
    t_f = _per_virtual_stage(t_forward, "t_forward", D * v)
    t_b = _per_virtual_stage(t_backward, "t_backward", D * v)
    t_w = _per_virtual_stage(t_weight, "t_weight", D * v)
    if t_p2p < 0:
        raise ConfigError(f"t_p2p must be >= 0, got t_p2p={t_p2p}")
    step_per_stage = None if isinstance(t_step, (int, float)) else _per_virtual_stage(t_step, "t_step", D * v)
    if step_per_stage is None and t_step < 0:
        raise ConfigError(f"t_step must be >= 0, got t_step={t_step}")

    rank_free = {r: 0.0 for r in range(D)}
    arrival: dict[tuple[int, tuple], float] = {}  # (destination rank, message key) -> arrival time
    events: list[TimelineEvent] = []
    # execution_order is a topological order of the dependencies, so every input's arrival time is
    # known by the time its consumer is reached.
    for r, i in execution_order(schedule):
        op = schedule.ops[r][i]
        recv, send = comm_of(op, r, D, v, schedule.placement)
        start = rank_free[r] if recv is None else max(rank_free[r], arrival.pop((r, recv[1])))
        if isinstance(op, Step):
            if step_per_stage is None:
                duration = t_step
            else:
                chunks = range(v) if op.chunk is None else [op.chunk]
                duration = sum(step_per_stage[virtual_stage(r, c, D, schedule.placement)] for c in chunks)
        else:
            vs = virtual_stage(r, op.chunk, D, schedule.placement)
            if isinstance(op, Forward):
                duration = t_f[vs]
            elif isinstance(op, BackwardInput):
                duration = t_b[vs]
            elif isinstance(op, BackwardWeight):
                duration = t_w[vs]
            else:
                duration = t_b[vs] + t_w[vs]
        end = start + duration
        if send is not None:  # to another rank it pays the message; to this rank's own next chunk, nothing
            arrival[(send[0], send[1])] = end + (t_p2p if send[0] != r else 0.0)
        rank_free[r] = end
        events.append(TimelineEvent(r, op, start, end))

    makespan = max(rank_free.values(), default=0.0)
    busy = {r: 0.0 for r in range(D)}
    for e in events:
        busy[e.rank] += e.end - e.start
    bubble = 1.0 - sum(busy.values()) / (D * makespan) if makespan > 0 else 0.0
    return Timeline(schedule, events, makespan, busy, bubble, stats.peak_activations)


def plot_timeline(timeline: Timeline, path: str, title: str | None = None) -> str:
    """Gantt chart, one row per rank (rank 0 on top): forwards blue, backwards (split: input backwards)
    orange, weight backwards green (darker for later chunks), steps grey; the micro-batch number is printed in each box. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = timeline.schedule
    D, v = s.num_stages, s.num_chunks
    span = timeline.makespan or 1.0
    max_ops = max(len(ops) for ops in s.ops.values())
    width = min(40.0, max(10.0, 0.4 * max_ops))
    fig, ax = plt.subplots(figsize=(width, 0.55 * D + 1.6))
    forward_colors = plt.get_cmap("Blues")
    backward_colors = plt.get_cmap("Oranges")
    weight_colors = plt.get_cmap("Greens")
    has_weight = any(isinstance(op, BackwardWeight) for ops in s.ops.values() for op in ops)

    def shade(cmap, chunk):  # chunk 0 light, chunk v-1 dark
        return cmap(0.45 + 0.4 * (chunk / (v - 1) if v > 1 else 0.0))

    # The largest font whose widest micro-batch number fits the narrowest box (a digit is ~0.6 em wide).
    compute = [e for e in timeline.events if not isinstance(e.op, Step) and e.end > e.start]
    narrowest = min((e.end - e.start for e in compute), default=span)
    box_points = narrowest / span * width * 72 * 0.85
    fontsize = max(4.0, min(9.0, 0.8 * box_points / (0.6 * len(str(s.num_microbatches - 1)))))

    for e in timeline.events:
        y = D - 1 - e.rank
        if isinstance(e.op, Step):
            if e.end > e.start:
                ax.barh(y, e.end - e.start, left=e.start, height=0.8, color="0.6", edgecolor="black", linewidth=0.4)
            else:  # a free step: draw a marker so it stays visible
                ax.plot([e.start, e.start], [y - 0.4, y + 0.4], color="0.6", linewidth=1.5)
            continue
        cmap = (forward_colors if isinstance(e.op, Forward) else
                weight_colors if isinstance(e.op, BackwardWeight) else backward_colors)
        ax.barh(y, e.end - e.start, left=e.start, height=0.8, color=shade(cmap, e.op.chunk),
                edgecolor="black", linewidth=0.4)
        ax.text((e.start + e.end) / 2, y, str(e.op.microbatch), ha="center", va="center", fontsize=fontsize)

    ax.set_yticks(range(D))
    ax.set_yticklabels([f"rank {D - 1 - y}" for y in range(D)])
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, D - 0.4)
    ax.set_xlabel("time")
    handles = []
    for c in range(v):
        suffix = f" chunk {c}" if v > 1 else ""
        handles += [Patch(color=shade(forward_colors, c), label=f"forward{suffix}"),
                    Patch(color=shade(backward_colors, c), label=f"{'input ' if has_weight else ''}backward{suffix}")]
        if has_weight:
            handles.append(Patch(color=shade(weight_colors, c), label=f"weight backward{suffix}"))
    handles.append(Patch(color="0.6", label="optimizer step"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if D < 3 else -0.18),
              ncol=min(len(handles), 7), fontsize=8, frameon=False)
    ax.set_title(title or f"{s.name}  D={D} v={v} M={s.num_microbatches}   "
                 f"bubble {timeline.bubble_fraction:.3f}   makespan {timeline.makespan:.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
