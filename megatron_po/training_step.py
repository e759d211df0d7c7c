"""The step: one synchronous iteration (forward/backward over this rank's micro-batches, gradient sync,
clipping, the optimizer step), its NaN/inf and skipped-step checks, and evaluation (forward only).

One iteration consumes one global batch (`micro_batch x num_microbatches x DP` samples): each DP rank
runs forward/backward over its `num_microbatches` micro-batches (gradients accumulated locally, the
DP all-reduce overlapping the last backward), then the gradients are clipped by their global norm and
the optimizer steps with the lr of the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, global_batch_size
from megatron_po.distributed.checkpoint_format import find_checkpoint
from megatron_po.distributed.ddp import (DistributedDataParallel, allreduce_embedding_grads,
                                         allreduce_sequence_parallel_grads)
from megatron_po.errors import UserError
from megatron_po.gpt_workload import GPTWorkload
from megatron_po.models.moe.router import after_optimizer_step
from megatron_po.monitor import timers
from megatron_po.optim.clip_grads import clip_grad_norm_, expert_norm_group
from megatron_po.optim.mixed_precision import MainParamsOptimizer
from megatron_po.optim.sample_schedule import SampleSchedule, set_lr
from megatron_po.run_rules import SkipGuard, any_rank, loss_is_nonfinite


@dataclass
class TrainState:
    """Where training stands (checkpointed as `train_state`): iterations done, samples consumed, and
    `updated_samples`, the samples of the iterations whose optimizer step was applied: the lr schedule's
    clock, as Megatron-LM's scheduler (`opt_param_scheduler.step(increment=batch)` only when
    `update_successful`). An fp16 step skipped for inf/NaN gradients consumes its samples (the data and
    --rampup-batch-size move on) but leaves the lr where it was. Asynchronous pipelines keep one such clock
    per model chunk (`AsyncPolicy.lr_steps`); there it follows `consumed_samples`."""
    iteration: int = 0
    consumed_samples: int = 0
    updated_samples: int | None = None  # None: a checkpoint saved before it was kept, i.e. = consumed_samples

    def __post_init__(self):
        if self.updated_samples is None:
            self.updated_samples = self.consumed_samples

    def advance(self, schedule: SampleSchedule, updated: bool = True) -> None:
        """One iteration done: its samples (--rampup-batch-size: its own batch) are consumed, and count
        toward the lr schedule when its step was applied (`updated`)."""
        batch = schedule.batch(self.iteration)
        self.consumed_samples += batch
        self.updated_samples += batch if updated else 0
        self.iteration += 1


@dataclass
class Trainable:
    """What this rank trains: its model chunks and optimizer. Synchronous methods hold the chunks'
    gradients in `ddp`; an asynchronous pipeline runs them inside `engine` (an AsyncPipelineRank, whose
    `optimizer` is one optimizer per chunk)."""
    chunks: list
    optimizer: object
    ddp: DistributedDataParallel | None = None
    engine: object | None = None

    @property
    def policy(self):
        """The asynchronous weight-version policy (its stashed versions are checkpointed), else None."""
        return self.engine.stage.policy if self.engine is not None else None


def forward_backward(cfg, chunks, ddp, batches, forward_only: bool = False,
                     grad_scale: float = 1.0, workload=None) -> torch.Tensor | None:
    """Loss averaged over this rank's micro-batches; gradients accumulated into the DDP buffer.

    Every layout runs through the pipeline executor: without pipelining it runs the "none" schedule
    (F0 B0 F1 B1 ..., plain gradient accumulation with the DP sync on the last backward).
    Returns the mean loss on the rank that holds it (None elsewhere). `workload` defaults to GPT.
    """
    from megatron_po.pipeline.executor import synchronous_forward_backward
    workload = workload or GPTWorkload(cfg)
    specs = workload.message_specs(next(iter(batches[0].values())).shape[0])  # dim 0 of any batch tensor
    return synchronous_forward_backward(cfg.parallel.pipeline_method, chunks, ddp, batches, forward_only, specs,
                                        grad_scale)


def per_token_normalizer(batches: list[dict]) -> None:
    """--calculate-per-token-loss: each micro-batch's loss becomes its summed token losses / (T / (M x DP)),
    T the loss tokens of the whole global batch (all micro-batches, all DP ranks), so the mean over the M
    micro-batches and DP replicas that the executor and DDP take is Megatron's sum / T. With context
    parallelism each rank holds its share of the tokens and DDP averages over DP x CP: T / (M x DP x CP)."""
    local = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
    dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=True))
    replicas = ps.get_data_parallel_world_size(with_context_parallel=True)
    normalizer = (local / (len(batches) * replicas)).clamp(min=1e-12).float()
    for b in batches:
        b["loss_normalizer"] = normalizer


def holds_loss(cfg: Config) -> bool:
    """This rank computes the loss: the last pipeline rank (ZB-V: rank 0, schedules.loss_rank)."""
    from megatron_po.pipeline.schedules import loss_rank
    D = ps.get_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank() == loss_rank(cfg.parallel.pipeline_method, D)


def average_over_dp(x: torch.Tensor | None) -> float | None:
    """Mean over data-parallel replicas of a loss held by the last pipeline stage. `x` may live anywhere (an
    evaluation's float comes as a CPU tensor): it is copied to the backend's device first, as NCCL takes
    only GPU tensors. With context parallelism the mean is over DP x CP: each CP rank holds its tokens'
    share of the loss times CP (data/context_split.py), so that mean is the loss of the whole sequences."""
    if x is None:
        return None
    x = x.detach().to(device=ps.get_device(), dtype=torch.float64, copy=True)
    dist.all_reduce(x, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(x) / ps.get_data_parallel_world_size(with_context_parallel=True)


def train_step(cfg, chunks, ddp, optimizer, batches, lr: float, workload=None, decoupled_lr: float | None = None):
    """One synchronous iteration. Returns (loss on the last stage or None, grad norm or None when the
    step was skipped for inf/NaN gradients). `decoupled_lr`: the lr of the "decoupled" groups
    (--decoupled-lr: input embedding and output layer). MoE: right after the optimizer step every expert bias
    moves by the tokens its router counted in this iteration (--moe-router-enable-expert-bias), also after a
    step skipped for inf/NaN gradients, as Megatron (which updates it before the optimizer decides), and the global
    aux loss's loads start again (--moe-router-load-balancing-type global_aux_loss)."""
    loss, grad_norm = _forward_backward_step(cfg, chunks, ddp, optimizer, batches, lr, workload, decoupled_lr)
    after_optimizer_step(chunks)
    return loss, grad_norm


def _forward_backward_step(cfg, chunks, ddp, optimizer, batches, lr, workload, decoupled_lr):
    wrapped = isinstance(optimizer, MainParamsOptimizer)
    ddp.zero_grad()
    with timers("forward-backward", 1):
        loss = forward_backward(cfg, chunks, ddp, batches, grad_scale=optimizer.get_loss_scale() if wrapped else 1.0,
                                workload=workload)
    with timers("grad-sync", 1):  # what the last backwards' DP reduce did not overlap, + SP/embedding grads
        ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(ddp.params)
        allreduce_embedding_grads(ddp.params)
    with timers("optimizer", 1):
        set_lr(optimizer, lr)
        if decoupled_lr is not None:
            for group in optimizer.param_groups:
                if group.get("decoupled"):
                    group["lr"] = decoupled_lr
        if wrapped:  # fp32 main params: unscale, skip on inf/NaN, clip and step inside (sharded or not)
            return loss, optimizer.step().grad_norm
        grad_norm = clip_grad_norm_(ddp.params, cfg.training.clip_grad, ps.get_model_parallel_group(),
                                    expert_norm_group(cfg))
        if math.isfinite(grad_norm) or not cfg.training.check_for_nan_in_loss_and_grad:
            optimizer.step()  # else the run stops (check_finite) with the weights of the last good step
    return loss, grad_norm


def last_checkpoint(save_dir: str | None) -> str:
    """What a stop leaves behind, for its message (nothing is saved after a NaN/inf)."""
    found = find_checkpoint(save_dir) if save_dir else None
    return (f"nothing saved; the last good checkpoint is iteration {found} in {save_dir}" if found is not None
            else "nothing saved")


def check_finite(cfg, iteration: int, loss, grad_norm: float | None, ddp, save_dir: str | None) -> None:
    """--check-for-nan-in-loss-and-grad (bf16/fp32; fp16's loss scaler skips such steps instead): a NaN/inf
    gradient norm -- the same on every rank, agreed over the model-parallel group and equal across the
    data-parallel replicas -- stops the run before the step (train_step held it back), so every rank
    arrives here together and says which ranks and stages hold the non-finite loss or gradients."""
    if not cfg.training.check_for_nan_in_loss_and_grad or cfg.precision.fp16:
        return
    if grad_norm is not None and math.isfinite(grad_norm):
        return
    mine = []
    if loss is not None and not torch.isfinite(loss).all():
        mine.append(f"lm loss {float(loss)}")
    if not torch.isfinite(ddp.grad_buffer).all():
        mine.append("non-finite gradients")
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    where = "; ".join(f"{ps.describe_rank(r)}: {', '.join(what)}" for r, what in enumerate(found) if what)
    raise UserError(f"NaN/inf at iteration {iteration} (grad norm {grad_norm if grad_norm is not None else 'nan'}): "
                    f"{where or 'no rank holds a non-finite value after the reduction'}; stopped before the "
                    f"optimizer step, {last_checkpoint(save_dir)}")


@torch.no_grad()
def evaluate(cfg, chunks, ddp, valid, num_mb, workload=None):
    workload = workload or GPTWorkload(cfg)
    for c in chunks:
        c.eval()
    losses = []
    gbs = global_batch_size(cfg, dist.get_world_size())
    for k in range(workload.eval_iters(valid)):
        batches = workload.microbatches(valid, k * gbs, num_mb, cfg.training.micro_batch_size)
        loss = forward_backward(cfg, chunks, ddp, batches, forward_only=True, workload=workload)
        losses.append(average_over_dp(loss) if holds_loss(cfg) else None)
    for c in chunks:
        c.train()
    if not holds_loss(cfg):
        return None
    return sum(losses) / len(losses)



def synchronous_iteration(cfg: Config, workload, model: Trainable, schedule: SampleSchedule, state: TrainState,
                          train_ds, guard: SkipGuard) -> tuple[torch.Tensor | None, float | None, float]:
    """Iteration `state.iteration + 1`: one global batch, a flush and a step at its end, then the checks that
    stop a run (NaN/inf, --max-skipped-steps). Returns (loss on the loss rank or None, grad norm or None when
    the step was skipped, lr)."""
    t, ck = cfg.training, cfg.checkpoint
    lr = schedule.lr_at(state.iteration, updated=state.updated_samples)  # skipped steps do not advance it
    # --rampup-batch-size: the iteration's own global batch, whole micro-batches on every DP rank
    batches = workload.microbatches(train_ds, state.consumed_samples, schedule.num_microbatches(state.iteration),
                                    t.micro_batch_size)
    if t.calculate_per_token_loss:
        per_token_normalizer(batches)
    scale = model.optimizer.get_loss_scale() if cfg.precision.fp16 else None  # the scale this step runs with
    loss, grad_norm = train_step(cfg, model.chunks, model.ddp, model.optimizer, batches, lr, workload,
                                 schedule.decoupled_lr_at(state.iteration, updated=state.updated_samples))
    check_finite(cfg, state.iteration + 1, loss, grad_norm, model.ddp, ck.save)
    guard.after_step(state.iteration + 1, grad_norm is None, scale, loss_is_nonfinite(loss),
                     lambda: last_checkpoint(ck.save), any_rank)  # fp16: bounded skipping
    return loss, grad_norm, lr
