"""Asynchronous training: this rank of the pipeline (`build_async_engine`) and the loop that streams
micro-batches through it without a flush, draining only at the next evaluation (unless the workload
evaluates inside the stream), checkpoint, exit or the end of training (`next_boundary`). See
docs ASYNC_PIPELINES.md and pipeline/async_pipeline.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, global_batch_size, num_microbatches, update_interval
from megatron_po.errors import RankError
from megatron_po.gpt_workload import GPTWorkload
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.periodic_work import PeriodicWork
from megatron_po.run_controls import RunControls
from megatron_po.run_rules import SkipGuard, loss_is_nonfinite
from megatron_po.models.moe.report import moe_metrics
from megatron_po.models.mtp import mtp_metrics
from megatron_po.training_log import Progress
from megatron_po.training_step import Trainable, TrainState, average_over_dp, last_checkpoint


ASYNC_SEGMENT_ITERATIONS = 1000  # the longest asynchronous segment without --async-drain-interval


def next_boundary(iteration: int, cfg: Config, eval_drains: bool = False) -> int:
    """The next iteration after which an asynchronous pipeline must drain: checkpoint, exit or the end
    of training (and evaluation when `eval_drains`; otherwise it runs inside the stream)."""
    t, ck = cfg.training, cfg.checkpoint
    # --async-drain-interval fixes the drains whether or not a run saves (its saves fall on drains);
    # without it every save drains, and so does every ASYNC_SEGMENT_ITERATIONS-th iteration (a segment's
    # op lists are built whole: this bounds them, independently of --eval-interval).
    drains = [cfg.parallel.async_drain_interval] if cfg.parallel.async_drain_interval else \
        ([ck.save_interval] if ck.save and ck.save_interval else []) + [ASYNC_SEGMENT_ITERATIONS]
    intervals = ([t.eval_interval] if eval_drains else []) + drains \
        + ([t.exit_interval] if t.exit_interval else [])
    return min([t.train_iters] + [(iteration // n + 1) * n for n in intervals])


def async_engine_arguments(cfg: Config, microbatches_per_iteration: int, schedule: SampleSchedule) -> dict:
    """The keyword arguments, taken from the flags, that this rank of the pipeline (`AsyncPipelineRank`) and the
    one-process emulator of the same run (`AsyncEmulator`, tools/layout_sweep.py) are built with: the update
    interval, the optimizer's settings, the lr of every step, the clip norm and the method's options. The LR
    schedule is counted in iterations (global batches), so warm-up and decay span the same samples as in
    synchronous training although a stage steps `microbatches_per_iteration / k` times per iteration."""
    from megatron_po.pipeline.async_pipeline import optimizer_kwargs_from_config
    p, t = cfg.parallel, cfg.training
    k = update_interval(cfg)
    steps_per_iteration = microbatches_per_iteration // k
    kwargs = optimizer_kwargs_from_config(t)
    if t.optimizer == "sgd":
        kwargs["sgd_direction"] = p.pipeoptim_sgd_direction
    options = {}
    if p.pipeline_method == "pipeoptim":
        options = dict(s_offset=p.pipeoptim_s_offset, include_weight_decay=p.pipeoptim_extrapolate_weight_decay,
                       weight_predictor=p.weight_predictor, prediction_horizon=p.prediction_horizon,
                       rollout_gradient=p.rollout_gradient)
    if p.pipeline_method in ("pipedream", "pipeoptim"):
        options.update(delay_compensation=p.delay_compensation_lambda,
                       delay_compensation_adaptive=p.delay_compensation_adaptive)
    options["staleness_lr_scaling"] = p.staleness_lr_scaling
    options["error_feedback"] = p.async_error_feedback
    return dict(update_interval=k, optimizer_kwargs=kwargs, clip_grad=t.clip_grad,
                lr_fn=lambda step: schedule.lr_at(step // steps_per_iteration), **options)


def build_async_engine(cfg: Config, padded_vocab: int, microbatches_per_iteration: int, workload=None,
                       schedule: SampleSchedule | None = None):
    """This rank of an asynchronous pipeline."""
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
    schedule = schedule or SampleSchedule(cfg, dist.get_world_size())
    workload = workload or GPTWorkload(cfg)
    return AsyncPipelineRank(cfg, padded_vocab, cfg.parallel.pipeline_method,
                             message_specs=workload.message_specs(cfg.training.micro_batch_size),
                             build_chunks=workload.chunks_for_rank,
                             **async_engine_arguments(cfg, microbatches_per_iteration, schedule))


def loss_stage_grad_norm(stage) -> float:
    """The grad norm an asynchronous run logs: the loss stage's, at its chunks' last steps (before clipping)."""
    return next((n for n in reversed(stage.grad_norms) if n is not None), float("nan"))


def stream_batches(cfg: Config, workload, train_ds, world: int):
    """mb -> this DP rank's share of micro-batch `mb` of the stream: micro-batch mb % M of global batch mb // M
    (same data order as synchronous training)."""
    gbs, num_mb, mbs = global_batch_size(cfg, world), num_microbatches(cfg, world), cfg.training.micro_batch_size

    def batch_of(mb: int) -> dict:
        g, m = divmod(mb, num_mb)
        return workload.microbatches(train_ds, g * gbs + m * mbs * ps.get_data_parallel_world_size(), 1, mbs)[0]
    return batch_of


def train_asynchronous(cfg: Config, workload, model: Trainable, state: TrainState, train_ds, schedule: SampleSchedule,
                       progress: Progress, controls: RunControls, guard: SkipGuard, periodic: PeriodicWork) -> None:
    """Micro-batches stream without a flush; the pipeline drains only at the next evaluation, checkpoint,
    exit or the end of training (segment boundaries)."""
    t, ck = cfg.training, cfg.checkpoint
    engine = model.engine
    world = dist.get_world_size()
    gbs, num_mb = global_batch_size(cfg, world), num_microbatches(cfg, world)
    batch_of = stream_batches(cfg, workload, train_ds, world)
    pending: dict[int, list] = {}
    skipped_steps_seen = 0  # the loss stage's skipped steps already reported
    check_nan = t.check_for_nan_in_loss_and_grad and not cfg.precision.fp16  # fp16: the loss scaler skips

    def on_loss(mb: int, loss: torch.Tensor) -> None:
        nonlocal skipped_steps_seen
        g = mb // num_mb
        if check_nan and not torch.isfinite(loss).all():  # before its backward
            raise RankError(f"lm loss is {float(loss)} at iteration {g + 1} (micro-batch {mb}) on "
                            f"{ps.describe_rank(dist.get_rank())}: stopped before its backward; "
                            f"{last_checkpoint(ck.save)}")
        pending.setdefault(g, []).append(loss)
        if len(pending[g]) == num_mb:
            mean = torch.stack(pending.pop(g)).mean()
            stage = engine.stage
            last_norm = loss_stage_grad_norm(stage)
            # Steps are stage-local here: the iteration counts as skipped when this (the loss) stage
            # skipped a step for inf/NaN gradients since the last one; fp16 logs this stage's scale.
            skipped = sum(stage.skipped_steps)
            skipped_now = skipped > skipped_steps_seen
            if skipped_now:
                last_norm, skipped_steps_seen = None, skipped
            scale = stage.optimizers[stage.loss_chunk].get_loss_scale() if cfg.precision.fp16 else None
            guard.after_iteration(g + 1, max(stage.consecutive_skipped), skipped_now, scale,
                                  loss_is_nonfinite(mean), lambda: last_checkpoint(ck.save), RankError,
                                  ps.describe_rank(dist.get_rank()))
            # The loss chunk's lr clock: the schedule's lr of iteration g unless steps were skipped (fp16)
            lr = stage.scheduled_lr(stage.loss_chunk)
            # The MTP block sits on this (the loss) stage: its losses of the forwards so far, like the LM loss's
            mtp = mtp_metrics(cfg, model.chunks) if progress.logs(g + 1) else {}
            progress.iteration_done(g + 1, average_over_dp(mean), lr, last_norm, scale, mtp=mtp)

    in_stream = getattr(workload, "eval_in_stream", False)  # else (NMT BLEU decoding) drain to evaluate

    def evaluate_in_stream(it: int):
        def run():  # on every rank at its cut after iteration `it`: no training op moves
            with progress.excluded():
                val = periodic.evaluate()
                if val is not None:
                    progress.log_validation(it, val)
                if cfg.model.num_experts is not None:  # the routers' numbers since the last cut or drain
                    progress.log_moe(it, moe_metrics(cfg, model.chunks))
        return run

    while state.iteration < t.train_iters:
        stop = next_boundary(state.iteration, cfg, eval_drains=not in_stream)
        controls.before_iteration(state.iteration + 1, last=stop)  # --profile: the segment holding its start
        evaluations = {it * num_mb: evaluate_in_stream(it) for it in range(state.iteration + 1, stop + 1)
                       if in_stream and periodic.eval_due(it)}
        engine.train_segment(batch_of, (stop - state.iteration) * num_mb, on_loss=on_loss,
                             evaluations=evaluations)
        state.consumed_samples += (stop - state.iteration) * gbs
        state.updated_samples = state.consumed_samples  # the lr clocks are per chunk here (policy.lr_steps)
        state.iteration = stop
        if cfg.model.num_experts is not None:  # the routers' numbers since the last cut or drain: every rank, drained
            progress.log_moe(state.iteration, moe_metrics(cfg, model.chunks))
        controls.after_iteration(state.iteration)
        stop = periodic(collect=True, evaluated=in_stream)  # every segment ends at a drain
        if stop:
            break
