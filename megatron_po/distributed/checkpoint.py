"""Checkpoints through `torch.distributed.checkpoint` (DCP), layout-independent and atomic.

Every tensor is saved under its *global* name (layer numbers counted over the whole model, not the
pipeline stage) and tensor-parallel shards are saved as DTensors sharded along their partition dim,
so DCP stores global tensors and a checkpoint can be loaded under another TP/PP/DP layout. Optimizer
state is keyed by parameter name (`optimizer.<param>.<state>`) for the same reason; state shaped like its
parameter ("like-param": Adam's moments, momentum buffers) is sharded like it, so it reshards too. Which
state keys exist is saved as metadata so an optimizer that has not stepped yet can allocate them before
loading. Weight versions an asynchronous policy must keep across a drain (PipeDream-2BW's older
version) are saved the same way (`policy.<param>.<key>`).

Keys in a checkpoint directory `iter_XXXXXXX/`:
  model.<name>                   weights (global shapes); the fp32 main params under mixed precision, so
                                 a bf16 run's checkpoint keeps full precision and loads into fp32 runs too
  optimizer.<name>.<key>         optimizer state; optimizer_state_keys.<name>: which keys exist, group lr
  policy.<name>.<key>            async weight-policy versions; policy_steps = steps every chunk had taken
  extra                          pickled dict from the caller (train state, config, vocab sizes)
  layout, optimizer_type         pickled (tp, pp, dp, chunks per rank) and the inner optimizer's class
  grad_scaler                    fp16 loss-scaler state
  rng.rank<r>                    each rank's RNG states (restored only under the same layout)
The vocabulary rows (padded to a multiple of --make-vocab-size-divisible-by x TP) are re-padded on load
when the new layout pads differently.

Atomicity: all ranks write into `iter_XXXXXXX.partial/`; after a barrier rank 0 renames it to
`iter_XXXXXXX/` and only then rewrites `latest_checkpointed_iteration.txt` (via a temp file and
`os.replace`). A crash at any point leaves the previous checkpoint and tracker untouched; leftovers of a
crashed save are removed by the next save. Rotation (`keep_last`) runs only after the tracker names the
new checkpoint, and renames a directory away before deleting it so a half-deleted one never looks
complete.

Loading checks the checkpoint before reading it, on every rank, and the ranks agree on the outcome
(one all-gather) so a problem only some ranks can see fails all of them with the same one-line
`UserError` instead of leaving the others blocked in a collective: a missing or truncated `.metadata`
or data file, a parameter missing from the checkpoint or saved with another shape, parameters the
model lacks, a different optimizer.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
# Test-only: "ITERATION:SECONDS:RANK" makes that rank sleep after writing that iteration's files into
# `.partial/` and before it is published, so a test can SIGKILL it in the middle of a save.
TEST_PAUSE_ENV = "MEGATRON_PO_TEST_SAVE_PAUSE"


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


def list_iterations(root: str) -> list[int]:
    """Iterations of the published checkpoints under `root`, ascending (`.partial` ones excluded)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m)


def find_checkpoint(root: str, step: int | None = None) -> int | None:
    """The iteration `--load root [--ckpt-step step]` means, or None when there is no checkpoint yet.

    Without `step`: the tracker's iteration; if the tracker is missing but published checkpoints exist
    (a crash between publishing the first checkpoint and writing the tracker), the newest of them."""
    available = list_iterations(root)
    if step is not None:
        if step not in available:
            have = ", ".join(map(str, available)) or "none"
            raise UserError(f"--ckpt-step {step}: no checkpoint {checkpoint_dir(root, step)} "
                            f"(iterations available: {have})")
        return step
    iteration = read_tracker(root)
    if iteration is None:
        return available[-1] if available else None
    if iteration not in available:
        raise UserError(f"--load {root}: {TRACKER} names iteration {iteration} but "
                        f"{checkpoint_dir(root, iteration)} is missing")
    return iteration


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


