"""Predictive optimizers: torch.optim's update rules, plus the direction PipeOptim extrapolates along.

Every optimizer here is a `torch.optim.Optimizer` (param_groups, state_dict, load_state_dict, lr
schedulers and step hooks work as usual) whose `step()` reproduces the torch.optim counterpart's foreach
implementation op for op. On top of `step()` each one exposes:

- `update_direction()`: ΔW, the displacement the LAST step applied to each parameter divided by the
  group's lr, so that `W_after = W_before - lr * ΔW` (up to float rounding). It is rebuilt from the
  optimizer's own state (see the ΔW table in docs/ASYNC_PIPELINES.md).
- `predict(steps)`: the PipeOptim weight prediction `Ŵ = W - steps * lr * ΔW`, written in place or into
  other tensors (e.g. the bf16 model weights while the optimizer holds fp32 main weights).
- `has_state()`: whether any step has happened yet; before that there is no ΔW and prediction is a no-op.

Memory: where the state already determines ΔW nothing extra is stored. Where it does not, one extra
tensor per parameter is kept after each step:

| optimizer                                 | extra state                            |
|-------------------------------------------|----------------------------------------|
| SGD without momentum                      | `last_grad` (g_t, incl. the L2 term)   |
| SGD momentum, direction="buffer"          | nothing (ΔW = momentum_buffer)         |
| SGD momentum, direction="lookahead"       | `last_grad`                            |
| SGD Nesterov                              | `last_grad`                            |
| Adam, AdamW                               | nothing (ΔW from exp_avg, exp_avg_sq)  |
| RMSprop with momentum (centered or not)   | nothing (ΔW = momentum_buffer)         |
| RMSprop without momentum                  | `last_grad`                            |
| Adagrad                                   | `last_grad`                            |
| Lion                                      | `update_sign` (int8, 1 byte/element)   |

Keeping the last direction (`keep_direction = True`, set by the predicting weight policies): the
factored ΔW that a step already computed (Adam's √v̂ + ε, RMSprop's and Adagrad's denominators,
Nesterov's g + μv) is kept per parameter until that parameter's next step, and every prediction in
between reuses it instead of rebuilding it from the state. With k = 1 a pipeline stage predicts once per
step, so this removes ΔW's whole cost from the prediction (for Adam three of its four passes over the
weights), at the price of holding those denominators between steps (4 bytes per parameter for Adam;
the step frees the old ones before allocating new ones, so the peak does not grow). Off by default.
Where the prediction is written by the step itself (`plan_prediction`, fused_prediction.py: the step
computes Ŵ right after W from the ΔW it has just computed), nothing needs keeping and the policies leave
it off.

All parameter writes (step and predict) go through `param.data`, which does not bump the parameter's
autograd version counter: in an asynchronous pipeline, micro-batches whose forward saved a weight are
still in flight when that weight is stepped or swapped, and their backward must not fail.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_po.dynamo_import import import_dynamo
from megatron_po.optim.fused_prediction import PredictionRequest, _add_scaled, _addcdiv, _per_step, run_group


class _Direction(NamedTuple):
    """ΔW for the parameters of one group that have state: `numerator / denominator / divisor`.

    Kept factored so that `predict()` can apply it with one fused `addcdiv_` without materialising ΔW.
    `denominators=None` and `divisors=None` mean 1. Decoupled weight decay is not included.
    """

    numerators: list[Tensor]
    denominators: list[Tensor] | None = None
    divisors: list[float] | None = None


def _step_value(step: Tensor) -> float:
    # Under torch.compile (the fused step on CUDA, fused_prediction.py) the count stays a tensor, as in
    # torch.optim's `_get_value`: no host sync and no recompilation as the count grows.
    return step if torch.compiler.is_compiling() else step.item()


_ONE = torch.tensor(1.0)  # made once: a tensor per step costs as much as the tiny add itself


def _increment_steps(states: list[dict]) -> None:
    # Same as torch.optim: step counts are 0-dim float32 CPU tensors (so state_dicts look alike), and a
    # CPU scalar tensor with alpha picks the overload that does not re-wrap 1 into a tensor per element.
    torch._foreach_add_([s["step"] for s in states], _ONE, alpha=1.0)


def _remember(states: list[dict], key: str, tensors: list[Tensor], dtype: torch.dtype | None = None) -> None:
    """Keep a copy of `tensors` in each state under `key`, reusing last step's buffers when present."""
    if all(key in s for s in states):
        torch._foreach_copy_([s[key] for s in states], tensors)
        return
    for state, tensor in zip(states, tensors):
        if key in state:
            state[key].copy_(tensor)
        else:
            state[key] = tensor.detach().to(dtype=dtype or tensor.dtype, copy=True)


