"""bench/convergence/convergence.py's report: the Markdown tables (main, head to head, predictor variants), the
verdict and notes paragraphs and the whole `convergence.md` text."""

from __future__ import annotations

import math
import os

from bench_common import machine, markdown_table, now
from convergence_settings import (ASYNC_METHODS, LABELS, MUON_NOTE, OPT_LABELS, PREDICTOR_VARIANTS, SYNC_METHODS,
                                  Settings, muon_ns_note)
from convergence_stats import compare, fmt, gap_closed


def _copies_str(copies: list[int]) -> str:
    return f"{max(copies)} (" + "/".join(str(c) for c in copies) + ")"


def _opponents(rows: dict, D: int, o: str) -> list[tuple[str, dict]]:
    """(method, row) of every other asynchronous method that ran at (D, optimizer), PipeOptim's comparisons."""
    return [(m, rows[(D, o, m)]) for m in ("pipedream", "pipedream-2bw", "spectrain", "async-naive")
            if (D, o, m) in rows]


def main_table(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["D", "optimizer", "method", "updates", "samples/update", "final train loss", "final val loss",
              "val gap to 1F1B", "tokens/s (sim.)", "weight copies/stage: max (r0/…/rD-1)", "val vs 1F1B"]
    out, keys = [], []
    for (D, o, m), row in summary["rows"].items():
        if m in PREDICTOR_VARIANTS:
            continue  # their own table: predictor_table
        keys.append((D, o, m))
        ref = summary["rows"].get((D, o, "1f1b")) or summary["rows"].get((D, o, "gpipe"))
        if ref is not None and m not in SYNC_METHODS:
            gap = (row["val_ms"][0] - ref["val_ms"][0]) / ref["val_ms"][0] * 100
            gap_s = f"{gap:+.2f}%"
            verdict = compare(row["val_ms"], ref["val_ms"], len(row["seeds"]))
        else:
            gap_s, verdict = ("0 (reference)" if m in SYNC_METHODS else "–"), "–"
        out.append([str(D), OPT_LABELS[o], LABELS[m], str(row["updates"]), row["samples_per_update"],
                    fmt(*row["train_ms"]), fmt(*row["val_ms"]), gap_s, f"{row['tokens_per_s']:,.0f}",
                    _copies_str(row["copies"]), verdict])
    if s.workload == "nmt":  # translation quality beside the loss
        header = header + ["final val BLEU (greedy)", "BLEU vs 1F1B"]
        for r, key in zip(out, keys):
            row, ref = summary["rows"][key], summary["rows"].get(key[:2] + ("1f1b",))
            versus = "–" if ref is None or key[2] in SYNC_METHODS else compare(
                tuple(-x if i == 0 else x for i, x in enumerate(row["bleu_ms"])),
                tuple(-x if i == 0 else x for i, x in enumerate(ref["bleu_ms"])), len(row["seeds"]))
            r += [fmt(*row["bleu_ms"], digits=2), versus]
    return header, out


def head_to_head(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    """PipeOptim against every other asynchronous method on final validation loss."""
    header = ["D", "optimizer", "PipeOptim vs", "Δ val (PipeOptim − other)", "spread (std PO + std other)",
              "paired: seeds where PipeOptim is lower", "verdict"]
    out = []
    rows = summary["rows"]
    for D in s.depths:
        for o in s.optimizers:
            po = rows.get((D, o, "pipeoptim"))
            if po is None:
                continue
            for m, other in _opponents(rows, D, o):
                delta = po["val_ms"][0] - other["val_ms"][0]
                spread = po["val_ms"][1] + other["val_ms"][1]
                common = [sd for sd in po["seeds"] if sd in other["seeds"]]
                wins = sum(1 for sd in common if po["val"][sd] < other["val"][sd])
                verdict = compare(po["val_ms"], other["val_ms"], len(common))
                verdict = {"better (real)": "PipeOptim better (real)", "worse (real)": "PipeOptim worse (real)"}.get(
                    verdict, verdict)
                out.append([str(D), OPT_LABELS[o], LABELS[m], f"{delta:+.4f}", f"{spread:.4f}",
                            f"{wins}/{len(common)}", verdict])
    return header, out


def predictor_table(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    """PipeOptim and each predictor / gradient-side variant against synchronous 1F1B and PipeOptim."""
    header = ["D", "optimizer", "method", "final val loss", "gap to 1F1B", "fraction of PipeOptim's gap closed",
              "vs PipeOptim", "paired: seeds below PipeOptim", "tokens/s vs PipeOptim (sim.)", "weight copies/stage"]
    rows, out = summary["rows"], []
    for D in s.depths:
        for o in s.optimizers:
            po, sync = rows.get((D, o, "pipeoptim")), rows.get((D, o, "1f1b")) or rows.get((D, o, "gpipe"))
            if po is None or sync is None:
                continue
            for m in ("pipeoptim", "pipedream", *PREDICTOR_VARIANTS):
                row = rows.get((D, o, m))
                if row is None:
                    continue
                gap = (row["val_ms"][0] - sync["val_ms"][0]) / sync["val_ms"][0] * 100
                if m == "pipeoptim":
                    closed, verdict, paired, speed = "0 (reference)", "–", "–", "1.00"
                else:
                    f = gap_closed(row, po, sync)
                    closed = "n/a (no real PipeOptim gap)" if f is None else f"{f:+.0%}"
                    verdict = compare(row["val_ms"], po["val_ms"], min(len(row["seeds"]), len(po["seeds"])))
                    common = [sd for sd in row["seeds"] if sd in po["seeds"]]
                    paired = f"{sum(1 for sd in common if row['val'][sd] < po['val'][sd])}/{len(common)}"
                    speed = f"{row['tokens_per_s'] / po['tokens_per_s']:.2f}"
                out.append([str(D), OPT_LABELS[o], LABELS[m], fmt(*row["val_ms"]), f"{gap:+.2f}%", closed, verdict,
                            paired, speed, _copies_str(row["copies"])])
    return header, out


def moonshot_lines(s: Settings, summary: dict) -> list[str]:
    """The issue's target: close >= half of PipeOptim's gap to synchronous 1F1B at D = 4 at no throughput
    cost (simulated tokens/s within 2 % of PipeOptim's, the calibration's noise level)."""
    rows, lines = summary["rows"], []
    for o in s.optimizers:
        po, sync = rows.get((4, o, "pipeoptim")), rows.get((4, o, "1f1b")) or rows.get((4, o, "gpipe"))
        if po is None or sync is None:
            continue
        found = []
        for m in PREDICTOR_VARIANTS:
            row = rows.get((4, o, m))
            f = None if row is None else gap_closed(row, po, sync)
            if f is not None:
                found.append((f, m, row["tokens_per_s"] / po["tokens_per_s"]))
        if not found:
            lines.append(f"- D=4, {OPT_LABELS[o]}: PipeOptim has no real gap to 1F1B here (or no variant ran): "
                         "nothing to close.")
            continue
        f, m, speed = max(found)
        met = f >= 0.5 and speed >= 0.98
        lines.append(f"- D=4, {OPT_LABELS[o]}: best variant {LABELS[m]} closes {f:+.0%} of PipeOptim's gap "
                     f"(simulated throughput {speed:.2f}x PipeOptim's): target {'MET' if met else 'not met'}.")
    return lines


def verdict_paragraph(s: Settings, summary: dict) -> str:
    rows = summary["rows"]
    lines = []
    for D in s.depths:
        for o in s.optimizers:
            po, parts = rows.get((D, o, "pipeoptim")), []
            if po is None:
                continue
            for m, other in _opponents(rows, D, o):
                v = compare(po["val_ms"], other["val_ms"], min(len(po["seeds"]), len(other["seeds"])))
                word = {"better (real)": "beats", "worse (real)": "loses to",
                        "one seed: no spread": "cannot be judged (one seed) against"}.get(
                            v, "ties (within spread) with")
                parts.append(f"{word} {LABELS[m]}")
            ref = rows.get((D, o, "1f1b")) or rows.get((D, o, "gpipe"))
            if ref is not None:
                v = compare(po["val_ms"], ref["val_ms"], len(po["seeds"]))
                gap = (po["val_ms"][0] - ref["val_ms"][0]) / ref["val_ms"][0] * 100
                parts.append(f"vs 1F1B: {gap:+.2f}% ({v})")
            lines.append(f"- D={D}, {OPT_LABELS[o]}: PipeOptim " + "; ".join(parts) + ".")
    return "\n".join(lines)


def notes(s: Settings, summary: dict, unigram: float) -> str:
    rows = summary["rows"]
    out = [f"- Unigram baseline: a model that knows only the training split's token frequencies scores "
           f"{unigram:.3f} on the validation set (the loss plateau every run passes through early on)."]
    for o in s.optimizers:
        sync_row = next((rows[(D, o, m)] for D in s.depths for m in SYNC_METHODS if (D, o, m) in rows), None)
        if sync_row is None:
            continue
        val = sync_row["val_ms"][0]
        if math.isfinite(val) and val > unigram - 0.1:
            out.append(f"- {OPT_LABELS[o]}: even the synchronous reference ends at {val:.3f}, not clearly below "
                       f"the unigram baseline ({unigram:.3f}): in this budget the runs learn little beyond token "
                       f"frequencies, so {OPT_LABELS[o]} comparisons between methods say little about pipelining.")
        stuck = [f"D={D} {LABELS[m]}" for D in s.depths for m in ASYNC_METHODS
                 if (D, o, m) in rows and math.isfinite(rows[(D, o, m)]["val_ms"][0])
                 and rows[(D, o, m)]["val_ms"][0] > unigram - 0.1 and not val > unigram - 0.1]
        if stuck:
            out.append(f"- {OPT_LABELS[o]}: not clearly below the unigram baseline at the end (final val loss "
                       f"above {unigram - 0.1:.3f}, while the synchronous reference reaches {val:.3f}): "
                       f"{', '.join(stuck)}.")
    if "pipedream-2bw" in s.methods:
        out.append("- PipeDream-2BW makes D times fewer updates than the others on the same samples (k = D "
                   "micro-batches per update, nothing else scaled): its gap at equal samples is mostly that.")
    out.append("- GPipe and 1F1B rows share one set of runs (identical update semantics; see the check above); "
               "only their simulated throughput differs, and with free communication and equal stages even "
               "that is the same schedule length, up to op-cost measurement noise.")
    return "\n".join(out)


def predictor_section(s: Settings, summary: dict) -> str:
    """The "Beyond the paper" section: empty unless a predictor variant ran."""
    if not any(m in PREDICTOR_VARIANTS for m in s.methods):
        return ""
    header, table = predictor_table(s, summary)
    spec = "\n".join(f"- {LABELS[m]}: `{base}` with {', '.join(f'{k}={v}' for k, v in opts.items())}"
                     for m, (base, opts) in PREDICTOR_VARIANTS.items() if m in s.methods)
    return f"""
## Beyond the paper: weight predictors and gradient-side corrections

Variants (policy options of `megatron_po/pipeline/policies.py`, predictors in `megatron_po/optim/predictors.py`;
delay compensation's λ = "tokens" = the {s.micro_batch * s.seq_length} tokens of a micro-batch, a stated rule):
{spec}

"Fraction of PipeOptim's gap closed" = (gap_PipeOptim − gap_variant) / gap_PipeOptim on the mean final
validation loss (1 = synchronous 1F1B reached, 0 = no better than PipeOptim, negative = worse); n/a where
PipeOptim's own gap is within the seed spread. "vs PipeOptim" uses the verdict rule above (a difference is
real only beyond std_a + std_b). Throughput: simulated tokens/s from the same calibration as PipeOptim's.

{markdown_table(header, table) if table else "(needs PipeOptim, 1F1B and a variant)"}

Moonshot (close at least half of PipeOptim's gap to 1F1B at D = 4 at no throughput cost):
{chr(10).join(moonshot_lines(s, summary)) or "- (D = 4 not run)"}

Curves: `predictors.png`.
"""


def write_report(s: Settings, wl, summary: dict, elapsed: float, load: tuple, png: str, reused: int = 0) -> str:
    reused = f" ({reused} run(s) reused from an earlier invocation's cache, --resume)" if reused else ""
    header, table = main_table(s, summary)
    h2h_header, h2h = head_to_head(s, summary)
    B = s.micro_batch
    calib = summary["calibrations"]
    check_lines = [f"- D={D}, {OPT_LABELS[o]} (seed 1, {s.check_updates} updates, M={D} micro-batches of "
                   f"{B // D}): max |loss difference| to the unpipelined reference: GPipe "
                   f"{c['check']['gpipe']['max_abs_diff']:.1e}, 1F1B {c['check']['1f1b']['max_abs_diff']:.1e}"
                   for (D, o), c in sorted(calib.items())]
    unigram = wl.unigram_baseline()
    n_params = None
    try:
        n_params = sum(p.numel() for c in wl.build_chunks(wl.config(1), wl.padded_vocab, 0, 1, 1)
                       for p in c.parameters())
    except Exception:  # noqa: BLE001 (the count is informative only)
        pass
    lr = ", ".join(f"{OPT_LABELS[o]} {s.lr[o]:g}" for o in s.optimizers)
    clipping = ("none (so the synchronous rule, global norm, and the asynchronous one, stage-local norm, "
                "cannot differ)" if s.clip_grad == 0 else
                f"{s.clip_grad} (synchronous: global norm; asynchronous: stage-local norm)")
    text = f"""# Convergence of pipeline methods ({s.workload.upper()}, D = {", ".join(map(str, s.depths))})

Command: `{s.command}`

{machine()}; load average at start {load[0]:.2f},
at end {load[1]:.2f}; wall time {elapsed / 60:.1f} min with {s.jobs} worker process(es), one torch thread each{reused};
{now()}.

## Settings (identical for every method; never tuned per method)
- Data: {wl.describe()}. Training samples shuffled by the seed, the same order for every method; validation
  = a fixed set of {s.eval_batches} x {B} sequences from the validation split, the same for every run.
- Model: {wl.describe_model(n_params)},
  untied input/output embeddings (required by the asynchronous methods), no dropout (every method sees the
  same function of the weights), {f"{n_params:,} parameters" if n_params else ""}; fp32. Layers split evenly
  over the D stages (D=8: one layer per stage; stage 0 also holds the embedding, the last stage the output layer).
- Seeds: {s.seeds} per (method, optimizer, D): the seed sets the weight init and the training-data order.
- Optimizers: {", ".join(OPT_LABELS[o] for o in s.optimizers)}; peak lr {lr} (Adam/AdamW as in
  `examples/gpt_tiny.sh`, SGD-momentum the common 0.1; the same for all methods, not tuned per method);
  cosine decay to {s.min_lr_ratio:g} x peak after a linear warm-up of {s.warmup} micro-batches; weight decay
  {s.weight_decay} (L2 for Adam and SGD, decoupled for AdamW; not on biases and norms); Adam betas (0.9, 0.999), eps 1e-8; SGD momentum {s.sgd_momentum}.{MUON_NOTE + muon_ns_note(s) if "muon" in s.optimizers else ""}
- Gradient clipping: {clipping}.
- Length: {s.steps} micro-batches of B = {wl.describe_sample()} = {s.steps * wl.tokens_per_microbatch:,.0f} training tokens
  per run (every method sees exactly the same samples); evaluation every {s.eval_interval} micro-batches.

## How the comparison is made fair
- **One optimizer update per B = {B} samples for every method except 2BW.** The asynchronous methods run
  k = 1, the published setting: every stage steps after each of its backwards, one micro-batch of B samples.
  GPipe and 1F1B step once per batch of the same B samples (run as M = D micro-batches of B/D so that they
  pipeline at all), so their update is W <- W - lr*U(mean gradient of the B samples at W). Same
  samples, same number of updates, same lr at every update, same hyperparameters.
- **PipeDream-2BW** needs gradient accumulation over k >= D micro-batches per update; it runs with k = D
  and nothing else scaled (same lr, same schedule on the sample clock): its updates average D micro-batches
  ({", ".join(f"D={D}: {D * B} samples" for D in s.depths)}), so it makes D times fewer updates on the same samples.
- **LR clock:** the schedule is a function of micro-batches consumed; step i of a stage that steps every k
  micro-batches uses the lr of micro-batch i*k, so warm-up and decay cover the same samples for all methods.
- **GPipe and 1F1B have identical update semantics** (the same gradient of the same batch, one flush, one
  step); they differ only in schedule and activation memory. Their convergence columns are therefore one
  run per (optimizer, seed): the unpipelined model trained on batches of B (the same emulator code with
  D = 1, where no method has staleness), valid at every D. The real GPipe / 1F1B op lists were run for a few
  updates as a check (`emulate` + `StageRunner`, `synchronous_forward_backward` semantics, global clipping):
{chr(10).join("  " + line for line in check_lines) if check_lines else "  (no synchronous method selected)"}
- **Asynchronous runs:** `AsyncEmulator` (all D stages in one process; the distributed run's op lists and
  per-op code, tested equal to it). The stream drains at each evaluation (every {s.eval_interval}
  micro-batches), exactly as `pretrain_gpt.py` does; evaluation uses the live weights, no prediction.
  PipeOptim: paper defaults (s = s(j) from the schedule, s_offset 0, momentum-buffer direction for SGD,
  decoupled weight decay not extrapolated). SpecTrain runs with SGD-momentum only (it predicts from the
  momentum buffer).
- **Train loss** is each micro-batch's loss as its forward computed it, i.e. on the weights the method
  used for that forward (stale for naive/PipeDream/2BW, predicted for SpecTrain/PipeOptim); "final" =
  mean over the last {s.tail} micro-batches. **Final val loss** = the fixed validation set after the last
  update, live weights.
- **Verdict rule:** a difference is called real only when it exceeds the spread: the mean ± std (sample
  std over seeds) intervals of the two methods do not overlap, i.e. |Δmean| > std_a + std_b. The paired
  count (seeds where PipeOptim is lower, same seed = same init and data order) is given alongside.
- **tokens/s (sim.)** is *simulated pipeline throughput*, not measured wall time (the emulator runs the
  stages one after another in one process). Per (D, optimizer) one calibration process trains every
  method in turn ({s.timing_rounds} rounds of 2D micro-batches each after an untimed warm-up, so load from
  other processes on this shared machine hits all methods alike) and records, on one thread, each op's
  time and the part of it spent in the weight policy's hooks (prediction, stashing, swaps, 2BW's version
  copy). A stage's forward / backward / step cost for an asynchronous method = the base cost of that op
  (op time minus hook time, pooled over all methods, which run the same model code; 10th percentile, the
  least-disturbed executions) + the method's own hook time (median over its ops). So measurement
  noise in the shared base cannot separate the methods; their policy work and their schedules do. GPipe
  and 1F1B pool their op times (the same ops in another order). These costs go into
  `megatron_po.pipeline.simulator.simulate` with each method's schedule and free communication.
  Async: steady state of the no-flush stream (a stage's step folded into its backwards, 1/k per backward).
  GPipe / 1F1B: one flush of M = D micro-batches of B/D (costs measured at that size) plus the slowest
  stage's step, per batch of B. Absolute values reflect one thread of a loaded 2-core CPU and such a tiny
  model that per-op overheads dominate; compare rows within one (D, optimizer) block.
- **Weight copies per stage** = the most full weight copies of the stage's model chunk alive at once,
  live weights included, measured by `AsyncEmulator.copies_per_chunk()` (max over seeds); GPipe/1F1B: 1.

## Results: final losses (mean ± std over {s.seeds} seeds), throughput, memory

{markdown_table(header, table)}

## PipeOptim against the other asynchronous methods (final validation loss, lower is better)

{markdown_table(h2h_header, h2h) if h2h else "(needs PipeOptim and another asynchronous method)"}

## Verdict

{verdict_paragraph(s, summary) or "(PipeOptim not selected)"}
{predictor_section(s, summary)}
## Notes

{notes(s, summary, unigram)}{wl.report_notes(summary) if hasattr(wl, "report_notes") else ""}

Curves: `{os.path.basename(png)}` (train loss as a moving mean, validation loss dashed; mean over seeds,
band ±1 std; one panel per (D, optimizer)).
"""
    return text
