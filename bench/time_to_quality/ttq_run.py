"""The runs of the time-to-quality study (bench/time_to_quality/time_to_quality.py): units, lr sweep, seeds, cache.

Reuses bench/convergence/convergence.py (imported, not copied): its GPT workload on the bundled Bible, `train_job`
(the asynchronous methods through `AsyncEmulator`, the synchronous reference unpipelined), `calibrate_job`
(measured per-op costs), `async_tokens_per_s`, the run cache and the mean ± std "within spread" rule.
What this file adds: the horizon, the methods of the issue, the learning-rate sweep (equal tuning) and the
practical synchronous configurations; bench/time_to_quality/ttq_report.py turns the runs into the two verdicts and plots.

Training runs ("units", each tuned on its own):
- `sync` (M = 1): one update per micro-batch of B samples, the convergence.py reference at equal updates;
- `sync-m<M>` (M = 2D, 4D): the practical synchronous run, one update per M micro-batches of B samples.
  Trained as one unpipelined update per batch of M*B samples (mathematically the mean gradient over the
  M micro-batches of a 1F1B flush); 1F1B, interleaved 1F1B and ZB-H1 share it and differ only in
  simulated time;
- asynchronous at D stages, k = 1 (2BW: k = D): async-naive, PipeDream, PipeDream-2BW, PipeOptim (paper
  defaults), PipeNAG (`pipenag` + the `nag` optimizer, shown with the AdamW rows), 2BW + error feedback.
Equal tuning: every unit runs the same lr grid with seed 1, then seeds 2..n at its best lr (lowest final
validation loss). The synchronous units are shared by every D (their key has no D).
`--workload nmt`: convergence.py's NMTWorkload at its own horizon (`nmt_study_settings`), its synchronous
M > 1 runs accumulating M micro-batches of B (`train_accumulated`), the validation BLEU of every run.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
import convergence as cv  # noqa: E402
from bench_common import final_val  # noqa: E402

SYNC_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1")
ASYNC = ("async-naive", "pipedream", "pipedream-2bw", "pipeoptim", "pipenag", "2bw-ef")
METHODS = SYNC_SCHEDULES + ASYNC
# Asynchronous variants run through convergence.py's PREDICTOR_VARIANTS hook (base method, policy options; po-ef:
# deep_pipelines.py's PipeOptim + error feedback). Registered at import, so the worker processes (which import
# this module to unpickle the job function) know them too.
VARIANTS = {"pipenag": ("pipenag", {}), "2bw-ef": ("pipedream-2bw", {"error_feedback": True}),
            "po-ef": ("pipeoptim", {"error_feedback": True})}
cv.PREDICTOR_VARIANTS.update(VARIANTS)
# Both studies' names (deep_pipelines_runs.LABELS is this).
LABELS = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "zb-v": "ZB-V",
          "interleaved-1f1b": "interleaved 1F1B (v=2)", "interleaved-zb-h1": "interleaved ZB-H1 (v=2)", "sync": "sync",
          "async-naive": "async-naive", "pipedream": "PipeDream", "pipedream-2bw": "PipeDream-2BW",
          "pipeoptim": "PipeOptim", "pipenag": "PipeNAG (NAG)", "2bw-ef": "2BW + error feedback",
          "po-ef": "PipeOptim + error feedback"}
cv.LABELS.update({m: LABELS[m] for m in VARIANTS})
OPTIMIZERS = ("adamw", "muon")
# The optimizer a method trains with in an optimizer's panel (PipeNAG is its own optimizer).
ACTUAL_OPT = {"pipenag": "nag"}
# Factors of 2 around examples/gpt_tiny.sh's 1e-3 (AdamW, Muon: its AdamW-equivalent lr) and bench/convergence/delay_robust.py's
# NAG lr of 1.0; index 2 also runs the calibrations. Muon up to 3.2e-2: topped at 8e-3, 1F1B at M = 8 chose the
# edge and was under-tuned (its best is 1.6e-2, the committed D = 4 study).
LR_GRID = {"adamw": [5e-4, 1e-3, 2e-3, 4e-3], "muon": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
           "nag": [0.25, 0.5, 1.0, 2.0]}
OUT = os.path.join(cv.REPO, "bench", "results", "time_to_quality")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One tuned training configuration: optimizer actually used, name ("sync" or an ASYNC method), D
    (0 for the synchronous runs, shared by every D) and M (micro-batches per synchronous update)."""
    opt: str
    name: str
    D: int = 0
    M: int = 1

    @property
    def label(self) -> str:
        if self.name == "sync":
            return "sync, 1 update per micro-batch" if self.M == 1 else f"sync, M={self.M}"
        return LABELS[self.name]


