"""The weights an activation recomputation sees under the asynchronous methods.

Recomputation (models/recompute.py) reruns parts of micro-batch j's forward F(j) inside its backward
B(j). To give the same activations, and so the same gradients, as a run without it, the rerun must see
the weights F(j) ran on: PipeOptim's and SpecTrain's prediction Ŵ, PipeDream's and 2BW's version, the
naive method's live weights of then. Where B(j) itself runs on those weights (PipeDream, 2BW: they swap
the version back in; any method when the chunk took no step between F(j) and B(j) and does not predict),
nothing is done. Elsewhere the weights of each recomputed region are copied at its forward and swapped
in, in place, only around its recomputation: the rest of the backward (the input gradients, which read
the parameters at backward time) runs on B(j)'s weights exactly as without recomputation. The copy is
freed right after the recomputation; `copies()` counts it (in whole chunk copies, rounded up).

The policy hands the executor a provider per forward (`weights_for_recompute`); the executor installs it
with `tensor_parallel.recompute_weights` without knowing which method runs.
"""

from __future__ import annotations

import contextlib

import torch


class RecomputeWeights:
    """Mixin of the asynchronous weight policies (pipeline/policies.py). Needs `self.params` (per chunk),
    `self.staleness` (chunk -> mb -> s(j)) and `self._note_copies(chunk)`."""

    _recompute_kept: dict[int, int] | None = None  # chunk -> elements of forward weights kept right now

    def _kept_numel(self) -> dict[int, int]:
        if self._recompute_kept is None:
            self._recompute_kept = {}
        return self._recompute_kept

    def _backward_sees_forward_weights(self, mb: int, chunk: int) -> bool:
        """Whether B(mb) runs on exactly the weights F(mb) ran on; asked right after before_forward(mb,
        chunk). Here (live weights at both passes): when the chunk took no step in between. Policies that
        predict or swap versions override it (a new policy must, if its passes see other weights)."""
        return self.staleness[chunk][mb] == 0

    def weights_for_recompute(self, mb: int, chunk: int):
        if self._backward_sees_forward_weights(mb, chunk):
            return None
        return lambda params: self._keep_for_recompute(chunk, params)

    def _keep_for_recompute(self, chunk: int, params: list[torch.Tensor]):
        """Copy a region's weights now (its forward); return what installs them around its recomputation."""
        with torch.no_grad():
            kept = [p.data.clone() for p in params]
        numel = sum(t.numel() for t in kept)
        kept_numel = self._kept_numel()
        kept_numel[chunk] = kept_numel.get(chunk, 0) + numel
        self._note_copies(chunk)

        @contextlib.contextmanager
        def installed():
            if not kept:
                raise RuntimeError("a recomputed region's forward weights were already used")
            _exchange(params, kept)
            try:
                yield
            finally:
                _exchange(params, kept)  # B(j)'s weights back in place
                kept.clear()
                kept_numel[chunk] -= numel
        return installed

    def _recompute_copies(self, chunk: int) -> int:
        """Forward weights kept for recomputation right now, in whole copies of the chunk (rounded up)."""
        kept = self._kept_numel().get(chunk, 0)
        total = sum(p.numel() for p in self.params[chunk])
        return -(-kept // total) if total else 0


@torch.no_grad()
def _exchange(params: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    """Swap the parameters' values with `other` in place through `.data` (autograd's version counters
    untouched, so the graphs of micro-batches in flight stay valid), one parameter-sized scratch at a time."""
    for p, o in zip(params, other):
        scratch = p.data.clone()
        p.data.copy_(o)
        o.copy_(scratch)
