"""Measure and report the time-to-quality study (bench/time_to_quality.py): simulated wall clock from the
measured per-op costs and each schedule's op list, time to target losses, the two verdicts, the plots.

Simulated time (as convergence.py's tokens/s column; free communication, stages run in parallel):
- synchronous, M micro-batches of B samples per update: one flush of the schedule's op list
  (`simulate`) + the slowest stage's optimizer step. Op costs per micro-batch of B = the calibration's
  async-naive costs (the shared base cost of a forward / backward of B samples on that stage, no policy
  work). Interleaved 1F1B (v = 2): each chunk costs half its stage; ZB-H1: the backward split into
  B = W = half of the measured backward (the equal split bench/zero_bubble.py assumes).
- asynchronous: `convergence.async_tokens_per_s` (steady state of the no-flush stream, the step folded
  into the backwards, 1/k per backward), from each method's own op costs (base + its policy hooks).
Time of a run = micro-batches x tokens per micro-batch / tokens per second (the throughput is constant
along a run; the emulated drains at evaluations are a measurement artefact and are not charged).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

import ttq_run as tr
from ttq_run import ASYNC, LABELS, SYNC_SCHEDULES, Unit, cv

COLORS = {"sync": "black", "async-naive": "tab:gray", "pipedream": "tab:blue", "pipedream-2bw": "tab:green",
          "pipeoptim": "tab:red", "pipenag": "tab:purple", "2bw-ef": "tab:olive"}
SYNC_STYLE = {1: ":", 2: "-", 4: "--"}  # M / D -> line style
SCHED_COLORS = {"1f1b": "black", "interleaved-1f1b": "tab:brown", "zb-h1": "tab:cyan"}
GOAL_SPEEDUP = 1.25


# --------------------------------------------------------------------------------------------------
# Measure
# --------------------------------------------------------------------------------------------------


def sync_seconds_per_update(schedule: str, op: dict, D: int, M: int) -> float:
    from megatron_po.pipeline.schedules import build_schedule
    from megatron_po.pipeline.simulator import simulate
    t_f = [op[str(r)]["Forward"] for r in range(D)]
    t_b = [op[str(r)]["Backward"] for r in range(D)]
    step = max(op[str(r)]["Step"] for r in range(D))
    if schedule == "interleaved-1f1b":
        half = lambda t: [t[vs % D] / 2 for vs in range(2 * D)]  # noqa: E731 (vs = chunk*D + rank)
        makespan = simulate(build_schedule("interleaved-1f1b", D, 2, M), half(t_f), half(t_b)).makespan
    elif schedule == "zb-h1":
        makespan = simulate(build_schedule("zb-h1", D, 1, M), t_f, [b / 2 for b in t_b],
                            t_weight=[b / 2 for b in t_b]).makespan
    else:
        makespan = simulate(build_schedule(schedule, D, 1, M), t_f, t_b).makespan
    return makespan + step


def update_interval(name: str, D: int) -> int:
    base = cv.PREDICTOR_VARIANTS.get(name, (name, {}))[0]
    return D if base == "pipedream-2bw" else 1


def time_to(curve: list, target: float, sec_per_mb: float) -> float | None:
    """Simulated seconds until the validation curve [(micro-batches, loss)] first reaches `target`,
    interpolated linearly between evaluations; None if it never does."""
    prev = None
    for x, y in curve:
        if math.isfinite(y) and y <= target:
            if prev is None or not math.isfinite(prev[1]) or prev[1] == y:
                return x * sec_per_mb
            x0, y0 = prev
            return (x0 + (x - x0) * (y0 - target) / (y0 - y)) * sec_per_mb
        prev = (x, y)
    return None


def configurations(s, study: dict, D: int, o: str) -> list[dict]:
    """Rows of (D, optimizer o): every synchronous schedule at M = 2D, 4D and every asynchronous unit,
    with its unit, runs, tokens/s and seconds per micro-batch of B."""
    tpm = study["workload"].tokens_per_microbatch
    calib = study["calibrations"]
    rows = []
    for M in (2 * D, 4 * D):
        u = Unit(o, "sync", 0, M)
        c = calib.get((D, o))
        if u not in study["runs"] or c is None:
            continue
        for sched in SYNC_SCHEDULES:
            if sched in s.methods:
                sec = sync_seconds_per_update(sched, c["op_times"]["async-naive"], D, M) / M
                rows.append({"name": sched, "label": f"{LABELS[sched]}, M={M}", "unit": u, "sec_per_mb": sec,
                             "tps": tpm / sec, "M": M, "color": SCHED_COLORS[sched], "style": SYNC_STYLE[M // D]})
    for m in ASYNC:
        if m in tr.ACTUAL_OPT and o != "adamw":
            continue  # PipeNAG (its own optimizer) is shown with the AdamW rows only
        u = Unit(tr.ACTUAL_OPT.get(m, o), m, D)
        c = calib.get((D, u.opt))
        if u not in study["runs"] or c is None or m not in c["op_times"]:
            continue
        tps = cv.async_tokens_per_s(c["op_times"][m], D, update_interval(m, D), tpm)
        k = update_interval(m, D)
        rows.append({"name": m, "label": LABELS[m] + (f", k={k}" if k > 1 else ", k=1"), "unit": u,
                     "sec_per_mb": tpm / tps, "tps": tps, "color": COLORS[m], "style": "-"})
    return rows


def finals(s, runs: list[dict]) -> dict:
    return {r["seed"]: tr.final_val(r, s.steps) for r in runs}


def val_ms(s, runs: list[dict]) -> tuple[float, float]:
    return cv.mean_std(list(finals(s, runs).values()))


def bleu_cell(runs: list[dict]) -> str:
    """NMT: greedy validation BLEU after the last update, mean ± std over seeds."""
    got = [r["bleu"] for r in runs if r.get("bleu") is not None]
    if not got:
        return "–"
    mean, std = cv.mean_std(got)
    return f"{mean:.2f} ± {std:.2f}"


def targets(s, study: dict, D: int, o: str) -> list[tuple[str, float]] | None:
    ref = study["runs"].get(Unit(o, "sync", 0, 2 * D))
    if not ref:
        return None
    t1 = val_ms(s, ref)[0]
    return [("T1 = 1F1B M=2D final", t1), ("T2 = T1 + 0.1", t1 + 0.1),
            ("T3 = (unigram + T1) / 2", (study["unigram"] + t1) / 2)]


def times_to(s, row: dict, runs: list[dict], target: float) -> list[float | None]:
    return [time_to(r["curve"], target, row["sec_per_mb"]) for r in runs]


def fmt_times(times: list[float | None]) -> str:
    got = [t for t in times if t is not None]
    if not got:
        return "not reached"
    mean, std = cv.mean_std(got)
    return f"{mean:.3g} ± {std:.2g}" + (f" ({len(got)}/{len(times)} reached)" if len(got) < len(times) else "")


def verdict2(s, study: dict, D: int, o: str) -> tuple[list[str], list[list[str]], list[dict]]:
    """Time to quality table of (D, o) and per-row data for the goal."""
    rows, tg = configurations(s, study, D, o), targets(s, study, D, o)
    ref = next((r for r in rows if r["name"] == "1f1b" and r["M"] == 2 * D), None)
    header = ["D", "optimizer", "configuration", "tokens/s (sim.)", "vs 1F1B M=2D", "final val loss",
              "horizon (sim. s)"] + ([f"time to {name} ({t:.3f}), s" for name, t in tg] if tg else []) + \
             ["speed-up to T1 vs 1F1B M=2D"] + (["final val BLEU"] if s.workload == "nmt" else [])
    table, data = [], []
    horizon_ref = s.steps * ref["sec_per_mb"] if ref else None
    for row in rows:
        runs = study["runs"][row["unit"]]
        cells = [str(D), cv.OPT_LABELS.get(row["unit"].opt, row["unit"].opt.upper()), row["label"],
                 f"{row['tps']:,.0f}", f"{row['tps'] / ref['tps']:.2f}x" if ref else "–",
                 cv.fmt(*val_ms(s, runs)), f"{s.steps * row['sec_per_mb']:.3g}"]
        speedup = None
        if tg:
            per_target = [times_to(s, row, runs, t) for _, t in tg]
            if ref and row["unit"] == ref["unit"]:  # 1F1B M=2D's runs (any schedule) reach T1 at their end
                per_target[0] = [s.steps * row["sec_per_mb"]] * len(runs)
            cells += [fmt_times(t) for t in per_target]
            t1 = per_target[0]
            if all(t is not None for t in t1) and horizon_ref:
                speedup = horizon_ref / statistics.fmean(t1)
        cells.append(f"{speedup:.2f}x" if speedup else "–")
        if s.workload == "nmt":
            cells.append(bleu_cell(runs))
        table.append(cells)
        data.append({**row, "speedup": speedup, "val": val_ms(s, runs)})
    return header, table, data


def verdict1(s, study: dict, D: int, o: str) -> tuple[list[str], list[list[str]]]:
    """Final validation loss at equal tokens: the equal-updates reference (sync, M = 1), the practical
    synchronous runs (M = 2D, 4D) and the asynchronous methods (k = 1; 2BW k = D)."""
    units = [Unit(o, "sync", 0, M) for M in (1, 2 * D, 4 * D)]
    units += [Unit(tr.ACTUAL_OPT.get(m, o), m, D) for m in ASYNC if m not in tr.ACTUAL_OPT or o == "adamw"]
    ref1, ref2 = (study["runs"].get(Unit(o, "sync", 0, M)) for M in (1, 2 * D))
    header = ["D", "optimizer", "run", "lr (best of grid)", "updates", "samples/update", "final val loss",
              "vs sync, 1 update/micro-batch", "vs 1F1B M=2D"] + (["final val BLEU"] if s.workload == "nmt" else [])
    table = []
    for u in units:
        runs = study["runs"].get(u)
        if not runs:
            continue
        k = u.M if u.name == "sync" else update_interval(u.name, D)
        v = val_ms(s, runs)

        def vs(ref):
            if not ref or ref is runs:
                return "–"
            r = val_ms(s, ref)
            return f"{v[0] - r[0]:+.3f}, {cv.compare(v, r, min(len(runs), len(ref)))}"
        label = u.label  # (PipeNAG's label names its optimizer)
        table.append([str(D), cv.OPT_LABELS[o], label, f"{study['best'][u]:g}", str(s.steps // k),
                      f"{k * s.micro_batch}", cv.fmt(*v) + f" (n={len(runs)})", vs(ref1), vs(ref2)]
                     + ([bleu_cell(runs)] if s.workload == "nmt" else []))
    return header, table


def goal_lines(s, study: dict) -> list[str]:
    out = []
    for D in s.depths:
        for o in s.optimizers:
            _, _, data = verdict2(s, study, D, o)
            ref = next((d for d in data if d["name"] == "1f1b" and d["M"] == 2 * D), None)
            strict = study["runs"].get(Unit(o, "sync", 0, 1))
            if ref is None:
                out.append(f"- D={D}, {cv.OPT_LABELS[o]}: no 1F1B M=2D run: cannot judge.")
                continue
            ok, near = [], []
            for d in data:
                if d["name"] not in ASYNC:
                    continue
                n = min(len(study["runs"][d["unit"]]), len(study["runs"][ref["unit"]]))
                quality = cv.compare(d["val"], ref["val"], n)
                fast = d["speedup"] is not None and d["speedup"] >= GOAL_SPEEDUP
                desc = (f"{LABELS[d['name']]} (final {d['val'][0]:.3f} vs 1F1B M=2D {ref['val'][0]:.3f}: {quality}; "
                        f"T1 {'%.2fx sooner' % d['speedup'] if d['speedup'] else 'not reached by every seed'}")
                if strict:
                    sv = val_ms(s, strict)
                    desc += f"; vs sync at equal updates {sv[0]:.3f}: {cv.compare(d['val'], sv, n)}"
                if d["unit"].opt != o:  # PipeNAG: another optimizer, so not "the same optimizer" as 1F1B
                    near.append(desc + f"; {d['unit'].opt}, not counted)")
                    continue
                (ok if quality != "worse (real)" and fast else near).append(desc + ")")
            verdict = "MET" if ok else "NOT MET"
            out.append(f"- **D={D}, {cv.OPT_LABELS[o]}: {verdict}.** " +
                       ("Qualifying: " + "; ".join(ok) + "." if ok else "") +
                       (" Others: " + "; ".join(near) + "." if near else ""))
    return out


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------


def _mean_curve(runs: list[dict]):
    import numpy as np
    n = min(len(r["curve"]) for r in runs)
    x = np.array([p[0] for p in runs[0]["curve"][:n]], dtype=float)
    y = np.array([[p[1] for p in r["curve"][:n]] for r in runs])
    return x, y.mean(0), (y.std(0, ddof=1) if len(runs) > 1 else np.zeros(n))


def plot(s, study: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(D, o) for D in s.depths for o in s.optimizers]
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.3 * len(panels)), squeeze=False)
    tpm = study["workload"].tokens_per_microbatch
    for i, (D, o) in enumerate(panels):
        ax_tok, ax_time = axes[i]
        lows, highs = [], []
        for M in (1, 2 * D, 4 * D):
            runs = study["runs"].get(Unit(o, "sync", 0, M))
            if runs:
                x, m, sd = _mean_curve(runs)
                ax_tok.plot(x * tpm / 1e6, m, color="black", ls=SYNC_STYLE.get(M // D, "-."), marker="o", ms=2,
                            label=Unit(o, "sync", 0, M).label)
                ax_tok.fill_between(x * tpm / 1e6, m - sd, m + sd, color="black", alpha=0.08, lw=0)
                lows.append(float((m - sd).min()))
                highs.append(float(m[-1]))
        for row in configurations(s, study, D, o):
            x, m, sd = _mean_curve(study["runs"][row["unit"]])
            if row["name"] in ASYNC:
                ax_tok.plot(x * tpm / 1e6, m, color=row["color"], marker="o", ms=2, label=row["label"])
                ax_tok.fill_between(x * tpm / 1e6, m - sd, m + sd, color=row["color"], alpha=0.08, lw=0)
                lows.append(float((m - sd).min()))
                highs.append(float(m[-1]))
            t = x * row["sec_per_mb"]
            ax_time.plot(t, m, color=row["color"], ls=row["style"], marker="o", ms=2, label=row["label"])
            ax_time.fill_between(t, m - sd, m + sd, color=row["color"], alpha=0.08, lw=0)
        for name, t in targets(s, study, D, o) or []:
            ax_time.axhline(t, color="gray", lw=0.7, ls=":")
            ax_time.annotate(name.split(" =")[0], (ax_time.get_xlim()[1], t), fontsize=7, va="bottom", ha="right")
        top = max(study["unigram"] + 0.3, max(highs, default=0) + 0.1)
        for ax in (ax_tok, ax_time):
            ax.axhline(study["unigram"], color="gray", lw=0.7, ls="-.")
            ax.set_ylim(min(lows, default=top - 2) - 0.05, top)
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6.5, ncol=2)
        ax_tok.set_title(f"D={D}, {cv.OPT_LABELS[o]}: against training tokens")
        ax_tok.set_xlabel("training tokens (millions)")
        ax_time.set_title(f"D={D}, {cv.OPT_LABELS[o]}: against simulated wall clock")
        ax_time.set_xlabel("simulated seconds (measured per-op costs, schedule op lists)")
    fig.suptitle(f"Time to quality: mean over seeds at each run's best lr, band ±1 std; dash-dot = unigram "
                 f"loss {study['unigram']:.3f}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def sweep_table(s, grid: dict, study: dict) -> tuple[list[str], list[list[str]]]:
    header = ["run", "D", "optimizer", "final val loss at each lr (seed 1)", "chosen lr"]
    rows = []
    for u in study["units"]:
        cells = ", ".join(f"{lr:g}: {study['sweep'][u].get(lr, float('nan')):.3f}" for lr in grid[u.opt])
        edge = " (edge of grid)" if len(grid[u.opt]) > 1 and study["best"][u] in (grid[u.opt][0], grid[u.opt][-1]) else ""
        rows.append([u.label, str(u.D or "all"), u.opt, cells, f"{study['best'][u]:g}{edge}"])
    return header, rows


def dump_json(s, grid: dict, study: dict, path: str) -> str:
    """Everything the tables come from (per-seed finals and validation curves of the chosen runs)."""
    out = {"command": s.command, "steps": s.steps, "unigram": study["unigram"], "grid": grid,
           "units": [{**vars(u), "label": u.label, "sweep": study["sweep"][u], "best_lr": study["best"][u],
                      "runs": [{"seed": r["seed"], "lr": r["lr"], "curve": r["curve"], "seconds": r["seconds"],
                                **({"bleu": r.get("bleu")} if s.workload == "nmt" else {})}
                               for r in study["runs"][u]]} for u in study["units"]],
           "op_times": {f"D={D},{o}": c["op_times"] for (D, o), c in study["calibrations"].items()}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return path


GPT_DATA = """- Data and model: bench/convergence.py's GPT workload: {describe}. {model}, untied
  embeddings, no dropout, fp32. Validation: a fixed set of {s.eval_batches} x {s.micro_batch} sequences, every
  {s.eval_interval} micro-batches."""
NMT_DATA = """- Data and model: bench/convergence.py's NMT workload (`NMTWorkload`): {describe}. {model}, untied
  input/output embeddings, no dropout, no label smoothing, fp32. Validation: a fixed set of {s.eval_batches} x {s.micro_batch}
  pairs (loss every {s.eval_interval} micro-batches; greedy BLEU of the same pairs after the last update)."""
GPT_HORIZON_NOTE = """- How the horizon was chosen (one synchronous AdamW run each, seed 1, before the study): convergence.py's 256
  micro-batches end at 5.17-5.28 (lr 1e-3), 0.7 nat below the unigram loss; 1,024 micro-batches end at 4.50
  (M = 1, lr 1e-3) and 4.95 (M = 8, lr 2e-3; 5.24 at 4e-3); a 2,048-micro-batch run (M = 1, lr 2e-3) passes
  4.94 / 4.62 / 4.35 at 256 / 512 / 1,024 and ends at 4.15. 1,024 is the shortest power of two at which the
  practical synchronous run (1F1B at M = 2D = 8) also ends about 1 nat below the unigram loss (0.98 for
  that seed-1 run; 0.92 for the 3-seed AdamW mean in the tables, 1.65 with Muon), not only the
  equal-updates reference (1.44 AdamW, 1.87 Muon); each run costs 35-55 s on one thread."""
NMT_HORIZON_NOTE = """- How the horizon was chosen (measured before the study, seed 1, AdamW lr 2e-3, on a machine at load
  average ~10): convergence.py's NMT setting (8 layers, sentences up to 128 tokens) costs 0.45 s per
  micro-batch, this one (4 layers, up to 64 tokens) 0.10 s; a 2,048-micro-batch run of it took 9-10 min.
  There the equal-updates run (M = 1) passes 5.12 / 4.60 / 4.28 / 4.11 at 256 / 512 / 768 / 1,024
  micro-batches and ends at 3.80 (2.31 nat below the unigram loss 6.11), greedy BLEU 1.13; the practical
  one (M = 8) stays on the unigram plateau to 256 (6.11), passes 5.78 / 5.35 / 5.06 at 512 / 768 / 1,024
  and ends at 4.71 (1.40 nat below), BLEU 0.79 (copy-the-source floor 0.13). 2,048 micro-batches for every
  run of the study did not fit the shared machine by the deadline, so the horizon is 1,024 (the
  synchronous finals at this horizon are in the settings above). BLEU stays near its floor at either
  length on this model, so it cannot separate the methods: the verdicts rest on the validation loss.