def study_settings(quick: bool = False, **overrides) -> cv.Settings:
    """The horizon of the study: 1,024 micro-batches of 8 x 64 tokens (524 k tokens, 0.41 epoch of the
    Bible), measured as the first power-of-two length where the practical synchronous run (1F1B at M = 8)
    ends about 1 nat below the unigram loss, the equal-updates one 1.4 nat (the report's notes)."""
    s = cv.Settings(depths=[4], optimizers=["adamw", "muon"], methods=list(METHODS), seeds=3, steps=1024,
                    warmup=32, eval_interval=64, eval_batches=32, tail=64, jobs=2, out=OUT)
    if quick:
        s = dataclasses.replace(cv.quick_settings(s), steps=64, eval_interval=16, eval_batches=16, tail=16,
                                seeds=2, timing_rounds=1)
    return dataclasses.replace(s, **overrides)


# NMT (--workload nmt): convergence.py's translation workload (NMTWorkload: English -> French Bible, greedy
# BLEU of every run), made cheaper so the study fits the shared 2-core machine: 4 layers (2 encoder +
# 2 decoder, one per stage at D = 4) and sentences up to 64 tokens (pairs longer are dropped by
# tools/preprocess_nmt.py); one AdamW lr grid, factors of 2 up from convergence.py's 1e-3 (the first
# sweep stopped at 4e-3; 8e-3, 1.6e-2, 3.2e-2 added while 1F1B at M = 8 chose the upper edge).
NMT_LR_GRID = {"adamw": [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]}
NMT_METHODS = ["1f1b", "interleaved-1f1b", "zb-h1", "async-naive", "pipedream", "pipeoptim"]


def nmt_study_settings(quick: bool = False, **overrides) -> cv.Settings:
    """The NMT horizon: 1,024 micro-batches of B = 16 pairs (about 1.2 M source + target tokens, 0.6
    epoch of the training pairs): the practical synchronous run (1F1B at M = 2D = 8) ends about 1 nat
    below the unigram loss there; twice as long costs ~9 min a run on the loaded machine (report's notes)."""
    s = cv.nmt_settings(cv.Settings(out=OUT))
    s = dataclasses.replace(s, depths=[4], optimizers=["adamw"], methods=list(NMT_METHODS), seeds=3,
                            num_layers=4, seq_length=64, steps=1024, warmup=64, eval_interval=128,
                            eval_batches=18, tail=128, jobs=2)
    if quick:
        s = dataclasses.replace(s, hidden_size=32, num_attention_heads=2, steps=64, warmup=4, eval_interval=32,
                                eval_batches=4, tail=16, seeds=2, timing_rounds=1, check_updates=2,
                                methods=["1f1b", "zb-h1", "pipedream"])
    return dataclasses.replace(s, **overrides)


def accumulates(s: cv.Settings, unit: "Unit") -> bool:
    """NMT's synchronous runs with M > 1 accumulate M micro-batches of B per update (`train_accumulated`)
    instead of one batch of M*B (`batch_settings`): its micro-batches hold pairs of one target length, so
    a batch of M*B pairs would be a different sample (and a validation batch of M*B a different mean)."""
    return s.workload == "nmt" and unit.name == "sync" and unit.M > 1


