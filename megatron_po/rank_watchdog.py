"""Lost ranks: the heartbeat watchdog that stops every rank, naming the lost one, when a rank dies.

A rank that dies mid-iteration leaves its peers blocked in a receive or a collective. gloo notices a
closed connection at once, NCCL may not notice at all, and neither says which rank is gone, nor can a
rank blocked on a live peer tell that this peer is itself waiting on the dead one. So every rank runs
a thread that, every `interval` seconds, bumps its counter in the rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT: rank 0's under srun or a plain launch, torchrun's agent's under torchrun)
and watches the counter of the next rank in a ring. A counter that stands still for `lost_after`
seconds (half the distributed timeout, at most 60 s) while its rank has not said it finished means
that rank is dead: the watcher publishes a fault naming it. Every watchdog polls the fault key; a
rank whose main thread has not exited by itself `grace` seconds after a fault prints one line and
exits with FAULT_EXIT_CODE. A main thread that fails in communication waits for that verdict to name
the lost rank (`communication_failure`); one that fails otherwise publishes its own error
(`report_fault`), so its peers stop instead of waiting for the timeout. If the store itself is gone,
rank 0 (or the launcher) is: every rank stops within 2 x lost_after.

Under torchrun its agent also notices a dead worker and terminates the others (SIGTERM) at once; its
summary names the failed rank. Under srun, `--kill-on-bad-exit=1` does the same for Slurm tasks. The
watchdog is what holds without either (and names the rank in any case).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
import threading
import time

import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.parallel_state import LaunchEnv, describe_rank, read_launch_env

FAULT_EXIT_CODE = 1


class Watchdog:
    """This rank's heartbeat thread and its view of the run's fault (see above)."""

    def __init__(self, env: LaunchEnv, timeout: datetime.timedelta):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lost_after = min(timeout.total_seconds() / 2, 60.0)
        self.interval = max(0.5, self.lost_after / 10)
        self.grace = 2 * self.interval  # for a main thread that is about to exit by itself
        self.address = f"{env.master_addr}:{env.master_port}"
        # Its own connection: the main thread may block on the default store (group creation).
        client = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                               timeout=datetime.timedelta(seconds=max(5.0, 2 * self.interval)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent store outlives restarts
        self.store = dist.PrefixStore(f"megatron_po/watchdog/{attempt}/", client)
        self.lock = threading.Lock()  # the main thread reports through the same connection
        self.store.set(f"where/{self.rank}", f"host {socket.gethostname()}, pid {os.getpid()}")
        self.watched = (self.rank + 1) % self.world
        self.fault: str | None = None
        self.exit_at = 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megatron_po-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        count, changed = -1, time.monotonic()
        while not self.stopped.wait(self.interval):
            try:
                with self.lock:
                    self.store.add(f"beat/{self.rank}", 1)
                    fault = self.store.get("fault").decode() if self.store.check(["fault"]) else None
                    seen = self.store.add(f"beat/{self.watched}", 0)
                    finished = self.store.check([f"done/{self.watched}"])
                now = time.monotonic()
                if seen != count:
                    count, changed = seen, now
                elif fault is None and not finished and now - changed >= self.lost_after:
                    fault = self.publish(f"{self._where(self.watched)} is lost: no heartbeat for "
                                         f"{now - changed:.0f} s")
            except Exception as e:  # the store's host is gone: stop probing it (each failure logs)
                self._observe(f"lost the rendezvous store at {self.address}: rank 0 (or the launcher "
                              f"hosting it) is gone ({str(e).splitlines()[0]})", grace=self.lost_after)
                while not self.stopped.wait(self.interval):
                    self._observe(self.fault, grace=self.lost_after)
                return
            if fault is not None:
                self._observe(fault, grace=self.grace)

    def probe(self, ranks: list[int], window: float) -> list[int]:
        """Those of `ranks` whose heartbeat does not move within `window` seconds (and are not done)."""
        keys = [f"beat/{r}" for r in ranks]
        with self.lock:
            before = [self.store.add(k, 0) for k in keys]
        time.sleep(window)
        with self.lock:
            return [r for r, k, b in zip(ranks, keys, before)
                    if self.store.add(k, 0) == b and not self.store.check([f"done/{r}"])]

    def _where(self, rank: int) -> str:
        key = f"where/{rank}"
        with self.lock:
            where = self.store.get(key).decode() if self.store.check([key]) else "never started"
        return f"{describe_rank(rank)}, {where},"

    def publish(self, message: str) -> str:
        """Make `message` the run's fault unless another is already; return the run's fault."""
        with self.lock:
            return self.store.compare_set("fault", "", message).decode()

    def _observe(self, fault: str, grace: float) -> None:
        """Note the run's fault (the first one seen counts, with its grace); exit once the grace is over."""
        if self.fault is None:
            self.fault, self.exit_at = fault, time.monotonic() + grace
            try:  # tell the rank that published it (`wait_until_seen`)
                with self.lock:
                    self.store.set(f"saw-fault/{self.rank}", "1")
            except Exception:
                pass  # the store is gone
        elif time.monotonic() >= self.exit_at and not self.stopped.is_set():
            print(f"error: {describe_rank(self.rank)} stops: {self.fault}", file=sys.stderr, flush=True)
            os._exit(FAULT_EXIT_CODE)

    def wait_until_seen(self, timeout: float) -> None:
        """After publishing a fault: wait (at most `timeout` s) until every other rank's watchdog has seen it
        or the rank has finished. The rank hosting the store (rank 0 under srun or a plain launch) must not
        exit before: a watchdog that finds the store gone first takes it for a lost rank 0 and stops only
        lost_after later (a stuck rank stopped 15 s late at --distributed-timeout-minutes 0.5)."""
        others = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + timeout
        try:
            with self.lock:
                self.store.set(f"saw-fault/{self.rank}", "1")  # for a peer waiting here too
            while time.monotonic() < deadline:
                with self.lock:
                    if all(self.store.check([f"saw-fault/{r}"]) or self.store.check([f"done/{r}"]) for r in others):
                        return
                time.sleep(0.05)
        except Exception:
            pass  # the store is gone: nothing to wait for

    def stop(self, finished: bool) -> None:
        if finished:  # a rank done with training is not lost (said before its heartbeat stops)
            try:
                with self.lock:
                    self.store.set(f"done/{self.rank}", "1")
            except Exception:
                pass
        self.stopped.set()
        self.thread.join()


