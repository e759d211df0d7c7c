"""Checkpoints through `torch.distributed.checkpoint` (DCP), layout-independent and atomic.

Every tensor is saved under its *global* name (layer numbers counted over the whole model, not the
pipeline stage) and tensor-parallel shards are saved as DTensors sharded along their partition dim,
so DCP stores global tensors and a checkpoint can be loaded under another TP/PP/DP layout. Optimizer
state is keyed by parameter name (`optimizer.<param>.<state>`) for the same reason; state shaped like its
parameter ("like-param": Adam's moments, momentum buffers) is sharded like it, so it reshards too. Which
state keys exist is saved as metadata so an optimizer that has not stepped yet can allocate them before
loading. Weight versions an asynchronous policy must keep across a drain (PipeDream-2BW's older
version) are saved the same way (`policy.<param>.<key>`).

The distributed optimizer (ZeRO-1) writes the same per-parameter tensors: its fp32 main params and
per-element state live in flat ranges of a padded buffer that ignore parameter boundaries, and each
rank writes the piece of each parameter it owns as DCP chunks of that parameter's global tensor at the
piece's offset (`_FlatRange`: no gathering, no extra memory). Loading reads each rank's own ranges back,
so sharded and unsharded runs and any DP (TP, PP, virtual pipeline) layouts load each other's
checkpoints, optimizer state included.

Keys in a checkpoint directory `iter_XXXXXXX/`:
  model.<name>                   weights (global shapes); the fp32 main params under mixed precision, so
                                 a bf16 run's checkpoint keeps full precision and loads into fp32 runs too
  optimizer.<name>.<key>         optimizer state; optimizer_state_keys.<name>: which keys exist, group lr
  policy.<name>.<key>            async weight-policy versions; policy_steps = steps every chunk had taken
  extra                          pickled dict from the caller (train state, config, vocab sizes)
  layout, optimizer_type         pickled (tp, pp, dp, chunks per rank) and the inner optimizer's class
  grad_scaler                    fp16 loss-scaler state (grad_scaler.stage<vs>: each virtual stage's own
                                 in asynchronous training; another stage count takes the smallest scale)
  rng.rank<r>                    each rank's RNG states (restored only under the same layout)
The vocabulary rows (padded to a multiple of --make-vocab-size-divisible-by x TP) are re-padded on load
when the new layout pads differently.

Atomicity: all ranks write into `iter_XXXXXXX.partial/`; after a barrier rank 0 renames it to
`iter_XXXXXXX/` and only then rewrites `latest_checkpointed_iteration.txt` (via a temp file and
`os.replace`). A crash at any point leaves the previous checkpoint and tracker untouched; leftovers of a
crashed save are removed by the next save. Rotation (`keep_last`) runs only after the tracker names the
new checkpoint, and renames a directory away before deleting it so a half-deleted one never looks
complete. Before the rename the ranks write `checksums.json` (checkpoint_integrity.py), verified on load.
A save that fails in the environment (disk full, read-only) stops every rank with one SaveError line
naming the path and the OS error, after removing its own `.partial` (docs/checkpoint_reliability.md).

Loading checks the checkpoint before reading it, on every rank, and the ranks agree on the outcome
(one all-gather) so a problem only some ranks can see fails all of them with the same one-line
`UserError` instead of leaving the others blocked in a collective: a missing or truncated `.metadata`
or data file, a parameter missing from the checkpoint or saved with another shape, parameters the
model lacks, a different optimizer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import re
import shutil
import time

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.distributed.agreement import agree
from megatron_po.distributed.checkpoint_integrity import checksum_checkpoint, has_manifest, verify_share
from megatron_po.errors import SaveError, UserError

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
    (it equals the first stage's embedding, which is saved). Transformer Engine layers' parameters get
    their local twins' names (te_layout.local_name), so either --transformer-impl loads the checkpoint."""
    from megatron_po.models.te_layout import local_name
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
            out.append((local_name(name), p))
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

    def view(self, p: torch.Tensor, t: torch.Tensor):
        """`t` (the stepped tensor or one of its state tensors) as DCP should see it: per-element state
        as (a piece of) the global parameter-shaped tensor, small state (step counters) whole."""
        if t.shape != self.tensor.shape:
            return t
        return _global_view(p, t) if self.offset is None else _FlatRange(p, self.offset, t)


