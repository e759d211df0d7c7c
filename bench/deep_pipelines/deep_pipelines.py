"""Where an asynchronous pipeline earns its keep (issues 36, 41): D = 8 with few micro-batches per update (M = 2,
4, 8), every method trained for the micro-batches it processes in an equal wall-clock budget on the measured
H200 clock.

    python bench/deep_pipelines/deep_pipelines.py --study --jobs 2 --resume        # issue 41's study (hours)
    python bench/deep_pipelines/deep_pipelines.py --study --report-only            # reports from the runs so far
    python bench/deep_pipelines/deep_pipelines.py --map-study 57 --jobs 1 --resume # issue 57: D = 4, M = 2
    python bench/deep_pipelines/deep_pipelines.py --optimizers muon -M <M> --methods sync <method> --ks <k> \
        --hidden 128 --seeds 3 --far-seeds 3 --jobs 2 --resume   # issue 41 item 4: S and the best unit, wider
    python bench/deep_pipelines/deep_pipelines.py --optimizers muon -M 2 --methods sync pipeoptim --ks M --resume
    python bench/deep_pipelines/deep_pipelines.py --quick                           # smoke run (a minute)
    python bench/deep_pipelines/deep_pipelines.py --from-json bench/results/deep_pipelines/<name>.json

The clock is megatron_po/pipeline/cost_model.py's: each method's seconds per micro-batch from its own op list
(a synchronous schedule's flush + every rank's step; the asynchronous stream's steady state with a step
after every k backwards; every send to another rank paying the p2p message time) priced by a cost model (default: the
measured H200 model, bench/results/gpu_nvidia_h200_a_cost_model.json). The budget is the time the best
synchronous schedule S needs for the horizon H (micro-batches of B samples; --study: 512 updates of S); each
asynchronous unit then trains for floor(budget / its seconds per micro-batch), rounded down to whole evaluation
intervals, with its lr schedule (warm-up 1/32 of its run, cosine decay) spanning its own run. The runs
(bench/time_to_quality/ttq_run.py's workload and bench/convergence/convergence.py's `train_job`, imported): the
synchronous schedules share one unpipelined run per (M, optimizer) (the mean gradient of M micro-batches, one
step); the asynchronous ones run through `AsyncEmulator` at D stages and update interval k. Each (optimizer, M)
is a block with its own JSON, report and verdicts file, run in order; finished runs are cached in
<out>/runs/ (committed), so --resume continues on a fresh clone. A block's plan (each unit's micro-batches, S
and the budget) is fixed by its first runs: a later command reads it back from the block's JSON
(`recorded_plan`), so a correction of the clock re-prices the report and retrains nothing. The report:
deep_pipelines_report.py.
"""

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import deep_pipelines_report as report  # noqa: E402
from deep_pipelines_runs import (ASYNC, CLOSE_NAT, D, FAR_SEEDS, LR_GRID, MAP_STUDIES, MAX_GROWTH,  # noqa: E402
                                 MEASURED, OPTIMIZERS, OUT, STUDY_BLOCKS, STUDY_SEEDS, STUDY_UPDATES, Progress,
                                 best_sync, cmm, cv, dump_json, map_units, plan_size, plan_units, provenance_now,
                                 recorded_plan, run_study, study_settings, study_units)