def named_parameters_for_load(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """`named_parameters_global` plus the last stage's tied-embedding copy under the embedding's name
    (it must be loaded too, weights and optimizer state alike: it is stepped like the embedding)."""
    out = named_parameters_global(chunks)
    have = {name for name, _ in out}
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "embedding_copy", False) and "embedding.word_embeddings.weight" not in have:
                out.append(("embedding.word_embeddings.weight", p))
                have.add("embedding.word_embeddings.weight")
    return out


_MESH = None


def _tp_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    global _MESH
    if _MESH is None or _MESH.get_group() is not ps.get_tensor_model_parallel_group():
        _MESH = DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), ps.get_device().type)
    return _MESH


def _is_tp_shard(p: torch.Tensor) -> bool:
    return getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1


def _global_view(p: torch.Tensor, t: torch.Tensor):
    """`t` (a param or a state tensor shaped like `p`) as DCP should see it: a DTensor when `p` is a
    tensor-parallel shard, else the plain tensor (replicated across TP/DP; DCP writes one copy)."""
    if _is_tp_shard(p) and t.shape == p.shape:
        from torch.distributed.tensor import DTensor, Shard
        if getattr(p, "partition_stride", 1) != 1:  # Shard(dim) means contiguous slices
            raise UserError("checkpointing a strided tensor-parallel partition is not supported")
        return DTensor.from_local(t, _tp_mesh(), [Shard(p.partition_dim)], run_check=False)
    return t


