"""Muon (Jordan et al. 2024; Moonshot AI's "Muon is scalable", 2025) as a predictive optimizer.

One optimizer object, two rules chosen per param group by its "use_muon" key (`muon_param_groups` sets it):

- hidden weight matrices (use_muon=True): momentum, Newton-Schulz orthogonalisation, decoupled decay

      B ← μ·B + G;   U = G + μ·B (Nesterov) or B;   O = NewtonSchulz(U);   W ← W(1 - lr·λ) - lr·scale·O

  NewtonSchulz (optim/newton_schulz.py): `num_ns_steps` (5) quintic iterations with the coefficient set of
  `--muon-coefficient-type` (default "simple": Keller Jordan's (3.4445, -4.7750, 2.0315) every step), matmuls
  at `--muon-fp32-matmul-prec` (default "medium": bf16, as Megatron-LM; "high" TF32, "highest" fp32).
  Same-shape matrices are orthogonalised together, one batched call per shape. `--muon-gram-newton-schulz`
  (opt-in) runs the same iterations through the Gram matrix on the wide matrices (the MLP's): fewer FLOPs. The momentum is the undamped
  sum B ← μB + G of the shared doc; Keller Jordan's current code keeps the EMA (1-μ)·B instead, which only
  scales U by (1-μ): the orthogonalisation removes the scale, so both give the same O up to the 1e-7 in the
  normalisation.
  scale = extra_scale_factor · f(rows, cols) of the orthogonalised matrix with Megatron's `--muon-scale-mode`:
  spectral √max(rows, cols), unit_rms_norm √(rows/cols), shape_scaling √max(1, rows/cols) (Keller
  Jordan's original). The default here, spectral with extra 0.2, is Moonshot's 0.2·√max(rows, cols), which
  gives the update the RMS of an AdamW update so that AdamW's lr and weight decay carry over; Megatron's
  default extra factor is 1.0 (its lrs are then Muon-sized, not AdamW-sized).
  Fused QKV (`--muon-split-qkv`, on by default as in Megatron): the attention's fused weight holds, per key/
  value group, the group's query rows, then its key rows, then its value rows (models/transformer.py);
  `muon_param_groups` marks it (`muon_qkv_rows` = those three row counts) and the step orthogonalises and
  scales the Q, K and V matrices (every group's rows of each kind) separately, then puts them back.
- everything else (embeddings, output layer, norms, biases): AdamW, exactly `optimizers.AdamW`.
- MoE experts (Megatron's choice): a stacked expert weight [experts, out, in] (models/moe/experts.py) is that
  many matrices, each orthogonalised and scaled on its own as a dense layer's (`_matrices`); the experts'
  biases go to AdamW. The experts are in Muon groups of their own, whose owners are ranks of the
  expert-data-parallel group (the ranks holding the same experts) instead of the data-parallel one.

ΔW for PipeOptim: for the matrices the applied update scale·O, kept per parameter as extra state
`muon_update` (one parameter-sized fp32 tensor: the momentum alone does not determine O, since Nesterov's
U needs the last gradient); for the AdamW part the AdamW ΔW (no extra state). Decoupled decay is excluded
from ΔW unless `include_weight_decay`, as for AdamW. Under the distributed optimizer each rank keeps the
`muon_update` of its own pieces.

Whole matrices. The orthogonalisation of a matrix is not the concatenation of its shards' ones, so:
- data parallelism (optim/muon_dp.py): each matrix is orthogonalised by ONE DP rank, its owner (largest
  first, balanced), and O reaches the others: with replicated state (plain and mixed-precision optimizers)
  by one packed all-gather over DP; under the distributed optimizer (ZeRO-1), whose DP ranks hold pieces
  that cut through matrices (`attach_shards`, called by the wrappers, says where each inner parameter's
  piece lies in its model parameter), by one all-to-all taking the pieces of U to the owners and one taking
  the pieces of O back. Momentum and `muon_update` stay where they were (replicated / sharded). Without
  the distributed optimizer the DP group is parallel_state's: every DP rank must step together, with the
  same (reduced) gradients, as data parallelism requires anyway.
- tensor parallelism (`--muon-tp-mode`): "duplicated" (the default here, exact): the owner's TP ranks
  all-gather their slices of U (one packed all-gather over TP per step), each orthogonalises the whole
  matrix and keeps its slice; the fused QKV weight gathers into exactly the TP=1 weight (each rank holds
  whole key/value groups). "distributed" (exact in exact arithmetic, other rounding): the TP ranks keep
  their slices and sum the Gram matrices over TP at every Newton-Schulz step. "blockwise" (Megatron's
  default; an APPROXIMATION, not Muon's step at TP > 1): each TP rank orthogonalises and scales its own
  slice as if it were a whole matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_po import parallel_state as ps
from megatron_po.distributed.ddp import all_gather_single, is_expert
from megatron_po.optim.muon_dp import assign_owners, owners_to_all, owners_to_pieces, pieces_to_owners
from megatron_po.optim.newton_schulz import (check_precision, coefficients, newton_schulz, newton_schulz_flops,
                                             output_dtype)
from megatron_po.optim.optimizers import (AdamW, PredictiveOptimizer, _check_betas, _check_non_negative, _Direction,
                                          _remember, param_groups)

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "distributed", "blockwise")


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
    biases in groups marked use_muon=False (AdamW). Each group keeps its weight decay and other keys.
    The attention's fused QKV weights are marked for `--muon-split-qkv` (`mark_fused_qkv`)."""
    adamw_ids = set()
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, torch.nn.Embedding) or type(module).__name__ == "VocabParallelEmbedding":
                adamw_ids.update(id(p) for p in module.parameters(recurse=False))
            mark_fused_qkv(module)
        output_layer = getattr(chunk, "output_layer", None)
        if output_layer is not None:
            adamw_ids.update(id(p) for p in output_layer.parameters())
    out = []
    for g in groups:
        hidden = [p for p in g["params"] if p.ndim == 2 and id(p) not in adamw_ids
                  and not getattr(p, "shared_embedding", False) and not is_expert(p)]
        experts = [p for p in g["params"] if p.ndim == 3 and is_expert(p)]  # stacked [E, out, in]; biases: AdamW
        muon_ids = {id(p) for p in hidden + experts}
        rest = [p for p in g["params"] if id(p) not in muon_ids]
        out += [{**g, "params": hidden, "use_muon": True}] if hidden else []
        out += [{**g, "params": experts, "use_muon": True, "experts": True}] if experts else []
        out += [{**g, "params": rest, "use_muon": False}] if rest else []
    return out