class PredictiveOptimizer(torch.optim.Optimizer):
    """Base class: the step loop, ΔW and prediction. Subclasses supply the update rule.

    A subclass implements `_step_group(group, params, grads, states)` (params are `.data` views, states
    may be empty dicts on a parameter's first step) and `_direction(group, params, states)` returning the
    factored ΔW of the last step. `decoupled_weight_decay` says whether `group["weight_decay"]` shrinks
    the weights outside the gradient (AdamW, Lion); otherwise weight decay is an L2 term already folded
    into the gradient and hence into ΔW.
    """

    decoupled_weight_decay = False
    keep_direction = False  # see the module docstring; the predicting weight policies turn it on
    predictor = None  # optim/predictors.py WeightPredictor; None = PipeOptim's linear Ŵ = W - s·lr·ΔW
    compile_fused_step = False  # the per-group step under torch.compile (--torch-compile: build_optimizer)

    def __init__(self, params: Iterable, defaults: dict):
        self._kept_direction: dict[int, tuple] = {}  # id(state) -> (numerator, denominator, divisor)
        self._planned: list[PredictionRequest] = []  # predictions the next step writes (fused_prediction.py)
        self._compiled_updates: dict[int, Callable] = {}  # param group index -> compiled `_group_update`
        import_dynamo()  # torch.optim's add_param_group would, holding our callers' frames (dynamo_import.py)
        super().__init__(params, defaults)

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor], states: list[dict]):
        """Apply one update; may return the factored ΔW it computed on the way (else None)."""
        raise NotImplementedError

    def init_state(self, group: dict, param: Tensor, state: dict) -> None:
        """Create the (empty) `state` of `param` in `group`: every entry a step leaves, zero-filled where a
        step fills it in. The step calls it for a parameter's first step and a checkpoint load calls it
        for a parameter that has not stepped yet, so the load writes into exactly the tensors a step
        would create: per-element state like `param` (its device), step counts 0-dim float32 on the CPU
        as torch.optim keeps them, whatever device the parameter is on."""
        raise NotImplementedError

    def _direction(self, group: dict, params: list[Tensor], states: list[dict]) -> _Direction:
        raise NotImplementedError

    def plan_prediction(self, *requests: PredictionRequest) -> None:
        """Have the next `step()` also write these predictions, from the ΔW it computes (see
        fused_prediction.py); replaces any earlier plan."""
        self._planned = list(requests)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One update of every parameter that has a gradient; parameters whose .grad is None are skipped
        (no state is created for them and their weights do not move), as in torch.optim. Then the planned
        predictions (`plan_prediction`), written by the same per-group pass."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        requests, self._planned = self._planned, []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            self._run_group(index, group, params, requests)
        for request in requests:
            request.done = True
        return loss

    def _run_group(self, index: int, group: dict, params: list[Tensor], requests: list[PredictionRequest]) -> None:
        """Step the group's `params` (those with a gradient) and write its part of every request."""
        run_group(self, index, group, params, requests)

    def _compilable(self, group: dict) -> bool:
        """Whether the group's step is per-element foreach work that torch.compile can fuse into one pass
        (fused_prediction.py; Muon's Newton-Schulz groups are not)."""
        return True

    def _keep(self, states: list[dict], d: _Direction) -> None:
        """Remember each parameter's factor of ΔW `d` until that parameter's next step (keyed by its state)."""
        for i, state in enumerate(states):
            self._kept_direction[id(state)] = (d.numerators[i], None if d.denominators is None else d.denominators[i],
                               None if d.divisors is None else d.divisors[i])

    def _direction_now(self, group: dict, params: list[Tensor], states: list[dict]) -> _Direction:
        """ΔW of `params`: the kept one when every parameter has it, else rebuilt from the state (and kept,
        when keeping is on, for the predictions until the next step)."""
        if self.keep_direction and self._kept_direction:
            entries = [self._kept_direction.get(id(state)) for state in states]
            if all(e is not None for e in entries):
                numerators, denominators, divisors = zip(*entries)
                return _Direction(list(numerators),
                                  None if denominators[0] is None else list(denominators),
                                  None if divisors[0] is None else list(divisors))
        d = self._direction(group, params, states)
        if self.keep_direction:
            self._keep(states, d)
        return d

    def forget_kept_direction(self) -> None:
        """Drop the kept directions: call after changing the state other than by `step()` (e.g. loading
        a checkpoint into the state tensors in place)."""
        self._kept_direction.clear()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load, then every loaded tensor copied INTO the state tensor this optimizer holds
        (or, for a parameter that has not stepped yet, creates with `init_state`) under the same key and
        shape: loading never replaces a state tensor, nor moves it to another device or dtype (torch's
        load would put step counts where the checkpoint had them and cast Lion's int8 signs to float).
        State the saved one lacks is dropped, as torch.optim does."""
        self.forget_kept_direction()  # new state: the kept directions describe the old one
        held = {p: dict(s) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        with torch.no_grad():
            for p, loaded in self.state.items():
                own = held.get(p) or {}
                if not own:
                    self.init_state(group_of[p], p, own)
                for key, value in loaded.items():
                    target = own.get(key)
                    if torch.is_tensor(target) and torch.is_tensor(value) and target.shape == value.shape:
                        loaded[key] = target.copy_(value)

    def has_state(self) -> bool:
        """Whether any parameter has been stepped, i.e. whether there is a ΔW to predict with."""
        return any(len(state) > 0 for state in self.state.values())

    def _stepped(self, group: dict) -> tuple[list[int], list[Tensor], list[dict]]:
        """Positions, `.data` views and states of the group's parameters that have state."""
        positions, params, states = [], [], []
        for i, p in enumerate(group["params"]):
            state = self.state.get(p)  # .get: self.state is a defaultdict, indexing would create entries
            if state:
                positions.append(i)
                params.append(p.data)
                states.append(state)
        return positions, params, states

    @torch.no_grad()
    def update_direction(self, include_weight_decay: bool = False) -> list[list[Tensor | None]]:
        """ΔW of the last step, one list per param group aligned with `group["params"]`.

        Entries are new tensors (never views of the state) in the parameter's dtype. A parameter that
        has never been stepped has no state and gets None; a parameter that was skipped by later steps
        (grad None) keeps the ΔW of its own last step. Decoupled weight decay (AdamW, Lion) is excluded
        unless `include_weight_decay`, in which case `λ·W` at the current weights is added; for the other
        optimizers weight decay is an L2 term already inside ΔW and the flag changes nothing.
        """
        directions = []
        for group in self.param_groups:
            row: list[Tensor | None] = [None] * len(group["params"])
            positions, params, states = self._stepped(group)
            if params:
                d = self._direction(group, params, states)
                if d.denominators is not None:
                    delta = torch._foreach_div(d.numerators, d.denominators)
                else:
                    delta = [n.to(dtype=p.dtype, copy=True) for n, p in zip(d.numerators, params)]
                if d.divisors is not None:
                    torch._foreach_div_(delta, d.divisors)
                if include_weight_decay and self.decoupled_weight_decay and group["weight_decay"] != 0:
                    torch._foreach_add_(delta, params, alpha=group["weight_decay"])
                for i, tensor in zip(positions, delta):
                    row[i] = tensor
            directions.append(row)
        return directions

    @torch.no_grad()
    def predict(
        self,
        steps: float | Sequence[float],
        include_weight_decay: bool = False,
        out: Sequence[Sequence[Tensor]] | None = None,
    ) -> None:
        """PipeOptim weight prediction `Ŵ = W - steps * lr * ΔW`, with each group's current lr.

        steps: how many steps ahead to extrapolate; one number for every group or one per param group
            (e.g. when model chunks with different staleness sit in different groups). 0 is allowed.
        include_weight_decay: also extrapolate decoupled weight decay (AdamW, Lion), see update_direction.
        out: None to overwrite the parameters in place, or one list per param group aligned with
            `group["params"]` that receives Ŵ; it may have another dtype (e.g. bf16 model weights for fp32
            main weights) and is written through `.data`. Ŵ is computed in the parameters' dtype.

        Parameters without state (never stepped, in particular everything before the first step) are
        predicted as W itself: in place that is a no-op, with `out` it is a plain copy.
        """
        if isinstance(steps, Tensor):
            steps = steps.tolist()
        if isinstance(steps, numbers.Real):
            steps_per_group = [float(steps)] * len(self.param_groups)
        else:
            steps_per_group = [float(s) for s in steps]
        if len(steps_per_group) != len(self.param_groups):
            raise ValueError(
                f"predict: got {len(steps_per_group)} step counts for {len(self.param_groups)} param groups"
            )
        if out is not None and len(out) != len(self.param_groups):
            raise ValueError(f"predict: out has {len(out)} lists for {len(self.param_groups)} param groups")

        for g, (group, s) in enumerate(zip(self.param_groups, steps_per_group)):
            if out is not None:
                targets = [t.data for t in out[g]]
                if len(targets) != len(group["params"]):
                    raise ValueError(f"predict: out[{g}] has {len(targets)} tensors for {len(group['params'])} params")
                if targets:  # start every target at W; the stepped ones are then moved (or recomputed) below
                    torch._foreach_copy_(targets, [p.data for p in group["params"]])
            positions, params, states = self._stepped(group)
            if s == 0 or not params:
                continue

            copy_out = False
            if out is None:
                dst = params
            elif all(targets[i].dtype == p.dtype for i, p in zip(positions, params)):
                dst = [targets[i] for i in positions]
            else:
                # Compute Ŵ in the optimizer's precision and round once, when copying it out.
                dst, copy_out = [p.clone() for p in params], True

            self._extrapolate(group, params, states, dst, s, include_weight_decay)
            if copy_out:
                torch._foreach_copy_([targets[i] for i in positions], dst)

    @torch.no_grad()
    def predicted(self, steps: float, include_weight_decay: bool = False) -> list[tuple[Tensor, Tensor]]:
        """Ŵ = W - steps·lr·ΔW (as `predict`) as new tensors, W untouched: [(parameter, Ŵ)] for the
        parameters that have state. One fused out-of-place foreach pass per param group; for a weight
        policy that points the parameters at Ŵ for a forward and back at W after it (no copies)."""
        pairs = []
        if steps == 0:
            return pairs
        for group in self.param_groups:
            positions, params, states = self._stepped(group)
            if params:
                out = self._extrapolate(group, params, states, params, float(steps), include_weight_decay,
                                        in_place=False)
                pairs += [(group["params"][i], w) for i, w in zip(positions, out)]
        return pairs

    def _extrapolate(self, group: dict, params: list, states: list, dst: list, steps: float,
                     include_weight_decay: bool, in_place: bool = True, direction: _Direction | None = None) -> list:
        """dst (holding W) <- W - steps·lr·ΔW, with ΔW from `params`' state (or `direction`, the one a step
        just computed); with decoupled decay extrapolated, Ŵ = W(1 - s·lr·λ) - s·lr·ΔW. One fused foreach
        pass. `in_place=False`: dst is left alone and Ŵ returned as new tensors (the same pass, out of
        place); else dst is returned.

        With a `predictor` (optim/predictors.py) the same pass applies its Ŵ = a·W - b·ΔW instead, b per
        parameter (e.g. the LR schedule's future lrs, or a rollout of the optimizer's recurrences)."""
        if self.predictor is None:
            alpha = -steps * group["lr"]
            # decided on numbers, never on the lr (a tensor under torch.compile: fused_prediction.py)
            decays = include_weight_decay and self.decoupled_weight_decay and group["weight_decay"] != 0
            decay = 1 + alpha * group["weight_decay"] if decays else None
            alphas = [alpha] * len(params)
        else:
            decay, coefficients = self.predictor.coefficients(self, group, states, steps, include_weight_decay)
            decay = None if decay == 1 else decay
            alphas = [-b for b in coefficients]
        if decay is not None:
            if in_place:
                torch._foreach_mul_(dst, _per_step(decay))
            else:
                dst, in_place = torch._foreach_mul(dst, _per_step(decay)), True  # new tensors: go on in place
        d = direction if direction is not None else self._direction_now(group, params, states)
        scalars = [a / x for a, x in zip(alphas, d.divisors)] if d.divisors is not None else None
        alpha = alphas[0] if all(a is alphas[0] or a == alphas[0] for a in alphas) else None  # one for all
        if d.denominators is not None:
            value = scalars if scalars is not None else alpha if alpha is not None else alphas
            return _addcdiv(dst, d.numerators, d.denominators, value, in_place)
        if scalars is None and alpha is not None:
            return _add_scaled(dst, d.numerators, alpha, in_place)
        terms = torch._foreach_mul(d.numerators, [_per_step(x) for x in (scalars if scalars is not None else alphas)])
        if not in_place:
            return torch._foreach_add(dst, terms)
        torch._foreach_add_(dst, terms)
        return dst


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0.0:
            raise ValueError(f"invalid {name}: {value} (must be >= 0)")


def _check_betas(betas: tuple[float, float]) -> None:
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"invalid beta{i + 1}: {beta} (must be in [0, 1))")


