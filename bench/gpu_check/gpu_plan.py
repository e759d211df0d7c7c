"""What a GPU check runs first (issue 44): the step no run has measured yet before the one whose code changed since
it was measured, before the rest, inside a time budget. Torch-free, and runs on a CPU:

    python bench/gpu_check/gpu_check.py --plan --budget-s 540    # the order, why, and what fits (a dry run)

The inputs:
- the committed results: every gpu.py results file (`"schema": "megatron_po bench/gpu/gpu.py 1"`) and check summary
  (`"megatron_po bench/gpu/gpu_check.py 1"`) under bench/results, full size only. A section counts as measured
  where its status was done (a test step: passed or failed, i.e. ran to its end); cut off and skipped do not;
- what earlier calls on this machine measured (bench/gpu_check/gpu_state.py's `measured.json`: the same GPU and
  boot), which count as the newest measurements;
- each step's code hash (`code_hash`): the git blob ids of the files its table entry names (gpu_budget.Step.files),
  hashed together. Results store the hash they were measured at (`code_hashes`); for older results without one
  it is computed from git at their commit (`git ls-tree`), and where neither is known (no commit recorded, a
  `-dirty` tree, no git) the code counts as changed.

The order: the CUDA suite first (unless an earlier call on this machine ran it at this code); then the sections
never measured; then those whose code hash differs from the
last measurement's; then the rest (unchanged), each class in the table's order of priority; a section brings the
baselines it is read against, unless this machine already measured them at the same code (reused: no time); a step
an earlier call on this machine ran at this code does not run again. The
budget (`--budget-s`) then walks that order and keeps each step whose seconds fit in what is left: its last
measured seconds (its last done run's, anywhere), else the table's estimate. The compile tests on the CPU are not
in the budget's walk: they run beside the timed steps (gpu_check.py).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field

import gpu_budget
import gpu_state

SECTION_SCHEMA = "megatron_po bench/gpu"  # gpu.py's results ("... bench/gpu/gpu.py 1"; the first H200's "bench/gpu.py")
CHECK_SCHEMA = "megatron_po bench/gpu/gpu_check.py"
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".gpu_state", "runs", "wandb", "node_modules"}


# --------------------------------------------------------------------------------------------------
# Code hashes
# --------------------------------------------------------------------------------------------------


def _pattern(glob_: str) -> re.Pattern:
    """A regex of one glob over repo-relative paths: `**/` any folders (none too), `*` within a name."""
    out, i = "", 0
    while i < len(glob_):
        if glob_.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob_.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob_[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob_[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(glob_[i]), i + 1
    return re.compile(out + r"\Z")


def select(paths, globs: tuple[str, ...]) -> list[str]:
    """The paths (repo-relative, '/'-separated) that a step's globs name: the last glob matching a path decides, a
    `!` one leaving it out (as in .gitignore), so a later glob can take back what an earlier `!` left out."""
    patterns = [(not g.startswith("!"), _pattern(g.lstrip("!"))) for g in globs]
    out = []
    for p in paths:
        keep = False
        for positive, pattern in patterns:
            if pattern.match(p):
                keep = positive
        if keep:
            out.append(p)
    return sorted(out)


def blob_id(data: bytes) -> str:
    """git's blob id of these bytes (what `git ls-tree` lists), so a tree on disk and a commit hash alike."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hash(entries: list[tuple[str, str]]) -> str:
    return hashlib.sha1("\n".join(f"{path} {blob}" for path, blob in entries).encode()).hexdigest()[:12]