def _global_shape(p: torch.Tensor) -> tuple:
    shape = list(p.shape)
    if _is_tp_shard(p):
        shape[p.partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return tuple(shape)


def _as_list(optimizers) -> list:
    """One optimizer, a list (one per model chunk in asynchronous training) or None -> a list."""
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


class _Stepped:
    """How one model parameter is stepped: by `inner` (a predictive optimizer), through `tensor` (the
    parameter itself, or its fp32 main param when a mixed-precision wrapper holds one), in `group`."""

    __slots__ = ("wrapper", "inner", "tensor", "group")

    def __init__(self, wrapper, inner, tensor, group):
        self.wrapper, self.inner, self.tensor, self.group = wrapper, inner, tensor, group

    @property
    def state(self) -> dict:
        return self.inner.state[self.tensor]


def _stepped(optimizers) -> dict[int, _Stepped]:
    """id(model param) -> _Stepped, for plain optimizers and mixed-precision wrappers (duck-typed:
    `model_params`/`main_params` aligned lists and the inner optimizer as `.optimizer`)."""
    out = {}
    for opt in _as_list(optimizers):
        if hasattr(opt, "pieces"):
            raise UserError("checkpoints of --use-distributed-optimizer runs are not supported yet: its optimizer "
                            "state is sharded over data-parallel ranks in flat ranges that do not map to "
                            "parameter names")
        wrapped = hasattr(opt, "main_params") and hasattr(opt, "model_params")
        inner = opt.optimizer if wrapped else opt
        pairs = zip(opt.model_params, opt.main_params) if wrapped else \
            [(p, p) for g in opt.param_groups for p in g["params"]]
        group = {id(q): g for g in inner.param_groups for q in g["params"]}
        for p, t in pairs:
            out[id(p)] = _Stepped(opt if wrapped else None, inner, t, group[id(t)])
    return out


def _layout() -> tuple[int, int, int, int]:
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def _model_and_optimizer_state(names, stepped: dict[int, _Stepped], with_optimizer: bool):
    """DCP entries of the weights and (`with_optimizer`) the optimizer state. The weights are the fp32
    main params when the optimizer holds them, so a checkpoint keeps full precision whatever the model
    dtype, and loading writes them where the optimizer steps (the model copy follows)."""
    state = {}
    for name, p in names:
        state[f"model.{name}"] = _global_view(p, stepped[id(p)].tensor.data if id(p) in stepped else p.data)
    state_keys = {}
    if with_optimizer:
        for name, p in names:
            if id(p) not in stepped:  # frozen: no optimizer state
                continue
            s = stepped[id(p)]
            st = s.inner.state.get(s.tensor, {})
            # "like-param" state is sharded like its parameter; other tensors (step counters) are small.
            state_keys[name] = {k: (("like-param" if v.shape == p.shape else tuple(v.shape)), v.dtype)
                                if torch.is_tensor(v) else None for k, v in st.items()}
            for k, v in st.items():
                state[f"optimizer.{name}.{k}"] = _global_view(p, v) if torch.is_tensor(v) else v
    return state, state_keys


def _grad_scaler(optimizers):
    return next((o.grad_scaler for o in _as_list(optimizers) if getattr(o, "grad_scaler", None) is not None), None)


def _policy_state(names, policy) -> dict:
    """`policy.<name>.<key>` entries of an async weight policy's extra weight versions."""
    if policy is None:
        return {}
    weights = policy.state_dict()["weights"]
    return {f"policy.{name}.{k}": _global_view(p, t) for name, p in names for k, t in weights.get(p, {}).items()}


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


def save_checkpoint(root: str, iteration: int, chunks, optimizer, extra: dict, policy=None,
                    keep_last: int | None = None) -> str:
    """Write a checkpoint of this iteration; collective over all ranks. `policy`: the async weight
    policy of this rank (saved at a drain); `keep_last`: afterwards delete all but the newest N."""
    import torch.distributed.checkpoint as dcp  # heavy import (~1-3 s): only when checkpointing
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for leftover in os.listdir(root):  # of crashed saves or rotations: saves are never concurrent
            if leftover.endswith((".partial", ".deleting")):
                shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)
    dist.barrier()
    names = named_parameters_global(chunks)
    stepped = _stepped(optimizer)
    state, state_keys = _model_and_optimizer_state(names, stepped, bool(stepped))
    for name, p in names:  # per parameter: identical on TP/DP replicas, so DCP keeps one
        if name in state_keys:
            # The lr in effect now: async PipeOptim/SpecTrain predict with it before the next step sets it.
            state[f"optimizer_state_keys.{name}"] = pickle.dumps({"keys": state_keys[name],
                                                                   "lr": stepped[id(p)].group["lr"]})
    if stepped:  # the inner optimizer's class: its state does not depend on the precision wrapper
        state["optimizer_type"] = pickle.dumps(type(next(iter(stepped.values())).inner).__name__)
    if _grad_scaler(optimizer) is not None:  # fp16 loss scale (agreed over ranks, so one copy)
        state["grad_scaler"] = pickle.dumps(_grad_scaler(optimizer).state_dict())
    if policy is not None:
        state.update(_policy_state(names, policy))
        state["policy_steps"] = pickle.dumps(policy.state_dict()["steps"])
    state["extra"] = pickle.dumps(extra)
    state["layout"] = pickle.dumps(_layout())
    state[f"rng.rank{dist.get_rank()}"] = pickle.dumps(rng_state())
    dcp.save(state, checkpoint_id=partial)
    _test_pause(iteration)
    dist.barrier()
    if dist.get_rank() == 0:
        publish(root, iteration, keep_last)
    dist.barrier()
    return final


def publish(root: str, iteration: int, keep_last: int | None = None) -> None:
    """Make the fully written `iter_N.partial/` the checkpoint of iteration N: rename it, then point
    the tracker at it, then rotate. One process (rank 0) only."""
    final = checkpoint_dir(root, iteration)
    old = None
    if os.path.exists(final):  # saving an iteration again (e.g. after --finetune): keep it until replaced
        old = final + ".deleting"
        os.replace(final, old)
    os.replace(final + ".partial", final)
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)  # the renames themselves survive a power loss
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last:
        rotate_checkpoints(root, keep_last)


