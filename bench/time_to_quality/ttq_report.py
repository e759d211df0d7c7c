"""Report the time-to-quality study (bench/time_to_quality/time_to_quality.py): the sweep, verdict 1 (final loss at equal
tokens), verdict 2 (time to target losses) and the goal on every clock (bench/time_to_quality/ttq_clock.py: the CPU costs
and, given one, a hardware cost model), the sensitivity to the step's cost, the plots and the JSON every
number comes from (`--from-json` regenerates the report from it without training).

Time of a run = micro-batches x seconds per micro-batch of its configuration on the clock (the throughput
is constant along a run; the emulated drains at evaluations are a measurement artefact and are not charged).
"""

from __future__ import annotations

import json
import os
import platform
import time

import bench_common
import ttq_cost_model
import ttq_goal as tg
import ttq_run as tr
from ttq_clock import (SYNC_STYLE, Clock, configurations, cpu_clock, fmt_speedup,  # noqa: F401 (re-exported)
                       sync_seconds_per_update, time_to, update_interval)
from ttq_goal import GOAL_SPEEDUP, targets, val_ms  # noqa: F401
from ttq_run import ASYNC, LABELS, Unit, cv


def bleu_cell(runs: list[dict]) -> str:
    """NMT: greedy validation BLEU after the last update, mean ± std over seeds."""
    got = [r["bleu"] for r in runs if r.get("bleu") is not None]
    if not got:
        return "–"
    mean, std = cv.mean_std(got)
    return f"{mean:.2f} ± {std:.2f}"


def fmt_times(times: list[float | None]) -> str:
    got = [t for t in times if t is not None]
    if not got:
        return "not reached"
    mean, std = cv.mean_std(got)
    return f"{mean:.3g} ± {std:.2g}" + (f" ({len(got)}/{len(times)} reached)" if len(got) < len(times) else "")


def verdict2(s, study: dict, D: int, o: str, clock: Clock | None = None) -> tuple[list[str], list[list[str]]]:
    """Time to quality table of (D, o) on `clock` (default: the CPU clock)."""
    clock = clock or cpu_clock(study)
    rows, tgs = tg.timed_rows(s, study, D, o, clock), targets(s, study, D, o)
    ref = next((r for r in rows if r["name"] == "1f1b" and r["M"] == 2 * D), None)
    header = ["D", "optimizer", "configuration", "tokens/s (sim.)", "vs 1F1B M=2D", "final val loss",
              "horizon (sim. s)"] + ([f"time to {name} ({t:.3f}), s" for name, t in tgs] if tgs else []) + \
             [f"speed-up to T1 vs {label}" for _, label in tg.BASELINES] + \
             (["final val BLEU"] if s.workload == "nmt" else [])
    table = []
    for row in rows:
        runs = study["runs"][row["unit"]]
        cells = [str(D), cv.OPT_LABELS.get(row["unit"].opt, row["unit"].opt.upper()), row["label"],
                 f"{row['tps']:,.0f}", f"{row['tps'] / ref['tps']:.2f}x" if ref else "–",
                 cv.fmt(*row["val"]), f"{s.steps * row['sec_per_mb']:.3g}"]
        cells += [fmt_times(t) for t in row["per_target"]]
        cells += [fmt_speedup(row["speedup"][b]) for b, _ in tg.BASELINES]
        if s.workload == "nmt":
            cells.append(bleu_cell(runs))
        table.append(cells)
    return header, table


def verdict1(s, study: dict, D: int, o: str) -> tuple[list[str], list[list[str]]]:
    """Final validation loss at equal tokens: the equal-updates reference (sync, M = 1), the practical
    synchronous runs (M = 2D, 4D) and the asynchronous methods (k = 1; 2BW k = D)."""
    units = [Unit(o, "sync", 0, M) for M in (1, 2 * D, 4 * D)]
    units += tr.async_units(o, D)
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


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------