def tree_files(root: str) -> list[str]:
    """Every file under `root`, repo-relative, without the folders no step measures (.git, caches, state)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        rel = os.path.relpath(folder, root)
        out += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files if not f.endswith(".pyc")]
    return out


def current_hashes(root: str, names: list[str] | None = None) -> dict[str, str]:
    """{step: code hash} of the files on disk under `root` (no git needed: a device's copy may have none)."""
    paths = tree_files(root)
    out = {}
    for name in names or list(gpu_budget.BY_NAME):
        files = select(paths, gpu_budget.BY_NAME[name].files)
        entries = []
        for p in files:
            with open(os.path.join(root, p), "rb") as f:
                entries.append((p, blob_id(f.read())))
        out[name] = _hash(entries)
    return out


def hashes_at_commit(root: str, commit: str, names: list[str]) -> dict[str, str] | None:
    """{step: code hash} of the files at `commit` (from git's tree listing), or None where git cannot say."""
    if not commit or "dirty" in commit or not re.fullmatch(r"[0-9a-f]{4,40}", commit):
        return None
    try:
        out = subprocess.run(["git", "ls-tree", "-r", commit], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    blobs = {}
    for line in out.stdout.splitlines():
        meta, _, path = line.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == "blob":
            blobs[path] = parts[2]
    return {name: _hash([(p, blobs[p]) for p in select(blobs, gpu_budget.BY_NAME[name].files)]) for name in names}


# --------------------------------------------------------------------------------------------------
# What was measured, and when
# --------------------------------------------------------------------------------------------------


@dataclass
class Measured:
    """One run of a step that went to its end: where, when, at which code, in how many seconds."""
    step: str
    started: str  # "YYYY-MM-DD HH:MM:SS"
    commit: str | None
    code_hash: str | None
    seconds: float | None
    file: str  # repo-relative, or "this machine (<call>)"
    device: str = ""


@dataclass
class Record:
    """Per step: its last measurement (None: never), and its last seconds however it ended (a cut-off run's
    seconds say at least that long)."""
    last: Measured | None = None
    cut_off_seconds: float | None = None
    seconds: list[float] = field(default_factory=list)


def read_results(results_root: str, repo: str) -> list[Measured | tuple[str, float]]:
    """Every full-size measurement under `results_root` (and, as (step, seconds), each cut-off run's seconds)."""
    found: list = []
    for path in sorted(glob.glob(os.path.join(results_root, "**", "*.json"), recursive=True)):
        data = gpu_state.read(path)
        schema = str((data or {}).get("schema", ""))
        if not data or not schema.startswith(SECTION_SCHEMA) or data.get("size", "full") != "full" \
                or data.get("quick"):
            continue
        rel = os.path.relpath(path, repo).replace(os.sep, "/")
        device = data.get("device", {})
        commit = data.get("commit") or device.get("commit")
        hashes = data.get("code_hashes") or {}
        if schema.startswith(CHECK_SCHEMA):
            statuses = {n: st for n, st in data.get("status", {}).items() if n in gpu_budget.TEST_STEPS}
            done = {n for n, st in statuses.items() if st.get("status") in ("passed", "failed")}
        else:
            statuses = data.get("section_status") or {n: {"status": "done"} for n in data.get("sections", {})}
            done = {n for n, st in statuses.items() if st.get("status") == "done" and n in data.get("sections", {})}
        for name, st in statuses.items():
            if name not in gpu_budget.BY_NAME or name == "targets":
                continue
            if name in done:
                found.append(Measured(name, str(data.get("started", "")), commit, hashes.get(name),
                                      st.get("seconds"), rel, device.get("name", "")))
            elif st.get("status") == "cut off" and st.get("seconds"):
                found.append((name, float(st["seconds"])))
    return found


def records(found: list, repo: str, this_machine: list[Measured] = ()) -> dict[str, Record]:
    """Per step, its last measurement (by start time; this machine's earlier calls last, as the newest) with the
    code hash it measured (computed from git at its commit where the file has none)."""
    out = {name: Record() for name in gpu_budget.BY_NAME}
    at_commit: dict = {}
    for m in sorted([f for f in found if isinstance(f, Measured)], key=lambda m: m.started) + list(this_machine):
        if m.code_hash is None and m.commit:
            if m.commit not in at_commit:
                at_commit[m.commit] = hashes_at_commit(repo, m.commit, list(gpu_budget.BY_NAME))
            m.code_hash = (at_commit[m.commit] or {}).get(m.step)
        rec = out[m.step]
        rec.last = m
        if m.seconds:
            rec.seconds.append(float(m.seconds))
    for f in found:
        if isinstance(f, tuple):
            out[f[0]].cut_off_seconds = max(out[f[0]].cut_off_seconds or 0.0, f[1])
    return out


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------

CLASSES = ("first", "never measured", "code changed", "unchanged")


@dataclass
class Planned:
    step: str
    why: str  # one of CLASSES, said in words in `reason`
    reason: str
    seconds: float  # what the budget counts for it (0 for a reused baseline)
    source: str  # "measured" (last done run) or "estimated"
    chosen: bool = False
    note: str = ""
    brings: list[str] = field(default_factory=list)  # the baselines it brings into the run


def step_seconds(name: str, rec: Record, quick: bool) -> tuple[float, str]:
    """Seconds the budget counts for step `name`: its last done run's (on any device), else the table's estimate
    (at least a cut-off run's seconds when its code did not change since). Quick: always the estimate."""
    if not quick and rec.seconds:
        return rec.seconds[-1], "measured"
    return gpu_budget.seconds(name, quick), "estimated"


def classify(name: str, rec: Record, now_hash: str) -> tuple[str, str]:
    last = rec.last
    if name == "cuda_tests":
        return "first", "the CUDA suite runs first"
    if last is None:
        return "never measured", "never measured" + (f" (cut off after {rec.cut_off_seconds:.0f} s)"
                                                     if rec.cut_off_seconds else "")
    where = f"{last.started[:10]} at {last.commit or 'an unrecorded commit'}, {last.file}"
    if last.code_hash is None:
        return "code changed", f"measured {where}; code version unknown there"
    if last.code_hash != now_hash:
        return "code changed", f"code changed since {where}"
    return "unchanged", f"unchanged since {where}"


def make_plan(candidates: list[str], recs: dict[str, Record], hashes: dict[str, str], budget_s: float | None,
              quick: bool = False, cached: set[str] = frozenset(), done_here: set[str] = frozenset()) -> list[Planned]:
    """The timed steps of `candidates` in the order they run (module docstring), each chosen or not by the budget
    (None: every one). `cached`: baselines this machine measured at the same code (they cost nothing); `done_here`:
    steps an earlier call on this machine ran at the same code (not run again, the CUDA suite included)."""
    timed = [n for n in candidates if n in gpu_budget.BY_NAME and gpu_budget.BY_NAME[n].kind != "cpu_tests"
             and n != "targets"]
    rows = {}
    for name in timed:
        why, reason = classify(name, recs[name], hashes.get(name, ""))
        if name in done_here and name not in cached:
            last = recs[name].last
            why, reason = "unchanged", f"ran on this machine at this code ({last.file if last else 'an earlier call'})"
        seconds, source = step_seconds(name, recs[name], quick)
        rows[name] = Planned(name, why, reason, seconds, source)
    order = sorted(timed, key=lambda n: (CLASSES.index(rows[n].why), gpu_budget.STEPS.index(n)))
    left = float("inf") if budget_s is None else budget_s
    chosen: set[str] = set()
    for name in order:
        row = rows[name]
        if name in chosen:  # brought in as an earlier step's baseline
            row.chosen, row.note = True, "brought in as a baseline"
            continue
        needs = [b for b in gpu_budget.baselines(name) if b not in chosen and b not in cached]
        cost = row.seconds + sum(step_seconds(b, recs[b], quick)[0] for b in needs)
        if name in cached:
            row.chosen, row.seconds, row.note = True, 0.0, "reused: measured on this machine at this code"
            chosen.add(name)
            continue
        if name in done_here:
            row.note = "not run again: the same code on the same machine"
            continue
        if cost > left:
            row.note = f"does not fit: {cost:.0f} s with its baselines, {max(left, 0):.0f} s left"
            continue
        left -= cost
        row.chosen, row.brings = True, needs
        chosen.update([name, *needs])
    return [rows[n] for n in order]


def run_order(plan: list[Planned]) -> list[str]:
    """The chosen steps in the order they run: each with its baselines right before it (gpu.py reads them)."""
    out: list[str] = []
    for row in plan:
        if not row.chosen:
            continue
        for name in [*row.brings, row.step]:
            if name not in out:
                out.append(name)
    return out


def plan_lines(plan: list[Planned], budget_s: float | None, cpu_steps: list[str]) -> list[str]:
    """The plan as Markdown: the order, why, seconds and whether it fits."""
    rows = [f"| {i} | {p.step} | {p.reason} | {p.seconds:.0f} ({p.source}) | "
            f"{'yes' + (' (brings ' + ', '.join(p.brings) + ')' if p.brings else '') if p.chosen else 'no'} | {p.note} |"
            for i, p in enumerate(plan, 1)]
    by_name = {p.step: p for p in plan}
    total = sum(by_name[n].seconds for n in run_order(plan) if n in by_name)
    return ([f"Plan (budget {'none' if budget_s is None else f'{budget_s:.0f} s'}): the CUDA suite first, then what no "
             "run measured, then what changed since its last measurement, then the rest.", "",
             "| # | step | why | seconds | runs | note |", "|---|---|---|---|---|---|", *rows, "",
             f"Timed steps chosen: {', '.join(run_order(plan)) or 'none'} (about {total:.0f} s, baselines counted "
             "where they run)."]
            + ([f"Beside them from the start, on cores of their own: {', '.join(cpu_steps)}."] if cpu_steps else []))
