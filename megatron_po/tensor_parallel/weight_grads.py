"""Deferred weight gradients: the B/W split of zero-bubble pipelining for linear layers.

A zero-bubble schedule runs a micro-batch's backward in two ops (pipeline/zero_bubble.py): B, the
gradient w.r.t. the stage input, which the previous stage waits for, and W, the weight gradients, which
nobody waits for. The executor runs B as an ordinary autograd backward inside `defer_weight_grads()`:
there, `layers._Linear` computes only its input gradient and queues a closure for its weight (and bias)
gradient, with the saved input and output gradient it needs: no forward and no autograd graph is re-run
at W. Every other parameter (norms, embeddings, anything built from torch ops) gets its gradient during
B as usual: those are cheap, the matmul weight gradients are the W work.

`apply_weight_grads(queue)` (the W op) runs the closures and accumulates each weight's gradient through
autograd (`torch.autograd.backward` on the leaf), so it lands in `.grad` (the DDP buffer) exactly as a
fused backward's would and the DDP post-accumulate hooks fire: once per parameter per W (contributions
of a weight used twice are summed first), so a bucket's reduction starts after its chunk's last W.

A global, not a thread-local: autograd runs CUDA backward on its own device threads.
"""

from __future__ import annotations

import contextlib

import torch

_queue: list | None = None


@contextlib.contextmanager
def defer_weight_grads():
    """Within the block, `_Linear` backwards queue their weight gradients; yields the queue."""
    global _queue
    previous, _queue = _queue, []
    try:
        yield _queue
    finally:
        _queue = previous


def deferring() -> bool:
    return _queue is not None


def defer(closure) -> None:
    """Queue `closure() -> [(parameter, gradient), ...]` for the W op."""
    _queue.append(closure)


def apply_weight_grads(queue: list) -> None:
    """Run the queued weight-gradient closures and accumulate into the parameters' `.grad`."""
    params: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    for closure in queue:
        for p, g in closure():
            if id(p) in grads:
                grads[id(p)] = grads[id(p)] + g
            else:
                params[id(p)], grads[id(p)] = p, g
    queue.clear()
    if params:
        torch.autograd.backward(list(params.values()), list(grads.values()))