def _stepped(optimizers) -> dict[int, _Stepped]:
    """id(model param) -> _Stepped, for plain optimizers, mixed-precision wrappers (duck-typed:
    `model_params`/`main_params` aligned lists and the inner optimizer as `.optimizer`) and the
    distributed optimizer (`pieces` of its DDP's flat buffer, at most one per parameter and rank)."""
    out = {}
    for opt in _as_list(optimizers):
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


# --------------------------------------------------------------------------------------------------
# Distributed-optimizer pieces as chunks of the global tensors
# --------------------------------------------------------------------------------------------------


def _blocks(shape: tuple, a: int, b: int) -> list[tuple[int, tuple, tuple]]:
    """(flat start, offsets, sizes) of rectangular blocks that together cover the row-major flat range
    [a, b) of a tensor of `shape`, each contiguous in memory: a partial first row, full rows, a partial
    last row, the partial rows split the same way one dimension down (at most 2·ndim − 1 blocks)."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(a, (a,) if shape else (), (b - a,) if shape else ())]
    inner = math.prod(shape[1:])
    first, last = -(-a // inner), b // inner  # the full rows are [first, last)

    def in_row(row, lo, hi):
        return [(row * inner + s, (row, *o), (1, *z)) for s, o, z in _blocks(shape[1:], lo, hi)]

    if first > last:  # inside one row
        return in_row(last, a - last * inner, b - last * inner)
    out = in_row(first - 1, a - (first - 1) * inner, inner) if a < first * inner else []
    if first < last:
        out.append((first * inner, (first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    return out + (in_row(last, 0, b - last * inner) if last * inner < b else [])


class _FlatRange:
    """The elements [offset, offset + numel) of a parameter's flattened (TP-local) tensor, held by the
    1-D `tensor` (a distributed-optimizer piece: fp32 main param or per-element state), as DCP chunks of
    the *global* parameter-shaped tensor. The range splits into rectangular blocks (`_blocks`) that are
    views of `tensor`, so DCP writes and reads them in place: no gather over data-parallel ranks, and the
    checkpoint holds the same per-parameter tensors as an unsharded optimizer's (DCP reshards on load).

    DCP finds tensors by chunk offset only for tensors, DTensors and ShardedTensors, so these entries
    travel beside the state dict, through the planners of `_dcp_save` / `_dcp_load`."""

    def __init__(self, p: torch.Tensor, offset: int, tensor: torch.Tensor):
        self.param, self.offset, self.tensor = p, offset, tensor
        self.shape = torch.Size(_global_shape(p))  # of the global tensor
        shift = [0] * p.dim()
        if _is_tp_shard(p):
            shift[p.partition_dim] = ps.get_tensor_model_parallel_rank() * p.shape[p.partition_dim]
        self.blocks = {}  # global offsets -> view of `tensor`
        for start, offsets, sizes in _blocks(tuple(p.shape), offset, offset + tensor.numel()):
            view = tensor[start - offset:start - offset + math.prod(sizes)].view(sizes)
            self.blocks[torch.Size(o + d for o, d in zip(offsets, shift))] = view

    def chunks(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.blocks.items()]

    def write_items(self, fqn: str) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(self.tensor)))
                for chunk in self.chunks()]

    def copy_from_local(self, local: torch.Tensor) -> None:
        """Take this range's elements from `local`, a full TP-local parameter-shaped tensor."""
        self.tensor.copy_(local.reshape(-1)[self.offset:self.offset + self.tensor.numel()])


def _layout() -> tuple[int, int, int, int]:
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def _model_and_optimizer_state(names, stepped: dict[int, _Stepped], with_optimizer: bool):
    """DCP entries of the weights and (`with_optimizer`) the optimizer state. The weights are the fp32
    main params when the optimizer holds them, so a checkpoint keeps full precision whatever the model
    dtype, and loading writes them where the optimizer steps (the model copy follows). Under the
    distributed optimizer each rank contributes the pieces it owns (`_FlatRange` entries)."""
    state = {}
    for name, p in names:
        s = stepped.get(id(p))
        if s is None:
            state[f"model.{name}"] = _global_view(p, p.data)
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


