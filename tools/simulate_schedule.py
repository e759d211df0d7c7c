"""Print a pipeline schedule, simulate its timeline and draw it.

    python tools/simulate_schedule.py --pipeline-method 1f1b --num-stages 4 --num-chunks 2 \
        --num-microbatches 8 --png /tmp/interleaved.png

`--t-forward` / `--t-backward` are the cost of one micro-batch through one whole pipeline stage; with
`--num-chunks v` each chunk costs 1/v of that, so runs with different v compare at equal model size.
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_po.errors import UserError
from megatron_po.pipeline.schedules import build_schedule, staleness
from megatron_po.pipeline.simulator import plot_timeline, simulate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipeline-method", choices=["none", "gpipe", "1f1b", "async"], default="1f1b",
                   help="1f1b with --num-chunks > 1 is Megatron's interleaved 1F1B; async streams "
                        "micro-batches without a flush and steps each chunk every --update-interval backwards")
    p.add_argument("--num-stages", type=int, default=4, help="pipeline ranks D")
    p.add_argument("--num-chunks", type=int, default=1, help="model chunks per rank v (virtual pipeline size)")
    p.add_argument("--num-microbatches", type=int, default=8, help="micro-batches M")
    p.add_argument("--t-forward", type=float, default=1.0, help="forward time of one stage (all its chunks)")
    p.add_argument("--t-backward", type=float, default=2.0, help="backward time of one stage (all its chunks)")
    p.add_argument("--t-p2p", type=float, default=0.0, help="latency of one activation/gradient message")
    p.add_argument("--t-step", type=float, default=0.0, help="time of one optimizer step op")
    p.add_argument("--update-interval", type=int, default=1, help="async: step after every k backwards")
    p.add_argument("--png", default=None, help="write the Gantt chart here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        schedule = build_schedule(args.pipeline_method, args.num_stages, args.num_chunks,
                                  args.num_microbatches, update_interval=args.update_interval)
        v = schedule.num_chunks
        timeline = simulate(schedule, args.t_forward / v, args.t_backward / v, args.t_p2p, args.t_step)
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
