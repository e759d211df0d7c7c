"""A pytest plugin (`-p suite_time_plugin`) that records what each test spent, for bench/micro/suite_time.py: wall
seconds (setup, call and teardown), CPU seconds of the pytest process and of the children it waited for (forked
ranks, subprocesses), how many processes it forked (tests/dist_harness.py's ranks) and executed (a
`pretrain_gpt.py`, a `torchrun`: each pays Python's and torch's start-up), and the seconds TorchDynamo spent
compiling in the pytest process itself (from the first test after the suite imported torch: its collection does).

One JSON line per test into `$SUITE_TIME_RECORDS/<worker>.jsonl` (pytest-xdist's workers each write their own).
Imports nothing of the checkout under test (the measured clone need not have this file); torch only when the
suite has imported it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

_counts = {"forks": 0, "execs": 0, "python_execs": 0, "compile_s": 0.0}
_depth = [0]


def _count_forks() -> None:
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            _counts["forks"] += 1
        return pid
    os.fork = fork


def _count_execs() -> None:
    real = subprocess.Popen._execute_child

    def execute_child(self, args, executable, *rest, **kw):
        words = [args] if isinstance(args, (str, bytes)) else list(args)
        first = os.path.basename(str(executable or words[0])) if words else ""
        _counts["execs"] += 1
        if first.startswith("python") or str(executable or words[0]) == sys.executable or \
                first in ("torchrun", "bash") and any(str(w).endswith(".py") for w in words):
            _counts["python_execs"] += 1
        return real(self, args, executable, *rest, **kw)
    subprocess.Popen._execute_child = execute_child


def _time_compiles() -> None:
    """TorchDynamo's outermost compilations (frames traced, graphs lowered, kernels built) timed in this process;
    the class's method is wrapped, not a registered callback: torch._dynamo.reset() clears those."""
    from torch._dynamo.callback import CompilationCallbackHandler
    real = CompilationCallbackHandler.install_callbacks

    def install_callbacks(self, *a, **kw):
        cm = real(self, *a, **kw)

        class Timed:
            def __enter__(self_):
                _depth[0] += 1
                self_.t0 = time.perf_counter()
                return cm.__enter__()

            def __exit__(self_, *exc):
                _depth[0] -= 1
                if _depth[0] == 0:
                    _counts["compile_s"] += time.perf_counter() - self_.t0
                return cm.__exit__(*exc)
        return Timed()
    CompilationCallbackHandler.install_callbacks = install_callbacks


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def pytest_configure(config):
    _count_forks()
    _count_execs()


_compiles_timed = [False]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _compiles_timed[0] and "torch" in sys.modules:
        try:
            _time_compiles()
        except (ImportError, AttributeError):  # another torch: compile seconds not recorded
            pass
        _compiles_timed[0] = True
    before = dict(_counts)
    t0, self0, children0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    record = {"test": item.nodeid, "file": item.nodeid.split("::")[0], "wall_s": time.perf_counter() - t0,
              "cpu_self_s": _cpu(resource.RUSAGE_SELF) - self0,
              "cpu_children_s": _cpu(resource.RUSAGE_CHILDREN) - children0,
              **{k: _counts[k] - before[k] for k in _counts}}
    folder = os.environ.get("SUITE_TIME_RECORDS")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