- NMT scope (budget): AdamW only, D = 4 only; the asynchronous methods of the paper at k = 1 (async-naive,
  PipeDream, PipeOptim); the synchronous runs at M = 2D = 8 and 4D = 16 (1F1B / interleaved / ZB-H1) and
  the equal-updates reference M = 1. Muon trains on this path (a tiny D = 4 PipeDream /
  PipeOptim check ran) but was not swept here. The lr grid was widened three times (first 1e-3..4e-3)
  because 1F1B at M = 8 chose its upper edge each time; every chosen lr is now inside the grid.
- Reading the NMT goal: at this horizon 1F1B at M = 8 makes 128 updates of 128 pairs and is still far from
  converged (its 2,048-micro-batch run above kept improving to the end), while the asynchronous methods
  make 1,024 updates of 16 pairs with a staleness of at most 3: more updates beat staleness here. The
  equal-updates synchronous run (M = 1, which no pipeline runs at this micro-batch size) stays ahead of
  every asynchronous method. With a budget several times longer, 1F1B's update deficit shrinks, so the
  margin measured here is specific to this short horizon."""
NMT_SYNC = (" (NMT: trained as M micro-batches of B accumulated per update on the unpipelined model,\n"
            "  `ttq_run.train_accumulated`: its micro-batches hold pairs of one target length)")
GPT_GOAL_NOTE = "- NMT: `time_to_quality_nmt.md`."
NMT_GOAL_NOTE = ("- BLEU (greedy, the validation pairs, after the last update) beside the loss: the copy-the-source\n"
                 "  floor (the English sources as the French output) scores {copy:.2f}.")


METHOD_TEXT = {"async-naive": "async-naive", "pipedream": "PipeDream", "pipedream-2bw": "PipeDream-2BW",
               "pipeoptim": "PipeOptim (paper defaults)", "pipenag": "PipeNAG (`pipenag` + `nag`)",
               "2bw-ef": "2BW + error feedback (`error_feedback=True`, the paper's s = 1 rule)"}


def methods_text(s) -> str:
    text = ", ".join(METHOD_TEXT[m] for m in ASYNC if m in s.methods)
    return text.replace("(`pipenag` + `nag`), 2BW", "(`pipenag` + `nag`),\n  2BW")  # (the full list's line break)


def not_run_text(s) -> str:
    """The methods and synchronous runs of the full study this report leaves out (a budget choice)."""
    left = [LABELS[m] for m in tr.METHODS if m not in s.methods]
    left += [Unit("", "sync", 0, M).label for M in sorted(tr.full_sync_ms(s) - set(tr.sync_ms(s)))]
    return f"\n  **Not run in this report** (the machine's budget): {', '.join(left)}." if left else ""


def write(s, grid: dict, study: dict, load0: tuple, elapsed: float, name: str | None = None) -> list[str]:
    import torch
    os.makedirs(s.out, exist_ok=True)
    nmt = s.workload == "nmt"
    base = os.path.join(s.out, name or ("time_to_quality_nmt" if nmt else "time_to_quality"))
    png = plot(s, study, base + ".png")
    load1 = os.getloadavg()
    wl, unigram = study["workload"], study["unigram"]
    sync_lines = []
    for o in s.optimizers:
        for M in sorted({1} | {m for D in s.depths for m in (2 * D, 4 * D)}):
            runs = study["runs"].get(Unit(o, "sync", 0, M))
            if runs:
                v = val_ms(s, runs)[0]
                sync_lines.append(f"{cv.OPT_LABELS[o]} {Unit(o, 'sync', 0, M).label}: {v:.3f} "
                                  f"({unigram - v:.2f} nat below)")
    blocks1, blocks2 = [], []
    for D in s.depths:
        for o in s.optimizers:
            h, t = verdict1(s, study, D, o)
            blocks1.append(cv.markdown_table(h, t))
            h, t, _ = verdict2(s, study, D, o)
            blocks2.append(cv.markdown_table(h, t) if t else f"(D={D}, {o}: no configuration)")
    sh, st = sweep_table(s, grid, study)
    n_runs = sum(len(v) for v in study["sweep"].values()) + sum(max(0, len(v) - 1) for v in study["runs"].values())
    data = (NMT_DATA if nmt else GPT_DATA).format(s=s, describe=wl.describe(), model=wl.describe_model(None))
    sample = wl.describe_sample() if nmt else f"{s.micro_batch} x {s.seq_length} tokens"
    text = f"""# Which pipeline should I use? Time to quality ({s.workload.upper()}, D = {", ".join(map(str, s.depths))})