class SGD(PredictiveOptimizer):
    """torch.optim.SGD (plain, momentum, Nesterov; L2 weight decay folded into the gradient).

    ΔW: without momentum the last gradient g_t (incl. λW); Nesterov `g_t + momentum·v_t`; with momentum
    either the buffer v_t (direction="buffer", the PipeOptim paper and SpecTrain) or the step that an
    unchanged gradient would give next, `momentum·v_t + (1-dampening)·g_t` (direction="lookahead").
    The buffer is what the last step applied, but it lags the next step: under a constant gradient g
    (no dampening) v_t = g(1-u^t)/(1-u), so predicting with the buffer falls short of the next step by
    lr·u^t·g, a gap that vanishes only once the buffer has converged. Lookahead matches the next step
    exactly when the gradient does not change. `update_direction()` always returns the group's chosen
    direction (for lookahead that is the next step's displacement over lr, not the last one's).
    Extra state: `last_grad` without momentum, with Nesterov and with direction="lookahead".
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        direction: str = "buffer",
    ):
        _check_non_negative(lr=lr, weight_decay=weight_decay, momentum=momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        if direction not in ("buffer", "lookahead"):
            raise ValueError(f"invalid direction: {direction!r} (must be 'buffer' or 'lookahead')")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            direction=direction,
        )
        super().__init__(params, defaults)

    @staticmethod
    def _keeps_last_grad(group: dict) -> bool:
        return group["momentum"] == 0 or group["nesterov"] or group["direction"] == "lookahead"

    def init_state(self, group, param, state):
        if self._keeps_last_grad(group):
            state["last_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group["momentum"] != 0:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        first = [not state for state in states]
        for p, state, new in zip(params, states, first):
            if new:
                self.init_state(group, p, state)
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        if self._keeps_last_grad(group):
            _remember(states, "last_grad", grads)

        update = grads
        if momentum != 0:
            if not any(first) and all("momentum_buffer" in s for s in states):
                buffers = [s["momentum_buffer"] for s in states]
                torch._foreach_mul_(buffers, momentum)
                torch._foreach_add_(buffers, grads, alpha=1 - dampening)
            else:
                # Some parameter steps for the first time: like torch, its buffer starts as g (undampened).
                buffers = []
                for state, grad, new in zip(states, grads, first):
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = grad.detach().clone()
                    elif new:
                        state["momentum_buffer"].copy_(grad)
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(grad, alpha=1 - dampening)
                    buffers.append(state["momentum_buffer"])
            # torch adds into the gradients in place here; out of place gives the same numbers
            # without mutating p.grad.
            update = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
        _add_scaled(params, update, -lr)
        if momentum == 0:
            return _Direction([s["last_grad"] for s in states])  # not `update`: p.grad may be zeroed in place
        if group["nesterov"] or group["direction"] == "buffer":
            return _Direction(update)  # what was applied; lookahead's direction is another one
        return None

    def _direction(self, group, params, states):
        momentum = group["momentum"]
        if self._keeps_last_grad(group) and any("last_grad" not in s for s in states):
            raise RuntimeError(
                "SGD.update_direction: this group's direction needs the last gradient, which is stored only "
                "by steps taken with that setting (was momentum/nesterov/direction changed after stepping?)"
            )
        if momentum == 0:
            return _Direction([s["last_grad"] for s in states])
        buffers = [s["momentum_buffer"] for s in states]
        last_grads = [s["last_grad"] for s in states] if self._keeps_last_grad(group) else None
        if group["nesterov"]:
            return _Direction(torch._foreach_add(last_grads, buffers, alpha=momentum))
        if group["direction"] == "lookahead":
            lookahead = torch._foreach_mul(buffers, momentum)
            torch._foreach_add_(lookahead, last_grads, alpha=1 - group["dampening"])
            return _Direction(lookahead)
        return _Direction(buffers)


class Adam(PredictiveOptimizer):
    """torch.optim.Adam (no amsgrad); weight decay is an L2 term added to the gradient.

    ΔW = m̂/(√v̂ + ε) with the bias corrections of the parameter's current step count. No extra state.

    `exp_avg_dtype`, `exp_avg_sq_dtype` (Megatron's --use-precision-aware-optimizer --exp-avg-dtype /
    --exp-avg-sq-dtype; default: the parameter's dtype): the moments are *stored* in that dtype and computed in
    the parameter's, as Transformer Engine's FusedAdam does (its multi_tensor_adam kernel loads m and v into
    fp32, updates them, steps the weight with the unrounded values and stores them rounded): each step upcasts
    the stored moments, runs the ordinary step and rounds them back. ΔW (`update_direction`, PipeOptim's
    prediction) is the state the optimizer holds: the stored, rounded moments upcast to the parameter's dtype,
    on every path: such a step returns no ΔW of its own (the unrounded one it stepped with is gone), so the
    prediction the step writes (fused_prediction.py) rebuilds it from the stored moments, as the separate
    prediction does; keeping it (`keep_direction`) holds the upcast first moment too (4 more bytes per parameter).
    """

    decoupled_weight_decay = False
    state_dtypes = {"exp_avg": None, "exp_avg_sq": None}  # None: the parameter's

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        exp_avg_dtype: torch.dtype | None = None,
        exp_avg_sq_dtype: torch.dtype | None = None,
    ):
        _check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay)
        _check_betas(betas)
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def init_state(self, group, param, state):
        state["step"] = torch.tensor(0.0)
        for key, dtype in self.state_dtypes.items():
            state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        stored = {key: [s[key] for s in states] for key, dtype in self.state_dtypes.items() if dtype is not None}
        if not stored:
            return self._adam_step(group, params, grads, states)
        # the lower-precision moments: computed in the parameters' dtype, stored rounded (see the docstring)
        wide = [{**s, **{key: s[key].to(p.dtype) for key in stored}} for p, s in zip(params, states)]
        self._adam_step(group, params, grads, wide)
        for key, tensors in stored.items():
            torch._foreach_copy_(tensors, [s[key] for s in wide])
        return None  # ΔW is the stored moments' (`_direction`), not the unrounded ones' the step used

    def _adam_step(self, group, params, grads, states):
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        _increment_steps(states)

        if weight_decay != 0:
            if self.decoupled_weight_decay:
                torch._foreach_mul_(params, _per_step(1 - lr * weight_decay))
            else:
                grads = torch._foreach_add(grads, params, alpha=weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)

        d = self._direction(group, params, states)
        step_sizes = [(lr / bias_correction1) * -1 for bias_correction1 in d.divisors]  # torch's rounding
        _addcdiv(params, d.numerators, d.denominators, step_sizes)
        return d

    def _direction(self, group, params, states):
        # The step's update is lr · m/(√v/√(1-β2^t) + ε) / (1-β1^t); factored as numerator m,
        # denominator √v̂ + ε and divisor 1-β1^t, with the same float ops as torch.optim.Adam.
        beta1, beta2 = group["betas"]
        step_counts = [_step_value(s["step"]) for s in states]
        bias_corrections1 = [1 - beta1**t for t in step_counts]
        bias_corrections2_sqrt = [(1 - beta2**t) ** 0.5 for t in step_counts]
        # Lower-precision moments (`state_dtypes`) upcast to the parameter's dtype (fp32): the state held.
        denominators = torch._foreach_sqrt([s["exp_avg_sq"].to(p.dtype) for p, s in zip(params, states)])
        torch._foreach_div_(denominators, bias_corrections2_sqrt)
        torch._foreach_add_(denominators, group["eps"])
        return _Direction([s["exp_avg"].to(p.dtype) for p, s in zip(params, states)], denominators, bias_corrections1)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay `W ← W(1 - lr·λ)` before the Adam update.

    ΔW as Adam; the decay is excluded from ΔW unless include_weight_decay=True. No extra state.
    """

    decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        exp_avg_dtype: torch.dtype | None = None,
        exp_avg_sq_dtype: torch.dtype | None = None,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, exp_avg_dtype, exp_avg_sq_dtype)


