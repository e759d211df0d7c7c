"""Checkpoints through `torch.distributed.checkpoint` (DCP), layout-independent and atomic.

Every tensor is saved under its *global* name (layer numbers counted over the whole model, not the
pipeline stage) and tensor-parallel shards are saved as DTensors sharded along their partition dim,
so DCP stores global tensors and a checkpoint can be loaded under another TP/PP/DP layout. Optimizer
state is keyed by parameter name (`optimizer.<param>.<state>`) for the same reason; which state keys
exist is saved as metadata so an optimizer that has not stepped yet can allocate them before loading.

Atomicity: all ranks write into `iter_XXXXXXX.partial/`; after a barrier rank 0 renames it to
`iter_XXXXXXX/` and only then rewrites `latest_checkpointed_iteration.txt` (via a temp file and
`os.replace`). A crash at any point leaves the previous checkpoint and tracker untouched.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise UserError(f"corrupt checkpoint tracker {path}: {text!r} is not an iteration number")
    return int(text)


# --------------------------------------------------------------------------------------------------
# Global names
# --------------------------------------------------------------------------------------------------


def named_parameters_global(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, param) for this rank's parameters, without the last stage's tied-embedding copy
    (it equals the first stage's embedding, which is saved)."""
    out, seen = [], set()
    for chunk in chunks:
        offset = chunk.layer_offset
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if getattr(p, "embedding_copy", False):
                continue
            name = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)
            out.append((name, p))
    return out


_MESH = None


def _tp_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    global _MESH
    if _MESH is None:
        _MESH = DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), ps.get_device().type)
    return _MESH


def _global_view(p: torch.Tensor, t: torch.Tensor):
    """`t` (a param or a state tensor shaped like `p`) as DCP should see it: a DTensor when `p` is a
    tensor-parallel shard, else the plain tensor (replicated across TP/DP; DCP writes one copy)."""
    if getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1 \
            and t.shape == p.shape:
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(t, _tp_mesh(), [Shard(p.partition_dim)], run_check=False)
    return t


def _optimizer_of(optimizers) -> dict:
    """id(param) -> the optimizer that steps it. `optimizers` is one optimizer, a list (one per model
    chunk in asynchronous training) or None."""
    if optimizers is None:
        return {}
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    return {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}


def _model_and_optimizer_state(chunks, optimizers):
    state = {}
    names = named_parameters_global(chunks)
    for name, p in names:
        state[f"model.{name}"] = _global_view(p, p.data)
    state_keys = {}
    owner = _optimizer_of(optimizers)
    if owner:
        for name, p in names:
            st = owner[id(p)].state.get(p, {})
            # "like-param" state is sharded like its parameter; other tensors (step counters) are small.
            state_keys[name] = {k: (("like-param" if v.shape == p.shape else tuple(v.shape)), v.dtype)
                                if torch.is_tensor(v) else None for k, v in st.items()}
            for k, v in st.items():
                state[f"optimizer.{name}.{k}"] = _global_view(p, v) if torch.is_tensor(v) else v
    return state, state_keys


# --------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------


def save_checkpoint(root: str, iteration: int, chunks, optimizer, extra: dict) -> str:
    """Write a checkpoint of this iteration; collective over all ranks."""
    import torch.distributed.checkpoint as dcp  # heavy import (~1-3 s): only when checkpointing
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a crashed save
    dist.barrier()
    state, state_keys = _model_and_optimizer_state(chunks, optimizer)
    for name, keys in state_keys.items():  # per parameter: identical on TP/DP replicas, so DCP keeps one
        state[f"optimizer_state_keys.{name}"] = pickle.dumps(keys)
    state["extra"] = pickle.dumps(extra)
    state[f"rng.rank{dist.get_rank()}"] = pickle.dumps(rng_state())
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return final


def load_checkpoint(root: str, chunks, optimizer, load_optim: bool = True, load_rng: bool = True) -> dict:
    """Load the latest checkpoint under `root` into the model (and optimizer); return its `extra`."""
    import torch.distributed.checkpoint as dcp
    if not os.path.isdir(root):
        raise UserError(f"--load {root}: no such directory")
    iteration = read_tracker(root)
    if iteration is None:
        raise UserError(f"--load {root}: no {TRACKER} (no finished checkpoint there)")
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise UserError(f"--load {root}: tracker names iteration {iteration} but {path} is missing")

    meta = {"extra": b""}
    dcp.load(meta, checkpoint_id=path)
    extra = pickle.loads(meta["extra"])
    owner = _optimizer_of(optimizer)
    if owner and load_optim:
        # Allocate state the optimizer has not created yet, so DCP can load into it in place.
        names = named_parameters_global(chunks)
        saved = {f"optimizer_state_keys.{name}": b"" for name, _ in names}
        try:
            dcp.load(saved, checkpoint_id=path)
        except Exception as e:
            raise UserError(f"--load {path}: no optimizer state for this model's parameters "
                            f"({_first_line(e)}); use --no-load-optim to load the weights only") from None
        for name, p in names:
            st = owner[id(p)].state[p]
            for k, spec in pickle.loads(saved[f"optimizer_state_keys.{name}"]).items():
                if k in st:
                    continue
                if spec is None:
                    st[k] = 0
                elif spec[0] == "like-param":
                    st[k] = torch.zeros_like(p, dtype=spec[1])
                else:
                    st[k] = torch.zeros(spec[0], dtype=spec[1], device=p.device)
    state, _ = _model_and_optimizer_state(chunks, optimizer if load_optim else None)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP reports shape/key mismatches as long chained errors
        raise UserError(f"--load {path}: checkpoint does not fit this model: {_first_line(e)}") from None
    for k, v in state.items():  # non-tensor values are returned, not filled in place
        if k.startswith("optimizer.") and not torch.is_tensor(v):
            name, key = k[len("optimizer."):].rsplit(".", 1)
            p = dict(named_parameters_global(chunks))[name]
            owner[id(p)].state[p][key] = v
    if load_rng:
        key = f"rng.rank{dist.get_rank()}"
        rng = {key: b""}
        try:
            dcp.load(rng, checkpoint_id=path)
            set_rng_state(pickle.loads(rng[key]))
        except Exception:
            pass  # saved under another world size: keep the freshly seeded generators
    return extra


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    for line in text:
        if "size" in line or "shape" in line or "Missing key" in line or "missing" in line:
            return line.strip()
    return text[0] if text else type(e).__name__


def rng_state() -> dict:
    import random

    import numpy as np

    from megatron_po.tensor_parallel import get_rng_tracker
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    from megatron_po.tensor_parallel import get_rng_tracker
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
