"""The harness every bench family shares: where the checkout is and the family folders on sys.path, the offline
environment, the argument parser, the results header (command, machine, commit, load, date), Markdown tables and
small statistics; and the studies' one engine: their run cache and worker pool, the progress line, the lr sweep,
their runs' curves and JSONs read back.

A distinct name (not `common`) because bench/ goes on sys.path, where a generic name could shadow a package.
Importing this module is cheap: no torch at import time (benchmark worker processes import it too).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
TESTS = os.path.join(REPO, "tests")
RESULTS = os.path.join(REPO, "bench", "results")

# bench/'s families, one folder each (bench/README.md is their index). Module names stay unique across the
# folders, so a script imports any other bench module by its flat name once `add_repo_to_path` has put every
# family on sys.path, ahead of bench/ itself (a folder shares its name with its entry point:
# bench/schedules/schedules.py).
FAMILIES = ("convergence", "time_to_quality", "deep_pipelines", "schedules", "step", "gpu", "gpu_check", "memory",
            "micro")


def offline_env() -> None:
    """Never reach the network for datasets or hub files (the corpora are bundled)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def add_repo_to_path() -> None:
    """`import megatron_po`, `tools` and every bench module by its flat name, from this checkout, however a
    bench script was reached (run as `python bench/<family>/<script>.py`, or imported by a test whose sys.path
    was reset since this module was first imported); and, last, tests/: the fork + gloo launcher the tests use
    (`dist_harness`, `rank_launcher`), which the multi-process benchmarks run their ranks on."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    if TESTS not in sys.path:
        sys.path.append(TESTS)
    for family in reversed(FAMILIES):
        path = os.path.join(BENCH, family)
        if path not in sys.path:
            sys.path.insert(0, path)


add_repo_to_path()


def write_text(path: str, text: str, atomic: bool = False) -> str:
    """`text` into `path`, its folder made; returns the path. `atomic`: written beside it and moved in place, so that a
    reader (or a kill) sees the old file or the new one, never half (a run's cache file that a later --resume reads;
    results rewritten after every figure)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    written = f"{path}.tmp{os.getpid()}" if atomic else path
    with open(written, "w") as f:
        f.write(text)
    if atomic:
        os.replace(written, path)
    return path


def publish(lines: list[str], out: str | None) -> None:
    """A results file's lines printed, and written to `out` when one is given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        write_text(out, text)


def write_json_atomic(path: str, obj) -> None:
    """`obj` as JSON at `path`, atomically (`write_text`): a run killed mid-write leaves no half file for --resume."""
    write_text(path, json.dumps(obj), atomic=True)


# --------------------------------------------------------------------------------------------------
# The studies' engine: the run cache, the progress line, the lr sweep (bench/convergence/, time_to_quality/,
# deep_pipelines/, delay_robust.py)
# --------------------------------------------------------------------------------------------------


class Progress:
    """Runs done against a plan across a whole command (every block of it), with an ETA from this session's pace:
    the planned micro-batches left x the wall seconds per micro-batch trained so far (runs read from the cache
    count as done, not as pace). A run's result names its length, `micro_batches`."""

    def __init__(self, planned_runs: int, planned_mb: int):
        self.planned_runs, self.planned_mb = planned_runs, planned_mb
        self.done_runs = self.done_mb = self.trained_mb = 0
        self.start = time.time()

    def add(self, r: dict, trained: bool) -> str:
        self.done_runs += 1
        self.done_mb += r["micro_batches"]
        self.trained_mb += r["micro_batches"] if trained else 0
        left = max(0, self.planned_mb - self.done_mb)
        eta = (time.time() - self.start) / self.trained_mb * left if self.trained_mb else math.nan
        return (f"study: {self.done_runs}/~{self.planned_runs} runs, {self.done_mb}/~{self.planned_mb} micro-batches"
                + (f", ETA {eta / 3600:.1f} h" if math.isfinite(eta) else ""))


