"""Workers die with their torchrun launcher.

When the torchrun agent itself dies (SIGKILL, a node agent crash, an OOM kill), nothing tells its worker
processes: they go on training -- and saving into `--save` -- until a collective times out, about a minute
later. A requeued job started on the same `--save` in that window had its in-progress checkpoint deleted by
the orphans' next save. So under torchrun every worker asks the kernel for SIGKILL when its parent dies
(Linux `prctl(PR_SET_PDEATHSIG)`): the workers are gone within milliseconds of their launcher and can
publish nothing after it (the `--save` lock, save_lock.py, then also frees at once).

Notes:
- Only under torchrun (its TORCHELASTIC_* variables): under `srun` the parent is slurmstepd, whose death
  Slurm handles, and in a plain `python pretrain_gpt.py` the parent is the user's shell.
- The signal is tied to the *thread* that forked the worker; torchrun's agent starts its workers from its
  main thread, so that is its process.
- Race: a launcher that dies before a worker reaches `arm()` (its first second of imports) is caught by
  the check below when the worker has already been re-parented (to init or a subreaper) by then; if it dies
  after that check, the signal fires. A worker re-parented before arming also cannot reach the
  rendezvous store, which torchrun's agent hosts, so it fails at start-up in any case.
- Elsewhere (macOS, Windows) `arm()` does nothing: no portable parent-death signal exists; the heartbeat
  watchdog (rank_watchdog.py) still stops orphans once the store is gone (within 2 x its lost_after).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_ARMED = False


def under_torchrun(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return any(k in env for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))


def arm(environ=None) -> bool:
    """Under torchrun on Linux: SIGKILL this process when its launcher dies; exit at once (code 1) if it
    died already. Returns whether the signal is armed. Idempotent."""
    global _ARMED
    if _ARMED:
        return True
    if not under_torchrun(environ) or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _ARMED = True
    if parent == 1 or os.getppid() != parent:  # the launcher is gone already: the signal will never come
        print("error: the torchrun launcher of this worker is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    return True
