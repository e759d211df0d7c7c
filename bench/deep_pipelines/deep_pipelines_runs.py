"""The deep-pipeline study's units, budget and runs (bench/deep_pipelines/deep_pipelines.py is the command):
the settings, each unit's horizon in the equal wall-clock budget, the lr sweep grown at its edges for every unit,
the seeds and the JSON (the command line and its plan: deep_pipelines.py).

The study of issue 41 (`STUDY`, fixed before any of its runs and printed in its reports): D = 8; Muon (bf16
Newton-Schulz, Q/K/V split) at M = 2 and M = 4, AdamW at M = 4, in that order; S, the synchronous baseline,
makes 512 updates (H = 512 x M micro-batches). Per (optimizer, M): S, and at k = M async-naive, PipeOptim and
PipeOptim + error feedback; at k = M/2 PipeOptim, and async-naive and PipeOptim + error feedback at k = M/2
only if PipeOptim at k = M/2 (seed 1, its best lr) ends within 0.1 nat of S (seed 1) (`conditional_units`).
AdamW: S, PipeOptim and PipeOptim + error feedback at k = M. Seeds: 5 for S and every unit whose seed-1 loss
is within 0.1 nat of S's; 1 for the others (`seeds_of`). The finished runs are cached as small JSON files in
<out>/runs/ (default bench/results/deep_pipelines/runs/, COMMITTED: --resume on a fresh clone reuses them)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import ttq_cost_model  # noqa: E402
import ttq_run as tr  # noqa: E402
from bench_common import Progress, final_val  # noqa: E402,F401 (dp.Progress, dp.final_val: the command, the report)
from megatron_po.errors import ConfigError  # noqa: E402
from megatron_po.pipeline import cost_model as cmm  # noqa: E402

cv = tr.cv
OUT = os.path.join(cv.REPO, "bench", "results", "deep_pipelines")
MEASURED, DERIVED = ttq_cost_model.MEASURED_PATH, ttq_cost_model.DERIVED_SEQ8192_PATH
D = 8  # the study's default depth (issue 41); --depth sets another (issue 50): one layer per stage

SYNC = ("1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "interleaved-zb-h1")
ASYNC = ("async-naive", "pipedream-2bw", "pipeoptim", "po-ef")
LABELS = tr.LABELS  # (po-ef, PipeOptim + error feedback: a variant ttq_run registers with convergence.py)
# Optimizers: the priced Muon (bf16 Newton-Schulz, Q/K/V split: what the cost model's Muon step measured). The
# cheaper one of the superseded H = 256 study (muon-ns3, 3 Newton-Schulz steps) was removed after commit 9a136c2.
OPTIMIZERS = {"adamw": ("adamw", {}), "muon": ("muon", {"muon_fp32_matmul_prec": "medium", "muon_split_qkv": True})}
OPT_LABELS = {"adamw": "AdamW", "muon": "Muon (bf16 NS x5, QKV split)"}
# One common lr grid per optimizer (factor 2 apart), centred on the previous study's D = 8 optima
# (time_to_quality_d8_*.md: AdamW sync 2e-3, asynchronous 1e-3..8e-3; Muon sync 8e-3..1.6e-2, asynchronous
# 2e-3..8e-3); grown by one point on a side for EVERY unit when any unit's best lr is at that edge.
LR_GRID = {"adamw": [1e-3, 2e-3, 4e-3], "muon": [4e-3, 8e-3, 1.6e-2]}
MAX_GROWTH = 2  # extensions per side at most (compute); a best lr still at an edge is flagged in the report

# The study of issue 41 (module docstring), in the order it runs.
STUDY_BLOCKS = (("muon", 2), ("muon", 4), ("adamw", 4))
STUDY_UPDATES = 512  # S's optimizer updates at every M: H = 512 x M micro-batches
STUDY_METHODS = {"muon": ("async-naive", "pipeoptim", "po-ef"), "adamw": ("pipeoptim", "po-ef")}  # at k = M
# The map studies, by issue, each fixed before its runs with its predictions: Muon at (D, M), in the order they
# run (the cheap ones first); S, PipeOptim and async-naive at k = M, and at M = 1 PipeOptim at k = 2 (an update
# every two micro-batches) (`map_units`). Issue 50, the pipeline map beyond D = 8
# (bench/results/deep_pipelines/predictions.md); issue 57, one new setting, D = 4 at M / D = 1/2, predicted by the
# refit on every depth before its runs (predictions_refit.md).
MAP_STUDIES = {50: ((4, "muon", 1), (8, "muon", 1), (16, "muon", 4)), 57: ((4, "muon", 2),)}
CLOSE_NAT = 0.1  # a unit whose seed-1 final loss is within this of S's gets S's seeds (else FAR_SEEDS)
STUDY_SEEDS, FAR_SEEDS = 5, 1
# Seconds of single-thread training per micro-batch of B of the 8-layer model (scaled by the layers), for the
# plan's CPU-hours estimate only (the
# committed H = 256 study, bench/results/time_to_quality/deep_pipelines_m2_muon.json: sync at M = 2 12.6-14.1 s
# per 256, PipeOptim at D = 8 32-52 s per 544, on the loaded 2-core machine).
SECONDS_PER_MB = {"sync": 0.055, "async": 0.085}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One tuned training configuration: optimizer key (OPTIMIZERS), name ("sync" or an ASYNC method), M
    (micro-batches per synchronous update; the setting an asynchronous unit belongs to) and k (update
    interval; the synchronous units: M)."""
    opt: str
    name: str
    M: int
    k: int

    @property
    def label(self) -> str:
        return f"sync, M={self.M}" if self.name == "sync" else f"{LABELS[self.name]}, k={self.k}"


