"""Run a pipeline rank's op list; the same runner serves real processes and the single-process emulator.

`StageRunner.run(op)` executes one op of one pipeline rank on its model chunks:

- `Forward(mb, c)`: take the input (the micro-batch's tokens on the first virtual stage, else the
  activation received from the previous virtual stage), run chunk c, and either send the output to
  the next virtual stage or, on the last one, compute the micro-batch's loss (a chunk with
  `reads_batch`, the NMT model, is called as `chunk(batch, hidden_states=...)` on every stage: it
  needs the micro-batch's padding masks everywhere);
- `Backward(mb, c)`: backpropagate from the loss (last virtual stage) or from the gradient received
  from the next virtual stage, then send the input's gradient to the previous virtual stage;
- `BackwardInput(mb, c)` / `BackwardWeight(mb, c)` (zero-bubble schedules): the same backward with the
  linear layers' weight gradients queued (`tensor_parallel/weight_grads.py`) and the input gradient sent
  at once; the later W op runs the queued weight gradients (no forward or graph re-run);
- `Step(c)`: call the caller's `step_fn(c)` (asynchronous methods step chunks mid-stream; synchronous
  training steps after the schedule, so its `Step(None)` is left to the caller).

It never knows which schedule produced the ops. What moves between stages goes through a transport:
`P2PTransport` (torch.distributed isend / blocking recv, any number of tensors per message, shapes
sent in a small header so variable-length batches work) or `Mailbox` (a dict, for the emulator). The
weight-version policy of asynchronous methods is called around every forward and backward, and gives
each forward the provider through which activation recomputation in its backward sees the forward's
weights (`WeightPolicy.weights_for_recompute`, docs/recomputation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.models.gpt import masked_mean_loss
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.monitor import timers
from megatron_po.pipeline.schedules import (GRADIENT_DONE, Backward, BackwardInput, BackwardWeight, Forward, Schedule,
                                             Step, comm_of, message_tag, rank_chunk_of, tag_period, virtual_stage)
from megatron_po.tensor_parallel import recompute_weights, weight_grads

# --------------------------------------------------------------------------------------------------
# Transports
# --------------------------------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 64  # int64 slots: [num_tensors, dtype code, (ndim, dims...) per tensor]


class Mailbox:
    """In-process transport: the emulator's ranks leave messages in a shared dict."""

    def __init__(self):
        self.messages: dict = {}

    def send(self, peer: int, key: tuple, tensors: list[torch.Tensor]) -> None:
        self.messages[(peer, key)] = [t.detach().clone() for t in tensors]

    def recv(self, me: int, peer: int, key: tuple) -> list[torch.Tensor]:
        return self.messages.pop((me, key))

    def flush(self) -> None:
        pass


