"""PipeOptim's prediction fused into the optimizer step: Ŵ written by the step that made W.

An asynchronous stage at k = 1 steps a chunk and then, as its very next op on that chunk, runs a forward
on the prediction Ŵ = W − s·lr·ΔW (s read from the schedule). Predicting separately before the forward
means reading W and the optimizer state again and rebuilding ΔW from it (or keeping the step's factored
ΔW alive until then: `keep_direction`, 4 bytes per parameter for Adam). Fused, the step writes Ŵ right
after W, from the ΔW it has just computed (Adam's m and √v̂ + ε, ...), which then dies with the step (with
Adam's lower-precision moments, --exp-avg-dtype, from the stored moments it has just rounded: optimizers.Adam).

A `PredictionRequest` says what to write; a policy hands it to the optimizer before the step
(`PredictiveOptimizer.plan_prediction`), and the next `step()` fulfils it for every param group:

- `targets=None`: Ŵ of the parameters that have state as NEW tensors (in `dtype`, default the
  parameters'); the policy points the parameters at them for the forward and back after it
  (`p.data = Ŵ`, `p.data = live`): no copy either way. `request.predicted` = [(parameter, Ŵ)].
- `targets` given (one list per param group, aligned with `group["params"]`): every target receives W,
  then the stateful ones Ŵ, as `predict(out=...)` does; e.g. the owned ranges of the distributed
  optimizer's predicted buffer, which travel in the all-gather the step sends anyway. With `steps=0`
  this is the plain main -> model copy (the mixed-precision wrapper's live weights go through it, so
  that they are written by the same pass).

The per-element rule lives in ONE place: each optimizer's `_step_group` (its update, op for op
torch.optim's foreach code) and `PredictiveOptimizer._extrapolate` (the prediction from the factored ΔW
`_step_group` returns). `group_update` below runs both for one param group:

- by default eagerly, as foreach ops; Ŵ for another dtype is computed in the parameters' precision a few
  tensors at a time (`chunk_numel` elements) and rounded once, so no full-size temporary exists;
- with --torch-compile (`compile_fused_step`, set by `build_optimizer(compile_step=True)`) that same function
  under `torch.compile` (inductor; meant for CUDA, correct on CPU too): the foreach ops of the step and the
  prediction, the cast to bf16 included, are pointwise per element and fuse into one pass over the parameters
  that reads W, g and the state once and writes W, the state, the live bf16 weights and Ŵ (AdamW with bf16
  weights and gradients: 14 bytes read, 12 + 2 + 2 written per parameter). Chosen over a hand-written Triton
  kernel because it compiles the rule itself: a Triton kernel would be a second copy of every optimizer's
  update. Under compile the step counts stay tensors (`optimizers._step_value`, as in torch.optim: no host
  sync) and the scalars that change from step to step (the lr, s·lr) become 0-dim tensors (the lr given as one
  by `_call_update`; `optimizers._per_step`, `_add_scaled`, `_addcdiv`), inputs of the graph instead of
  constants, so an LR schedule does not recompile it; the bias corrections are then computed in fp32 instead
  of in Python doubles: compiled = eager within float rounding, not bitwise. Compiled only where the function
  is pure per-element foreach work: not a group's first step (it creates the state), not Muon's Newton-Schulz
  groups (matmuls and collectives: their fused tail runs eagerly), not with a weight predictor other than the
  linear one (its coefficients read the state on the host). Compiled a slice of STEP_SLICE parameters at a
  time (`_slices`), the slices alike sharing one graph: the compile time is that of a few layers, not of every
  tensor of the group. One compiled function per kind of slice of each param group (its own code object,
  `_own_copy`); a group that fails to compile runs eagerly from then on, with one warning.

Where no fused path applies (the first forward of a segment after a drain, a forward whose preceding op
on the chunk is not the step, a chunk that copies weights instead of swapping pointers, error feedback,
which moves the weights after the step: pipeline/fused_steps.py), the policy predicts as before
(`predict`, `predicted`, `predict_into`: the same `write_group`, its temporaries bounded by
`chunk_numel`), ΔW then rebuilt from the state or taken from `keep_direction`.
"""

