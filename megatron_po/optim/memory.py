"""Memory accounting of the training state: bytes per parameter per rank, measured from the objects.

`measure_training_memory(model_params, ddp, optimizer)` walks the real tensors (model weights, the DDP
gradient buffer, the fp32 main params and the optimizer state) and adds up the sizes of their
*storages*, each storage once: views into one flat buffer count as the buffer, padding included, and a
tensor that is both a weight and a main param (plain fp32 training) is not counted twice. Dividing by
the number of model parameters gives Megatron's "bytes per parameter" table, e.g. bf16 params + fp32
grads + Adam: 18 without the distributed optimizer, 6 + 12/DP with it.

`track_new_tensor_bytes()` measures, for a block of code, the peak number of bytes held by tensors the
block allocates (freed ones are subtracted when their storage dies): used to show that PipeOptim's
predict + restore makes no full-size copy of the weights.
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
