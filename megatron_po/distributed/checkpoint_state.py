"""The entries a checkpoint holds for a model and its optimizer (the keys: checkpoint_format.py).

The weights are saved from where the optimizer steps them (`stepped_params`): the parameter itself, the
fp32 main param of a mixed-precision wrapper, or, under the distributed optimizer, the piece of it this
data-parallel rank owns; so are the optimizer's per-parameter state and the fp16 loss scalers.
"""

from __future__ import annotations

import torch

from megatron_po import parallel_state as ps
from megatron_po.distributed.checkpoint_dcp import FlatRange, global_view
from megatron_po.distributed.fsdp import local_shard


def as_list(optimizers) -> list:
    """One optimizer, a list (one per model chunk in asynchronous training) or None -> a list."""
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


class _Stepped:
    """How one model parameter is stepped: by `inner` (a predictive optimizer) in `group`, through
    `tensor`: the parameter itself, or its fp32 main param when a mixed-precision wrapper holds one, or,
    under the distributed optimizer, the 1-D fp32 main piece of it that this data-parallel rank owns
    (`offset`: where that piece starts in the flattened parameter; `tensor` None: other ranks own all
    of it). Its optimizer state is `inner.state[tensor]`, shaped like `tensor` where it is per element."""

    __slots__ = ("wrapper", "inner", "tensor", "group", "offset")

    def __init__(self, wrapper, inner, tensor, group, offset=None):
        self.wrapper, self.inner, self.tensor, self.group, self.offset = wrapper, inner, tensor, group, offset

    @property
    def state(self) -> dict:
        return self.inner.state[self.tensor]

    def prepare_load(self, saved_keys) -> None:
        """Make the state that a checkpoint holding the entries `saved_keys` loads into, in place. A
        parameter that has not stepped yet gets its state from the optimizer's own `init_state`, the
        code its first step runs, so the loaded state has the devices, dtypes and shapes a step gives
        it (step counts on the CPU, per-element state on the parameter's device). Entries the checkpoint
        lacks (saved under other optimizer settings) are dropped for the next step to create; entries
        only the checkpoint has are not loaded."""
        state = self.state
        if not state:
            self.inner.init_state(self.group, self.tensor, state)
        for key in [k for k in state if k not in saved_keys]:
            del state[key]

    def view(self, p: torch.Tensor, t: torch.Tensor):
        """`t` (the stepped tensor or one of its state tensors) as DCP should see it: per-element state
        as (a piece of) the global parameter-shaped tensor, small state (step counters) whole."""
        if t.shape != self.tensor.shape:
            return t
        return global_view(p, t) if self.offset is None else FlatRange(p, self.offset, t)


def policy_key(p: torch.Tensor) -> torch.Tensor:
    """The tensor an asynchronous weight policy keys `p`'s extra weight versions by: `p`, or under FSDP2 this
    rank's shard of it (the policy moves shards: pipeline/async_policy.chunk_parameters)."""
    return local_shard(p)


def stepped_params(optimizers) -> dict[int, _Stepped]:
    """id(model param) -> _Stepped, for plain optimizers, mixed-precision wrappers (duck-typed:
    `model_params`/`main_params` aligned lists and the inner optimizer as `.optimizer`) and the
    distributed optimizer (`pieces` of its DDP's flat buffer, at most one per parameter and rank)."""
    out = {}
    for opt in as_list(optimizers):
        if hasattr(opt, "pieces"):
            inner, ranges = opt.optimizer, opt.ddp.param_range
            for group, params in zip(inner.param_groups, opt.model_groups):
                for p in params:
                    out[id(p)] = _Stepped(opt, inner, None, group)
            for piece in opt.pieces:
                s = out[id(piece.param)]
                s.tensor, s.offset = piece.main, piece.start - ranges[id(piece.param)][0]
            continue
        wrapped = hasattr(opt, "main_params") and hasattr(opt, "model_params")
        inner = opt.optimizer if wrapped else opt
        pairs = zip(opt.model_params, opt.main_params) if wrapped else \
            [(p, p) for g in opt.param_groups for p in g["params"]]
        group = {id(q): g for g in inner.param_groups for q in g["params"]}
        for p, t in pairs:
            out[id(p)] = _Stepped(opt if wrapped else None, inner, t, group[id(t)])
    return out


def parallel_layout() -> tuple[int, ...]:
    """(TP, PP, DP, virtual stages), and CP after them when it is > 1 (so layouts saved without CP read
    the same): the random generators are restored only under the same layout."""
    layout = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
              ps.get_data_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size() or 1)
    cp = ps.get_context_parallel_world_size()
    return layout + (cp,) if cp > 1 else layout


def model_and_optimizer_state(names, stepped: dict[int, _Stepped], with_optimizer: bool):
    """DCP entries of the weights and (`with_optimizer`) the optimizer state. The weights are the fp32
    main params when the optimizer holds them, so a checkpoint keeps full precision whatever the model
    dtype, and loading writes them where the optimizer steps (the model copy follows). Under the
    distributed optimizer each rank contributes the pieces it owns (`FlatRange` entries)."""
    state = {}
    for name, p in names:
        s = stepped.get(id(p))
        if s is None:
            state[f"model.{name}"] = global_view(p, p.data)
        elif s.tensor is not None:
            state[f"model.{name}"] = s.view(p, s.tensor.data)
    state_keys = {}
    if with_optimizer:
        for name, p in names:
            s = stepped.get(id(p))
            if s is None or s.tensor is None:  # frozen, or owned by other data-parallel ranks
                continue
            st = s.inner.state.get(s.tensor, {})
            # "like-param" state is sharded like its parameter; other tensors (step counters) are small.
            state_keys[name] = {k: (("like-param" if v.shape == s.tensor.shape else tuple(v.shape)), v.dtype)
                                if torch.is_tensor(v) else None for k, v in st.items()}
            for k, v in st.items():
                state[f"optimizer.{name}.{k}"] = s.view(p, v) if torch.is_tensor(v) else v
    return state, state_keys


def virtual_stage(chunk: int) -> int:
    """The virtual pipeline stage of this rank's model chunk `chunk` (asynchronous training's per-chunk
    checkpoint entries are keyed by it)."""
    return chunk * ps.get_pipeline_model_parallel_world_size() + ps.get_pipeline_model_parallel_rank()


def grad_scalers(optimizers) -> dict[str, object]:
    """fp16 loss scalers by checkpoint key: `grad_scaler` for synchronous training (one scale, agreed
    over all ranks); `grad_scaler.stage<vs>` per model chunk in asynchronous training, where every
    virtual stage keeps its own scale."""
    opts = [o for o in as_list(optimizers) if getattr(o, "grad_scaler", None) is not None]
    if not isinstance(optimizers, (list, tuple)):
        return {"grad_scaler": opts[0].grad_scaler} if opts else {}
    return {f"grad_scaler.stage{virtual_stage(c)}": o.grad_scaler for c, o in enumerate(optimizers) if o in opts}
