"""One pipeline rank's side of asynchronous training: its chunks, one optimizer per chunk, the step and
the weight policy (`AsyncStage`), which the emulator and the distributed rank (async_pipeline.py) share.

Every pipeline rank holds its model chunks, one optimizer per chunk and one weight policy
(policies.py). Micro-batches stream through `async_one_f_one_b(D, v, M, k)`; after every k backwards of
chunk c the rank runs Step(c), which here means (`AsyncStage.step`):

  (a) mean of chunk c's gradients over the data-parallel group (when it has more than one rank): the
      chunk's DDP buckets, each all-reduced (reduce-scattered with the distributed optimizer) from the
      backward hooks of the last backward before the step as soon as it is complete; one flat
      all-reduce at the step only under delay compensation, which edits gradients after each backward;
  (b) gradient-norm clipping local to the stage: the norm over chunk c's parameters only, TP shards
      counted once each over the TP group (DP replicas hold identical gradients after (a));
  (c) lr = lr_fn(i), i = the number of updates chunk c has applied so far (`lr_steps[c]`: a step
      skipped for inf/NaN gradients does not count, as Megatron-LM's scheduler steps only on a successful
      update; the schedule's own step count, which staleness and the policies read, counts every step);
  (d) the optimizer step of chunk c, then (e) chunk c's gradients are dropped.

Each micro-batch's loss is scaled by 1/k, so a step applies the mean over its k micro-batches (and over
DP after (a)).

Precision and the distributed optimizer (`precision`, the config's PrecisionConfig). With --bf16/--fp16
every chunk gets a MixedPrecisionOptimizer (fp32 main params; inf/NaN checks and clipping over the
stage's TP group only: stage-local). With --use-distributed-optimizer every chunk gets its own DDP
buffers and a DistributedOptimizer (ZeRO-1 over the DP group): (a) becomes a reduce-scatter launched by
the chunk's last backward before the step, each DP rank steps its shard of the fp32 main params, and the
updated shards are all-gathered into the weights. PipeOptim and SpecTrain predict Ŵ = W_main − s·lr·ΔW
for the own shard from the own state, into a separate full buffer per pass kind (written by the step
itself, pipeline/fused_steps.py), and right after each step send the updated shard and the predicted
shards of the passes before the next step in ONE packed
all-gather per bucket (asynchronous with --overlap-param-gather: the forward pre-hooks wait); a pass
on Ŵ points the parameters at that buffer and back after it, so the restore moves no data. At k = 1:
one all-gather of 2× (PipeOptim; 3× SpecTrain) the shard per micro-batch, instead of three (update,
prediction, restore) of 1× each (`predicting_policies._PredictingPolicy`). PipeDream and 2BW work
unchanged: they stash and swap the (full, replicated) model weights, never the sharded main params.
Found-inf and the grad norm are agreed over DP and TP of the stage.

FSDP2 (`fsdp=True`, --use-torch-fsdp2; distributed/fsdp.py): every chunk is fully sharded over DP x CP and each
of its layers is gathered for every forward and every backward (reshard after forward, always): the gather
delivers whatever the shards hold at that moment. The policy works on this rank's shards
(`async_policy.chunk_parameters`): PipeOptim and SpecTrain predict the own shard from the own optimizer state
in place (the live shard cached, 2 shard-sized copies), PipeDream and 2BW stash shards (1/DP of a stashed
version), so a pass gathers the predicted or stashed weights with one all-gather per layer, as a plain pass.
(a) is FSDP2's reduce-scatter at the end of each backward; the step (`FSDPOptimizer`) agrees on found-inf and
the norm over the shards' group and the stage's TP group and updates the shards in place.

fp16 loss scaling is per chunk (virtual stage): each has its own dynamic scale and skips its own steps
on inf/NaN. So that stages with different scales compose, gradients cross stage boundaries unscaled, in
fp32 (`_StageLossScaling`): the sender divides its input gradient by its own scale, the receiver
multiplies by its own and rounds to fp16 for its backward; the chunk holding the loss scales the loss by
its scale (it never steps between a micro-batch's forward and backward, so the scale is the same at both).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import PrecisionConfig
from megatron_po.distributed.ddp import DistributedDataParallel, allreduce_sequence_parallel_grads, is_expert
from megatron_po.distributed.fsdp import FullyShardedDataParallel, fsdp_precision, shard_chunks
from megatron_po.errors import ConfigError
from megatron_po.models.moe.router import after_optimizer_step
from megatron_po.monitor import timers
from megatron_po.optim import build_optimizer
from megatron_po.optim.clip_grads import clip_grad_norm_, global_grad_norm
from megatron_po.optim.distributed_optimizer import DistributedOptimizer
from megatron_po.optim.fsdp_optimizer import FSDPOptimizer
from megatron_po.optim.mixed_precision import (MainParamsOptimizer, MixedPrecisionOptimizer, build_grad_scaler,
                                               grad_buffer_dtype, model_dtype)
from megatron_po.optim.muon import optimizer_param_groups
from megatron_po.optim.sample_schedule import set_lr
from megatron_po.pipeline.async_policy import chunk_parameters, shift_microbatches
from megatron_po.pipeline.executor import StageRunner, WeightPolicy
from megatron_po.pipeline.pipenag import PipeNAGPolicy  # noqa: F401  (registers --pipeline-method pipenag)
from megatron_po.pipeline.policies import build_policy
from megatron_po.pipeline.schedules import Schedule, async_one_f_one_b


def segment_schedule(num_stages: int, num_chunks: int, num_microbatches: int, update_interval: int,
                     first_microbatch: int = 0) -> Schedule:
    """Async 1F1B over micro-batches `first_microbatch .. first_microbatch + num_microbatches - 1`."""
    if num_microbatches % update_interval != 0:
        raise ConfigError(f"a segment of {num_microbatches} micro-batches does not split into steps of "
                          f"k={update_interval} micro-batches: use a multiple of k")
    schedule = async_one_f_one_b(num_stages, num_chunks, num_microbatches, update_interval)
    return shift_microbatches(schedule, first_microbatch)


def _probe_schedule(num_stages: int, num_chunks: int, update_interval: int) -> Schedule:
    """A schedule long enough to reach the steady state; policies validate themselves against it when
    they are built, so bad combinations fail before any training."""
    unit = update_interval if num_chunks == 1 else math.lcm(num_stages, update_interval)
    return segment_schedule(num_stages, num_chunks, unit * math.ceil(4 * num_stages * num_chunks / unit),
                            update_interval)


class AsyncStage:
    """One pipeline rank's side of asynchronous training: its chunks, one optimizer per chunk, the step
    function run at each Step(c) and the weight policy (kept across segments). `precision`: model dtype,
    loss scaling and the distributed optimizer (default: fp32, plain optimizers); `ddp_bucket_size`: the
    distributed optimizer's bucket size; `compile_step` (--torch-compile): the optimizers' steps, with the
    prediction fused into them, under torch.compile."""

    def __init__(self, rank: int, num_stages: int, chunks: list, method: str, update_interval: int,
                 optimizer_name: str, optimizer_kwargs: dict, lr_fn: Callable[[int], float] | None,
                 clip_grad: float = 0.0, dp_group=None, tp_group=None, precision: PrecisionConfig | None = None,
                 ddp_bucket_size: int = 40_000_000, compile_step: bool = False, fsdp: bool = False,
                 **policy_options):
        self.rank, self.num_stages, self.chunks = rank, num_stages, chunks
        self.method, self.update_interval = method, update_interval
        kwargs = dict(optimizer_kwargs)
        weight_decay = kwargs.pop("weight_decay", 0.0)
        lr = kwargs.pop("lr", None)
        if lr is None and lr_fn is None:
            raise ConfigError("asynchronous training needs a learning rate: optimizer_kwargs['lr'] or lr_fn")
        lr = lr if lr is not None else lr_fn(0)
        self.lr_fn = lr_fn if lr_fn is not None else (lambda step: lr)
        self.clip_grad = clip_grad
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 else None
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        # Each group's reduction by its own size: MoE experts are summed over their expert-data-parallel group
        # also where DP x CP = 1 (TP 2 with expert TP 1: both TP ranks route their own tokens to the same experts).
        self.reduces = self.dp_group is not None or _expert_data_parallel_group(chunks) is not None
        pr = precision if precision is not None else PrecisionConfig()
        self.dtype = model_dtype(pr.bf16, pr.fp16)

        def inner(groups):
            return build_optimizer(optimizer_name, groups, lr, weight_decay=weight_decay, compile_step=compile_step,
                                   **kwargs)

        def scaler():  # one per chunk: every virtual stage keeps its own loss scale
            return build_grad_scaler(pr.fp16, pr.loss_scale, pr.initial_loss_scale, pr.min_loss_scale,
                                     pr.loss_scale_window, pr.hysteresis)

        def groups(chunk):  # Megatron's decay split; Muon also splits hidden matrices from the rest
            return optimizer_param_groups(optimizer_name, [chunk], weight_decay)

        self.ddps = self.fsdp = None
        mixed = pr.bf16 or pr.fp16
        if fsdp:  # fp32 shards over DP x CP, resharded after every pass: the policies act on the shards
            self.fsdp = FullyShardedDataParallel(shard_chunks(chunks, reshard_after_forward=True,
                                                              mp_policy=fsdp_precision(pr)))
        else:
            for c in chunks:
                c.to(self.dtype)
        # Delay compensation edits each gradient after its backward: the DP mean must wait for the step.
        bucketed_dp = self.reduces and not policy_options.get("delay_compensation")
        if not fsdp and (pr.use_distributed_optimizer or (mixed and pr.accumulate_allreduce_grads_in_fp32)
                         or bucketed_dp):
            # A gradient buffer per chunk: the distributed optimizer reduce-scatters it; fp32 accumulation
            # of low-precision gradients needs it too (the mixed-precision optimizer reads `main_grad`);
            # with DP > 1 its buckets are all-reduced as the chunk's last backward before a step fills
            # them, overlapping that backward, as in synchronous training.
            self.ddps = [DistributedDataParallel([c], self.dp_group, ddp_bucket_size,
                                                 use_distributed_optimizer=pr.use_distributed_optimizer,
                                                 overlap_param_gather=pr.overlap_param_gather,
                                                 grad_dtype=grad_buffer_dtype(pr.bf16, pr.fp16,
                                                                              pr.accumulate_allreduce_grads_in_fp32))
                         for c in chunks]
        # MoE: the experts' gradient squares (norm, clipping, found-inf) are summed over the stage's expert
        # TP x EP ranks, which hold every expert of the stage once (optim/clip_grads.py); stage-local, as the rest.
        self.expert_groups = [_stage_expert_group(c) for c in chunks]
        if fsdp:
            shard_group = ps.get_data_parallel_group(with_context_parallel=True)
            self.optimizers = [FSDPOptimizer(inner, groups(c), scaler(), clip_grad, shard_group, self.tp_group,
                                             expert_group=eg,
                                             expert_shard_group=ps.get_expert_data_parallel_group() if eg else None,
                                             model_order=self.fsdp.params)
                               for c, eg in zip(chunks, self.expert_groups)]
        elif pr.use_distributed_optimizer:
            self.optimizers = [DistributedOptimizer(inner, groups(c), ddp, scaler(), clip_grad, self.tp_group,
                                                    expert_group=eg)
                               for c, ddp, eg in zip(chunks, self.ddps, self.expert_groups)]
        elif mixed:
            self.optimizers = [MixedPrecisionOptimizer(inner, groups(c), scaler(), clip_grad, self.tp_group,
                                                       expert_group=eg) for c, eg in zip(chunks, self.expert_groups)]
        else:
            self.optimizers = [inner(groups(c)) for c in chunks]
        self.params = [chunk_parameters(c) for c in chunks]  # listed once: a module walk per step adds up
        self.steps = [0] * len(chunks)
        self.grad_norms: list[float | None] = [None] * len(chunks)  # before clipping, at the last step
        self.skipped_steps = [0] * len(chunks)  # steps skipped for inf/NaN gradients (mixed precision)
        self.consecutive_skipped = [0] * len(chunks)  # of them in a row, up to the last step (--max-skipped-steps)
        self.loss_chunk = next((i for i, c in enumerate(chunks) if c.post_process), None)
        self.policy = build_policy(method, rank, chunks, self.optimizers,
                                   _probe_schedule(num_stages, len(chunks), update_interval), **policy_options)
        self.policy.lr_fn = self.lr_fn  # schedule-aware weight predictors read the future lrs from it
        # Each chunk's lr clock: its applied updates. The policy shares the list (its predictors read the
        # clock, its state_dict checkpoints it and load_state_dict restores it in place).
        self.lr_steps = self.policy.lr_steps
        # The segment's runner, weakly: it holds this stage's bound `step`, so a strong reference would
        # be a cycle keeping every tensor of the stage alive after its last user let go (until a gc).
        self._runner: weakref.ref[StageRunner] | None = None

    @torch.no_grad()
    def step(self, c: int) -> None:
        opt = self.optimizers[c]
        if self.ddps is not None:  # the DP mean: reduce-scatter (distributed optimizer) or all-reduce
            with timers("grad-sync", 1):  # what the last backward's bucketed reduces did not overlap
                self.ddps[c].finish_grad_sync()
            params = self.ddps[c].params
        elif self.fsdp is not None:  # FSDP2 reduce-scattered the DP mean into each shard's grad in the backward
            params = list(self.chunks[c].parameters())
        else:
            params = self.params[c]
            if self.reduces:  # one all-reduce per group per step of this chunk: the DP mean
                with timers("grad-sync", 1):
                    _mean_over_data_parallel(params, self.dp_group)
        if self.tp_group is not None:  # sequence parallel: norm weights saw only this TP rank's tokens
            allreduce_sequence_parallel_grads(params)
        set_lr(opt, self.scheduled_lr(c) * self.policy.lr_scale(c))  # staleness-aware scaling, or 1
        ef = getattr(self.policy, "error_feedback", None)  # --async-error-feedback (error_feedback.py)
        if ef is not None:
            ef.begin(c)
        applied = True
        if isinstance(opt, MainParamsOptimizer):  # unscale/inf-check/clip/step inside, stage-local
            result = opt.step()
            applied = not result.skipped
            self.grad_norms[c] = result.grad_norm
            self.skipped_steps[c] += result.skipped
            self.consecutive_skipped[c] = self.consecutive_skipped[c] + 1 if result.skipped else 0
            runner = self._runner() if self._runner is not None else None
            if c == self.loss_chunk and runner is not None:
                runner.loss_scale = self._loss_scale()  # the scale may have changed
        else:
            if self.clip_grad > 0:
                self.grad_norms[c] = clip_grad_norm_(params, self.clip_grad, self.tp_group, self.expert_groups[c])
            else:
                self.grad_norms[c] = global_grad_norm(params, self.tp_group, self.expert_groups[c])
            opt.step()
        if ef is not None:
            ef.end(c, self.policy.gradient_delay(c))
        # Aux-loss-free balancing: once per optimizer step of the chunk (a skipped fp16 step too, as in
        # synchronous training), from the tokens its routers counted in the forwards since the last update;
        # the global aux loss's loads start again.
        after_optimizer_step([self.chunks[c]])
        if self.ddps is not None:
            self.ddps[c].zero_grad()
        else:
            for p in params:
                p.grad = None
        self.steps[c] += 1
        self.lr_steps[c] += applied  # the lr clock moves only with an applied update

    def scheduled_lr(self, c: int) -> float:
        """The lr schedule's value for chunk c's next step: lr_fn of the updates it has applied."""
        return self.lr_fn(self.lr_steps[c])

    def finish_param_sync(self) -> None:
        """Wait for the distributed optimizer's pending all-gathers (at a drain, before reading weights)."""
        for opt in self.optimizers:
            if hasattr(opt, "finish_param_sync"):
                opt.finish_param_sync()

    def _loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward: 1/k, times the fp16 loss
        scale of the chunk holding the loss."""
        opt = self.optimizers[self.loss_chunk] if self.loss_chunk is not None else None
        scale = opt.get_loss_scale() if isinstance(opt, MainParamsOptimizer) else 1.0
        return scale / self.update_interval

    def _aux_loss_scale(self, c: int) -> float:
        """The gradient of chunk c's MoE auxiliary losses in a backward: 1/k, times the chunk's own fp16 loss
        scale (its gradients carry that scale: `_StageLossScaling`)."""
        opt = self.optimizers[c]
        scale = opt.get_loss_scale() if isinstance(opt, MainParamsOptimizer) else 1.0
        return scale / self.update_interval

    def _grad_sync(self, c: int, enabled: bool) -> None:
        self.ddps[c].sync_enabled = enabled  # the chunk's last backward before a step launches its reduce

    def runner(self, schedule: Schedule, transport, get_batch, on_loss=None) -> StageRunner:
        """The StageRunner of this rank for one training segment."""
        self.policy.use_schedule(schedule)
        if self.dtype == torch.float16:
            if self.loss_chunk is not None and any(self.policy.staleness[self.loss_chunk].values()):
                raise ConfigError("--fp16 with an asynchronous method needs the chunk holding the loss to run each "
                                  "micro-batch's forward and backward between the same two steps (its loss scale); "
                                  "this schedule steps it in between")
            transport = _StageLossScaling(transport, self)
        runner = StageRunner(rank=self.rank, num_stages=self.num_stages, chunks=self.chunks, transport=transport,
                             get_batch=get_batch, loss_scale=self._loss_scale(), policy=self.policy,
                             step_fn=self.step, grad_sync=self._grad_sync if self.ddps is not None else None,
                             on_loss=on_loss, detail_level=1, aux_loss_scale=self._aux_loss_scale)
        self._runner = weakref.ref(runner)
        return runner

    def eval_runner(self, transport, get_batch) -> StageRunner:
        """Forward only, live weights (the default policy; the runner skips policies in forward-only runs)."""
        return StageRunner(rank=self.rank, num_stages=self.num_stages, chunks=self.chunks, transport=transport,
                           get_batch=get_batch, policy=WeightPolicy(), forward_only=True)


class _StageLossScaling:
    """A transport for fp16 asynchronous pipelines, where every chunk has its own loss scale: gradients
    travel between stages unscaled, in fp32. Sending, a chunk divides its input gradient by its own
    scale; receiving, it multiplies by its own and rounds to fp16 for its backward. (Forward
    activations pass unchanged.)"""

    def __init__(self, transport, stage: AsyncStage):
        self.transport, self.stage = transport, stage
        if hasattr(transport, "prepost"):
            self.prepost = transport.prepost

    def _scale(self, virtual_stage: int) -> float:
        return self.stage.optimizers[virtual_stage // self.stage.num_stages].get_loss_scale()

    def send(self, peer: int, key: tuple, tensors: list[torch.Tensor]) -> None:
        if key[0] == "grad":  # key[2]: the receiving virtual stage; the sender is the next one
            scale = self._scale(key[2] + 1)
            tensors = [t.float() / scale for t in tensors]
        self.transport.send(peer, key, tensors)

    def recv(self, me: int, peer: int, key: tuple) -> list[torch.Tensor]:
        tensors = self.transport.recv(me, peer, key)
        if key[0] == "grad":
            scale = self._scale(key[2])
            tensors = [(t * scale).to(self.stage.dtype) for t in tensors]
        return tensors

    def flush(self) -> None:
        self.transport.flush()


def _stage_expert_group(chunk):
    """The group a chunk's MoE expert gradient squares are summed over (the stage's expert TP x EP ranks),
    None for a chunk without experts."""
    if not any(is_expert(p) for p in chunk.parameters()):
        return None
    return ps.get_expert_tensor_and_model_parallel_group() if ps.model_parallel_is_initialized() else None


def _expert_data_parallel_group(chunks):
    """The expert-data-parallel group of the chunks' MoE experts where it has more than one rank, else None."""
    if not ps.model_parallel_is_initialized() or not any(is_expert(p) for c in chunks for p in c.parameters()):
        return None
    group = ps.get_expert_data_parallel_group()
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _mean_over_data_parallel(params, dp_group) -> None:
    """The DP mean of the chunk's gradients in one all-reduce (no gradient buffer: delay compensation edits
    each gradient after its backward). MoE experts as the DDP buckets reduce them: summed over their
    expert-data-parallel group (each already holds the tokens of every EP rank), scaled by the same 1/DP.
    `dp_group` None: one data-parallel rank (the experts may still have several)."""
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    for expert in (False, True):
        grads = [p.grad for p in params if p.grad is not None and is_expert(p) == expert]
        group = ps.get_expert_data_parallel_group() if expert else dp_group
        if not grads or group is None:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))


def fp32_gradient_specs(message_specs):
    """Message specs for fp16 asynchronous pipelines: gradients travel in fp32 (see _StageLossScaling)."""
    if message_specs is None:
        return None
    return lambda key: ([(shape, torch.float32) for shape, _ in message_specs(key)] if key[0] == "grad"
                        else message_specs(key))
