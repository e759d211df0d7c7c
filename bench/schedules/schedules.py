"""Pipeline schedule throughput: our executor vs its simulated bound vs torch.distributed.pipelining,
and the cost of PipeOptim's weight prediction in the asynchronous pipeline.

    python bench/schedules/schedules.py [--tf 0.02 --Ms 4 8 16 --reps 5 --skip-p2p --skip-synthetic --skip-gpt
                               --skip-gpt-async --gpt-async-pp 2 --gpt-async-layers 4 8 --copies-pp 4 --skip-zb]

Unless `--skip-zb`, it ends with bench/schedules/zero_bubble.py's table (zero-bubble schedules next to 1F1B,
interleaved, async PipeOptim and torch's ScheduleInterleavedZeroBubble; bench/results/zero_bubble.md).

Every rank is a forked process in a gloo group (tests/dist_harness.py, one torch thread per rank).
Four tables, measured in the same run, printed and written to bench/results/schedules.md:

0. p2p cost per message on gloo (2 ranks, one [mbs, 16] fp32 tensor): one-way latency with the receiver
   already waiting (the simulator's t_p2p), the cost of a recv whose message was sent earlier (gloo only
   moves the data once the receiver has posted its recv: a rendezvous round trip), the send call, and
   the wait of a receive posted before the send; raw gloo isend/recv next to our P2PTransport with
   agreed shapes (`message_specs`: one payload, no header, receives posted ahead) and with the header
   protocol (no specs: a shape header, then the payload).
1. Synthetic stages, D=4: each virtual stage is a tiny linear layer (an optimizer-visible parameter)
   followed by an autograd Function that sleeps t_f in forward and t_b = 2 t_f in backward on a
   [mbs, 16] tensor (sleep releases the GIL and the CPU, so 4 ranks run in parallel on 2 cores).
   Throughput (micro-batches/s) over the ideal 1/(t_f+t_b) of one stage for our gpipe, 1f1b,
   interleaved 1f1b (v=2, each chunk at half the cost) and the asynchronous no-flush stream, next to
   the simulator's bound (nominal costs without and with the measured p2p cost; and with the stage
   costs as measured in one process) and to torch's ScheduleGPipe / Schedule1F1B /
   ScheduleInterleaved1F1B on identical stages. "ours" is the real code path with agreed shapes:
   `run_rank(build_schedule(...), StageRunner(..., P2PTransport(D, v, ActivationSpecs((mbs, 16)))))`;
   "ours, header protocol" is the same without specs. Async: `AsyncPipelineRank(cfg, ..., "pipeoptim",
   update_interval=1, message_specs=...)` whose chunk builder is swapped for the sleeping stages
   (Adam steps and PipeOptim's predict / restore run for real), and the bare schedule (`run_rank` of
   the async op list, no optimizer); steady-state throughput from the times at which the last stage
   computes the losses of micro-batches M and 3M of a segment of 4M: (3M - M) / (t(3M) - t(M)), the
   middle half, away from fill and drain (the bound times the simulated segment the same way). Next
   to it: torch's Schedule1F1B at the same M, measured side by side.
2. The real tiny GPT at PP=2: tokens/s of one forward+backward iteration (no optimizer), ours
   (`synchronous_forward_backward` with `gpt_message_specs`, and with the header protocol) vs torch's
   Schedule1F1B / ScheduleGPipe on the same chunks.
3. The real tiny GPT, asynchronous (PP=2 by default, untied, 4 and 8 layers): tokens/s of segments of
   `AsyncPipelineRank.train_segment` for async-naive, pipeoptim and pipedream (same schedule; they
   differ in the weight policy), repetitions alternating, over the whole segment and in its steady
   state; the time each rank spends in the weight policy's hooks as a share of the time per micro-batch
   and each rank's CPU time against async-naive's (PipeOptim's prediction, written by the step itself
   since issue 30, included); and the weight copies per chunk from `copies_per_chunk()` at PP=4. (The
   prediction as a pass of its own, timed in one process, was a table until commit 81465f1:
   bench/results/schedules.md; bench/step/fused_step.py times the step with and without it.)

Times are medians of `--reps` repetitions after `--warmup` discarded ones. All variants of one table
row run alternately in the same processes, so machine noise (this box is shared) hits them alike. A
repetition's makespan is max(end) - min(start) over ranks (perf_counter is CLOCK_MONOTONIC, shared by
the processes).
"""

