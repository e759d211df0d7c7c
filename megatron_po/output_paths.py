"""Start-up checks of every output path, and the `--save` lock, before any model is built.

An unwritable `--save` used to be found at the first save (the work up to it lost, then a traceback), an
unwritable `--metrics-file` or `--tensorboard-dir` when the logger opened it. Now each rank, right after
the process groups exist, creates the directories and writes (then deletes) a probe file in each of
`--save`, `--tensorboard-dir`, `--data-cache-path` and the directory of `--metrics-file` (which is
opened for appending as the logger will); the ranks agree on the outcome, so the first problem stops
every rank with one line naming the flag, the path and the OS error (exit code 2):

    error: --save /data/ckpt: cannot write there ([Errno 30] Read-only file system: '/data/ckpt/.write-test-...')

Then rank 0 takes the `--save` lock (save_lock.py) -- before auto-resume looks for the latest checkpoint,
so a job never reads a directory another job is writing.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from megatron_po.distributed import save_lock
from megatron_po.distributed.agreement import agree
from megatron_po.errors import UserError


def _probe_dir(flag: str, path: str) -> str | None:
    """Create `path` and write a file in it; one line naming the flag, path and OS error on failure."""
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{flag} {path}: not a directory"
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-") as f:
            f.write(b"x")
            f.flush()
    except OSError as e:
        return f"{flag} {path}: cannot write there ({_describe(e)})"
    return None


def _probe_file(flag: str, path: str) -> str | None:
    """The file's directory is created and the file opened for appending (as the logger will)."""
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory, not a file"
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write there ({_describe(e)})"
    return None


def _describe(e: OSError) -> str:
    where = f": '{e.filename}'" if e.filename else ""
    return f"[Errno {e.errno}] {e.strerror}{where}" if e.errno else str(e)


def output_path_errors(cfg) -> list[str]:
    """This process's problems with the configured output paths (empty when all are writable)."""
    checks = [("--save", cfg.checkpoint.save, _probe_dir),
              ("--tensorboard-dir", cfg.logging.tensorboard_dir, _probe_dir),
              ("--data-cache-path", cfg.data.data_cache_path, _probe_dir),
              ("--metrics-file", cfg.logging.metrics_file, _probe_file)]
    return [e for flag, path, probe in checks if path for e in [probe(flag, path)] if e]


def prepare_outputs(cfg, log=print) -> None:
    """Collective: check every output path on every rank, then take the --save lock on rank 0; any
    problem raises the same one-line UserError on every rank. `log`: prints a stale-lock takeover."""
    errors = output_path_errors(cfg)
    error, _ = agree(errors[0] if errors else None)
    if error is None and cfg.checkpoint.save:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            try:
                save_lock.acquire(cfg.checkpoint.save, log=log)
            except UserError as e:
                error = str(e)
            except OSError as e:
                error = f"--save {cfg.checkpoint.save}: cannot lock {save_lock.LOCK_NAME} there ({_describe(e)})"
        error, _ = agree(error)
        if error is not None and rank0:
            save_lock.release(cfg.checkpoint.save)  # not ours to keep when another rank failed
    if error is not None:
        raise UserError(error)
