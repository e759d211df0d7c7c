"""The simulated clocks of the time-to-quality study (bench/time_to_quality/time_to_quality.py): seconds per micro-batch of
every configuration from per-op costs and each schedule's op list.

A clock is a set of per-op costs per (D, optimizer) in the calibration's format ({method: {"rank":
{"Forward", "Backward", "Step"[, "BackwardInput", "BackwardWeight"]: seconds}}}):
- the CPU clock: the study's own calibration (the tiny model on one CPU thread, `calibrate_job`);
- a cost-model clock: bench/time_to_quality/ttq_cost_model.py's per-op ratios measured on real hardware (`--cost-model`).
The curves (validation loss against micro-batches) are the same under every clock; only the seconds per
micro-batch change. `scale_steps` prices the optimizer steps at a given step/(forward+backward), the rest of
the clock fixed (the report's sensitivity line).

Simulated time (free communication, stages in parallel):
- synchronous, M micro-batches of B samples per update (`convergence.sync_seconds_per_update`): one flush of
  the schedule's op list (`simulate`) + the slowest stage's optimizer step, op costs = the clock's async-naive
  costs (the shared base cost of a forward / backward of B samples, no policy work). Interleaved 1F1B (v = 2): each chunk costs half its
  stage; ZB-H1: the backward split into input and weight gradients (the clock's BackwardInput /
  BackwardWeight where it has them, else B = W = half of the backward, as bench/schedules/zero_bubble.py assumes);
- synchronous at equal updates (one update per micro-batch of B): 1F1B over M = D micro-batches of B/D (the
  equal-updates reference's own split, convergence.py's GPipe/1F1B check), each op costing 1/D of B's (linear
  in samples: optimistic for this baseline, a GPU runs small micro-batches less efficiently) + one step;
- asynchronous: `convergence.async_tokens_per_s` (steady state of the no-flush stream, the step folded into
  the backwards, 1/k per backward) from each method's own op costs (base + its policy hooks).
"""

from __future__ import annotations

import dataclasses

import ttq_cost_model
import ttq_run as tr
from bench_common import first_reach
from megatron_po.pipeline.cost_model import format_speedup as fmt_speedup  # noqa: F401 (tc.fmt_speedup)
from ttq_run import LABELS, SYNC_SCHEDULES, Unit, cv

COLORS = {"sync": "black", "async-naive": "tab:gray", "pipedream": "tab:blue", "pipedream-2bw": "tab:green",
          "pipeoptim": "tab:red", "pipenag": "tab:purple", "2bw-ef": "tab:olive"}
SYNC_STYLE = {1: ":", 2: "-", 4: "--"}  # M / D -> line style
SCHED_COLORS = {"1f1b": "black", "interleaved-1f1b": "tab:brown", "zb-h1": "tab:cyan"}
EQUAL_UPDATES_LABEL = "sync, 1 update per micro-batch (1F1B, M=D of B/D)"


@dataclasses.dataclass(frozen=True)
class Clock:
    """Per-op costs of one clock: `ops[(D, optimizer)]` in the calibration's format; `tokens_per_mb` for its
    tokens/s column."""
    key: str
    label: str
    ops: dict
    tokens_per_mb: float
    cost_model: dict | None = None
    source: str | None = None  # the cost model's file

    def block(self, D: int, opt: str) -> dict | None:
        return self.ops.get((D, opt))


def cpu_clock(study: dict) -> Clock:
    return Clock("cpu", "per-op costs of the tiny model on one CPU thread (the study's calibration)",
                 {k: c["op_times"] for k, c in study["calibrations"].items()}, study["tokens_per_microbatch"])


def model_clock(cm: dict, study: dict, source: str | None = None) -> Clock:
    """The clock of cost model `cm` for every (D, optimizer) the study calibrated, its methods."""
    ops = {}
    for (D, opt), c in study["calibrations"].items():
        block = ttq_cost_model.op_times(cm, D, opt, list(c["op_times"]))
        if block:
            ops[(D, opt)] = block
    return Clock("gpu", f"cost model {cm['name']} ({cm['device']})", ops, cm["tokens_per_microbatch"], cost_model=cm,
                 source=source)


