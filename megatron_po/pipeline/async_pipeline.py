"""Asynchronous pipeline training: the no-flush 1F1B stream in segments, evaluation without a drain, and
the two ways to run it: every rank in one process (`AsyncEmulator`) or one rank of the distributed run
(`AsyncPipelineRank`).

Each rank's side (its chunks, one optimizer per chunk, Step(c) after every k backwards of chunk c, the
weight policy; precision, the distributed optimizer and fp16 loss scaling) is `async_stage.AsyncStage`.

Segments. Training runs the stream in segments of M micro-batches (`segment_schedule`): the schedule of
M micro-batches with ids offset by the number already consumed, so batches, p2p tags and staleness use
global ids. A segment ends with a drain (every micro-batch in flight finishes its backward and step),
which is needed before checkpoints and the end of training (evaluation is not: see below). A drain does not change the
update semantics of the micro-batches already in flight: their forward ran where it would have run in
the endless stream, and exactly the same backwards and steps of their stage separate it from their
backward, so s(j), and with it PipeDream's stashed versions, 2BW's versions and PipeOptim's
predictions, are unchanged (tests/test_async_pipeline.py checks s(j) against a longer stream). It only
shortens the stream: the next segment starts with a fresh warm-up, whose first micro-batches see fresher
weights than they would have without the drain. (SpecTrain's backward look-ahead s_b counts steps until
a micro-batch's round trip ends on the timeline; during a drain fewer steps remain, so the schedule
gives the last micro-batches a smaller s_b, which is what that stream really does.) M must be a
multiple of k (a step always averages k micro-batches) and, with interleaving, of D.

Evaluation without a drain. `train_segment(..., evaluations={N: fn})` calls fn() on every rank at its
cut for N (`iteration_cuts`): just before the rank's first forward of a micro-batch >= N, i.e. when the
rank has run every op that precedes the next iteration's micro-batches. There fn evaluates forward-only
on the rank's live weights (`evaluate`, eval mode, no prediction, no gradients), micro-batches flowing
stage to stage under ids far from the training ones, so no p2p tag or mailbox key is shared. No
training op moves, and eval mode draws no random numbers, so the training trajectory is bit for bit the
same whatever the evaluation interval. The value differs from a drained evaluation: stage r evaluates
on the weights it holds at its cut (its steps up to micro-batch N - 1 - s, s its staleness), which is
what the stream is at that moment. The emulator snapshots each rank's weights at the same cut and
evaluates on the snapshots after the segment, so its values equal the distributed run's.

`AsyncEmulator` runs all D ranks in one process (the research tool: exact per-op numerics of the
distributed run, no process groups needed); `AsyncPipelineRank` is one rank of the distributed run.
Both use the same `AsyncStage`, so their updates are identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, TrainingConfig, uses_fsdp2, virtual_pipeline_size
from megatron_po.errors import ConfigError
from megatron_po.optim.build import precision_aware_kwargs
from megatron_po.optim.muon import muon_kwargs
from megatron_po.pipeline.async_policy import shift_microbatches
from megatron_po.pipeline.async_stage import AsyncStage, fp32_gradient_specs, segment_schedule
from megatron_po.pipeline.cuts import EVAL_ID_OFFSET, hooks_at_cuts
from megatron_po.pipeline.executor import Mailbox, P2PTransport, emulate, forward_only_ops, run_rank
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.pipeline.policies import ASYNC_METHODS
from megatron_po.pipeline.schedules import Schedule, gpipe

# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def check_async_config(cfg: Config, method: str, num_stages: int, num_chunks: int, update_interval: int) -> None:
    if method not in ASYNC_METHODS:
        raise ConfigError(f"unknown asynchronous pipeline method {method!r}; valid: {', '.join(ASYNC_METHODS)}")
    if not cfg.model.untie_embeddings_and_output_weights:
        raise ConfigError("asynchronous pipeline methods need --untie-embeddings-and-output-weights")
    if not isinstance(update_interval, int) or update_interval < 1:
        raise ConfigError(f"the async update interval must be an integer >= 1, got {update_interval!r}")
    if num_stages < 1 or num_chunks < 1:
        raise ConfigError(f"need num_stages >= 1 and num_chunks >= 1, got {num_stages}, {num_chunks}")


def with_method(cfg: Config, method: str) -> Config:
    """`cfg` running --pipeline-method `method` (the engines take the method apart from the config; the chunks'
    build reads it: an MTP block apart from the embedding owns its copy under the asynchronous methods)."""
    if cfg.parallel.pipeline_method == method:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_method=method))


def optimizer_kwargs_from_config(t: TrainingConfig) -> dict:
    """`build_optimizer` keyword arguments from the training flags."""
    return dict(lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
                adam_eps=t.adam_eps, sgd_momentum=t.sgd_momentum, **muon_kwargs(t),
                nadam_momentum_decay=t.nadam_momentum_decay, **precision_aware_kwargs(t))


def _training_defaults(cfg: Config, optimizer_name, optimizer_kwargs, clip_grad) -> tuple[str, dict, float]:
    """Optimizer name, `build_optimizer` kwargs and clip norm: the given ones, else cfg.training's."""
    t = cfg.training
    return (optimizer_name or t.optimizer,
            optimizer_kwargs if optimizer_kwargs is not None else optimizer_kwargs_from_config(t),
            t.clip_grad if clip_grad is None else clip_grad)


