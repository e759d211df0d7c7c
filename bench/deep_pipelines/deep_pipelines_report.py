"""The report of the deep-pipeline study (deep_pipelines.py), written from its JSON alone: the study's definition
and the verdict rule first (fixed before the runs), then the settings as they ran, the clocks (measured and
derived cost models, p2p priced), the sweep, the verdict with its uncertainty (rule (a): one standard error of the
difference of the means; rule (b): the speed-up over every pairing of seeds, its 10th percentile against the bar),
the plots, and the verdicts file tools/simulate_schedule.py `--cost-model` prints from. A report made while runs
are missing says so at its top ("in progress: N of K runs, verdict not yet decided")."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import deep_pipelines_runs as dp  # noqa: E402
from bench_common import first_reach  # noqa: E402 (rep.first_reach: deep_pipelines_predict.py)
from megatron_po.pipeline import cost_model as cmm  # noqa: E402

REPO = dp.cv.REPO
BAR = 1.25


def rel(path: str) -> str:
    return os.path.relpath(path, REPO) if os.path.isabs(path) else path


def mean_std(xs: list[float]) -> tuple[float, float]:
    """convergence.py's mean and sd over the finite values (a diverged run has no final loss); inf when none."""
    xs = [x for x in xs if math.isfinite(x)]
    return dp.cv.mean_std(xs) if xs else (math.inf, 0.0)


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """The seeds' mean validation loss at every evaluation all of them reached."""
    if not runs:
        return []
    common = set.intersection(*({x for x, _ in r["curve"]} for r in runs))
    return sorted((x, statistics.fmean(dict(r["curve"])[x] for r in runs)) for x in common)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, linear between order statistics (numpy's default)."""
    ys = sorted(xs)
    if not ys:
        return math.nan
    pos = (len(ys) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def rule_a(unit_finals: list[float], sync_finals: list[float]) -> dict:
    """(a): the unit's mean final loss not worse than S's by more than one standard error of the difference of
    the two means, se = sqrt(sd_u^2 / n_u + sd_S^2 / n_S). A unit of one seed takes S's standard deviation as its
    own (its spread unmeasured; stated in the report)."""
    (mu, su), (ms, ss) = mean_std(unit_finals), mean_std(sync_finals)
    nu, ns = len(unit_finals), len(sync_finals)
    su = su if nu > 1 else ss
    se = math.sqrt(su ** 2 / max(nu, 1) + ss ** 2 / max(ns, 1))
    diff = mu - ms
    return {"diff": diff, "se": se, "pass": math.isfinite(diff) and diff <= se}


def pair_speedups(unit_runs: list[dict], sync_runs: list[dict], budget: float, t_unit: float) -> list[float]:
    """(b)'s speed-up over every pairing of a unit seed with an S seed: S's budget / (micro-batches at which the
    unit seed's curve first reaches that S seed's final loss x the unit's seconds per micro-batch); 0 where it
    never does (below any bar)."""
    out = []
    for ru in unit_runs:
        for rs in sync_runs:
            reach = first_reach(ru["curve"], dp.final_val(rs))
            out.append(budget / (reach * t_unit) if reach else 0.0)
    return out


def speed_stats(speeds: list[float]) -> dict:
    return {"n": len(speeds), "p10": percentile(speeds, 10), "median": percentile(speeds, 50),
            "p90": percentile(speeds, 90), "b": bool(speeds) and percentile(speeds, 10) >= BAR}


def fmt_range(st: dict) -> str:
    if not st["n"]:
        return "–"
    return f"{fmt_x(st['median'])} [{fmt_x(st['p10'])}–{fmt_x(st['p90'])}]"


fmt_x = cmm.format_speedup  # rounded down, "never" for 0: the advisor prints the verdicts file the same


def clock_rows(cm: dict, opt: str, M: int, units: list, D: int) -> dict:
    """{name or (name, k): seconds per micro-batch} for every synchronous schedule and asynchronous unit."""
    out = {n: dp.seconds_per_microbatch(cm, opt, n, M, D=D) for n in dp.SYNC}
    for u in units:
        if u.name != "sync":
            out[(u.name, u.k)] = dp.seconds_per_microbatch(cm, opt, u.name, M, u.k, D)
    return out


def analyse(study: dict, cms: dict) -> list[dict]:
    """One block per (optimizer, M): the synchronous run, each asynchronous unit's rule (a) and (b) on every
    clock (every pairing of seeds)."""
    blocks = []
    keys = sorted({(u.opt, u.M) for u in study["units"]}, key=lambda k: (list(dp.OPTIMIZERS).index(k[0]), k[1]))
    for opt, M in keys:
        units = [u for u in study["units"] if (u.opt, u.M) == (opt, M)]
        sync = next((u for u in units if u.name == "sync"), None)
        if sync is None or not study["runs"][sync]:
            continue
        H = study["horizons"][sync]
        s_runs = study["runs"][sync]
        s_finals = [dp.final_val(r) for r in s_runs]
        s_final = mean_std(s_finals)
        clocks = {}
        for key, cm in cms.items():
            t = clock_rows(cm, opt, M, units, study["D"])
            best = min((n for n in dp.SYNC if t[n] is not None), key=t.get)
            clocks[key] = {"t": t, "best": best, "budget": H * t[best]}
        rows = []
        for u in units:
            if u.name == "sync" or not study["runs"][u]:
                continue
            runs = study["runs"][u]
            n = study["horizons"][u]
            finals = [dp.final_val(r) for r in runs]
            curve = mean_curve(runs)
            row = {"unit": u, "horizon": n, "final": mean_std(finals), "n_seeds": len(runs), "curve": curve,
                   "rule_a": rule_a(finals, s_finals), "clocks": {}}
            row["a"] = row["rule_a"]["pass"]
            for key, c in clocks.items():
                tu = c["t"][(u.name, u.k)]
                st = speed_stats(pair_speedups(runs, s_runs, c["budget"], tu))
                row["clocks"][key] = {"t": tu, "bound": c["t"][c["best"]] / tu, **st}
            rows.append(row)
        blocks.append({"D": study["D"], "opt": opt, "M": M, "H": H, "sync_final": s_final, "sync_n": len(s_runs),
                       "sync_curve": mean_curve(s_runs), "clocks": clocks, "rows": rows})
    return blocks


def verdict_text(row: dict, key: str = "measured") -> str:
    c = row["clocks"][key]
    if row["a"] and c["b"]:
        return "MEETS the target"
    why = []
    if not row["a"]:
        why.append(f"(a) {row['rule_a']['diff']:+.3f} nat > 1 SE ({row['rule_a']['se']:.3f})")
    if not c["b"]:
        why.append(f"(b) 10th percentile {fmt_x(c['p10'])} < {BAR}x" if c["p10"] else
                   "(b) at the 10th percentile the unit never reaches S's final loss")
    return "does not meet: " + ", ".join(why)


def write_plot(blocks: list[dict], path: str) -> str | None:
    if not blocks:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(blocks), 2, figsize=(13, 4.2 * len(blocks)), squeeze=False)
    colors = {"async-naive": "tab:gray", "pipedream-2bw": "tab:green", "pipeoptim": "tab:red", "po-ef": "tab:olive"}
    styles = {1: ":", 2: "--"}
    for (ax_t, ax_n), b in zip(axes, blocks):
        c = b["clocks"]["measured"]
        ts = c["t"][c["best"]]
        xs, ys = zip(*b["sync_curve"])
        ax_t.plot([x * ts for x in xs], ys, color="black", lw=2, label=f"S: sync M={b['M']} on {dp.LABELS[c['best']]}")
        ax_n.plot(xs, ys, color="black", lw=2, label=f"S: sync M={b['M']}")
        for row in b["rows"]:
            u = row["unit"]
            if not row["curve"]:
                continue
            xs, ys = zip(*row["curve"])
            style = styles.get(u.k, "-") if u.k != u.M else "-"
            label = f"{dp.LABELS[u.name]}, k={u.k}"
            ax_t.plot([x * row["clocks"]["measured"]["t"] for x in xs], ys, style, color=colors[u.name], label=label)
            ax_n.plot(xs, ys, style, color=colors[u.name], label=label)
        for ax in (ax_t, ax_n):
            ax.axhline(b["sync_final"][0], color="black", lw=0.6, ls=":")
            ax.set_ylabel("validation loss (mean over seeds)")
            ax.grid(alpha=0.3)
        ax_t.axvline(c["budget"], color="black", lw=0.6)
        ax_n.axvline(b["H"], color="black", lw=0.6)
        ax_t.set_xlabel("seconds on the measured H200 clock (eager steps, p2p priced)")
        ax_n.set_xlabel("micro-batches of B samples")
        ax_t.set_title(f"D={b['D']} M={b['M']} {dp.OPT_LABELS[b['opt']]}, H={b['H']}: equal budget (line)", fontsize=10)
        ax_n.set_title("the same curves against samples (each on its own cosine)", fontsize=10)
        ax_t.legend(fontsize=7)
        lo = min(min(y for _, y in b["sync_curve"]), *(min(y for _, y in r["curve"]) for r in b["rows"] if r["curve"]))
        for ax in (ax_t, ax_n):
            ax.set_ylim(lo - 0.1, lo + 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def in_progress(data: dict) -> str | None:
    """"in progress: N of K runs, verdict not yet decided" while planned runs are missing, else None."""
    planned, done = data.get("planned_runs"), data.get("done_runs")
    if not data["not_run"] and (planned is None or done == planned):
        return None
    if planned is None:
        return f"in progress: {len(data['not_run'])} planned runs missing, verdict not yet decided"
    return f"in progress: {done} of {planned} runs, verdict not yet decided"


def regenerate(json_path: str) -> list[str]:
    """md, png and the verdicts file beside the JSON, from it alone."""
    with open(json_path) as f:
        data = json.load(f)
    study = dp.study_from_json(data)
    base = json_path[:-len(".json")]
    cms = {"measured": cmm.load_cost_model(os.path.join(REPO, data["cost_model"])),
           "derived": cmm.load_cost_model(dp.DERIVED)}
    blocks = analyse(study, cms)
    png = write_plot(blocks, base + ".png")
    md = bench_common.write_text(base + ".md", markdown(data, study, blocks, cms, os.path.basename(png) if png else None))
    hidden = data["settings"].get("hidden_size")
    verdicts = write_verdicts(blocks, cms, base + "_verdicts.json", rel(md), in_progress(data),
                              hidden if base.endswith(f"_hidden{hidden}") else None)  # --hidden names the files
    return [p for p in (md, png, verdicts) if p]


QUANTILES = ("median", "p10", "p90")  # of the speed-up over seed pairings, as the verdicts file names them
RULE = (f"(a) mean final loss not worse than S's by more than one standard error of the difference of the means; "
        f"(b) speed-up to S's final loss over every pairing of a unit seed with an S seed: 10th percentile >= {BAR}x "
        "(measured H200 clock, p2p priced)")


def headline(b: dict) -> dict | None:
    """The row a verdict names: the first that meets the target, else the one with the highest 10th percentile."""
    met = [r for r in b["rows"] if r["a"] and r["clocks"]["measured"]["b"]]
    pool = met or b["rows"]
    return max(pool, key=lambda r: r["clocks"]["measured"]["p10"]) if pool else None


def write_verdicts(blocks: list[dict], cms: dict, path: str, source: str, status: str | None = None,
                   hidden: int | None = None) -> str | None:
    """The study's verdict per (D, M, optimizer) on the measured clock, for tools/simulate_schedule.py: the
    original keys (cost_model, source, rows, summary) and the horizon, seeds, range and rule of the row the
    summary names (`unit`), each row's figures in `row_stats`, and `status` (final, or in progress). A run at
    `--hidden N` (issue 41 item 4) keys its verdicts ",hidden=N": the advisor's D = 8 verdict stays the
    study's, whichever file sorts first."""
    wide = f",hidden={hidden}" if hidden else ""
    out = {"note": "written by bench/deep_pipelines/deep_pipelines_report.py; read by tools/simulate_schedule.py "
                   "--cost-model", "verdicts": {}}
    for b in blocks:
        key = f"D={b['D']},M={b['M']},{b['opt']}{wide}"
        label = lambda r: f"{dp.LABELS[r['unit'].name]}, k={r['unit'].k}"  # noqa: E731
        rows = {label(r): ("not yet decided" if status else verdict_text(r)) + f" ({r['n_seeds']} seed{'s' if r['n_seeds'] != 1 else ''})"
                for r in b["rows"]}
        met = [label(r) for r in b["rows"] if r["a"] and r["clocks"]["measured"]["b"]]
        top = headline(b)
        m = top["clocks"]["measured"] if top else None
        summary = (f"{status}" if status else f"met by {'; '.join(met)}" if met else
                   f"no asynchronous method meets the target ({RULE}; against {dp.LABELS[b['clocks']['measured']['best']]})")
        out["verdicts"][key] = {
            "cost_model": cms["measured"]["name"], "source": source, "rows": rows, "summary": summary,
            "status": status or "final", "horizon_microbatches": b["H"], "horizon_updates": b["H"] // b["M"],
            "unit": label(top) if top else None, "seeds": top["n_seeds"] if top else None, "sync_seeds": b["sync_n"],
            **{f"speedup_{q}": m[q] if m else None for q in QUANTILES}, "rule": RULE,
            "row_stats": {label(r): {"seeds": r["n_seeds"], "loss_diff": r["rule_a"]["diff"], "loss_se": r["rule_a"]["se"],
                                     "a": r["a"], "b": r["clocks"]["measured"]["b"],
                                     **{f"speedup_{q}": r["clocks"]["measured"][q] for q in QUANTILES},
                                     "bound": r["clocks"]["measured"]["bound"]} for r in b["rows"]}}
    if not out["verdicts"]:
        return None
    return bench_common.write_text(path, json.dumps(out, indent=1) + "\n")


def not_run_bounds(study: dict, cm: dict) -> str:
    """Units of this (optimizer, M) the study did not run (k = 1 at M = 4, PipeDream-2BW at M < D, ...), each
    with its bound on the measured clock: under the bar a unit needs more sample efficiency than S to win."""
    ran = set(study["units"])
    pairs = dict.fromkeys((u.opt, u.M) for u in study["units"])
    D = study["D"]
    full = [u for o, M in pairs for u in dp.plan_units([o], [M], ["sync", *dp.ASYNC], ["1", "2", "M"], D=D)]
    missing = [u for u in full if u not in ran and u.name != "sync"]
    if not missing:
        return ""
    items = [f"{u.label} {dp.best_sync(cm, u.opt, u.M, D)[1] / dp.seconds_per_microbatch(cm, u.opt, u.name, u.M, u.k, D):.2f}x"
             for u in missing]
    ef = "" if not any(u.name == "po-ef" for u in missing) or any(u.name == "po-ef" for u in ran) else \
        " (error feedback's work per step derived: 9/7 of the AdamW step)"
    return (f"Not in this study's plan (bound on the measured clock: S's seconds per micro-batch / the unit's; under "
            f"{BAR}x a unit needs {BAR} / bound x S's sample efficiency to meet (b)): " + "; ".join(items) + ef + ".\n")


# The predictions committed before a map study's runs: issue 50's (the D = 8 fit), issue 57's (the refit).
PREDICTION_FILES = ("predictions.json", "predictions_refit.json")


def predictions_for(D: int, M: int, folder: str = dp.OUT) -> tuple[dict, dict]:
    """({(method, k): the prediction committed before the runs} for (D, M), {"md": its file's Markdown name,
    "fitted_on": what its model was fitted on}) from the first predictions file that predicts (D, M)."""
    for name in PREDICTION_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            data = json.load(f)
        preds = {(p["method"], p["k"]): p for p in data["predictions"] if (p["D"], p["M"]) == (D, M)}
        if preds:
            return preds, {"md": name[:-len(".json")] + ".md", "fitted_on": data.get("fitted_on", "the D = 8 study")}
    return {}, {}


def prediction_lines(b: dict, status: str | None) -> list[str]:
    """The block's units beside what a predictions file (PREDICTION_FILES) predicted for them before their runs,
    with the qualifier it gave ("uncertain" where the median's interval crosses the bar; none for a setting no
    file predicted), and where the prediction failed."""
    preds, source = predictions_for(b["D"], b["M"])
    rows = [(r, preds[(r["unit"].name, r["unit"].k)]) for r in b["rows"] if (r["unit"].name, r["unit"].k) in preds]
    if not rows:
        return []
    L = [f"Predicted before the runs ([{source['md']}]({source['md']}): ln r = beta[method] x tau + gamma x "
         f"log2(M/k), fitted on {source['fitted_on']}) against the outcome, measured H200 clock:\n",
         "| unit | predicted: median [10-90 %], median's 80 % interval, verdict | measured: median [10-90 %], verdict "
         "| prediction |", "|---|---|---|---|"]
    for r, p in rows:
        a, m = p["measured"], r["clocks"]["measured"]
        said = f"{fmt_x(a['speedup'])} [{fmt_x(a['speedup_p10'])}–{fmt_x(a['speedup_p90'])}], " \
               f"{fmt_x(a['median_lo'])}–{fmt_x(a['median_hi'])}, {a['verdict']}{'' if a['firm'] else ' (uncertain)'}"
        got = "met" if r["a"] and m["b"] else "not met"
        inside = a["median_lo"] <= m["median"] <= a["median_hi"]
        outcome = ("not yet decided" if status else
                   ("verdict right" if got == a["verdict"] else "**verdict WRONG**") +
                   ("; median inside its 80 % interval" if inside else "; **median outside its 80 % interval**"))
        L.append(f"| {r['unit'].label} | {said} | {fmt_range(m)}, {'not yet decided' if status else got} | {outcome} |")
    L.append("")
    return L


def replanned_lines(b: dict, planned: dict | None, eval_interval: int) -> list[str]:
    """Where the clock changed after the block's runs were planned (issue 57: a hand-off between two chunks of
    one rank pays no transfer): S and the budget as planned, and each unit whose budget on today's clock would be
    another number of micro-batches than it ran (the runs stand: (a) reads each at the end of its run, (b) prices
    its curve on today's clock). Nothing where the plan's clock and today's agree."""
    c = b["clocks"]["measured"]
    if not planned or (planned["S"] == c["best"] and abs(planned["S_ms_per_microbatch"] - 1e3 * c["t"][c["best"]]) < 5e-4):
        return []
    moved = []
    for r in b["rows"]:
        now = int(b["H"] * c["t"][c["best"]] / r["clocks"]["measured"]["t"]) // eval_interval * eval_interval
        if now != r["horizon"]:
            moved.append(f"{r['unit'].label} ran {r['horizon']} micro-batches, {now} on today's clock")
    return [f"The runs were planned on the clock of their day: S = {dp.LABELS[planned['S']]} at "
            f"{planned['S_ms_per_microbatch']:.3f} ms per micro-batch, budget {planned['budget_s']:.3f} s. The clock "
            "has changed since (issue 57: a hand-off between two chunks of one rank, ZB-V's turn, pays no transfer): "
            "the tables price the same runs on today's. " +
            (f"Budgets it moves: {'; '.join(moved)} ((a) reads each run's end; (b) its curve wherever it reaches)."
             if moved else "No unit's budget moves by an evaluation interval.") + "\n"]


def _load_text(data: dict) -> str:
    """This command's load (start, end) and the load the runs met (each run records the 1-minute load at its
    end: measured, in whichever session ran it; runs cached before that record existed are counted as not)."""
    p = data["provenance"]
    text = (f"this command: load average at start {' '.join(f'{x:.2f}' for x in p['load_start'])}, at end "
            f"{' '.join(f'{x:.2f}' for x in p['load_end'])}")
    lo, hi, n, total = data.get("run_loads") or (None, None, 0, 0)
    if n:
        text += f"; the runs: 1-minute load at the end of each, {lo:.1f}-{hi:.1f} ({n} of the {total} runs record it)"
    elif total:
        text += f"; the runs' load not recorded (none of the {total} runs records it)"
    return text


def _cpu_text(data: dict) -> str:
    cpu, n = data.get("train_cpu_seconds") or (0, 0)
    return f", {cpu / 3600:.2f} CPU-hours over the {n} runs that record their CPU time" if n else ""


def markdown(data: dict, study: dict, blocks: list[dict], cms: dict, png: str | None) -> str:
    s = data["settings"]
    p = data["provenance"]
    status = in_progress(data)
    L = []
    opt, M, H = next(((u.opt, u.M, study["horizons"][u]) for u in study["units"] if u.name == "sync"), (None,) * 3)
    D = study["D"]
    ef = any(u.name == "po-ef" for u in study["units"])  # error feedback ran here (its derived cost is then stated)
    title = (f"D = {D}, M = {M}, {dp.OPT_LABELS[opt]}, H = {H} micro-batches ({H // M} updates of S)" if opt else f"D = {D}")
    L.append(f"# Where an asynchronous pipeline earns its keep: {title}\n")
    if status:
        L.append(f"**{status.upper()}.** The tables below hold the runs finished so far; a unit's seeds, its lr and "
                 "the study's verdict may still change as the remaining runs finish (the command that makes its runs, "
                 "with `--resume`, continues it: for the study `python bench/deep_pipelines/deep_pipelines.py --study "
                 "--jobs 2 --resume`).\n")
    regenerated = "--report-only" in data["command"].split()
    L.append(f"Command: `{data['command']}`" + (" (no training: the report from the committed runs)" if regenerated
                                                else "") +
             f"  \nCode: {p['machine']}; {_load_text(data)} (2 CPU cores shared with other "
             f"sessions); wall time {p['wall_minutes']:.0f} min; {data['train_seconds'] / 3600:.2f} h of single-thread "
             f"training in the tables (each run's wall time on the loaded machine){_cpu_text(data)}; {p['date']}.  \n"
             "No GPU ran here: every GPU time is the measured H200 cost "
             "model's or derived from it, as labelled.\n")
    L.append("## The study (fixed before any run)\n")
    for key, d in (data.get("definition") or {}).items():
        L.append(f"- {key}: S = **{dp.LABELS[d['S']]}** (the fastest synchronous schedule on the measured clock, "
                 f"p2p {d['p2p_ms']:g} ms per message), {d['S_ms_per_microbatch']:.3f} ms per micro-batch; H = "
                 f"{d['H']} micro-batches = {d['updates']} updates of S; budget = H x that = {d['budget_s']:.3f} s.")
    rule = data.get("seeds_rule") or {}
    cond = data.get("conditional") or {}
    words = data["command"].split()
    if "--map-study" in words:  # a map study's units: fixed per setting, none conditional
        at = words.index("--map-study") + 1
        issue = words[at] if at < len(words) and words[at].isdigit() else "50"
        L.append("- Units: S; " + "; ".join(u["label"] for u in data["units"] if u["name"] != "sync") +
                 f" (issue {issue}'s plan for this setting; none conditional).")
    elif "--study" not in words:  # a block of the command line's own units
        L.append("- Units: S; " + "; ".join(u["label"] for u in data["units"] if u["name"] != "sync") +
                 " (as the command names them; none conditional).")
    else:
        L.append(
            "- Units: S; at k = M async-naive, PipeOptim and PipeOptim + error feedback (AdamW: PipeOptim and "
            "PipeOptim + error feedback); at k = M/2 PipeOptim (Muon). The other methods at k = M/2 (" +
            ("; ".join(cond.get("units", [])) or "none here") + ") run only if PipeOptim at k = M/2 (seed 1, its "
            f"best lr) ends within {rule.get('close_nat', dp.CLOSE_NAT)} nat of S (seed 1): decided "
            f"**{cond.get('decided', 'n/a')}**.")
    L.append(
        f"- Seeds: {rule.get('seeds', s.get('seeds'))} for S and for every unit whose seed-1 final loss (at its best "
        f"lr) is within {rule.get('close_nat', dp.CLOSE_NAT)} nat of S's; {rule.get('far_seeds', s.get('seeds'))} for "
        "the others (a unit that far behind fails (a) by several seed standard deviations; its spread is unmeasured, "
        "so (a) takes S's standard deviation for it).")
    L.append(
        "- Equal tuning: one lr grid per optimizer, common to every unit, factor 2 apart, the same at every depth "
        "(centred on the optima of the earlier H = 256 study at D = 8, `deep_pipelines_runs.LR_GRID`); if any "
        "unit's best lr (seed 1, its sweep complete) sits at an edge, the grid grows by one point on "
        f"that side for EVERY unit (at most {dp.MAX_GROWTH} times a side). Grids run: " +
        "; ".join(f"{o}: {', '.join(f'{x:g}' for x in g)} (grown low {data['grown'][o]['low']}, high "
                  f"{data['grown'][o]['high']})" for o, g in data["grid"].items()) + ".")
    L.append("- Each unit warms up over 1/32 of its own run and decays (cosine to 0.1 x) over its own run.\n")
    L.append("## The verdict rule (written before the numbers)\n")
    L.append(
        "An asynchronous unit (method, k), trained for the micro-batches it processes in S's time for H, **meets the "
        "target** if\n"
        "- (a) its mean final validation loss over seeds is not worse than S's by more than one standard error of the "
        "difference of the two means: mean_u - mean_S <= sqrt(sd_u^2 / n_u + sd_S^2 / n_S); and\n"
        f"- (b) over every pairing of a unit seed with an S seed, the speed-up to that S seed's final loss (S's budget "
        "/ (micro-batches at which the unit seed's curve, linear between evaluations, first reaches it x the unit's "
        f"seconds per micro-batch)) has its **10th percentile >= {BAR}x** on the measured H200 clock (a pairing that "
        "never reaches counts as 0). The median and the 10-90 % range are reported.\n"
        "(a) compares losses at the end of each run's own schedule. (b) reads the unit's curve MID-SCHEDULE (its lr "
        "still high, not annealed) against S's ANNEALED end: conservative for the asynchronous unit, kept so on "
        "purpose. The **bound** is S's seconds per micro-batch / the unit's: the most a unit no more sample-efficient "
        "than S can gain. Both clocks are reported (measured; derived 8,192-token model, S re-chosen there, the same "
        "curves); the verdict is the measured one's.\n")
    L.append("## Settings (as they ran)\n")
    extra = ", ".join(f"{k} {s[k]}" for k in ("muon_fp32_matmul_prec", "muon_split_qkv", "muon_num_ns_steps",
                                                "muon_coefficient_type") if k in s)
    L.append(
        f"- Workload: bench/convergence/convergence.py's GPT ({s['num_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads, sequence {s['seq_length']}, vocab {s['vocab_size']}; corpus "
        f"`{bench_common.portable(s['corpus'])}`), D = {D} stages of one layer; micro-batch B = {s['micro_batch']} sequences; "
        f"validation every {s['eval_interval']} micro-batches on a fixed {s['eval_batches']} x {s['micro_batch']} "
        f"sequences; unigram loss {data['unigram']:.3f}.\n"
        f"- Optimizer: {', '.join(dp.OPT_LABELS[o] for o in data['grid'])}; weight decay {s['weight_decay']}, clipping "
        f"{s['clip_grad'] or 'none'}" + (f"; Muon options as run: {extra}" if any(o != "adamw" for o in data["grid"])
                                        else "") + ". lr, warm-up and horizon per unit (below).\n"
        "- S's schedules run the same updates (the mean gradient of M micro-batches, one step): one unpipelined run "
        f"per seed, priced per schedule on the clock. Asynchronous units run through `AsyncEmulator` at D = {D} and "
        "update interval k: one step per k micro-batches, lr of micro-batch i*k at step i."
        + (" PipeOptim + error feedback: PipeOptim with `error_feedback=True`." if ef else "") + "\n")
    L.append("| unit | micro-batches | updates | warm-up (micro-batches) | best lr | seeds |")
    L.append("|---|---|---|---|---|---|")
    for e in data["units"]:
        ran = e.get("ran") or {}
        L.append(f"| {e['label']} | {e['horizon']} | {ran.get('updates', '?')} | {ran.get('warmup_micro_batches', '?')} | "
                 f"{format(e['best_lr'], 'g') if e['runs'] else '–'} | {len(e['runs'])} |")
    L.append("")
    L.append("## Clocks (per-op cost models; seconds per micro-batch from each method's own op list)\n")
    for key, cm in cms.items():
        path = data["cost_model"] if key == "measured" else rel(dp.DERIVED)
        L.append(f"- **{key}** ({cmm.provenance(cm).upper()}): `{path}`: {cm['name']}: {cm['device']}; prices "
                 f"{cmm.pipeline_priced(cm, D)}; p2p {cm.get('p2p_ms', 0.0):g} ms per message (DERIVED: bf16 "
                 "activation at NVLink bandwidth + NCCL latency, megatron_po/pipeline/cost_model.py), paid by every "
                 "send to another rank of both the synchronous and the asynchronous op lists (a hand-off between two "
                 "chunks of one rank, ZB-V's turn, pays nothing). Steps: the EAGER optimizer steps measured."
                 + (" Error feedback's work per step is derived (9/7 of the AdamW step)." if ef else ""))
    L.append("")
    L.append("| clock | optimizer | M | " + " | ".join(dp.LABELS[n] for n in dp.SYNC) + " | best sync |")
    L.append("|---|---|---|" + "---|" * (len(dp.SYNC) + 1))
    for b in blocks:
        for key in cms:
            c = b["clocks"][key]
            cells = [f"{1e3 * c['t'][n]:.2f}" if c["t"][n] is not None else "not admitted" for n in dp.SYNC]
            L.append(f"| {key} | {dp.OPT_LABELS[b['opt']]} | {b['M']} | " + " | ".join(cells) +
                     f" | {dp.LABELS[c['best']]} |")
    L.append("\nms per micro-batch of B (a flush of M micro-batches + every rank's step, over M); \"not admitted\" "
             f"where this code's schedule does not admit (D = {D}, M).\n")
    L.append("## Sweep (seed 1): final validation loss at each lr\n")
    L.append("| unit | micro-batches | final val loss at each lr | chosen lr |")
    L.append("|---|---|---|---|")
    for u in study["units"]:
        sw = study["sweep"][u]
        grid = data["grid"][u.opt]
        edge = study["best"][u] in (grid[0], grid[-1]) and sw
        cells = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in sorted(sw.items()))
        chosen = (f"{study['best'][u]:g}{' (edge of grid)' if edge else ''}"
                  f"{' (so far)' if len(sw) < len(grid) else ''}" if sw else "–")
        L.append(f"| {u.label} | {study['horizons'][u]} | {cells or 'not run'} | {chosen} |")
    L.append("")
    for b in blocks:
        c = b["clocks"]["measured"]
        L.append(f"## Result: D = {D}, M = {b['M']}, {dp.OPT_LABELS[b['opt']]}\n")
        L.append(f"S = **{dp.LABELS[c['best']]}**, {1e3 * c['t'][c['best']]:.3f} ms per micro-batch; budget = {b['H']} "
                 f"x that = {c['budget']:.3f} s. S's final validation loss: **{b['sync_final'][0]:.4f} ± "
                 f"{b['sync_final'][1]:.4f}** (mean ± sd, n = {b['sync_n']}).\n")
        L += replanned_lines(b, (data.get("definition") or {}).get(f"{b['opt']},M={b['M']}"), s["eval_interval"])
        L.append("| unit | micro-batches in the budget | final val loss (mean ± sd, n) | diff to S ± 1 SE | (a) | "
                 "bound (S / unit) | speed-up, measured: median [10th–90th pct] (pairings) | (b) | derived: bound | "
                 "derived: median [10th–90th] | verdict (measured) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            m, d = r["clocks"]["measured"], r["clocks"]["derived"]
            ra = r["rule_a"]
            L.append(f"| {r['unit'].label} | {r['horizon']} | {r['final'][0]:.4f} ± {r['final'][1]:.4f} ({r['n_seeds']}) "
                     f"| {ra['diff']:+.4f} ± {ra['se']:.4f} | {'yes' if r['a'] else 'no'} | {fmt_x(m['bound'])} | "
                     f"{fmt_range(m)} ({m['n']}) | {'yes' if m['b'] else 'no'} | {fmt_x(d['bound'])} | {fmt_range(d)} | "
                     f"{'not yet decided' if status else verdict_text(r)} |")
        met = [r for r in b["rows"] if r["a"] and r["clocks"]["measured"]["b"]]
        L.append("")
        if status:
            L.append(f"**Verdict: not yet decided** ({status}).\n")
        elif met:
            L.append("**Verdict: met** by " + "; ".join(r["unit"].label for r in met) + ".\n")
        else:
            best_bound = max((r["clocks"]["measured"]["bound"] for r in b["rows"]), default=None)
            L.append(f"**Verdict: not met** by any asynchronous unit run here. The fastest unit's throughput is "
                     f"{fmt_x(best_bound)} S's; reaching S's final loss {BAR}x sooner needs that bound x (H / "
                     f"micro-batches to reach it) >= {BAR}.\n")
        L.append("Derived clock: the same curves (their runs planned for the measured budget) re-priced on the "
                 "derived 8,192-token model, with S re-chosen there.\n")
        L += prediction_lines(b, status)
    if png:
        L.append(f"![validation loss against the measured clock and against samples]({png})\n")
    L.append("## What did not run\n")
    L.append(not_run_bounds(study, cms["measured"]))
    if data["not_run"]:
        L.append(f"{len(data['not_run'])} planned runs have not run (optimizer, method, M, k, lr (None: the best, not "
                 "yet known), seed): " + "; ".join(", ".join(str(x) for x in j) for j in data["not_run"]) + ".\n")
    else:
        L.append("Every planned run of this command ran.\n")
    return "\n".join(L)