from megatron_po.errors import ConfigError  # noqa: E402


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = bench_common.parser(__doc__)
    p.add_argument("--study", action="store_true", help="issue 41's study (module docstring): Muon at M = 2, 4 and "
                   "AdamW at M = 4, in that order, H = 512 x M; ignores --optimizers, -M, --methods, --ks")
    p.add_argument("--map-study", type=int, nargs="?", const=50, default=None, choices=sorted(MAP_STUDIES),
                   metavar="ISSUE", help="a map study, each predicted before its runs (deep_pipelines_predict.py): "
                   "50 (the default; the pipeline map beyond D = 8), Muon at (D, M) = (4, 1), (8, 1), (16, 4), in "
                   "that order; 57 (the refit's held-out setting), Muon at (4, 2); H = 512 x M; S, PipeOptim and "
                   "async-naive at k = M, PipeOptim at k = 2 where M = 1; ignores --depth, --optimizers, -M, "
                   "--methods, --ks")
    p.add_argument("--depth", "-D", type=int, default=D, help=f"pipeline stages D, one layer each (default {D})")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon"], choices=list(OPTIMIZERS))
    p.add_argument("--microbatches", "-M", type=int, nargs="+", default=[4], help="M per synchronous update (default 4)")
    p.add_argument("--methods", nargs="+", default=["sync", *ASYNC], choices=["sync", *ASYNC])
    p.add_argument("--ks", nargs="+", default=["1", "2", "M"], help="update intervals of the asynchronous units "
                   "(integers, or M)")
    p.add_argument("--seeds", type=int, default=None, help=f"seeds of S and of every unit within {CLOSE_NAT} nat of "
                   f"it (default {STUDY_SEEDS}; --quick 2)")
    p.add_argument("--far-seeds", type=int, default=None, help=f"seeds of a unit more than {CLOSE_NAT} nat behind S "
                   f"(seed 1) (default {FAR_SEEDS}; --quick: --seeds)")
    p.add_argument("--steps", type=int, default=None, help=f"horizon H of S in micro-batches at every M (default "
                   f"{STUDY_UPDATES} x M: {STUDY_UPDATES} updates)")
    p.add_argument("--hidden", type=int, default=None, help="model width (default 64; issue 41 item 4: 128, with "
                   "the same depth and heads; part of every run's cache key)")
    p.add_argument("--lr-grid", nargs="+", default=None, metavar="OPT=LR,LR,...")
    p.add_argument("--cost-model", default=os.path.relpath(MEASURED, cv.REPO), metavar="PATH",
                   help="the clock that sets every unit's budget (default: the measured H200 model)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, H = 32, AdamW, sync and PipeOptim "
                   "at k = M, one lr (no growth), 2 seeds")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one torch thread each)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs from <out>/runs (committed)")
    p.add_argument("--report-only", action="store_true", help="no training: the reports from the runs <out>/runs "
                   "holds (a partial one says so: in progress, N of K runs, verdict not yet decided)")
    p.add_argument("--deadline", default=None, metavar="HH:MM", type=_hhmm, help="start no run after this UTC time")
    p.add_argument("--out", default=None, help="output directory (default bench/results/deep_pipelines)")
    p.add_argument("--name", default="deep_pipelines", help="first part of the output files' names (then D, M, "
                   "optimizer, horizon)")
    p.add_argument("--from-json", default=None, metavar="PATH", help="the report again from its JSON, no training")
    return p


def _hhmm(text: str) -> str:
    """--deadline's check at parse time: bad input is one argparse error line, not a traceback mid-plan."""
    h, _, m = text.partition(":")
    if not (h.isdigit() and m.isdigit() and len(m) == 2 and int(h) < 24 and int(m) < 60):
        raise argparse.ArgumentTypeError(f"expected a UTC time HH:MM, got {text!r}")
    return text


def _deadline(text: str | None) -> float | None:
    if text is None:
        return None
    import datetime
    h, m = (int(x) for x in text.split(":"))
    now = datetime.datetime.now(datetime.timezone.utc)
    at = now.replace(hour=h, minute=m, second=0, microsecond=0)
    # A time up to 12 h ago has passed (no new run starts: --resume then reports what the cache holds);
    # further back, it is tomorrow's.
    return (at + datetime.timedelta(days=1)).timestamp() if (now - at).total_seconds() > 12 * 3600 else at.timestamp()


@dataclasses.dataclass
class Block:
    """One (optimizer, M) of a command: its settings (H = s.steps), units, conditional units, output name."""
    s: cv.Settings
    units: list
    conditional: list
    name: str


@dataclasses.dataclass
class Plan:
    """What a command runs: the blocks in order, the clock, lr grids and the run's options."""
    blocks: list
    cm: dict
    cost_model_path: str
    grid: dict
    max_growth: int
    deadline: float | None
    command: str
    close_nat: float = CLOSE_NAT
    far_seeds: int = FAR_SEEDS


