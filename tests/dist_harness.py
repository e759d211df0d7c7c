"""Run a function on N forked processes joined in a gloo process group.

Fork (not spawn) keeps a 4-rank test at ~0.1 s instead of ~4 s. Each child gets its own rank, builds the
process groups, runs `fn(*args)` and sends back its (picklable) result or its traceback. A child that
hangs or dies fails the test within `timeout` seconds, and no child outlives the call.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import traceback


# What a rank reports: its result, or where it failed (the harness's set-up, or `fn`)
OK, SET_UP, RAN = "ok", "set-up", "ran"


def free_port() -> int:
    """A port nothing listens on now, drawn below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) can be handed out again, to any outgoing connection of another test (gloo opens many), in the seconds before a
    launched rank binds it; CI lost a rendezvous port that way. Drawn with the system's randomness, not `random`'s
    (tests seed it), so two tests beside each other rarely draw the same one."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw busy: what the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(10001, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default




def _child(rank, world_size, port, tp, pp, vpp, fn, args, results, timeout, cp=1):
    # A hung rank prints every thread's stack shortly before the parent gives up on it.
    faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
    stage = SET_UP
    try:
        import torch
        import torch.distributed as dist

        from megatron_po import parallel_state as ps

        torch.set_num_threads(1)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        os.environ.update(env)
        ps.destroy_model_parallel()
        ps.init_distributed(timeout_minutes=2)
        ps.initialize_model_parallel(tp, pp, vpp, context_parallel_size=cp)
        stage = RAN
        out = fn(*args)
        if dist.is_initialized():  # fn may have shut the group down itself (e.g. run_main)
            dist.barrier()
        # Plain pickle copies tensors by value (the multiprocessing reducers would share them through
        # file descriptors, which die with this process).
        results.put((rank, OK, pickle.dumps(out)))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, stage, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the queue before the hard exit
        os._exit(0)


def run_distributed(fn, world_size: int, tp: int = 1, pp: int = 1, vpp: int | None = None,
                    args: tuple = (), timeout: float = 180.0, cp: int = 1) -> list:
    """Run `fn(*args)` on `world_size` ranks (`cp`: the context-parallel size); return the list of results
    indexed by rank. The harness's own process-group set-up (before `fn` runs) is tried twice, on a new port the
    second time: it can lose its port or its gloo connections to another socket of a test running beside it on the
    machine (CI saw "Gloo connectFullMesh failed ... Connection closed by peer" once in ~2,200 tests). A set-up that
    fails twice, and anything `fn` raises, fails the test."""
    failures = []
    for _ in range(2):
        status, got = _launch(fn, world_size, tp, pp, vpp, args, timeout, cp)
        if status != SET_UP:
            break
        failures.append(got)
    if status == SET_UP:
        raise AssertionError("the ranks' process groups could not be set up, twice:\n" + "\n".join(failures))
    if status != OK:
        raise AssertionError("a rank failed:\n" + got)
    return got


def _launch(fn, world_size, tp, pp, vpp, args, timeout, cp) -> tuple[str, object]:
    """One launch: (OK, results by rank), or (SET_UP or RAN, the failing rank's traceback)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, tp, pp, vpp, fn, args, results, timeout, cp))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, failed = {}, None
    try:
        for _ in range(world_size):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"distributed test timed out after {timeout}s; "
                                   f"finished ranks: {sorted(out)}") from None
            if status == OK:
                out[rank] = pickle.loads(value)
            else:
                failed = (status, f"--- rank {rank} ---\n{value}")
                break  # the other ranks may now block forever; fail at once
    finally:
        for p in procs:
            p.join(timeout=0.5 if failed else 10)
            if p.is_alive():
                p.kill()
                p.join()
    if failed:
        return failed
    return OK, [out[r] for r in range(world_size)]


def run_mains(argvs: list[list[str]]) -> list[int]:
    """On a forked rank: `training.run_main(argv)` for each argv in turn; the exit codes. The first run joins on
    the harness's port. run_main shuts the process group down when it ends, so each later run starts a new one on
    a port of its own, chosen by rank 0 just before the run and handed to the others through a small store of the
    ranks' own: a port chosen in the parent minutes earlier can meanwhile be taken by any other socket on the
    machine (gloo's connections of a parallel test, CI saw it), and the previous run's port is no better: a rank
    could reach the previous store while rank 0 still tears it down."""
    import torch.distributed as dist

    from megatron_po.training import run_main
    rank, world = dist.get_rank(), dist.get_world_size()
    ports = None
    if len(argvs) > 1:  # the side store, found through the harness's group while that still exists
        host = os.environ["MASTER_ADDR"]
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
        port = [store.port if store is not None else None]
        dist.broadcast_object_list(port, src=0)
        ports = store if store is not None else dist.TCPStore(host, port[0], world, is_master=False)
    codes = []
    for i, argv in enumerate(argvs):
        if i > 0:
            if rank == 0:
                ports.set(f"port {i}", str(free_port()))
            os.environ["MASTER_PORT"] = ports.get(f"port {i}").decode()
        codes.append(run_main(argv))
    return codes
