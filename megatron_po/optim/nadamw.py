"""NAdamW: torch.optim.NAdam with decoupled weight decay, as a predictive optimizer (`--optimizer nadamw`).

The rule is torch's (`torch.optim.NAdam(..., decoupled_weight_decay=True)`, foreach path, op for op), per
parameter at its step count t, with ψ = `momentum_decay`:

    W ← W(1 − lr·λ)                                   (decoupled decay)
    μ_t = β1(1 − ½·0.96^(tψ)),  μ_{t+1} likewise,  Π_t = Π_{t−1}·μ_t  (the state's `mu_product`)
    m ← β1·m + (1−β1)·g;   v ← β2·v + (1−β2)·g²;   den = √v/√(1−β2^t) + ε
    W ← W − lr·(1−μ_t)/(1−Π_t)·g/den − lr·μ_{t+1}/(1−Π_t·μ_{t+1})·m/den

This is the optimizer the PipeNAG reference code (AsyncPP, `optim/nadamw.py`) runs, at β1 = 0.99, on top of
weight stashing: its first term is Nesterov's look-ahead along the momentum and its second the (1−μ_t)-
discounted current (stale) gradient, the delay-robust Nesterov rule of Ajanthan et al. (ICML 2025) in Adam's
clothes (docs/delay_robust.md).

ΔW (`update_direction`, PipeOptim's prediction) is what the last step subtracted, divided by lr and without
the decay: `(c_g·g_t + c_m·m_t)/den` with c_g = (1−μ_t)/(1−Π_t), c_m = μ_{t+1}/(1−Π_t·μ_{t+1}). m_t alone does
not give g_t, so the last gradient is kept as extra state `last_grad` (one parameter-sized tensor, as SGD
Nesterov and RMSprop without momentum do). Pitfall kept from torch: with ψ = 0.004, μ_t is only ≈ 0.57·β1/0.99
after 1,000 steps and reaches ≈ β1 after ~50,000 (`--nadam-momentum-decay` scales ψ to a run's length).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_po.optim.fused_prediction import _addcdiv, _per_step
from megatron_po.optim.optimizers import (PredictiveOptimizer, _check_betas, _check_non_negative, _Direction,
                                          _increment_steps, _remember, _step_value)


class NAdamW(PredictiveOptimizer):
    """torch.optim.NAdam(decoupled_weight_decay=True) (no maximize/capturable); see the module docstring."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, momentum_decay: float = 4e-3):
        _check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
        _check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay))

    @staticmethod
    def _mus(group: dict, step: float) -> tuple[float, float]:
        """(μ_t, μ_{t+1}) at step count t, with torch's float expressions."""
        beta1, psi = group["betas"][0], group["momentum_decay"]
        return (beta1 * (1.0 - 0.5 * (0.96 ** (step * psi))), beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * psi))))

    def init_state(self, group, param, state):
        state["step"] = torch.tensor(0.0)
        state["mu_product"] = torch.tensor(1.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["last_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        mu_products = [s["mu_product"] for s in states]
        _increment_steps(states)
        if weight_decay != 0:
            torch._foreach_mul_(params, _per_step(1 - lr * weight_decay))
        _remember(states, "last_grad", grads)

        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        den = torch._foreach_sqrt(exp_avg_sqs)
        steps = [_step_value(s["step"]) for s in states]
        mus, mu_nexts = zip(*(self._mus(group, t) for t in steps))
        torch._foreach_mul_(mu_products, list(mus))
        torch._foreach_div_(den, [(1 - beta2 ** t) ** 0.5 for t in steps])
        torch._foreach_add_(den, eps)
        step_grads = [(lr * (1.0 - mu) / (1.0 - _step_value(mp))) * -1 for mp, mu in zip(mu_products, mus)]
        step_avgs = [(lr * mn / (1.0 - _step_value(mp) * mn)) * -1 for mp, mn in zip(mu_products, mu_nexts)]
        _addcdiv(params, grads, den, step_grads)
        _addcdiv(params, exp_avgs, den, step_avgs)
        return _Direction(self._numerators(group, states), den)

    def _numerators(self, group: dict, states: list[dict]) -> list[torch.Tensor]:
        """c_g·g_t + c_m·m_t of each parameter's last step (ΔW's numerator; den is the denominator)."""
        c_g, c_m = [], []
        for s in states:
            mu, mu_next = self._mus(group, _step_value(s["step"]))
            mp = _step_value(s["mu_product"])
            c_g.append((1.0 - mu) / (1.0 - mp))
            c_m.append(mu_next / (1.0 - mp * mu_next))
        numerators = torch._foreach_mul([s["last_grad"] for s in states], c_g)
        torch._foreach_add_(numerators, torch._foreach_mul([s["exp_avg"] for s in states], c_m))
        return numerators

    def _direction(self, group, params, states):
        beta2 = group["betas"][1]
        den = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_div_(den, [(1 - beta2 ** _step_value(s["step"])) ** 0.5 for s in states])
        torch._foreach_add_(den, group["eps"])
        return _Direction(self._numerators(group, states), den)