def scale_steps(ops: dict, ratio: float) -> dict:
    """ops with the optimizer steps priced at `ratio` x forward+backward (mean over stages, as
    `step_ratio_of`): every stage's measured step scaled by one factor (the steps' profile over the stages
    kept; on uniform stages each stage's step is then ratio x its forward+backward), each method's own Step
    hook time (its Step minus async-naive's) kept as it is."""
    base = ops["async-naive"]
    own = step_ratio_of(ops)
    out = {}
    for m, per in ops.items():
        out[m] = {}
        for r, c in per.items():
            b = base[r]
            step = b["Step"] * ratio / own if own > 0 else ratio * (b["Forward"] + b["Backward"])
            out[m][r] = {**c, "Step": step + max(0.0, c["Step"] - b["Step"])}
    return out


def step_ratio_of(ops: dict) -> float:
    """The clock's own step / (forward + backward), mean over stages (async-naive's base costs)."""
    base = ops["async-naive"]
    return sum(c["Step"] / (c["Forward"] + c["Backward"]) for c in base.values()) / len(base)


# --------------------------------------------------------------------------------------------------
# Seconds per micro-batch of B samples
# --------------------------------------------------------------------------------------------------


def equal_updates_seconds_per_mb(op: dict, D: int) -> float:
    """Synchronous training at one update per micro-batch of B: 1F1B over D micro-batches of B/D + a step."""
    return sync_seconds_per_update("1f1b", op, D, D, scale=1.0 / D)


update_interval = cv.default_interval  # (1; PipeDream-2BW and its variants: D)
sync_seconds_per_update = cv.sync_seconds_per_update  # (one flush + the slowest stage's step)


def async_seconds_per_mb(op: dict, D: int, k: int) -> float:
    return 1.0 / cv.async_tokens_per_s(op, D, k, 1)


def time_to(curve: list, target: float, sec_per_mb: float) -> float | None:
    """Simulated seconds until the validation curve [(micro-batches, loss)] first reaches `target`,
    interpolated linearly between evaluations (bench_common.first_reach); None if it never does."""
    x = first_reach(curve, target)
    return None if x is None else x * sec_per_mb


def configurations(s, study: dict, D: int, o: str, clock: Clock | None = None) -> list[dict]:
    """Rows of (D, optimizer o) on `clock` (default: the CPU clock): every synchronous schedule at M = 2D,
    4D, synchronous training at equal updates, and every asynchronous unit the clock prices, with its unit,
    runs, tokens/s and seconds per micro-batch of B."""
    clock = clock or cpu_clock(study)
    tpm = clock.tokens_per_mb
    rows = []
    ops = clock.block(D, o)
    for M in (2 * D, 4 * D):
        u = Unit(o, "sync", 0, M)
        if u not in study["runs"] or ops is None:
            continue
        for sched in SYNC_SCHEDULES:
            if sched in s.methods:
                sec = sync_seconds_per_update(sched, ops["async-naive"], D, M) / M
                rows.append({"name": sched, "label": f"{LABELS[sched]}, M={M}", "unit": u, "sec_per_mb": sec,
                             "tps": tpm / sec, "M": M, "color": SCHED_COLORS[sched], "style": SYNC_STYLE[M // D]})
    u = Unit(o, "sync", 0, 1)
    if u in study["runs"] and ops is not None:
        sec = equal_updates_seconds_per_mb(ops["async-naive"], D)
        rows.append({"name": "sync", "label": EQUAL_UPDATES_LABEL, "unit": u, "sec_per_mb": sec, "tps": tpm / sec,
                     "M": 1, "color": "black", "style": SYNC_STYLE[1]})
    for u in tr.async_units(o, D):
        m, block = u.name, clock.block(D, u.opt)
        if u not in study["runs"] or block is None or m not in block:
            continue
        k = update_interval(m, D)
        sec = async_seconds_per_mb(block[m], D, k)
        rows.append({"name": m, "label": LABELS[m] + f", k={k}", "unit": u,
                     "sec_per_mb": sec, "tps": tpm / sec, "color": COLORS[m], "style": "-"})
    return rows


# --------------------------------------------------------------------------------------------------
# The largest step cost at which a speed-up still clears the bar (printing: cost_model.format_speedup)
# --------------------------------------------------------------------------------------------------


def largest_ratio(speedup_at, bar: float, hi: float = 64.0, tol: float = 1e-6) -> float | None:
    """Largest r in [0, hi] with speedup_at(r) >= bar, for speedup_at non-increasing in r (bisection to
    tol x max(1, r)). None: under the bar already at r = 0; hi: still over it at r = hi."""
    if speedup_at(0.0) < bar:
        return None
    if speedup_at(hi) >= bar:
        return hi
    lo = 0.0
    while hi - lo > tol * max(1.0, lo):
        mid = (lo + hi) / 2
        if speedup_at(mid) >= bar:
            lo = mid
        else:
            hi = mid
    return lo
