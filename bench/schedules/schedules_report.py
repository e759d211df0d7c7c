"""bench/schedules/schedules.py's report: each table of `schedules.md` as one function that launches its runs
(tests/dist_harness.py), turns what they return into rows and emits the section, and the closing
`Targets` table."""

from __future__ import annotations

import os
import statistics
import time

from bench_common import markdown_table, median
from dist_harness import run_distributed
from megatron_po.config import ModelConfig
from megatron_po.pipeline.executor import PREPOST_WINDOW
from schedules_measure import async_bound, bound, makespans, steady_window
from schedules_runs import (AGREED, ASYNC_VARIANTS, HEADER, SYNC_VARIANTS, calibrate_stage_costs, gpt_async_bench,
                            gpt_bench, merge_p2p, p2p_costs, synthetic_async, synthetic_sync)
from schedules_stages import ASYNC_LR, WIDTH, mean_sleeps

TIMEOUT = 1800.0


def p2p_section(args, emit) -> float:
    """Table 0: p2p cost per message on gloo. Returns the simulator's t_p2p for the bounds of table 1."""
    res = run_distributed(p2p_costs, 2, pp=2, args=(args.mbs, args.p2p_samples), timeout=TIMEOUT)
    p2p = merge_p2p(res)
    emit(f"## 0. p2p cost per message on gloo: one [{args.mbs}, {WIDTH}] fp32 tensor, 2 ranks, "
         f"{args.p2p_samples} samples each")
    emit()
    emit(f"`{AGREED}`: P2PTransport with `message_specs` (one payload, no header; `recv` posts the irecv "
         f"itself unless `prepost` did, as run_rank does {PREPOST_WINDOW} ops ahead). `{HEADER}`: "
         f"P2PTransport without specs (a 64-int64 shape header, then the payload).")
    emit()
    rows = []
    for k, v in p2p.items():
        q = statistics.quantiles([x * 1e6 for x in v], n=10)
        rows.append([k, f"{median(v) * 1e6:.0f}", f"{q[0]:.0f}", f"{q[-1]:.0f}"])
    emit(markdown_table(["what", "median us", "p10 us", "p90 us"], rows))
    t_p2p = median(p2p[f"{AGREED}: one-way latency, receiver waiting"])
    t_p2p_header = median(p2p[f"{HEADER}: one-way latency, receiver waiting"])
    emit()
    emit(f"Simulator p2p cost used below: t_p2p = {t_p2p * 1e3:.3f} ms (ours with agreed shapes, one-way, "
         f"receiver waiting; the header protocol's is {t_p2p_header * 1e3:.3f} ms).")
    emit()
    return t_p2p