def _grad_scalers(optimizers) -> dict[str, object]:
    """fp16 loss scalers by checkpoint key: `grad_scaler` for synchronous training (one scale, agreed
    over all ranks); `grad_scaler.stage<vs>` per model chunk in asynchronous training, where every
    virtual stage keeps its own scale."""
    opts = [o for o in _as_list(optimizers) if getattr(o, "grad_scaler", None) is not None]
    if not isinstance(optimizers, (list, tuple)):
        return {"grad_scaler": opts[0].grad_scaler} if opts else {}
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    return {f"grad_scaler.stage{c * D + r}": o.grad_scaler for c, o in enumerate(optimizers) if o in opts}


def _load_grad_scalers(optimizers, small: dict, saved_layout: tuple) -> None:
    """Restore the loss scalers: the same key when it holds the same layers (same number of virtual
    stages), else the most cautious (smallest) scale saved."""
    saved = {k: pickle.loads(v) for k, v in small.items() if k.startswith("grad_scaler")}
    if not saved:
        return
    same_stages = saved_layout[1] * saved_layout[3] == _layout()[1] * _layout()[3]
    for key, scaler in _grad_scalers(optimizers).items():
        if key in saved and (key == "grad_scaler" or same_stages):
            scaler.load_state_dict(saved[key])
        else:
            scaler.load_state_dict(min(saved.values(), key=lambda st: st["scale"]))


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
                    keep_last: int | None = None, save_optim: bool = True, save_rng: bool = True) -> str:
    """Write a checkpoint of this iteration; collective over all ranks. `policy`: the async weight
    policy of this rank (saved at a drain); `keep_last`: afterwards delete all but the newest N;
    `save_optim`/`save_rng` False (--no-save-optim/--no-save-rng): leave the optimizer (and loss-scaler)
    state or the random generators' states out."""
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    rank, world = dist.get_rank(), dist.get_world_size()
    guard = _SaveGuard(root, iteration, partial)
    with guard:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            for leftover in os.listdir(root):  # of crashed saves or rotations: saves are never concurrent
                if leftover.endswith((".partial", ".deleting")):
                    shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)
    guard.agree()  # also the barrier: the leftovers are gone before anyone writes
    for opt in _as_list(optimizer):  # overlapped parameter all-gathers still writing the weights
        if hasattr(opt, "finish_param_sync"):
            opt.finish_param_sync()
    names = named_parameters_global(chunks)
    stepped = _stepped(optimizer) if save_optim else {}
    state, state_keys = _model_and_optimizer_state(names, stepped, bool(stepped))
    for name, p in names:  # per parameter: identical on TP/DP replicas, so DCP keeps one
        if name in state_keys:
            # The lr in effect now: async PipeOptim/SpecTrain predict with it before the next step sets it.
            state[f"optimizer_state_keys.{name}"] = pickle.dumps({"keys": state_keys[name],
                                                                   "lr": stepped[id(p)].group["lr"]})
    if stepped:  # the inner optimizer's class: its state does not depend on the precision wrapper
        state["optimizer_type"] = pickle.dumps(type(next(iter(stepped.values())).inner).__name__)
    for key, scaler in (_grad_scalers(optimizer) if save_optim else {}).items():  # fp16 loss scales
        state[key] = pickle.dumps(scaler.state_dict())
    if policy is not None:
        state.update(_policy_state(names, policy))
        state["policy_steps"] = pickle.dumps(policy.state_dict()["steps"])
    state["extra"] = pickle.dumps(extra)
    state["layout"] = pickle.dumps(_layout())
    if save_rng:
        state[f"rng.rank{dist.get_rank()}"] = pickle.dumps(rng_state())
    with guard:
        _dcp_save(state, partial)
    guard.agree()
    with guard:  # every rank hashes its share of the files; rank 0 writes checksums.json into .partial
        checksum_checkpoint(partial, rank, world)
    _test_pause(iteration)
    guard.agree()
    with guard:
        if rank == 0:
            publish(root, iteration, keep_last)
    guard.agree()
    return final