def study_settings(quick: bool = False, depth: int = D) -> cv.Settings:
    """Micro-batches of B = 8 x 64 tokens, validation every 32 micro-batches on 16 x 8 fixed sequences; D =
    `depth` stages of one layer each (`depths`, `num_layers`); the horizon (`steps`) is set per M by the plan
    (H = STUDY_UPDATES x M; --steps: one H for every M)."""
    s = tr.study_settings(False, depths=[depth], num_layers=depth, seeds=3, steps=512, warmup=16, eval_interval=32,
                          eval_batches=16, tail=32)
    if quick:
        s = dataclasses.replace(cv.quick_settings(s), depths=[depth], steps=32, warmup=1, eval_interval=16,
                                eval_batches=8, tail=8, seeds=2, timing_rounds=1)
    return s


def depth_of(s: cv.Settings) -> int:
    """The study's D: its settings' one depth."""
    return s.depths[0]


def opt_settings(s: cv.Settings, opt: str) -> cv.Settings:
    return dataclasses.replace(s, **OPTIMIZERS[opt][1])


# --------------------------------------------------------------------------------------------------
# The clock: seconds per micro-batch of every configuration from its op list
# --------------------------------------------------------------------------------------------------


def method_costs(cm: dict, opt: str, name: str, D: int = D) -> cmm.StageCosts:
    """Per-op costs of a method (the synchronous schedules: async-naive's, no policy work) at D stages;
    error feedback's and 2BW's work derived where the model has no figure (cost_model.method_costs)."""
    method = {"sync": "1f1b", "po-ef": "pipeoptim"}.get(name, name)
    return cmm.method_costs(cm, D, OPTIMIZERS[opt][0], method, error_feedback=name == "po-ef")[0]


def seconds_per_microbatch(cm: dict, opt: str, name: str, M: int, k: int = 1, D: int = D) -> float | None:
    """A configuration's seconds per micro-batch of B samples on cost model cm at D stages; None when the
    schedule does not admit (D, M) (e.g. interleaving at M % D != 0)."""
    c = method_costs(cm, opt, "sync" if name in SYNC else name, D)
    if name in SYNC:
        try:
            return cmm.sync_iteration(name, D, M, c).makespan / M
        except ConfigError:
            return None
    return cmm.async_per_microbatch(D, k, c).seconds_per_microbatch


def best_sync(cm: dict, opt: str, M: int, D: int = D) -> tuple[str, float]:
    """The fastest synchronous schedule at (D, M) and its seconds per micro-batch."""
    priced = {n: seconds_per_microbatch(cm, opt, n, M, D=D) for n in SYNC}
    name = min((n for n, t in priced.items() if t is not None), key=priced.get)
    return name, priced[name]