def synthetic_section(args, emit, t_p2p: float, summary: dict, started: float) -> None:
    """Table 1: the schedules on synthetic sleeping stages, ours vs the simulator's bounds vs torch's."""
    D, t_f = args.stages, args.tf
    t_b = 2 * t_f
    ideal = 1.0 / (t_f + t_b)
    cal = {v: run_distributed(calibrate_stage_costs, 1, args=(t_f / v, t_b / v, args.mbs, 20))[0] for v in (1, 2)}
    emit(f"## 1. Synthetic sleeping stages: D={D}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms per stage "
         f"(interleaved: v=2 chunks per rank at half the cost), [{args.mbs}, {WIDTH}] activations")
    emit()
    emit(f"Throughput as a fraction of ideal = 1/(t_f+t_b) = {ideal:.2f} micro-batches/s; median of {args.reps} "
         f"after {args.warmup} warm-up, all columns of a row measured alternately in the same processes.")
    emit(f"- `bound`: simulator, nominal costs, t_p2p = 0. `bound p2p`: nominal costs, t_p2p = "
         f"{t_p2p * 1e3:.2f} ms. `bound cal`: simulator with the measured stage "
         f"costs (one process, no p2p: forward {cal[1][0] * 1e3:.2f} / backward {cal[1][1] * 1e3:.2f} ms, "
         f"v=2 chunk {cal[2][0] * 1e3:.2f} / {cal[2][1] * 1e3:.2f} ms; sleep overshoot and the cold CPU "
         f"after a sleep) and t_p2p = {t_p2p * 1e3:.2f} ms. `bound run`: the same with the stage costs as "
         f"they happened in the `ours` runs of that row (mean duration of every forward and backward sleep on "
         f"all ranks: under CPU contention a sleeping rank wakes late); `overshoot`: those means minus the "
         f"nominal t_f, t_b per stage. No bound charges for optimizer steps.")
    emit(f"- `ours`: run_rank + StageRunner + P2PTransport with agreed shapes "
         f"(`ActivationSpecs(({args.mbs}, {WIDTH}))`: no header, receives posted {PREPOST_WINDOW} ops ahead), "
         f"the real code path. `ours, header`: the same without message specs (header protocol). "
         f"`torch`: ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B (2 PipelineStages per rank) on "
         f"the same stages.")
    emit(f"- async rows: steady-state throughput of the no-flush stream: segments of N=4M micro-batches, "
         f"the last stage notes when each micro-batch's loss is computed (`on_loss`), rate = (b-a) / "
         f"(t(b)-t(a)) for a=M, b=3M (the middle half, away from fill and drain; the bounds time the "
         f"simulated segment the same way). `AsyncPipelineRank pipeoptim`: "
         f"`AsyncPipelineRank(..., \"pipeoptim\", update_interval=1, message_specs=...).train_segment`, its "
         f"chunk builder swapped for the sleeping stages: a Step (Adam, lr {ASYNC_LR:g}, clip 1.0) after every "
         f"backward and PipeOptim's predict / restore around every forward. `run_rank only`: the async op "
         f"list without optimizer or policy. Their `torch` column is torch's Schedule1F1B at the same M "
         f"(it has no no-flush schedule), measured side by side, and `ours/torch` compares the two.")
    emit()
    rows = []
    async_copies = None
    breakdowns = {}
    for M in args.Ms:
        for name, method, v, kind in [("gpipe", "gpipe", 1, "gpipe"), ("1f1b", "1f1b", 1, "1f1b"),
                                      ("interleaved 1f1b v=2", "1f1b", 2, "interleaved"),
                                      ("async", "async", 1, None)]:
            tf_cal, tb_cal = cal[v]
            if method == "async":
                N, a, b = steady_window(M)
                per_rank = run_distributed(synthetic_async, D, pp=D, timeout=TIMEOUT,
                                           args=(M, t_f, t_b, args.mbs, args.warmup, args.reps))
                async_copies = {r: res[2] for r, res in enumerate(per_rank)}
                breakdowns[M] = [res[4] for res in per_rank]
                got = {variant: median(per_rank[-1][0][variant]) for variant in ASYNC_VARIANTS}
                theirs = M / median(makespans([r[1]["torch"] for r in per_rank], args.warmup))
                b0 = async_bound(D, M, t_f, t_b, 0.0)
                bp = async_bound(D, M, t_f, t_b, t_p2p)
                bc = async_bound(D, M, tf_cal, tb_cal, t_p2p)
                tf_run, tb_run = mean_sleeps([r[3] for r in per_rank])
                br = async_bound(D, M, tf_run, tb_run, t_p2p)
                summary["async"][M] = (got["pipeoptim"] / ideal, got["pipeoptim"] / theirs, got["schedule"] / ideal)
                entries = [(f"async 1f1b, AsyncPipelineRank pipeoptim k=1 (N={N}, mb {a}..{b})",
                            got["pipeoptim"], got["pipeoptim_header"]),
                           (f"async 1f1b, run_rank only (N={N}, mb {a}..{b})", got["schedule"], None)]
            else:
                per_rank = run_distributed(synthetic_sync, D, pp=D, timeout=TIMEOUT,
                                           args=(method, kind, v, M, t_f, t_b, args.mbs, args.warmup, args.reps))
                got = {k: M / median(makespans([r[k] for r in per_rank], args.warmup)) for k in SYNC_VARIANTS}
                theirs = got["torch"]
                b0 = bound(method, D, v, M, t_f / v, t_b / v, 0.0)
                bp = bound(method, D, v, M, t_f / v, t_b / v, t_p2p)
                bc = bound(method, D, v, M, tf_cal, tb_cal, t_p2p)
                tf_run, tb_run = mean_sleeps([r["slept"] for r in per_rank])
                br = bound(method, D, v, M, tf_run, tb_run, t_p2p)
                entries = [(name, got["ours"], got["header"])]
            for label, ours, header in entries:
                row = [M, label, f"{b0 / ideal:.3f}", f"{bp / ideal:.3f}", f"{bc / ideal:.3f}",
                       f"{br / ideal:.3f}", f"{(tf_run * v - t_f) * 1e3:.2f} / {(tb_run * v - t_b) * 1e3:.2f}",
                       f"{ours / ideal:.3f}", f"{ours / bp:.3f}", f"{ours / br:.3f}",
                       "-" if header is None else f"{header / ideal:.3f}",
                       f"{theirs / ideal:.3f}", f"{ours / theirs:.3f}x"]
                rows.append(row)
                print("  ", row, f"[{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}]",
                      flush=True)
    emit(markdown_table(["M", "schedule", "bound", "bound p2p", "bound cal", "bound run", "overshoot ms f / b", "ours",
                         "ours/bound p2p", "ours/bound run", "ours, header", "torch", "ours/torch"], rows))
    emit()
    if breakdowns:
        M = max(breakdowns)
        N = steady_window(M)[0]
        emit(f"Where each rank's time goes in the async pipeoptim segments of M={M} (N={N} micro-batches, fill "
             f"and drain included), ms per micro-batch, median over the repetitions: `sleep` = the stage's "
             f"forward + backward sleeps (nominal {(t_f + t_b) * 1e3:g}), `recv` = inside P2PTransport.recv "
             f"(waiting for data, mostly fill and drain), `send`, `prepost` (posting receives ahead), `step` "
             f"(AsyncStage.step: clip, Adam), `policy` (PipeOptim predict / restore), `other` = the rest "
             f"(StageRunner, autograd, the Linear, the loss). CPU ms per micro-batch of the non-sleeping "
             f"parts in brackets.")
        emit()
        rows = []
        parts = ("recv", "send", "prepost", "step", "policy")
        for r, reps in enumerate(breakdowns[M]):
            med = {k: median([x.get(k, 0.0) for x in reps]) / N * 1e3
                   for k in ("segment", "sleep") + parts + tuple(f"{p}_cpu" for p in parts)}
            other = med["segment"] - med["sleep"] - sum(med[p] for p in parts)
            rows.append([r, f"{med['segment']:.2f}", f"{med['sleep']:.2f}"]
                        + [f"{med[p]:.2f} ({med[p + '_cpu']:.2f})" for p in parts] + [f"{other:.2f}"])
        emit(markdown_table(["rank", "segment", "sleep", "recv", "send", "prepost", "step", "policy", "other"], rows))
        emit()
    if async_copies is not None:
        emit("Weight copies per chunk of the synthetic pipeoptim run (`copies_per_chunk()`, rank: copies): "
             + ", ".join(f"{r}: {c[0]}" for r, c in sorted(async_copies.items())))
        emit()


