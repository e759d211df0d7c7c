"""Error-feedback correction of delayed updates (`--async-error-feedback`), optimizer-agnostic.

Zmushko et al. (2026, "One-step gradient delay is not a barrier ...") correct PipeDream-2BW's one-step
delay at the level of updates: with u_t the update the optimizer computes at step t (from a gradient taken
one step earlier),

    x_{t+1} = x_t − u_t − (u_t − u_{t−1}) = x_t − 2·u_t + u_{t−1}

(their x_{t+1} = x_t − 2·u_{t−1} + u_{t−2}, indexed by the gradient's step). The difference of the last two
updates is the error the delay made: the update that should have been applied one step ago is known now.
Nothing about the optimizer is used: u_t is read off the weights, as the displacement `W_before − W_after`
of the optimizer's own step (decoupled weight decay, clipping and the lr schedule included), and the
correction is applied to the weights after it. State: u_{t−1}, one parameter-sized tensor per parameter,
plus one reused parameter-sized scratch for the step being taken.

The s-step generalisation is OURS (the paper defines and analyses s = 1 only): for a gradient that is s
steps stale (the no-flush stream: s = s(j) from the schedule, D − r − 1 in the straight pipeline), the
correction is scaled by s,

    x_{t+1} = x_t − u_t − s·(u_t − u_{t−1}),

the linear extrapolation of the update sequence over the s steps the gradient missed (u_{t+s} ≈ u_t +
s·(u_t − u_{t−1})). s = 1 is the paper's rule, s = 0 leaves the step untouched (synchronous training is
reproduced bit for bit). With k > 1 micro-batches per step s is the mean over the step's micro-batches.
The delay of each step comes from the weight policy (`AsyncPolicy.gradient_delay`), never from D − r − 1:
PipeDream-2BW's is 1 (0 at its first step, whose gradient is at W(0) itself), every other method's the
schedule's s(j). Before the first recorded update there is nothing to difference: that step is left as is.

fp32 model weights only: with --bf16/--fp16 or the distributed optimizer the optimizer steps the fp32 main
params (or a shard of them) and the displacement read off the model weights would be rounded; those
combinations are refused by the config rules.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Per chunk: `begin(c)` before the optimizer step, `end(c, delay)` after it (see the module docstring)."""

    def __init__(self, params: list[list[torch.Tensor]]):
        self.params = params  # per chunk, the chunk's parameters
        self.last: list[list[torch.Tensor] | None] = [None] * len(params)  # u_{t-1} per chunk
        self._scratch: list[list[torch.Tensor] | None] = [None] * len(params)

    @torch.no_grad()
    def begin(self, chunk: int) -> None:
        """Remember the weights the optimizer step is about to move."""
        live = [p.data for p in self.params[chunk]]
        if self._scratch[chunk] is None:
            self._scratch[chunk] = [w.clone() for w in live]
        else:
            torch._foreach_copy_(self._scratch[chunk], live)

    @torch.no_grad()
    def end(self, chunk: int, delay: float) -> None:
        """u_t = W_before − W_after; W_after ← W_after − delay·(u_t − u_{t−1}); keep u_t."""
        live = [p.data for p in self.params[chunk]]
        update = self._scratch[chunk]
        torch._foreach_sub_(update, live)  # u_t
        last = self.last[chunk]
        if last is not None and delay != 0:
            correction = torch._foreach_sub(update, last)
            torch._foreach_add_(live, correction, alpha=-float(delay))
        # u_t becomes u_{t-1}; the old u_{t-1}'s storage is the next step's scratch
        self.last[chunk], self._scratch[chunk] = update, last

    def copies(self, chunk: int) -> int:
        """Parameter-sized buffers held for the chunk: u_{t−1} and the step's scratch."""
        return (self.last[chunk] is not None) + (self._scratch[chunk] is not None)

    def state_dict(self) -> dict:
        """{param: {"ef_update": u_{t−1}}} for the chunks that have one (checkpointed with the policy)."""
        return {p: {"ef_update": u} for params, last in zip(self.params, self.last) if last is not None
                for p, u in zip(params, last)}

    def load_targets(self, keys: dict) -> dict:
        """{param: {"ef_update": tensor}}: the u_{t−1} tensors that a checkpoint holding the entries `keys`
        ({param: names}) loads into in place, created (like the live weights, as a step creates them)
        for a chunk that has none yet."""
        out = {}
        for c, params in enumerate(self.params):
            if params and all("ef_update" in keys.get(p, ()) for p in params):
                if self.last[c] is None:
                    self.last[c] = [p.data.clone() for p in params]
                for p, u in zip(params, self.last[c]):
                    out.setdefault(p, {})["ef_update"] = u
        return out

    @torch.no_grad()
    def load_state_dict(self, weights: dict) -> None:
        """u_{t−1} copied into the tensors held (`load_targets`: the same objects when a checkpoint load
        filled them already)."""
        targets = self.load_targets({p: tuple(w) for p, w in weights.items()})
        for c, params in enumerate(self.params):
            if params and all(p in targets for p in params):
                for p, u in zip(params, self.last[c]):
                    if weights[p]["ef_update"] is not u:
                        u.copy_(weights[p]["ef_update"])
            else:  # saved without error feedback: no previous update, the first step is left as is
                self.last[c] = None