def plot(s, study: dict, path: str, clocks: list[Clock] | None = None) -> str:
    """One row of panels per (D, optimizer): validation loss against training tokens, then against the
    simulated wall clock of each clock (the same curves, stretched by each configuration's seconds per
    micro-batch)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    clocks = clocks or [cpu_clock(study)]
    panels = [(D, o) for D in s.depths for o in s.optimizers]
    fig, axes = plt.subplots(len(panels), 1 + len(clocks), figsize=(6.5 * (1 + len(clocks)), 4.3 * len(panels)),
                             squeeze=False)
    tpm = study["tokens_per_microbatch"]
    for i, (D, o) in enumerate(panels):
        ax_tok, ax_times = axes[i][0], axes[i][1:]
        lows, highs = [], []
        for M in (1, 2 * D, 4 * D):
            runs = study["runs"].get(Unit(o, "sync", 0, M))
            if runs:
                x, m, sd = cv.mean_band([r["curve"] for r in runs])
                ax_tok.plot(x * tpm / 1e6, m, color="black", ls=SYNC_STYLE.get(M // D, "-."), marker="o", ms=2,
                            label=Unit(o, "sync", 0, M).label)
                ax_tok.fill_between(x * tpm / 1e6, m - sd, m + sd, color="black", alpha=0.08, lw=0)
                lows.append(float((m - sd).min()))
                highs.append(float(m[-1]))
        for j, (clock, ax_time) in enumerate(zip(clocks, ax_times)):
            for row in configurations(s, study, D, o, clock):
                x, m, sd = cv.mean_band([r["curve"] for r in study["runs"][row["unit"]]])
                if row["name"] in ASYNC and j == 0:
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
            ax_time.set_title(f"D={D}, {cv.OPT_LABELS[o]}: against simulated wall clock, {clock.key.upper()}")
            ax_time.set_xlabel(f"simulated seconds ({clock.label})", fontsize=7)
        top = max(study["unigram"] + 0.3, max(highs, default=0) + 0.1)
        for ax in (ax_tok, *ax_times):
            ax.axhline(study["unigram"], color="gray", lw=0.7, ls="-.")
            ax.set_ylim(min(lows, default=top - 2) - 0.05, top)
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6.5, ncol=2)
        ax_tok.set_title(f"D={D}, {cv.OPT_LABELS[o]}: against training tokens")
        ax_tok.set_xlabel("training tokens (millions)")
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


def dump_json(s, grid: dict, study: dict, path: str, provenance: str | None = None,
              cost_model: dict | None = None) -> str:
    """Everything the tables come from (per-seed finals and validation curves of the chosen runs, the CPU
    op costs, the cost model), enough for `--from-json` to regenerate the report without training."""
    out = {"command": s.command, "provenance": provenance, "settings": tr.settings_record(s), "steps": s.steps,
           "unigram": study["unigram"],
           "tokens_per_microbatch": study["tokens_per_microbatch"], "grid": grid,
           "units": [{**vars(u), "label": u.label, "sweep": study["sweep"][u], "best_lr": study["best"][u],
                      "runs": [{"seed": r["seed"], "lr": r["lr"], "curve": r["curve"], "seconds": r["seconds"],
                                **({"bleu": r.get("bleu")} if s.workload == "nmt" else {})}
                               for r in study["runs"][u]]} for u in study["units"]],
           "op_times": {f"D={D},{o}": c["op_times"] for (D, o), c in study["calibrations"].items()},
           "cost_model": cost_model}
    return bench_common.write_text(path, json.dumps(out, indent=1, default=str))


GPT_DATA = """- Data and model: bench/convergence/convergence.py's GPT workload: {describe}. {model}, untied
  embeddings, no dropout, fp32. Validation: a fixed set of {s.eval_batches} x {s.micro_batch} sequences, every
  {s.eval_interval} micro-batches."""
NMT_DATA = """- Data and model: bench/convergence/convergence.py's NMT workload (`NMTWorkload`): {describe}. {model}, untied
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
  because 1F1B at M = 8 chose its upper edge each time (where the chosen lrs sit now: the edge-of-grid
  note below).
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


def edge_note(grid: dict, study: dict) -> str:
    """Which units chose an lr at an edge of their grid (from the sweep, not a fixed sentence)."""
    edges = []
    for u in study["units"]:
        g, best = grid[u.opt], study["best"][u]
        if len(g) > 1 and best in (g[0], g[-1]):
            side = "lowest" if best == g[0] else "highest"
            edges.append(f"{u.label}{f' D={u.D}' if u.D else ''} ({u.opt}) at {best:g}, the {side}")
    if not edges:
        return "- Every chosen lr is inside its grid (sweep table)."
    return ("- Chosen lr at an edge of its grid (sweep table): " + "; ".join(edges) +
            ". A better lr may lie beyond it; compare its neighbours in the sweep before reading its row.")


def header_block(s, study: dict, load0: tuple, elapsed: float) -> str:
    """The machine, load and cost lines of a report that trained (or reused) its runs."""
    import torch
    load1 = os.getloadavg()
    n_runs = sum(len(v) for v in study["sweep"].values()) + sum(max(0, len(v) - 1) for v in study["runs"].values())
    return f"""torch {torch.__version__}, {os.cpu_count()} CPU cores (shared with other sessions), {platform.platform()},
commit {bench_common.commit()};
load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f};
wall time {elapsed / 60:.1f} min with {s.jobs} worker process(es) (runs reused from the cache with --resume
count as 0); {n_runs} training runs in the tables, {study.get("train_seconds", 0) / 60:.0f} min of single-thread
training in all (sweep included; on the shared machine, at the load averages above);
{time.strftime("%Y-%m-%d %H:%M:%S")}."""


