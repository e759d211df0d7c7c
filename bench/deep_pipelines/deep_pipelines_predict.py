"""The sample-efficiency model's predictions, each written before the runs it predicts: fit the samples an
asynchronous unit needs to reach S's final loss on committed Muon runs, and predict the speed-up and verdict of
every unit of a map study (`deep_pipelines.py --map-study ISSUE`).

    python bench/deep_pipelines/deep_pipelines_predict.py --map-study 57    # the refit: predictions_refit.{json,md}

- Issue 50 (`predictions.{json,md}`, written at ee5f69d before its runs): fitted on the D = 8 study alone, the
  median's 80 % interval from the fit's own residual (3 degrees of freedom at one depth). It proved too narrow
  at a new depth: 2 of 8 measured medians inside.
- Issue 57 (`predictions_refit.{json,md}`): refitted on every Muon study at hidden 64 (D = 4, 8, 16), the
  interval calibrated by leaving each depth out (`lodo`): each depth's units predicted by the fit to the other
  depths; the interval's sd is the root-mean-square error of those predictions in ln r, the same at every
  setting. Its coverage per left-out depth is stated with the width taken from the OTHER depths' errors only,
  beside the issue 50 construction's.

The model (megatron_po/pipeline/sample_efficiency.py, which the report and the advisor evaluate):
ln r = beta[method] * tau(D, k) + gamma * log2(M / k), r = the micro-batches at which a unit seed's curve first
reaches an S seed's final loss over S's horizon H. The fit: least squares on ln(median r over seed pairings) of
every Muon unit at hidden 64 whose median pairing reaches (uncensored); a unit whose median pairing never
reaches is censored (r > its own micro-batches / H) and is listed with what the fit predicts for it.
AdamW is not fitted: no AdamW unit reaches S's loss at D = 8 (the prediction covers Muon, the priced optimizer).
A prediction is written once, before its study's runs: the command refuses (one line) once the study has a JSON.
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

# The runs each fit sees (Muon, hidden 64, S at 512 updates; the hidden-128 block is a check): issue 50's, the
# D = 8 study; issue 57's, every depth.
FIT_FILES = ("deep_pipelines_d8_m2_muon_h1024.json", "deep_pipelines_d8_m4_muon_h2048.json")
REFIT_FILES = FIT_FILES + ("deep_pipelines_d4_m1_muon_h512.json", "deep_pipelines_d8_m1_muon_h512.json",
                           "deep_pipelines_d16_m4_muon_h2048.json")
CHECK_FILES = ("deep_pipelines_d8_m2_muon_h1024_hidden128.json",)
METHODS = ("pipeoptim", "async-naive", "po-ef")
MIN_SEEDS = 3  # a unit of fewer seeds (a far one) has no pairing spread to read
# Per map study (dp.MAP_STUDIES): the runs its model is fitted on, whether its interval is calibrated by leaving
# each depth out, what it was fitted on (in words) and the file it is written to.
ROUNDS = {50: {"fit_files": FIT_FILES, "lodo": False, "fitted_on": "the D = 8 study",
               "path": os.path.join(dp.OUT, "predictions.json")},
          57: {"fit_files": REFIT_FILES, "lodo": True, "fitted_on": "the D = 4, 8 and 16 studies",
               "path": os.path.join(dp.OUT, "predictions_refit.json")}}
PREDICTIONS, REFIT = ROUNDS[50]["path"], ROUNDS[57]["path"]


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


def fitted_points(obs: list[dict]) -> list[dict]:
    """The uncensored units a fit sees: median pairing reaches S's loss, >= MIN_SEEDS seeds."""
    return [o for o in obs if o["seeds"] >= MIN_SEEDS and math.isfinite(o["median"])]


def least_squares(points: list[dict]) -> dict:
    """ln(median r) on the model's design rows: coefficients, their covariance, residual sigma and dof, and the
    methods the points identify (a method no point ran has no coefficient to predict with)."""
    base = {"methods": list(METHODS)}
    X = np.array([se.features(base, o["method"], o["D"], o["M"], o["k"]) for o in points])
    y = np.array([math.log(o["median"]) for o in points])
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    rank = int(np.linalg.matrix_rank(X))
    dof = len(y) - rank
    sigma2 = float(((X @ theta - y) ** 2).sum()) / dof if dof > 0 else math.nan
    cov = sigma2 * np.linalg.pinv(X.T @ X)
    return {**base, "coefficients": theta.tolist(), "covariance": cov.tolist(), "sigma": math.sqrt(sigma2),
            "dof": dof, "identified": sorted({o["method"] for o in points}), "X": X, "y": y}


