"""Issue 50's prediction, written before its runs: fit the samples an asynchronous unit needs to reach S's final
loss on the D = 8 study's committed runs alone, and predict the speed-up and verdict of every new setting.

    python bench/deep_pipelines/deep_pipelines_predict.py          # fit, predict, write predictions.{json,md}

The model (megatron_po/pipeline/sample_efficiency.py, which the report and the advisor evaluate):
ln r = beta[method] * tau(D, k) + gamma * log2(M / k), r = the micro-batches at which a unit seed's curve first
reaches an S seed's final loss over S's horizon H. The fit: least squares on ln(median r over seed pairings) of
every Muon unit at hidden 64 whose median pairing reaches (uncensored); a unit whose median pairing never
reaches is censored (r > its own micro-batches / H) and is listed with what the fit predicts for it.
AdamW is not fitted: no AdamW unit reaches S's loss at D = 8 (the prediction covers Muon, the priced optimizer).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import json  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402

import deep_pipelines_report as rep  # noqa: E402
import deep_pipelines_runs as dp  # noqa: E402
from megatron_po.pipeline import cost_model as cmm  # noqa: E402
from megatron_po.pipeline import sample_efficiency as se  # noqa: E402

# The runs the fit sees: the D = 8 study at 512 updates, Muon, hidden 64 (the hidden-128 block is a check).
FIT_FILES = ("deep_pipelines_d8_m2_muon_h1024.json", "deep_pipelines_d8_m4_muon_h2048.json")
CHECK_FILES = ("deep_pipelines_d8_m2_muon_h1024_hidden128.json",)
METHODS = ("pipeoptim", "async-naive", "po-ef")
MIN_SEEDS = 3  # a unit of fewer seeds (a far one) has no pairing spread to read
PREDICTIONS = os.path.join(dp.OUT, "predictions.json")


def observations(path: str) -> list[dict]:
    """Per asynchronous unit of one study JSON: D, M, k, seeds, the pairings' sample ratios r (inf: never)."""
    with open(path) as f:
        data = json.load(f)
    study = dp.study_from_json(data)
    out = []
    for u in study["units"]:
        if u.name == "sync" or u.name not in METHODS:
            continue
        sync = next(x for x in study["units"] if x.name == "sync" and x.M == u.M)
        H = study["horizons"][sync]
        rs = [(rep.first_reach(ru["curve"], dp.final_val(rs_)) or math.inf) / H
              for ru in study["runs"][u] for rs_ in study["runs"][sync]]
        out.append({"file": os.path.basename(path), "method": u.name, "D": study["D"], "M": u.M, "k": u.k,
                    "seeds": len(study["runs"][u]), "own_ratio": study["horizons"][u] / H, "r": rs,
                    "median": rep.percentile(rs, 50), "p10": rep.percentile(rs, 10), "p90": rep.percentile(rs, 90)})
    return out


def fit(obs: list[dict]) -> dict:
    """Least squares on the uncensored units (median finite, >= MIN_SEEDS seeds): coefficients, their covariance,
    the residual sigma, the seeds' pooled spread offsets, and the leave-one-out check of every point whose
    removal leaves the model identified."""
    fitp = [o for o in obs if o["seeds"] >= MIN_SEEDS and math.isfinite(o["median"])]
    base = {"methods": list(METHODS)}
    X = np.array([se.features(base, o["method"], o["D"], o["M"], o["k"]) for o in fitp])
    y = np.array([math.log(o["median"]) for o in fitp])
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    dof = len(y) - X.shape[1]
    rss = float(((X @ theta - y) ** 2).sum())
    sigma2 = rss / dof
    cov = sigma2 * np.linalg.inv(X.T @ X)
    # The seeds' spread: ln r at the pairings' 10th / 90th percentile less ln of their median, averaged over the
    # fitted units whose 90th percentile reaches (a pairing spread is a property of the seeds, not the setting).
    spread = [o for o in fitp if math.isfinite(o["p90"])]
    offsets = [float(np.mean([math.log(o["p10"] / o["median"]) for o in spread])),
               float(np.mean([math.log(o["p90"] / o["median"]) for o in spread]))]
    out = {**base, "parameters": [f"beta[{m}]" for m in METHODS] + ["gamma"], "coefficients": theta.tolist(),
           "covariance": cov.tolist(), "sigma": math.sqrt(sigma2), "dof": dof, "seed_offsets": offsets,
           "points": [{k: o[k] for k in ("file", "method", "D", "M", "k", "seeds", "median", "p10", "p90")}
                      | {"fitted": math.exp(float(np.dot(row, theta)))} for o, row in zip(fitp, X)]}
    loo = []
    for i, o in enumerate(fitp):
        keep = [j for j in range(len(fitp)) if j != i]
        Xi = X[keep]
        if np.linalg.matrix_rank(Xi) < X.shape[1]:
            continue  # the only point of a coefficient: nothing left to predict it from
        th, *_ = np.linalg.lstsq(Xi, y[keep], rcond=None)
        loo.append({"method": o["method"], "D": o["D"], "M": o["M"], "k": o["k"], "measured": o["median"],
                    "predicted": math.exp(float(X[i] @ th))})
    out["leave_one_out"] = loo
    return out


