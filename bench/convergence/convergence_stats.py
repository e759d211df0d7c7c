"""bench/convergence/convergence.py's statistics: mean ± std over seeds, the verdict rule (a difference is real only
beyond the spread), final losses of a run, the summary rows of every (D, optimizer, method) and the
fraction of PipeOptim's gap a variant closes."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from convergence_measure import async_tokens_per_s, sync_seconds_per_update
from convergence_settings import ALL_METHODS, SYNC_METHODS, Settings


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(mean: float, std: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "diverged" if mean != mean else f"{mean}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def compare(a: tuple[float, float], b: tuple[float, float], n: int) -> str:
    """Verdict on mean a vs mean b (lower is better): a difference is real only when it exceeds the
    spread, i.e. when the mean ± std intervals do not overlap (|Δ| > std_a + std_b)."""
    (ma, sa), (mb, sb) = a, b
    if not (math.isfinite(ma) and math.isfinite(mb)):
        return "n/a"
    if n < 2:
        return "one seed: no spread"
    if abs(ma - mb) <= sa + sb:
        return "within spread"
    return "better (real)" if ma < mb else "worse (real)"


def _final_train(r: dict, tail: int) -> float | None:
    losses = r["losses"]
    if len(losses) < tail:
        return float("nan")
    return statistics.fmean(losses[-tail:])


def _final_val(r: dict, steps: int) -> float:
    if not r["val"] or r["val"][-1][0] != steps:
        return float("nan")
    return r["val"][-1][1]


def summarize(s: Settings, results: list[dict], tokens_per_mb: int) -> dict:
    """Rows of the main table, keyed (D, optimizer, method), with per-seed values for paired comparisons."""
    train = defaultdict(dict)  # (D, opt, method) -> {seed: result}
    calib = {}
    for r in results:
        if r["kind"] == "calibrate":
            calib[(r["D"], r["optimizer"])] = r
        else:
            train[(r["D"], r["optimizer"], r["method"])][r["seed"]] = r
    rows = {}
    for D in s.depths:
        for o in s.optimizers:
            for m in ALL_METHODS:
                if m not in s.methods or (m == "spectrain" and o != "sgd"):
                    continue
                runs = train.get((0, o, "sync") if m in SYNC_METHODS else (D, o, m), {})
                if not runs:
                    continue
                seeds = sorted(runs)
                row = {"D": D, "optimizer": o, "method": m, "seeds": seeds,
                       "train": {sd: _final_train(runs[sd], s.tail) for sd in seeds},
                       "val": {sd: _final_val(runs[sd], s.steps) for sd in seeds}}
                if m in SYNC_METHODS:
                    row["copies"] = [1] * D
                    row["updates"] = s.steps
                    row["samples_per_update"] = f"{s.micro_batch} ({D}x{s.micro_batch // D})"
                    c = calib.get((D, o))
                    row["tokens_per_s"] = (tokens_per_mb / sync_seconds_per_update(m, c["op_times"][m], D,
                                                                                   c["check"][m]["M"]) if c else float("nan"))
                    row["check_diff"] = c["check"][m]["max_abs_diff"] if c else None
                else:
                    any_run = runs[seeds[0]]
                    k = any_run["update_interval"]
                    row["copies"] = [max(runs[sd]["copies"][r] for sd in seeds) for r in range(D)]
                    row["updates"] = any_run["steps_taken"][0]
                    row["samples_per_update"] = f"{k * s.micro_batch}" + (f" ({k}x{s.micro_batch})" if k > 1 else "")
                    c = calib.get((D, o))
                    row["tokens_per_s"] = (async_tokens_per_s(c["op_times"][m], D, k, tokens_per_mb)
                                           if c and m in c["op_times"] else float("nan"))
                row["train_ms"] = mean_std(list(row["train"].values()))
                row["val_ms"] = mean_std(list(row["val"].values()))
                row["bleu"] = {sd: runs[sd].get("bleu") for sd in seeds}  # NMT only (None for GPT)
                row["bleu_ms"] = mean_std(list(row["bleu"].values()))
                rows[(D, o, m)] = row
    return {"rows": rows, "calibrations": calib, "train": train}


def gap_closed(variant: dict, pipeoptim: dict, sync: dict) -> float | None:
    """Fraction of PipeOptim's gap to synchronous training (final val loss, means over seeds) that the
    variant closes: 1 = reaches synchronous, 0 = PipeOptim's loss, < 0 = worse than PipeOptim. None when
    PipeOptim has no real gap to close (its mean ± std overlaps the synchronous one)."""
    if compare(pipeoptim["val_ms"], sync["val_ms"], len(pipeoptim["seeds"])) != "worse (real)":
        return None
    po_gap = pipeoptim["val_ms"][0] - sync["val_ms"][0]
    return (po_gap - (variant["val_ms"][0] - sync["val_ms"][0])) / po_gap
