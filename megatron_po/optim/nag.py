"""NAG: the Nesterov method of Ajanthan et al. (ICML 2025, "PipeNAG") as a predictive optimizer (`--optimizer nag`).

The paper's delayed Nesterov step (its Eq. 10, γ = `--sgd-momentum`, η = lr, τ = the gradient's delay):

    d_t = γ·(w_t − w_{t−1});   w_{t+1} = w_t + d_t − η·(1−γ)·∇f(w̄_t + d̄_t),   w̄_t = w_{t−τ}, d̄_t = d_{t−τ}

i.e. the gradient is taken at the look-ahead point w + d and discounted by (1−γ). Written with a momentum
buffer b (torch's convention, the lr scaling the whole step), b_t = γ·b_{t−1} + (1−γ)·g_t and
w_{t+1} = w_t − η·b_t, so d_t = −γ·η·b_{t−1}: momentum SGD with dampening 1−γ. The buffer starts at 0, as
in the paper (w_1 = w_0 − η(1−γ)g_0), NOT at g like torch.optim.SGD's. Under an lr schedule the look-ahead
uses the last step's lr (d_t is exactly γ times the last displacement) and a step scales the momentum
part by the current lr, as torch's momentum SGD does. L2 weight decay is folded into the gradient.

Two forms, the same method:
- `explicit_lookahead=False` (default; synchronous training, PipeOptim): the parameters hold the look-ahead
  point y_t = w_t + d_t itself, the standard reformulation of NAG, whose step is
  y_{t+1} = y_t − η·(γ·b_t + (1−γ)·g_t) with g_t at y_t (torch's Nesterov form, here dampened). That is
  Eq. 10 at τ = 0. ΔW = γ·b_t + (1−γ)·g_t; extra state `last_grad`.
- `explicit_lookahead=True` (set by the `pipenag` weight policy, pipeline/pipenag.py): the parameters hold
  w_t, a step is w_{t+1} = w_t − η·b_t, and the policy runs each micro-batch's passes on the look-ahead
  point `predicted(γ)` = w − γ·η·b = w + d. ΔW = b; no extra state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_po.optim.fused_prediction import _add_scaled
from megatron_po.optim.optimizers import PredictiveOptimizer, _check_non_negative, _Direction, _remember


class NAG(PredictiveOptimizer):
    """Dampened Nesterov momentum with a zero-initialised buffer; see the module docstring."""

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 explicit_lookahead: bool = False):
        _check_non_negative(lr=lr, weight_decay=weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum: {momentum} (must be in [0, 1))")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      explicit_lookahead=explicit_lookahead))

    def init_state(self, group, param, state):
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if not group["explicit_lookahead"]:
            state["last_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        gamma = group["momentum"]
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        buffers = [s["momentum_buffer"] for s in states]
        torch._foreach_mul_(buffers, gamma)
        torch._foreach_add_(buffers, grads, alpha=1 - gamma)
        if group["explicit_lookahead"]:
            update = buffers
        else:
            _remember(states, "last_grad", grads)
            update = torch._foreach_mul(buffers, gamma)
            torch._foreach_add_(update, grads, alpha=1 - gamma)
        _add_scaled(params, update, -group["lr"])
        return _Direction(update)

    def _direction(self, group, params, states):
        buffers = [s["momentum_buffer"] for s in states]
        if group["explicit_lookahead"]:
            return _Direction(buffers)
        if any("last_grad" not in s for s in states):
            raise RuntimeError("NAG.update_direction: the reformulated direction needs the last gradient, "
                               "stored only by steps taken with explicit_lookahead=False")
        update = torch._foreach_mul(buffers, group["momentum"])
        torch._foreach_add_(update, [s["last_grad"] for s in states], alpha=1 - group["momentum"])
        return _Direction(update)
