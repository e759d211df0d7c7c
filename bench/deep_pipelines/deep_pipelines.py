"""Where an asynchronous pipeline earns its keep (issue 36): D = 8 with few micro-batches per update (M = 2, 4,
8), every method trained for the micro-batches it processes in an equal wall-clock budget on the measured
H200 clock.

    python bench/deep_pipelines/deep_pipelines.py --jobs 1 --resume                 # M = 4, AdamW and Muon
    python bench/deep_pipelines/deep_pipelines.py --optimizers muon muon-ns3 --resume
    python bench/deep_pipelines/deep_pipelines.py --quick                           # smoke run (a minute)
    python bench/deep_pipelines/deep_pipelines.py --from-json bench/results/time_to_quality/deep_pipelines.json

The clock is megatron_po/pipeline/cost_model.py's: each method's seconds per micro-batch from its own op list
(a synchronous schedule's flush + every rank's step; the asynchronous stream's steady state with a step
after every k backwards) priced by a cost model (default: the measured H200 model,
bench/results/gpu_nvidia_h200_a_cost_model.json). The budget is the time the best synchronous schedule
needs for the horizon H (micro-batches of B samples); each asynchronous unit then trains for
floor(budget / its seconds per micro-batch), rounded down to whole evaluation intervals, with its lr
schedule (warm-up 1/32 of its run, cosine decay) spanning its own run. The runs (bench/time_to_quality/ttq_run.py's
workload and bench/convergence/convergence.py's `train_job`, imported): the synchronous schedules share one unpipelined
run per (M, optimizer) (the mean gradient of M micro-batches, one step); the asynchronous ones run through
`AsyncEmulator` at D stages and update interval k. The report: deep_pipelines_report.py.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import deep_pipelines_report as report  # noqa: E402
from deep_pipelines_runs import Plan, build_parser, dump_json, plan_from_args, provenance_now, run_study  # noqa: E402
from megatron_po.errors import ConfigError  # noqa: E402


def run(plan: Plan, log=print) -> list[str]:
    """The runs, the JSON, then the report from it: [json, md, png, verdicts]."""
    load0, t0 = os.getloadavg(), time.perf_counter()
    study = run_study(plan.s, plan.cm, plan.units, plan.grid, log, plan.deadline, plan.max_growth, plan.equal_samples)
    path = dump_json(os.path.join(plan.s.out, plan.name + ".json"), plan.s, study, plan.cost_model_path,
                     plan.command, provenance_now(load0, time.perf_counter() - t0))
    return [path, *report.regenerate(path)]


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
