"""Data-parallel gradient reduction over a contiguous, bucketed gradient buffer.

Every parameter's gradient lives in one flat buffer, so micro-batch gradients accumulate in place and a
bucket is a contiguous slice that one collective handles. Buckets hold parameters in reverse
registration order, roughly the order backward produces their gradients (MoE expert parameters after all
the others, in buckets of their own reduced over the expert-data-parallel group); as soon as every parameter of
a bucket has its final gradient for this step, the bucket's reduction starts asynchronously and
overlaps the rest of the backward pass. `no_sync()` suppresses that during the first micro-batches of a
step (gradient accumulation); `finish_grad_sync()` launches what is left and waits. Gradients are
pre-scaled by 1/DP, so the reduced buffer holds the mean over data-parallel ranks.

Where a parameter's gradient lives (`p.main_grad` always names its slice of the buffer):
- buffer dtype == parameter dtype (fp32 training, or bf16/fp16 grads in the model dtype): `p.grad` IS
  that slice, and autograd accumulates into it directly;
- buffer dtype != parameter dtype (`--accumulate-allreduce-grads-in-fp32` with bf16/fp16 params): a
  post-accumulate hook adds each backward's low-precision `p.grad` into the fp32 `p.main_grad` and frees
  `p.grad` (Megatron's scheme), so accumulation over micro-batches and the reduction are in fp32.

With `use_distributed_optimizer=True` (ZeRO-1, see optim/distributed_optimizer.py):
- each bucket is padded to a multiple of DP (x an alignment) and cut into DP equal contiguous ranges
  that ignore parameter boundaries; data-parallel rank d owns range d of every bucket; MoE expert buckets
  are cut the same way over their expert-data-parallel group (the ranks holding the same experts, as
  Megatron shards them), so expert-DP rank d owns range d of every expert bucket (`Bucket.group`);
- the bucket reduction is a reduce-scatter: afterwards only the owned range holds the DP mean (the rest
  of the buffer still holds this rank's local gradients and must not be used);
- the parameters' storage moves into one flat `param_buffer` with the same layout, so updated shards
  can be all-gathered straight into the model weights, bucket by bucket (`start_param_sync`); with
  `overlap_param_gather` those gathers run asynchronously and a forward pre-hook on every module waits
  for the buckets of its own parameters, overlapping the gather with the next forward;
- a tied embedding (`shared_embedding`) gets a bucket of its own: it then starts at offset 0 of an
  identically sized bucket on the first and the last pipeline stage, so both copies are sharded the
  same way and `allreduce_embedding_grads` may still run after the reduce-scatter.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.errors import ConfigError

# Each rank's shard of a bucket is a multiple of this many elements (256-byte aligned in fp32).
SHARD_ALIGNMENT = 64


def reduce_scatter_single(output, input_, group, async_op):
    # torch >= 2.10 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input_, group=group, async_op=async_op)


def all_gather_single(output, input_, group, async_op):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input_, group=group, async_op=async_op)


@dataclass
class Bucket:
    start: int
    end: int  # exclusive; includes the padding in distributed-optimizer mode
    params: list = field(default_factory=list)
    num_ready: int = 0
    handle: object = None  # the pending gradient reduction
    gather_handle: object = None  # the pending parameter all-gather (distributed optimizer)
    expert: bool = False  # holds MoE expert parameters: reduced over the expert-data-parallel group
    # The ranks this bucket is reduced over and (distributed optimizer) sharded into `size` ranges, this rank
    # owning range `rank`: the data-parallel group, or for experts the expert-data-parallel group.
    group: object = None
    size: int = 1
    rank: int = 0

    def shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """[start, end) of the part of this bucket that data-parallel rank `dp_rank` owns."""
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


class _Done:
    """The handle of a reduction over a group of one rank (nothing to wait for)."""

    def wait(self) -> None:
        pass


def is_expert(p: torch.Tensor) -> bool:
    """A MoE expert parameter (models/moe/experts.py): its gradient is reduced over the expert-data-parallel
    group, the ranks holding the same expert slice, instead of the data-parallel group."""
    return getattr(p, "expert_parallel", False)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient to reduce/clip/step with: the DDP buffer slice when there is one, else `.grad` (of an
    FSDP2-sharded parameter: this rank's shard of it, distributed/fsdp.py)."""
    main_grad = getattr(p, "main_grad", None)
    if main_grad is not None:
        return main_grad
    grad = p.grad
    return grad._local_tensor if ps.is_dtensor(grad) else grad


