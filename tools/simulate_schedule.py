"""Print a pipeline schedule, simulate its timeline and draw it.

    python tools/simulate_schedule.py --pipeline-method 1f1b --num-stages 4 --num-chunks 2 \
        --num-microbatches 8 --png /tmp/interleaved.png

    python tools/simulate_schedule.py --pipeline-method all --num-stages 4 --num-microbatches 8 \
        --t-forward 20 --t-backward 40 --t-weight 20

`--t-forward` / `--t-backward` are the cost of one micro-batch through one whole pipeline stage; with
`--num-chunks v` each chunk costs 1/v of that, so runs with different v compare at equal model size.
`--t-backward` is the whole backward; zero-bubble schedules split it into B (input gradient,
t_backward - t_weight) and W (weight gradients, `--t-weight`, default half the backward).
`--pipeline-method all` prints one row per schedule (bubble fraction, peak in-flight micro-batches
per rank); interleaved schedules there use `--num-chunks` (2 when it is 1).
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_po.errors import ConfigError, UserError
from megatron_po.pipeline.schedules import build_schedule, staleness
from megatron_po.pipeline.simulator import plot_timeline, simulate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipeline-method", choices=["none", "gpipe", "1f1b", "async", "zb-h1", "zb-h2", "zb-v", "all"],
                   default="1f1b",
                   help="1f1b with --num-chunks > 1 is Megatron's interleaved 1F1B; async streams "
                        "micro-batches without a flush and steps each chunk every --update-interval backwards; "
                        "zb-h1 / zb-h2 / zb-v: zero bubble (zb-h1 with --num-chunks > 1: interleaved; zb-v: "
                        "--num-chunks 2 in a V); all: a table")
    p.add_argument("--num-stages", type=int, default=4, help="pipeline ranks D")
    p.add_argument("--num-chunks", type=int, default=1, help="model chunks per rank v (virtual pipeline size)")
    p.add_argument("--num-microbatches", type=int, default=8, help="micro-batches M")
    p.add_argument("--t-forward", type=float, default=1.0, help="forward time of one stage (all its chunks)")
    p.add_argument("--t-backward", type=float, default=2.0, help="backward time of one stage (all its chunks)")
    p.add_argument("--t-weight", type=float, default=None,
                   help="weight-gradient part of --t-backward (zero-bubble W); default: half of it")
    p.add_argument("--t-p2p", type=float, default=0.0, help="latency of one activation/gradient message")
    p.add_argument("--t-step", type=float, default=0.0, help="time of one optimizer step op")
    p.add_argument("--update-interval", type=int, default=1, help="async: step after every k backwards")
    p.add_argument("--png", default=None, help="write the Gantt chart here")
    return p.parse_args(argv)


def _simulate(args, method: str, num_chunks: int):
    schedule = build_schedule(method, args.num_stages, num_chunks, args.num_microbatches,
                              update_interval=args.update_interval if method == "async" else 1)
    v = schedule.num_chunks
    t_w = args.t_backward / 2 if args.t_weight is None else args.t_weight
    if not 0 <= t_w <= args.t_backward:
        raise ConfigError(f"--t-weight ({t_w}) must be in [0, --t-backward ({args.t_backward})]")
    timeline = simulate(schedule, args.t_forward / v, (args.t_backward - t_w) / v, args.t_p2p, args.t_step,
                        t_weight=t_w / v)
    return schedule, timeline


ALL = [("gpipe", 1), ("1f1b", 1), ("1f1b", None), ("zb-h1", 1), ("zb-h1", None), ("zb-h2", 1), ("zb-v", 2),
       ("async", 1)]


def table_of_all(args) -> str:
    """One row per schedule: makespan, bubble fraction, bubble time / ideal, peak in flight per rank."""
    v_inter = args.num_chunks if args.num_chunks > 1 else 2
    ideal = args.num_microbatches * (args.t_forward + args.t_backward)
    lines = [f"D={args.num_stages} M={args.num_microbatches} t_F={args.t_forward:g} t_B+t_W={args.t_backward:g} "
             f"t_W={args.t_backward / 2 if args.t_weight is None else args.t_weight:g} (per stage); ideal {ideal:g}",
             f"{'schedule':<22} {'v':>2} {'makespan':>9} {'bubble':>7} {'extra/ideal':>11}  peak in flight per rank"]
    for method, v in ALL:
        v = v or v_inter
        try:
            schedule, tl = _simulate(args, method, v)
        except ConfigError as e:  # e.g. interleaving needs M % D == 0
            lines.append(f"{method:<22} {v:>2}  skipped: {e}")
            continue
        name = ("interleaved-" if v > 1 and method == "zb-h1" else "") + schedule.name
        peaks = " ".join(str(tl.peak_activations[r]) for r in sorted(tl.peak_activations))
        lines.append(f"{name:<22} {v:>2} {tl.makespan:>9.4g} {tl.bubble_fraction:>7.4f} "
                     f"{(tl.makespan - ideal) / ideal:>11.4f}  {peaks}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.pipeline_method == "all":
            print(table_of_all(args))
            return 0
        schedule, timeline = _simulate(args, args.pipeline_method, args.num_chunks)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)

    print(schedule)
    print()
    print(timeline.table())
    M = schedule.num_microbatches
    ideal = M * (args.t_forward + args.t_backward)
    print(f"ideal compute per rank {ideal:.4g}; bubble time / ideal = "
          f"{(timeline.makespan - ideal) / ideal if ideal else 0.0:.4f}")
    if args.pipeline_method == "async":
        print("\nstaleness s(mb) per (rank, chunk): optimizer steps between F(mb) and B(mb)")
        for (r, c), per_mb in sorted(staleness(schedule).items()):
            values = [per_mb[mb] for mb in sorted(per_mb)]
            print(f"  rank {r} chunk {c}: max {max(values)}  {' '.join(map(str, values))}")
    if args.png:
        plot_timeline(timeline, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
