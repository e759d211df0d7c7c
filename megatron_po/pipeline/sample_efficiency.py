"""How many samples an asynchronous stream needs to reach the synchronous baseline's loss: the fitted model the
deep-pipeline study predicts with (issue 50), and the speed-up it implies on a cost model's throughput bound.

A unit (method, update interval k) at D stages, against S, the synchronous run at M micro-batches per update,
reaches S's final loss after r x H micro-batches, where H is S's horizon. The model:

    ln r = beta[method] * tau(D, k) + gamma * log2(M / k)

- tau(D, k) = the mean staleness in optimizer updates over the stream's stages and micro-batches, read off the
  asynchronous op lists (`schedules.staleness`): (D - 1) / (2k) for the straight stream. Staleness in updates,
  not samples: at D = 8, k = 1 and k = 2 are equally stale in samples but k = 1 needed far more of them.
- log2(M / k): a unit stepping every k < M micro-batches makes more, smaller updates than S (at D = 8, M = 4,
  PipeOptim k = 2 matched k = 4's sample ratio at twice its staleness); k = M is the comparison at equal batch.
- No intercept: a stream with no staleness stepping at S's batch makes S's updates (r = 1).

The speed-up to S's final loss is bound / r (bound = S's seconds per micro-batch / the unit's, on the clock);
a unit with r >= bound never reaches it in the budget. The coefficients come from a fit (bench/deep_pipelines/
deep_pipelines_predict.py writes them, with their covariance, into bench/results/deep_pipelines/predictions.json
(issue 50: the D = 8 study) and predictions_refit.json (issue 57: every depth)); this module only evaluates it,
so the study's report and the advisor (tools/simulate_schedule.py) say the same.

The median's 80 % interval: ln r +- t x sd. A fit without an `interval` entry (issue 50's) takes sd from its
own residual and coefficients at a new setting (sigma^2 + x' Cov x, t on its residual degrees of freedom); that
proved too narrow at a depth the fit had not seen. A calibrated fit (issue 57) states `interval` = {"sd", "dof"}:
sd the root-mean-square error of its leave-one-depth-out predictions in ln r, the same at every setting.
"""

from __future__ import annotations

import functools
import math
import statistics

BAR = 1.25  # the study's target speed-up (rule (b))
# Two-sided 80 % quantiles of Student's t (the 10-90 % interval), by degrees of freedom; the normal's beyond 30.
T90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 7: 1.415, 8: 1.397, 9: 1.383, 10: 1.372,
       11: 1.363, 12: 1.356, 13: 1.350, 14: 1.345, 15: 1.341, 16: 1.337, 17: 1.333, 18: 1.330, 19: 1.328, 20: 1.325,
       21: 1.323, 22: 1.321, 23: 1.319, 24: 1.318, 25: 1.316, 26: 1.315, 27: 1.314, 28: 1.313, 29: 1.311, 30: 1.310}


@functools.lru_cache(maxsize=None)
def mean_staleness(D: int, k: int) -> float:
    """The mean over stages and steady-state micro-batches of s(j), the updates a stage takes between a
    micro-batch's forward and its backward, from the asynchronous stream's op lists (D stages, a step after
    every k backwards)."""
    from megatron_po.pipeline.schedules import build_schedule, staleness
    n = 8 * D * k  # enough micro-batches for a steady state well clear of warm-up and drain
    per_chunk = staleness(build_schedule("async", D, 1, n, update_interval=k))
    lo, hi = 2 * D * k, 6 * D * k  # whole update groups inside the steady state
    return statistics.fmean(s for r in range(D) for j, s in per_chunk[(r, 0)].items() if lo <= j < hi)


def features(fit: dict, method: str, D: int, M: int, k: int) -> list[float] | None:
    """The design row of (method, D, M, k) in the fit's parameter order; None for a method the fit has no
    coefficient for."""
    if method not in fit["methods"]:
        return None
    tau = mean_staleness(D, k)
    return [tau if m == method else 0.0 for m in fit["methods"]] + [math.log2(M / k)]


def _quad(row: list[float], cov: list[list[float]]) -> float:
    return sum(row[i] * cov[i][j] * row[j] for i in range(len(row)) for j in range(len(row)))


def t90(dof: int) -> float:
    """The 90th percentile of Student's t at dof degrees of freedom (the normal's beyond the table)."""
    return T90.get(dof, 1.282)


def half_width(fit: dict, row: list[float]) -> float:
    """Half the median's 80 % interval in ln r at design row `row`: the calibrated one where the fit states it
    (`interval`: t at its dof x its sd), else the fit's own prediction error (t at the residual dof x
    sqrt(sigma^2 + row' Cov row))."""
    if "interval" in fit:
        return t90(fit["interval"]["dof"]) * fit["interval"]["sd"]
    return t90(fit["dof"]) * math.sqrt(fit["sigma"] ** 2 + _quad(row, fit["covariance"]))


def predict(fit: dict, method: str, D: int, M: int, k: int, bound: float) -> dict | None:
    """The predicted sample ratio r and speed-up of one unit, with intervals; None outside the fit's methods.

    - `r`, `speedup`: the central prediction of the median over seed pairings (speed-up 0 = never reaches).
    - `speedup_p10`, `speedup_p90`: the 10-90 % range over seed pairings the central prediction implies (the
      seeds' spread of ln r around its median, pooled over the fitted settings).
    - `median_lo`, `median_hi`: an 80 % prediction interval of the median speed-up (`half_width`: calibrated by
      leaving each depth out where the fit states it, else the fit's own error at a new setting).
    - `verdict`: rule (b) on the prediction: "met" when speedup_p10 >= BAR; `firm` says whether the p10 stays
      on that side of BAR across the 80 % interval of the median."""
    row = features(fit, method, D, M, k)
    if row is None:
        return None
    theta = fit["coefficients"]
    ln_r = sum(x * b for x, b in zip(row, theta))
    h = half_width(fit, row)
    d10, d90 = fit["seed_offsets"]  # ln r at the pairings' 10th / 90th percentile minus ln of their median

    def speed(x: float) -> float:  # bound / r, 0 when the unit never reaches S's loss in its budget
        r = math.exp(x)
        return bound / r if r < bound else 0.0
    p10, p10_lo, p10_hi = speed(ln_r + d90), speed(ln_r + d90 + h), speed(ln_r + d90 - h)
    return {"method": method, "D": D, "M": M, "k": k, "tau": mean_staleness(D, k), "bound": bound,
            "r": math.exp(ln_r), "speedup": speed(ln_r), "speedup_p10": p10, "speedup_p90": speed(ln_r + d10),
            "median_lo": speed(ln_r + h), "median_hi": speed(ln_r - h),
            "verdict": "met" if p10 >= BAR else "not met", "firm": (p10_lo >= BAR) == (p10_hi >= BAR)}


def describe(p: dict, fmt) -> str:
    """One line: the predicted median [pairings' 10-90 %], its 80 % interval and the verdict it implies (fmt
    formats a speed-up as the reports do)."""
    if p["median_hi"] == 0.0:
        return f"never reaches it in the budget (r {p['r']:.2f} > bound): {p['verdict']}"
    return (f"{fmt(p['speedup'])} [{fmt(p['speedup_p10'])}–{fmt(p['speedup_p90'])}], median's 80 % "
            f"interval {fmt(p['median_lo'])}–{fmt(p['median_hi'])}: {p['verdict']}"
            + ("" if p["firm"] else f" (uncertain: the interval crosses {BAR}x)"))
