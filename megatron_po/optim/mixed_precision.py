"""Mixed precision: bf16/fp16 model weights, fp32 main weights held by an optimizer wrapper.

The model computes in bf16 or fp16; an fp32 copy of every weight (the *main params*) is what the
optimizer steps, and the model weights are rounded copies of it, refreshed after every step. Gradients
arrive either in the model dtype or, with `--accumulate-allreduce-grads-in-fp32`, in the fp32 DDP buffer
(`p.main_grad`, see distributed/ddp.py); either way the step sees fp32 gradients.

A step (`MainParamsOptimizer.step`, shared with the sharded optimizer in distributed_optimizer.py):
  1. main grads from the model grads (an alias of the fp32 DDP buffer, or an fp32 copy);
  2. unscale by 1/loss_scale and look for inf/NaN; the flag is agreed (MAX) over the given process
     groups: the model-parallel group in synchronous training, the stage's own TP group in async
     pipelines (plus the DP group when the state is sharded). A non-finite step is skipped on every
     rank and reported (`StepResult.skipped`); with fp16 the loss scale then backs off. Asynchronous
     pipelines keep one scaler per model chunk, so the skip and the scale are stage-local there
     (pipeline/async_pipeline.py);
  3. global grad norm, every parameter counted once (TP shards on every TP rank, replicated params on
     TP rank 0 only, the tied-embedding copy not at all), and clipping to `clip_grad`;
  4. the inner predictive optimizer steps the fp32 main params;
  5. main -> model copy (rounding to the model dtype).

Loss scaling (fp16 only) follows Megatron: dynamic by default, initial scale 2**32, min scale 1,
growth x2 after `loss_scale_window` = 1000 clean steps in a row, back-off x0.5 only once `hysteresis`
= 2 non-finite steps have accumulated (the hysteresis counter refills only when the scale grows);
`--loss-scale S` fixes the scale instead (non-finite steps are still skipped). bf16 needs no scaling.

PipeOptim: the fp32 main params *are* the live-weight cache. `predict_model_params(steps)` writes
Ŵ = W_main - s·lr·ΔW straight into the low-precision model weights (computed in fp32 a few tensors at a
time, rounded once) and `restore_model_params()` is the ordinary main -> model copy, so prediction costs
no extra full-size weight copy. A PipeOptim/SpecTrain policy should call these two methods instead of
keeping its own cache whenever the optimizer has them (`hasattr(opt, "predict_model_params")`).
Fused into the step instead (`plan_prediction`, optim/fused_prediction.py): the step writes the live
model weights (the main -> model copy, as a prediction with s = 0) and Ŵ as new tensors in the model dtype
in the same per-group pass; the policy points the model parameters at Ŵ and back, so the restore moves no
data either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_po.distributed.ddp import grad_of
from megatron_po.errors import ConfigError
from megatron_po.optim.clip_grads import squared_sums
from megatron_po.optim.fused_prediction import PredictionRequest, steps_per_group, write_group
from megatron_po.optim.optimizers import PredictiveOptimizer

# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------


def model_dtype(bf16: bool = False, fp16: bool = False) -> torch.dtype:
    """The dtype of the model weights (and activations) for the precision flags."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def grad_buffer_dtype(bf16: bool = False, fp16: bool = False,
                      accumulate_allreduce_grads_in_fp32: bool = False) -> torch.dtype:
    """The dtype of the DDP gradient buffer: fp32 when asked for (or for fp32 models), else the model's."""
    return torch.float32 if accumulate_allreduce_grads_in_fp32 else model_dtype(bf16, fp16)


# --------------------------------------------------------------------------------------------------
# Loss scaling
# --------------------------------------------------------------------------------------------------


class ConstantGradScaler:
    """A fixed loss scale (`--loss-scale`)."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Megatron's dynamic loss scale: back off by `backoff_factor` once `hysteresis` non-finite steps have
    accumulated (never below `min_scale`), grow by `growth_factor` after `growth_interval` clean steps in
    a row. The hysteresis counter is refilled only when the scale grows, as in Megatron."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Also takes a ConstantGradScaler's state (the scale only): the trackers then start afresh."""
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def build_grad_scaler(fp16: bool, loss_scale: float | None = None, initial_loss_scale: float = 2.0**32,
                      min_loss_scale: float = 1.0, loss_scale_window: int = 1000, hysteresis: int = 2):
    """The loss scaler for the flags: None unless fp16; constant with `--loss-scale`, else dynamic."""
    if not fp16:
        return None
    if loss_scale is not None:
        return ConstantGradScaler(loss_scale)
    return DynamicGradScaler(initial_loss_scale, min_loss_scale, growth_interval=loss_scale_window,
                             hysteresis=hysteresis)


