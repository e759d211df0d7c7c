"""Data-parallel gradient reduction over a contiguous, bucketed gradient buffer.

Every parameter's `.grad` is a view into one flat buffer, so autograd accumulates micro-batch gradients
in place and a bucket is a contiguous slice that one all-reduce handles. Buckets hold parameters in
reverse registration order, roughly the order backward produces their gradients; as soon as every
parameter of a bucket has its final gradient for this step, the bucket's all-reduce starts
asynchronously and overlaps the rest of the backward pass. `no_sync()` suppresses that during the
first micro-batches of a step (gradient accumulation); `finish_grad_sync()` launches what is left and
waits. Gradients are pre-scaled by 1/DP, so the reduced buffer holds the mean over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_po import parallel_state as ps


@dataclass
class Bucket:
    start: int
    end: int
    params: list = field(default_factory=list)
    num_ready: int = 0
    handle: object = None


class DistributedDataParallel:
    def __init__(self, chunks: list[nn.Module], dp_group=None, bucket_size: int = 40_000_000,
                 grad_dtype: torch.dtype = torch.float32):
        self.chunks = chunks
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        seen, params = set(), []
        for chunk in chunks:
            for p in chunk.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.params = params
        device = params[0].device if params else torch.device("cpu")
        total = sum(p.numel() for p in params)
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)

        # Lay parameters out in reverse order, cutting a new bucket when one exceeds bucket_size.
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        offset, bucket = 0, None
        for p in reversed(params):
            if bucket is None or offset - bucket.start >= bucket_size:
                bucket = Bucket(start=offset, end=offset)
                self.buckets.append(bucket)
            n = p.numel()
            p.grad = self.grad_buffer[offset:offset + n].view_as(p)
            bucket.params.append(p)
            bucket.end = offset + n
            self._bucket_of[id(p)] = bucket
            offset += n
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sync_enabled = True

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
        if not self.sync_enabled or self.dp_size == 1:
            return
        bucket = self._bucket_of[id(p)]
        bucket.num_ready += 1
        if bucket.num_ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            return
        view = self.grad_buffer[bucket.start:bucket.end]
        view.div_(self.dp_size)
        bucket.handle = dist.all_reduce(view, group=self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch the buckets that backward did not complete (unused params), in order, then wait."""
        if self.dp_size > 1:
            for bucket in self.buckets:
                self._launch(bucket)
            for bucket in self.buckets:
                bucket.handle.wait()
        for bucket in self.buckets:
            bucket.handle, bucket.num_ready = None, 0

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.handle, bucket.num_ready = None, 0


def allreduce_sequence_parallel_grads(params) -> None:
    """Norm weights (and other replicated params) under sequence parallelism see a slice of the tokens
    on each TP rank: sum their gradients over the TP group."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_embedding_grads(params) -> None:
    """Tied input/output embeddings split across virtual stages: the last one holds a copy of the word
    embedding (`embedding_copy`). Summing the two gradients keeps both copies equal after every step
    (synchronous methods only). The copies may sit on one rank (one stage, several chunks) or on the
    first and last pipeline ranks (the embedding group)."""
    shared = [p for p in params if getattr(p, "shared_embedding", False) and p.grad is not None]
    if not shared or not any(getattr(p, "embedding_copy", False) for p in shared) \
            and ps.get_pipeline_model_parallel_world_size() == 1:
        return
    total = shared[0].grad.clone()
    for p in shared[1:]:
        total += p.grad
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_embedding_group())
    for p in shared:
        p.grad.copy_(total)
