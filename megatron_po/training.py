"""The training loop: set-up, then one iteration after another, each followed by the periodic work.

    set-up         training_setup: flags and process groups, model + optimizer (or this rank of an
                   asynchronous pipeline), datasets, resume
    the step       training_step.synchronous_iteration: one global batch, a flush, one optimizer step
                   (asynchronous methods: async_training streams micro-batches without a flush)
    periodic work  periodic_work.PeriodicWork: evaluation, checkpoints, --exit-interval and
                   --exit-duration-in-mins; training_log.Progress: the console line and metrics
    run controls   run_controls.RunControls (--profile, --manual-gc, ...); run_rules.SkipGuard (fp16 skips)

Data order follows Megatron's pretraining sampler (gpt_workload): global batch `g` holds samples
`[g*G, (g+1)*G)`, so a DP=2 run sees, in total, the same samples per step as one process. Every TP rank
reads the same samples itself (deterministic indexing) instead of receiving a broadcast.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po import rank_watchdog
from megatron_po.async_training import train_asynchronous
from megatron_po.config import Config
from megatron_po.distributed import launcher_death, save_lock
from megatron_po.errors import ConfigError, DataError, RankError, SaveError, UserError
from megatron_po.gpt_workload import GPTWorkload
from megatron_po.models.moe.report import moe_metrics
from megatron_po.models.mtp import mtp_metrics
from megatron_po.periodic_work import PeriodicWork
from megatron_po.run_controls import RunControls
from megatron_po.run_rules import SkipGuard, launcher_rank
from megatron_po.training_log import replica_metrics, start_logging
from megatron_po.training_setup import build_datasets, build_model, initialize, resume
from megatron_po.training_step import average_over_dp, holds_loss, synchronous_iteration

# Kept importable from here for scripts written against the one-module loop (bench/, user code).
from megatron_po.flops import gpt_flops_per_token, nmt_flops_per_sample  # noqa: F401
from megatron_po.gpt_workload import build_model_chunks  # noqa: F401
from megatron_po.training_log import truncate_metrics  # noqa: F401
from megatron_po.training_setup import build_optimizer_for  # noqa: F401
from megatron_po.training_step import train_step  # noqa: F401


def pretrain(cfg: Config, workload=None) -> dict:
    """Run training as configured; returns the last logged record (on the logging rank).
    `workload`: what is trained (default `GPTWorkload(cfg)`; pretrain_nmt.py passes an NMTWorkload)."""
    workload = workload or GPTWorkload(cfg)
    start_time = time.time()  # --exit-duration-in-mins counts from here, as Megatron's _TRAIN_START_TIME
    # Set-up
    cfg, schedule = initialize(cfg, workload)  # flags checked, process groups, output paths, seeds
    model = build_model(cfg, workload, schedule)  # chunks + DDP + optimizer, or this rank of an async pipeline
    train_ds, valid_ds = build_datasets(cfg, workload)
    state = resume(cfg, model)  # iteration and consumed samples: 0, or where the checkpoint left off
    progress = start_logging(cfg, workload, schedule, state.iteration)
    controls = RunControls(cfg, start_time)  # --profile, --manual-gc, --exit-duration-in-mins, ...
    periodic = PeriodicWork(cfg, workload, model, state, progress, controls, valid_ds)  # eval, save, exit
    guard = SkipGuard(cfg)  # --max-skipped-steps; fp16: a NaN loss at the loss scale's floor stops the run

    # The loop: the step, the bookkeeping, then the periodic work
    if model.engine is not None:  # asynchronous: micro-batches stream; the pipeline drains for the periodic work
        train_asynchronous(cfg, workload, model, state, train_ds, schedule, progress, controls, guard, periodic)
    else:  # synchronous: one global batch per iteration, a flush and a step at its end
        while state.iteration < cfg.training.train_iters:
            controls.before_iteration(state.iteration + 1)
            loss, grad_norm, lr = synchronous_iteration(cfg, workload, model, schedule, state, train_ds, guard)
            state.advance(schedule, updated=grad_norm is not None)  # iteration + 1; the lr's clock if stepped
            logged = progress.logs(state.iteration)
            metrics = replica_metrics(cfg, model.ddp.params) if logged else {}  # --log-params-norm, ...
            moe = moe_metrics(cfg, model.chunks) if logged else {}  # the routers' losses and loads, per layer
            mtp = mtp_metrics(cfg, model.chunks) if logged else {}  # the MTP depths' losses, on the loss stage
            progress.iteration_done(state.iteration, average_over_dp(loss) if holds_loss(cfg) else None, lr,
                                    grad_norm, model.optimizer.get_loss_scale() if cfg.precision.fp16 else None,
                                    metrics=metrics, moe=moe, mtp=mtp)
            controls.after_iteration(state.iteration)
            if periodic(collect=progress.boundary(state.iteration)):  # evaluate, save, exit as the intervals say
                break
    controls.close()
    progress.logger.close()
    return progress.record


def run_main(cfg_or_argv, description: str = "megatron_po", workload_cls=GPTWorkload) -> int:
    """Entry-point wrapper: bad input -> one `error:` line on stderr and exit code 2. `workload_cls`
    (GPTWorkload, nmt_workload.NMTWorkload) is built from the parsed config."""
    import sys

    from megatron_po.config import parse_args
    try:
        launcher_death.arm()  # under torchrun: die with the launcher, never save after it
        cfg = parse_args(cfg_or_argv, description) if not isinstance(cfg_or_argv, Config) else cfg_or_argv
        pretrain(cfg, workload_cls(cfg))
    except SaveError as e:  # every rank raises it alike (a full or read-only disk): one line, exit 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except (UserError, DataError) as e:
        rank_watchdog.report_fault(f"stopped: {e}")  # should only this rank have raised it, the others stop too
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A config error comes before the process group, alike on every rank: rank 0 (by the launcher's
        # RANK) prints it, so torchrun's output holds it once; every rank exits 2.
        said_by_rank0 = isinstance(e, ConfigError) and launcher_rank() != 0
        if not said_by_rank0 and (rank == 0 or not dist.is_initialized() or isinstance(e, RankError)):
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        message = rank_watchdog.communication_failure(e)  # a lost peer: one line naming it, not a traceback
        if message is None:
            rank_watchdog.report_fault(f"failed: {type(e).__name__}: {e}")
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        return rank_watchdog.FAULT_EXIT_CODE
    finally:
        save_lock.release()
        rank_watchdog.stop_watchdog()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