def train_accumulated(s: cv.Settings, M: int, optimizer: str, seed: int) -> dict:
    """convergence.train_job's synchronous reference with M micro-batches of B per update: the
    unpipelined model (one emulated stage, no staleness) with update interval k = M, i.e. the mean
    gradient of M micro-batches at one set of weights, one step (1F1B's update at M micro-batches),
    the lr of micro-batch i*M at update i. Same data order, validation set and result fields as train_job."""
    return cv.train_job(s, 0, optimizer, "sync", seed, update_interval=M)


def batch_settings(s: cv.Settings, M: int) -> cv.Settings:
    """Settings of a synchronous run with M micro-batches per update: one micro-batch of M*B samples per
    update, the same samples in the same order, the lr clock (warm-up, decay) scaled to updates, the
    same validation sequences in batches of M*B (mean of equal-sized batch means = the same mean)."""
    if M == 1:
        return s
    return dataclasses.replace(s, micro_batch=s.micro_batch * M, steps=s.steps // M,
                               eval_interval=s.eval_interval // M, eval_batches=s.eval_batches // M,
                               warmup=max(1, round(s.warmup / M)), tail=max(1, s.tail // M))


def sync_ms(s: cv.Settings) -> list[int]:
    """M of the synchronous units: 1 (the equal-updates reference), 2D and 4D at every D, or the ones
    --sync-m picked (`s.sync_ms`: not a Settings field, it selects units and changes no run)."""
    chosen = getattr(s, "sync_ms", None)
    return sorted(full_sync_ms(s) if chosen is None else set(chosen))


def full_sync_ms(s: cv.Settings) -> set[int]:
    """M of the full study's synchronous units: 1, and 2D and 4D at every D."""
    return {1} | {M for D in s.depths for M in (2 * D, 4 * D)}


def validate(s: cv.Settings, grid: dict) -> None:
    bad = [m for m in s.methods if m not in METHODS]
    bad += [o for o in s.optimizers if o not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"error: unknown method/optimizer {bad}; methods {', '.join(METHODS)}; "
                         f"optimizers {', '.join(OPTIMIZERS)}")
    for D in s.depths:
        if D < 2 or s.num_layers % D:
            raise SystemExit(f"error: D={D} must be >= 2 and divide --num-layers {s.num_layers}")
        for M in (2 * D, 4 * D):
            batches = 0 if s.workload == "nmt" else s.eval_batches % M  # (NMT accumulates: any count)
            if s.steps % M or s.eval_interval % M or batches or s.steps % s.eval_interval:
                raise SystemExit(f"error: steps {s.steps}, eval interval {s.eval_interval} and eval batches "
                                 f"{s.eval_batches} must be multiples of M={M} (= 2D, 4D at D={D})")
    missing = [2 * D for D in s.depths if 2 * D not in sync_ms(s)]
    if missing and any(m in SYNC_SCHEDULES for m in s.methods):
        raise SystemExit(f"error: --sync-m must include M = 2D = {', '.join(map(str, missing))} (the 1F1B reference "
                         f"of the targets and the goal)")
    if any(len(v) < 1 for v in grid.values()) or s.seeds < 1:
        raise SystemExit("error: need at least one lr per optimizer and --seeds >= 1")


def plan_units(s: cv.Settings) -> list[Unit]:
    """Every unit the selected (depths, optimizers, methods) need, deepest runs first."""
    units = []
    for o in s.optimizers:
        if any(m in SYNC_SCHEDULES for m in s.methods):
            units += [Unit(o, "sync", 0, M) for M in sync_ms(s)]
        for D in sorted(s.depths, reverse=True):
            units += [u for u in async_units(o, D) if u.name in s.methods]
    return list(dict.fromkeys(units))


def async_units(o: str, D: int) -> list[Unit]:
    """The asynchronous units of optimizer o's panel at D, in ASYNC's order: PipeNAG (its own optimizer,
    ACTUAL_OPT) in AdamW's only."""
    return [Unit(ACTUAL_OPT.get(m, o), m, D) for m in ASYNC if m not in ACTUAL_OPT or o == "adamw"]


# --------------------------------------------------------------------------------------------------
# Jobs (worker processes); results cached in <cache>/runs/ttq-<key>.json
# --------------------------------------------------------------------------------------------------


def _unit_settings(s: cv.Settings, unit: Unit, lr: float) -> cv.Settings:
    # Only this optimizer's lr in the settings: the cache key then depends on nothing else's lr.
    s = dataclasses.replace(s, lr={unit.opt: lr})
    return s if accumulates(s, unit) else batch_settings(s, unit.M)


def _calib_methods(opt: str, methods: list[str]) -> list[str]:
    """Asynchronous methods timed by one calibration (async-naive always: its op costs, the base shared
    by every method, price the synchronous schedules' micro-batches of B samples)."""
    if opt == "nag":
        return ["async-naive", "pipenag"]
    return ["async-naive"] + [m for m in ASYNC if m in methods and m not in ACTUAL_OPT and m != "async-naive"]


def job_path(s: cv.Settings, job: tuple) -> str:
    if job[0] == "train":
        _, unit, lr, seed = job
        us = _unit_settings(s, unit, lr)
        key = cv._job_key(us, ("train", unit.D, unit.opt, f"{unit.name}-m{unit.M}", seed))
    else:
        _, D, opt = job
        cs = dataclasses.replace(s, lr={opt: LR_GRID[opt][2]}, methods=_calib_methods(opt, s.methods))
        key = cv._job_key(cs, ("calibrate", D, opt))
        if cs.methods != _calib_methods(opt, list(METHODS)):
            # It times only the selected methods: another job than the full set's (whose key stays as it
            # was, so the full studies' cache holds), else a study of more methods would reuse it and lack them.
            key = cv._job_key(cs, ("calibrate", D, opt, *cs.methods))
    return os.path.join(s.cache(), "runs", f"ttq-{key}.json")


def run_job(s: cv.Settings, job: tuple) -> dict:
    """One training run or one calibration, cached (written atomically when it finishes)."""
    path = job_path(s, job)
    if job[0] == "train":
        _, unit, lr, seed = job
        us = _unit_settings(s, unit, lr)
        if accumulates(s, unit):
            r, per = train_accumulated(us, unit.M, unit.opt, seed), 1  # (already on the micro-batch clock)
        else:
            r, per = cv.train_job(us, unit.D, unit.opt, "sync" if unit.name == "sync" else unit.name, seed), unit.M
        # The validation curve on the clock of micro-batches of B samples, whatever M is.
        r.update(name=unit.name, unit=dataclasses.asdict(unit), lr=lr,
                 curve=[(e * per, v) for e, v in r["val"]], micro_batches=us.steps * per)
    else:
        _, D, opt = job
        cs = dataclasses.replace(s, lr={opt: LR_GRID[opt][2]}, methods=_calib_methods(opt, s.methods))
        r = cv.calibrate_job(cs, D, opt)
    bench_common.write_json_atomic(path, r)
    return r


def _describe(r: dict) -> str:
    if r["kind"] != "train":
        return f"calibration D={r['D']} {r['optimizer']}"
    u = Unit(**r["unit"])
    return (f"{u.label} D={u.D} {u.opt} lr {r['lr']:g} seed {r['seed']}: val "
            f"{r['curve'][-1][1] if r['curve'] else float('nan'):.4f} ({r['seconds']:.0f} s)")


def run_jobs(s: cv.Settings, jobs: list[tuple], log) -> list[dict]:
    """Cached results of `jobs` (with --resume), the rest run on `s.jobs` worker processes."""
    return bench_common.run_cached_jobs([(s, j) for j in jobs], job_path, run_job,
                                        workers=s.jobs, resume=s.resume, describe=_describe, log=log)


def run_study(s: cv.Settings, grid: dict, log=print) -> dict:
    """The calibrations, then the sweep (seed 1 at every lr of the grid, bench_common.tune), then seeds 2..n at
    each unit's best lr. Returns {"sweep": {unit: {lr: final}}, "best": {unit: lr}, "runs": {unit: [results at
    the best lr]}, "calibrations": {(D, opt): result}, ...}."""
    validate(s, grid)
    wl = cv.build_workload(s)
    wl.prepare()
    units = plan_units(s)
    for M in sorted({u.M for u in units}):
        cv.build_workload(batch_settings(s, M)).prepare()  # (dataset indices: once, not in every worker)
    calib = {(r["D"], r["optimizer"]): r for r in
             run_jobs(s, [("calibrate", D, o) for D in s.depths for o in sorted({u.opt for u in units})], log)}
    train = lambda jobs: {(Unit(**r["unit"]), r["lr"], r["seed"]): r  # noqa: E731
                          for r in run_jobs(s, [("train", *j) for j in jobs], log)}
    final = lambda r: final_val(r, s.steps)  # noqa: E731
    results: dict = {}
    best = bench_common.tune(units, grid, train, final, results=results, log=log)
    log(f"> runs at the best lr (seeds 2..{s.seeds})")
    results.update(train([(u, best[u], sd) for u in units for sd in range(2, s.seeds + 1)]))
    sweep = {u: {lr: final(results[(u, lr, 1)]) for lr in grid[u.opt] if (u, lr, 1) in results} for u in units}
    runs = {u: sorted((r for (uu, lr, _), r in results.items() if uu == u and lr == best[u]), key=lambda r: r["seed"])
            for u in units}
    return {"units": units, "sweep": sweep, "best": best, "runs": runs, "calibrations": calib,
            "train_seconds": sum(r["seconds"] for r in results.values()), "unigram": wl.unigram_baseline(),
            "workload": wl, "tokens_per_microbatch": wl.tokens_per_microbatch}


# Settings fields that change no number of a report (where it is written, how the runs were scheduled).
NOT_RECORDED = ("out", "cache_dir", "command", "resume", "jobs")


def settings_record(s: cv.Settings) -> dict:
    """The settings a report's numbers depend on, for its JSON (the corpus relative to the checkout)."""
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in NOT_RECORDED}
    if os.path.abspath(d["corpus"]).startswith(cv.REPO + os.sep):
        d["corpus"] = os.path.relpath(d["corpus"], cv.REPO)
    return {**d, "sync_ms": getattr(s, "sync_ms", None)}


def settings_from_record(d: dict) -> cv.Settings:
    d = dict(d)
    sync = d.pop("sync_ms", None)
    s = cv.Settings(**{**d, "corpus": os.path.join(cv.REPO, d["corpus"])})
    s.sync_ms = sync  # (not a field, as in time_to_quality.settings_from_args)
    return s


def study_from_json(s: cv.Settings, data: dict, workload: bool = True) -> dict:
    """run_study's result rebuilt from a results JSON (bench/ttq_report.dump_json), without training: the
    units, their sweeps, best lrs and runs (seed, lr, curve, seconds), the CPU op costs. `workload`: prepare
    the data (tokenizer, corpus; for the report's data lines), else leave it out."""
    wl = cv.build_workload(s) if workload else None
    if wl is not None:
        wl.prepare()
    study = bench_common.units_from_json(data, lambda e: Unit(e["opt"], e["name"], e["D"], e["M"]))
    calib = {}
    for key, ops in data["op_times"].items():
        d, opt = key.split(",")
        calib[(int(d.removeprefix("D=")), opt)] = {"op_times": ops}
    tpm = data.get("tokens_per_microbatch") or (wl.tokens_per_microbatch if wl else s.micro_batch * s.seq_length)
    return {**study, "calibrations": calib, "unigram": data["unigram"], "workload": wl, "tokens_per_microbatch": tpm,
            "train_seconds": sum(r["seconds"] for rs in study["runs"].values() for r in rs)}