class P2PTransport:
    """Point-to-point between pipeline ranks.

    Two protocols. With `message_specs` (key -> [(shape, dtype), ...], known to both sides, e.g. the
    GPT activation [s, b, h]) a message is one flat payload, and the receiver posts its irecv ahead of
    time (`prepost`, driven by `run_rank`'s look-ahead over the op list): a receive posted before the
    data arrives costs one gloo hand-off instead of two round trips. Without specs (variable shapes)
    each message is a header (shapes, dtype) followed by the payload.

    Tags come from `message_tag` (micro-batch ids folded into half its period), doubled to tell header
    from payload, so forward activations and backward gradients never match each other even when both
    neighbours are the same rank (D=2)."""

    def __init__(self, num_stages: int, num_chunks: int, message_specs=None):
        self.D, self.v = num_stages, num_chunks
        self.specs = message_specs
        self.ranks = ps.get_pipeline_model_parallel_ranks()
        self.group = ps.get_pipeline_model_parallel_group()
        self.device = ps.get_device()
        self.pending: list = []  # (work, tensors kept alive until the send completes)
        self.posted: dict = {}  # (peer, key) -> (irecv work, flat buffer, specs)
        # ZB-V's "v" placement hands an activation (gradient) between two chunks of the same rank.
        self.me = ps.get_pipeline_model_parallel_rank()
        self.local: dict = {}  # key -> tensors sent to this rank itself
        self._mb_period = tag_period(num_stages, num_chunks) // 2  # 2 * tag must stay below 2**32

    def _tag(self, key) -> int:
        kind, mb, dest_vs = key
        return 2 * message_tag(kind, mb % self._mb_period, dest_vs, self.v, self.D)

    def send(self, peer: int, key: tuple, tensors: list[torch.Tensor]) -> None:
        if peer == self.me:
            self.local[key] = [t.detach().clone() for t in tensors]
            return
        tag, dst = self._tag(key), self.ranks[peer]
        if len(tensors) == 1:
            payload = tensors[0].detach().reshape(-1).contiguous()
        else:
            payload = torch.cat([t.detach().reshape(-1) for t in tensors])
        if self.specs is None:
            dtype = tensors[0].dtype
            header = [len(tensors), _DTYPES.index(dtype)]
            for t in tensors:
                assert t.dtype == dtype, "all tensors of one message share a dtype"
                header += [t.dim(), *t.shape]
            assert len(header) <= _HEADER, "message header too large"
            head = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=self.device)
            self.pending.append((dist.isend(head, dst, group=self.group, tag=tag), head))
        self.pending.append((dist.isend(payload, dst, group=self.group, tag=tag + 1), payload))
        if len(self.pending) > 64:  # drop completed sends so long asynchronous runs don't accumulate
            self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def prepost(self, peer: int, key: tuple) -> None:
        """Post the irecv of a message this rank will need soon (agreed shapes only)."""
        if self.specs is None or (peer, key) in self.posted or peer == self.me:
            return
        specs = self.specs(key)
        numel = sum(int(torch.Size(shape).numel()) for shape, _ in specs)
        buf = torch.empty(numel, dtype=specs[0][1], device=self.device)
        work = dist.irecv(buf, self.ranks[peer], group=self.group, tag=self._tag(key) + 1)
        self.posted[(peer, key)] = (work, buf, specs)

    def recv(self, me: int, peer: int, key: tuple) -> list[torch.Tensor]:
        if peer == self.me:
            return self.local.pop(key)
        if self.specs is not None:
            self.prepost(peer, key)
            work, payload, specs = self.posted.pop((peer, key))
            work.wait()
            shapes = [shape for shape, _ in specs]
        else:
            tag, src = self._tag(key), self.ranks[peer]
            head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(head, src, group=self.group, tag=tag)
            h = head.tolist()
            n, dtype = h[0], _DTYPES[h[1]]
            shapes, i = [], 2
            for _ in range(n):
                ndim = h[i]
                shapes.append(tuple(h[i + 1:i + 1 + ndim]))
                i += 1 + ndim
            payload = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes), dtype=dtype, device=self.device)
            dist.recv(payload, src, group=self.group, tag=tag + 1)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        return [t.view(s) for t, s in zip(payload.split(sizes), shapes)]

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# --------------------------------------------------------------------------------------------------
# Weight-version policy interface (asynchronous methods plug in here; synchronous ones use the no-op)
# --------------------------------------------------------------------------------------------------


class WeightPolicy:
    """Hooks the runner calls around each pass; the default keeps the live weights throughout.

    Forward-only runs (evaluation) never call the hooks: evaluation always uses the live weights.
    `before_step` lets a policy keep the weights a step is about to overwrite (weight stashing);
    `lr_scale` is the factor the step function applies to the lr of the chunk's next step.
    """

    def before_forward(self, mb: int, chunk: int) -> None: ...
    def after_forward(self, mb: int, chunk: int) -> None: ...
    def before_backward(self, mb: int, chunk: int) -> None: ...
    def after_backward(self, mb: int, chunk: int) -> None: ...
    def before_step(self, chunk: int) -> None: ...
    def after_step(self, chunk: int) -> None: ...

    def lr_scale(self, chunk: int) -> float:
        return 1.0

    def weights_for_recompute(self, mb: int, chunk: int):
        """The `tensor_parallel.recompute_weights` provider for the forward of (mb, chunk): how activation
        recomputation inside its backward gets the weights this forward runs on. None: the backward's
        weights are those already (synchronous methods change weights only after the flush)."""
        return None


# --------------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------------