class RMSprop(PredictiveOptimizer):
    """torch.optim.RMSprop (plain, momentum, centered); L2 weight decay folded into the gradient.

    ΔW is what the step applied: with momentum the buffer (no extra state), otherwise g_t/(√E[g²] + ε)
    (centered: √(E[g²] - E[g]²)), which needs the last gradient: extra state `last_grad`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
    ):
        _check_non_negative(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered)
        super().__init__(params, defaults)

    def init_state(self, group, param, state):
        state["step"] = torch.tensor(0.0)
        state["square_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            state["last_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        alpha, momentum = group["alpha"], group["momentum"]
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        _increment_steps(states)

        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        if momentum == 0:
            _remember(states, "last_grad", grads)
        square_avgs = [s["square_avg"] for s in states]
        torch._foreach_mul_(square_avgs, alpha)
        torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
        if group["centered"]:
            torch._foreach_lerp_([s["grad_avg"] for s in states], grads, 1 - alpha)

        rms = self._root_mean_square(group, states)
        if momentum > 0:
            buffers = [s["momentum_buffer"] for s in states]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_addcdiv_(buffers, grads, rms)
            _add_scaled(params, buffers, -group["lr"])
            return _Direction(buffers)
        _addcdiv(params, grads, rms, -group["lr"])
        return _Direction([s["last_grad"] for s in states], rms)

    @staticmethod
    def _root_mean_square(group: dict, states: list[dict]) -> list[Tensor]:
        """The step's denominator √E[g²] + ε (centered: √(E[g²] - E[g]²) + ε), from the current state."""
        if group["centered"]:
            grad_avgs = [s["grad_avg"] for s in states]
            rms = torch._foreach_addcmul([s["square_avg"] for s in states], grad_avgs, grad_avgs, value=-1)
            torch._foreach_sqrt_(rms)
        else:
            rms = torch._foreach_sqrt([s["square_avg"] for s in states])
        torch._foreach_add_(rms, group["eps"])
        return rms

    def _direction(self, group, params, states):
        if group["momentum"] > 0:
            return _Direction([s["momentum_buffer"] for s in states])
        return _Direction([s["last_grad"] for s in states], self._root_mean_square(group, states))