class DistributedDataParallel:
    def __init__(self, chunks: list[nn.Module], dp_group=None, bucket_size: int = 40_000_000,
                 grad_dtype: torch.dtype = torch.float32, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False, reduce_scatter: bool | None = None):
        if overlap_param_gather and not use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather requires --use-distributed-optimizer")
        self.chunks = chunks
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        # Distributed optimizer: reduce-scatter the gradients (each rank gets its owned ranges), or
        # all-reduce them (`full_grads`: every rank holds the whole mean gradient; ps.reduce_scatter_grads
        # picks it on gloo, where it is the cheaper collective, for fp32 gradient buffers).
        if reduce_scatter is None:
            reduce_scatter = self.dp_size == 1 or grad_dtype != torch.float32 or ps.reduce_scatter_grads(dp_group)
        self.full_grads = use_distributed_optimizer and not reduce_scatter
        seen, params = set(), []
        for chunk in chunks:
            for p in chunk.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.params = params
        device = params[0].device if params else torch.device("cpu")
        # MoE experts: their own buckets, summed over the expert-data-parallel group (every expert's gradient
        # there already sums the tokens of all EP ranks), scaled by the same 1/DP as the dense ones.
        self.expert_group = ps.get_expert_data_parallel_group() if any(map(is_expert, params)) else None
        expert_size = dist.get_world_size(self.expert_group) if self.expert_group is not None else 1
        expert_rank = dist.get_rank(self.expert_group) if self.expert_group is not None else 0
        shard_of = {False: (dp_group, self.dp_size, self.dp_rank), True: (self.expert_group, expert_size, expert_rank)}

        # Lay parameters out in reverse order, cutting a new bucket when one exceeds bucket_size.
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self.param_range: dict[int, tuple[int, int]] = {}  # id(param) -> [start, end) in the buffers
        offset, bucket = 0, None

        def close(bucket):
            pad_to = bucket.size * SHARD_ALIGNMENT if use_distributed_optimizer else 1
            bucket.end = -(-bucket.end // pad_to) * pad_to if bucket.end > bucket.start else bucket.end
            return bucket.end

        # Experts after the dense parameters: one run of expert buckets (Megatron keeps them in a buffer of their own).
        ordered = [p for p in reversed(params) if not is_expert(p)] + [p for p in reversed(params) if is_expert(p)]
        for p in ordered:
            own_bucket = use_distributed_optimizer and getattr(p, "shared_embedding", False)
            if bucket is None or offset - bucket.start >= bucket_size or own_bucket or (
                    use_distributed_optimizer and getattr(bucket.params[-1], "shared_embedding", False)) or (
                    bucket.expert != is_expert(p)):
                if bucket is not None:
                    offset = close(bucket)
                group, size, rank = shard_of[is_expert(p)]
                bucket = Bucket(start=offset, end=offset, expert=is_expert(p), group=group, size=size, rank=rank)
                self.buckets.append(bucket)
            n = p.numel()
            self.param_range[id(p)] = (offset, offset + n)
            bucket.params.append(p)
            bucket.end = offset + n
            self._bucket_of[id(p)] = bucket
            offset += n
        total = close(bucket) if bucket is not None else 0
        # Each bucket's reduction is decided by its own group's size (DESIGN.md): the expert-data-parallel group
        # has several ranks also where DP x CP = 1 (TP 2 with expert TP 1: both TP ranks route their own tokens
        # to the same experts), so a DDP with one data-parallel rank may still have expert buckets to sum.
        self.reduces = self.dp_size > 1 or any(b.size > 1 for b in self.buckets)
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)

        self._accumulates_into_main_grad: set[int] = set()
        for p in params:
            start, end = self.param_range[id(p)]
            p.main_grad = self.grad_buffer[start:end].view_as(p)
            if p.dtype == grad_dtype:
                p.grad = p.main_grad  # autograd accumulates straight into the buffer
            else:
                p.grad = None
                self._accumulates_into_main_grad.add(id(p))
            p.register_post_accumulate_grad_hook(_weak_hook(self._on_grad_ready))
        self.sync_enabled = True

        self.param_buffer = None
        if use_distributed_optimizer:
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ConfigError("the distributed optimizer needs one parameter dtype, got "
                                  f"{', '.join(sorted(map(str, dtypes)))}")
            # Move every parameter's storage into one flat buffer laid out like the gradient buffer.
            self.param_buffer = torch.zeros(total, dtype=params[0].dtype if params else torch.float32,
                                            device=device)
            with torch.no_grad():
                for p in params:
                    start, end = self.param_range[id(p)]
                    view = self.param_buffer[start:end].view_as(p)
                    view.copy_(p.data)
                    p.data = view
            if overlap_param_gather:
                self._register_forward_pre_hooks()

    # -- gradient accumulation ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (every micro-batch but the last of a step)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None:  # a zero-bubble B op left this weight's gradient to its W op (weight_grads.py)
            return
        if id(p) in self._accumulates_into_main_grad:
            with torch.no_grad():
                p.main_grad.add_(p.grad)  # low-precision grad of this backward into the fp32 buffer
            p.grad = None
        if not self.sync_enabled or not self.reduces:
            return
        bucket = self._bucket_of[id(p)]
        bucket.num_ready += 1
        if bucket.num_ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            return
        view = self.grad_buffer[bucket.start:bucket.end]
        view.div_(self.dp_size)  # experts too: the mean over DP of gradients each summing every EP rank's tokens
        if bucket.size == 1:  # an expert bucket whose experts no other rank holds
            bucket.handle = _Done()
        elif self.use_distributed_optimizer and not self.full_grads:
            start, end = self.owned_range(bucket)
            # In place: the owned range of the input receives the reduced values (safe on gloo and NCCL).
            bucket.handle = reduce_scatter_single(self.grad_buffer[start:end], view, bucket.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(view, group=bucket.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch the buckets that backward did not complete (unused params), in order, then wait."""
        if self.reduces:
            for bucket in self.buckets:
                self._launch(bucket)
            for bucket in self.buckets:
                bucket.handle.wait()
        for bucket in self.buckets:
            bucket.handle, bucket.num_ready = None, 0

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        for p in self.params:
            if id(p) in self._accumulates_into_main_grad:
                p.grad = None
        for bucket in self.buckets:
            bucket.handle, bucket.num_ready = None, 0

    # -- parameter all-gather (distributed optimizer) -------------------------------------------

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """[start, end) of `bucket` that this rank owns (reduces, steps, gathers from) among the ranks of
        `bucket.group` (data parallel; expert data parallel for an expert bucket)."""
        return bucket.shard(bucket.rank, bucket.size)

    def start_param_sync(self, async_op: bool | None = None) -> None:
        """All-gather every bucket's owned ranges into the full parameters. Asynchronous when
        `overlap_param_gather` (the forward pre-hooks wait, or `finish_param_sync`), else blocking."""
        if not self.use_distributed_optimizer:
            raise RuntimeError("start_param_sync: this DDP was built without use_distributed_optimizer")
        self.finish_param_sync()
        if not self.reduces:
            return
        async_op = self.overlap_param_gather if async_op is None else async_op
        # Issue in forward order (buckets are laid out backwards) so the first layers arrive first.
        for bucket in reversed(self.buckets):
            if bucket.size == 1:
                continue
            start, end = self.owned_range(bucket)
            handle = all_gather_single(self.param_buffer[bucket.start:bucket.end], self.param_buffer[start:end],
                                       bucket.group, async_op=async_op)
            bucket.gather_handle = handle if async_op else None

    def start_packed_param_sync(self, buffers: list[torch.Tensor], async_op: bool) -> None:
        """ONE all-gather per bucket for several flat buffers laid out like `param_buffer` (the live
        weights and predicted ones, asynchronous pipelines): this rank's owned ranges of all of them go
        out packed in one message, and waiting (`_wait_gather`, the forward pre-hooks) unpacks each
        rank's pieces into every buffer. One buffer: gathered in place, as `start_param_sync`."""
        self.finish_param_sync()
        if not self.reduces or not buffers:
            return
        for bucket in reversed(self.buckets):
            if bucket.size == 1:
                continue
            start, end = self.owned_range(bucket)
            if len(buffers) == 1:
                buf = buffers[0]
                handle = all_gather_single(buf[bucket.start:bucket.end], buf[start:end], bucket.group, async_op)
                bucket.gather_handle = handle if async_op else None
                continue
            packed = torch.cat([b[start:end] for b in buffers])
            out = torch.empty(packed.numel() * bucket.size, dtype=packed.dtype, device=packed.device)
            handle = all_gather_single(out, packed, bucket.group, async_op)
            bucket.gather_handle = _PackedGather(handle, out, buffers, bucket, bucket.size)
            if not async_op:
                self._wait_gather(bucket)

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before reading the weights outside a forward)."""
        for bucket in self.buckets:
            self._wait_gather(bucket)

    @staticmethod
    def _wait_gather(bucket: Bucket) -> None:
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None

    def _wait_for_own_params(self, module, _args) -> None:
        for p in module.parameters(recurse=False):
            bucket = self._bucket_of.get(id(p))
            if bucket is not None:
                self._wait_gather(bucket)

    def _wait_for_params_read_outside_forward(self, _module, _args) -> None:
        """Parameters read outside their module's forward (the chunked output loss reads the output layer's
        weight, tensor_parallel/output_cross_entropy.py): their module's pre-hook never runs, so the chunk's waits."""
        for p in self.params:
            if getattr(p, "read_outside_forward", False):
                self._wait_gather(self._bucket_of[id(p)])

    def _register_forward_pre_hooks(self) -> None:
        for chunk in self.chunks:
            chunk.register_forward_pre_hook(_weak_hook(self._wait_for_params_read_outside_forward))
            for module in chunk.modules():
                if any(True for _ in module.parameters(recurse=False)):
                    module.register_forward_pre_hook(_weak_hook(self._wait_for_own_params))


def _weak_hook(method):
    """The bound `method` as a hook that does not keep its object alive. A hook on a parameter (or module)
    that holds the DDP holding that parameter is a reference cycle; through a parameter's post-accumulate-
    grad hook it runs through torch's C++ hook list, which the garbage collector cannot see, so the DDP,
    its buffers and the model would never be freed (module hooks: only by a collection)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return hook


