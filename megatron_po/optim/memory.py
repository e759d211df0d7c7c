"""Memory accounting of the training state: bytes per parameter per rank, measured from the objects.

`measure_training_memory(model_params, ddp, optimizer)` walks the real tensors (model weights, the DDP
gradient buffer, the fp32 main params and the optimizer state) and adds up the sizes of their
*storages*, each storage once: views into one flat buffer count as the buffer, padding included, and a
tensor that is both a weight and a main param (plain fp32 training) is not counted twice. Dividing by
the number of model parameters gives Megatron's "bytes per parameter" table, e.g. bf16 params + fp32
grads + Adam: 18 without the distributed optimizer, 6 + 12/DP with it.

`track_new_tensor_bytes()` measures, for a block of code, the peak number of bytes held by tensors the
block allocates (freed ones are subtracted when their storage dies): used to show that PipeOptim's
predict + restore makes no full-size copy of the weights, and for the whole-run peaks of the
asynchronous methods (bench/memory/memory.py --async). `count_bytes_moved()` counts the bytes a block's tensor
ops read and write (the optimizer step's and the prediction's memory traffic, bench/step/fused_step.py).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MEGATRON_BYTES_PER_PARAM = {
    # Megatron-LM docs, distributed optimizer: (non-distributed, distributed as a function of DP size)
    "fp16 params, fp16 grads": (20, lambda dp: 4 + 16 / dp),
    "bf16 params, fp32 grads": (18, lambda dp: 6 + 12 / dp),
    "fp32 params, fp32 grads": (16, lambda dp: 8 + 8 / dp),
}


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


@dataclass
class MemoryBreakdown:
    num_params: int  # model parameters held by this rank (one replica's share, padding excluded)
    param_bytes: int
    grad_bytes: int
    main_param_bytes: int
    optimizer_state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.main_param_bytes + self.optimizer_state_bytes

    def per_param(self) -> dict[str, float]:
        n = max(self.num_params, 1)
        return {"params": self.param_bytes / n, "grads": self.grad_bytes / n, "main_params": self.main_param_bytes / n,
                "optimizer_state": self.optimizer_state_bytes / n, "total": self.total_bytes / n}


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def measure_training_memory(model_params, ddp=None, optimizer=None) -> MemoryBreakdown:
    """Storage bytes of this rank's weights, gradients, main params and optimizer state."""
    model_params = list(model_params)
    seen: set = set()

    def add(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t) or t.numel() == 0:
                continue
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += nbytes
        return total

    params = add(model_params)
    grads = [ddp.grad_buffer] if ddp is not None else []
    grads += [p.grad for p in model_params] + [getattr(p, "main_grad", None) for p in model_params]
    grad_bytes = add(grads)
    main = []
    if optimizer is not None and hasattr(optimizer, "main_shards"):
        main = optimizer.main_shards
    elif optimizer is not None and hasattr(optimizer, "main_params"):
        main = optimizer.main_params
    main_bytes = add(main)
    state = []
    if optimizer is not None:
        for st in _inner_optimizer(optimizer).state.values():
            state += [v for v in st.values() if torch.is_tensor(v)]
    state_bytes = add(state)
    return MemoryBreakdown(sum(p.numel() for p in model_params), params, grad_bytes, main_bytes, state_bytes)


class _NewTensorTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops under this mode, minus those already freed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set = set()

    def _freed(self, key, nbytes):
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if torch.is_tensor(t) and t.numel() > 0}
        for t in tree_flatten(out)[0]:
            if not torch.is_tensor(t) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._tracked:
                continue  # in place, a view, or already counted
            self._tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


@contextlib.contextmanager
def track_new_tensor_bytes():
    """`with track_new_tensor_bytes() as t: ...` then `t.peak` (most bytes alive at once among tensors
    allocated inside the block) and `t.live` (bytes still alive at the end)."""
    tracker = _NewTensorTracker()
    with tracker:
        yield tracker


class _BytesMoved(TorchDispatchMode):
    """Bytes every op reads (its tensor arguments) and writes (its new outputs and the arguments it
    mutates), views and metadata ops excluded: the memory traffic of eager code, op by op."""

    def __init__(self):
        super().__init__()
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in _FREE_OPS:
            return out
        schema = func._schema
        mutated = {arg.name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            nbytes = sum(_nbytes(t) for t in tree_flatten(value)[0])
            if arg.name in mutated:
                self.written += nbytes
                if func.overloadpacket in _OVERWRITING_OPS:
                    continue  # the old values are not read
            self.read += nbytes
        if not any(r.alias_info is not None for r in schema.returns):
            self.written += sum(_nbytes(t) for t in tree_flatten(out)[0])
        return out


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


_FREE_OPS = {torch.ops.aten.detach, torch.ops.aten.empty_like, torch.ops.aten.empty, torch.ops.aten.empty_strided,
             torch.ops.aten._local_scalar_dense, torch.ops.aten.set_, torch.ops.aten.lift_fresh}


_OVERWRITING_OPS = {torch.ops.aten.copy_, torch.ops.aten._foreach_copy_, torch.ops.aten.zero_,
                    torch.ops.aten._foreach_zero_, torch.ops.aten.fill_}


@contextlib.contextmanager
def count_bytes_moved():
    """`with count_bytes_moved() as c: ...` then `c.read`, `c.written`: the bytes the block's tensor ops
    read and write (eager execution; an op that writes a fresh tensor of the same size counts it once
    as written, `empty_like` and friends nothing). For the optimizer step and PipeOptim's prediction:
    bytes per parameter and micro-batch (bench/step/fused_step.py)."""
    counter = _BytesMoved()
    with counter:
        yield counter