Command: `{s.command}`

torch {torch.__version__}, {os.cpu_count()} CPU cores (shared with other sessions), {platform.platform()};
load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f};
wall time {elapsed / 60:.1f} min with {s.jobs} worker process(es) (runs reused from the cache with --resume
count as 0); {n_runs} training runs in the tables, {study.get("train_seconds", 0) / 60:.0f} min of single-thread
training in all (sweep included; on the shared machine, at the load averages above);
{time.strftime("%Y-%m-%d %H:%M:%S")}.

## Settings
{data}
- **Horizon**: {s.steps} micro-batches of B = {sample} = {s.steps * wl.tokens_per_microbatch:,.0f}
  training tokens per run, the same samples in the same order for every run of a seed. Unigram loss of
  the corpus's tokenizer (training-split token frequencies, add-one) on the validation set:
  **{unigram:.3f}**. Synchronous final validation losses (mean over seeds, best lr):
  {"; ".join(sync_lines) or "(none)"}.
- Optimizers: {", ".join(cv.OPT_LABELS.get(o, o) for o in s.optimizers)} (PipeNAG runs the `nag` optimizer,
  its own lr grid); cosine decay to {s.min_lr_ratio:g} x peak after {s.warmup} warm-up micro-batches (on the
  micro-batch clock: a run with M micro-batches per update warms up over {s.warmup}/M updates); weight
  decay {s.weight_decay}; no clipping.{cv.MUON_NOTE if "muon" in s.optimizers else ""}