class _Matrix:
    """One matrix Muon orthogonalises: a 2-D parameter, or expert `expert`'s [out, in] slice of a stacked MoE
    expert parameter, at element `offset` of the flattened parameter. It answers what the layout reads of a
    matrix (shape, numel, its TP split, its fused-QKV rows) for the slice."""

    def __init__(self, param: Tensor, expert: int | None = None):
        self.param, self.expert = param, expert
        self.shape = tuple(param.shape[-2:])
        self.offset = 0 if expert is None else expert * self.shape[0] * self.shape[1]
        self.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", -1)
        self.partition_dim = dim - 1 if expert is not None and dim >= 0 else dim  # dim 0 of the stack: experts
        self.muon_qkv_rows = getattr(param, "muon_qkv_rows", None) if expert is None else None

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def _matrices(param: Tensor) -> list[_Matrix]:
    return [_Matrix(param)] if param.ndim == 2 else [_Matrix(param, e) for e in range(param.shape[0])]


def _segments(matrices: list[_Matrix], first: int, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(matrix index, start, end within the matrix, offset within the piece) of every matrix of one parameter
    (`matrices[first:]` from its first) that the piece [start, end) of the flattened parameter overlaps."""
    out = []
    for i in range(first, len(matrices)):
        m = matrices[i]
        if i > first and m.offset == 0:
            break  # the next parameter's
        lo, hi = max(start, m.offset), min(end, m.offset + m.numel())
        if lo < hi:
            out.append((i, lo - m.offset, hi - m.offset, lo - start))
    return out


def mark_fused_qkv(module) -> None:
    """If `module` is a self-attention with a fused QKV projection (SelfAttention's `qkv`, TESelfAttention's
    `layernorm_qkv`), tag its weight with `muon_qkv_rows` = (query rows, key rows, value rows) of ONE key/value
    group: the weight's rows are those three blocks, group after group (models/transformer.py)."""
    heads_per_group, head_dim = getattr(module, "heads_per_group", None), getattr(module, "head_dim", None)
    linear = getattr(module, "qkv", None) or getattr(module, "layernorm_qkv", None)
    weight = getattr(linear, "weight", None)
    if heads_per_group is None or head_dim is None or weight is None or weight.ndim != 2:
        return
    weight.muon_qkv_rows = (heads_per_group * head_dim, head_dim, head_dim)


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
                muon_extra_scale_factor=t.muon_extra_scale_factor, muon_fp32_matmul_prec=t.muon_fp32_matmul_prec,
                muon_coefficient_type=t.muon_coefficient_type, muon_split_qkv=t.muon_split_qkv,
                muon_tp_mode=t.muon_tp_mode, muon_gram_newton_schulz=t.muon_gram_newton_schulz)