def _as_list(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class StageRunner:
    rank: int  # pipeline rank
    num_stages: int
    chunks: list  # model chunks of this rank, indexed by chunk id
    transport: object
    get_batch: object  # mb -> dict(tokens, labels, loss_mask)
    loss_scale: float = 1.0  # multiplies each micro-batch loss before backward (1/M: the mean)
    policy: WeightPolicy = field(default_factory=WeightPolicy)
    step_fn: object = None  # chunk -> None, for Step ops
    grad_sync: object = None  # (chunk, enabled: bool) -> None, DDP sync on a chunk's last backward
    weight_grads_done: object = None  # chunk -> None after a W op (FSDP2 reduce-scatters its gradients: fsdp.py)
    forward_only: bool = False
    on_loss: object = None  # (mb, detached loss) -> None, on the last virtual stage (progress logging)
    detail_level: int = 2  # --timing-log-level of the per-op timers (asynchronous runs: 1, they have no coarser)
    saved: dict = field(default_factory=dict)  # (mb, chunk) -> (inputs, outputs) kept for backward
    losses: dict = field(default_factory=dict)  # mb -> detached loss (last virtual stage)
    deferred: dict = field(default_factory=dict)  # (mb, chunk) -> weight-gradient closures from BackwardInput
    placement: str = "interleaved"  # the schedule's chunk placement (ZB-V: "v")
    # chunk -> the gradient of its MoE auxiliary losses in a backward (None: `loss_scale`). Asynchronous fp16
    # stages scale each chunk's gradients by the chunk's own loss scale (async_stage._StageLossScaling).
    aux_loss_scale: object = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def _peer(self, vs: int) -> int:
        return rank_chunk_of(vs, self.num_stages, self.placement)[0]

    def run(self, op, sync_grads: bool = False) -> None:
        if isinstance(op, Forward):
            self.forward(op.microbatch, op.chunk)
        elif isinstance(op, Backward):
            self.backward(op.microbatch, op.chunk, sync_grads)
        elif isinstance(op, BackwardInput):
            self.backward(op.microbatch, op.chunk, split=True)
        elif isinstance(op, BackwardWeight):
            self.backward_weight(op.microbatch, op.chunk, sync_grads)
        elif isinstance(op, Step):
            if self.step_fn is not None:
                with timers("prediction", self.detail_level):
                    self.policy.before_step(op.chunk)
                with timers("optimizer", 1):
                    self.step_fn(op.chunk)
                with timers("prediction", self.detail_level):
                    self.policy.after_step(op.chunk)

    def forward(self, mb: int, c: int) -> None:
        chunk = self.chunks[c]
        vs = virtual_stage(self.rank, c, self.num_stages, self.placement)
        reads_batch = getattr(chunk, "reads_batch", False)  # NMT: every stage needs the source padding mask
        batch = self.get_batch(mb) if (chunk.pre_process or chunk.post_process or reads_batch) else None
        inputs = []
        if not chunk.pre_process:
            with timers("p2p", self.detail_level):
                inputs = self.transport.recv(self.rank, self._peer(vs - 1), ("act", mb, vs))
            if not self.forward_only:
                for t in inputs:
                    t.requires_grad_(t.is_floating_point())
        if not self.forward_only:
            with timers("prediction", self.detail_level):
                self.policy.before_forward(mb, c)
        weights = None if self.forward_only else self.policy.weights_for_recompute(mb, c)
        with torch.set_grad_enabled(not self.forward_only), timers("forward-compute", self.detail_level), recompute_weights(weights):
            hidden = None if chunk.pre_process else (inputs[0] if len(inputs) == 1 else tuple(inputs))
            if reads_batch:
                out = chunk(batch, hidden_states=hidden)
            else:
                out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None, hidden_states=hidden,
                            labels=batch["labels"] if chunk.post_process else None,
                            loss_mask=batch["loss_mask"] if chunk.post_process else None)
            if chunk.post_process:
                if "loss_normalizer" in batch:  # --calculate-per-token-loss: sum / the global batch's tokens
                    loss = (out * batch["loss_mask"]).sum() / batch["loss_normalizer"]
                else:
                    loss = masked_mean_loss(out, batch["loss_mask"])
                self.losses[mb] = loss.detach()
                outputs = [loss * self.loss_scale]
        if chunk.post_process and self.on_loss is not None:
            self.on_loss(mb, self.losses[mb])
        if not self.forward_only:
            with timers("prediction", self.detail_level):
                self.policy.after_forward(mb, c)
        if not chunk.post_process:
            outputs = _as_list(out)
            with timers("p2p", self.detail_level):
                self.transport.send(self._peer(vs + 1), ("act", mb, vs + 1), outputs)
        if not self.forward_only:
            self.saved[(mb, c)] = (inputs, outputs)

    def backward(self, mb: int, c: int, sync_grads: bool = False, split: bool = False) -> None:
        """Fused backward, or (split=True) the B op of zero bubble: the linear weight gradients are
        queued for `backward_weight`, whose DDP sync decides; B never starts a reduction."""
        chunk = self.chunks[c]
        vs = virtual_stage(self.rank, c, self.num_stages, self.placement)
        inputs, outputs = self.saved.pop((mb, c))
        if chunk.post_process:
            grads = [None]
        else:
            with timers("p2p", self.detail_level):
                grads = self.transport.recv(self.rank, self._peer(vs + 1), ("grad", mb, vs))
        with timers("prediction", self.detail_level):
            self.policy.before_backward(mb, c)
        if self.grad_sync is not None:
            self.grad_sync(c, sync_grads)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        # The MoE auxiliary losses of this micro-batch get the gradient its loss got (models/moe/aux_losses.py).
        aux_scale = self.loss_scale if self.aux_loss_scale is None else self.aux_loss_scale(c)
        with timers("backward-compute", self.detail_level), aux_loss_scale(aux_scale):
            if split:
                with weight_grads.defer_weight_grads() as queue:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                self.deferred[(mb, c)] = queue
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.grad_sync is not None:
            self.grad_sync(c, False)
        with timers("prediction", self.detail_level):
            self.policy.after_backward(mb, c)
        if not chunk.pre_process:
            in_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            with timers("p2p", self.detail_level):
                self.transport.send(self._peer(vs - 1), ("grad", mb, vs - 1), in_grads)


    def backward_weight(self, mb: int, c: int, sync_grads: bool = False) -> None:
        """The W op: accumulate the weight gradients `backward(split=True)` queued for (mb, c)."""
        queue = self.deferred.pop((mb, c))
        if self.grad_sync is not None:
            self.grad_sync(c, sync_grads)
        with timers("backward-compute", self.detail_level):
            weight_grads.apply_weight_grads(queue)
        if self.weight_grads_done is not None:
            self.weight_grads_done(c)
        if self.grad_sync is not None:
            self.grad_sync(c, False)


