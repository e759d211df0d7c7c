"""Muon (Jordan et al. 2024; Moonshot AI's "Muon is scalable", 2025) as a predictive optimizer.

One optimizer object, two rules chosen per param group by its "use_muon" key (`muon_param_groups` sets it):

- hidden weight matrices (use_muon=True): momentum, Newton-Schulz orthogonalisation, decoupled decay

      B ← μ·B + G;   U = G + μ·B (Nesterov) or B;   O = NewtonSchulz(U);   W ← W(1 - lr·λ) - lr·scale·O

  NewtonSchulz: X ← U/(‖U‖_F + 1e-7), transposed so rows ≤ columns, then `num_ns_steps` (5) quintic
  iterations X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ and (a, b, c) = (3.4445, -4.7750, 2.0315) (Keller
  Jordan's coefficients). Computed in fp32 (the reference runs it in bf16 on GPUs; fp32 keeps the tests
  exact and costs nothing that matters at our sizes). The momentum is the undamped sum B ← μB + G of the
  shared doc; Keller Jordan's current code keeps the EMA (1-μ)·B instead, which only scales U by (1-μ):
  the orthogonalisation removes the scale, so both give the same O up to the 1e-7 in the normalisation.
  scale = extra_scale_factor · f(rows, cols) of the FULL matrix with Megatron's `--muon-scale-mode`:
  spectral √max(rows, cols), unit_rms_norm √(rows/cols), shape_scaling √max(1, rows/cols) (Keller
  Jordan's original). The default here, spectral with extra 0.2, is Moonshot's 0.2·√max(rows, cols), which
  gives the update the RMS of an AdamW update so that AdamW's lr and weight decay carry over; Megatron's
  default extra factor is 1.0 (its lrs are then Muon-sized, not AdamW-sized).
- everything else (embeddings, output layer, norms, biases): AdamW, exactly `optimizers.AdamW`.

ΔW for PipeOptim: for the matrices the applied update scale·O, kept per parameter as extra state
`muon_update` (one parameter-sized fp32 tensor: the momentum alone does not determine O, since Nesterov's
U needs the last gradient); for the AdamW part the AdamW ΔW (no extra state). Decoupled decay is excluded
from ΔW unless `include_weight_decay`, as for AdamW.

Whole matrices. The orthogonalisation of a matrix is not the concatenation of its shards' ones, so:
- tensor parallelism: a column- (row-) parallel weight's U is all-gathered over the TP group along its
  partition dim, orthogonalised whole on every TP rank, and each keeps its own slice. The gathered fused
  QKV weight comes out with its rows in another order than the TP=1 weight;
  orthogonalisation commutes with permuting rows or columns (O(PUQ) = P·O(U)·Q), so that is exact.
- distributed optimizer (ZeRO-1): a DP rank owns contiguous ranges of each bucket that cut through
  matrices. `attach_shards` (called by the wrappers) says where each inner parameter's piece lies in its
  model parameter; each step every bucket holding a Muon matrix is all-gathered over the DP group (the
  fp32 U of this rank's range, i.e. one fp32 all-gather of those buckets per step, like the fp32 param
  all-gather of a bucket), and every DP rank orthogonalises every matrix it holds a piece of (the
  Newton-Schulz compute is replicated, not sharded, over DP). Momentum and `muon_update` stay sharded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_po import parallel_state as ps
from megatron_po.optim.optimizers import (AdamW, PredictiveOptimizer, _check_betas, _check_non_negative, _Direction,
                                          _remember, param_groups)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


def newton_schulz(u: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> Tensor:
    """The quintic Newton-Schulz approximation of U's orthogonal polar factor, in fp32."""
    if u.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(u.shape)}")
    a, b, c = coefficients
    x = u.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation: A = X·Xᵀ is then the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def muon_scale(rows: int, cols: int, mode: str = "spectral", extra_scale_factor: float = 0.2) -> float:
    """Megatron's `--muon-scale-mode` factor for a rows x cols matrix, times `--muon-extra-scale-factor`."""
    if mode == "spectral":
        factor = math.sqrt(max(rows, cols))
    elif mode == "unit_rms_norm":
        factor = math.sqrt(rows / cols)
    elif mode == "shape_scaling":
        factor = math.sqrt(max(1.0, rows / cols))
    else:
        raise ValueError(f"invalid muon scale mode: {mode!r} (must be one of {', '.join(SCALE_MODES)})")
    return extra_scale_factor * factor