from __future__ import annotations

import math
import numbers
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_po.dynamo_import import import_dynamo


def steps_per_group(steps, num_groups: int) -> list[float]:
    """One step count per param group from a number, a tensor or a sequence."""
    if isinstance(steps, Tensor):
        steps = steps.tolist()
    if isinstance(steps, numbers.Real):
        return [float(steps)] * num_groups
    out = [float(s) for s in steps]
    if len(out) != num_groups:
        raise ValueError(f"predict: got {len(out)} step counts for {num_groups} param groups")
    return out


def chunks(numels: list[int], limit: float) -> list[range]:
    """Consecutive index ranges whose element counts add up to at most `limit` (at least one each)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and total + n > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(numels):
        out.append(range(start, len(numels)))
    return out


# --------------------------------------------------------------------------------------------------
# Foreach arguments that stay inputs of a compiled graph (used by the optimizers' update rules)
# --------------------------------------------------------------------------------------------------

_SCALAR_ONE = torch.tensor(1.0)


def _per_step(x):
    """A scalar that changes from step to step (an lr, the prediction's s·lr) as a foreach argument: the
    number itself eagerly; under torch.compile a 0-dim tensor, which the graph takes as an input (a Python
    number is a constant of the graph there, and every new lr would recompile it)."""
    return _SCALAR_ONE * x if torch.compiler.is_compiling() and not isinstance(x, Tensor) else x


def _add_scaled(dst: list[Tensor], src: list[Tensor], alpha, in_place: bool = True) -> list[Tensor]:
    """dst + alpha·src (`torch._foreach_add(_)(dst, src, alpha=alpha)`), in place or as new tensors."""
    if torch.compiler.is_compiling():
        terms = torch._foreach_mul(src, _per_step(alpha))
        return torch._foreach_add(dst, terms) if not in_place else (torch._foreach_add_(dst, terms), dst)[1]
    if not in_place:
        return torch._foreach_add(dst, src, alpha=alpha)
    torch._foreach_add_(dst, src, alpha=alpha)
    return dst


def _addcdiv(dst: list[Tensor], numerators: list[Tensor], denominators: list[Tensor], value,
             in_place: bool = True) -> list[Tensor]:
    """dst + value·numerator/denominator (`torch._foreach_addcdiv(_)`), value one number or one per
    tensor. Under torch.compile the values are tensors (`_per_step`, or derived from the step-count
    tensors), which the foreach overloads take only stacked and on the CPU: written as div, mul, add,
    one pointwise expression that inductor fuses the same way."""
    if torch.compiler.is_compiling():
        value = [_per_step(v) for v in value] if isinstance(value, list) else _per_step(value)
        terms = torch._foreach_mul(torch._foreach_div(numerators, denominators), value)
        return torch._foreach_add(dst, terms) if not in_place else (torch._foreach_add_(dst, terms), dst)[1]
    if not in_place:
        return torch._foreach_addcdiv(dst, numerators, denominators, value)
    torch._foreach_addcdiv_(dst, numerators, denominators, value)
    return dst


@dataclass
class PredictionRequest:
    """Ŵ = W − steps·lr·ΔW for the next step to write (see the module docstring).

    steps: one number, or one per param group. targets: None (new tensors) or one list per param group.
    dtype: the new tensors' dtype (None: the parameters'). After the step, `done` says whether it ran (a
    mixed-precision step skipped for inf/NaN does not) and `predicted` holds [(parameter, Ŵ)] (new
    tensors only: the parameters with state; empty when steps is 0). `slot`: the caller's label."""

    steps: float | list[float]
    include_weight_decay: bool = False
    targets: list[list[Tensor]] | None = None
    dtype: torch.dtype | None = None
    chunk_numel: int = 1 << 20
    slot: object = None
    done: bool = False
    predicted: list[tuple[Tensor, Tensor]] = field(default_factory=list)