class _PackedGather:
    """A pending packed all-gather: `wait()` waits, then copies every rank's piece of every buffer home."""

    def __init__(self, handle, out: torch.Tensor, buffers: list[torch.Tensor], bucket: Bucket, dp_size: int):
        self.handle, self.out, self.buffers, self.bucket, self.dp_size = handle, out, buffers, bucket, dp_size

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        pieces = self.out.view(self.dp_size, len(self.buffers), -1)
        for i, buf in enumerate(self.buffers):
            buf[self.bucket.start:self.bucket.end].view(self.dp_size, -1).copy_(pieces[:, i])


def allreduce_sequence_parallel_grads(params) -> None:
    """Norm weights (and other replicated params) under sequence parallelism see a slice of the tokens
    on each TP rank: sum their gradients over the TP group."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [grad_of(p) for p in params if getattr(p, "sequence_parallel", False) and grad_of(p) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_embedding_grads(params) -> None:
    """The word embedding's copy on the last virtual stage (`embedding_copy`: tied input/output embeddings, or
    the multi-token prediction block's, models/mtp.py). Summing the two gradients keeps both copies equal after
    every step (synchronous methods only). The copies may sit on one rank (one stage, several chunks; ZB-V's
    rank 0, which holds the first and the last virtual stage: summed there) or on the first and last pipeline
    ranks (summed over the embedding group)."""
    shared = [p for p in params if getattr(p, "shared_embedding", False) and grad_of(p) is not None]
    copies = sum(bool(getattr(p, "embedding_copy", False)) for p in shared)
    if not shared or (copies == 0 and ps.get_pipeline_model_parallel_world_size() == 1):
        return
    total = grad_of(shared[0]).clone()
    for p in shared[1:]:
        total += grad_of(p)
    if ps.get_pipeline_model_parallel_world_size() > 1 and copies in (0, len(shared)):  # the other end is there
        dist.all_reduce(total, group=ps.get_embedding_group())
    for p in shared:
        grad_of(p).copy_(total)