def plan_from_args(given: list[str]) -> Plan:
    a = build_parser().parse_args(given)
    if a.depth < 2 or (a.quick and a.depth != D):
        raise SystemExit(f"error: --depth {a.depth}: need D >= 2 (--quick runs at D = {D})")
    s = study_settings(a.quick, a.depth)
    s.seeds = a.seeds if a.seeds is not None else (s.seeds if a.quick else STUDY_SEEDS)
    far = a.far_seeds if a.far_seeds is not None else (s.seeds if a.quick else FAR_SEEDS)
    if s.seeds < 1 or far < 1 or far > s.seeds:
        raise SystemExit(f"error: need 1 <= --far-seeds ({far}) <= --seeds ({s.seeds})")
    if a.hidden is not None:
        if a.hidden < s.num_attention_heads or a.hidden % s.num_attention_heads:
            raise SystemExit(f"error: --hidden {a.hidden} must be a multiple of the {s.num_attention_heads} heads")
        s.hidden_size = a.hidden
    s.jobs, s.resume = (1, True) if a.report_only else (a.jobs, a.resume)
    s.out = os.path.abspath(a.out or (os.path.join(OUT, ".cache", "quick") if a.quick else OUT))
    grid = bench_common.parse_lr_grid(a.lr_grid, {o: v[1:2] if a.quick else v for o, v in LR_GRID.items()})
    defaults = build_parser().parse_args([])
    if a.study:
        pairs = [(D, o, M, *study_units(o, M)) for o, M in STUDY_BLOCKS]
    elif a.map_study:
        pairs = [(depth, o, M, map_units(o, M), []) for depth, o, M in MAP_STUDIES[a.map_study]]
    else:
        optimizers = ["adamw"] if a.quick and a.optimizers == defaults.optimizers else a.optimizers
        methods = ["sync", "pipeoptim"] if a.quick and a.methods == defaults.methods else a.methods
        ks = ["M"] if a.quick and a.ks == defaults.ks else a.ks
        if any(x != "M" and not x.isdigit() for x in ks):
            raise SystemExit(f"error: --ks takes integers >= 1 or M, got {' '.join(ks)}")
        pairs = [(a.depth, o, M, plan_units([o], [M], methods, ks, a.depth), [])
                 for o in optimizers for M in a.microbatches]
    blocks = []
    for depth, o, M, units, cond in pairs:
        H = a.steps if a.steps is not None else (s.steps if a.quick else STUDY_UPDATES * M)
        bs = dataclasses.replace(s, steps=H, depths=[depth], num_layers=depth if not a.quick else s.num_layers)
        if M < 1 or H % M or s.eval_interval % M or s.eval_batches % M or H % s.eval_interval:
            raise SystemExit(f"error: M={M} must divide the horizon {H}, the evaluation interval {s.eval_interval} "
                             f"and the validation batches {s.eval_batches}; the interval must divide H")
        name = f"{a.name}_d{depth}_m{M}_{o.replace('-', '_')}_h{H}" + (f"_hidden{s.hidden_size}" if a.hidden else "")
        blocks.append(Block(bs, units, cond, name))
    path = a.cost_model if os.path.isabs(a.cost_model) else os.path.join(cv.REPO, a.cost_model)
    command = bench_common.command_line("bench/deep_pipelines/deep_pipelines.py", given, quote=True)
    deadline = 0.0 if a.report_only else _deadline(a.deadline)
    return Plan(blocks, cmm.load_cost_model(path), os.path.relpath(path, cv.REPO),
                {o: grid[o] for o in dict.fromkeys(u.opt for b in blocks for u in b.units)},
                0 if a.quick else MAX_GROWTH, deadline, command, CLOSE_NAT, far)


def run(plan: Plan, log=print) -> list[str]:
    """The plan, block by block: S and the budget printed before any run, the runs (progress: runs done against
    the plan, ETA), then each block's JSON and report from it. Returns every file written."""
    sizes = [plan_size(b.s, plan.cm, b.units + b.conditional, len(plan.grid[b.units[0].opt])) for b in plan.blocks]
    log(f"> plan: {len(plan.blocks)} block(s), ~{sum(x[0] for x in sizes)} runs, ~{sum(x[1] for x in sizes)} "
        f"micro-batches, ~{sum(x[2] for x in sizes):.1f} CPU-hours single-thread (sweep at the initial grid and S's "
        "seeds for every unit: an upper bound on seeds, grid growth not counted)")
    for b in plan.blocks:
        u = b.units[0]
        name, t = best_sync(plan.cm, u.opt, u.M, b.s.depths[0])
        log(f"> {b.name}: S = {name} at {1e3 * t:.3f} ms per micro-batch on {plan.cost_model_path} "
            f"(p2p {plan.cm.get('p2p_ms', 0.0):g} ms); H = {b.s.steps} micro-batches ({b.s.steps // u.M} updates); "
            f"budget {b.s.steps * t:.3f} s")
    progress = Progress(sum(x[0] for x in sizes), sum(x[1] for x in sizes))
    paths = []
    for b in plan.blocks:
        load0, t0 = os.getloadavg(), time.perf_counter()
        path = os.path.join(b.s.out, b.name + ".json")
        horizons, definition = recorded_plan(path, plan.cost_model_path)
        study = run_study(b.s, plan.cm, b.units, {o: plan.grid[o] for o in {u.opt for u in b.units}}, log,
                          plan.deadline, plan.max_growth, b.conditional, plan.close_nat,
                          plan.far_seeds, progress, horizons)
        if not any(study["runs"].values()):
            log(f"> {b.name}: no finished run yet, no report")
            continue
        dump_json(path, b.s, study, plan.cm, plan.cost_model_path, plan.command,
                  provenance_now(load0, time.perf_counter() - t0), definition)
        paths.append(path)
        try:  # a report bug must not stop the study: the JSON holds everything (--from-json redoes it)
            paths += report.regenerate(path)
        except Exception as e:  # noqa: BLE001
            log(f"> {b.name}: the report failed ({type(e).__name__}: {e}); the JSON is written: --from-json")
    return paths


def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(given)
    try:
        if a.from_json:
            paths = report.regenerate(a.from_json)
        else:
            paths = run(plan_from_args(given))
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"> wrote {', '.join(os.path.relpath(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
