"""Soak: a long PipeOptim run of the tiny GPT at PP=2 x DP=2, watched from outside for memory growth and
throughput drift.

    python bench/memory/soak.py                         # 2,000 iterations (about 25 min on 2 shared cores)
    python bench/memory/soak.py --iters 200             # a quick look

Four `pretrain_gpt.py` processes are launched as Slurm tasks would be (no torchrun), with evaluations,
checkpoints (`--keep-last 2`) and the metrics file on, on the bundled corpus (prepared by
examples/data/prepare_bible.sh when missing). Every second the benchmark samples each rank's resident
memory (VmRSS) and anonymous memory (RssAnon: heap, what a leak grows; VmRSS also counts the pages of
the memory-mapped corpus the sampler has touched) and reads the metrics file for the iteration reached.

Warm-up ends after the first checkpoint (it allocates the save path's buffers once). Reported, against
the figures right after warm-up in the same run: each rank's memory growth (median over the last tenth
of the iterations vs the first tenth after warm-up) and its least-squares slope in MB per 1,000
iterations (target: no growth), and the median tokens/s of the last quarter over that of the first
post-warm-up quarter (drift). The markdown report goes to `--out` (default bench/results/soak.md).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
REPO = bench_common.REPO

from rank_launcher import launch, memory_kb, tagged_processes  # noqa: E402

DATA = os.path.join(REPO, "examples", "data")


def training_flags(args, work: str) -> list[str]:
    """The tiny GPT of examples/gpt_tiny.sh, pipelined: PP=2 x DP=2, PipeOptim, AdamW."""
    return [
        "--pipeline-model-parallel-size", "2", "--pipeline-method", "pipeoptim",
        "--untie-embeddings-and-output-weights",
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "8", "--global-batch-size", "32",
        "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--data-path", os.path.join(DATA, "bible_text_document"), "--split", "969,30,1",
        "--tokenizer-model", os.path.join(DATA, "bible.model"), "--data-cache-path", os.path.join(work, "cache"),
        "--log-interval", "10", "--eval-interval", str(args.eval_interval), "--eval-iters", "4",
        "--save", os.path.join(work, "checkpoints"), "--save-interval", str(args.save_interval),
        "--keep-last", "2", "--metrics-file", os.path.join(work, "metrics.jsonl"),
    ]


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (iteration, MB) points, in MB per 1,000 iterations."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv=None) -> int:
    ap = bench_common.parser(__doc__)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--save-interval", type=int, default=500)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "soak"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "soak.md"))
    args = ap.parse_args(argv)

    if not os.path.exists(os.path.join(DATA, "bible_text_document.idx")):
        subprocess.run(["bash", os.path.join(DATA, "prepare_bible.sh"), sys.executable], check=True, cwd=REPO)
    if os.path.exists(args.work):
        subprocess.run(["rm", "-rf", args.work], check=True)
    flags = training_flags(args, args.work)
    metrics = os.path.join(args.work, "metrics.jsonl")
    tag = uuid.uuid4().hex
    load_start = os.getloadavg()
    started = time.time()
    procs = launch(os.path.join(REPO, "pretrain_gpt.py"), flags, 4, os.path.join(args.work, "logs"), tag)
    samples = []  # (seconds, iteration, rank, VmRSS kB, RssAnon kB)
    iteration, next_report = 0, 60.0
    while any(p.poll() is None for p in procs):
        records = bench_common.read_metrics(metrics)
        iteration = max([r["iteration"] for r in records], default=0)
        for rank, p in enumerate(procs):
            try:
                m = memory_kb(p.pid)
            except OSError:
                continue
            if "RssAnon" not in m:  # exited, not yet reaped
                continue
            samples.append((time.time() - started, iteration, rank, m["VmRSS"], m["RssAnon"]))
        if time.time() - started >= next_report:
            next_report += 60.0
            print(f"  {time.time() - started:5.0f} s: iteration {iteration}/{args.iters}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        time.sleep(1.0)
    elapsed = time.time() - started
    codes = [p.returncode for p in procs]
    leftovers = tagged_processes(tag)
    if any(codes):
        print(f"soak run failed: exit codes {codes}; logs in {args.work}/logs", file=sys.stderr)
        return 1

    records = bench_common.read_metrics(metrics)
    warm = args.save_interval  # the first checkpoint closes warm-up
    post = [s for s in samples if s[1] > warm]
    train = [r for r in records if "tokens_per_sec" in r and r["iteration"] > warm]
    span = args.iters - warm
    early = [r["tokens_per_sec"] for r in train if r["iteration"] <= warm + span // 4]
    late = [r["tokens_per_sec"] for r in train if r["iteration"] > args.iters - span // 4]
    drift = statistics.median(late) / statistics.median(early)

    rows, worst_growth = [], 0.0
    tenth = max(1, span // 10)
    for rank in range(4):
        mine = [s for s in post if s[2] == rank]
        # medians over the first and the last tenth: a single sample may catch an evaluation's or a
        # checkpoint's transient buffers
        first = [s for s in mine if s[1] <= warm + tenth] or mine[:1]
        last = [s for s in mine if s[1] > args.iters - tenth] or mine[-1:]
        anon0, anon1 = (statistics.median(s[4] for s in part) / 1024 for part in (first, last))
        rss0, rss1 = (statistics.median(s[3] for s in part) / 1024 for part in (first, last))
        slope = slope_per_1000([(s[1], s[4] / 1024) for s in mine])
        worst_growth = max(worst_growth, (anon1 - anon0) / anon0)
        rows.append(f"| {rank} | {rank // 2} | {anon0:.1f} | {anon1:.1f} | {anon1 - anon0:+.1f} "
                    f"({(anon1 - anon0) / anon0:+.1%}) | {slope:+.2f} | {rss0:.1f} | {rss1:.1f} |")
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    verdict_mem = "none" if worst_growth <= 0.02 else f"{worst_growth:.1%} (above the 2% noise allowance)"
    command = bench_common.command_line("bench/memory/soak.py", argv or sys.argv[1:], quote=True)
    lines = [
        "# Soak: PipeOptim, tiny GPT, PP=2 x DP=2, CPU (gloo)",
        "",
        f"Command: `{command.strip()}` ({args.iters} iterations, {elapsed / 60:.1f} min wall clock, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs, commit {bench_common.commit()}; load "
        f"average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end).",
        "",
        "Training command of each rank (4 processes launched as Slurm tasks, no torchrun):",
        "",
        "```",
        bench_common.portable("pretrain_gpt.py " + " ".join(shlex.quote(f) for f in flags)),
        "```",
        "",
        f"Warm-up: iterations 1-{warm} (first evaluation and first checkpoint). Memory sampled every second "
        f"from /proc ({len(samples)} samples); the table compares the medians over the first and the last tenth "
        f"of the post-warm-up iterations; the slope fits all post-warm-up samples. Loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}.",
        "",
        f"| rank | stage | RssAnon, iterations {warm + 1}-{warm + tenth} (MB) | RssAnon, last {tenth} iterations (MB) "
        "| growth | slope (MB / 1000 it) | VmRSS, first (MB) | VmRSS, last (MB) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Throughput: median tokens/s of iterations {warm + 1}-{warm + span // 4}: {statistics.median(early):.0f}; "
        f"of the last {span // 4}: {statistics.median(late):.0f}; ratio **{drift:.3f}** (1.0 = no drift; the "
        f"machine's load moves it by several %).",
        "",
        f"Memory growth after warm-up: **{verdict_mem}** (largest RssAnon growth of any rank "
        f"{worst_growth:+.2%}). Exit codes {codes}; processes left behind: {len(leftovers)}.",
    ]
    bench_common.publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