class _SaveGuard:
    """Failures of a save's steps: `with guard:` records an OSError (or DCP's CheckpointException, which
    wraps the failing rank's) of this rank; `agree()` -- collective, and a barrier -- makes every rank
    raise the same one-line SaveError when any rank failed, after rank 0 removed this save's `.partial`
    (a full disk is not kept full for the next try). Anything else keeps its traceback (a bug)."""

    def __init__(self, root: str, iteration: int, partial: str):
        self.root, self.iteration, self.partial, self.error = root, iteration, partial, None

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        from torch.distributed.checkpoint.api import CheckpointException
        if e is None or not isinstance(e, (OSError, CheckpointException)):
            return False
        if isinstance(e, CheckpointException) and not all(isinstance(x, OSError)
                                                          for x, _ in getattr(e, "failures", {}).values()):
            return False
        failures = getattr(e, "failures", None)  # DCP's: {failing rank: (exception, traceback)}
        rank = dist.get_rank()
        if failures:
            rank, (e, _) = sorted(failures.items())[0]
        self.error = f"rank {rank}: {_os_error_line(e)}"
        return True

    def agree(self) -> None:
        error, _ = agree(self.error)
        if error is None:
            return
        if dist.get_rank() == 0:
            shutil.rmtree(self.partial, ignore_errors=True)
        last = read_tracker_quietly(self.root)
        kept = (f"the last good checkpoint, iteration {last}, is untouched" if last is not None
                else "no earlier checkpoint exists")
        raise SaveError(f"saving checkpoint iteration {self.iteration} to {self.root} failed ({error}); "
                        f"removed {self.partial}; {kept}")


def _os_error_line(e: BaseException) -> str:
    """`[Errno 28] No space left on device: '<file>'` of an OSError."""
    if isinstance(e, OSError):
        where = f": '{e.filename}'" if e.filename else ""
        return f"[Errno {e.errno}] {e.strerror or e}{where}" if e.errno else f"{e}{where}"
    return _first_line(e)


def read_tracker_quietly(root: str) -> int | None:
    try:
        return find_checkpoint(root)
    except (UserError, OSError):
        return None


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


# Their rows are the (padded) vocabulary: padded to a multiple of --make-vocab-size-divisible-by x TP,
# so their row count may change with the layout. Loading re-pads them (rows beyond the tokenizer's
# vocabulary are never produced as inputs or labels; new ones start at zero).
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight",
                "encoder_embedding.word_embeddings.weight")  # NMT's separate source vocabulary


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
                    step: int | None = None, policy=None, verify: bool = True) -> dict:
    """Load checkpoint `step` (default: the tracker's) under `root` into the model (and optimizer, and
    the async weight `policy`); return its `extra`. Collective over all ranks. `verify` (not
    --no-verify-checkpoint): check every file against the checkpoint's checksums.json first, each rank
    a share of them."""
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
        elif verify:
            error = verify_share(path, dist.get_rank(), dist.get_world_size())
    except UserError as e:
        error = str(e)
    error, _ = agree(error)
    if error:
        raise UserError(error)
    if verify and dist.get_rank() == 0 and not has_manifest(path):
        print(f"> {path} has no checksums.json (saved before checksums were written): loaded unverified",
              flush=True)
    meta = md.state_dict_metadata
    names = named_parameters_for_load(chunks)
    stepped = _stepped(optimizer)
    load_optim = load_optim and bool(stepped)

    # Small pickled entries first: extra, which optimizer state to allocate, RNG, policy step count.
    rng_key = f"rng.rank{dist.get_rank()}"
    small = {"extra": b"", "layout": b"", "optimizer_type": b"", "policy_steps": b"", rng_key: b""}
    small.update({f"optimizer_state_keys.{n}": b"" for n, _ in names} if load_optim else {})
    small.update({k: b"" for k in meta if k.startswith("grad_scaler")} if load_optim else {})
    small = {k: v for k, v in small.items() if k in meta}
    _dcp_load(small, path)
    extra = pickle.loads(small["extra"])

    # Does it fit? Every rank checks its own parameters, rank 0 the checkpoint's surplus; all agree.
    misfit = _check_fits(md, names, stepped, load_optim, extra.get("vocab_size"))
    error, all_names = agree(f"{where}: {misfit}" if misfit else None, [n for n, _ in names])
    if error is None and dist.get_rank() == 0:
        ours = {n for rank_names in all_names for n in rank_names}
        extra_params = sorted(k[len("model."):] for k in meta if k.startswith("model.") and k[len("model."):] not in ours)
        if extra_params:
            error = (f"{where}: the checkpoint has parameter {extra_params[0]} that this model lacks "
                     f"({len(extra_params)} such; saved from another model configuration?)")
    error, _ = agree(error)
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
            saved = pickle.loads(small[f"optimizer_state_keys.{name}"])
            s.group["lr"] = saved["lr"]
            if s.tensor is None:  # distributed optimizer: other data-parallel ranks own all of it
                continue
            st = s.state
            for k, spec in saved["keys"].items():
                if k in st:
                    continue
                if spec is None:
                    st[k] = 0
                elif spec[0] == "like-param":
                    st[k] = torch.zeros_like(s.tensor, dtype=spec[1])
                else:
                    st[k] = torch.zeros(spec[0], dtype=spec[1], device=s.tensor.device)
        _load_grad_scalers(optimizer, small, pickle.loads(small["layout"]))
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
        if k.startswith("optimizer.") and not (torch.is_tensor(v) or isinstance(v, _FlatRange)):
            name, key = k[len("optimizer."):].rsplit(".", 1)
            stepped[id(dict(names)[name])].state[key] = v
    for target, full, rows in repad:  # this rank's rows of the re-padded vocabulary
        local = torch.zeros_like(target.param, dtype=full.dtype) if isinstance(target, _FlatRange) else target
        n = max(0, min(local.shape[0], full.shape[0] - rows))
        local.zero_()
        local[:n].copy_(full[rows:rows + n])
        if isinstance(target, _FlatRange):
            target.copy_from_local(local)
    for inner in {id(x.inner): x.inner for x in stepped.values()}.values():
        inner.forget_kept_direction()  # ΔW kept from the last step describes the state before loading
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
        if not (torch.is_tensor(value) or isinstance(value, _FlatRange)) or key not in meta:
            continue
        name = next((n for n in VOCAB_PARAMS if key == f"model.{n}" or key.startswith((f"optimizer.{n}.",
                                                                                        f"policy.{n}."))), None)
        saved = tuple(meta[key].size)
        if name is None or name not in params or saved == tuple(value.shape):
            continue
        p = params[name]
        local = value.to_local() if hasattr(value, "to_local") else value  # a tensor, or a piece of one
        full = torch.empty(saved, dtype=value.tensor.dtype if isinstance(value, _FlatRange) else local.dtype,
                           device=p.device)
        state[key] = full
        out.append((local, full, ps.get_tensor_model_parallel_rank() * p.shape[0] if _is_tp_shard(p) else 0))
    return out


