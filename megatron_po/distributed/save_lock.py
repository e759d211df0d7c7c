"""One job per `--save` directory: an exclusive lock on `<save>/.lock`.

Two jobs writing one directory destroy each other's work: each save first deletes leftover `.partial`
directories (of crashed saves, it assumes), and both publish iterations over one tracker. So rank 0 takes
an exclusive `flock` on `<save>/.lock` before anything looks into the directory (auto-resume included)
and holds it until the run ends; the file records the holder (host, pid, job id, start time) so the
refusal can name it:

    error: --save /ckpt is in use by another job (host n12, pid 4242, job 981, since 2026-11-25 10:02:11 UTC):
           two jobs must not write one checkpoint directory; wait for it to end or choose another --save

(one line, exit code 2). The kernel drops a flock when its holder dies however it dies (SIGKILL
included), so a lock whose holder is gone is free: the next job takes it over and says whose it was
(the file still names the dead holder, as nobody released it). A released lock leaves an empty file.

Scope: flock is exact between processes of one host and on shared filesystems that implement it across
hosts (Lustre with `-o flock`, GPFS, NFSv4); on a filesystem whose flock is local to each client, two
jobs on different hosts are not kept apart -- the holder line at least shows up in `<save>/.lock`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from megatron_po.errors import UserError

LOCK_NAME = ".lock"
_HELD: dict[str, int] = {}  # realpath of the save dir -> fd of its lock, held by this process


def holder_info() -> dict:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def describe(info: dict) -> str:
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if info.get("job"):
        parts.append(f"job {info['job']}")
    if info.get("since"):
        parts.append(f"since {info['since']}")
    return ", ".join(parts)


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    if not text:
        return None
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {"host": text[:80]}
    except ValueError:
        return {"host": text[:80]}


def acquire(save_dir: str, log=print) -> str | None:
    """Take the lock on `save_dir` (created if needed) for this process, or raise UserError naming the
    holder. Returns a line to log when a stale lock was taken over, else None. Idempotent per process."""
    key = os.path.realpath(save_dir)
    if key in _HELD:
        return None
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        info = _read(fd) or {}
        os.close(fd)
        raise UserError(f"--save {save_dir} is in use by another job ({describe(info)}): two jobs must not "
                        f"write one checkpoint directory; wait for it to end or choose another --save") from None
    previous = _read(fd)
    me = holder_info()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    _HELD[key] = fd
    if previous:
        message = (f"> --save {save_dir}: took over the stale lock of {describe(previous)} "
                   f"(that job ended without releasing it)")
        if log is not None:
            log(message)
        return message
    return None


def release(save_dir: str | None = None) -> None:
    """Release the lock on `save_dir` (all this process holds when None): empty the file, unlock."""
    for key in [k for k in _HELD if save_dir is None or k == os.path.realpath(save_dir)]:
        fd = _HELD.pop(key)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # a full or read-only disk: the lock is still dropped with the descriptor
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