- **Equal tuning**: every training run (a "unit": one optimizer, one method, one D, one M) runs the lr grid
  {", ".join(f"{o}: {'/'.join(f'{x:g}' for x in v)}" for o, v in grid.items())} with seed 1, then seeds
  2..{s.seeds} at its best lr (lowest final validation loss of seed 1).
- Methods: synchronous 1F1B, interleaved 1F1B (v = 2) and ZB-H1 share one training run per M (identical
  update semantics: mean gradient of M micro-batches of B, one step) and differ only in simulated time{NMT_SYNC if nmt else ""};
  asynchronous methods through `AsyncEmulator` with k = 1 (PipeDream-2BW and 2BW + error feedback: k = D):
  {methods_text(s)}.{not_run_text(s)}

## Sweep (seed 1)

{cv.markdown_table(sh, st)}

## Verdict 1: final validation loss at equal tokens (mean ± std over seeds)

Every row saw the same {s.steps * s.micro_batch:,} samples. "vs sync, 1 update/micro-batch" is convergence.py's
equal-updates reference (GPipe/1F1B run as M = D micro-batches of B/D, one update per B samples);
"vs 1F1B M=2D" is the practical synchronous configuration. A difference is real only when the mean ± std
intervals do not overlap (|Δ| > std_a + std_b, convergence.py's rule).

{chr(10).join(blocks1)}

## Verdict 2: time to quality (simulated wall clock)

Same D stages, micro-batches of B = {s.micro_batch} {"pairs" if nmt else "sequences"}; synchronous at M = 2D and 4D micro-batches
per update, asynchronous k = 1 (2BW: k = D). Targets: T1 = the final validation loss of 1F1B at M = 2D
(same optimizer, mean over seeds), T2 = T1 + 0.1, T3 = halfway between the unigram loss and T1. Time to a
target: the first evaluation at or below it, interpolated linearly from the previous one, in simulated
seconds (mean ± std over the seeds that reach it). 1F1B at M = 2D reaches T1 at the end of its run by
definition. Speed-up = 1F1B M=2D's horizon time / the method's mean time to T1 (only when every seed
reaches T1).

{chr(10).join(blocks2)}

## The goal (issue 16)

At each D: an asynchronous method whose final validation loss is not worse than 1F1B (same optimizer, at
M = 2D, the same tokens) beyond the seed spread, and which reaches 1F1B's final loss ≥ {GOAL_SPEEDUP}x sooner
in simulated wall clock than 1F1B at M = 2D. The quality check against the equal-updates synchronous
reference (stricter: it makes 2D times more updates than 1F1B at M = 2D) is shown too.

{chr(10).join(goal_lines(s, study))}
{NMT_GOAL_NOTE.format(copy=wl.copy_source_bleu()) if nmt else GPT_GOAL_NOTE}

## Notes
{NMT_HORIZON_NOTE if nmt else GPT_HORIZON_NOTE}
- Simulated time, free communication, stages in parallel. Synchronous, M micro-batches of B per update: one
  flush of the schedule's op list (`megatron_po.pipeline.simulator.simulate`) + the slowest stage's
  optimizer step (not overlapped with the next flush). Op costs per micro-batch of B = the calibration's
  async-naive costs (the shared base cost of a forward / backward of B samples on that stage, no policy
  work). Interleaved 1F1B (v = 2): each chunk costs half its stage's op. ZB-H1: the measured backward split
  into B = W = half (the equal split bench/zero_bubble.py assumes). Asynchronous:
  `convergence.async_tokens_per_s` (steady state of the no-flush stream, the step folded into the backwards,
  1/k per backward) from each method's own op costs (the shared base + its weight-policy hooks).
- Time of a run = micro-batches x tokens per micro-batch / tokens per second: the throughput is constant
  along a run; the emulator's drains at evaluations are a measurement artefact and are not charged.
- Throughputs come from one calibration per (D, optimizer) (convergence.py's `calibrate_job`: every method
  trained in turn, op costs = 10th percentile of a shared base + each method's median hook time), on one
  thread of a loaded 2-core CPU with a tiny model; compare rows within one (D, optimizer) block.
- Curves: `{os.path.basename(png)}`; all numbers (per seed curves, sweep, op costs): `{os.path.basename(base)}.json`.
"""
    md = base + ".md"
    with open(md, "w") as f:
        f.write(text)
    return [md, png, dump_json(s, grid, study, base + ".json")]