# The command-line entry; the benchmark lives in schedules_stages (workloads), schedules_measure (timers,
# bounds), schedules_runs (what each rank runs) and schedules_report (the tables).

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402,F401
# Imported once in the parent: the forked ranks inherit it.
import torch._dynamo  # noqa: E402,F401  (model init imports it lazily, ~1 s; once here, not in every rank)

from bench_common import Lines, command_line, load_at_end, load_at_start, machine, now  # noqa: E402
from schedules_report import (gpt_async_section, gpt_sync_section, p2p_section, synthetic_section,  # noqa: E402
                              targets_section)


def build_parser() -> argparse.ArgumentParser:
    p = bench_common.parser(__doc__)
    p.add_argument("--tf", type=float, default=0.02, help="synthetic forward time per stage (s); t_b = 2 t_f")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--Ms", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--mbs", type=int, default=4, help="synthetic micro-batch rows")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--p2p-samples", type=int, default=200)
    p.add_argument("--gpt-reps", type=int, default=9)
    p.add_argument("--gpt-async-pp", type=int, default=2, help="PP of the timed asynchronous GPT runs")
    p.add_argument("--gpt-async-layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--copies-pp", type=int, default=4, help="PP of the weight-copy count")
    p.add_argument("--gpt-async-n", type=int, default=16, help="micro-batches per segment")
    p.add_argument("--gpt-async-reps", type=int, default=11)
    p.add_argument("--skip-p2p", action="store_true", help="(the simulator then uses --t-p2p)")
    p.add_argument("--t-p2p", type=float, default=0.0005, help="t_p2p (s) for the bounds when --skip-p2p")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--skip-gpt-async", action="store_true")
    p.add_argument("--skip-zb", action="store_true",
                   help="skip bench/schedules/zero_bubble.py (zero-bubble schedules, written to bench/results/zero_bubble.md)")
    p.add_argument("--out", default=os.path.join(bench_common.RESULTS, "schedules.md"))
    return p


def main():
    args = build_parser().parse_args()
    assert args.reps >= 3, "median of at least 3 repetitions"
    out = Lines()
    emit = out.emit
    started = time.perf_counter()
    summary: dict = {"async": {}, "cpu_vs": {}, "e2e": {}, "copies": None}

    emit(f"Command: `{command_line('bench/schedules/schedules.py', sys.argv[1:])}`")
    emit()
    emit(f"{machine()}, {load_at_start()}, {now()}")
    emit()
    t_p2p = args.t_p2p if args.skip_p2p else p2p_section(args, emit)
    if not args.skip_synthetic:
        synthetic_section(args, emit, t_p2p, summary, started)
    if not args.skip_gpt:
        gpt_sync_section(args, emit)
    if not args.skip_gpt_async:
        gpt_async_section(args, emit, summary, started)
    targets_section(args, emit, summary)
    emit(load_at_end(started))
    out.write(args.out)
    print(f"\nwritten to {args.out}")
    if not args.skip_zb:  # D=4, M=8, t_f = t_B = t_W = 20 ms: issue 19's setting, its own results file
        from zero_bubble import run_zero_bubble
        run_zero_bubble(reps=args.reps, warmup=args.warmup, mbs=args.mbs,
                        out_path=os.path.join(bench_common.RESULTS, "zero_bubble.md"),
                        command=f"python bench/schedules/schedules.py {' '.join(sys.argv[1:])} (its zero-bubble part)")


if __name__ == "__main__":
    main()