def muon_param_groups(groups: list[dict], chunks) -> list[dict]:
    """Split `param_groups(...)`' groups for Muon: the 2-D weights of the hidden layers in groups marked
    use_muon=True; embeddings (any nn.Embedding / vocab-parallel embedding), the output layer, norms and
    biases in groups marked use_muon=False (AdamW). Each group keeps its weight decay and other keys."""
    adamw_ids = set()
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, torch.nn.Embedding) or type(module).__name__ == "VocabParallelEmbedding":
                adamw_ids.update(id(p) for p in module.parameters(recurse=False))
        output_layer = getattr(chunk, "output_layer", None)
        if output_layer is not None:
            adamw_ids.update(id(p) for p in output_layer.parameters())
    out = []
    for g in groups:
        hidden = [p for p in g["params"] if p.ndim == 2 and id(p) not in adamw_ids
                  and not getattr(p, "shared_embedding", False)]
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in g["params"] if id(p) not in hidden_ids]
        out += [{**g, "params": hidden, "use_muon": True}] if hidden else []
        out += [{**g, "params": rest, "use_muon": False}] if rest else []
    return out


def optimizer_param_groups(name: str, chunks, weight_decay: float) -> list[dict]:
    """The param groups `build_optimizer(name, ...)` expects for these model chunks: Megatron's decay /
    no-decay split, and for "muon" also the hidden-matrix / AdamW split."""
    groups = param_groups(chunks, weight_decay)
    return muon_param_groups(groups, chunks) if name == "muon" else groups


def muon_kwargs(training_config) -> dict:
    """`build_optimizer` keyword arguments of the --muon-* flags (TrainingConfig fields of the same names)."""
    t = training_config
    return dict(muon_momentum=t.muon_momentum, muon_use_nesterov=t.muon_use_nesterov,
                muon_num_ns_steps=t.muon_num_ns_steps, muon_scale_mode=t.muon_scale_mode,
                muon_extra_scale_factor=t.muon_extra_scale_factor)


