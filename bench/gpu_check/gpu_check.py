"""Everything a lent GPU should check and measure, in one command per device call (issues 34, 44): what no run has
measured yet first, inside a time budget. `bash scripts/gpu_check.sh` runs it (docs/gpu.md).

    bash scripts/gpu_check.sh                           # a call: the plan below, inside 540 s
    bash scripts/gpu_check.sh --budget-s 330            # as much as 330 s allow
    bash scripts/gpu_check.sh --plan                    # print the plan and why, run nothing (on a CPU too)
    bash scripts/gpu_check.sh --steps cuda_tests muon   # only these steps (and the baselines they read)
    bash scripts/gpu_check.sh --quick                   # one test of each suite and a tiny GPT: runs on a CPU

The plan (bench/gpu_check/gpu_plan.py): the CUDA suite first, then the sections no committed result measured, then those
whose code (the files of their entry in bench/gpu_check/gpu_budget.py) changed since their last measurement, then the
rest; each chosen when its last measured seconds (else its estimate) fit in the time left. A section brings the
baselines it is read against, unless an earlier call on this machine measured them at the same code
(bench/gpu_check/gpu_state.py: same GPU UUID and boot id; they are reused, and their ratios say "same machine").

  cuda_tests         bash scripts/run_gpu_tests.sh: the suite's "cuda" tests (timed with the sections: it uses the GPU)
  peak ... gpipe     bench/gpu/gpu.py's sections, all in one gpu.py process in the plan's order, `targets` after them
  cpu_compile_tests, cpu_compile_tests_rest   the compile tests on the device's torch with CUDA_VISIBLE_DEVICES
                     empty (what only torch 2.11 breaks): not timed and not in the budget's walk; they start with the
                     timed steps, in the background, on CPU cores of their own (os.sched_setaffinity: the timed
                     steps get the first half of the cores, the tests the rest), and end with the call

The budget (--budget-s, default 540, for a device call of at most 600 s): a step runs with what is left as its
timeout, in a process group of its own that is killed whole when it overruns (the step: cut off); gpu.py gets its
own --budget-s and rewrites its results after every figure, so a section killed half-way keeps what it measured.
The summary is rewritten after every step.

Outputs, into --out-dir (default $OUT when the environment sets it, the device tool's folder that comes back;
else bench/results/gpu_check/), at most 8 files (what the device tool brings back): gpu_check_<call>.md and .json
(the summary: command, device, commit, code hashes, plan, steps), cuda_tests_<call>.log, cpu_compile_tests_<call>.log
(both compile-test steps), gpu_<call>.log, and gpu.py's gpu_<device>_<call>.md, .json and _cost_model.json;
<call> is call1, call2, ... on one machine. Machine paths in them are made portable. The output ends with one
screen: every target with its figure at this commit (or, labelled, at the last commit that measured it), met or not;
then every step of the call with its status, seconds and why (a section that raised: the exception's type and
message, where it was raised and the section's last output lines: issue 58), and the command that runs again each
step that did not end well.

Exit status 1 when a test or a section failed, else 0 (skipped and cut off steps are named, not failures).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here

import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

import gpu_budget  # noqa: E402
import gpu_plan  # noqa: E402
from gpu_outcome import (again, closing_steps, count_results, not_run_to_the_end, pytest_summary,  # noqa: E402
                         section_statuses)
import gpu_state  # noqa: E402
import gpu_targets  # noqa: E402
from bench_common import REPO, RESULTS, load_at_start, log, markdown_table, now, portable  # noqa: E402

# Seconds kept at the end of the budget: a killed step's group gets KILL_GRACE_S to end after SIGTERM, then the
# summary is written; gpu.py's own budget ends GPU_MARGIN_S before its step's timeout, so it stops by itself.
END_RESERVE_S = 8.0
KILL_GRACE_S = 3.0
GPU_MARGIN_S = 6.0
# A test step is cut off at this multiple of its estimate, so that a suite far slower than expected leaves the
# sections their time (its log keeps each test's result up to there).
TEST_CAP = 2.0

# One fast test per test step at --quick, so that a CPU test runs the whole command in seconds: a "cuda" test
# (skipped with "needs CUDA" on a CPU) and a compile test of each step.
QUICK_TESTS = {"cuda_tests": "test_bf16_and_fp16_losses_stay_close_to_fp32",
               "cpu_compile_tests": "test_a_step_that_does_not_compile_runs_eagerly_with_a_warning",
               "cpu_compile_tests_rest": "test_backward_reads_the_parameters_a_policy_points_at"}
# The compile tests on the device's torch, CPU leg: step cpu_compile_tests (part 2) the compiled optimizer steps with
# the fused prediction (tests/test_fused_prediction.py) and the compiled-layer tests where torch 2.11 broke or that
# cover a mechanism of their own (TP collectives between graphs, the distributed optimizer's step, checkpoints,
# PipeOptim's stream, the compile summary); step cpu_compile_tests_rest (part 2, last) every other test of
# tests/test_compiled_layers.py.
CPU_COMPILE_TESTS = [f"tests/test_fused_prediction.py::{name}" for name in (
    "test_compiled_fused_step_equals_eager_without_recompiling",
    "test_compiled_step_keeps_a_direction_the_separate_prediction_can_use",
    "test_inductor_compiled_adamw_step_with_bf16_prediction",
    "test_a_step_that_does_not_compile_runs_eagerly_with_a_warning")] + [
    f"tests/test_compiled_layers.py::{name}" for name in (
        "test_1f1b_tp2_pp2_sequence_parallel_compiled_equals_single_process",
        "test_pipeoptim_pp2_dp2_distributed_optimizer_compiled_equals_eager",
        "test_checkpoints_load_from_compiled_into_eager_and_back",
        "test_compile_summary_counts_this_process_and_its_graphs",
        "test_asynchronous_methods_compiled_equal_eager[pipeoptim]")]
CPU_COMPILE_TESTS_REST = ["tests/test_compiled_layers.py"] + [
    arg for test in CPU_COMPILE_TESTS if test.startswith("tests/test_compiled_layers.py")
    for arg in ("--deselect", test)]
# The GPU image lacks these three (issue 29); the suites run with them unimportable, as scripts/run_gpu_tests.sh does.
PYTEST_WITHOUT_OPTIONAL = ("import sys; sys.modules.update(dict.fromkeys(('wandb', 'datasets', 'nltk'))); "
                           "import pytest; sys.exit(pytest.main(sys.argv[1:]))")


# --------------------------------------------------------------------------------------------------
# Running one step in a process group of its own, inside the time left
# --------------------------------------------------------------------------------------------------


def run_process(cmd: list[str], log_path: str, timeout: float, env: dict | None = None, append: bool = False,
                preexec_fn=None) -> tuple[int | None, float]:
    """Run `cmd` from the checkout, its output into `log_path` (after what is there with `append`), in a process
    group of its own (`preexec_fn` runs in the child first: pinning it to cores); past `timeout` seconds the group
    gets SIGTERM, then SIGKILL after KILL_GRACE_S. (exit code, or None when it was killed; seconds)."""
    started = time.perf_counter()
    with open(log_path, "a" if append else "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec_fn)
        try:
            return proc.wait(timeout=max(timeout, 0.1)), time.perf_counter() - started
        except subprocess.TimeoutExpired:
            bench_common.kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            bench_common.kill_group(proc, signal.SIGKILL)  # the group's stragglers too (a pytest's ranks, a compile worker)
            proc.wait()
            return None, time.perf_counter() - started
        finally:
            bench_common.kill_group(proc, signal.SIGKILL)  # an interrupted wait leaves nothing running either


def make_portable(path: str) -> None:
    """Rewrite a file this check wrote with machine paths made portable (results are committed)."""
    if os.path.exists(path):
        with open(path, errors="replace") as f:
            bench_common.write_text(path, portable_here(f.read()))


# --------------------------------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------------------------------


def test_command(name: str, quick: bool) -> tuple[list[str], dict]:
    """The command and environment of test step `name`."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    k = ["-k", QUICK_TESTS[name]] if quick else []
    if name == "cuda_tests":  # (-vv on the script's -q: one line per test as it ends, kept if the step is cut off)
        env["PYTHON"] = sys.executable
        return ["bash", "scripts/run_gpu_tests.sh", "-vv", *k], env
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU leg: torch sees no GPU, as on CI
    tests = CPU_COMPILE_TESTS if name == "cpu_compile_tests" else CPU_COMPILE_TESTS_REST
    return [sys.executable, "-c", PYTEST_WITHOUT_OPTIONAL, "-v", "--durations=10", *tests, *k], env