def gpt_sync_section(args, emit) -> None:
    """Table 2: the tiny GPT at PP=2, synchronous, ours vs torch.pipelining."""
    mc = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                     hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                     make_vocab_size_divisible_by=128)
    vocab, mbs, M = 1024, 4, 8
    res = run_distributed(gpt_bench, 2, pp=2, timeout=TIMEOUT,
                          args=(mc, vocab, mbs, M, ["1f1b", "gpipe"], 2, args.gpt_reps))
    emit(f"## 2. Tiny GPT, PP=2, synchronous: {mc.num_layers} layers, hidden {mc.hidden_size}, "
         f"{mc.num_attention_heads} heads, seq {mc.seq_length}, vocab {vocab} (untied), micro-batch {mbs}, "
         f"M={M}; forward+backward, no optimizer; 1 thread per rank; median of {args.gpt_reps} after 2 "
         f"warm-up, the three variants alternating in the same 2 processes")
    emit()
    emit("`ours`: synchronous_forward_backward with `gpt_message_specs` (as training.forward_backward "
         "calls it); `ours, header`: without specs.")
    emit()
    rows = []
    tokens = M * mbs * mc.seq_length
    for method in ["1f1b", "gpipe"]:
        ms = {k: median(makespans([r[method][k] for r in res], 2)) for k in ("ours", "header", "torch")}
        rows.append([method, f"{tokens / ms['ours']:,.0f}", f"{tokens / ms['header']:,.0f}",
                     f"{tokens / ms['torch']:,.0f}", f"{ms['torch'] / ms['ours']:.3f}x",
                     f"{ms['ours'] * 1e3:.0f} / {ms['header'] * 1e3:.0f} / {ms['torch'] * 1e3:.0f}"])
        print("  ", rows[-1], flush=True)
    emit(markdown_table(["schedule", "ours tokens/s", "ours, header tokens/s", "torch.pipelining tokens/s",
                         "ours/torch", "iteration ms ours / header / torch"], rows))
    emit()