def fit(obs: list[dict]) -> dict:
    """Least squares on the uncensored units (`fitted_points`): coefficients, their covariance, the residual
    sigma, the seeds' pooled spread offsets, and the leave-one-out check of every point whose removal leaves the
    model identified."""
    fitp = fitted_points(obs)
    ls = least_squares(fitp)
    X, y, theta = ls.pop("X"), ls.pop("y"), np.array(ls["coefficients"])
    ls.pop("identified")
    # The seeds' spread: ln r at the pairings' 10th / 90th percentile less ln of their median, averaged over the
    # fitted units whose 90th percentile reaches (a pairing spread is a property of the seeds, not the setting).
    spread = [o for o in fitp if math.isfinite(o["p90"])]
    offsets = [float(np.mean([math.log(o["p10"] / o["median"]) for o in spread])),
               float(np.mean([math.log(o["p90"] / o["median"]) for o in spread]))]
    out = {**ls, "parameters": [f"beta[{m}]" for m in METHODS] + ["gamma"], "seed_offsets": offsets,
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


def _rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def lodo(obs: list[dict]) -> dict:
    """Leave one depth out: each depth's fitted units predicted by the fit to the other depths (a unit whose
    method no other depth ran is not predicted: listed), and two 80 % intervals of each, in ln r:
    - "own": the fold fit's own prediction error, t at its residual dof x sqrt(sigma^2 + x' Cov x) (issue 50's
      construction);
    - "calibrated": t at n x the root-mean-square error of the n predictions of the OTHER left-out depths (the
      chosen construction, its width not taken from the depth it is checked on).
    Returns the rows, the coverage per left-out depth and the interval the final fit states: {"sd": the RMS error
    of all n predictions, "dof": n}."""
    fitp = fitted_points(obs)
    rows, skipped = [], []
    for d in sorted({o["D"] for o in fitp}):
        ls = least_squares([o for o in fitp if o["D"] != d])
        for o in (o for o in fitp if o["D"] == d):
            if o["method"] not in ls["identified"]:
                skipped.append({k: o[k] for k in ("method", "D", "M", "k")})
                continue
            row = se.features(ls, o["method"], o["D"], o["M"], o["k"])
            pred = float(np.dot(row, ls["coefficients"]))
            rows.append({"D": d, "method": o["method"], "M": o["M"], "k": o["k"], "measured": o["median"],
                         "predicted": math.exp(pred), "error": math.log(o["median"]) - pred,
                         "own_half": se.half_width(ls, row), "fold_dof": ls["dof"]})
    for r in rows:
        others = [x["error"] for x in rows if x["D"] != r["D"]]
        r["calibrated_half"] = se.t90(len(others)) * _rms(others)
        r["inside_own"], r["inside_calibrated"] = (abs(r["error"]) <= r[h] for h in ("own_half", "calibrated_half"))
    coverage = []
    for d in sorted({r["D"] for r in rows}):
        rs = [r for r in rows if r["D"] == d]
        coverage.append({"D": d, "n": len(rs), "own": sum(r["inside_own"] for r in rs),
                         "own_half_mean": float(np.mean([r["own_half"] for r in rs])),
                         "calibrated": sum(r["inside_calibrated"] for r in rs),
                         "calibrated_half": rs[0]["calibrated_half"]})
    return {"rows": rows, "not_predicted": skipped, "coverage": coverage,
            "interval": {"construction": "leave-one-depth-out RMS error in ln r", "sd": _rms([r["error"] for r in rows]),
                         "dof": len(rows)}}


def bounds(cm: dict, opt: str, method: str, D: int, M: int, k: int) -> float:
    """S's seconds per micro-batch over the unit's on cost model cm (the throughput bound)."""
    return dp.best_sync(cm, opt, M, D)[1] / dp.seconds_per_microbatch(cm, opt, method, M, k, D)


def new_settings(issue: int = 50) -> list[tuple[int, int, str, int]]:
    """(D, M, method, k) of a map study (dp.MAP_STUDIES, dp.map_units), in its order."""
    return [(D, M, u.name, u.k) for D, opt, M in dp.MAP_STUDIES[issue] for u in dp.map_units(opt, M)
            if u.name != "sync"]


def study_started(issue: int) -> list[str]:
    """The JSONs a map study has written (its runs have begun): a prediction is not rewritten after that."""
    names = [f"deep_pipelines_d{D}_m{M}_{o}_h{dp.STUDY_UPDATES * M}.json" for D, o, M in dp.MAP_STUDIES[issue]]
    return [n for n in names if os.path.isfile(os.path.join(dp.OUT, n))]


def predictions(issue: int) -> dict:
    """The fit of `issue`'s round (calibrated where it says so) and its predictions of the map study: what the
    predictions file holds."""
    rnd = ROUNDS[issue]
    obs = [o for f in rnd["fit_files"] for o in observations(os.path.join(dp.OUT, f))]
    model = fit(obs)
    if rnd["lodo"]:
        model["lodo"] = lodo(obs)
        model["interval"] = model["lodo"]["interval"]
    cms = {"measured": cmm.load_cost_model(dp.MEASURED), "derived": cmm.load_cost_model(dp.DERIVED)}
    preds = []
    for D, M, method, k in new_settings(issue):
        p = {key: se.predict(model, method, D, M, k, bounds(cm, "muon", method, D, M, k)) for key, cm in cms.items()}
        preds.append({"D": D, "M": M, "method": method, "k": k, **p})

    def fitted_r(o):
        return math.exp(float(np.dot(se.features(model, o["method"], o["D"], o["M"], o["k"]), model["coefficients"])))
    censored = [{**{k: o[k] for k in ("method", "D", "M", "k", "seeds", "p10")}, "own_ratio": o["own_ratio"],
                 "predicted_r": fitted_r(o)} for o in obs if not math.isfinite(o["median"]) and o["method"] in METHODS]
    checks = [{**{k: o[k] for k in ("file", "method", "D", "M", "k", "seeds", "median", "p10", "p90")},
               "predicted_r": fitted_r(o)} for f in CHECK_FILES for o in observations(os.path.join(dp.OUT, f))]
    return {"note": "written by bench/deep_pipelines/deep_pipelines_predict.py BEFORE the runs it predicts; read by "
                    "deep_pipelines_report.py and tools/simulate_schedule.py", "issue": issue,
            "fitted_on": rnd["fitted_on"], "fit_files": list(rnd["fit_files"]), "fit": model, "censored": censored,
            "checks": checks, "predictions": preds,
            "clocks": {k: os.path.relpath(p, dp.cv.REPO) for k, p in (("measured", dp.MEASURED), ("derived", dp.DERIVED))}}


def main(argv=None) -> int:
    p = bench_common.parser(__doc__)
    p.add_argument("--map-study", type=int, default=57, choices=sorted(ROUNDS), metavar="ISSUE",
                   help="the map study to predict (default 57; 50's predictions.json was written before its runs)")
    a = p.parse_args(argv)
    started = study_started(a.map_study)
    if started:
        raise SystemExit(f"error: --map-study {a.map_study}: its runs have begun ({', '.join(started)}): a prediction "
                         "is written before its study's runs, not after")
    out = predictions(a.map_study)
    out["header"] = "\n".join(bench_common.header(__file__, sys.argv[1:] if argv is None else argv))
    path = ROUNDS[a.map_study]["path"]
    bench_common.write_text(path, json.dumps(out, indent=1) + "\n")
    md = bench_common.write_text(path[:-len(".json")] + ".md", markdown(out))
    print(f"> wrote {os.path.relpath(path)}, {os.path.relpath(md)}")
    return 0


def _r(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "never"


def _x(x: float) -> str:
    return rep.fmt_x(x)


def _units(items: list[dict]) -> str:
    """Units named one per item, separated by semicolons (their labels hold commas)."""
    return "; ".join(f"{dp.LABELS[x['method']]} D = {x['D']}, M = {x['M']}, k = {x['k']}" for x in items)


TITLES = {50: "The pipeline map beyond D = 8: the predictions, made before the runs (issue 50)",
          57: "The pipeline map, calibrated: the refit on every depth and its prediction, made before the runs "
              "(issue 57)"}


def markdown(out: dict) -> str:
    m = out["fit"]
    issue = out.get("issue", 50)
    L = [f"# {TITLES[issue]}\n", out["header"], ""]
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
             f"(Muon, hidden 64; units of >= {MIN_SEEDS} seeds whose median pairing reaches S's loss):\n")
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
    L.append("")
    if "lodo" in m:
        L += lodo_lines(m)
    else:
        L.append("Leave one out (each point predicted from the others, where they still identify the model): " +
                 "; ".join(f"{dp.LABELS[x['method']]} M = {x['M']}, k = {x['k']}: r {x['predicted']:.3f} predicted, "
                           f"{x['measured']:.3f} measured" for x in m["leave_one_out"]) + ".\n")
    L.append("Censored units (their median pairing never reaches S's loss: r > their own micro-batches / H), and what "
             "the fit says of them: " + "; ".join(
                 f"{dp.LABELS[c['method']]} D = {c['D']}, M = {c['M']}, k = {c['k']} ({c['seeds']} "
                 f"seed{'s' if c['seeds'] != 1 else ''}): r > {c['own_ratio']:.3f}, fitted {c['predicted_r']:.3f} "
                 f"({'consistent' if c['predicted_r'] > c['own_ratio'] else 'INCONSISTENT: the fit says it reaches'})"
                 for c in out["censored"]) + ".\n")
    L.append("Check off the fit (the same D = 8 setting, hidden 128): " + "; ".join(
        f"{dp.LABELS[c['method']]} M = {c['M']}, k = {c['k']}: r {c['median']:.3f} measured, {c['predicted_r']:.3f} "
        "predicted (the model is for the study's width)" for c in out["checks"]) + ".\n")
    L.append("## The predictions (Muon, hidden 64, S at 512 updates; rule (b): the 10th percentile over seed "
             f"pairings >= {se.BAR}x)\n")
    how = ("the leave-one-depth-out error above" if "interval" in m else
           "the fit's residual at a new setting, Student's t")
    L.append(f"Predicted median [10-90 % over seed pairings], the median's 80 % prediction interval ({how}), and the "
             "verdict it implies (rule (b) on the predicted 10th percentile; \"uncertain\" where the interval crosses "
             "the bar). Measured H200 clock (the verdict's); the derived 8,192-token clock beside it.\n")
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


def lodo_lines(m: dict) -> list[str]:
    """The leave-one-depth-out section: every prediction of a left-out depth, the coverage per depth of the two
    constructions, and the interval chosen."""
    lo, iv = m["lodo"], m["interval"]
    half = se.t90(iv["dof"]) * iv["sd"]
    L = ["## Leave one depth out: how the 80 % interval is calibrated\n",
         "Each depth's units are predicted by the fit to the other depths alone. Two 80 % intervals of each "
         "prediction of the median, in ln r: **own**, the fold fit's own error at a new setting (t at its residual "
         "degrees of freedom x sqrt(sigma^2 + x' Cov x): issue 50's construction); **calibrated**, t at n x the "
         "root-mean-square error of the n predictions of the OTHER left-out depths (its width is not taken from "
         "the depth it is checked on; those predictions come from fits that include it: three depths cannot "
         "separate the two further).\n",
         "| left out | unit | M | k | r measured | r predicted | error in ln r | own: half-width (dof), inside | "
         "calibrated: half-width, inside |", "|---|---|---|---|---|---|---|---|---|"]
    for r in lo["rows"]:
        L.append(f"| D = {r['D']} | {dp.LABELS[r['method']]} | {r['M']} | {r['k']} | {r['measured']:.3f} | "
                 f"{r['predicted']:.3f} | {r['error']:+.4f} | {r['own_half']:.4f} ({r['fold_dof']}), "
                 f"{'yes' if r['inside_own'] else '**no**'} | {r['calibrated_half']:.4f}, "
                 f"{'yes' if r['inside_calibrated'] else '**no**'} |")
    if lo["not_predicted"]:
        L.append(f"\nNot predicted (no other depth ran the method, so no coefficient for it): "
                 f"{_units(lo['not_predicted'])}.")
    L.append("\n| left out | units predicted | own: inside (mean half-width) | calibrated: inside (half-width) |")
    L.append("|---|---|---|---|")
    for c in lo["coverage"]:
        L.append(f"| D = {c['D']} | {c['n']} | {c['own']} of {c['n']} ({c['own_half_mean']:.4f}) | "
                 f"{c['calibrated']} of {c['n']} ({c['calibrated_half']:.4f}) |")
    n = sum(c["n"] for c in lo["coverage"])
    own, cal = sum(c["own"] for c in lo["coverage"]), sum(c["calibrated"] for c in lo["coverage"])
    L.append(f"| all | {n} | {own} of {n} ({100 * own / n:.0f} %) | {cal} of {n} ({100 * cal / n:.0f} %) |")
    L.append(f"\nNominal: 80 % ({0.8 * n:.1f} of {n}). **The construction chosen: calibrated.** The own construction's "
             "coverage is all or nothing by depth: wide where a fold fit has few degrees of freedom, narrow where it "
             "extrapolates to a depth it has not seen. The predictions below take the median's 80 % interval as "
             f"ln r +- t x sd with sd = {iv['sd']:.4f}, the root-mean-square error of all {iv['dof']} leave-one-depth-"
             f"out predictions, and t = {se.t90(iv['dof']):.3f} (t at {iv['dof']} degrees of freedom): +- "
             f"{half:.4f} in ln r, r within a factor {math.exp(half):.3f} either way, at every setting (the refit's "
             f"own residual sigma is {m['sigma']:.4f}). Its first test out of sample is the setting predicted "
             "below.\n")
    return L


if __name__ == "__main__":
    sys.exit(main())
