"""Weight predictors: how far along the optimizer's direction a predicting pipeline policy moves the weights.

PipeOptim runs the forward of a micro-batch whose backward comes `s` optimizer steps later on predicted
weights Ŵ, so that forward and backward see (nearly) the same weights. Every predictor here has the form

    Ŵ = a·W − b·ΔW        (per parameter; ΔW = the optimizer's kept update direction, `update_direction()`)

with scalars a, b computed from the optimizer's hyperparameters, its step counts, the LR schedule and s.
So each one costs the same single fused foreach pass over the weights as PipeOptim's own prediction
(plus the one `mul` of a ≠ 1 when decoupled weight decay is extrapolated), reuses the direction the step
kept (`keep_direction`), and works unchanged on mixed-precision main params and on the shards of the
distributed optimizer (a and b depend on no tensor, so every shard applies them to its own state).

Notation: t = steps the chunk has taken, e_1..e_n = the lrs of the next n = ⌈s⌉ steps it will take
(the last one weighted by the fractional part of s), λ = the group's decoupled weight decay (AdamW; used
only when weight-decay extrapolation is on, `include_weight_decay`).

| predictor (`--weight-predictor`) | b (a = 1 unless decay is extrapolated)                               |
|----------------------------------|----------------------------------------------------------------------|
| `linear` (PipeOptim, default)    | s·lr_t (the lr of the last step);             a = 1 − λ·b            |
| `lr-schedule`                    | Σ e_i (the schedule's real future lrs: warm-up, decay); a = 1 − λ·b  |
| `rollout`                        | Σ e_i·r_i·Π_{j>i}(1 − λe_j);                  a = Π_i (1 − λe_i)      |

`rollout` rolls the optimizer's own recurrences forward n steps under a stated assumption on the next
gradients (`--rollout-gradient`) and sums the exact displacements that result, bias corrections and
compounded decoupled decay included. r_i = (i-th future step's direction) / ΔW:

| optimizer                         | first-moment: next gradients = the bias-corrected first moment     | zero-mean: next gradients average 0       |
|-----------------------------------|--------------------------------------------------------------------|-------------------------------------------|
| Adam / AdamW (β1, per-param t)    | 1: m̂ and v̂ are fixed points of their recurrences (the bias-correction changes cancel exactly) | β1^i·(1−β1^t)/(1−β1^{t+i})  (v̂ kept) |
| SGD momentum u, dampening τ       | c_{t+i}/c_t, c_t = u^{t−1} + (1−τ)(1−u^{t−1})/(1−u) (buffer growth) | u^i                                       |
| plain SGD                         | 1 (the next gradients equal the last one)                          | 0                                         |

"first-moment" for Adam also takes the second moment as v̂_t (gradients drawn from the distribution the
moments estimate). Taking it as m̂² instead (a deterministic gradient) would give every future step its own
per-element denominator √(β2^i·v + (1−β2^i)·m̂²): s passes over the weights, so it is not offered. Under
a constant gradient both assumptions coincide with the truth, and the rollout reproduces s real steps
exactly (tests/test_predictors.py). SGD's step count t comes from the policy (torch's SGD keeps none).
Rollout supports Adam, AdamW and SGD (plain, or momentum with direction="buffer"); others raise ConfigError.

Horizon control (`--prediction-horizon`), applied to every predictor by scaling the lrs e_i by h(s)/s:
`full` h(s) = s; `sqrt` h(s) = √s, the stated rule "extrapolate as far as a random walk of s steps of the
current size travels": when successive steps are uncorrelated (gradient noise dominating, as with one
small micro-batch per step) the expected distance grows like √s, not s. A trust-region cap on ‖Ŵ − W‖
relative to the last step's size amounts to the same thing here, because Ŵ − W is always parallel to
the last step (ΔW): capping it at √s last steps is `sqrt`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_po.errors import ConfigError

PREDICTOR_NAMES = ("linear", "lr-schedule", "rollout")
ROLLOUT_GRADIENTS = ("first-moment", "zero-mean")
HORIZON_RULES = ("full", "sqrt")


def horizon_length(steps: float, rule: str) -> float:
    """h(s): how many steps' worth of displacement to extrapolate for a staleness of s steps."""
    if rule == "full":
        return steps
    if rule == "sqrt":
        return math.sqrt(steps)
    raise ConfigError(f"unknown prediction horizon rule {rule!r}; valid: {', '.join(HORIZON_RULES)}")