def rotate_checkpoints(root: str, keep_last: int) -> list[int]:
    """Delete published checkpoints beyond the newest `keep_last`, never the one the tracker names;
    returns the deleted iterations."""
    keep = set(list_iterations(root)[-keep_last:])
    tracked = read_tracker(root)
    if tracked is not None:
        keep.add(tracked)
    deleted = []
    for it in list_iterations(root):
        if it not in keep:
            doomed = checkpoint_dir(root, it) + ".deleting"
            os.replace(checkpoint_dir(root, it), doomed)  # atomic: no half-deleted iter_N is ever visible
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(it)
    return deleted


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _test_pause(iteration: int) -> None:
    spec = os.environ.get(TEST_PAUSE_ENV)
    if spec:
        it, seconds, rank = spec.split(":")
        if int(it) == iteration and int(rank) == dist.get_rank():
            time.sleep(float(seconds))


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def read_metadata(path: str):
    """DCP metadata of a checkpoint directory, after checking that every data file it points to is
    there and long enough. Bad input raises UserError (one line naming the file)."""
    from torch.distributed.checkpoint import FileSystemReader
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(meta_file):
        raise UserError(f"{meta_file} is missing: not a complete checkpoint")
    try:
        md = FileSystemReader(path).read_metadata()
        storage = md.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # truncated or garbled pickle
        raise UserError(f"{meta_file} is corrupt or truncated ({type(e).__name__}: {_first_line(e)})") from None
    for rel, size in sorted(needed.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise UserError(f"{f} is missing (the checkpoint's .metadata refers to it)")
        have = os.path.getsize(f)
        if have < size:
            raise UserError(f"{f} is truncated: {have} bytes, the checkpoint's .metadata needs {size}")
    return md


def _agree(error: str | None, payload=None) -> tuple[str | None, list]:
    """All-gather (error, payload) over every rank: returns the first rank's error (or None) and
    every rank's payload, so all ranks take the same decision."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error, [payload]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, payload))
    return next((e for e, _ in gathered if e), None), [p for _, p in gathered]


# Their rows are the (padded) vocabulary: padded to a multiple of --make-vocab-size-divisible-by x TP,
# so their row count may change with the layout. Loading re-pads them (rows beyond the tokenizer's
# vocabulary are never produced as inputs or labels; new ones start at zero).
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _repadded(name: str, saved: tuple, shape: tuple, vocab_size: int | None) -> bool:
    return (name in VOCAB_PARAMS and vocab_size is not None and saved[1:] == shape[1:]
            and min(saved[0], shape[0]) >= vocab_size)


def _check_fits(md, names, stepped: dict, load_optim: bool, vocab_size: int | None) -> str | None:
    """This rank's first reason why the checkpoint cannot be loaded into its parameters, or None."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = md.state_dict_metadata
    for name, p in names:
        saved = meta.get(f"model.{name}")
        if not isinstance(saved, TensorStorageMetadata):
            return f"parameter {name} is not in the checkpoint (saved from another model configuration?)"
        shape = _global_shape(p)
        if tuple(saved.size) != shape and not _repadded(name, tuple(saved.size), shape, vocab_size):
            return f"parameter {name} has shape {tuple(saved.size)} in the checkpoint but {shape} in this model"
    if load_optim:
        missing = next((n for n, p in names if id(p) in stepped and f"optimizer_state_keys.{n}" not in meta), None)
        if missing is not None:
            return f"no optimizer state for parameter {missing}; use --no-load-optim to load the weights only"
    return None


def load_checkpoint(root: str, chunks, optimizer, load_optim: bool = True, load_rng: bool = True,
                    step: int | None = None, policy=None) -> dict:
    """Load checkpoint `step` (default: the tracker's) under `root` into the model (and optimizer, and
    the async weight `policy`); return its `extra`. Collective over all ranks."""
    iteration = find_checkpoint(root, step) if os.path.isdir(root) else None
    if iteration is None:
        raise UserError(f"--load {root}: no checkpoint there" if os.path.isdir(root)
                        else f"--load {root}: no such directory")
    path = checkpoint_dir(root, iteration)
    where = f"--load {path}"

    md, error = None, None
    try:
        md = read_metadata(path)  # its messages name the bad file
        if "extra" not in md.state_dict_metadata:
            error = f"{where}: not a megatron_po checkpoint (no 'extra' entry)"
    except UserError as e:
        error = str(e)
    error, _ = _agree(error)
    if error:
        raise UserError(error)
    meta = md.state_dict_metadata
    names = named_parameters_for_load(chunks)
    stepped = _stepped(optimizer)
    load_optim = load_optim and bool(stepped)

    # Small pickled entries first: extra, which optimizer state to allocate, RNG, policy step count.
    rng_key = f"rng.rank{dist.get_rank()}"
    small = {"extra": b"", "layout": b"", "optimizer_type": b"", "grad_scaler": b"", "policy_steps": b"", rng_key: b""}
    small.update({f"optimizer_state_keys.{n}": b"" for n, _ in names} if load_optim else {})
    small = {k: v for k, v in small.items() if k in meta}
    _dcp_load(small, path)
    extra = pickle.loads(small["extra"])

    # Does it fit? Every rank checks its own parameters, rank 0 the checkpoint's surplus; all agree.
    misfit = _check_fits(md, names, stepped, load_optim, extra.get("vocab_size"))
    error, all_names = _agree(f"{where}: {misfit}" if misfit else None, [n for n, _ in names])
    if error is None and dist.get_rank() == 0:
        ours = {n for rank_names in all_names for n in rank_names}
        extra_params = sorted(k[len("model."):] for k in meta if k.startswith("model.") and k[len("model."):] not in ours)
        if extra_params:
            error = (f"{where}: the checkpoint has parameter {extra_params[0]} that this model lacks "
                     f"({len(extra_params)} such; saved from another model configuration?)")
    error, _ = _agree(error)
    if error:
        raise UserError(error)

    if load_optim:
        ours = type(next(iter(stepped.values())).inner).__name__
        theirs = pickle.loads(small["optimizer_type"]) if "optimizer_type" in small else ours
        if theirs != ours:  # every rank reads the same entry: no agreement needed
            raise UserError(f"{where}: the checkpoint holds {theirs} optimizer state but this run uses {ours}; "
                            "use --no-load-optim to load the weights only")
        # Allocate state the optimizer has not created yet, so DCP can load into it in place.
        for name, p in names:
            if id(p) not in stepped:
                continue
            s = stepped[id(p)]
            st = s.state
            saved = pickle.loads(small[f"optimizer_state_keys.{name}"])
            s.group["lr"] = saved["lr"]
            for k, spec in saved["keys"].items():
                if k in st:
                    continue
                if spec is None:
                    st[k] = 0
                elif spec[0] == "like-param":
                    st[k] = torch.zeros_like(s.tensor, dtype=spec[1])
                else:
                    st[k] = torch.zeros(spec[0], dtype=spec[1], device=s.tensor.device)
        if "grad_scaler" in small and _grad_scaler(optimizer) is not None:
            for opt in _as_list(optimizer):
                if getattr(opt, "grad_scaler", None) is not None:
                    opt.grad_scaler.load_state_dict(pickle.loads(small["grad_scaler"]))
    state, _ = _model_and_optimizer_state(names, stepped, load_optim)
    load_policy = policy is not None and "policy_steps" in small
    policy_weights = {}
    if load_policy:
        for name, p in names:
            for key in sorted(k[len(f"policy.{name}."):] for k in meta if k.startswith(f"policy.{name}.")):
                buf = torch.empty_like(p.data)
                policy_weights.setdefault(p, {})[key] = buf
                state[f"policy.{name}.{key}"] = _global_view(p, buf)
    repad = _repad_buffers(state, names, meta)
    _dcp_load(state, path)
    for k, v in state.items():  # non-tensor values are returned, not filled in place
        if k.startswith("optimizer.") and not torch.is_tensor(v):
            name, key = k[len("optimizer."):].rsplit(".", 1)
            stepped[id(dict(names)[name])].state[key] = v
    for local, full, rows in repad:  # this rank's rows of the re-padded vocabulary
        n = max(0, min(local.shape[0], full.shape[0] - rows))
        local.zero_()
        local[:n].copy_(full[rows:rows + n])
    for wrapper in {id(x.wrapper): x.wrapper for x in stepped.values() if x.wrapper is not None}.values():
        wrapper.restore_model_params()  # the weights were loaded into its fp32 main params
    if repad and dist.get_rank() == 0:
        print(f"> {path}: vocabulary re-padded from {repad[0][1].shape[0]} rows to this run's padding", flush=True)
    if load_policy:
        policy.load_state_dict({"steps": pickle.loads(small["policy_steps"]), "weights": policy_weights})
    if load_rng:
        if rng_key in small and pickle.loads(small["layout"]) == _layout():
            set_rng_state(pickle.loads(small[rng_key]))
        elif dist.get_rank() == 0:
            print(f"> {path} was saved under another parallel layout: random generators freshly seeded",
                  flush=True)
    return extra


def _repad_buffers(state: dict, names, meta) -> list:
    """Swap the vocabulary tensors whose row count differs from the checkpoint's for full-size buffers
    of the checkpoint's shape (DCP assembles them whole); returns (target, buffer, first global row)."""
    out = []
    params = dict(names)
    for key, value in list(state.items()):
        if not torch.is_tensor(value) or key not in meta:
            continue
        name = next((n for n in VOCAB_PARAMS if key == f"model.{n}" or key.startswith((f"optimizer.{n}.",
                                                                                        f"policy.{n}."))), None)
        saved = tuple(meta[key].size)
        if name is None or name not in params or saved == tuple(value.shape):
            continue
        p = params[name]
        local = value.to_local() if hasattr(value, "to_local") else value
        full = torch.empty(saved, dtype=local.dtype, device=local.device)
        state[key] = full
        out.append((local, full, ps.get_tensor_model_parallel_rank() * local.shape[0] if _is_tp_shard(p) else 0))
    return out


def _dcp_load(state: dict, path: str) -> None:
    """dcp.load whose failures (DCP raises them on every rank, as a BaseException) become UserError."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it reads in one process
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise UserError(f"--load {path}: cannot read the checkpoint: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """A one-line summary of a (possibly long, chained, multi-rank) exception."""
    failures = getattr(e, "failures", None)
    if failures:  # DCP's CheckpointException: {rank: (exception, traceback)}
        rank, (exc, _) = sorted(failures.items())[0]
        return f"{type(exc).__name__} on rank {rank}: {_first_line(exc)}"
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in text:
        if "size" in line or "shape" in line or "Missing key" in line or "missing" in line:
            return line
    return text[0] if text else type(e).__name__


# --------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# One process, no torch.distributed: consolidation (tools/checkpoint_convert.py)
# --------------------------------------------------------------------------------------------------


def read_full_checkpoint(root: str, step: int | None = None, prefix: str = "model.",
                         progress: bool = True) -> tuple[dict[str, torch.Tensor], dict, int]:
    """({name: full tensor} of the entries under `prefix`, extra, iteration) of a checkpoint, read in
    this process alone (DCP without a process group assembles each tensor from every rank's shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not os.path.isdir(root):
        raise UserError(f"--load {root}: no such directory")
    iteration = find_checkpoint(root, step)
    if iteration is None:
        raise UserError(f"--load {root}: no checkpoint there")
    path = checkpoint_dir(root, iteration)
    md = read_metadata(path)
    small = {"extra": b""}
    _dcp_load(small, path)
    extra = pickle.loads(small["extra"])
    specs = {k: v for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    out = {}
    # A few hundred MB per read keeps memory near the size of the result and gives progress steps.
    groups, group, size = [], {}, 0
    for k, v in specs.items():
        group[k] = v
        size += v.size.numel() * v.properties.dtype.itemsize
        if size > 256 << 20:
            groups.append(group)
            group, size = {}, 0
    if group:
        groups.append(group)
    from tqdm import tqdm
    total = sum(v.size.numel() * v.properties.dtype.itemsize for v in specs.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {os.path.basename(path)}",
              disable=not progress) as bar:
        for group in groups:
            state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in group.items()}
            _dcp_load(state, path)
            for k, t in state.items():
                out[k[len(prefix):]] = t
                bar.update(t.numel() * t.element_size())
    return out, extra, iteration