class Muon(AdamW):
    """Muon for the groups with use_muon=True, AdamW (`optimizers.AdamW`) for the others; see the module
    docstring. `lr`, `weight_decay` apply to both parts; `betas`, `eps` to the AdamW part. The Newton-Schulz
    precision and coefficients, the QKV split and the TP mode are settings of the run, not of a param group
    (so they are not in the state dict, and a checkpoint resumes under the flags it is resumed with)."""

    decoupled_weight_decay = True
    batch_newton_schulz = True  # False: one Newton-Schulz call per matrix (tests: batched = unbatched)

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 num_ns_steps: int = 5, scale_mode: str = "spectral", extra_scale_factor: float = 0.2,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "simple", split_qkv: bool = True,
                 tp_mode: str = "duplicated", gram_newton_schulz: bool = False):
        _check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay, extra_scale_factor=extra_scale_factor)
        _check_betas(betas)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid muon momentum: {momentum} (must be in [0, 1))")
        if not isinstance(num_ns_steps, int) or num_ns_steps < 1:
            raise ValueError(f"invalid number of Newton-Schulz steps: {num_ns_steps} (must be an integer >= 1)")
        muon_scale(2, 1, scale_mode)  # validates the mode
        coefficients(coefficient_type, num_ns_steps)  # validates the set and its step count
        check_precision(fp32_matmul_prec)
        if tp_mode not in TP_MODES:
            raise ValueError(f"invalid muon TP mode {tp_mode!r} (must be one of {', '.join(TP_MODES)})")
        self.fp32_matmul_prec, self.coefficient_type = fp32_matmul_prec, coefficient_type
        self.split_qkv, self.tp_mode = split_qkv, tp_mode
        self.gram_newton_schulz = gram_newton_schulz  # opt-in (--muon-gram-newton-schulz): newton_schulz.py
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, use_muon=False,
                        momentum=momentum, nesterov=nesterov, num_ns_steps=num_ns_steps, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor)
        PredictiveOptimizer.__init__(self, params, defaults)
        # id(inner param) -> (model param, start, end): where the inner parameter lies in the flattened
        # model parameter. Absent: the inner parameter is the model parameter (plain optimizer).
        self._shards: dict[int, tuple[Tensor, int, int]] = {}
        self._ddp = None  # the distributed optimizer's DDP when the pieces are DP shards
        self._muon_models: list[list[Tensor]] = []  # per param group: its model params (Muon groups only)
        self._layouts: dict = {}  # the matrices of a step, their owners and pieces (`_layout`)
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
        DDP when the pieces are the distributed optimizer's DP shards (then `step` moves U and O pieces)."""
        self._shards = {id(inner): (model, start, end) for inner, model, start, end in shards}
        self._ddp = ddp
        if len(model_groups) != len(self.param_groups):
            raise ValueError(f"attach_shards: {len(model_groups)} model groups for "
                             f"{len(self.param_groups)} param groups")
        self._muon_models = [list(g["params"]) if g.get("use_muon") else [] for g in model_groups]
        self._layouts.clear()

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
        on every DP rank even where this rank holds no piece of it: its exchanges are collective, and the
        rank may own (orthogonalise) matrices it holds no piece of."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        requests, self._planned = self._planned, []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params and group["use_muon"] and self._ddp is not None:  # collective: every DP rank
                self._group_index, self._group_params = index, []
                self._orthogonalise(group, [], [])
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Muon does not support sparse gradients")
            self._group_index, self._group_params = index, params  # the tensors themselves: .data views
            # are new objects, without the TP attributes and ids the layout is looked up by
            self._run_group(index, group, params, requests)  # the step, then the planned predictions
        for request in requests:
            request.done = True
        return loss

    def _compilable(self, group):
        # Newton-Schulz (matmuls, TP/DP gathers) is not per-element work: a Muon group's fused tail, the
        # prediction from the kept `muon_update`, runs eagerly after it.
        return not group["use_muon"]

    def _orthogonalise(self, group: dict, params: list[Tensor], updates: list[Tensor]) -> list[Tensor]:
        """scale·O for each parameter (the inner parameter's piece of it), in the parameter's dtype: every
        matrix is orthogonalised by its owner only (module docstring, optim/muon_dp.py)."""
        params = self._group_params
        layout = self._layout(self._group_index, params)
        device = updates[0].device if updates else self._ddp.grad_buffer.device
        # (matrix index, start, end within the matrix, offset within the inner param) of each inner param
        where = [layout.where[id(p)] for p in params]
        dtype = output_dtype(self.fp32_matmul_prec)
        mine = {i: u.reshape(-1)[offset:offset + end - start]  # this rank's U of each matrix it holds any of
                for segments, u in zip(where, updates) for i, start, end, offset in segments}
        if layout.dp_group is None:  # this rank owns every matrix, and holds each whole
            owned = mine
        elif self._ddp is None:  # replicated state: this rank holds the whole U of every matrix
            owned = {i: u for i, u in mine.items() if layout.owners[i] == layout.rank}
        else:
            owned = pieces_to_owners(mine, layout.pieces, layout.owners, layout.numels, layout.dp_group, device)
        results = self._orthogonalise_owned(group, layout, owned)
        if layout.dp_group is not None and self._ddp is None:
            everything = owners_to_all(results, layout.owners, layout.numels, layout.dp_group, dtype, device)
            results = {i: everything[i] for i in mine}
        elif layout.dp_group is not None:
            results = owners_to_pieces(results, layout.pieces, layout.owners, layout.dp_group, dtype, device)
        out = []
        for p, segments in zip(params, where):
            if len(segments) == 1:  # a 2-D weight (or its piece): O as it came
                o = results[segments[0][0]].reshape(-1).float()
            else:
                o = torch.empty(p.numel(), dtype=torch.float32, device=device)
                for i, start, end, offset in segments:
                    o[offset:offset + end - start].copy_(results[i].reshape(-1))
            for i, start, end, offset in segments:
                piece = o[offset:offset + end - start]
                for lo, hi, scale in layout.scales[i]:  # rows [lo, hi) of the TP-local matrix are scaled by `scale`
                    cols = layout.models[i].shape[1]
                    a, b = max(lo * cols - start, 0), min(hi * cols - start, piece.numel())
                    if a < b:
                        piece[a:b].mul_(scale)
            out.append(o.view(p.shape).to(p.dtype))
        return out

    # -- which matrices, where, and who orthogonalises them --------------------------------------

    def _layout(self, index: int, params: list[Tensor]) -> _Layout:
        """The matrices of group `index` this step and who orthogonalises each (cached). Under the
        distributed optimizer: every model matrix of the group (the same list on every DP rank) and the
        flat range of it each DP rank holds; otherwise the step's own parameters, each held whole."""
        key = index if self._ddp is not None else (index, tuple(id(p) for p in params))
        if key in self._layouts:
            return self._layouts[key]
        group = self.param_groups[index]
        layout = _Layout()
        if self._ddp is not None:
            ddp = self._ddp
            bucket_of = {id(p): bucket for bucket in ddp.buckets for p in bucket.params}
            models = self._muon_models[index]
            # The ranks sharing these matrices' shards (experts: their expert-data-parallel group), alike for all
            shard_groups = {(b.group, b.size, b.rank) for b in (bucket_of[id(m)] for m in models)}
            assert len(shard_groups) <= 1, "a Muon group mixes dense and expert parameters"
            group_, world, layout.rank = shard_groups.pop() if shard_groups else (ddp.dp_group, ddp.dp_size, ddp.dp_rank)
            layout.dp_group = group_ if world > 1 else None
            first = {}  # id(model) -> index of its first matrix
            for m in models:
                first[id(m)] = len(layout.models)
                layout.models += _matrices(m)
            layout.pieces = [{} for _ in range(world)]
            for m in models:
                m_start, m_end = ddp.param_range[id(m)]
                for r in range(world):
                    lo, hi = bucket_of[id(m)].shard(r, world)
                    for i, start, end, _ in _segments(layout.models, first[id(m)], lo - m_start, hi - m_start):
                        layout.pieces[r][i] = (start, end)
            for p in params:
                model, start, end = self._shards[id(p)]
                layout.where[id(p)] = _segments(layout.models, first[id(model)], start, end)
        else:
            experts = bool(group.get("experts"))
            size = ((ps.get_expert_data_parallel_world_size() if experts else ps.get_data_parallel_world_size())
                    if ps.model_parallel_is_initialized() else 1)
            layout.dp_group = (ps.get_expert_data_parallel_group() if experts else ps.get_data_parallel_group()) \
                if size > 1 else None
            layout.rank, world = ((dist.get_rank(layout.dp_group) if size > 1 else 0), size)
            for p in params:
                model = self._shards.get(id(p), (p,))[0]
                first = len(layout.models)
                layout.models += _matrices(model)
                layout.where[id(p)] = _segments(layout.models, first, 0, p.numel())
        layout.numels = [m.numel() for m in layout.models]
        shapes = [self._orthogonalised_shapes(m) for m in layout.models]
        held = None
        if layout.pieces:
            held = [[end - start for start, end in (layout.pieces[r].get(i, (0, 0)) for r in range(world))]
                    for i in range(len(layout.models))]
        layout.owners = assign_owners([sum(newton_schulz_flops(r, c, group["num_ns_steps"]) for r, c in parts)
                                       for parts in shapes], world, held)
        layout.scales = [self._row_scales(group, m, parts) for m, parts in zip(layout.models, shapes)]
        self._layouts[key] = layout
        return layout

    def _tp_dim(self, model: Tensor) -> int:
        """The dim along which TP ranks hold slices of `model` (-1: whole on every TP rank, or TP = 1)."""
        if ps.get_tensor_model_parallel_world_size() == 1 or not getattr(model, "tensor_model_parallel", False):
            return -1
        return getattr(model, "partition_dim", -1)

    def _qkv_rows(self, model: Tensor) -> tuple[int, int, int] | None:
        return getattr(model, "muon_qkv_rows", None) if self.split_qkv else None

    def _orthogonalised_shapes(self, model: Tensor) -> list[tuple[int, int]]:
        """(rows, cols) of each matrix Newton-Schulz sees for `model`: the whole matrix, or its slice with
        --muon-tp-mode blockwise; the Q, K and V parts of a fused QKV weight when split."""
        rows, cols = model.shape
        dim, tp = self._tp_dim(model), ps.get_tensor_model_parallel_world_size()
        if dim >= 0 and self.tp_mode != "blockwise":
            rows, cols = (rows * tp, cols) if dim == 0 else (rows, cols * tp)
        qkv = self._qkv_rows(model)
        if qkv is None:
            return [(rows, cols)]
        groups = rows // sum(qkv)
        return [(groups * n, cols) for n in qkv]

    def _row_scales(self, group: dict, model: Tensor, parts: list[tuple[int, int]]) -> list[tuple[int, int, float]]:
        """(first row, end row, scale) runs covering the TP-local matrix: one run, or for a split QKV weight
        each key/value group's query, key and value rows with their part's scale (equal neighbours merged)."""
        scales = [muon_scale(r, c, group["scale_mode"], group["extra_scale_factor"]) for r, c in parts]
        qkv = self._qkv_rows(model)
        if qkv is None:
            return [(0, model.shape[0], scales[0])]
        runs: list[tuple[int, int, float]] = []
        row = 0
        for _ in range(model.shape[0] // sum(qkv)):
            for n, scale in zip(qkv, scales):
                if runs and runs[-1][2] == scale and runs[-1][1] == row:
                    runs[-1] = (runs[-1][0], row + n, scale)
                else:
                    runs.append((row, row + n, scale))
                row += n
        return runs

    # -- the owner's work -----------------------------------------------------------------------

    def _orthogonalise_owned(self, group: dict, layout: _Layout, owned: dict[int, Tensor]) -> dict[int, Tensor]:
        """The TP-local O (unscaled, in Newton-Schulz's output dtype, flat) of every matrix this rank owns,
        from its TP-local U (`owned`, {matrix index: U}). All TP ranks of this rank's TP group own the same
        matrices (ownership is by DP rank), so the TP collectives line up."""
        indices = sorted(owned)
        models = [layout.models[i] for i in indices]
        mats = [owned[i].reshape(m.shape).float() for i, m in zip(indices, models)]
        dims = [self._tp_dim(m) for m in models]
        if self.tp_mode == "duplicated":
            mats = self._gather_tp(mats, dims)
        jobs = []  # (matrix position, part, U, transpose, TP group)
        tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        for k, (m, u) in enumerate(zip(models, mats)):
            distributed = self.tp_mode == "distributed" and dims[k] >= 0
            for j, part in enumerate(_split_rows(u, self._qkv_rows(m))):
                # TP-distributed: the slices must split X's columns, so iterate on the transpose of a row slice
                jobs.append(((k, j), part, dims[k] == 0 if distributed else None, tp_group if distributed else None))
        done = self._newton_schulz(group, jobs)
        results = {}
        for k, (i, m) in enumerate(zip(indices, models)):
            qkv = self._qkv_rows(m)
            o = _join_rows([done[(k, j)] for j in range(3 if qkv else 1)], qkv)
            if self.tp_mode == "duplicated" and dims[k] >= 0:
                o = o.chunk(ps.get_tensor_model_parallel_world_size(), dim=dims[k])[ps.get_tensor_model_parallel_rank()]
            results[i] = o.reshape(-1)
        return results

    def _gather_tp(self, mats: list[Tensor], dims: list[int]) -> list[Tensor]:
        """Whole matrices from the TP slices (fp32): ONE all-gather over the TP group for all of them."""
        sliced = [k for k, d in enumerate(dims) if d >= 0]
        if not sliced:
            return mats
        tp = ps.get_tensor_model_parallel_world_size()
        send = torch.cat([mats[k].reshape(-1) for k in sliced])
        received = torch.empty(tp * send.numel(), dtype=send.dtype, device=send.device)
        all_gather_single(received, send, ps.get_tensor_model_parallel_group(), async_op=False)
        received = received.view(tp, -1)
        out, offset = list(mats), 0
        for k in sliced:
            n = mats[k].numel()
            out[k] = torch.cat([received[r, offset:offset + n].view(mats[k].shape) for r in range(tp)], dim=dims[k])
            offset += n
        return out

    def _newton_schulz(self, group: dict, jobs: list) -> dict:
        """Run every job's Newton-Schulz, the matrices of one shape in one batched call. A tall matrix is
        iterated on as its transpose anyway, so it joins the wide ones of the transposed shape (an MLP's
        up [ffn, h] and down [h, ffn] projections form one batch). TP-distributed jobs keep their
        orientation and batch per TP group."""
        batches: dict = {}
        for key, u, transpose, tp_group in jobs:
            flip = tp_group is None and u.shape[0] > u.shape[1]
            u = u.mT if flip else u
            batch = (tuple(u.shape), transpose, tp_group) if self.batch_newton_schulz else (key,)
            batches.setdefault(batch, []).append((key, u, flip, transpose, tp_group))
        done = {}
        for batch in batches.values():
            _, _, _, transpose, tp_group = batch[0]
            o = newton_schulz(torch.stack([u for _, u, _, _, _ in batch]), group["num_ns_steps"],
                              self.coefficient_type, self.fp32_matmul_prec, transpose=transpose, tp_group=tp_group,
                              gram=self.gram_newton_schulz)
            done.update((key, x.mT if flip else x) for (key, _, flip, _, _), x in zip(batch, o.unbind(0)))
        return done


class _Layout:
    """One Muon group's matrices for a step (`Muon._layout`)."""

    def __init__(self):
        self.models: list[Tensor] = []  # the model matrices (TP-local), in an order every DP rank shares
        self.numels: list[int] = []
        self.owners: list[int] = []  # the DP rank orthogonalising each
        self.scales: list[list[tuple[int, int, float]]] = []  # `Muon._row_scales` of each
        self.pieces: list[dict[int, tuple[int, int]]] = []  # distributed optimizer: per DP rank, the ranges it holds
        self.where: dict[int, tuple[int, int, int]] = {}  # id(inner param) -> (matrix index, start, end)
        self.dp_group = None  # None: nothing to share (DP = 1)
        self.rank = 0


def _split_rows(u: Tensor, qkv: tuple[int, int, int] | None) -> list[Tensor]:
    """[u], or the Q, K and V matrices of a fused QKV weight: per key/value group its q, k and v rows."""
    if qkv is None:
        return [u]
    groups = u.shape[0] // sum(qkv)
    return [part.reshape(-1, u.shape[1]) for part in u.reshape(groups, sum(qkv), u.shape[1]).split(qkv, dim=1)]


def _join_rows(parts: list[Tensor], qkv: tuple[int, int, int] | None) -> Tensor:
    """The inverse of `_split_rows`."""
    if qkv is None:
        return parts[0]
    groups = parts[0].shape[0] // qkv[0]
    return torch.cat([p.reshape(groups, n, p.shape[1]) for p, n in zip(parts, qkv)], dim=1).view(-1, parts[0].shape[1])