class Adagrad(PredictiveOptimizer):
    """torch.optim.Adagrad (dense gradients); L2 weight decay folded into the gradient.

    The step at count t applies lr/(1+(t-1)·lr_decay) · g_t/(√Σg² + ε). ΔW is that divided by the base
    lr = group["lr"], i.e. `g_t/(√Σg² + ε) / (1+(t-1)·lr_decay)`, so the decayed effective lr is part of
    ΔW and `W_after = W_before - group["lr"]·ΔW`. Extra state: `last_grad` (Σg² loses the sign of g).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ):
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
        )
        _check_non_negative(**defaults)
        super().__init__(params, defaults)

    def init_state(self, group, param, state):
        state["step"] = torch.tensor(0.0)
        state["sum"] = torch.full_like(param, group["initial_accumulator_value"], memory_format=torch.preserve_format)
        state["last_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        _increment_steps(states)

        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        _remember(states, "last_grad", grads)
        lr_decay_factors = [1 + (_step_value(s["step"]) - 1) * group["lr_decay"] for s in states]
        minus_clr = [-group["lr"] / f for f in lr_decay_factors]
        sums = [s["sum"] for s in states]
        torch._foreach_addcmul_(sums, grads, grads, value=1)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, group["eps"])
        torch._foreach_addcdiv_(params, torch._foreach_mul(grads, minus_clr), std)
        return _Direction([s["last_grad"] for s in states], std, lr_decay_factors)

    def _direction(self, group, params, states):
        std = torch._foreach_sqrt([s["sum"] for s in states])
        torch._foreach_add_(std, group["eps"])
        lr_decay_factors = [1 + (_step_value(s["step"]) - 1) * group["lr_decay"] for s in states]
        return _Direction([s["last_grad"] for s in states], std, lr_decay_factors)


class Lion(PredictiveOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled weight decay:

        c = β1·m + (1-β1)·g;   W ← W(1 - lr·λ) - lr·sign(c);   m ← β2·m + (1-β2)·g

    ΔW = sign(c) of the last step (decay excluded unless include_weight_decay=True). m alone does not
    determine c, so the sign is kept as extra state `update_sign`, in int8 (1 byte per element).
    """

    decoupled_weight_decay = True

    def __init__(
        self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ):
        _check_non_negative(lr=lr, weight_decay=weight_decay)
        _check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def init_state(self, group, param, state):
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["update_sign"] = torch.zeros_like(param, dtype=torch.int8, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        exp_avgs = [s["exp_avg"] for s in states]

        signs = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(signs, grads, alpha=1 - beta1)
        torch._foreach_sign_(signs)
        if weight_decay != 0:
            torch._foreach_mul_(params, _per_step(1 - lr * weight_decay))
        _add_scaled(params, signs, -lr)
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)
        _remember(states, "update_sign", signs, dtype=torch.int8)
        return _Direction([s["update_sign"] for s in states])

    def _direction(self, group, params, states):
        return _Direction([s["update_sign"] for s in states])


def param_groups(modules, weight_decay: float) -> list[dict]:
    """Megatron's rule: no weight decay on biases and normalization weights (the params of at most one
    dimension; the MoE experts' biases, [experts, size], are one vector per expert, as Megatron's per-expert
    biases). `modules`: the model chunks one optimizer steps (each parameter once)."""
    decay, no_decay, seen = [], [], set()
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            vectors = 2 if getattr(p, "expert_parallel", False) else 1
            (no_decay if p.ndim <= vectors else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