def _split_ranges(state: dict) -> tuple[dict, dict]:
    """(the state DCP takes as is, the `_FlatRange` entries its planners must handle)."""
    ranges = {k: v for k, v in state.items() if isinstance(v, _FlatRange)}
    return {k: v for k, v in state.items() if k not in ranges}, ranges


def _dcp_save(state: dict, path: str) -> None:
    """dcp.save of `state`, `_FlatRange` entries written as chunks of their global tensors."""
    import torch.distributed.checkpoint as dcp  # heavy import (~1-3 s): only when checkpointing

    state, ranges = _split_ranges(state)

    class Planner(dcp.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.plan = dataclasses.replace(plan, items=plan.items + [item for fqn, r in ranges.items()
                                                                      for item in r.write_items(fqn)])
            return self.plan

        def lookup_object(self, index):
            return ranges[index.fqn].blocks[index.offset] if index.fqn in ranges else super().lookup_object(index)

    dcp.save(state, checkpoint_id=path, planner=Planner())


def _dcp_load(state: dict, path: str) -> None:
    """dcp.load whose failures (DCP raises them on every rank, as a BaseException) become UserError.
    Tensors are filled in place (`_FlatRange` entries: the blocks of their pieces); other values are
    returned in `state`."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    plain, ranges = _split_ranges(state)

    class Planner(dcp.DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items, meta = [], self.metadata.state_dict_metadata
            for fqn, r in ranges.items():
                if fqn not in meta:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                items += create_read_items_for_chunk_list(fqn, meta[fqn], r.chunks())
            return dataclasses.replace(plan, items=plan.items + items)

        def lookup_tensor(self, index):
            return ranges[index.fqn].blocks[index.offset] if index.fqn in ranges else super().lookup_tensor(index)

    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it reads in one process
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(plain, checkpoint_id=path, planner=Planner())
    except (Exception, CheckpointException) as e:
        raise UserError(f"--load {path}: cannot read the checkpoint: {_first_line(e)}") from None
    state.update(plain)


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