def run_cached_jobs(jobs: list, path_of, worker, *, workers: int = 1, resume: bool = False, describe=str, log=print,
                    deadline: float | None = None, progress: Progress | None = None) -> list[dict]:
    """Each job's result (a dict; a job is a tuple of arguments): read from its cache file `path_of(*job)` with
    `resume`, else `worker(*job)` (a module-level function, so that spawned worker processes can run it; it writes
    the cache file, if any: `path_of` None) on `workers` processes, a progress line `describe(result)` each (and
    `progress`'s, which counts the cached runs first); jobs not started by `deadline` (a time.time() value) are
    left out. Every study's runner."""
    out, todo = [], []
    for job in jobs:
        if resume and os.path.isfile(path_of(*job)):
            with open(path_of(*job)) as f:
                out.append(json.load(f))
            if progress is not None:
                progress.add(out[-1], False)
        else:
            todo.append(job)
    if out and todo:
        log(f"> {len(out)} finished run(s) read from the cache, {len(todo)} to run")
    if not todo:
        return out
    start, pool = time.perf_counter(), None
    if workers > 1 and len(todo) > 1:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(todo)))
        results = pool.imap_unordered(_call, [(worker, job) for job in todo])
    else:
        results = (worker(*job) for job in todo if deadline is None or time.time() < deadline)
    try:
        for i, r in enumerate(results, 1):
            out.append(r)
            minutes = (time.perf_counter() - start) / 60
            log(f"[{i}/{len(todo)}] {describe(r)}" + (f" | {progress.add(r, True)}" if progress is not None else "")
                + f" | {minutes:.1f} min, ETA {minutes / i * (len(todo) - i):.1f} min, load {loadavg()[0]:.1f}")
            if pool is not None and deadline is not None and time.time() > deadline:
                log("> deadline reached: the remaining jobs are not run")
                pool.terminate()
                break
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return out


def _call(worker_and_job: tuple):
    worker, job = worker_and_job
    return worker(*job)


def tune(units: list, grid: dict, run, final, *, max_growth: int = 0, grown: dict | None = None,
         results: dict | None = None, log=print) -> dict:
    """A study's lr sweep (equal tuning): seed 1 of every unit (`unit.opt` names its grid) at every lr of its
    optimizer's grid, `run(jobs)` training the jobs (unit, lr, 1) and returning their results {(unit, lr, seed):
    result}; while a unit whose sweep is complete has its best lr (lowest `final(result)`, ties to the lower lr)
    at an edge of the grid, the grid grows by one point on that side (half the lowest, twice the highest) for
    every unit of that optimizer, at most `max_growth` times a side (`grown` counts them; `grid` is updated in
    place). Returns the best lr of every unit; `results` (given or new) holds every run."""
    results = {} if results is None else results
    grown = {o: {"low": 0, "high": 0} for o in grid} if grown is None else grown
    while True:
        jobs = [(u, lr, 1) for u in units for lr in grid[u.opt] if (u, lr, 1) not in results]
        log(f"> sweep: {len(jobs)} runs (seed 1) over {len(units)} units")
        results.update(run(jobs))
        best = {u: min(grid[u.opt], key=lambda lr: (final(results[(u, lr, 1)]) if (u, lr, 1) in results else math.inf,
                                                    lr)) for u in units}
        more = False
        for o, g in grid.items():
            mine = [u for u in units if u.opt == o and all((u, lr, 1) in results for lr in g)]
            for side, edge, point in (("low", 0, g[0] / 2), ("high", -1, g[-1] * 2)):
                if any(best[u] == g[edge] for u in mine) and grown[o][side] < max_growth:
                    g.insert(len(g) if side == "high" else 0, point)
                    grown[o][side] += 1
                    more = True
        if not more:
            return best


