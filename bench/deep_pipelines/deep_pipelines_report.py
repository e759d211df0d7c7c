"""The report of the deep-pipeline study (deep_pipelines.py), written from its JSON alone: the verdict rule
first, then the clocks (measured and derived cost models), the sweep, the equal wall-clock verdict, the
bound that explains it, the equal-samples view, the plots, and the verdicts file tools/simulate_schedule.py
`--cost-model` prints from."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import deep_pipelines_runs as dp  # noqa: E402
from megatron_po.pipeline import cost_model as cmm  # noqa: E402

REPO = dp.cv.REPO
BAR = 1.25


def rel(path: str) -> str:
    return os.path.relpath(path, REPO) if os.path.isabs(path) else path


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.inf, 0.0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """The seeds' mean validation loss at every evaluation all of them reached."""
    if not runs:
        return []
    common = set.intersection(*({x for x, _ in r["curve"]} for r in runs))
    return sorted((x, statistics.fmean(dict(r["curve"])[x] for r in runs)) for x in common)


def first_reach(curve: list, target: float) -> float | None:
    """Micro-batches at which the curve first reaches target, linear between evaluations (from 0 at loss
    +inf: a first evaluation already below counts at its own x)."""
    prev = None
    for x, y in curve:
        if math.isfinite(y) and y <= target:
            if prev is None or prev[1] == y:
                return float(x)
            x0, y0 = prev
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
        prev = (x, y)
    return None


def at(curve: list, x: float) -> float | None:
    """The curve at x micro-batches, linear between evaluations; None outside it."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1] if curve and curve[-1][0] == x else None


def fmt_x(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    text = f"{math.floor(x * 1000) / 1000:.3f}"  # rounded down: a value under the bar never prints at it
    return text + "x"


def clock_rows(cm: dict, opt: str, M: int, units: list) -> dict:
    """{name or (name, k): seconds per micro-batch} for every synchronous schedule and asynchronous unit."""
    out = {n: dp.seconds_per_microbatch(cm, opt, n, M) for n in dp.SYNC}
    for u in units:
        if u.name != "sync":
            out[(u.name, u.k)] = dp.seconds_per_microbatch(cm, opt, u.name, M, u.k)
    return out


def analyse(study: dict, cms: dict) -> list[dict]:
    """One block per (optimizer, M): the synchronous run, each asynchronous unit's verdict on every clock."""
    blocks = []
    keys = sorted({(u.opt, u.M) for u in study["units"]}, key=lambda k: (list(dp.OPTIMIZERS).index(k[0]), k[1]))
    for opt, M in keys:
        units = [u for u in study["units"] if (u.opt, u.M) == (opt, M)]
        sync = next((u for u in units if u.name == "sync"), None)
        if sync is None or not study["runs"][sync]:
            continue
        H = study["horizons"][sync]
        s_final = mean_std([dp.final_val(r) for r in study["runs"][sync]])
        clocks = {}
        for key, cm in cms.items():
            t = clock_rows(cm, opt, M, units)
            best = min((n for n in dp.SYNC if t[n] is not None), key=t.get)
            clocks[key] = {"t": t, "best": best, "budget": H * t[best]}
        rows = []
        for u in units:
            if u.name == "sync" or not study["runs"][u]:
                continue
            runs = study["runs"][u]
            n = study["horizons"][u]
            fin = mean_std([dp.final_val(r) for r in runs])
            curve = mean_curve(runs)
            reach = first_reach(curve, s_final[0])
            row = {"unit": u, "horizon": n, "final": fin, "n_seeds": len(runs), "curve": curve, "reach": reach,
                   "a": fin[0] <= s_final[0] + max(fin[1], s_final[1]), "clocks": {}}
            for key, c in clocks.items():
                tu = c["t"][(u.name, u.k)]
                bound = c["t"][c["best"]] / tu
                speed = c["budget"] / (reach * tu) if reach else None
                row["clocks"][key] = {"t": tu, "bound": bound, "speedup": speed, "b": speed is not None and speed >= BAR}
            row["equal_samples"] = at(curve, H) if n >= H else None
            own = study.get("equal_samples", {}).get(u, [])
            row["equal_samples_run"] = (mean_std([dp.final_val(r) for r in own]), len(own)) if own else None
            rows.append(row)
        blocks.append({"opt": opt, "M": M, "sync": sync, "H": H, "sync_final": s_final,
                       "sync_n": len(study["runs"][sync]), "sync_curve": mean_curve(study["runs"][sync]),
                       "clocks": clocks, "rows": rows})
    return blocks


