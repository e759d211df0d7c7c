"""Saving a checkpoint, atomically (the format: checkpoint_format.py).

Atomicity: all ranks write into `iter_XXXXXXX.partial/`; after a barrier rank 0 renames it to
`iter_XXXXXXX/` and only then rewrites `latest_checkpointed_iteration.txt` (via a temp file and
`os.replace`). A crash at any point leaves the previous checkpoint and tracker untouched; leftovers of a
crashed save are removed by the next save. Rotation (`keep_last`) runs only after the tracker names the
new checkpoint, and renames a directory away before deleting it so a half-deleted one never looks
complete. Before the rename the ranks write `checksums.json` (checkpoint_integrity.py), verified on load.
A save that fails in the environment (disk full, read-only) stops every rank with one SaveError line
naming the path and the OS error, after removing its own `.partial` (docs/checkpoint_reliability.md).
"""

from __future__ import annotations

import os
import shutil
import time

import torch.distributed as dist

from megatron_po.distributed.agreement import agree
from megatron_po.distributed.checkpoint_data import JsonEntry
from megatron_po.distributed.checkpoint_dcp import dcp_save, first_line, global_view
from megatron_po.distributed.checkpoint_format import (TRACKER, checkpoint_dir, list_iterations,
                                                       named_buffers_global, named_parameters_global,
                                                       read_tracker, read_tracker_quietly)
from megatron_po.distributed.checkpoint_integrity import checksum_checkpoint
from megatron_po.distributed.checkpoint_rng import rng_state
from megatron_po.distributed.checkpoint_state import (as_list, grad_scalers, model_and_optimizer_state,
                                                      parallel_layout, policy_key, stepped_params, virtual_stage)
from megatron_po.errors import SaveError

# Test-only: "ITERATION:SECONDS:RANK" makes that rank sleep after writing that iteration's files into
# `.partial/` and before it is published, so a test can SIGKILL it in the middle of a save.
TEST_PAUSE_ENV = "MEGATRON_PO_TEST_SAVE_PAUSE"


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
    for opt in as_list(optimizer):  # overlapped parameter all-gathers still writing the weights
        if hasattr(opt, "finish_param_sync"):
            opt.finish_param_sync()
    names = named_parameters_global(chunks)
    stepped = stepped_params(optimizer) if save_optim else {}
    state, state_keys = model_and_optimizer_state(names + named_buffers_global(chunks), stepped, bool(stepped))
    for name, p in names:  # per parameter: identical on TP/DP replicas, so DCP keeps one
        if name in state_keys:
            # The lr in effect now: async PipeOptim/SpecTrain predict with it before the next step sets it.
            state[f"optimizer_state_keys.{name}"] = JsonEntry({"keys": state_keys[name],
                                                                "lr": stepped[id(p)].group["lr"]})
    if stepped:  # the inner optimizer's class: its state does not depend on the precision wrapper
        state["optimizer_type"] = JsonEntry(type(next(iter(stepped.values())).inner).__name__)
    for key, scaler in (grad_scalers(optimizer) if save_optim else {}).items():  # fp16 loss scales
        state[key] = JsonEntry(scaler.state_dict())
    if policy is not None:
        policy_state = policy.state_dict()
        state.update(_policy_state(names, policy_state["weights"]))
        state["policy_steps"] = JsonEntry(policy_state["steps"])
        for c, n in enumerate(policy_state["lr_steps"]):  # each chunk's lr clock: its applied updates
            state[f"policy_lr_steps.stage{virtual_stage(c)}"] = JsonEntry(n)
    state["extra"] = JsonEntry(extra)
    state["layout"] = JsonEntry(parallel_layout())
    if save_rng:
        state[f"rng.rank{dist.get_rank()}"] = JsonEntry(rng_state())
    with guard:
        dcp_save(state, partial)
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
    return first_line(e)


def save_in_one_process(state: dict, root: str, iteration: int = 0) -> None:
    """`state` (DCP entries: tensors, `Deferred`, `JsonEntry`) as the checkpoint of `iteration` under `root`, written
    by this process alone without torch.distributed (the converters of tools/checkpoint_convert.py), with its
    checksums, published like a training run's."""
    import warnings
    partial = checkpoint_dir(root, iteration) + ".partial"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp_save(state, partial)
    checksum_checkpoint(partial)  # checksums.json, verified when training loads it
    publish(root, iteration)


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


def _policy_state(names, weights: dict) -> dict:
    """`policy.<name>.<key>` entries of an async weight policy's extra weight versions (`weights`: its
    state_dict's {param: {key: tensor}})."""
    return {f"policy.{name}.{k}": global_view(p, t) for name, p in names
            for k, t in weights.get(policy_key(p), {}).items()}
