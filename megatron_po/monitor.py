"""What the training logs measure besides the loss: named timers, memory, and the device's peak FLOP/s
(the denominator of MFU).

Timers (`--timing-log-level`): level 1 times the coarse phases of an iteration (`forward-backward`,
`grad-sync`, `optimizer`), level 2 also every forward and backward computation, every pipeline send /
receive (`p2p`, including the time spent waiting for a neighbour) and the weight-version policy hooks
(`prediction`: PipeOptim/SpecTrain predict and restore, PipeDream stash and swap). A timer above the
level costs one comparison. On GPUs a timer synchronizes the device at both ends (otherwise it would
time kernel launches), which removes compute/communication overlap: use level 2 to find where time
goes, not for production runs. On CPUs nothing is synchronized.

Each process has one `timers` object; the training loop reports and resets it every log interval.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from contextlib import nullcontext

import torch

from megatron_po import parallel_state as ps

# --------------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------------

_OFF = nullcontext()


class _Span:
    __slots__ = ("timers", "name", "start")

    def __init__(self, timers: "Timers", name: str):
        self.timers, self.name = timers, name

    def __enter__(self):
        if self.timers.synchronize:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.timers.synchronize:
            torch.cuda.synchronize()
        self.timers.elapsed[self.name] += time.perf_counter() - self.start
        return False


class Timers:
    """Named wall-clock timers accumulated between reports: `with timers("optimizer", 1): ...`."""

    def __init__(self):
        self.level = 0
        self.synchronize = False
        self.elapsed: dict[str, float] = defaultdict(float)

    def configure(self, level: int) -> None:
        self.level = level
        self.synchronize = level > 0 and ps.get_device().type == "cuda"
        self.elapsed.clear()

    def __call__(self, name: str, level: int):
        return _OFF if level > self.level else _Span(self, name)

    def pop(self) -> dict[str, float]:
        """Seconds per timer since the last call; resets them."""
        out = dict(self.elapsed)
        self.elapsed.clear()
        return out

    def paused(self):
        """Nothing is timed inside (evaluation and checkpoints are not part of an iteration)."""
        return _Paused(self)


class _Paused:
    def __init__(self, timers: Timers):
        self.timers = timers

    def __enter__(self):
        self.level, self.timers.level = self.timers.level, 0

    def __exit__(self, *exc):
        self.timers.level = self.level
        return False


timers = Timers()

# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def memory_gb() -> dict[str, float]:
    """This process's memory: on GPUs the tensors allocated on its device (now and the peak so far), on
    CPUs the resident set size (now and the peak)."""
    if ps.get_device().type == "cuda":
        return {"memory_gb": torch.cuda.memory_allocated() / 2**30,
                "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30}
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux, updated lazily
    return {"memory_gb": rss, "max_memory_gb": max(rss, peak)}

# --------------------------------------------------------------------------------------------------
# Peak FLOP/s, for MFU
# --------------------------------------------------------------------------------------------------

# Dense peak TFLOP/s of one GPU from the vendor's data sheets: (bf16/fp16 tensor cores, fp32 without
# TF32). The first name that is a substring of `torch.cuda.get_device_name()` wins, so the more
# specific names come first. Anything else (TF32 matmuls, other devices, CPUs): --peak-tflops.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("A10", 125.0, 31.2),
    ("L4", 121.0, 30.3),
    ("V100", 125.0, 15.7),
]


def device_peak_tflops(half_precision: bool, override: float | None = None) -> float | None:
    """Peak TFLOP/s of this process's device for the training dtype, or None when unknown."""
    if override is not None:
        return override
    if ps.get_device().type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    for key, half, fp32 in PEAK_TFLOPS:
        if key in name:
            return half if half_precision else fp32
    return None
