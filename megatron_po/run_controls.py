"""Megatron's per-iteration run controls, in one place for the training loop:

- `--exit-duration-in-mins`: every rank reads its own clock; the ranks agree (all-reduce MAX) after each
  iteration, so all of them stop after the same one (synchronous methods; asynchronous ones at their next
  drain: evaluation, checkpoint, exit interval or the end).
- `--manual-gc [--manual-gc-interval N]`: Python's automatic collector off (no pauses at random points of
  a step, which stall the other ranks); `gc.collect()` every N iterations (asynchronous methods: at drains)
  and around evaluation/checkpoints.
- `--empty-unused-memory-level`: release the CUDA caching allocator's unused blocks after each iteration
  (1) and after evaluation (2); nothing to release on CPU.
- `--profile --profile-step-start S --profile-step-end E`: a torch.profiler trace of iterations S..E-1 on
  rank 0 (asynchronous methods: of the whole segments between drains that hold them), written as a Chrome/Perfetto JSON trace that TensorBoard's profiler plugin also reads
  (`<--tensorboard-dir or ./profile>/trace_rank0_iter<S>-<E>.pt.trace.json`).
- `--log-params-norm`, `--log-num-zeros-in-grad`: the L2 norm of all parameters and the count of zero
  gradient entries of one model replica, each parameter counted once (TP shards on every TP rank,
  TP-replicated parameters on TP rank 0, a tied embedding's copy not at all), summed over the
  model-parallel group.
"""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.distributed.ddp import grad_of
from megatron_po.distributed.fsdp import local_shard
from megatron_po.optim.clip_grads import counts_toward_norm, sum_dense_and_experts
from megatron_po.run_rules import any_rank


class RunControls:
    def __init__(self, cfg, start_time: float | None = None):
        self.cfg = cfg
        self.t, self.lc = cfg.training, cfg.logging
        self.start = start_time if start_time is not None else time.time()
        self.profiler = None
        self.gc_was_enabled = gc.isenabled()
        if self.t.manual_gc:
            gc.disable()
            gc.collect()

    # --- per iteration ---------------------------------------------------------------------------

    def before_iteration(self, iteration: int, last: int | None = None) -> None:
        """`iteration`: the 1-based number of the iteration about to run; `last`: the last one run before the
        next call (an asynchronous segment runs iterations iteration..last without a drain)."""
        lc = self.lc
        last = iteration if last is None else last
        if lc.profile and iteration <= lc.profile_step_start <= last and dist.get_rank() == 0:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def after_iteration(self, iteration: int) -> None:
        lc, t = self.lc, self.t
        if self.profiler is not None and iteration + 1 >= lc.profile_step_end:
            self.profiler.__exit__(None, None, None)
            out = lc.tensorboard_dir or "profile"
            os.makedirs(out, exist_ok=True)
            self.profiler.export_chrome_trace(
                os.path.join(out, f"trace_rank0_iter{lc.profile_step_start}-{lc.profile_step_end}.pt.trace.json"))
            self.profiler = None
        if t.manual_gc and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
            gc.collect()
        if t.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def around_boundary(self) -> None:
        """Before/after evaluation and checkpoints."""
        if self.t.manual_gc:
            gc.collect()
        if self.t.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def time_is_up(self) -> bool:
        """--exit-duration-in-mins reached on any rank (collective: every rank calls it at the same point)."""
        limit = self.t.exit_duration_in_mins
        if limit is None:
            return False
        return any_rank((time.time() - self.start) / 60.0 > limit)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.t.manual_gc and self.gc_was_enabled:
            gc.enable()


def replica_sums(params, group, expert_group=None, shard_groups=None) -> dict[str, float]:
    """`params_norm` and `num_zeros_in_grad` of one model replica, summed over `group` (model parallel); MoE
    experts over `expert_group` (the expert model-parallel group, optim/clip_grads.py) when given. FSDP2-sharded
    parameters count this rank's shards, summed first over `shard_groups` (dense, experts: the ranks they are
    sharded over, distributed/fsdp.py)."""
    sums = torch.zeros(2, 2, dtype=torch.float64, device=ps.get_device())  # [dense, expert] x [squares, zeros]
    for p in params:
        if not counts_toward_norm(p):
            continue
        row = sums[int(getattr(p, "expert_parallel", False))]
        row[0] += local_shard(p).detach().double().square().sum()
        grad = grad_of(p)
        if grad is not None:
            row[1] += (grad == 0).sum()
    for row, shard_group in zip(sums, shard_groups or ()):
        if shard_group is not None and dist.get_world_size(shard_group) > 1:
            dist.all_reduce(row, group=shard_group)
    both = sum_dense_and_experts(sums[0], sums[1], group, expert_group)
    return {"params_norm": float(both[0].sqrt()), "num_zeros_in_grad": int(both[1])}
