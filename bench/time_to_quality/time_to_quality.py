"""Which pipeline should I use? Time to quality of every pipeline method, equally tuned (issue 16).

    python bench/time_to_quality/time_to_quality.py --jobs 2                          # D = 4, AdamW and Muon, all methods
    python bench/time_to_quality/time_to_quality.py --optimizers adamw --resume       # one optimizer (reuses finished runs)
    python bench/time_to_quality/time_to_quality.py --depths 4 8 --resume             # add D = 8
    python bench/time_to_quality/time_to_quality.py --quick                           # smoke run (a few minutes)
    python bench/time_to_quality/time_to_quality.py --workload nmt --resume           # the translation model (D = 4, AdamW)
    python bench/time_to_quality/time_to_quality.py --from-json bench/results/time_to_quality/time_to_quality.json
                                                                      # the report again from its JSON, no training

Every report prints its verdicts on two clocks: the CPU per-op costs measured with the runs, and a hardware
cost model (`--cost-model`, default bench/results/gpu_nvidia_h200_a_cost_model.json: MEASURED on one H200,
GPT 1.3B, eager optimizer steps (issue 37); the older derived seed: bench/results/time_to_quality/
cost_model_h200_1p3b.json; `--cost-model none` for the CPU clock only; schema: bench/time_to_quality/ttq_cost_model.py).

Writes bench/results/time_to_quality/time_to_quality.{md,png,json}: command, load, settings, the lr sweep,
verdict 1 (final validation loss at equal tokens, seed spread), verdict 2 (simulated time to three target
losses), the issue's goal answered, and validation loss against tokens and against simulated wall clock,
one row of panels per (D, optimizer); `--workload nmt`: time_to_quality_nmt.*, with the validation BLEU
(`--name` renames the files). The runs: bench/time_to_quality/ttq_run.py; the clocks: bench/time_to_quality/ttq_clock.py, bench/time_to_quality/ttq_cost_model.py;
the verdicts: bench/time_to_quality/ttq_goal.py; the report: bench/time_to_quality/ttq_report.py; all reuse bench/convergence/convergence.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
import ttq_cost_model  # noqa: E402
import ttq_report  # noqa: E402
import ttq_run as tr  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = bench_common.parser(__doc__)
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
    p.add_argument("--cost-model", default=os.path.relpath(ttq_cost_model.MEASURED_PATH, tr.cv.REPO), metavar="PATH",
                   help="per-op costs of real hardware for the second clock (bench/time_to_quality/ttq_cost_model.py's schema; "
                        "default: %(default)s); 'none': the CPU clock only")
    p.add_argument("--cost-model-variant", default=None, metavar="NAME",
                   help="one of the cost model's variants in place of its default entries")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="regenerate the report from a results JSON (its command's settings, its runs and CPU op "
                        "costs) without training; writes beside it, under its name")
    return p


def cost_model_from_args(a) -> tuple[dict | None, str | None]:
    """The cost model --cost-model names (checked: one error line), or (None, None) for 'none'."""
    if a.cost_model == "none":
        if a.cost_model_variant:
            raise SystemExit("error: --cost-model-variant needs a --cost-model")
        return None, None
    path = a.cost_model if os.path.isabs(a.cost_model) or os.path.exists(a.cost_model) else \
        os.path.join(tr.cv.REPO, a.cost_model)
    return ttq_cost_model.load_cost_model(path, a.cost_model_variant), path


def settings_from_args(argv=None):
    a = build_parser().parse_args(argv)
    nmt = a.workload == "nmt"
    s = tr.nmt_study_settings(a.quick) if nmt else tr.study_settings(a.quick)
    grid = {o: v[1:3] if a.quick else v for o, v in (tr.NMT_LR_GRID if nmt else tr.LR_GRID).items()}
    grid = bench_common.parse_lr_grid(a.lr_grid, grid)
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
    s.cost_model, s.cost_model_path = cost_model_from_args(a)  # (likewise not fields)
    given = sys.argv[1:] if argv is None else list(argv)
    s.command = bench_common.command_line("bench/time_to_quality/time_to_quality.py", given, quote=True)
    return s, grid


def run(s, grid: dict, log=print) -> dict:
    """The study end to end; returns {"paths": [md, png, json], "study": ...}."""
    load0, start = os.getloadavg(), time.perf_counter()
    study = tr.run_study(s, grid, log)
    if not hasattr(s, "cost_model"):  # (settings rebuilt by dataclasses.replace lose it: the default's)
        s.cost_model, s.cost_model_path = cost_model_from_args(build_parser().parse_args([]))
    return {"paths": ttq_report.write(s, grid, study, load0, time.perf_counter() - start, getattr(s, "name", None),
                                      s.cost_model, cost_model_path=s.cost_model_path),
            "study": study}


def regenerate(path: str, given: list[str], workload: bool = True) -> dict:
    """The report of results JSON `path` again, from its runs (no training), with the cost model of `given`
    (this command's arguments); written beside it under its name. The settings and the original run's
    header lines come from the JSON."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --from-json {path}: file not found")
    with open(path) as f:
        data = json.load(f)
    s = tr.settings_from_record(data["settings"])
    grid = {o: [float(x) for x in v] for o, v in data["grid"].items()}
    mine, _ = settings_from_args(given)
    s.cost_model, s.cost_model_path = mine.cost_model, mine.cost_model_path
    s.out, s.name, s.command = os.path.dirname(os.path.abspath(path)), os.path.basename(path)[:-len(".json")], data["command"]
    provenance = data.get("provenance")
    study = tr.study_from_json(s, data, workload)
    by = bench_common.command_line("bench/time_to_quality/time_to_quality.py", ["--from-json", path, *given], quote=True)
    paths = ttq_report.write(s, grid, study, os.getloadavg(), 0.0, s.name, s.cost_model,
                             {"by": by, "from": os.path.basename(path), "provenance": provenance},
                             cost_model_path=s.cost_model_path)
    return {"paths": paths, "study": study, "settings": s, "grid": grid}


def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(given)
    if a.from_json:
        defaults = vars(build_parser().parse_args([]))
        other = [k for k, v in vars(a).items() if v != defaults[k] and k not in ("from_json", "cost_model",
                                                                                    "cost_model_variant")]
        if other:
            raise SystemExit(f"error: --from-json takes only --cost-model and --cost-model-variant (the settings "
                             f"are the JSON's), got --{other[0].replace('_', '-')}")
        rest = [x for i, x in enumerate(given) if x != "--from-json" and (i == 0 or given[i - 1] != "--from-json")
                and not x.startswith("--from-json=")]
        out = regenerate(a.from_json, rest)
    else:
        out = run(*settings_from_args(argv))
    print(f"> wrote {', '.join(os.path.relpath(p) for p in out['paths'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