def shown(cmd: list[str], env_shown: str = "") -> str:
    """A step's command as the summary shows it (the interpreter as `python`, paths portable)."""
    words = ["python" if w == sys.executable else w for w in cmd]
    return portable_here(env_shown + " ".join(shlex.quote(w) for w in words))


def portable_here(text: str) -> str:
    """bench_common.portable, and this interpreter's installation as `$PYTHON_PREFIX` (tracebacks in the logs)."""
    text = portable(text)
    for prefix in sorted({sys.prefix, sys.base_prefix}, key=len, reverse=True):
        if len(prefix) > 1:
            text = text.replace(prefix + os.sep, "$PYTHON_PREFIX/")
    return text


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """(cores of the timed steps, cores of the background tests): the first half (rounded up) and the rest; one
    core: both on it. None where the platform cannot pin (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = (len(cores) + 1) // 2
    return set(cores[:half]), set(cores[half:])


def pinned(cores: set[int] | None):
    """A preexec_fn pinning the child (and so all it starts) to `cores`."""
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


class Check:
    """One call: its plan, its steps' statuses, and the summary files rewritten after each step."""

    def __init__(self, args, command: str, out_dir: str, label: str, state_dir: str, plan: list, hashes: dict):
        self.args, self.command, self.out_dir, self.label = args, command, out_dir, label
        self.state_dir, self.plan, self.hashes = state_dir, plan, hashes
        self.deadline = STARTED + args.budget_s - END_RESERVE_S
        self.timed = gpu_plan.run_order(plan)
        self.background = [s for s in args.candidates if s in gpu_budget.CPU_TEST_STEPS and s not in args.done_here]
        self.steps = self.timed + [p.step for p in plan if not p.chosen] + self.background
        seconds = {p.step: p.seconds for p in plan}
        self.status: dict[str, dict] = {name: {"status": "not reached", "seconds": None,
                                               "estimate_s": seconds.get(name, gpu_budget.seconds(name, args.quick))}
                                        for name in self.steps}
        for p in plan:
            if not p.chosen:
                self.status[p.step] = {"status": "skipped", "seconds": None, "estimate_s": p.seconds, "note": p.note}
        self.timed_cores, self.test_cores = split_cores()
        self.commands: list[str] = []  # what ran, in order
        self.device = device_info()
        self.started_at, self.load = now(), load_at_start()
        self.files: list[str] = []
        self.lock = threading.Lock()  # the background tests' thread updates the statuses and writes the summary

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def results_name(self) -> str:
        return f"gpu_{self.device['slug']}_{self.label}.md"

    # ---- the test steps

    def run_tests(self, name: str, log_name: str, cores, cap: float | None) -> None:
        """Test step `name` into `log_name` (appended: the two compile-test steps share one log), pinned to
        `cores`, killed at `cap` seconds or the end of the budget."""
        cmd, env = test_command(name, self.args.quick)
        command = shown(cmd, "CUDA_VISIBLE_DEVICES= " if name.startswith("cpu_compile_tests") else "")
        if cores is not None and name in gpu_budget.CPU_TEST_STEPS:  # their torch threads: their cores only
            env["OMP_NUM_THREADS"] = str(len(cores))
        with self.lock:
            self.commands.append(command)
            self.status[name]["status"] = "running"
            self.write()
        log(f"[gpu_check] {name}: {command} -> {log_name} ({self.left():.0f} s left)")
        timeout = self.left() if cap is None else min(self.left(), cap)
        rc, seconds = run_process(cmd, self.path(log_name), timeout, env, append=True, preexec_fn=pinned(cores))
        make_portable(self.path(log_name))
        summary = pytest_summary(self.path(log_name))
        status = "cut off" if rc is None else "passed" if rc == 0 else "failed"
        note = summary or (f"exit code {rc}" if rc else "")
        if rc is None:
            why = f"{TEST_CAP:g}x its estimate" if cap is not None and cap < self.left() + 1 else "the end of the budget"
            note = f"killed at {seconds:.0f} s, {why}; {count_results(self.path(log_name))}"
        with self.lock:
            if log_name not in self.files:
                self.files.append(log_name)
            self.status[name].update(status=status, seconds=seconds, note=note, log=log_name)
            if rc is not None:
                gpu_state.save_measured(self.state_dir, name, {"code_hash": self.hashes.get(name), "seconds": seconds,
                                                               "status": status, "call": self.label,
                                                               "started": self.started_at, "size": self.size(),
                                                               "commit": bench_common.commit()})
            self.write()
        log(f"[gpu_check] {name}: {status} in {seconds:.0f} s {summary}")

    def run_background(self) -> None:
        """The compile tests on the device's CPU, one after the other, in one log, on the test cores."""
        for name in self.background:
            if self.left() <= 1:
                with self.lock:
                    self.status[name].update(status="skipped", note="the call ended first")
                continue
            self.run_tests(name, f"cpu_compile_tests_{self.label}.log", self.test_cores, None)

    def size(self) -> str:
        return "quick" if self.args.quick else "full"

    # ---- the sections, in one gpu.py process

    def run_sections(self, sections: list[str]) -> None:
        results = self.results_name()
        budget = self.left() - GPU_MARGIN_S
        seconds = [f"{p.step}={p.seconds:.0f}" for p in self.plan if p.step in sections and p.source == "measured"]
        cmd = [sys.executable, "bench/gpu/gpu.py", "--only", *sections, "targets", "--budget-s", f"{budget:.0f}",
               "--out", self.path(results), "--state-dir", self.state_dir, "--call", self.label,
               *(["--seconds", *seconds] if seconds else []), *(["--quick"] if self.args.quick else []),
               *(["--eager-only"] if self.args.eager_only else [])]
        log_name = f"gpu_{self.label}.log"
        with self.lock:
            self.commands.append(shown(cmd))
            for s in sections:
                self.status[s]["status"] = "running"
            self.files += [log_name] + [f for f in (results, results[:-3] + ".json", results[:-3] + "_cost_model.json")
                                        if f not in self.files]
            self.write()
        log(f"[gpu_check] sections {' '.join(sections)}: {self.commands[-1]} ({self.left():.0f} s left)")
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        rc, seconds = run_process(cmd, self.path(log_name), self.left(), env, preexec_fn=pinned(self.timed_cores))
        make_portable(self.path(log_name))
        data = gpu_state.read(self.path(results[:-3] + ".json"))
        with self.lock:
            self.files = [f for f in self.files if os.path.exists(self.path(f))]
            for s, update in section_statuses(data, sections, rc, self.path(log_name)).items():
                self.status[s].update(update)
        log(f"[gpu_check] gpu.py: exit code {rc} in {seconds:.0f} s")

    # ---- the summary

    def left_out(self) -> list[str]:
        return not_run_to_the_end(self.status)

    def rerun_commands(self) -> list[str]:
        left = self.left_out()
        return [again(left, self.flags())] if left else []

    def target_lines(self) -> list[str]:
        """The closing screen: every target with its figure at this commit, or the last commit's that measured it."""
        here = gpu_state.read(self.path(self.results_name()[:-3] + ".json"))
        figures = {n: sec.get("figures", {}) for n, sec in here.get("sections", {}).items()}
        reused = {n: sec["reused"] for n, sec in here.get("sections", {}).items() if sec.get("reused")}
        committed = committed_figures(self.args.quick)
        rows = []
        for t, row in zip(gpu_targets.TARGETS, gpu_targets.rows(figures, reused)):
            if row[1] != "not measured":
                rows.append([t.name, row[1], f"this commit ({bench_common.commit()})", row[2], row[3]])
                continue
            found = next(((v, d) for d in committed if (v := t.value(d["figures"])) is not None), None)
            if found is None:
                rows.append([t.name, "never measured", "", "", "sections " + ", ".join(t.sections)])
            else:
                value, d = found
                rows.append([t.name, f"{value:.3f}", f"last measured at {d['commit']} ({d['started'][:10]}, "
                             f"{d['device']}): {d['file']}", "met" if t.met(value) else "NOT MET",
                             "sections " + ", ".join(t.sections)])
        lines = ["## Targets", "", markdown_table(["target", "figure", "measured at", "", "from"], rows), ""]
        return lines + self.step_lines()

    def step_lines(self) -> list[str]:
        return closing_steps(self.status, self.flags())

    def flags(self) -> str:
        """The flags a command running some steps again takes from this call's: --quick, --eager-only."""
        return "".join(f" --{f}" for f, on in (("quick", self.args.quick), ("eager-only", self.args.eager_only)) if on)

    def write(self, final: bool = False) -> None:
        d = self.device
        rows = [[n, st["status"], "" if st["seconds"] is None else f"{st['seconds']:.0f}", f"{st['estimate_s']:.0f}",
                 "background, own cores" if n in self.background else "timed", st.get("note", "")]
                for n, st in self.status.items()]
        used = time.perf_counter() - STARTED
        lines = [f"# GPU check, {self.label}: {d['name']}", "",
                 f"Command: `{self.command}`  ",
                 f"Device: {d['name']}{d['memory']}; torch {d['torch']}, CUDA {d['cuda']}; {os.cpu_count()} CPU "
                 f"cores, {platform.platform()}  ",
                 f"Machine: GPU {gpu_state.gpu_uuid()}, boot {gpu_state.boot_id()} (its state: "
                 f"{portable_here(self.state_dir)})  ",
                 f"Code: commit {bench_common.commit()}  ",
                 f"Started {self.started_at}; {self.load}  ",
                 f"Budget: {self.args.budget_s:.0f} s (--budget-s); {used:.0f} s used. Cores: timed steps "
                 f"{cores_text(self.timed_cores)}, background tests {cores_text(self.test_cores)}.", ""]
        if self.args.quick:
            lines += ["> **Quick (`--quick`)**: one test of each suite and a tiny GPT, so that a CPU test runs the "
                      "whole command; it measures nothing.", ""]
        lines += gpu_plan.plan_lines(self.plan, self.args.budget_s, self.background) + [""]
        lines += ["| step | status | seconds | estimated | runs | note |", "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
        lines += ["", "Statuses: passed / failed (a test step), done / failed (a section), reused (a baseline an "
                  "earlier call measured on this machine at this code), cut off (killed at the end of the budget), "
                  "skipped (it did not fit the budget), not reached (the call ended first), running (this summary "
                  "was written while it ran).", ""]
        lines += (["Commands run, in order:", "", "```", *self.commands, "```", ""] if self.commands else
                  ["No command ran.", ""])
        if self.files:
            lines += ["Files (beside this one): " + ", ".join(f"`{f}`" for f in self.files), ""]
        one, five, _ = bench_common.loadavg()
        lines.append(f"load average at end {one:.2f} (1 min) / {five:.2f} (5 min)")
        lines += ["", *self.target_lines()]
        name = f"gpu_check_{self.label}"
        bench_common.write_text(self.path(name + ".md"), portable_here("\n".join(lines) + "\n"), atomic=True)
        data = {"schema": "megatron_po bench/gpu/gpu_check.py 2", "command": self.command, "call": self.label,
                "steps_planned": self.steps, "budget_s": self.args.budget_s, "seconds_used": used,
                "quick": self.args.quick, "size": self.size(), "device": self.device, "commit": bench_common.commit(),
                "machine": {"gpu_uuid": gpu_state.gpu_uuid(), "boot_id": gpu_state.boot_id()},
                "code_hashes": {n: self.hashes.get(n) for n in self.steps},
                "plan": [vars(p) for p in self.plan], "started": self.started_at, "status": self.status,
                "not_run_to_the_end": self.left_out(), "to_run_them": self.rerun_commands(),
                "commands": self.commands, "files": self.files}
        bench_common.write_text(self.path(name + ".json"), portable_here(json.dumps(data, indent=1) + "\n"),
                                atomic=True)

    def run(self) -> int:
        self.write()
        # The compile tests on the CPU start with the timed steps, on cores of their own, never before them.
        background = threading.Thread(target=self.run_background, daemon=True)
        if self.background:
            background.start()
        sections = [s for s in self.timed if s not in gpu_budget.TEST_STEPS]
        if "cuda_tests" in self.timed:
            cap = TEST_CAP * self.status["cuda_tests"]["estimate_s"]
            self.run_tests("cuda_tests", f"cuda_tests_{self.label}.log", self.timed_cores, cap)
        if sections:
            self.run_sections(sections)
        if self.background:
            background.join(max(self.left(), 0) + KILL_GRACE_S + 5)
        with self.lock:
            self.write()
        failed = [n for n, st in self.status.items() if st["status"] == "failed"]
        left = self.left_out()
        log(f"[gpu_check] {self.label} in {time.perf_counter() - STARTED:.0f} s -> "
            f"{portable(self.path(f'gpu_check_{self.label}.md'))}"
            + (f"; FAILED: {', '.join(failed)}" if failed else "")
            + (f"; not run to the end: {', '.join(left)}" if left else ""))
        print("\n".join(self.target_lines()), flush=True)  # the call's output ends with the one screen
        return 1 if failed else 0


def cores_text(cores: set[int] | None) -> str:
    if cores is None:
        return "not pinned"
    c = sorted(cores)
    return f"{c[0]}-{c[-1]}" if len(c) > 1 and c[-1] - c[0] == len(c) - 1 else ",".join(map(str, c))


def committed_figures(quick: bool) -> list[dict]:
    """Every committed gpu.py result (full size), newest first: {"figures": {section: figures}, "commit", "started",
    "device", "file"}."""
    out = []
    for path in glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True):
        data = gpu_state.read(path)
        if not str(data.get("schema", "")).startswith(gpu_plan.SECTION_SCHEMA) or "sections" not in data \
                or data.get("size", "full") != "full":
            continue
        device = data.get("device", {})
        out.append({"figures": {n: s.get("figures", {}) for n, s in data["sections"].items()},
                    "commit": data.get("commit") or device.get("commit") or "an unrecorded commit",
                    "started": str(data.get("started", "")), "device": device.get("name", "?"),
                    "file": os.path.relpath(path, REPO).replace(os.sep, "/")})
    return sorted(out, key=lambda d: d["started"], reverse=True)