def _slice(direction, rows: range):
    """The factored ΔW of the parameters `rows` (a range of positions)."""
    if direction is None:
        return None
    pick = (lambda xs: None if xs is None else [xs[i] for i in rows])
    return type(direction)(pick(direction.numerators), pick(direction.denominators), pick(direction.divisors))


def write_group(optimizer, group: dict, positions: list[int], params: list[Tensor], states: list[dict],
                all_params: list[Tensor], job: tuple, direction) -> list[Tensor] | None:
    """One request's Ŵ for one param group, right after its step. `params`/`states`/`positions`: the
    group's parameters that have state (`.data`) and where they sit in `group["params"]`; `all_params`:
    `.data` of every parameter of the group; `job` = (steps, include_weight_decay, targets or None,
    dtype, chunk_numel); `direction`: the factored ΔW the step computed for `params` (None: the
    optimizer's ΔW now). Returns the new Ŵ tensors (targets None), else None."""
    steps, include_weight_decay, targets, dtype, chunk_numel = job
    limit = math.inf if torch.compiler.is_compiling() else chunk_numel  # compiled: fused, no temporaries
    if targets is not None:
        if targets:
            torch._foreach_copy_(targets, all_params)
        if steps == 0 or not params:
            return None
        for rows in chunks([p.numel() for p in params], limit):
            cparams, cstates = [params[i] for i in rows], [states[i] for i in rows]
            ctargets = [targets[positions[i]] for i in rows]
            same = all(t.dtype == p.dtype for t, p in zip(ctargets, cparams))
            # Ŵ in the optimizer's precision, rounded once when it is copied out.
            dst = ctargets if same else [p.clone() for p in cparams]
            optimizer._extrapolate(group, cparams, cstates, dst, steps, include_weight_decay,
                                   direction=_slice(direction, rows))
            if not same:
                torch._foreach_copy_(ctargets, dst)
        return None
    if steps == 0 or not params:
        return []
    if dtype is None or all(p.dtype == dtype for p in params):
        return optimizer._extrapolate(group, params, states, params, steps, include_weight_decay, in_place=False,
                                      direction=direction)
    out = []
    for rows in chunks([p.numel() for p in params], limit):
        wide = optimizer._extrapolate(group, [params[i] for i in rows], [states[i] for i in rows],
                                      [params[i] for i in rows], steps, include_weight_decay, in_place=False,
                                      direction=_slice(direction, rows))
        out += [w.to(dtype) for w in wide]
    return out


# --------------------------------------------------------------------------------------------------
# One param group's step with its predictions
# --------------------------------------------------------------------------------------------------


COMPILE_BACKEND = "inductor"  # tests check graph breaks and recompilations with "aot_eager" (no codegen)


def run_group(optimizer, index: int, group: dict, params: list[Tensor], requests: list[PredictionRequest]) -> None:
    """Step group `index`'s `params` (those with a gradient; may be none) and write the group's part of
    every request. Fused (ΔW straight from the step, no rebuilding) when the step covers every parameter
    of the group that has state, else each prediction follows the step from the state."""
    jobs = [(steps_per_group(r.steps, len(optimizer.param_groups))[index], r.include_weight_decay,
             None if r.targets is None else [t.data for t in r.targets[index]], r.dtype, r.chunk_numel)
            for r in requests]
    all_data = [p.data for p in group["params"]] if any(job[2] is not None for job in jobs) else []
    fused = bool(params) and all(p.grad is not None or not optimizer.state.get(p) for p in group["params"])
    outs, positions = None, [i for i, p in enumerate(group["params"]) if p.grad is not None]
    if params:
        states = [optimizer.state[p] for p in params]
        for state in states:  # free the old directions before the step allocates new ones
            optimizer._kept_direction.pop(id(state), None)
        data, grads = [p.data for p in params], [p.grad for p in params]
        args = (group, data, grads, states, positions, all_data, jobs if fused else [], optimizer.keep_direction)
        d, outs = _call_update(optimizer, index, args)
        if optimizer.keep_direction and d is not None:
            if d.divisors is not None and any(isinstance(x, Tensor) for x in d.divisors):
                # compiled: the bias corrections came back as (CPU) tensors; the predictions that use the
                # kept ΔW run eagerly and take numbers
                d = d._replace(divisors=[float(x) for x in d.divisors])
            optimizer._keep(states, d)
    if not fused and jobs:
        positions, data, states = optimizer._stepped(group)
        outs = [write_group(optimizer, group, positions, data, states, all_data, job, None) for job in jobs]
    for request, out in zip(requests, outs or []):
        request.predicted += [(group["params"][i], w) for i, w in zip(positions, out or [])]