def clock_blocks(s, study: dict, clocks: list[Clock]) -> str:
    out = []
    for c in clocks:
        out.append(f"### {c.key.upper()} clock: {c.label}\n")
        if c.cost_model:
            cm = c.cost_model
            out.append(f"Per-op costs from `{c.source or cm['name']}`: {ttq_cost_model.describe(cm)}. "
                       f"tokens/s: the D-stage pipeline's at that model's {cm['tokens_per_microbatch']:,} tokens per "
                       f"micro-batch; seconds: the study's micro-batches at that model's per-op costs (at D other "
                       f"than {cm['pipeline_stages']}, the same model split into D stages). Methods the cost model "
                       f"does not price are left out.\n")
        for D in s.depths:
            for o in s.optimizers:
                h, t = verdict2(s, study, D, o, c)
                out.append(cv.markdown_table(h, t) if t else f"(D={D}, {o}: no configuration)")
        out.append("")
    return "\n".join(out)


def goal_section(s, study: dict, clocks: list[Clock]) -> str:
    header, table, lines = tg.goal_table(s, study, clocks)
    sens = tg.sensitivity_lines(s, study, clocks)
    cm = next((c.cost_model for c in clocks if c.cost_model), None)
    variants = tg.variants_table(s, study, next(c for c in clocks if c.cost_model)) if cm else None
    text = f"""At each D: an asynchronous method whose final validation loss is not worse than 1F1B (same optimizer, at
M = 2D, the same tokens) beyond the seed spread, and which reaches 1F1B's final loss (T1) ≥ {GOAL_SPEEDUP}x sooner
in simulated wall clock; judged against 1F1B at M = 2D (the issue's goal) and against ZB-H1 at M = 2D (the
strongest synchronous schedule here), on every clock. Speed-ups are printed rounded down (3 decimals, more
where needed), so a value under the {GOAL_SPEEDUP}x bar never prints as the bar; the verdict compares the
unrounded value. Synchronous training at equal updates (one update per micro-batch) is shown too: on the
same clock, and as quality (stricter: 2D times more updates than 1F1B at M = 2D).

{chr(10).join(lines)}

{cv.markdown_table(header, table)}

**Sensitivity to the optimizer step's cost**: the largest r = step/(forward+backward) (mean over stages: every
stage's step scaled by one factor, for the method and the baseline alike, so on the cost model's uniform
stages each step is r x its stage's forward+backward; everything else of the clock fixed; the curves do not
depend on the clock) at which each asynchronous method still reaches T1 ≥ {GOAL_SPEEDUP}x sooner than 1F1B / ZB-H1
at M = 2D ("never": not even with a free step; methods some seed of which never reaches T1 are left out):

{chr(10).join(sens)}
"""
    if cm:
        ratios = tg.variant_step_ratios(cm)
        text += f"\nThe cost model's step/(F+B) of its variants: {ratios or 'none change a step'}.\n"
    if variants:
        text += ("\nThe cost model's variants (speed-up to T1 vs 1F1B M=2D / vs ZB-H1 M=2D of the methods that reach T1 "
                 "on every seed; the variants' notes are in the cost model's JSON):\n\n" +
                 (cv.markdown_table(*variants) if variants[1] else "(no asynchronous method reaches T1 on every seed)") + "\n")
    return text