def at_best_lr(units: list, grid: dict, best: dict, results: dict, final) -> tuple[dict, dict]:
    """A study's sweep {unit: {lr: final(its seed-1 run)}} and its runs at each unit's best lr {unit: [results, by
    seed]}, from `results` {(unit, lr, seed): result}."""
    sweep = {u: {lr: final(results[(u, lr, 1)]) for lr in grid[u.opt] if (u, lr, 1) in results} for u in units}
    runs = {u: sorted((r for (uu, lr, _), r in results.items() if uu == u and lr == best[u]), key=lambda r: r["seed"])
            for u in units}
    return sweep, runs


def final_val(r: dict, steps: int | None = None) -> float:
    """A run's final validation loss: its curve [(micro-batches, loss)] at its end (`steps`, default its own
    `micro_batches`); inf when it diverged or stopped early (never a best lr)."""
    c = r["curve"]
    end = r["micro_batches"] if steps is None else steps
    return c[-1][1] if c and c[-1][0] == end and math.isfinite(c[-1][1]) else math.inf


def first_reach(curve: list, target: float) -> float | None:
    """Micro-batches at which a validation curve [(micro-batches, loss)] first reaches `target`, linear between
    evaluations (a first evaluation already below, or one after a non-finite loss, counts at its own x); None if
    it never does."""
    prev = None
    for x, y in curve:
        if math.isfinite(y) and y <= target:
            if prev is None or not math.isfinite(prev[1]) or prev[1] == y:
                return float(x)
            x0, y0 = prev
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
        prev = (x, y)
    return None


def units_from_json(data: dict, unit) -> dict:
    """The units of a study JSON (`unit(entry)` makes each), with their sweeps {lr: final loss}, best lrs and runs
    at the best lr: what the studies' reports read back."""
    entries = dict(zip((unit(e) for e in data["units"]), data["units"]))
    return {"units": list(entries), "best": {u: e["best_lr"] for u, e in entries.items()},
            "sweep": {u: {float(lr): v for lr, v in e["sweep"].items()} for u, e in entries.items()},
            "runs": {u: runs_from_json(e["runs"]) for u, e in entries.items()}}


def runs_from_json(runs: list[dict]) -> list[dict]:
    """Runs read back from a study JSON, in seed order, their curves as (micro-batches, loss) tuples."""
    return sorted(({**r, "curve": [tuple(p) for p in r["curve"]]} for r in runs), key=lambda r: r["seed"])


def parse_lr_grid(items: list[str], grid: dict) -> dict:
    """`--lr-grid OPT=LR,LR,...` items over the default grids: a copy of `grid` with each named optimizer's list
    replaced (one error line for an unknown optimizer or a malformed list)."""
    grid = {o: list(v) for o, v in grid.items()}
    for item in items or []:
        o, _, v = item.partition("=")
        try:
            if o not in grid:
                raise ValueError
            grid[o] = [float(x) for x in v.split(",")]
        except ValueError:
            raise SystemExit(f"error: --lr-grid {item!r}: expected OPT=LR,LR,... with OPT one of "
                             f"{', '.join(grid)}") from None
    return grid