# --------------------------------------------------------------------------------------------------
# Prediction into other tensors, a few parameters at a time
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def predict_into(optimizer: PredictiveOptimizer, steps, targets: Sequence[Sequence[Tensor]],
                 include_weight_decay: bool = False, chunk_numel: int = 1 << 20) -> None:
    """`optimizer.predict(steps, include_weight_decay, out=targets)` with bounded temporary memory.

    Same float ops in the same order per element as `PredictiveOptimizer.predict` (so fp32 results are
    bitwise equal to it), but ΔW and the fp32 Ŵ of a lower-precision target are built for at most
    `chunk_numel` elements at a time, never for all weights at once: predicting fp32 main weights into
    bf16 model weights needs no full-size temporary.
    """
    groups = optimizer.param_groups
    per_group = steps_per_group(steps, len(groups))
    if len(targets) != len(groups):
        raise ValueError(f"predict: {len(targets)} target lists for {len(groups)} param groups")
    for g, (group, s) in enumerate(zip(groups, per_group)):
        dsts = [t.data for t in targets[g]]
        if len(dsts) != len(group["params"]):
            raise ValueError(f"predict: targets[{g}] has {len(dsts)} tensors for {len(group['params'])} params")
        positions, params, states = optimizer._stepped(group)
        write_group(optimizer, group, positions, params, states, [p.data for p in group["params"]],
                    (s, include_weight_decay, dsts, None, chunk_numel), None)


# --------------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------------


class StepResult(NamedTuple):
    """What a mixed-precision step did. `skipped`: inf/NaN gradients were found (on any rank of the
    agreeing groups) and nothing moved. `grad_norm`: global norm before clipping (None when skipped)."""

    skipped: bool
    grad_norm: float | None

    @property
    def found_inf(self) -> bool:
        return self.skipped


def normalize_param_groups(params) -> list[dict]:
    """torch.optim's accepted forms (an iterable of tensors, or of dicts with "params") as dicts."""
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    return [{**g, "params": list(g["params"])} for g in params]


def _multi_rank_groups(groups) -> list:
    """The given process groups that have something to reduce over (None = this process alone)."""
    return [g for g in groups if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1]


