"""bench/convergence/convergence.py's running: the jobs (a training run through `AsyncEmulator`, a calibration per
(D, optimizer) that checks the real GPipe / 1F1B op lists and times every method), their plan, the
worker pool and the run cache under `<cache>/runs/` (`--resume`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections import defaultdict

import bench_common
from bench_common import REPO, log as _print
from convergence_measure import _async_op_costs, _median, _op_costs, _time_runners, _timed
from convergence_settings import ASYNC_METHODS, LABELS, MUON_LEGACY, PREDICTOR_VARIANTS, SYNC_METHODS, Settings
from convergence_workloads import build_workload


def _training_config(s: Settings, optimizer: str):
    from megatron_po.config import TrainingConfig
    lr = s.lr[optimizer]
    return TrainingConfig(lr=lr, min_lr=lr * s.min_lr_ratio, lr_decay_style="cosine", lr_warmup_iters=s.warmup,
                          train_iters=s.steps, weight_decay=s.weight_decay, sgd_momentum=s.sgd_momentum)


def _optimizer_kwargs(s: Settings, optimizer: str) -> dict:
    kwargs = {"lr": s.lr[optimizer], "weight_decay": s.weight_decay, "sgd_momentum": s.sgd_momentum}
    if optimizer == "muon":
        kwargs.update(muon_fp32_matmul_prec=s.muon_fp32_matmul_prec, muon_split_qkv=s.muon_split_qkv,
                      muon_num_ns_steps=s.muon_num_ns_steps, muon_coefficient_type=s.muon_coefficient_type)
    return kwargs


def method_spec(method: str, wl) -> tuple[str, dict]:
    """(base asynchronous method, weight-policy options) of a method or predictor variant."""
    base, options = PREDICTOR_VARIANTS.get(method, (method, {}))
    return base, {k: (wl.tokens_per_microbatch if v == "tokens" else v) for k, v in options.items()}


def default_interval(method: str, D: int) -> int:
    """Micro-batches per step of an asynchronous method as published: 1; PipeDream-2BW (and its variants) D."""
    return D if PREDICTOR_VARIANTS.get(method, (method, {}))[0] == "pipedream-2bw" else 1


def lr_fn(s: Settings, optimizer: str, k: int = 1):
    """The lr of a chunk's step i on the micro-batch clock: micro-batch i*k's (sample_schedule.microbatch_lr),
    warm-up and decay spanning the same samples for every method and update interval k."""
    from megatron_po.optim.sample_schedule import microbatch_lr
    t = _training_config(s, optimizer)
    return lambda step: microbatch_lr(step, k, t)


def build_emulator(s: Settings, wl, method: str, D: int, k: int, optimizer: str, seed: int):
    """`AsyncEmulator` of a method or predictor variant at D stages stepping every k micro-batches, seeded."""
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    base, options = method_spec(method, wl)
    model_parallel_seed(seed)
    return AsyncEmulator(wl.config(seed), wl.padded_vocab, base, D, 1, k, optimizer, _optimizer_kwargs(s, optimizer),
                         lr_fn(s, optimizer, k), s.clip_grad, build_chunks=wl.build_chunks, **options)


def train_job(s: Settings, D: int, optimizer: str, method: str, seed: int,
              update_interval: int | None = None) -> dict:
    """One training run. method "sync" = the unpipelined reference (GPipe and 1F1B updates), D ignored.
    `update_interval`: micro-batches per step (default 1; PipeDream-2BW: D); "sync" with k = M is the
    unpipelined reference accumulating M micro-batches of B per update (bench/time_to_quality/ttq_run.py's NMT units)."""
    import torch
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    wl = build_workload(s)
    get_batch, valid = wl.train_batch(seed), wl.valid_batches()
    sync = method == "sync"
    stages = 1 if sync else D
    k = update_interval or default_interval(method, D)
    emu = build_emulator(s, wl, "async-naive" if sync else method, stages, k, optimizer, seed)
    losses, val = [], []
    for end in range(s.eval_interval, s.steps + 1, s.eval_interval):
        losses += emu.train_segment(get_batch, end - emu.microbatches_consumed)
        val.append((end, emu.evaluate(valid)))
        if not all(math.isfinite(x) for x in losses[-s.eval_interval:]) or not math.isfinite(val[-1][1]):
            break  # diverged: keep what we have, the report shows it
    copies = emu.copies_per_chunk()
    bleu = wl.bleu(emu.chunks) if hasattr(wl, "bleu") else None  # NMT: greedy BLEU after the last update
    return {"kind": "train", "D": D, "optimizer": optimizer, "method": method, "seed": seed, "losses": losses,
            "val": val, "copies": [copies[(r, 0)] for r in range(stages)],
            "steps_taken": [emu.steps_taken()[(r, 0)] for r in range(stages)], "update_interval": k,
            "seconds": time.perf_counter() - t_start, "bleu": bleu}


class SyncPipeline:
    """GPipe or 1F1B through its real op list: each update runs M = D micro-batches of B/D samples
    (`emulate` + `StageRunner`, gradients accumulated over the flush), clips by the global norm and steps
    every stage: the semantics of `synchronous_forward_backward` + `training_step.train_step`."""

    def __init__(self, s: Settings, wl, name: str, D: int, optimizer: str, seed: int, times: dict):
        from megatron_po.optim import build_optimizer
        from megatron_po.optim.muon import optimizer_param_groups
        from megatron_po.pipeline.schedules import build_schedule
        from megatron_po.tensor_parallel import model_parallel_seed
        model_parallel_seed(seed)
        cfg = wl.config(seed)
        self.s, self.D, self.M, self.lr_fn, self.times = s, D, D, lr_fn(s, optimizer), times
        self.chunks = [wl.build_chunks(cfg, wl.padded_vocab, r, D, 1)[0] for r in range(D)]
        kw = _optimizer_kwargs(s, optimizer)
        kw.pop("lr")
        wd = kw.pop("weight_decay")
        self.opts = [build_optimizer(optimizer, optimizer_param_groups(optimizer, [c], wd), self.lr_fn(0),
                                     weight_decay=wd, **kw) for c in self.chunks]
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.schedule = build_schedule(name, D, 1, self.M)
        self.updates = 0

    def step(self, batch: dict) -> float:
        import torch
        from megatron_po.optim.clip_grads import clip_grad_norm_
        from megatron_po.optim.sample_schedule import set_lr
        from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate
        D, M = self.D, self.M
        micro = [{key: v.chunk(M)[i] for key, v in batch.items()} for i in range(M)]
        mailbox = Mailbox()
        runners = {r: StageRunner(rank=r, num_stages=D, chunks=[self.chunks[r]], transport=mailbox,
                                  get_batch=micro.__getitem__, loss_scale=1.0 / M) for r in range(D)}
        for r, runner in runners.items():
            runner.run = _timed(runner.run, r, self.times)
        emulate(self.schedule, runners)
        loss = torch.stack([runners[D - 1].losses[i] for i in range(M)]).mean().item()
        clip_grad_norm_(self.params, self.s.clip_grad)  # the global norm (no-op with clip_grad 0)
        for r, (c, opt) in enumerate(zip(self.chunks, self.opts)):
            t0 = time.perf_counter()
            set_lr(opt, self.lr_fn(self.updates))
            opt.step()
            for p in c.parameters():
                p.grad = None
            self.times[(r, "Step")].append(time.perf_counter() - t0)
        self.updates += 1
        return loss


def calibrate_job(s: Settings, D: int, optimizer: str, seed: int = 1) -> dict:
    """Per (D, optimizer), in one process:

    1. check: GPipe and 1F1B through their real op lists (`SyncPipeline`) against the unpipelined
       reference on the same `check_updates` batches (per-update loss difference);
    2. op costs for the throughput simulation: every selected method (the two synchronous pipelines just
       checked and one `AsyncEmulator` per asynchronous method) trains in turn, segment by segment
       (2D micro-batches of B samples each, after an untimed warm-up segment of D), for `timing_rounds`
       rounds, so that load from other processes hits all methods alike. Asynchronous op costs = a base
       shared by all methods + each method's own weight-policy hook time (`_async_op_costs`); GPipe and
       1F1B pool their op times (the same ops in another order).
    """
    import torch
    torch.set_num_threads(1)
    wl = build_workload(s)
    get_batch = wl.train_batch(seed)
    n = s.check_updates
    ref_losses = build_emulator(s, wl, "async-naive", 1, 1, optimizer, seed).train_segment(get_batch, n)
    out = {"kind": "calibrate", "D": D, "optimizer": optimizer, "seed": seed, "ref_losses": ref_losses,
           "check": {}, "op_times": {}, "update_interval": {}}
    times: dict = {}
    sync_times: dict = defaultdict(list)  # GPipe and 1F1B run the same ops in another order: costs pooled
    sync = {}
    for name in SYNC_METHODS:
        times[name] = sync_times
        sync[name] = SyncPipeline(s, wl, name, D, optimizer, seed, sync_times)
        losses = [sync[name].step(get_batch(u)) for u in range(n)]
        out["check"][name] = {"losses": losses, "max_abs_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                              "M": sync[name].M}
    emulators = {}
    for m in ASYNC_METHODS + tuple(PREDICTOR_VARIANTS):
        if m not in s.methods or (m == "spectrain" and optimizer != "sgd"):
            continue
        k = default_interval(m, D)
        emulators[m] = build_emulator(s, wl, m, D, k, optimizer, seed)
        times[m] = defaultdict(list)
        _time_runners(emulators[m], times[m])
        out["update_interval"][m] = k
    timed = [m for m in SYNC_METHODS if m in s.methods] + list(emulators)
    for round_ in range(s.timing_rounds + 1):
        length = D if round_ == 0 else 2 * D  # round 0: warm-up (first-call costs), not kept
        for m in timed:
            if m in sync:
                for _ in range(length):
                    sync[m].step(get_batch(sync[m].updates))
            else:
                emulators[m].train_segment(get_batch, length)
            if round_ == 0:
                times[m].clear()  # (the synchronous pair shares one dict: cleared after each warm-up)
    out["op_times"] = _async_op_costs({m: times[m] for m in emulators}, D)
    for m in SYNC_METHODS:
        if m in timed:
            out["op_times"][m] = _op_costs(sync_times)
    out["hook_ms"] = {m: {str(r): {kind: 1e3 * _median(times[m][(r, kind + "Hooks")])
                                   for kind in ("Forward", "Backward", "Step")} for r in range(D)}
                      for m in emulators}
    return out


def _job_key(s: Settings, job: tuple) -> str:
    relevant = {k: v for k, v in dataclasses.asdict(s).items()
                if k not in ("depths", "optimizers", "methods", "seeds", "out", "jobs", "resume", "command",
                             "cache_dir")}
    for name, legacy in MUON_LEGACY.items():  # only Muon runs depend on them; at the old values, the old keys
        if job[2] != "muon" or relevant[name] == legacy:
            del relevant[name]
    # The corpus by its path inside the checkout, so a cache carries over between clones and worktrees.
    if os.path.abspath(relevant["corpus"]).startswith(REPO + os.sep):
        relevant["corpus"] = os.path.relpath(os.path.abspath(relevant["corpus"]), REPO)
    variants = [m for m in s.methods if m in PREDICTOR_VARIANTS]
    if job[0] == "calibrate" and variants:  # it also times the variants: not the same job as without them
        return hashlib.md5(json.dumps([relevant, list(job), variants], sort_keys=True).encode()).hexdigest()[:16]
    return hashlib.md5(json.dumps([relevant, list(job)], sort_keys=True).encode()).hexdigest()[:16]


def _job_path(s: Settings, job: tuple) -> str:
    return os.path.join(s.cache(), "runs", f"{_job_key(s, job)}.json")


def _run_job(s: Settings, job: tuple) -> dict:
    result = calibrate_job(s, *job[1:]) if job[0] == "calibrate" else train_job(s, *job[1:])
    bench_common.write_json_atomic(_job_path(s, job), result)
    return result


def plan_jobs(s: Settings) -> list[tuple]:
    """("calibrate", D, optimizer) and ("train", D, optimizer, method, seed); the synchronous reference
    is one run per (optimizer, seed) (D = 0), shared by GPipe and 1F1B at every D."""
    sync = any(m in SYNC_METHODS for m in s.methods)
    jobs = [("calibrate", D, o) for D in sorted(s.depths, reverse=True) for o in s.optimizers]
    # Longest first (deep pipelines, many weight copies) so the pool ends evenly.
    order = ["pipedream", "pipedream-dc", "pipedream-stale-lr", "spectrain", "pipeoptim", "po-dc",
             *[m for m in PREDICTOR_VARIANTS if m.startswith("po-") and m != "po-dc"], "pipedream-2bw", "async-naive"]
    for seed in range(1, s.seeds + 1):
        for D in sorted(s.depths, reverse=True):
            for m in order:
                if m not in s.methods:
                    continue
                for o in s.optimizers:
                    if m == "spectrain" and o != "sgd":
                        continue  # SpecTrain predicts from the momentum buffer: SGD-momentum only
                    jobs.append(("train", D, o, m, seed))
        if sync:
            jobs += [("train", 0, o, "sync", seed) for o in s.optimizers]
    return jobs


def _describe(r: dict) -> str:
    if r["kind"] == "calibrate":
        return (f"calibration D={r['D']} {r['optimizer']}: GPipe/1F1B vs unpipelined max |dloss| "
                f"{r['check']['gpipe']['max_abs_diff']:.1e}/{r['check']['1f1b']['max_abs_diff']:.1e}, "
                f"op costs of {len(r['op_times'])} methods")
    depth = "sync" if r["method"] == "sync" else f"D={r['D']}"
    last = r["val"][-1][1] if r["val"] else float("nan")
    return f"{depth} {r['optimizer']} {LABELS[r['method']]} seed {r['seed']}: val {last:.4f} ({r['seconds']:.0f} s)"


def run_jobs(s: Settings, jobs: list[tuple], log=_print) -> tuple[list[dict], int]:
    """Every job's result (bench_common.run_cached_jobs: `<cache>/runs/<key>.json` with --resume, the rest on
    s.jobs workers) and how many came from the cache."""
    reused = sum(os.path.isfile(_job_path(s, j)) for j in jobs) if s.resume else 0
    return bench_common.run_cached_jobs([(s, j) for j in jobs], _job_path, _run_job, workers=s.jobs,
                                        resume=s.resume, describe=_describe, log=log), reused