def _call_update(optimizer, index: int, args: tuple):
    """`group_update(optimizer, *args)`, compiled where that applies, then one slice of the group at a time
    (`_slices`); the slices' ΔW and outputs joined as the whole group's."""
    group, params, grads, states, positions, all_params, jobs, keep = args
    if not compiles(optimizer, index, group, states):
        return group_update(optimizer, *args)
    # The lr changes from step to step: a 0-dim tensor, an input of the graph (as a Python number it
    # would be a constant, and every new lr a recompilation; graphs are static: `compiled_update`). In
    # float32, as `_per_step` makes the other per-step scalars: with a float64 one, inductor's graph of the
    # distributed optimizer's step (PipeOptim, PP 2 x DP 2) moved the loss by 1e-2 after one update.
    traced = {**group, "lr": torch.tensor(group["lr"], dtype=torch.float32)}
    directions, outs = [], []  # per slice
    for rows, first, last in _slices(len(group["params"]), positions):
        sliced_jobs = [job[:2] + (None if job[2] is None else job[2][first:last],) + job[3:] for job in jobs]
        if not rows:  # no parameter of this slice steps: only the copies into the targets
            outs.append([write_group(optimizer, group, [], [], [], all_params[first:last], job, None)
                         for job in sliced_jobs])
            continue
        piece = ([params[i] for i in rows], [grads[i] for i in rows], [states[i] for i in rows],
                 [positions[i] - first for i in rows], all_params[first:last], sliced_jobs, keep)
        d, out = _update_slice(optimizer, index, group, traced, piece)
        directions.append(d)
        outs.append(out)
    return _joined(directions, outs, jobs)


STEP_SLICE = 8  # consecutive parameters of a group per compiled call (`_slices`)


def _slices(count: int, positions: list[int]):
    """The compiled step's slices of a group of `count` parameters whose `positions` step: (the rows of
    `positions` in the slice, its first position, one past its last) per STEP_SLICE parameters. Each slice's
    graph holds its few tensors, and slices alike (shapes, stepping positions) share one (`compiled_update`):
    a model's layers repeat, so the step compiles a few layers' graphs whatever the depth. One graph for a
    whole group grows with its tensor count, inductor's fusion and scheduling faster than linearly: GPT-1.3B's
    groups (99 and 194 tensors) compiled in ~100 s on an H100 (torch 2.11) and 103 s on a 2-core CPU (torch
    2.13), where their slices compile in 19 s (bench/results/step_compile.md)."""
    row = 0
    for first in range(0, count, STEP_SLICE):
        last = min(first + STEP_SLICE, count)
        start = row
        while row < len(positions) and positions[row] < last:
            row += 1
        yield range(start, row), first, last


