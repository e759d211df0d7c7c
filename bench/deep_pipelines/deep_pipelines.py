"""Where an asynchronous pipeline earns its keep (issues 36, 41): D = 8 with few micro-batches per update (M = 2,
4, 8), every method trained for the micro-batches it processes in an equal wall-clock budget on the measured
H200 clock.

    python bench/deep_pipelines/deep_pipelines.py --study --jobs 2 --resume        # issue 41's study (hours)
    python bench/deep_pipelines/deep_pipelines.py --study --report-only            # reports from the runs so far
    python bench/deep_pipelines/deep_pipelines.py --study --hidden 128 --seeds 3 --far-seeds 3 ...  # item 4
    python bench/deep_pipelines/deep_pipelines.py --optimizers muon -M 2 --methods sync pipeoptim --ks M --resume
    python bench/deep_pipelines/deep_pipelines.py --quick                           # smoke run (a minute)
    python bench/deep_pipelines/deep_pipelines.py --from-json bench/results/deep_pipelines/<name>.json

The clock is megatron_po/pipeline/cost_model.py's: each method's seconds per micro-batch from its own op list
(a synchronous schedule's flush + every rank's step; the asynchronous stream's steady state with a step
after every k backwards; every send paying the p2p message time) priced by a cost model (default: the
measured H200 model, bench/results/gpu_nvidia_h200_a_cost_model.json). The budget is the time the best
synchronous schedule S needs for the horizon H (micro-batches of B samples; --study: 512 updates of S); each
asynchronous unit then trains for floor(budget / its seconds per micro-batch), rounded down to whole evaluation
intervals, with its lr schedule (warm-up 1/32 of its run, cosine decay) spanning its own run. The runs
(bench/time_to_quality/ttq_run.py's workload and bench/convergence/convergence.py's `train_job`, imported): the
synchronous schedules share one unpipelined run per (M, optimizer) (the mean gradient of M micro-batches, one
step); the asynchronous ones run through `AsyncEmulator` at D stages and update interval k. Each (optimizer, M)
is a block with its own JSON, report and verdicts file, run in order; finished runs are cached in
<out>/runs/ (committed), so --resume continues on a fresh clone. The report: deep_pipelines_report.py.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import deep_pipelines_report as report  # noqa: E402
from deep_pipelines_runs import (Plan, Progress, best_sync, build_parser, dump_json, plan_from_args,  # noqa: E402
                                 plan_size, provenance_now, run_study)
from megatron_po.errors import ConfigError  # noqa: E402


def run(plan: Plan, log=print) -> list[str]:
    """The plan, block by block: S and the budget printed before any run, the runs (progress: runs done against
    the plan, ETA), then each block's JSON and report from it. Returns every file written."""
    sizes = [plan_size(b.s, plan.cm, b.units + b.conditional, len(plan.grid[b.units[0].opt])) for b in plan.blocks]
    log(f"> plan: {len(plan.blocks)} block(s), ~{sum(x[0] for x in sizes)} runs, ~{sum(x[1] for x in sizes)} "
        f"micro-batches, ~{sum(x[2] for x in sizes):.1f} CPU-hours single-thread (sweep at the initial grid and S's "
        "seeds for every unit: an upper bound on seeds, grid growth not counted)")
    for b in plan.blocks:
        u = b.units[0]
        name, t = best_sync(plan.cm, u.opt, u.M)
        log(f"> {b.name}: S = {name} at {1e3 * t:.3f} ms per micro-batch on {plan.cost_model_path} "
            f"(p2p {plan.cm.get('p2p_ms', 0.0):g} ms); H = {b.s.steps} micro-batches ({b.s.steps // u.M} updates); "
            f"budget {b.s.steps * t:.3f} s")
    progress = Progress(sum(x[0] for x in sizes), sum(x[1] for x in sizes))
    loads: list[float] = []

    def logged(text: str) -> None:
        loads.append(os.getloadavg()[0])
        log(text)
    paths = []
    for b in plan.blocks:
        load0, t0 = os.getloadavg(), time.perf_counter()
        loads.clear()
        study = run_study(b.s, plan.cm, b.units, {o: plan.grid[o] for o in {u.opt for u in b.units}}, logged,
                          plan.deadline, plan.max_growth, plan.equal_samples, b.conditional, plan.close_nat,
                          plan.far_seeds, progress)
        if not any(study["runs"].values()):
            log(f"> {b.name}: no finished run yet, no report")
            continue
        path = dump_json(os.path.join(b.s.out, b.name + ".json"), b.s, study, plan.cm, plan.cost_model_path,
                         plan.command, provenance_now(load0, time.perf_counter() - t0, loads))
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