_WATCHDOG: Watchdog | None = None


def start_watchdog(environ=None) -> None:
    """Start this rank's heartbeat watchdog (after `initialize_model_parallel`; nothing to watch alone)."""
    global _WATCHDOG
    if _WATCHDOG is None and dist.is_initialized() and dist.get_world_size() > 1:
        _WATCHDOG = Watchdog(read_launch_env(environ), ps.group_timeout())


def stop_watchdog(finished: bool = True) -> None:
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop(finished)
        _WATCHDOG = None


def _stop_once_the_fault_is_seen() -> None:
    """This rank's main thread is about to exit on the run's fault: stop its watchdog (first: its thread would exit
    this process after its grace), then wait (at most 3 heartbeats) until every peer's watchdog has seen the fault.
    If this rank hosts the store, a peer that had not polled it yet would otherwise find the store gone and name
    rank 0 instead of the rank the fault names (Watchdog.wait_until_seen)."""
    watchdog = _WATCHDOG
    stop_watchdog(finished=False)
    watchdog.wait_until_seen(timeout=3 * watchdog.interval)


def report_fault(message: str) -> None:
    """This rank stops with an error its peers may not share: publish it so they stop too."""
    if _WATCHDOG is not None:
        try:
            _WATCHDOG.publish(f"{describe_rank(_WATCHDOG.rank)} {message}")
        except Exception:
            stop_watchdog(finished=False)
            return  # the store is gone too: the peers' watchdogs see that
        _stop_once_the_fault_is_seen()


def is_communication_error(e: BaseException) -> bool:
    """A failed collective, receive or store operation (a peer closed its connection, a timeout)."""
    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and (
        "gloo" in text or "NCCL" in text or "Connection closed" in text or "Connection reset" in text))


def communication_failure(e: BaseException) -> str | None:
    """For a communication error: one line saying which rank was lost (if one was) and what failed here.
    None for any other error.

    A timeout means the peers were alive (a dead one would have been found by its heartbeat within
    lost_after < the timeout) but one is stuck: say so at once and publish it, which also stops the
    stuck rank. A closed connection usually means a direct peer died: probe the heartbeats of this rank's
    groups for a few beats, then wait for the verdict (the ring watcher's lost_after covers the rest)."""
    if not is_communication_error(e):
        return None
    # gloo's text is "[<source file>:<line>] <what>. <advice>": keep <what>
    here = re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0]).split(". ")[0] if str(e) else type(e).__name__
    me = describe_rank(dist.get_rank()) if dist.is_initialized() else "this rank"
    if _WATCHDOG is None:
        return f"{me}: communication failed: {here}"
    if "timed out" not in here.lower():
        peers = sorted(set(ps.peer_ranks()) - {_WATCHDOG.rank})
        window = max(3.0, 3 * _WATCHDOG.interval)
        try:
            stalled = _WATCHDOG.probe(peers, window)
            if stalled and _WATCHDOG.fault is None:
                _WATCHDOG.publish(f"{_WATCHDOG._where(stalled[0])} is lost: no heartbeat for {window:.0f} s")
        except Exception:
            pass  # the store is gone: the watchdog reports that
        deadline = time.monotonic() + _WATCHDOG.lost_after + 2 * _WATCHDOG.interval
        while _WATCHDOG.fault is None and time.monotonic() < deadline:
            time.sleep(0.1)
    fault = _WATCHDOG.fault
    if fault is None:  # nobody died: a peer is stuck, or this rank's link failed
        report_fault(f"failed in communication: {here}")
        return f"{me}: communication failed (no rank was lost: a stuck peer or a broken link): {here}"
    _stop_once_the_fault_is_seen()
    return f"{me} stops: {fault}; here: {here}"