def _update_slice(optimizer, index: int, group: dict, traced: dict, piece: tuple):
    """`group_update` of one slice (`piece`: its arguments after the group), compiled (`traced`: the group with
    its lr a tensor). A compilation that fails (dynamo and inductor raise before the graph runs, so nothing of
    the slice has been written) leaves the group eager for good, with one warning: slower, never wrong."""
    if optimizer._compiled_updates.get(index, {}) is not None:  # None once a slice failed to compile
        try:
            return compiled_update(optimizer, index, piece)(optimizer, traced, *piece)
        except torch._dynamo.exc.TorchDynamoException as e:
            optimizer._compiled_updates[index] = None
            warnings.warn(f"{type(optimizer).__name__}: the fused step of param group {index} did not compile, "
                          f"running it eagerly ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return group_update(optimizer, group, *piece)


def _joined(directions: list, outs: list[list], jobs: list[tuple]):
    """(ΔW, each job's output) of the whole group, as `group_update` returns them, from the slices' ΔW (the
    slices that step) and outputs (every slice)."""
    d = None
    if directions and all(x is not None for x in directions):
        first = directions[0]
        d = type(first)(*(None if getattr(first, f) is None else [t for x in directions for t in getattr(x, f)]
                          for f in first._fields))
    return d, [None if job[2] is not None else [w for out in outs for w in out[j]] for j, job in enumerate(jobs)]


def group_update(optimizer, group, params, grads, states, positions, all_params, jobs, keep):
    """The fused pass of one param group: `optimizer._step_group` (the update rule), then each job's Ŵ
    from the ΔW it returned (`write_group`). Returns (that ΔW if `keep` else None, the jobs' outputs).
    A step that returns none (Adam with lower-precision moments: ΔW is the stored moments', not the step's)
    has it rebuilt from the state it left: for the whole group when it is kept, else by each job a chunk at
    a time (`_extrapolate`)."""
    d = optimizer._step_group(group, params, grads, states)
    if d is None and keep:
        d = optimizer._direction(group, params, states)
    outs = [write_group(optimizer, group, positions, params, states, all_params, job, d) for job in jobs]
    return (d if keep else None), outs


def compiles(optimizer, index: int, group: dict, states: list[dict]) -> bool:
    """Whether group `index`'s step runs under torch.compile (see the module docstring): with
    `optimizer.compile_fused_step` (--torch-compile), unless compiling it has failed (`_call_update`)."""
    if not optimizer.compile_fused_step or optimizer.predictor is not None:
        return False
    return all(states) and optimizer._compilable(group) and optimizer._compiled_updates.get(index, {}) is not None


def compiled_update(optimizer, index: int, piece: tuple):
    """`group_update` under torch.compile for a slice of group `index` (`piece`: the slice's arguments after
    the group, `_update_slice`): one function, with its own code object (`_own_copy`), per kind of slice (its
    shapes and dtypes, which of its parameters step), so that each code object's recompilations are those of
    one slice, as they were of one group."""
    params, positions, all_params = piece[0], piece[3], piece[4]
    by_kind = optimizer._compiled_updates.setdefault(index, {})
    kind = (tuple((p.shape, p.dtype) for p in params), tuple(positions), len(all_params))
    if kind not in by_kind:
        # Static shapes (dynamic=False): a group's tensors keep their shapes, and what changes per step comes in
        # as tensors (the step counts, the lr: `_call_update`). Torch 2.11 cannot trace views of one flat
        # buffer (the gradient buffer's) once automatic dynamic shapes make its storage size symbolic
        # ("aten.set_.source_Storage ... size_bytes_is_heap_allocated_"), and fell back to the eager step.
        options = _UNCACHED if COMPILE_BACKEND == "inductor" else None  # other backends take no such options
        import_dynamo()  # before torch.compile would, holding our callers' frames (dynamo_import.py)
        by_kind[kind] = torch.compile(_own_copy(group_update), backend=COMPILE_BACKEND, dynamic=False,
                                      options=options)
    return by_kind[kind]


# Inductor's caches of compiled graphs (on disk, across processes) off for the step: on torch 2.13 a
# distributed optimizer's step graph (PipeOptim, PP 2 x DP 2: parameters and targets are views into flat
# buffers) taken from the cache computed wrong weights where the same graph compiled afresh was right
# (tests/test_compiled_layers.py, run twice). Compiling it costs a few seconds per process.
_UNCACHED = {"fx_graph_cache": False}


def _own_copy(fn):
    """`fn` with its own code object. Dynamo keeps compiled graphs, and counts recompilations against its
    limit, per code object; every kind of slice of every optimizer's param group needs its own graph (its
    tensor count and shapes), and one shared code object would exhaust the limit with the chunks of one
    emulator."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