def bounds(cm: dict, opt: str, method: str, D: int, M: int, k: int) -> float:
    """S's seconds per micro-batch over the unit's on cost model cm (the throughput bound)."""
    return dp.best_sync(cm, opt, M, D)[1] / dp.seconds_per_microbatch(cm, opt, method, M, k, D)


def new_settings() -> list[tuple[int, int, str, int]]:
    """(D, M, method, k) of issue 50's study (dp.MAP_BLOCKS, dp.map_units), in its order."""
    return [(D, M, u.name, u.k) for D, opt, M in dp.MAP_BLOCKS for u in dp.map_units(opt, M) if u.name != "sync"]


def main() -> int:
    bench_common.parser(__doc__).parse_args()
    obs = [o for f in FIT_FILES for o in observations(os.path.join(dp.OUT, f))]
    model = fit(obs)
    cms = {"measured": cmm.load_cost_model(dp.MEASURED), "derived": cmm.load_cost_model(dp.DERIVED)}
    preds = []
    for D, M, method, k in new_settings():
        p = {key: se.predict(model, method, D, M, k, bounds(cm, "muon", method, D, M, k)) for key, cm in cms.items()}
        preds.append({"D": D, "M": M, "method": method, "k": k, **p})
    censored = [{**{k: o[k] for k in ("method", "D", "M", "k", "seeds", "p10")}, "own_ratio": o["own_ratio"],
                 "predicted_r": math.exp(float(np.dot(se.features(model, o["method"], o["D"], o["M"], o["k"]),
                                                      model["coefficients"])))}
                for o in obs if not math.isfinite(o["median"]) and o["method"] in METHODS]
    checks = [{**{k: o[k] for k in ("file", "method", "D", "M", "k", "seeds", "median", "p10", "p90")},
               "predicted_r": math.exp(float(np.dot(se.features(model, o["method"], o["D"], o["M"], o["k"]),
                                                    model["coefficients"])))}
              for f in CHECK_FILES for o in observations(os.path.join(dp.OUT, f))]
    out = {"note": "written by bench/deep_pipelines/deep_pipelines_predict.py BEFORE the runs it predicts; read by "
                   "deep_pipelines_report.py and tools/simulate_schedule.py", "header": "\n".join(bench_common.header(__file__, sys.argv[1:])),
           "fit_files": list(FIT_FILES), "fit": model, "censored": censored, "checks": checks, "predictions": preds,
           "clocks": {k: os.path.relpath(p, dp.cv.REPO) for k, p in (("measured", dp.MEASURED), ("derived", dp.DERIVED))}}
    bench_common.write_text(PREDICTIONS, json.dumps(out, indent=1) + "\n")
    md = bench_common.write_text(PREDICTIONS[:-len(".json")] + ".md", markdown(out))
    print(f"> wrote {os.path.relpath(PREDICTIONS)}, {os.path.relpath(md)}")
    return 0