def horizon(s: cv.Settings, cm: dict, unit: Unit) -> int:
    """Micro-batches the unit trains for: H for the synchronous run; the asynchronous ones what fits in the
    best synchronous schedule's time for H, rounded down to whole evaluation intervals."""
    if unit.name == "sync":
        return s.steps
    _, t_sync = best_sync(cm, unit.opt, unit.M, depth_of(s))
    t = seconds_per_microbatch(cm, unit.opt, unit.name, unit.M, unit.k, depth_of(s))
    return max(s.eval_interval, int(s.steps * t_sync / t) // s.eval_interval * s.eval_interval)


# --------------------------------------------------------------------------------------------------
# Runs (cached: <out>/runs/dp-<key>.json, committed; the data cache stays in the git-ignored <out>/.cache)
# --------------------------------------------------------------------------------------------------


def unit_settings(s: cv.Settings, unit: Unit, lr: float, steps: int) -> cv.Settings:
    """The run's settings: its optimizer's, its lr, its horizon, warm-up 1/32 of it; a synchronous unit as
    one update per batch of M*B samples (ttq_run.batch_settings)."""
    us = dataclasses.replace(opt_settings(s, unit.opt), lr={OPTIMIZERS[unit.opt][0]: lr}, steps=steps,
                             warmup=max(1, steps // 32))
    return tr.batch_settings(us, unit.M) if unit.name == "sync" else us


def job_path(s: cv.Settings, unit: Unit, lr: float, seed: int, steps: int) -> str:
    us = unit_settings(s, unit, lr, steps)
    key = cv._job_key(us, ("train", depth_of(s), OPTIMIZERS[unit.opt][0], f"dp-{unit.name}-m{unit.M}-k{unit.k}", seed))
    return os.path.join(s.out, "runs", f"dp-{key}.json")


def run_job(s: cv.Settings, unit: Unit, lr: float, seed: int, steps: int) -> dict:
    us = unit_settings(s, unit, lr, steps)
    opt = OPTIMIZERS[unit.opt][0]
    cpu0 = time.process_time()  # (the study's cost in CPU-hours: wall seconds on the shared machine say less)
    if unit.name == "sync":
        r, per = cv.train_job(us, 0, opt, "sync", seed), unit.M
    else:
        r, per = cv.train_job(us, depth_of(s), opt, unit.name, seed, update_interval=unit.k), 1
    # Small enough to commit: no per-micro-batch train losses, the validation curve once (5 decimals).
    curve = [(e * per, round(v, 5)) for e, v in r["val"]]
    r = {k: v for k, v in r.items() if k not in ("losses", "val", "bleu")}
    r.update(unit=dataclasses.asdict(unit), lr=lr, micro_batches=steps, seconds=round(r["seconds"], 1),
             cpu_seconds=round(time.process_time() - cpu0, 1), curve=curve,
             load_1min=round(os.getloadavg()[0], 2))  # the machine's load as it ran: its seconds' context
    path = job_path(s, unit, lr, seed, steps)
    bench_common.write_json_atomic(path, r)
    return r


def _describe(r: dict) -> str:
    u = Unit(**r["unit"])
    last = r["curve"][-1][1] if r["curve"] else float("nan")
    return (f"{OPT_LABELS[u.opt]} {u.label} lr {r['lr']:g} seed {r['seed']} ({r['micro_batches']} mb): "
            f"val {last:.4f} ({r['seconds']:.0f} s)")


def run_jobs(s: cv.Settings, jobs: list[tuple], log, deadline: float | None = None,
             progress: Progress | None = None) -> dict:
    """{(unit, lr, seed): result} of jobs (unit, lr, seed, steps): cached with --resume, the rest on s.jobs workers
    (the longest first, so two workers finish a phase together); jobs not started by `deadline` (time.time())
    are skipped (reported as not run)."""
    jobs = sorted(jobs, key=lambda j: -j[3] * SECONDS_PER_MB["sync" if j[0].name == "sync" else "async"])
    runs = bench_common.run_cached_jobs([(s, *j) for j in jobs], job_path, run_job,
                                        workers=s.jobs, resume=s.resume, describe=_describe, log=log,
                                        deadline=deadline, progress=progress)
    return {(Unit(**r["unit"]), r["lr"], r["seed"]): r for r in runs}


def plan_units(optimizers: list[str], ms: list[int], methods: list[str], ks: list[str], D: int = D) -> list[Unit]:
    """Every unit: per (optimizer, M) the synchronous run and each asynchronous method at k in ks
    ("1", "2", "M"), PipeDream-2BW only where k >= D (it accumulates over at least D micro-batches)."""
    units = []
    for o in optimizers:
        for M in ms:
            if any(m in SYNC for m in methods) or "sync" in methods:
                units.append(Unit(o, "sync", M, M))
            for m in ASYNC:
                if m not in methods:
                    continue
                for k in dict.fromkeys(M if x == "M" else int(x) for x in ks):
                    if m != "pipedream-2bw" or k >= D:
                        units.append(Unit(o, m, M, k))
    return units


def study_units(opt: str, M: int) -> tuple[list[Unit], list[Unit]]:
    """Issue 41's units for one (optimizer, M): (always run, run only if `conditional_units` says so)."""
    units = [Unit(opt, "sync", M, M)] + [Unit(opt, m, M, M) for m in STUDY_METHODS[opt]]
    if opt != "muon" or M < 2:
        return units, []
    units.append(Unit(opt, "pipeoptim", M, M // 2))
    return units, [Unit(opt, m, M, M // 2) for m in ("async-naive", "po-ef")]


def map_units(opt: str, M: int) -> list[Unit]:
    """A map study's units for one (D, M): S, PipeOptim and async-naive at k = M; PipeOptim at k = 2 where M = 1."""
    return [Unit(opt, "sync", M, M), Unit(opt, "pipeoptim", M, M), Unit(opt, "async-naive", M, M)] + (
        [Unit(opt, "pipeoptim", M, 2)] if M == 1 else [])


def conditional_units(results: dict, best: dict, units: list[Unit], conditional: list[Unit],
                      close_nat: float) -> bool | None:
    """Whether the other methods at k = M/2 run (the rule fixed before the runs): PipeOptim at k = M/2 (seed 1,
    its best lr) within close_nat of S (seed 1, its best lr). None while either seed-1 result is missing."""
    if not conditional:
        return False
    sync = next(u for u in units if u.name == "sync")
    po = next(u for u in units if u.name == "pipeoptim" and u.k == conditional[0].k)
    r_s, r_p = results.get((sync, best[sync], 1)), results.get((po, best[po], 1))
    if r_s is None or r_p is None:
        return None
    return final_val(r_p) <= final_val(r_s) + close_nat


def seeds_of(u: Unit, results: dict, best: dict, sync: Unit | None, seeds: int, far_seeds: int,
             close_nat: float) -> int:
    """S's seeds for S and every unit whose seed-1 final loss is within close_nat of S's; far_seeds for the
    others (a unit that far behind fails (a) by several seed standard deviations). `seeds` while unknown."""
    if u.name == "sync" or sync is None:
        return seeds
    r_s, r_u = results.get((sync, best[sync], 1)), results.get((u, best[u], 1))
    if r_s is None or r_u is None:
        return seeds
    return seeds if final_val(r_u) <= final_val(r_s) + close_nat else far_seeds


def plan_size(s: cv.Settings, cm: dict, units: list[Unit], grid_points: int) -> tuple[int, int, float]:
    """(runs, micro-batches, single-thread CPU-hours at SECONDS_PER_MB) of a block before any run: the sweep at
    the initial grid and S's seeds for every unit (an upper bound on the seeds; growth of the grid not counted)."""
    runs = mb = seconds = 0
    for u in units:
        n, h = grid_points + s.seeds - 1, horizon(s, cm, u)
        runs, mb = runs + n, mb + n * h
        seconds += n * h * SECONDS_PER_MB["sync" if u.name == "sync" else "async"] * s.num_layers / 8  # (per layer)
    return runs, mb, seconds / 3600


def run_study(s: cv.Settings, cm: dict, units: list[Unit], grid: dict, log=print,
              deadline: float | None = None, max_growth: int = MAX_GROWTH,
              conditional: list[Unit] = (), close_nat: float = CLOSE_NAT, far_seeds: int | None = None,
              progress: Progress | None = None, planned_horizons: dict | None = None) -> dict:
    """Sweep seed 1 over the common grid; grow an optimizer's grid by one point on a side for every unit
    while any unit's best lr sits at that edge (at most max_growth times; judged on units whose sweep is
    complete); add the `conditional` units where `conditional_units` says so (they sweep the grid as grown,
    and may grow it for every unit); then seeds 2..n at each unit's best lr (`seeds_of`). Each unit trains for
    its `planned_horizons` entry where the block's first runs fixed one (`recorded_plan`), else for `horizon`
    on cm. Returns {"units", "grid", "sweep", "best", "runs", "horizons", "not_run", "planned", "conditional",
    ...}."""
    far_seeds = s.seeds if far_seeds is None else far_seeds
    units, conditional = list(units), list(conditional)
    wl = tr.prepare_data(s, {u.M for u in units})
    steps = {u: (planned_horizons or {}).get(u) or horizon(s, cm, u) for u in units + conditional}
    grid = {o: list(v) for o, v in grid.items()}
    results: dict = {}
    grown = {o: {"low": 0, "high": 0} for o in grid}
    run = lambda jobs: run_jobs(s, [(*j, steps[j[0]]) for j in jobs], log, deadline, progress)  # noqa: E731
    tune = lambda: bench_common.tune(units, grid, run, final_val, max_growth=max_growth, grown=grown,  # noqa: E731
                                     results=results, log=log)
    best = tune()
    decided = conditional_units(results, best, units, conditional, close_nat)
    if decided:
        log(f"> PipeOptim at k = {conditional[0].k} ends within {close_nat} nat of S (seed 1): adding "
            + ", ".join(u.label for u in conditional))
        units += conditional
        best = tune()
    sync = next((u for u in units if u.name == "sync"), None)
    n_seeds = {u: seeds_of(u, results, best, sync, s.seeds, far_seeds, close_nat) for u in units}
    jobs = [(u, best[u], sd, steps[u]) for u in units for sd in range(2, n_seeds[u] + 1)
            if (u, best[u], sd) not in results]
    log(f"> {len(jobs)} runs at the best lr (seeds 2..{s.seeds} where within {close_nat} nat of S, else "
        f"{far_seeds} seed{'s' if far_seeds != 1 else ''})")
    results.update(run_jobs(s, jobs, log, deadline, progress))
    sweep, runs = bench_common.at_best_lr(units, grid, best, results, final_val)
    planned = {(u, lr, 1) for u in units for lr in grid[u.opt]} | {(u, best[u], sd) for u in units
                                                                    for sd in range(2, n_seeds[u] + 1)}
    if decided is None:  # not yet known: the conditional units' sweep is planned (their seeds too, at most)
        planned |= {(u, lr, 1) for u in conditional for lr in grid[u.opt]}
        planned |= {(u, None, sd) for u in conditional for sd in range(2, s.seeds + 1)}
    not_run = sorted(((u.opt, u.name, u.M, u.k, lr, sd) for (u, lr, sd) in planned - set(results)),
                     key=lambda x: (x[:4], x[4] or 0, x[5]))
    return {"D": depth_of(s), "units": units, "grid": grid, "grown": grown, "sweep": sweep, "best": best, "runs": runs,
            "horizons": steps, "not_run": not_run, "unigram": wl.unigram_baseline(),
            "planned": len(planned), "done": len(planned & set(results)),
            "conditional": {"units": [u.label for u in conditional],
                            "decided": "not yet" if decided is None else ("run" if decided else "not run")},
            "seeds_rule": {"close_nat": close_nat, "seeds": s.seeds, "far_seeds": far_seeds},
            "train_seconds": sum(r["seconds"] for r in results.values()),
            "train_cpu_seconds": [sum(r["cpu_seconds"] for r in results.values() if "cpu_seconds" in r),
                                  sum(1 for r in results.values() if "cpu_seconds" in r)],
            "run_loads": run_loads(list(results.values()))}


def run_loads(runs: list[dict]) -> list:
    """[min, max, runs that record it, runs] of the 1-minute load at the end of each run (`load_1min`): the load
    the block's runs met, in whichever session ran them (a --report-only command trains nothing)."""
    loads = [r["load_1min"] for r in runs if "load_1min" in r]
    return [min(loads), max(loads), len(loads), len(runs)] if loads else [None, None, 0, len(runs)]


RUN_KEYS = ("seed", "lr", "curve", "seconds", "micro_batches", "copies", "steps_taken", "update_interval")
# Settings that vary per unit (its lr, warm-up, horizon: recorded per unit) or were never the run's.
PER_UNIT = ("lr", "warmup", "steps")


def settings_as_run(s: cv.Settings, opt: str) -> dict:
    """The settings every run of an optimizer's block ran with (its optimizer options applied); lr, warm-up and
    horizon are each unit's own (dump_json records them per unit)."""
    return {k: v for k, v in tr.settings_record(opt_settings(s, opt)).items() if k not in PER_UNIT + ("sync_ms",)}


def dump_json(path: str, s: cv.Settings, study: dict, cm: dict, cm_path: str, command: str, provenance: dict,
              planned: dict | None = None) -> str:
    """The study's runs, sweeps and settings as they ran (relative paths only): what --from-json rebuilds the
    report from. "definition": S, its horizon and budget, fixed before the runs (`planned`, the one the block's
    first runs recorded, else on cm now)."""
    units = []
    for u in study["units"]:
        n = study["horizons"][u]
        units.append({**dataclasses.asdict(u), "label": u.label, "horizon": n,
                      "ran": {"micro_batches": n, "updates": n // u.k, "warmup_micro_batches": max(1, n // 32) if
                              u.name != "sync" else max(1, round(max(1, n // 32) / u.M)) * u.M,
                              "lr_schedule": "linear warm-up, cosine to 0.1 x over its own run"},
                      "sweep": {str(lr): v for lr, v in study["sweep"][u].items()}, "best_lr": study["best"][u],
                      "runs": [{k: r[k] for k in RUN_KEYS} for r in study["runs"][u]]})
    opts = sorted({u.opt for u in study["units"]})
    data = {"command": command, "settings": settings_as_run(s, opts[0]), "cost_model": cm_path,
            "definition": planned or definition(s, cm, study["units"]), "grid": study["grid"], "grown": study["grown"],
            "units": units, "not_run": study["not_run"], "planned_runs": study.get("planned"),
            "done_runs": study.get("done"), "conditional": study.get("conditional"),
            "seeds_rule": study.get("seeds_rule"), "unigram": study["unigram"],
            "train_seconds": study["train_seconds"], "train_cpu_seconds": study.get("train_cpu_seconds"),
            "run_loads": study.get("run_loads"), "provenance": provenance}
    return bench_common.write_text(path, json.dumps(data, indent=1) + "\n")


def definition(s: cv.Settings, cm: dict, units: list[Unit]) -> dict:
    """S and the budget per (optimizer, M) on the clock that plans the runs: fixed before any run."""
    out = {}
    for opt, M in dict.fromkeys((u.opt, u.M) for u in units):
        name, t = best_sync(cm, opt, M, depth_of(s))
        out[f"{opt},M={M}"] = {"S": name, "S_ms_per_microbatch": 1e3 * t, "H": s.steps, "updates": s.steps // M,
                               "budget_s": s.steps * t, "p2p_ms": cm.get("p2p_ms", 0.0)}
    return out


def recorded_plan(path: str, cost_model_path: str) -> tuple[dict, dict | None]:
    """({unit: micro-batches it trains for}, the definition: S and the budget) as the block's JSON at `path`
    recorded them when its runs were planned on the same cost model file; ({}, None) for a block not yet run.
    A study's plan is fixed by its first runs: a correction of the clock made later (issue 57: no transfer
    between two chunks of one rank) re-prices its reports, and neither retrains a run nor renames S's budget."""
    if not os.path.isfile(path):
        return {}, None
    with open(path) as f:
        data = json.load(f)
    if data.get("cost_model") != cost_model_path:
        return {}, None
    return ({Unit(e["opt"], e["name"], e["M"], e["k"]): e["horizon"] for e in data["units"]},
            data.get("definition"))


def study_from_json(data: dict) -> dict:
    study = bench_common.units_from_json(data, lambda e: Unit(e["opt"], e["name"], e["M"], e["k"]))
    entries = dict(zip(study["units"], data["units"]))
    return {**study, "D": data["settings"]["depths"][0], "horizons": {u: e["horizon"] for u, e in entries.items()},
            "grid": data["grid"], "grown": data["grown"], "not_run": data["not_run"], "unigram": data["unigram"],
            "train_seconds": data["train_seconds"], "train_cpu_seconds": data.get("train_cpu_seconds"),
            "run_loads": data.get("run_loads"), "planned": data.get("planned_runs"),
            "done": data.get("done_runs"), "conditional": data.get("conditional"),
            "seeds_rule": data.get("seeds_rule")}


def provenance_now(load0, wall: float) -> dict:
    """Machine, commit (-dirty when the tree differs), this command's load average at start and end and its wall
    time (the load the runs met is each run's own record: `run_loads`)."""
    import datetime
    return {"machine": bench_common.machine(), "load_start": list(load0), "load_end": list(os.getloadavg()),
            "wall_minutes": wall / 60, "commit": bench_common.commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