# --------------------------------------------------------------------------------------------------
# Device, steps, arguments
# --------------------------------------------------------------------------------------------------


def device_info() -> dict:
    """The GPU (nvidia-smi), torch's version and CUDA build, without importing torch (seconds of the budget) nor
    opening the GPU in this process."""
    info = {"name": "cpu", "memory": "", "torch": "unknown", "cuda": None}
    try:
        from importlib import metadata, util
        info["torch"] = metadata.version("torch")
        spec = util.find_spec("torch")
        version_py = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        with open(version_py) as f:
            found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        info["cuda"] = found.group(1) if found else None
    except Exception:  # noqa: BLE001  (the summary says unknown)
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if first:
            name, _, memory = first.partition(",")
            info.update(name=name.strip(), memory=f", {memory.strip()}")
    except (OSError, subprocess.SubprocessError):
        pass
    if info["name"] == "cpu" and os.path.exists("/dev/nvidia0"):  # a GPU without nvidia-smi: gpu.py names it
        info["name"] = "gpu"
    info["slug"] = re.sub(r"[^a-z0-9]+", "_", info["name"].lower()).strip("_")
    return info


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_common.parser(__doc__)
    ap.add_argument("--steps", nargs="+", choices=gpu_budget.STEPS, metavar="STEP",
                    help="run only these steps (and the baselines they read): " + ", ".join(gpu_budget.STEPS))
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds for the whole call; the check ends before them (default 540)")
    ap.add_argument("--plan", action="store_true", help="print the plan (order, why, seconds, what fits) and stop")
    ap.add_argument("--out-dir", default=None,
                    help="where the results go (default $OUT when set, else bench/results/gpu_check/)")
    ap.add_argument("--quick", action="store_true",
                    help="one test per test step and gpu.py --quick (a tiny GPT): the whole check on a CPU")
    ap.add_argument("--eager-only", action="store_true",
                    help="gpu.py --eager-only: sections fp8 and moe without their compiled runs (inductor's minutes on "
                         "a CPU): the CPU tests' calls")
    args = ap.parse_args(argv)
    if args.budget_s <= END_RESERVE_S:
        ap.error(f"--budget-s must exceed {END_RESERVE_S:.0f} s (kept for ending the steps and the summary)")
    if not args.plan:
        for module in ("torch", "pytest"):
            from importlib import util
            if util.find_spec(module) is None:
                ap.error(f"{sys.executable} cannot import {module}; run with an interpreter that has torch and "
                         "pytest (PYTHON=... bash scripts/gpu_check.sh)")
    args.candidates = gpu_budget.with_baselines(args.steps) if args.steps else list(gpu_budget.PLANNED)
    state_dir = gpu_state.machine_dir(REPO)
    hashes = gpu_plan.current_hashes(REPO)
    size = "quick" if args.quick else "full"
    this_machine = [gpu_plan.Measured(step, e.get("started", ""), e.get("commit"), e.get("code_hash"), e.get("seconds"),
                                      f"this machine ({e.get('call')})")
                    for step, e in gpu_state.measured(state_dir).items()
                    if e.get("size") == size and step in gpu_budget.BY_NAME]
    recs = gpu_plan.records(gpu_plan.read_results(RESULTS, REPO) if not args.quick else [], REPO, this_machine)
    cached = {n for n in gpu_state.reusable(state_dir, hashes)
              if gpu_state.baselines(state_dir)[n].get("size") == size}
    done_here = {step for step, e in gpu_state.measured(state_dir).items()
                 if e.get("size") == size and e.get("code_hash") == hashes.get(step)}
    args.done_here = done_here
    plan = gpu_plan.make_plan(args.candidates, recs, hashes, args.budget_s - END_RESERVE_S - GPU_MARGIN_S,
                              args.quick, cached, done_here)
    if args.plan:
        background = [s for s in args.candidates if s in gpu_budget.CPU_TEST_STEPS and s not in done_here]
        print("\n".join(gpu_plan.plan_lines(plan, args.budget_s, background)))
        return 0
    label = gpu_state.new_call(state_dir)
    out_dir = os.path.abspath(args.out_dir or os.environ.get("OUT") or os.path.join(RESULTS, "gpu_check"))
    os.makedirs(out_dir, exist_ok=True)
    via = os.environ.get("GPU_CHECK_VIA")  # scripts/gpu_check.sh says it started us
    command = portable(" ".join([via and f"bash {via}" or "python bench/gpu_check/gpu_check.py",
                                 *(shlex.quote(a) for a in argv)]))
    check = Check(args, command, out_dir, label, state_dir, plan, hashes)
    log(f"[gpu_check] {label} on {check.device['name']}, torch {check.device['torch']}: "
        f"{' '.join(check.timed)} (+ beside them: {' '.join(check.background) or 'none'}); budget "
        f"{args.budget_s:.0f} s -> {portable(out_dir)}")
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
