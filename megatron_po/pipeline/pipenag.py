"""PipeNAG (`--pipeline-method pipenag`): the Nesterov method for asynchronous pipelines of Ajanthan et al.
(ICML 2025), as a weight policy paired with `--optimizer nag` (optim/nag.py).

The paper's rule (its Eq. 10), per stage, γ the momentum, τ the gradient's delay:

    d_t = γ·(w_t − w_{t−1});   w_{t+1} = w_t + d_t − η·(1−γ)·∇f(w_{t−τ} + d_{t−τ})

The look-ahead is modified for the delay in two ways: the stale gradient is taken at the look-ahead point
of the weights it was computed from (w̄ + d̄, not w̄), and it is discounted by (1−γ), so that with γ → 1 the
momentum carries the weights along their drift during the delay and the stale gradient only nudges it.
In our stream: F(j) runs on the look-ahead point of the live weights, w_v + γ(w_v − w_{v−1}) (v = the chunk's
step count at F(j)), that point is kept for B(j) (weight stashing of look-ahead points), and the step
applies w ← w − η·b with b ← γb + (1−γ)g (the NAG optimizer in its explicit-look-ahead form, whose
`predicted(γ)` is exactly w + d). τ is s(j), read from the schedule: B(j) asserts that the point it swaps
in is the one of step `steps − s(j)`, so the straight and the interleaved streams (and k > 1) need nothing
else. Memory: the live weights plus one look-ahead point per version still in flight (s_max + 1 of them,
where PipeDream keeps s_max stashed versions besides the live one): s_max + 2 copies.

This is the paper's method as written. The configuration its reference code (AsyncPP) actually runs is
PipeDream's weight stashing with torch's NAdam (decoupled decay, β1 = 0.99), where NAdam's own Nesterov
form supplies the look-ahead: `--pipeline-method pipedream --optimizer nadamw --adam-beta1 0.99`
(docs/delay_robust.md, "the recipe").
"""

from __future__ import annotations

import torch

from megatron_po.errors import ConfigError
from megatron_po.optim.fsdp_optimizer import FSDPOptimizer
from megatron_po.optim.nag import NAG
from megatron_po.pipeline.async_policy import AsyncPolicy, _swap
from megatron_po.pipeline.policies import POLICIES


class PipeNAGPolicy(AsyncPolicy):
    """Forward and backward of micro-batch j on the look-ahead point of the weights live at F(j)."""

    def __init__(self, rank, chunks, optimizers, schedule=None, **options):
        # FSDP2: the NAG steps the chunk's shards themselves (optim/fsdp_optimizer.py), the points are of shards
        self.nags = [opt.optimizer if isinstance(opt, FSDPOptimizer) else opt for opt in optimizers]
        for opt in self.nags:
            if not isinstance(opt, NAG):
                raise ConfigError("--pipeline-method pipenag runs the paper's Nesterov step: it needs --optimizer nag "
                                  f"with fp32 weights and no distributed optimizer (got {type(opt).__name__})")
            for group in opt.param_groups:
                group["explicit_lookahead"] = True  # the policy supplies the look-ahead; the step is w − η·b
        self.gammas = [opt.param_groups[0]["momentum"] for opt in self.nags]
        self.version_of: dict[tuple[int, int], int] = {}  # (mb, chunk) in flight -> step count at F(j)
        self.points: list[dict[int, list[torch.Tensor]]] = [{} for _ in chunks]  # chunk -> version -> w + d
        super().__init__(rank, chunks, optimizers, schedule, **options)

    def copies(self, chunk):
        return 1 + len(self.points[chunk]) + self._recompute_copies(chunk)

    def _backward_sees_forward_weights(self, mb, chunk):
        return True  # B(j) swaps in the point F(j) ran on

    @torch.no_grad()
    def _lookahead(self, chunk: int) -> list[torch.Tensor]:
        """w + γ(w − w_prev) = w − γ·η·b (NAG's `predicted(γ)`); w itself before the first step (d_0 = 0)."""
        point = dict(self.nags[chunk].predicted(self.gammas[chunk]))
        return [point[p] if p in point else p.data.clone() for p in self.params[chunk]]

    def _in_flight(self, chunk: int) -> set[int]:
        return {v for (_, c), v in self.version_of.items() if c == chunk}

    def _free(self, chunk: int) -> None:
        """Drop the points no micro-batch in flight uses and no later forward can (older versions)."""
        keep = self._in_flight(chunk) | {self.steps[chunk]}
        for v in [v for v in self.points[chunk] if v not in keep]:
            del self.points[chunk][v]

    def before_forward(self, mb, chunk):
        v = self.steps[chunk]
        self.version_of[(mb, chunk)] = v
        if v not in self.points[chunk]:
            self.points[chunk][v] = self._lookahead(chunk)
            self._note_copies(chunk)
        _swap(self.params[chunk], self.points[chunk][v])  # the parameters hold w + d, the slot holds w

    def after_forward(self, mb, chunk):
        _swap(self.params[chunk], self.points[chunk][self.version_of[(mb, chunk)]])

    def before_backward(self, mb, chunk):
        v = self.version_of[(mb, chunk)]
        assert v == self.steps[chunk] - self.staleness[chunk][mb], "look-ahead point is not s(j) steps old"
        _swap(self.params[chunk], self.points[chunk][v])

    def after_backward(self, mb, chunk):
        _swap(self.params[chunk], self.points[chunk][self.version_of.pop((mb, chunk))])
        self._free(chunk)

    def after_step(self, chunk):
        super().after_step(chunk)
        self._free(chunk)

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.points = [{} for _ in self.chunks]  # recomputed from the live weights and the loaded buffer


POLICIES["pipenag"] = PipeNAGPolicy  # registered here: policies.py sits below this module
