"""Which pipeline should I use? Time to quality of every pipeline method, equally tuned (issue 16).

    python bench/time_to_quality.py --jobs 2                          # D = 4, AdamW and Muon, all methods
    python bench/time_to_quality.py --optimizers adamw --resume       # one optimizer (reuses finished runs)
    python bench/time_to_quality.py --depths 4 8 --resume             # add D = 8
    python bench/time_to_quality.py --quick                           # smoke run (a few minutes)
    python bench/time_to_quality.py --workload nmt --resume           # the translation model (D = 4, AdamW)

Writes bench/results/time_to_quality/time_to_quality.{md,png,json}: command, load, settings, the lr sweep,
verdict 1 (final validation loss at equal tokens, seed spread), verdict 2 (simulated time to three target
losses), the issue's goal answered, and validation loss against tokens and against simulated wall clock,
one row of panels per (D, optimizer); `--workload nmt`: time_to_quality_nmt.*, with the validation BLEU
(`--name` renames the files). The runs: bench/ttq_run.py; measuring and reporting: bench/ttq_report.py;
both reuse bench/convergence.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
import ttq_report  # noqa: E402
import ttq_run as tr  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="gpt", choices=("gpt", "nmt"),
                   help="gpt (default) or nmt: the translation model (its own horizon, methods and lr grid)")
    p.add_argument("--depths", type=int, nargs="+", default=None, help="pipeline stages D (default 4)")
    p.add_argument("--optimizers", nargs="+", default=None, choices=tr.OPTIMIZERS, help="default: adamw muon")
    p.add_argument("--methods", nargs="+", default=None, choices=tr.METHODS, help="default: all")
    p.add_argument("--sync-m", type=int, nargs="+", default=None, metavar="M",
                   help="synchronous runs to train: M micro-batches per update (default 1, 2D and 4D; 2D required)")
    p.add_argument("--seeds", type=int, default=None, help="seeds at the best lr (default 3; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="micro-batches of B per run (default 1024)")
    p.add_argument("--lr-grid", nargs="+", default=None, metavar="OPT=LR,LR,...",
                   help=f"lr sweep per optimizer (default {tr.LR_GRID})")
    p.add_argument("--quick", action="store_true", help="tiny model, 64 micro-batches, 2 lr, 2 seeds, 4 methods")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one torch thread each)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs from <out>/.cache/runs")
    p.add_argument("--out", default=None, help="output directory (default bench/results/time_to_quality)")
    p.add_argument("--name", default=None,
                   help="base name of the output files (default time_to_quality; nmt: time_to_quality_nmt)")
    return p


def settings_from_args(argv=None):
    a = build_parser().parse_args(argv)
    nmt = a.workload == "nmt"
    s = tr.nmt_study_settings(a.quick) if nmt else tr.study_settings(a.quick)
    grid = {o: list(v) for o, v in (tr.NMT_LR_GRID if nmt else tr.LR_GRID).items()}
    if a.quick:
        grid = {o: v[1:3] for o, v in grid.items()}
    for item in a.lr_grid or []:
        o, _, v = item.partition("=")
        if o not in grid:
            raise SystemExit(f"error: --lr-grid {item!r}: OPT must be one of {', '.join(grid)}")
        try:
            grid[o] = [float(x) for x in v.split(",")]
        except ValueError:
            raise SystemExit(f"error: --lr-grid {item!r}: expected OPT=LR,LR,...") from None
    for name in ("depths", "optimizers", "methods", "seeds", "steps"):
        if getattr(a, name) is not None:
            setattr(s, name, getattr(a, name))
    if a.quick and a.methods is None and not nmt:  # (NMT's quick methods: nmt_study_settings)
        s.methods = ["1f1b", "zb-h1", "pipedream", "2bw-ef"]
    if a.quick and a.optimizers is None:
        s.optimizers = ["adamw"]
    s.jobs, s.resume = a.jobs, a.resume
    s.sync_ms = a.sync_m  # (likewise not a field)
    s.name = a.name  # (not a Settings field, so not in the cache key; None: the workload's default name)
    s.out = os.path.abspath(a.out or (tr.OUT + "_quick" if a.quick else tr.OUT))
    given = sys.argv[1:] if argv is None else list(argv)
    s.command = "python bench/time_to_quality.py" + "".join(" " + shlex.quote(x) for x in given)
    return s, grid


def run(s, grid: dict, log=print) -> dict:
    """The study end to end; returns {"paths": [md, png, json], "study": ...}."""
    load0, start = os.getloadavg(), time.perf_counter()
    study = tr.run_study(s, grid, log)
    return {"paths": ttq_report.write(s, grid, study, load0, time.perf_counter() - start, getattr(s, "name", None)),
            "study": study}


def main(argv=None) -> int:
    s, grid = settings_from_args(argv)
    out = run(s, grid)
    print(f"> wrote {', '.join(os.path.relpath(p) for p in out['paths'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