def gpt_async_section(args, emit, summary: dict, started: float) -> None:
    """Table 3: the tiny GPT, asynchronous: PipeOptim's prediction overhead and weight copies."""
    P, n = args.gpt_async_pp, args.gpt_async_n
    vocab, mbs = 1024, 4
    methods = ["async-naive", "pipeoptim", "pipedream"]

    def model(layers):
        return ModelConfig(num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=128,
                           hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                           make_vocab_size_divisible_by=128)

    emit("## 3. Tiny GPT, asynchronous (k=1): PipeOptim's prediction overhead and weight copies")
    emit()
    emit(f"Hidden 128, 4 heads, seq 128, vocab {vocab} (untied), micro-batch {mbs}, no dropout; AdamW "
         f"(lr 3e-4, wd 0.01), clip 1.0, agreed shapes (the training defaults); k=1, so every stage steps "
         f"after every backward. Segments of {n} micro-batches through `AsyncPipelineRank.train_segment` "
         f"(fill and drain included), one AsyncPipelineRank per method in the same processes (same "
         f"initial weights), methods alternating ABC CBA ...; PP={P}: {P} processes with 1 thread each on "
         f"{os.cpu_count()} cores{' (oversubscribed)' if P > (os.cpu_count() or 1) else ''}; median of "
         f"{args.gpt_async_reps} after 1 warm-up segment each.")
    emit("- `policy ms/mb`: wall time per micro-batch spent in the weight policy's hooks, per rank "
         "(pipeoptim: point the parameters at the Ŵ the step wrote, or predict it, before each forward, and back; "
         "pipedream: stash copies and swaps around the backward). `policy share`: that over the segment "
         "time per micro-batch, on the rank where it is largest (wall / the same with CPU time: hook CPU "
         "time over the rank's CPU time in the segment). `step ms/mb`: the AdamW step (clip, lr, step) "
         "per micro-batch, rank 0. `tokens/s`: segment = n micro-batches over the whole segment (fill "
         "and drain included); steady = between the losses of micro-batches n/4 and 3n/4 on the last "
         "stage. `vs naive`: the extra time per micro-batch over async-naive, median over the paired "
         "repetitions (each pair run back to back) [quartiles], for the segment / steady rates. `CPU vs "
         "naive`: the same for each rank's CPU time in the segment (main thread), which other processes "
         "on the machine disturb much less than the wall clock.")
    emit()
    header = ["PP", "layers", "method", "tokens/s segment / steady", "vs naive segment / steady",
              "CPU vs naive (rank 0 / 1 / ...)",
              "policy ms/mb (rank 0 / 1 / ...)", "policy share wall / CPU", "step ms/mb",
              "copies per chunk (rank 0 / 1 / ...)"]
    rows = []

    def paired(xs, ys):
        """Median and quartiles of x/y - 1 over the pairs, as text."""
        ratios = [x / y - 1 for x, y in zip(xs, ys)]
        q = statistics.quantiles(ratios, n=4)
        return f"{median(ratios) * 100:+.1f}% [{q[0] * 100:+.1f}, {q[2] * 100:+.1f}]"

    for layers in args.gpt_async_layers:
        mc = model(layers)
        res = run_distributed(gpt_async_bench, P, pp=P, timeout=TIMEOUT,
                              args=(mc, vocab, mbs, n, methods, 1, args.gpt_async_reps))
        warm = 1
        tokens_per_mb = mbs * mc.seq_length
        spans = {m: makespans([r[0][m] for r in res], warm) for m in methods}
        steady = {m: res[-1][3][m][warm:] for m in methods}  # micro-batches/s, last stage
        for m in methods:
            per_mb = median(spans[m]) / n
            pol = [median([t["policy"] for t in r[1][m][warm:]]) / n for r in res]
            cpu_share = [median([t["policy_cpu"] / t["cpu"] for t in r[1][m][warm:]]) for r in res]
            step0 = median([t["step"] for t in res[0][1][m][warm:]]) / n
            vs = "-" if m == "async-naive" else (
                f"{paired(spans[m], spans['async-naive'])} / "
                f"{paired(steady['async-naive'], steady[m])}")  # time ratios: naive rate / method rate
            cpu_vs = "-"
            if m != "async-naive":
                extra = [median([x["cpu"] / y["cpu"] - 1
                                 for x, y in zip(r[1][m][warm:], r[1]["async-naive"][warm:])]) for r in res]
                cpu_vs = " / ".join(f"{x * 100:+.1f}%" for x in extra)
            if m == "pipeoptim":
                summary["e2e"][layers] = vs
                summary["cpu_vs"][layers] = max(extra)
            rows.append([P, layers, m, f"{n * tokens_per_mb / median(spans[m]):,.0f} / "
                         f"{median(steady[m]) * tokens_per_mb:,.0f}", vs, cpu_vs,
                         " / ".join(f"{x * 1e3:.2f}" for x in pol),
                         f"{max(pol) / per_mb * 100:.1f}% / {max(cpu_share) * 100:.1f}%", f"{step0 * 1e3:.2f}",
                         " / ".join(str(r[2][m][0]) for r in res)])
            print("  ", rows[-1], f"[{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}]",
                  flush=True)
    emit(markdown_table(header, rows))
    emit()
    # Weight copies at a deeper pipeline: a count, not a timing, so oversubscribing the cores is harmless.
    C = args.copies_pp
    mc = model(2 * C)
    res = run_distributed(gpt_async_bench, C, pp=C, timeout=TIMEOUT, args=(mc, vocab, mbs, 4 * C, methods, 1, 0))
    emit(f"Weight copies per chunk at PP={C} ({2 * C} layers, one segment of {4 * C} micro-batches per method, "
         f"`AsyncPipelineRank.copies_per_chunk()`: the most full copies held at once, live weights included):")
    emit()
    emit(markdown_table(["rank r"] + methods + ["D - r"],
                        [[r] + [res[r][2][m][0] for m in methods] + [C - r] for r in range(C)]))
    emit()
    summary["copies"] = {m: [res[r][2][m][0] for r in range(C)] for m in methods}