def backwards_before_step(ops) -> set[int]:
    """Indices of the ops whose gradients complete a step: the last Backward (zero bubble: the last
    BackwardWeight) of chunk c before a Step(c) or Step(None). The DDP reduce of that chunk overlaps
    exactly these ops (parameters whose gradient a split backward completes at B, e.g. norms, are
    reduced at `finish_grad_sync` instead)."""
    out, last = set(), {}
    for i, op in enumerate(ops):
        if isinstance(op, GRADIENT_DONE):
            last[op.chunk] = i
        elif isinstance(op, Step):
            chunks = list(last) if op.chunk is None else [op.chunk]
            out |= {last.pop(c) for c in chunks if c in last}
    return out


def forward_only_ops(ops) -> list:
    """Evaluation: the schedule's forwards in their order (a valid pipeline order on every rank)."""
    return [op for op in ops if isinstance(op, Forward)]


# --------------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------------


PREPOST_WINDOW = 4  # ops of look-ahead for posting receives (buffers alive: at most this many messages)


def run_rank(schedule: Schedule, runner: StageRunner, before_op: dict | None = None) -> None:
    """Distributed: this process runs its own rank's ops in order. `before_op`: {op index: fn()} run
    just before that op (len(ops): after the last one), e.g. evaluation between two training ops."""
    ops = schedule.ops[runner.rank]
    before_op = before_op or {}
    if runner.forward_only:
        ops = forward_only_ops(ops)
    sync_at = backwards_before_step(ops)
    prepost = getattr(runner.transport, "prepost", None)
    if runner.placement != schedule.placement:
        raise ValueError(f"schedule {schedule.name} places chunks {schedule.placement!r}, the runner "
                         f"{runner.placement!r}")
    receives = [comm_of(op, runner.rank, runner.num_stages, runner.num_chunks, schedule.placement)[0] for op in ops]
    for i, op in enumerate(ops):
        if prepost is not None:  # post the receives of the next few ops before they are needed
            for recv in receives[i:i + PREPOST_WINDOW + 1]:
                if recv is not None:
                    prepost(*recv)
        if i in before_op:
            before_op[i]()
        runner.run(op, sync_grads=i in sync_at)
    if len(ops) in before_op:
        before_op[len(ops)]()
    with timers("p2p", runner.detail_level):
        runner.transport.flush()


