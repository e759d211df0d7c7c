"""What the benchmark scripts share: where the checkout is, the offline environment, the command line and
machine/load lines of a results header, Markdown tables and small statistics.

A distinct name (not `common`) because bench/ goes on sys.path, where a generic name could shadow a package.
Importing this module is cheap: no torch at import time (benchmark worker processes import it too).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
TESTS = os.path.join(REPO, "tests")
RESULTS = os.path.join(REPO, "bench", "results")


def offline_env() -> None:
    """Never reach the network for datasets or hub files (the corpora are bundled)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def add_repo_to_path() -> None:
    """`import megatron_po` and `tools` from this checkout when run as `python bench/<script>.py`."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


def log(*args) -> None:
    print(*args, flush=True)


# --------------------------------------------------------------------------------------------------
# Results header
# --------------------------------------------------------------------------------------------------


def command_line(script: str, argv: list[str], quote: bool = False) -> str:
    """`python bench/<script>` and its arguments, as the results file's `Command:` line shows them
    (quoted for the shell with `quote`)."""
    if quote:
        return f"python {script}" + "".join(" " + shlex.quote(a) for a in argv)
    return " ".join(["python", script] + list(argv))


def loadavg() -> tuple[float, float, float]:
    """1, 5 and 15 minute load averages (NaN where the platform has none)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3


def machine() -> str:
    """`torch <version>, <n> CPU cores, <platform>`."""
    import torch
    return f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.platform()}"


def load_at_start() -> str:
    one, five, _ = loadavg()
    return f"load average at start {one:.2f} (1 min) / {five:.2f} (5 min)"


def load_at_end(started: float) -> str:
    """The closing line: load now and minutes since `started` (a perf_counter value)."""
    one, five, _ = loadavg()
    minutes = (time.perf_counter() - started) / 60
    return f"load average at end {one:.2f} (1 min) / {five:.2f} (5 min); {minutes:.1f} minutes"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class Lines:
    """A results file written as it is printed: `emit(text)` prints a line and keeps it for `write`."""

    def __init__(self):
        self.lines: list[str] = []

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


# --------------------------------------------------------------------------------------------------
# Tables and statistics
# --------------------------------------------------------------------------------------------------


def markdown_table(header: list, rows: list[list]) -> str:
    """A Markdown table with columns padded to their widest cell (cells may be numbers)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def median(xs):
    return statistics.median(xs)