def targets_section(args, emit, summary: dict) -> None:
    """The `Targets` table: what the asynchronous work aims at, measured above."""
    D = args.stages
    rows = []
    if summary["async"]:
        fr = summary["async"]
        rows.append([f"async no-flush stream through AsyncPipelineRank pipeoptim, D={D}: fraction of ideal >= 0.95",
                     ", ".join(f"M={M}: {v[0]:.3f}" for M, v in sorted(fr.items()))
                     + " (bare schedule: " + ", ".join(f"{v[2]:.3f}" for M, v in sorted(fr.items())) + ")",
                     "yes" if all(v[0] >= 0.95 for v in fr.values()) else "no"])
        if 8 in fr:
            rows.append(["async / torch Schedule1F1B at M=8 >= 1.3x", f"{fr[8][1]:.3f}x",
                         "yes" if fr[8][1] >= 1.3 else "no"])
    if summary["cpu_vs"]:  # what PipeOptim's policy (prediction in the step + pointer swaps) adds to async-naive
        rows.append(["PipeOptim prediction overhead <= 3% of the step time (k=1: per micro-batch)",
                     "CPU time per micro-batch over async-naive's, the rank where it is largest (micro-batch 4): "
                     + ", ".join(f"{la} layers {x * 100:+.1f}%" for la, x in summary["cpu_vs"].items())
                     + "; end to end (segment / steady): "
                     + ", ".join(f"{la} layers {x}" for la, x in summary["e2e"].items()),
                     "yes" if max(summary["cpu_vs"].values()) <= 0.03 else "no"])
    if summary["copies"]:
        c = summary["copies"]
        depth = [len(c["pipedream"]) - r for r in range(len(c["pipedream"]))]
        rows.append(["weight copies: PipeOptim <= 2, PipeDream D-r",
                     f"pipeoptim {' / '.join(map(str, c['pipeoptim']))}, pipedream "
                     f"{' / '.join(map(str, c['pipedream']))} (D-r {' / '.join(map(str, depth))})",
                     "yes" if max(c["pipeoptim"]) <= 2 and c["pipedream"] == depth else "no"])
    if rows:
        emit("## Targets")
        emit()
        emit(markdown_table(["target", "measured", "met"], rows))
        emit()