class WeightPredictor:
    """Base: a predictor computes (a, [b per parameter]) for one param group; the optimizer applies
    Ŵ = a·W − b·ΔW in its `_extrapolate` (one fused pass). One predictor per optimizer (model chunk).

    `plan(lr_fn, steps_taken)` is called by the policy before each prediction: lr_fn(i) is the base lr
    of the chunk's step i (the group's lr is that times its "lr_mult"), steps_taken the chunk's step count
    t, so the next step uses lr_fn(t). Without a plan the lr is taken as constant at the group's lr.
    """

    name = "linear"

    def __init__(self, horizon: str = "full"):
        horizon_length(1.0, horizon)  # validates the rule
        self.horizon = horizon
        self.lr_fn: Callable[[int], float] | None = None
        self.steps_taken: int | None = None

    def plan(self, lr_fn: Callable[[int], float] | None, steps_taken: int | None) -> None:
        self.lr_fn, self.steps_taken = lr_fn, steps_taken

    def future_lrs(self, group: dict, steps: float) -> list[float]:
        """e_1..e_⌈s⌉: the group's lrs of the next ⌈s⌉ steps, the last weighted by s's fractional part,
        all scaled by the horizon rule's h(s)/s."""
        n = math.ceil(steps)
        if self.lr_fn is None or self.steps_taken is None:
            lrs = [group["lr"]] * n
        else:
            mult = group.get("lr_mult", 1.0)
            lrs = [self.lr_fn(self.steps_taken + i) * mult for i in range(n)]
        weights = [min(1.0, steps - i) for i in range(n)]
        scale = horizon_length(steps, self.horizon) / steps
        return [lr * w * scale for lr, w in zip(lrs, weights)]

    def coefficients(self, optimizer, group: dict, states: list[dict], steps: float,
                     include_weight_decay: bool) -> tuple[float, list[float]]:
        """(a, [b_p]) for the group's parameters that have `states` (steps > 0)."""
        b = horizon_length(steps, self.horizon) * group["lr"]
        return _linear_decay(optimizer, group, b, include_weight_decay), [b] * len(states)


def _decay_rate(optimizer, group: dict, include_weight_decay: bool) -> float:
    """λ when decoupled weight decay is extrapolated, else 0."""
    if include_weight_decay and optimizer.decoupled_weight_decay:
        return group["weight_decay"]
    return 0.0


def _linear_decay(optimizer, group: dict, b: float, include_weight_decay: bool) -> float:
    return 1 - b * _decay_rate(optimizer, group, include_weight_decay)


class LinearPredictor(WeightPredictor):
    """PipeOptim: b = h(s)·lr_t, the last step's lr held for the whole horizon (the default)."""

    name = "linear"


class ScheduleAwarePredictor(WeightPredictor):
    """b = Σ e_i: the LR schedule's actual lrs of the next s steps (warm-up and decay are known in advance)
    instead of s times the current one; same direction ΔW."""

    name = "lr-schedule"

    def coefficients(self, optimizer, group, states, steps, include_weight_decay):
        b = sum(self.future_lrs(group, steps))
        return _linear_decay(optimizer, group, b, include_weight_decay), [b] * len(states)