class MainParamsOptimizer:
    """Shared step of the optimizers that keep fp32 main params apart from the model weights.

    Subclasses say where the main params and their gradients live (`_main_grads`, `_norm_pieces`,
    `_release_main_grads`, `_copy_main_to_model`) and over which groups found-inf and norms are summed
    (`_agreement_groups`). The inner optimizer (`self.optimizer`) is a PredictiveOptimizer over the
    main params with one param group per model param group (same order, same hyperparameters), so
    `param_groups[i]["lr"]` set by the training loop reaches it directly.
    """

    optimizer: PredictiveOptimizer
    grad_scaler: ConstantGradScaler | DynamicGradScaler | None
    clip_grad: float
    predict_chunk_numel: int
    _planned: list[PredictionRequest] = []  # predictions the next step writes (`plan_prediction`)
    # The fp32 main params are apart from the model weights, so a prediction is written straight into the model
    # weights and undone by the main -> model copy (`predict_model_params`); False where they are the same
    # tensors (FSDP2's fp32 shards, optim/fsdp_optimizer.py): a policy then caches the live weights itself.
    predicts_into_model_weights = True
    expert_group = None  # MoE: the expert model-parallel group the experts' squares are summed over

    # -- what a subclass provides ---------------------------------------------------------------

    def _main_grads(self) -> list[Tensor]:
        """Attach fp32 grads to the main params; return the tensors to unscale/check (each element once)."""
        raise NotImplementedError

    def _norm_pieces(self) -> list[tuple[Tensor, Tensor]]:
        """(fp32 main grad, model param it belongs to) for every main param with a grad."""
        raise NotImplementedError

    def _release_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_to_model(self) -> None:
        raise NotImplementedError

    def _agreement_groups(self) -> list:
        raise NotImplementedError

    def _expert_agreement_groups(self) -> list:
        """The groups the experts' squares are summed over (after the flag's agreement): `expert_group`."""
        return [self.expert_group]

    def _prediction_targets(self) -> list[list[Tensor]]:
        raise NotImplementedError

    def _before_weights_change(self) -> None:
        """Hook: wait for anything still writing the model weights (pending all-gathers)."""

    def _step_and_write(self, requests: list[PredictionRequest]) -> None:
        """Step the main params, writing the planned predictions in the same pass; refresh the model."""
        self.optimizer.plan_prediction(*requests)
        self.optimizer.step()
        self._release_main_grads()
        self._copy_main_to_model()

    # -- torch.optim-like surface ---------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def has_state(self) -> bool:
        return self.optimizer.has_state()

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward on (multiplied by the current loss scale, fp16)."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    # -- the step -------------------------------------------------------------------------------

    def _unscale_and_agree(self, grads: list[Tensor]) -> tuple[bool, float]:
        """Unscale the main grads, then agree on found-inf and the global grad norm in one all-reduce per
        group: an asynchronous stage at k = 1 steps after every micro-batch, and every collective is a
        point where its data-parallel replicas wait for each other."""
        found = torch.zeros(1, dtype=torch.float32, device=self._device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.get_loss_scale(), dtype=torch.float32, device=self._device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        # Every rank must skip together: a step on some ranks only would desynchronise the replicas. The
        # flags are summed with the squares (any non-zero sum = some rank found inf/NaN).
        return self._agree(found[0].to(torch.float64))

    def _agree(self, found: Tensor) -> tuple[bool, float]:
        """(found inf/NaN on any rank, global grad norm): `found` and the squares summed over the agreement
        groups; with MoE experts (`expert_group`, clip_grads.py) then the flag and the experts' squares over
        the expert model-parallel group, which reaches the ranks holding other experts."""
        sums = squared_sums(self._norm_pieces(), self._device)
        dense = sums[0] if self.expert_group is not None else sums.sum()
        stats = torch.stack([found, dense])
        for group in _multi_rank_groups(self._agreement_groups()):
            dist.all_reduce(stats, group=group)
        if self.expert_group is None:
            return bool(stats[0] > 0), float(stats[1].sqrt())
        experts = torch.stack([stats[0], sums[1]])
        for group in _multi_rank_groups(self._expert_agreement_groups()):
            dist.all_reduce(experts, group=group)
        return bool(experts[0] > 0), float((stats[1] + experts[1]).sqrt())

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) main grads, each parameter counted once over the groups."""
        return self._agree(torch.zeros((), dtype=torch.float64, device=self._device))[1]

    def plan_prediction(self, *requests: PredictionRequest) -> None:
        """Have the next step also write these predictions of the model weights (optim/fused_prediction.py);
        a skipped step (inf/NaN) leaves them undone (`request.done` False)."""
        self._planned = list(requests)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> StepResult:
        """Unscale, skip on inf/NaN, clip, step the fp32 main params, copy them into the model weights."""
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure")
        requests, self._planned = self._planned, []
        self._before_weights_change()
        grads = self._main_grads()
        found_inf, norm = self._unscale_and_agree(grads)
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            self._release_main_grads()
            return StepResult(True, None)
        if self.clip_grad > 0 and norm > self.clip_grad:
            torch._foreach_mul_([g for g, _ in self._norm_pieces()], self.clip_grad / (norm + 1e-6))
        self._step_and_write(requests)
        return StepResult(False, norm)

    # -- PipeOptim ------------------------------------------------------------------------------

    @torch.no_grad()
    def predict_model_params(self, steps: float | Sequence[float], include_weight_decay: bool = False) -> None:
        """Write Ŵ = W_main - s·lr·ΔW (per param group `s`, each group's lr) into the model weights.
        Before the first step (no state) this is the plain main -> model copy."""
        self._before_weights_change()
        predict_into(self.optimizer, steps, self._prediction_targets(), include_weight_decay,
                     self.predict_chunk_numel)

    @torch.no_grad()
    def restore_model_params(self) -> None:
        """Put the live weights (the fp32 main params, rounded) back into the model."""
        self._before_weights_change()
        self._copy_main_to_model()


class MixedPrecisionOptimizer(MainParamsOptimizer):
    """fp32 main params for bf16/fp16 (or fp32) model params, stepped by a predictive optimizer.

    inner_optimizer_factory: called once with the main params' groups (dicts, same keys as the model
        groups), returns a PredictiveOptimizer, e.g. `lambda groups: build_optimizer("adam", groups, lr=...)`.
    model_param_groups: the model params, as torch.optim takes them (tensors or group dicts).
    grad_scaler: `build_grad_scaler(...)` (fp16) or None.
    clip_grad: clip the global grad norm to this (0: only measure it).
    model_parallel_group: group over which found-inf and the grad norm are agreed: the model-parallel
        group (TP x PP) in synchronous training, the TP group (stage-local) in async pipelines, None
        for a single process. DP replicas already hold identical (reduced) grads.
    expert_group: with MoE experts, the expert model-parallel group (optim/clip_grads.py): the flag and the
        experts' squares are agreed over it too.

    Model grads are read from `p.main_grad` (DDP buffer) when present, else `p.grad`; an fp32 gradient
    is used in place (unscaling and clipping modify it), a bf16/fp16 one is copied to fp32 per step.
    """

    def __init__(self, inner_optimizer_factory: Callable[[list[dict]], PredictiveOptimizer], model_param_groups,
                 grad_scaler=None, clip_grad: float = 0.0, model_parallel_group=None,
                 predict_chunk_numel: int = 1 << 20, expert_group=None):
        groups = normalize_param_groups(model_param_groups)
        self.model_groups = [g["params"] for g in groups]
        self.model_params = [p for g in self.model_groups for p in g]
        if len({id(p) for p in self.model_params}) != len(self.model_params):
            raise ValueError("a parameter appears in more than one param group")
        self.main_params = self._main_params_of(self.model_params)
        main_of = dict(zip(map(id, self.model_params), self.main_params))
        main_groups = [{**g, "params": [main_of[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = inner_optimizer_factory(main_groups)
        if not isinstance(self.optimizer, PredictiveOptimizer):
            raise TypeError(f"the inner optimizer must be a PredictiveOptimizer, got {type(self.optimizer).__name__}")
        attach = getattr(self.optimizer, "attach_shards", None)
        if attach is not None:  # an optimizer stepping whole matrices (Muon) needs the model params' layout
            self._attach_shards(attach, groups)
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.model_parallel_group = model_parallel_group
        self.expert_group = expert_group
        self.predict_chunk_numel = predict_chunk_numel
        self._device = self.main_params[0].device

    def _main_params_of(self, model_params: list[Tensor]) -> list[Tensor]:
        """The fp32 main params the inner optimizer steps: fp32 copies of the model params."""
        return [p.detach().to(torch.float32, copy=True) for p in model_params]

    def _attach_shards(self, attach, groups: list[dict]) -> None:
        """Tell an optimizer stepping whole matrices (Muon's `attach_shards`) where its params lie: whole here."""
        attach([(m, p, 0, p.numel()) for p, m in zip(self.model_params, self.main_params)], groups)

    def _main_grads(self):
        for model_p, main_p in zip(self.model_params, self.main_params):
            grad = grad_of(model_p)  # the DDP buffer's slice, `.grad`, or this rank's shard of an FSDP2 gradient
            main_p.grad = None if grad is None else grad if grad.dtype == torch.float32 else grad.float()
        return [m.grad for m in self.main_params if m.grad is not None]

    def _norm_pieces(self):
        return [(m.grad, p) for m, p in zip(self.main_params, self.model_params) if m.grad is not None]

    def _release_main_grads(self):
        for m in self.main_params:
            m.grad = None

    def _copy_main_to_model(self):
        torch._foreach_copy_([p.data for p in self.model_params], self.main_params)

    def _step_and_write(self, requests):
        # The live model weights are a prediction with s = 0 (the main -> model copy), written by the
        # same pass as the step; Ŵ as new tensors in the model dtype, mapped to the model params.
        for r in requests:
            r.dtype, r.chunk_numel = r.dtype or self.model_params[0].dtype, self.predict_chunk_numel
        self.optimizer.plan_prediction(*requests, PredictionRequest(0.0, targets=self.model_groups))
        self.optimizer.step()
        self._release_main_grads()
        model_of = {id(m): p for p, m in zip(self.model_params, self.main_params)}
        for r in requests:
            r.predicted = [(model_of[id(m)], w) for m, w in r.predicted]

    def _agreement_groups(self):
        return [self.model_parallel_group]

    def _prediction_targets(self):
        return self.model_groups

    @property
    def state(self) -> dict:
        """{model param: the inner optimizer's state of its main param} (for param-keyed checkpoints)."""
        return {p: self.optimizer.state[m] for p, m in zip(self.model_params, self.main_params)}

    def update_direction(self, include_weight_decay: bool = False) -> list[list[Tensor | None]]:
        """ΔW per group aligned with the model params, fp32 (see PredictiveOptimizer.update_direction)."""
        return self.optimizer.update_direction(include_weight_decay)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "main_params": list(self.main_params),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load the inner state, the fp32 main params and the loss scale; the model weights follow."""
        if len(state["main_params"]) != len(self.main_params):
            raise ConfigError(f"optimizer state has {len(state['main_params'])} main params, this model "
                              f"{len(self.main_params)}")
        self.optimizer.load_state_dict(state["optimizer"])
        for m, saved in zip(self.main_params, state["main_params"]):
            m.copy_(saved)
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self._copy_main_to_model()