def _r(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "never"


def _x(x: float) -> str:
    return rep.fmt_x(x)


def markdown(out: dict) -> str:
    m = out["fit"]
    L = ["# The pipeline map beyond D = 8: the predictions, made before the runs (issue 50)\n", out["header"], ""]
    L.append("## The model\n")
    L.append("r = the micro-batches at which a unit seed's validation curve first reaches an S seed's final loss, over "
             "S's horizon H (speed-up = bound / r, bound = S's seconds per micro-batch / the unit's on the clock). "
             "Fitted on ln of the median r over seed pairings:\n")
    L.append("    ln r = beta[method] * tau(D, k) + gamma * log2(M / k)\n")
    L.append("- **tau(D, k)**: the mean staleness in optimizer updates over stages and micro-batches, read off the "
             "asynchronous op lists (`megatron_po/pipeline/sample_efficiency.py`): (D - 1) / (2k). Staleness in "
             "updates, not samples: at D = 8, M = 2, k = 1 and k = 2 are equally stale in samples and k = 1 never "
             "reached S's loss.\n"
             "- **log2(M / k)**: a unit that steps every k < M micro-batches makes more, smaller updates than S.\n"
             "- **No intercept**: a stream with no staleness stepping at S's batch makes S's updates (r = 1).\n"
             "- Not in the model: the horizon in samples (every setting is at 512 updates of S, as the fit's), the "
             "width (the hidden-128 check below), the mid-schedule reading (a unit with a larger bound is read earlier "
             "in its own cosine), the optimizer (Muon only: no AdamW unit reaches S's loss at D = 8).\n")
    L.append(f"Fitted on the committed runs of {', '.join('`bench/results/deep_pipelines/' + f + '`' for f in out['fit_files'])} "
             f"(Muon, hidden 64, D = 8; units of >= {MIN_SEEDS} seeds whose median pairing reaches S's loss):\n")
    L.append("| parameter | value | standard error |")
    L.append("|---|---|---|")
    for name, v, row in zip(m["parameters"], m["coefficients"], m["covariance"]):
        L.append(f"| {name} | {v:.4f} | {math.sqrt(row[m['parameters'].index(name)]):.4f} |")
    L.append(f"\nResidual sigma {m['sigma']:.4f} in ln r ({m['dof']} degrees of freedom); the seeds' spread of ln r "
             f"around its median (pooled): 10th percentile {m['seed_offsets'][0]:+.4f}, 90th {m['seed_offsets'][1]:+.4f}.\n")
    L.append("| fitted unit | D | M | k | seeds | r median [10-90 %] | fitted r |")
    L.append("|---|---|---|---|---|---|---|")
    for p in m["points"]:
        L.append(f"| {dp.LABELS[p['method']]} | {p['D']} | {p['M']} | {p['k']} | {p['seeds']} | {_r(p['median'])} "
                 f"[{_r(p['p10'])}-{_r(p['p90'])}] | {_r(p['fitted'])} |")
    L.append("\nLeave one out (each point predicted from the others, where they still identify the model): " +
             "; ".join(f"{dp.LABELS[x['method']]} M = {x['M']}, k = {x['k']}: r {x['predicted']:.3f} predicted, "
                       f"{x['measured']:.3f} measured" for x in m["leave_one_out"]) + ".\n")
    L.append("Censored units (their median pairing never reaches S's loss: r > their own micro-batches / H), and what "
             "the fit says of them: " + "; ".join(
                 f"{dp.LABELS[c['method']]} M = {c['M']}, k = {c['k']} ({c['seeds']} seed{'s' if c['seeds'] != 1 else ''}): "
                 f"r > {c['own_ratio']:.3f}, fitted {c['predicted_r']:.3f} "
                 f"({'consistent' if c['predicted_r'] > c['own_ratio'] else 'INCONSISTENT: the fit says it reaches'})"
                 for c in out["censored"]) + ".\n")
    L.append("Check off the fit (the same D = 8 setting, hidden 128): " + "; ".join(
        f"{dp.LABELS[c['method']]} M = {c['M']}, k = {c['k']}: r {c['median']:.3f} measured, {c['predicted_r']:.3f} "
        "predicted (the model is for the study's width)" for c in out["checks"]) + ".\n")
    L.append("## The predictions (Muon, hidden 64, S at 512 updates; rule (b): the 10th percentile over seed "
             f"pairings >= {se.BAR}x)\n")
    L.append("Predicted median [10-90 % over seed pairings], the median's 80 % prediction interval (the fit's "
             "residual at a new setting, Student's t), and the verdict it implies (rule (b) on the predicted 10th "
             "percentile; \"uncertain\" where the interval crosses the bar). Measured H200 clock (the verdict's); the "
             "derived 8,192-token clock beside it.\n")
    L.append("| D | M | unit | tau | r predicted | measured clock: bound | predicted speed-up | median's 80 % "
             "interval | verdict | derived clock: bound | predicted |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in out["predictions"]:
        a, d = p["measured"], p["derived"]
        L.append(f"| {p['D']} | {p['M']} | {dp.LABELS[p['method']]}, k = {p['k']} | {a['tau']:.3f} | {a['r']:.3f} | "
                 f"{_x(a['bound'])} | {_x(a['speedup'])} [{_x(a['speedup_p10'])}–{_x(a['speedup_p90'])}] | "
                 f"{_x(a['median_lo'])}–{_x(a['median_hi'])} | {a['verdict']}{'' if a['firm'] else ' (uncertain)'} | "
                 f"{_x(d['bound'])} | {_x(d['speedup'])} [{_x(d['speedup_p10'])}–{_x(d['speedup_p90'])}] |")
    L.append("\nThe study's reports print each prediction beside its outcome "
             "(`bench/results/deep_pipelines/deep_pipelines_d<D>_m<M>_muon_h<H>.md`).\n")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