def read_metrics(path: str) -> list[dict]:
    """pretrain_gpt.py's metrics records (--metrics-file) so far: a line it is still writing is left for later."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


@contextlib.contextmanager
def watching(module, name: str, see):
    """`module.<name>` wrapped while inside: `see(*args, **kwargs)` sees every call before it runs (the benchmarks
    count a collective's bytes at its call)."""
    real = getattr(module, name)

    def call(*args, **kwargs):
        see(*args, **kwargs)
        return real(*args, **kwargs)
    setattr(module, name, call)
    try:
        yield
    finally:
        setattr(module, name, real)


def gpt_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` micro-batches of `batch` random token sequences (a torch.Generator seeded `seed`): tokens, the next tokens
    as labels and a loss mask of ones; what the benchmarks train on where the text does not matter."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(batch, seq)})
    return out


def kill_group(proc, sig: int = signal.SIGKILL) -> None:
    """Signal a process started with start_new_session=True and all it started (compile workers, ranks), if alive."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


def log(*args) -> None:
    print(*args, flush=True)


# --------------------------------------------------------------------------------------------------
# Results header
# --------------------------------------------------------------------------------------------------


def portable(text: str) -> str:
    """`text` with this machine's own paths made portable: the checkout's path becomes relative to the repo,
    the device tool's output folder `$OUT` (where the environment names one), the temporary folder `$TMPDIR`
    and the home folder `~` (results files never name one machine's paths)."""
    import tempfile
    text = text.replace(REPO + os.sep, "").replace(REPO, ".")
    out = os.environ.get("OUT", "").rstrip(os.sep)
    if len(out) > 1 and not out.startswith(REPO):
        text = text.replace(out + os.sep, "$OUT/").replace(out, "$OUT")
    for path, placeholder in ((os.path.realpath(tempfile.gettempdir()), "$TMPDIR"), (tempfile.gettempdir(), "$TMPDIR"),
                              (os.path.expanduser("~"), "~")):
        if len(path) > 1:
            text = text.replace(path + os.sep, placeholder + "/")
    return text


def command_line(script: str, argv: list[str], quote: bool = False) -> str:
    """`python bench/<script>` and its arguments, as the results file's `Command:` line shows them
    (quoted for the shell with `quote`; machine paths made portable)."""
    if quote:
        return portable(f"python {script}" + "".join(" " + shlex.quote(a) for a in argv))
    return portable(" ".join(["python", script] + list(argv)))


def loadavg() -> tuple[float, float, float]:
    """1, 5 and 15 minute load averages (NaN where the platform has none)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3


def machine() -> str:
    """`torch <version>, <n> CPU cores, <platform>, commit <commit>`."""
    import torch
    return f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.platform()}, commit {commit()}"


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The checkout's commit, with `-dirty` when tracked files differ from it: a results file names the code
    that made it, and says so when that code was not exactly a commit."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (rev + ("-dirty" if dirty else "")) if rev else "unknown (not a git checkout)"


def script(file: str) -> str:
    """A script's path relative to the checkout (`bench/<family>/<name>.py`), as results files show it."""
    return os.path.relpath(os.path.abspath(file), REPO)


def parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """The argument parser every bench script starts from: the module docstring's first paragraph as the
    description, the rest (usage examples) shown verbatim by --help."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    return argparse.ArgumentParser(description=head, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def header(file: str, argv: list[str] | None = None, title: str | None = None, command: str | None = None) -> list[str]:
    """The opening lines of a results file: title, command (`command` where a caller ran this script's code for
    its own command line), machine and commit, load average, date."""
    argv = sys.argv[1:] if argv is None else argv
    lines = [f"# {title}", ""] if title else []
    return lines + [f"Command: `{command or command_line(script(file), argv)}`", "",
                    f"{machine()}; {load_at_start()}; {now()}.", ""]


def card(file: str, argv, title: str, device: str, settings: str, load: str | None = None) -> list[str]:
    """A results file's opening as a card, a field a line: title, command, commit and date, device (and the machine),
    settings, the load at the start (`load`: taken when the run began; default now)."""
    argv = sys.argv[1:] if argv is None else argv
    return [f"# {title}", "", f"Command: `{command_line(script(file), argv)}`  ", f"Commit: {commit()}; {now()}  ",
            f"Device: {device}; {machine()}  ", f"Settings: {settings}  ", load or load_at_start(), ""]


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
    """A results file written as it is printed: `emit(text)` prints a line and keeps it for `write`; `opening`, the
    first lines (a `header`), emitted at once."""

    def __init__(self, opening: list[str] = ()):
        self.lines: list[str] = []
        for line in opening:
            self.emit(line)

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def write(self, path: str) -> None:
        write_text(path, "\n".join(self.lines) + "\n")


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