class Muon(AdamW):
    """Muon for the groups with use_muon=True, AdamW (`optimizers.AdamW`) for the others; see the module
    docstring. `lr`, `weight_decay` apply to both parts; `betas`, `eps` to the AdamW part."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 num_ns_steps: int = 5, scale_mode: str = "spectral", extra_scale_factor: float = 0.2,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        _check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay, extra_scale_factor=extra_scale_factor)
        _check_betas(betas)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid muon momentum: {momentum} (must be in [0, 1))")
        if not isinstance(num_ns_steps, int) or num_ns_steps < 1:
            raise ValueError(f"invalid number of Newton-Schulz steps: {num_ns_steps} (must be an integer >= 1)")
        muon_scale(2, 1, scale_mode)  # validates the mode
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, use_muon=False,
                        momentum=momentum, nesterov=nesterov, num_ns_steps=num_ns_steps, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor)
        PredictiveOptimizer.__init__(self, params, defaults)
        # id(inner param) -> (model param, start, end): where the inner parameter lies in the flattened
        # model parameter. Absent: the inner parameter is the model parameter (plain optimizer).
        self._shards: dict[int, tuple[Tensor, int, int]] = {}
        self._ddp = None  # the distributed optimizer's DDP when the pieces are DP shards
        self._muon_model_ids: list[set[int]] = []  # per param group: ids of its model params
        self._group_index, self._group_params = 0, []

    def add_param_group(self, param_group: dict) -> None:
        # A group without the key would silently train every parameter with AdamW (a plain tensor list
        # cannot say which weights are hidden matrices): refuse it.
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError("Muon needs param groups saying which parameters are hidden matrices (key "
                             "'use_muon'): build them with optim.muon.optimizer_param_groups('muon', chunks, wd)")
        super().add_param_group(param_group)

    def attach_shards(self, shards: list[tuple[Tensor, Tensor, int, int]], model_groups: list[dict],
                      ddp=None) -> None:
        """Called by the wrappers holding main params: (inner param, model param, start, end) for every
        inner param, the model param groups (with their use_muon keys, the same on every DP rank), and the
        DDP when the pieces are the distributed optimizer's DP shards (then `step` gathers buckets)."""
        self._shards = {id(inner): (model, start, end) for inner, model, start, end in shards}
        self._ddp = ddp
        if len(model_groups) != len(self.param_groups):
            raise ValueError(f"attach_shards: {len(model_groups)} model groups for "
                             f"{len(self.param_groups)} param groups")
        self._muon_model_ids = [{id(p) for p in g["params"]} if g.get("use_muon") else set() for g in model_groups]

    # -- the Muon step ---------------------------------------------------------------------------

    def init_state(self, group, param, state):
        if not group["use_muon"]:
            return super().init_state(group, param, state)
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["muon_update"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states):
        if not group["use_muon"]:
            return super()._step_group(group, params, grads, states)
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p, state in zip(params, states):
            if not state:
                self.init_state(group, p, state)
        buffers = [s["momentum_buffer"] for s in states]
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        updates = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
        orthogonal = self._orthogonalise(group, params, updates)
        _remember(states, "muon_update", orthogonal)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        directions = [s["muon_update"] for s in states]
        torch._foreach_add_(params, directions, alpha=-lr)
        return _Direction(directions)

    def _direction(self, group, params, states):
        if not group["use_muon"]:
            return super()._direction(group, params, states)
        return _Direction([s["muon_update"] for s in states])

    @torch.no_grad()
    def step(self, closure=None):
        """As PredictiveOptimizer.step, except that under the distributed optimizer a Muon group is visited
        on every DP rank even where this rank holds no piece of it: its bucket all-gathers are collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                if group["use_muon"] and self._ddp is not None:
                    self._gather_dp(index, [], [])
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Muon does not support sparse gradients")
            states = [self.state[p] for p in params]
            for state in states:
                self._kept_direction.pop(id(state), None)
            self._group_index, self._group_params = index, params  # the tensors themselves: .data views
            # are new objects, without the TP attributes and ids the layout is looked up by
            d = self._step_group(group, [p.data for p in params], [p.grad for p in params], states)
            if self.keep_direction and d is not None:
                self._keep(states, d)
        return loss

    def _orthogonalise(self, group: dict, params: list[Tensor], updates: list[Tensor]) -> list[Tensor]:
        """scale·O for each parameter (the inner parameter's piece of it), in the parameter's dtype."""
        params = self._group_params
        full_updates = self._gather_dp(self._group_index, params, updates) if self._ddp is not None else None
        tp_size = ps.get_tensor_model_parallel_world_size()
        out = []
        for i, (p, u) in enumerate(zip(params, updates)):
            model, start, end = self._shards.get(id(p), (p, 0, p.numel()))
            local = (full_updates[i] if full_updates is not None else u).reshape(model.shape).float()
            dim = getattr(model, "partition_dim", -1) if getattr(model, "tensor_model_parallel", False) else -1
            if tp_size > 1 and dim >= 0:  # orthogonalise the whole TP-sharded matrix, keep this rank's slice
                parts = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                full = torch.cat(parts, dim=dim)
            else:
                full = local
            o = newton_schulz(full, group["num_ns_steps"])
            o.mul_(muon_scale(full.shape[0], full.shape[1], group["scale_mode"], group["extra_scale_factor"]))
            if full is not local:
                o = o.chunk(tp_size, dim=dim)[ps.get_tensor_model_parallel_rank()]
            out.append(o.reshape(-1)[start:end].reshape(p.shape).to(p.dtype))
        return out

    def _gather_dp(self, index: int, params: list[Tensor], updates: list[Tensor]) -> list[Tensor]:
        """The whole (TP-local) model-parameter U of each inner piece of group `index`, assembled from every
        DP rank's pieces: one fp32 all-gather over the DP group per bucket holding a matrix of that group
        (the same buckets on every DP rank: chosen from the model groups, not from this rank's pieces)."""
        from megatron_po.distributed.ddp import all_gather_single
        ddp = self._ddp
        piece_of = {id(self._shards[id(p)][0]): (p, u) for p, u in zip(params, updates)}
        # the pieces a model param has on this rank: in the distributed optimizer at most one per param
        full_of: dict[int, Tensor] = {}
        for bucket in ddp.buckets:
            if not any(id(p) in self._muon_model_ids[index] for p in bucket.params):
                continue
            lo, hi = ddp.owned_range(bucket)
            buf = torch.zeros(bucket.end - bucket.start, dtype=torch.float32, device=updates[0].device
                              if updates else ddp.grad_buffer.device)
            for model in bucket.params:
                if id(model) in piece_of:
                    p, u = piece_of[id(model)]
                    _, start, end = self._shards[id(p)]
                    p_start = ddp.param_range[id(model)][0]
                    buf[p_start + start - bucket.start:p_start + end - bucket.start].copy_(u.reshape(-1))
            if ddp.dp_size > 1:
                all_gather_single(buf, buf[lo - bucket.start:hi - bucket.start].clone(), ddp.dp_group,
                                  async_op=False)
            for model in bucket.params:
                if id(model) in piece_of:
                    p_start, p_end = ddp.param_range[id(model)]
                    full_of[id(model)] = buf[p_start - bucket.start:p_end - bucket.start]
        return [full_of[id(self._shards[id(p)][0])] for p in params]