def _batch_getter(batches, first: int) -> tuple[Callable[[int], dict], int | None]:
    """(mb -> batch, count): a callable takes global micro-batch ids; a sequence is this segment's."""
    if callable(batches):
        return batches, None
    batches = list(batches)
    return (lambda mb: batches[mb - first]), len(batches)


def _eval_schedule(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Forwards in GPipe order (any number of micro-batches); the runners keep only the forwards."""
    return gpipe(num_stages, num_chunks, num_microbatches)


def _set_train(chunks, mode: bool) -> None:
    for c in chunks:
        c.train(mode)


def _global_state(chunks, gather_tp: bool) -> dict[str, torch.Tensor]:
    """{global parameter name: tensor} (full tensors when `gather_tp`, TP shards gathered)."""
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    out = {}
    for name, p in named_parameters_global(chunks):
        t = p.detach().full_tensor() if ps.is_dtensor(p) else p.detach().clone()  # FSDP2: the shards gathered
        if gather_tp and getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
            from megatron_po.tensor_parallel import gather_tensor
            shards = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = gather_tensor(shards, p.partition_dim, getattr(p, "partition_stride", 1))
        out[name] = t
    return out


# --------------------------------------------------------------------------------------------------
# Single process: every rank in memory
# --------------------------------------------------------------------------------------------------


class AsyncEmulator:
    """All D pipeline ranks of an asynchronous run in one process, with the numerics of the distributed
    run (same ops, same per-op code; only the transport differs).

        emu = AsyncEmulator(cfg, padded_vocab, "pipeoptim", num_stages=4, update_interval=1,
                            optimizer_name="adam", optimizer_kwargs={"lr": 1e-3}, lr_fn=lambda i: 1e-3)
        losses = emu.train_segment(get_batch, 64)   # get_batch(global micro-batch id) -> batch dict
        val = emu.evaluate(valid_batches)           # live weights, no prediction
        weights = emu.full_state_dict()             # {global parameter name: tensor}

    Defaults come from `cfg.training`: optimizer name and settings, clip_grad; lr_fn defaults to the
    constant `lr`. `policy_options` go to the method's policy (pipeoptim: s_offset, include_weight_decay).
    `build_chunks` makes a rank's model chunks (default GPT's; `partition.build_nmt_chunks_for_rank` for
    the encoder-decoder model, with padded_vocab = (source, target)).
    Model init follows `cfg.training.seed` (layout independent); dropout draws from torch's global RNG.
    """

    def __init__(self, cfg: Config, padded_vocab: int, method: str, num_stages: int, num_chunks: int = 1,
                 update_interval: int = 1, optimizer_name: str | None = None, optimizer_kwargs: dict | None = None,
                 lr_fn: Callable[[int], float] | None = None, clip_grad: float | None = None,
                 build_chunks=build_chunks_for_rank, **policy_options):
        check_async_config(cfg, method, num_stages, num_chunks, update_interval)
        cfg = with_method(cfg, method)
        self.cfg, self.method = cfg, method
        self.num_stages, self.num_chunks, self.update_interval = num_stages, num_chunks, update_interval
        optimizer_name, optimizer_kwargs, clip_grad = _training_defaults(cfg, optimizer_name, optimizer_kwargs,
                                                                         clip_grad)
        self.stages = []
        for r in range(num_stages):
            chunks = build_chunks(cfg, padded_vocab, r, num_stages, num_chunks, ps.get_device())
            self.stages.append(AsyncStage(r, num_stages, chunks, method, update_interval, optimizer_name,
                                          optimizer_kwargs, lr_fn, clip_grad, precision=cfg.precision,
                                          ddp_bucket_size=cfg.parallel.ddp_bucket_size,
                                          compile_step=cfg.model.torch_compile, **policy_options))
        self.microbatches_consumed = 0

    @property
    def chunks(self) -> list:
        """Every model chunk, in virtual-stage order."""
        return [self.stages[r].chunks[c] for c in range(self.num_chunks) for r in range(self.num_stages)]

    def train_segment(self, get_batch, num_microbatches: int | None = None,
                      evaluations: dict[int, Callable[[], None]] | None = None, on_loss=None) -> list[float]:
        """Stream `num_microbatches` micro-batches through the pipeline and drain it; returns each
        micro-batch's loss, in order. `get_batch` is a function of the global micro-batch id
        (`microbatches_consumed + i`) or a list of this segment's batches. `evaluations`: {N: fn}, fn()
        (which calls `evaluate`) sees every rank's weights as they were at its cut for N, as in the
        distributed run; the training stream is not changed by it. `on_loss(mb, loss)`: as for
        `AsyncPipelineRank`, called as the last stage computes each loss (its state then is the
        distributed last stage's)."""
        first = self.microbatches_consumed
        get_batch, count = _batch_getter(get_batch, first)
        num_microbatches = num_microbatches if num_microbatches is not None else count
        schedule = segment_schedule(self.num_stages, self.num_chunks, num_microbatches, self.update_interval, first)
        mailbox = Mailbox()
        runners = {s.rank: s.runner(schedule, mailbox, get_batch, on_loss if s.rank == self.num_stages - 1 else None)
                   for s in self.stages}
        snapshots: dict[tuple[int, int], list[torch.Tensor]] = {}

        def snapshot(n: int, stage: AsyncStage) -> Callable[[], None]:
            def take():
                snapshots[(n, stage.rank)] = [p.detach().clone() for params in stage.params for p in params]
            return take
        hooks = {s.rank: hooks_at_cuts(schedule, {n: snapshot(n, s) for n in evaluations or {}}, s.rank)
                 for s in self.stages}
        emulate(schedule, runners, hooks)
        for s in self.stages:
            s.finish_param_sync()
        for n in sorted(evaluations or {}):  # nothing in flight now: point the parameters at the snapshots
            live = {}
            for s in self.stages:
                for p, w in zip((p for params in s.params for p in params), snapshots[(n, s.rank)]):
                    live[p], p.data = p.data, w
            evaluations[n]()
            for p, w in live.items():
                p.data = w
        self.microbatches_consumed += num_microbatches
        losses = runners[self.num_stages - 1].losses
        return [losses[first + i].item() for i in range(num_microbatches)]

    def evaluate(self, batches: Sequence[dict]) -> float:
        """Mean loss over `batches` on the live weights (eval mode, no prediction, no gradients)."""
        batches = list(batches)
        chunks = self.chunks
        _set_train(chunks, False)
        mailbox = Mailbox()
        runners = {s.rank: s.eval_runner(mailbox, batches.__getitem__) for s in self.stages}
        emulate(_eval_schedule(self.num_stages, self.num_chunks, len(batches)), runners)
        _set_train(chunks, True)
        losses = runners[self.num_stages - 1].losses
        return torch.stack([losses[i] for i in range(len(batches))]).mean().item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its global name (as in checkpoints and the unpipelined GPTModel)."""
        out = {}
        for s in self.stages:
            out.update(_global_state(s.chunks, gather_tp=False))
        return out

    def copies_per_chunk(self) -> dict[tuple[int, int], int]:
        """(rank, chunk) -> the most weight copies that chunk has held at once (live weights included)."""
        return {(s.rank, c): n for s in self.stages for c, n in s.policy.copies_per_chunk().items()}

    def steps_taken(self) -> dict[tuple[int, int], int]:
        return {(s.rank, c): n for s in self.stages for c, n in enumerate(s.steps)}


# --------------------------------------------------------------------------------------------------
# Distributed: this process is one pipeline rank
# --------------------------------------------------------------------------------------------------


class AsyncPipelineRank:
    """This process's pipeline rank of an asynchronous run (P2P between ranks; DP, TP groups from
    parallel_state). Same arguments and update semantics as `AsyncEmulator`, with D and the rank taken
    from the process groups and v from the config unless given. Losses live on the last pipeline stage:
    `train_segment` and `evaluate` return None on the other stages, and each DP rank reports the losses
    of its own micro-batches (`get_batch` must return this DP rank's share)."""

    def __init__(self, cfg: Config, padded_vocab: int, method: str, num_chunks: int | None = None,
                 update_interval: int = 1, optimizer_name: str | None = None, optimizer_kwargs: dict | None = None,
                 lr_fn: Callable[[int], float] | None = None, clip_grad: float | None = None,
                 message_specs=None, build_chunks=build_chunks_for_rank, **policy_options):
        D = ps.get_pipeline_model_parallel_world_size()
        v = num_chunks if num_chunks is not None else virtual_pipeline_size(cfg)
        check_async_config(cfg, method, D, v, update_interval)
        cfg = with_method(cfg, method)
        self.cfg, self.method = cfg, method
        self.num_stages, self.num_chunks, self.update_interval = D, v, update_interval
        self.rank = ps.get_pipeline_model_parallel_rank()
        optimizer_name, optimizer_kwargs, clip_grad = _training_defaults(cfg, optimizer_name, optimizer_kwargs,
                                                                         clip_grad)
        chunks = build_chunks(cfg, padded_vocab, self.rank, D, v, ps.get_device())
        self.stage = AsyncStage(self.rank, D, chunks, method, update_interval, optimizer_name, optimizer_kwargs,
                                lr_fn, clip_grad, dp_group=ps.get_data_parallel_group(with_context_parallel=True),
                                tp_group=ps.get_tensor_model_parallel_group(), precision=cfg.precision,
                                ddp_bucket_size=cfg.parallel.ddp_bucket_size, compile_step=cfg.model.torch_compile,
                                fsdp=uses_fsdp2(cfg), **policy_options)
        if cfg.precision.fp16:
            message_specs = fp32_gradient_specs(message_specs)
        self.transport = P2PTransport(D, v, message_specs) if D > 1 else Mailbox()
        self.microbatches_consumed = 0
        self._cut: int | None = None  # inside train_segment's evaluation at the cut for this micro-batch id

    def restore_progress(self, microbatches_consumed: int) -> None:
        """After loading a checkpoint (taken at a drain): continue the stream's global micro-batch ids
        and each chunk's step count (the lr clocks, `policy.lr_steps`, come with the policy's state)."""
        self.microbatches_consumed = microbatches_consumed
        self.stage.steps = [microbatches_consumed // self.update_interval] * self.num_chunks

    @property
    def chunks(self) -> list:
        return self.stage.chunks

    def holds_loss(self) -> bool:
        return self.rank == self.num_stages - 1

    def train_segment(self, get_batch, num_microbatches: int | None = None, on_loss=None,
                      evaluations: dict[int, Callable[[], None]] | None = None) -> list[float] | None:
        """Stream micro-batches through this rank and drain. `on_loss(mb, loss)` is called on the last
        stage as each micro-batch's loss is computed (progress logging without draining).
        `evaluations`: {N: fn}; fn() runs at this rank's cut for N (before its first forward of a
        micro-batch >= N) and may call `evaluate`, which then runs between two training ops."""
        first = self.microbatches_consumed
        get_batch, count = _batch_getter(get_batch, first)
        num_microbatches = num_microbatches if num_microbatches is not None else count
        schedule = segment_schedule(self.num_stages, self.num_chunks, num_microbatches, self.update_interval, first)
        runner = self.stage.runner(schedule, self.transport, get_batch, on_loss)

        def at_cut(n: int, fn: Callable[[], None]) -> Callable[[], None]:
            def run():
                self._cut = n
                try:
                    fn()
                finally:
                    self._cut = None
            return run
        actions = {n: at_cut(n, fn) for n, fn in (evaluations or {}).items()}
        run_rank(schedule, runner, hooks_at_cuts(schedule, actions, self.rank))
        self.stage.finish_param_sync()
        self.microbatches_consumed += num_microbatches
        if not self.holds_loss():
            return None
        return [runner.losses[first + i].item() for i in range(num_microbatches)]

    def evaluate(self, batches: Sequence[dict]) -> float | None:
        """Mean loss over `batches` on this rank's live weights (None off the last stage). Called from an
        evaluation of `train_segment`, it runs between two training ops: forwards only, under micro-batch
        ids EVAL_ID_OFFSET past the cut's, and without waiting for the training sends still in flight."""
        batches = list(batches)
        mid_stream = self._cut is not None
        base = (self._cut if mid_stream else self.microbatches_consumed) + EVAL_ID_OFFSET
        schedule = shift_microbatches(_eval_schedule(self.num_stages, self.num_chunks, len(batches)), base)
        runner = self.stage.eval_runner(self.transport, lambda mb: batches[mb - base])
        _set_train(self.chunks, False)
        if mid_stream:
            for op in forward_only_ops(schedule.ops[self.rank]):
                runner.run(op)
        else:
            run_rank(schedule, runner)
        _set_train(self.chunks, True)
        if not self.holds_loss():
            return None
        return torch.stack([runner.losses[base + i] for i in range(len(batches))]).mean().item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their global names, TP shards gathered into full tensors."""
        return _global_state(self.chunks, gather_tp=True)

    def copies_per_chunk(self) -> dict[int, int]:
        return self.stage.policy.copies_per_chunk()