def emulate(schedule: Schedule, runners: dict[int, StageRunner], before_op: dict | None = None) -> None:
    """Single process: run every rank's ops in an order the dependencies allow (the one the deadlock
    checker finds), with the same per-op code and numerics as the distributed run. `before_op`:
    {rank: {op index: fn()}}, as in `run_rank`."""
    from megatron_po.pipeline.schedules import Schedule as _S, execution_order
    sched = schedule
    if any(r.forward_only for r in runners.values()):
        sched = _S(schedule.name, schedule.num_stages, schedule.num_chunks, schedule.num_microbatches,
                   {r: forward_only_ops(ops) for r, ops in schedule.ops.items()}, schedule.placement)
    wrong = [r for r, runner in runners.items() if runner.placement != schedule.placement]
    if wrong:
        raise ValueError(f"schedule {schedule.name} places chunks {schedule.placement!r}; runners {wrong} do not")
    sync_at = {r: backwards_before_step(ops) for r, ops in sched.ops.items()}
    hooks = before_op or {}
    for r, i in execution_order(sched):
        if i in hooks.get(r, {}):
            hooks[r][i]()
        runners[r].run(sched.ops[r][i], sync_grads=i in sync_at[r])
    for r, ops in sched.ops.items():
        if len(ops) in hooks.get(r, {}):
            hooks[r][len(ops)]()


# --------------------------------------------------------------------------------------------------
# Synchronous training glue
# --------------------------------------------------------------------------------------------------

_SCHEDULE_CACHE: dict = {}
_TRANSPORT: dict = {}  # (D, v, message_specs) -> the transport over the pipeline group
ps.on_release(_TRANSPORT.clear)  # a transport sends over the groups it was made with: it goes with them


def synchronous_forward_backward(method: str, chunks, ddp, batches, forward_only: bool = False,
                                 message_specs=None, grad_scale: float = 1.0):
    """One synchronous iteration of this rank over `batches` (its micro-batches). Gradients end up in
    the DDP buffer (the DP reduce overlapping each chunk's last backward); the caller steps.
    `grad_scale` multiplies every micro-batch loss before backward (fp16 loss scaling).
    Returns the mean micro-batch loss on the last pipeline stage, None elsewhere."""
    from megatron_po.pipeline.schedules import build_schedule
    D, v, M = ps.get_pipeline_model_parallel_world_size(), len(chunks), len(batches)
    if D == 1 and v == 1:
        method = "none"
    key = (method, D, v, M)
    if key not in _SCHEDULE_CACHE:
        _SCHEDULE_CACHE[key] = build_schedule(method, D, v, M)
    if (D, v, message_specs) not in _TRANSPORT:
        _TRANSPORT[(D, v, message_specs)] = P2PTransport(D, v, message_specs) if D > 1 else Mailbox()
    transport = _TRANSPORT[(D, v, message_specs)]

    def grad_sync(_chunk, enabled):
        ddp.sync_enabled = enabled

    runner = StageRunner(rank=ps.get_pipeline_model_parallel_rank(), num_stages=D, chunks=chunks,
                         transport=transport, get_batch=batches.__getitem__, loss_scale=grad_scale / M,
                         grad_sync=grad_sync if ddp is not None else None, forward_only=forward_only,
                         weight_grads_done=getattr(ddp, "weight_grads_done", None),
                         placement=_SCHEDULE_CACHE[key].placement)
    run_rank(_SCHEDULE_CACHE[key], runner)
    if ddp is not None:
        ddp.sync_enabled = True
    if not runner.losses:
        return None
    return torch.stack([runner.losses[mb] for mb in sorted(runner.losses)]).mean()