class RolloutPredictor(WeightPredictor):
    """Roll the optimizer's recurrences s steps forward under `gradient` (see the module docstring) and
    sum the exact displacements, bias corrections and compounded decoupled decay included."""

    name = "rollout"

    def __init__(self, horizon: str = "full", gradient: str = "first-moment"):
        if gradient not in ROLLOUT_GRADIENTS:
            raise ConfigError(f"unknown rollout gradient assumption {gradient!r}; valid: {', '.join(ROLLOUT_GRADIENTS)}")
        super().__init__(horizon)
        self.gradient = gradient

    def coefficients(self, optimizer, group, states, steps, include_weight_decay):
        lrs = self.future_lrs(group, steps)
        lam = _decay_rate(optimizer, group, include_weight_decay)
        # keep[i] = Π_{j>i}(1 − λ e_j): how much of step i's displacement survives the later decays.
        keep, after = [0.0] * len(lrs), 1.0
        for i in reversed(range(len(lrs))):
            keep[i] = after
            after *= 1 - lam * lrs[i]
        by_count: dict[float, float] = {}
        out = []
        for state in states:
            t = self._step_count(state)
            if t not in by_count:
                ratios = rollout_ratios(optimizer, group, t, len(lrs), self.gradient)
                by_count[t] = sum(e * r * k for e, r, k in zip(lrs, ratios, keep))
            out.append(by_count[t])
        return after, out

    def _step_count(self, state: dict) -> float | None:
        if "step" in state:
            return state["step"].item()
        return None if self.steps_taken is None else float(self.steps_taken)


def check_rollout_supported(optimizer) -> None:
    """ConfigError unless `rollout_ratios` knows the optimizer's recurrence."""
    from megatron_po.optim.optimizers import SGD, Adam
    if isinstance(optimizer, Adam):
        return
    if isinstance(optimizer, SGD) and all(not g["nesterov"] and (g["momentum"] == 0 or g["direction"] == "buffer")
                                          for g in optimizer.param_groups):
        return
    raise ConfigError(f"--weight-predictor rollout knows the recurrences of Adam, AdamW and SGD (plain, or momentum "
                      f"with the buffer direction, no Nesterov); got {type(optimizer).__name__}")


def rollout_ratios(optimizer, group: dict, t: float | None, n: int, gradient: str) -> list[float]:
    """r_1..r_n: the direction of each of the next n steps divided by ΔW (the last step's direction),
    after t steps (None: t unknown, taken as large), under the gradient assumption `gradient`."""
    from megatron_po.optim.optimizers import SGD, Adam
    zero_mean = gradient == "zero-mean"
    if isinstance(optimizer, Adam):
        beta1 = group["betas"][0]
        if not zero_mean:
            return [1.0] * n
        if t is None:
            return [beta1**i for i in range(1, n + 1)]
        return [beta1**i * (1 - beta1**t) / (1 - beta1 ** (t + i)) for i in range(1, n + 1)]
    if isinstance(optimizer, SGD):
        u, tau = group["momentum"], group["dampening"]
        if u == 0:
            return [0.0 if zero_mean else 1.0] * n
        if zero_mean:
            return [u**i for i in range(1, n + 1)]
        if t is None:
            return [1.0] * n

        def c(count: float) -> float:  # buffer after `count` steps of a constant unit gradient (torch: v_1 = g)
            return u ** (count - 1) + (1 - tau) * (1 - u ** (count - 1)) / (1 - u)
        return [c(t + i) / c(t) for i in range(1, n + 1)]
    check_rollout_supported(optimizer)
    raise AssertionError("unreachable")


PREDICTORS = {"linear": LinearPredictor, "lr-schedule": ScheduleAwarePredictor, "rollout": RolloutPredictor}


def build_predictor(name: str = "linear", horizon: str = "full", rollout_gradient: str = "first-moment",
                    optimizer=None) -> WeightPredictor:
    """The predictor `--weight-predictor name`; `optimizer` (the predictive optimizer it will serve, if
    given) is checked to be one the predictor supports. Bad names raise ConfigError."""
    if name not in PREDICTORS:
        raise ConfigError(f"unknown weight predictor {name!r}; valid: {', '.join(PREDICTOR_NAMES)}")
    if name == "rollout":
        if optimizer is not None:
            check_rollout_supported(optimizer)
        return RolloutPredictor(horizon, rollout_gradient)
    if rollout_gradient != "first-moment":
        raise ConfigError(f"--rollout-gradient applies to --weight-predictor rollout, not {name}")
    return PREDICTORS[name](horizon)