def write(s, grid: dict, study: dict, load0: tuple, elapsed: float, name: str | None = None,
          cost_model: dict | None = None, regenerated: dict | None = None, cost_model_path: str | None = None) -> list[str]:
    """The report (.md), plot (.png) and numbers (.json). `cost_model`: a second clock beside the CPU one;
    `regenerated`: {"by": command, "from": json name, "provenance": the original run's header lines}
    when the runs come from a results JSON instead of training."""
    from ttq_clock import model_clock
    os.makedirs(s.out, exist_ok=True)
    nmt = s.workload == "nmt"
    base = os.path.join(s.out, name or ("time_to_quality_nmt" if nmt else "time_to_quality"))
    source = os.path.relpath(cost_model_path, cv.REPO) if cost_model_path else None
    clocks = [cpu_clock(study)] + ([model_clock(cost_model, study, source)] if cost_model else [])
    png = plot(s, study, base + ".png", clocks)
    wl, unigram = study["workload"], study["unigram"]
    if regenerated:
        load = os.getloadavg()
        provenance = regenerated["provenance"] or "(the original run's header was not recorded)"
        header = (f"{provenance}\n\nRegenerated without training from `{regenerated['from']}` (its runs, curves and CPU "
                  f"op costs) by\n`{regenerated['by']}`; {time.strftime('%Y-%m-%d %H:%M:%S')}, load average "
                  f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.")
    else:
        provenance = header = header_block(s, study, load0, elapsed)
    sync_lines = []
    for o in s.optimizers:
        for M in sorted({1} | {m for D in s.depths for m in (2 * D, 4 * D)}):
            runs = study["runs"].get(Unit(o, "sync", 0, M))
            if runs:
                v = val_ms(s, runs)[0]
                sync_lines.append(f"{cv.OPT_LABELS[o]} {Unit(o, 'sync', 0, M).label}: {v:.3f} "
                                  f"({unigram - v:.2f} nat below)")
    blocks1 = []
    for D in s.depths:
        for o in s.optimizers:
            h, t = verdict1(s, study, D, o)
            blocks1.append(cv.markdown_table(h, t))
    sh, st = sweep_table(s, grid, study)
    data = (NMT_DATA if nmt else GPT_DATA).format(s=s, describe=wl.describe(), model=wl.describe_model(None))
    sample = wl.describe_sample() if nmt else f"{s.micro_batch} x {s.seq_length} tokens"
    text = f"""# Which pipeline should I use? Time to quality ({s.workload.upper()}, D = {", ".join(map(str, s.depths))})

Command: `{s.command}`

{header}

## Settings
{data}
- **Horizon**: {s.steps} micro-batches of B = {sample} = {s.steps * study["tokens_per_microbatch"]:,.0f}
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
- **Clocks**: {"; ".join(f"{c.key.upper()} clock = {c.label}" for c in clocks)}.

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
per update, and at equal updates (one per micro-batch: 1F1B over D micro-batches of B/D); asynchronous k = 1
(2BW: k = D). Targets: T1 = the final validation loss of 1F1B at M = 2D (same optimizer, mean over seeds),
T2 = T1 + 0.1, T3 = halfway between the unigram loss and T1. Time to a target: the first evaluation at or
below it, interpolated linearly from the previous one, in simulated seconds (mean ± std over the seeds that
reach it). 1F1B and ZB-H1 at M = 2D reach T1 at the end of their run by definition. Speed-up against a
baseline = the baseline's time to T1 / the row's mean time to T1 (only when every seed reaches T1); one
table per clock: the curves are the same, only the seconds per micro-batch differ.

{clock_blocks(s, study, clocks)}
## The goal (issue 16), on every clock

{goal_section(s, study, clocks)}
{NMT_GOAL_NOTE.format(copy=wl.copy_source_bleu()) if nmt else GPT_GOAL_NOTE}

## Notes
{NMT_HORIZON_NOTE if nmt else GPT_HORIZON_NOTE}
{edge_note(grid, study)}
- Simulated time, free communication, stages in parallel (bench/time_to_quality/ttq_clock.py). Synchronous, M micro-batches of
  B per update: one flush of the schedule's op list (`megatron_po.pipeline.simulator.simulate`) + the slowest
  stage's optimizer step (not overlapped with the next flush). Op costs per micro-batch of B = the clock's
  async-naive costs (the shared base cost of a forward / backward of B samples on that stage, no policy
  work). Interleaved 1F1B (v = 2): each chunk costs half its stage's op. ZB-H1: the backward split into
  input and weight gradients (CPU: B = W = half of the measured backward, the equal split
  bench/schedules/zero_bubble.py assumes; a cost model: its own split). Synchronous at equal updates: 1F1B over D
  micro-batches of B/D, each op at 1/D of B's cost (linear in samples: optimistic for it) + one step.
  Asynchronous: `convergence.async_tokens_per_s` (steady state of the no-flush stream, the step folded into
  the backwards, 1/k per backward) from each method's own op costs (the shared base + its weight-policy hooks).
- Time of a run = micro-batches x seconds per micro-batch: the throughput is constant along a run; the
  emulator's drains at evaluations are a measurement artefact and are not charged.
- CPU clock: one calibration per (D, optimizer) (convergence.py's `calibrate_job`: every method trained in
  turn, op costs = 10th percentile of a shared base + each method's median hook time), on one thread of a
  loaded 2-core CPU with a tiny model; compare rows within one (D, optimizer) block. A cost model's clock:
  bench/time_to_quality/ttq_cost_model.py (schema and derivations: docs/benchmarks.md, the JSON's `source`).
- Curves: `{os.path.basename(png)}`; all numbers (per seed curves, sweep, op costs, the cost model): `{os.path.basename(base)}.json`.
"""
    return [bench_common.write_text(base + ".md", text), png,
            dump_json(s, grid, study, base + ".json", provenance, cost_model)]