def verdict_text(row: dict, key: str = "measured") -> str:
    c = row["clocks"][key]
    if row["a"] and c["b"]:
        return "MEETS the target"
    why = []
    if not row["a"]:
        why.append("(a) worse final loss")
    if not c["b"]:
        why.append("(b) " + ("never reaches the sync final loss" if c["speedup"] is None else
                             f"{fmt_x(c['speedup'])} < {BAR}x"))
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
        ax_t.plot([x * ts for x in xs], ys, color="black", lw=2, label=f"sync M={b['M']} on {dp.LABELS[c['best']]}")
        ax_n.plot(xs, ys, color="black", lw=2, label=f"sync M={b['M']}")
        for row in b["rows"]:
            u = row["unit"]
            if not row["curve"]:
                continue
            xs, ys = zip(*row["curve"])
            style = styles.get(u.k, "-")
            label = f"{dp.LABELS[u.name]}, k={u.k}"
            ax_t.plot([x * row["clocks"]["measured"]["t"] for x in xs], ys, style, color=colors[u.name], label=label)
            ax_n.plot(xs, ys, style, color=colors[u.name], label=label)
        for ax in (ax_t, ax_n):
            ax.axhline(b["sync_final"][0], color="black", lw=0.6, ls=":")
            ax.set_ylabel("validation loss (mean over seeds)")
            ax.grid(alpha=0.3)
        ax_t.axvline(c["budget"], color="black", lw=0.6)
        ax_n.axvline(b["H"], color="black", lw=0.6)
        ax_t.set_xlabel("seconds on the measured H200 clock (gpu_nvidia_h200_full, eager steps)")
        ax_n.set_xlabel("micro-batches of B samples")
        ax_t.set_title(f"D=8 M={b['M']} {dp.OPT_LABELS[b['opt']]}: equal budget (line)", fontsize=10)
        ax_n.set_title("the same curves against samples (each on its own cosine)", fontsize=10)
        ax_t.legend(fontsize=7)
        lo = min(min(y for _, y in b["sync_curve"]), *(min(y for _, y in r["curve"]) for r in b["rows"] if r["curve"]))
        for ax in (ax_t, ax_n):
            ax.set_ylim(lo - 0.1, lo + 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


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
    md = base + ".md"
    with open(md, "w") as f:
        f.write(markdown(data, study, blocks, cms, os.path.basename(png) if png else None))
    verdicts = write_verdicts(blocks, cms, base + "_verdicts.json", rel(md))
    return [p for p in (md, png, verdicts) if p]


def write_verdicts(blocks: list[dict], cms: dict, path: str, source: str) -> str | None:
    """The study's verdict per (D, M, optimizer) on the measured clock, for tools/simulate_schedule.py."""
    out = {"note": "written by bench/deep_pipelines/deep_pipelines_report.py; read by tools/simulate_schedule.py "
                   "--cost-model", "verdicts": {}}
    for b in blocks:
        key = f"D={dp.D},M={b['M']},{b['opt']}"
        rows = {f"{dp.LABELS[r['unit'].name]}, k={r['unit'].k}": verdict_text(r) + f" ({r['n_seeds']} seeds)"
                for r in b["rows"]}
        met = [k for k, v in rows.items() if v.startswith("MEETS")]
        out["verdicts"][key] = {"cost_model": cms["measured"]["name"], "source": source, "rows": rows,
                                "summary": (f"met by {', '.join(met)}" if met else "no asynchronous method meets the "
                                            f"target (final loss within spread AND >= {BAR}x sooner than "
                                            f"{dp.LABELS[b['clocks']['measured']['best']]})")}
    if not out["verdicts"]:
        return None
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return path


def not_run_by_design(study: dict, cm: dict) -> str:
    """The issue's full plan (AdamW, Muon, the cheaper Muon; M = 2, 4, 8; every method at k = 1, 2, M) less the
    units this study ran, each with its bound on the measured clock: a unit whose bound is under the bar
    cannot meet (b) whatever its quality."""
    ran = set(study["units"])
    full = dp.plan_units(list(dp.OPTIMIZERS), [2, 4, 8], ["sync", *dp.ASYNC], ["1", "2", "M"])
    missing = [u for u in full if u not in ran]
    if not missing:
        return "Every unit of the issue's plan ran.\n"
    lines = [f"{len(missing)} units of the issue's plan were not run here (compute: 2 CPU cores shared with other "
             "sessions, load average 5-27 during the runs). Their throughput ratio on the measured clock (best "
             f"synchronous schedule's seconds per micro-batch / theirs). Under {BAR}x, a unit needs {BAR} / ratio x "
             f"S's sample efficiency to meet (b): not expected at k = M (S's samples per update, plus staleness); "
             "possible in principle at k < M (more updates per sample):\n"]
    by = {}
    for u in missing:
        if u.name == "sync":
            by.setdefault((u.opt, u.M), []).append(f"sync (M={u.M})")
            continue
        b = dp.best_sync(cm, u.opt, u.M)[1] / dp.seconds_per_microbatch(cm, u.opt, u.name, u.M, u.k)
        by.setdefault((u.opt, u.M), []).append(f"{u.label} {b:.2f}x")
    for (o, M), items in by.items():
        lines.append(f"- {dp.OPT_LABELS[o]}, M = {M}: " + "; ".join(items))
    return "\n".join(lines) + "\n"


def markdown(data: dict, study: dict, blocks: list[dict], cms: dict, png: str | None) -> str:
    s = data["settings"]
    p = data["provenance"]
    L = []
    partial = bool(data["not_run"])
    L.append(f"# Where an asynchronous pipeline earns its keep: D = 8, few micro-batches per update"
             f"{' (PARTIAL)' if partial else ''}\n")
    L.append(f"Command: `{data['command']}`  \nCode: commit {p['commit']}; {p['machine']}; load average at start "
             f"{' '.join(f'{x:.2f}' for x in p['load_start'])}, at end {' '.join(f'{x:.2f}' for x in p['load_end'])} "
             f"(2 CPU cores shared with other sessions); wall time {p['wall_minutes']:.0f} min; "
             f"{data['train_seconds'] / 60:.0f} min of single-thread training in the tables; {p['date']}.  \n"
             f"No GPU ran here: every GPU time is the measured H200 cost model's or derived from it, as labelled.\n")
    L.append("## The verdict rule (written before the numbers)\n")
    L.append(
        "At D = 8 and each M, let S be the best synchronous schedule on the measured clock (the fastest of 1F1B, "
        "ZB-H1, ZB-H2, ZB-V and interleaved 1F1B / ZB-H1 where they admit M) and H its horizon. An asynchronous "
        "unit (method, k), trained for the micro-batches it processes in S's time for H, **meets the target** if\n"
        "- (a) its mean final validation loss over seeds is not worse than S's within seed spread: "
        "mean_async <= mean_sync + max(std_async, std_sync); and\n"
        f"- (b) it reaches S's final mean loss (its seed-mean curve, linear between evaluations) at least **{BAR}x "
        "sooner** on the measured H200 clock: S's budget / (micro-batches to reach x its seconds per micro-batch) "
        f">= {BAR}.\n"
        "Both clocks are reported (measured; derived 8,192-token model); the verdict is the measured one's. The "
        "**bound** is the throughput ratio S's seconds per micro-batch / the unit's: the unit's speedup in (b) is that "
        "ratio x (H / the micro-batches it needs to reach S's final loss), so it is the most a unit that is no more "
        "sample-efficient than S can gain. A unit at k = M takes as many samples per update as S, with staleness on "
        "top; a unit at k < M updates more often per sample and could be more sample-efficient than S.\n")
    L.append("## Settings\n")
    L.append(
        f"- Workload: bench/convergence/convergence.py's GPT ({s['num_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads, sequence {s['seq_length']}, vocab {s['vocab_size']}; corpus "
        f"`{dp.shown_path(s['corpus'])}`), D = 8 stages of one layer; micro-batch B = {s['micro_batch']} sequences; validation "
        f"every {s['eval_interval']} micro-batches on a fixed {s['eval_batches']} x {s['micro_batch']} sequences; "
        f"unigram loss {data['unigram']:.3f}.\n"
        f"- Horizon H = {s['steps']} micro-batches of B for the synchronous run"
        f"{' (the first study ran 1,024: shortened to fit the shared 2-core machine)' if s['steps'] < 1024 else ''}. The synchronous schedules run the same updates (the mean gradient of M "
        "micro-batches, one step), so they share one unpipelined run per (M, optimizer) and differ only on the clock.\n"
        "- **Equal wall-clock budget**: budget = H x S's seconds per micro-batch on the measured clock; each "
        "asynchronous unit trains for floor(budget / its seconds per micro-batch) micro-batches, rounded down to "
        f"whole evaluation intervals of {s['eval_interval']} (against the asynchronous unit), with warm-up 1/32 of "
        "its own run and cosine decay to 0.1 x over its own run; the synchronous run warms up over H/32.\n"
        "- Asynchronous units run through `AsyncEmulator` at D = 8 and update interval k (`--async-update-interval`): "
        "one step per k micro-batches, lr of micro-batch i*k at step i. PipeOptim + error feedback: PipeOptim with "
        "`error_feedback=True`. PipeDream-2BW needs k >= D (only at M = 8).\n"
        f"- Optimizers: " + "; ".join(f"{dp.OPT_LABELS[o]}" for o in dict.fromkeys(u.opt for u in study["units"])) +
        ". Weight decay 0.01, no clipping.\n"
        "- **Equal tuning**: one lr grid per optimizer, common to every unit, factor 2 apart; if any unit's best lr "
        "(seed 1) sits at an edge, the grid grows by one point on that side for EVERY unit (at most "
        f"{dp.MAX_GROWTH} times a side). Then seeds 2..{s['seeds']} at each unit's best lr. Grids run: " +
        "; ".join(f"{o}: {', '.join(f'{x:g}' for x in g)} (grown low {data['grown'][o]['low']}, high "
                  f"{data['grown'][o]['high']})" for o, g in data["grid"].items()) + ".\n")
    L.append("## Clocks (per-op cost models; seconds per micro-batch from each method's own op list)\n")
    for key, cm in cms.items():
        path = data["cost_model"] if key == "measured" else rel(dp.DERIVED)
        L.append(f"- **{key}** ({cmm.provenance(cm).upper()}): `{path}`: {cm['name']}: {cm['device']}; {cm['model']}; "
                 f"p2p {cm.get('p2p_ms', 0.0):g} ms per message. Steps: the EAGER optimizer steps measured (the "
                 "compiled step was not measured on the H200, docs/gpu.md). Error feedback's and 2BW's work per step "
                 "are derived (9/7 and 2/7 of the AdamW step; megatron_po/pipeline/cost_model.py); the cheaper Muon's "
                 "step is derived: AdamW's + (Muon's - AdamW's) x 3/5.")
    L.append("")
    L.append("| clock | optimizer | M | " + " | ".join(dp.LABELS[n] for n in dp.SYNC) + " | best sync |")
    L.append("|---|---|---|" + "---|" * (len(dp.SYNC) + 1))
    for b in blocks:
        for key in cms:
            c = b["clocks"][key]
            cells = [f"{1e3 * c['t'][n]:.2f}" if c["t"][n] is not None else "not admitted" for n in dp.SYNC]
            L.append(f"| {key} | {dp.OPT_LABELS[b['opt']]} | {b['M']} | " + " | ".join(cells) +
                     f" | {dp.LABELS[c['best']]} |")
    L.append("\nms per micro-batch of B (a flush of M micro-batches + every rank's step, over M). Interleaved "
             "schedules need M % D == 0 in this code (at M < D they are not admitted here).\n")
    L.append("## Sweep (seed 1): final validation loss at each lr\n")
    L.append("| optimizer | M | unit | micro-batches | " + "final val loss at each lr | chosen lr |")
    L.append("|---|---|---|---|---|---|")
    for u in study["units"]:
        sw = study["sweep"][u]
        grid = data["grid"][u.opt]
        edge = study["best"][u] in (grid[0], grid[-1]) and sw
        cells = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in sorted(sw.items()))
        L.append(f"| {dp.OPT_LABELS[u.opt]} | {u.M} | {u.label} | {study['horizons'][u]} | {cells or 'not run'} | "
                 f"{study['best'][u]:g}{' (edge of grid)' if edge else ''} |")
    L.append("")
    for b in blocks:
        c = b["clocks"]["measured"]
        L.append(f"## D = 8, M = {b['M']}, {dp.OPT_LABELS[b['opt']]}\n")
        L.append(f"Best synchronous schedule on the measured clock: **{dp.LABELS[c['best']]}**, "
                 f"{1e3 * c['t'][c['best']]:.2f} ms per micro-batch; budget = {b['H']} x that = {c['budget']:.2f} s. "
                 f"Its final validation loss: **{b['sync_final'][0]:.3f} ± {b['sync_final'][1]:.3f}** "
                 f"(n = {b['sync_n']}).\n")
        L.append("| unit | micro-batches in the budget | final val loss (mean ± std, n) | (a) | sec/mb measured | "
                 "bound (S / unit) | speedup to S's final loss, measured | (b) | derived: bound | derived: speedup | "
                 "equal samples: loss at H | verdict (measured) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            m, d = r["clocks"]["measured"], r["clocks"]["derived"]
            eq = r["equal_samples"]
            eq_text = (f"ran {r['horizon']} < H" if eq is None else
                       f"{eq:.3f} ({eq - b['sync_final'][0]:+.3f}): its budget run is H long" if r["horizon"] == b["H"]
                       else f"{eq:.3f} ({eq - b['sync_final'][0]:+.3f}) on its longer cosine")
            if r["equal_samples_run"]:
                (m_, s_), n_ = r["equal_samples_run"]
                eq_text += f"; run of H: {m_:.3f} ± {s_:.3f} ({m_ - b['sync_final'][0]:+.3f}, n = {n_})"
            L.append(f"| {r['unit'].label} | {r['horizon']} | {r['final'][0]:.3f} ± {r['final'][1]:.3f} "
                     f"({r['n_seeds']}) | {'yes' if r['a'] else 'no'} | {1e3 * m['t']:.2f} | {fmt_x(m['bound'])} | "
                     f"{fmt_x(m['speedup'])} | {'yes' if m['b'] else 'no'} | {fmt_x(d['bound'])} | "
                     f"{fmt_x(d['speedup'])} | {eq_text} | {verdict_text(r)} |")
        met = [r for r in b["rows"] if r["a"] and r["clocks"]["measured"]["b"]]
        L.append("")
        if met:
            L.append(f"**Verdict: met** by " + ", ".join(r["unit"].label for r in met) + ".\n")
        else:
            best_bound = max((r["clocks"]["measured"]["bound"] for r in b["rows"]), default=None)
            L.append(f"**Verdict: not met** by any asynchronous unit run here. The bound: the fastest unit's "
                     f"throughput is {fmt_x(best_bound)} {dp.LABELS[c['best']]}'s; reaching S's final loss "
                     f"{BAR}x sooner needs that bound x (H / micro-batches to reach it) >= {BAR}.\n")
        L.append("Speedup = S's budget / (micro-batches at which the unit's seed-mean curve first reaches S's final "
                 "mean loss x its seconds per micro-batch). Derived clock: the same curves (their runs planned for "
                 "the measured budget) re-priced on the derived 8,192-token model, with S re-chosen there. Equal "
                 "samples: the unit's seed-mean curve at H micro-batches, ON ITS OWN LONGER COSINE (lr still higher "
                 "than a run stopped at H would have it), not a run stopped at H; a unit that ran fewer than H has "
                 "none. \"Run of H\" (where `--equal-samples` ran it): the unit at its best lr trained for H "
                 "micro-batches, its cosine over H: the equal-samples comparison proper.\n")
    if png:
        L.append(f"![validation loss against the measured clock and against samples]({png})\n")
    L.append("## What did not run\n")
    L.append(not_run_by_design(study, cms["measured"]))
    if data["not_run"]:
        L.append(f"{len(data['not_run'])} planned runs did not run before the deadline (optimizer, method, M, k, lr, "
                 "seed): " + "; ".join(", ".join(str(x) for x in j) for j in data["not_run"]) + ".\n")
    else:
        L.append("Every planned run of this command ran.\n")
    return "\n".join(L)
