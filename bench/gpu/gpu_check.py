"""Everything a lent GPU should check and measure, in one command per device call (issue 34): the CUDA test
suite, then bench/gpu/gpu.py's sections by priority, then the compile and fused-step tests on the device's own
torch with the GPU hidden (what only that torch version breaks), inside a time budget. Part 1 is the first call,
part 2 (a second call) the sections part 1 leaves. `bash scripts/gpu_check.sh` runs it (docs/gpu.md).

    bash scripts/gpu_check.sh                           # part 1: the CUDA suite, peak, gpt, plain, compiled
    bash scripts/gpu_check.sh --part 2                  # part 2: stream_compiled, fused, muon, fp16, stream, ...
    bash scripts/gpu_check.sh --part 2 --budget-s 330   # as much of part 2 as 330 s allow
    bash scripts/gpu_check.sh --part 2 --add compiled   # part 2 and a step part 1 left (its summary says which)
    bash scripts/gpu_check.sh --steps cuda_tests muon   # exactly these steps (and the baselines they read)
    bash scripts/gpu_check.sh --quick                   # one test of each suite and a tiny GPT: runs on a CPU

Steps, by priority (bench/gpu/gpu_budget.py holds the order, the parts and the estimated seconds):

  cuda_tests         bash scripts/run_gpu_tests.sh: the suite's "cuda" tests
  peak ... stream_compiled_muon   bench/gpu/gpu.py's sections, all in one gpu.py process (later sections read
                     earlier ones' figures), with `targets` after them; a section whose ratios read another's
                     (plain and compiled read gpt and plain, MFU the peak) brings it along
  cpu_compile_tests  the compiled optimizer steps' tests of tests/test_fused_prediction.py and the compiled-layer
                     tests where torch 2.11 broke (CPU_COMPILE_TESTS), with CUDA_VISIBLE_DEVICES empty
  cpu_compile_tests_rest  the other tests of tests/test_compiled_layers.py, as cpu_compile_tests and beside it
                     (neither is a timing)

The budget (--budget-s, default 540, for a device call of at most 600 s): a step whose estimate exceeds the time
left is skipped; a step runs with what is left as its timeout, in a process group of its own that is killed
whole when it overruns (the step: cut off); gpu.py gets its own --budget-s, so it stops starting sections that
cannot finish and ends before it would be killed. The summary is rewritten after every step, so a call that
ends early keeps what it measured. It names every step with its status and seconds, and the command that runs
what was skipped or cut off.

Outputs, into --out-dir (default $OUT when the environment sets it, the device tool's folder that comes back;
else bench/results/gpu_check/): gpu_check_part<N>.md and .json (the summary: command, device, torch and CUDA,
code commit, load, steps), <step>_part<N>.log (each test step's pytest output, and gpu.py's), and gpu.py's
results gpu_<device>_part<N>.md, .json and _cost_model.json. Machine paths in them are made portable
(bench_common.portable: the checkout, $OUT, $TMPDIR, ~).

Exit status 1 when a test or a section failed, else 0 (skipped and cut off steps are named, not failures).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here

import itertools  # noqa: E402
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
from bench_common import REPO, RESULTS, load_at_start, log, now, portable  # noqa: E402

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


def run_process(cmd: list[str], log_path: str, timeout: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run `cmd` from the checkout, its output into `log_path`, in a process group of its own; past `timeout`
    seconds the group gets SIGTERM, then SIGKILL after KILL_GRACE_S. (exit code, or None when it was killed;
    seconds)."""
    started = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 0.1)), time.perf_counter() - started
        except subprocess.TimeoutExpired:
            kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc, signal.SIGKILL)  # the group's stragglers too (a pytest's ranks, a compile worker)
            proc.wait()
            return None, time.perf_counter() - started
        finally:
            kill_group(proc, signal.SIGKILL)  # an interrupted wait leaves nothing running either


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


def make_portable(path: str) -> None:
    """Rewrite a file this check wrote with machine paths made portable (results are committed)."""
    if os.path.exists(path):
        with open(path, errors="replace") as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(portable_here(text))


def count_results(log_path: str) -> str:
    """What a cut-off pytest (-v) had reported: "12 PASSED, 1 FAILED" from its per-test lines."""
    with open(log_path, errors="replace") as f:
        found = re.findall(r"(PASSED|FAILED|SKIPPED|ERROR)\b", f.read())
    counts = {word: found.count(word) for word in ("PASSED", "FAILED", "ERROR", "SKIPPED") if word in found}
    return ", ".join(f"{n} {word.lower()}" for word, n in counts.items()) or "no test finished"


def pytest_summary(log_path: str) -> str:
    """pytest's closing line ("3 failed, 25 passed, 28 deselected in 88.29s"), or ""."""
    if not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        found = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|error).*? in [\d.]+s.*?) ?=*$", f.read(),
                           re.M)
    return found[-1] if found else ""


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


class Check:
    """One call: its steps, their statuses, and the summary files rewritten after each step."""

    def __init__(self, args, command: str, out_dir: str):
        self.args, self.command, self.out_dir = args, command, out_dir
        self.deadline = STARTED + args.budget_s - END_RESERVE_S
        self.steps = planned_steps(args)
        self.status: dict[str, dict] = {name: {"status": "not reached", "seconds": None,
                                               "estimate_s": gpu_budget.seconds(name, args.quick)}
                                        for name in self.steps}
        self.commands: list[str] = []  # what ran, in order
        self.device = device_info()
        self.started_at, self.load = now(), load_at_start()
        self.files: list[str] = []
        self.lock = threading.Lock()  # the test steps' threads update the statuses and write the summary

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    # ---- the test steps

    def run_tests(self, name: str) -> None:
        """Test step `name`, in a thread of its own (the summary is written under the lock)."""
        estimate = gpu_budget.seconds(name, self.args.quick)
        if estimate > self.left():
            with self.lock:
                self.status[name].update(status="skipped", note=f"time budget: {max(self.left(), 0):.0f} s left")
            return
        cmd, env = test_command(name, self.args.quick)
        log_name = f"{name}_{self.args.label}.log"
        command = shown(cmd, "CUDA_VISIBLE_DEVICES= " if name.startswith("cpu_compile_tests") else "")
        with self.lock:
            self.commands.append(command)
        log(f"[gpu_check] {name}: {command} -> {log_name} ({self.left():.0f} s left)")
        cap = TEST_CAP * estimate
        by_cap = cap < self.left()
        rc, seconds = run_process(cmd, self.path(log_name), min(self.left(), cap), env)
        make_portable(self.path(log_name))
        summary = pytest_summary(self.path(log_name))
        status = "cut off" if rc is None else "passed" if rc == 0 else "failed"
        note = summary or (f"exit code {rc}" if rc else "")
        if rc is None:
            why = f"{TEST_CAP:g}x its estimate" if by_cap else "the end of the budget"
            note = f"killed at {seconds:.0f} s, {why}; {count_results(self.path(log_name))}"
        with self.lock:
            self.files.append(log_name)
            self.status[name].update(status=status, seconds=seconds, note=note, log=log_name)
            self.write()
        log(f"[gpu_check] {name}: {status} in {seconds:.0f} s {summary}")

    # ---- the sections, in one gpu.py process

    def run_sections(self, sections: list[str]) -> None:
        fits = [s for s in sections if gpu_budget.seconds(s, self.args.quick) <= self.left() - GPU_MARGIN_S]
        if not fits:
            for s in sections:
                self.status[s].update(status="skipped", note=f"time budget: {max(self.left(), 0):.0f} s left")
            return
        slug = self.device["slug"]
        results = f"gpu_{slug}_{self.args.label}.md"
        budget = self.left() - GPU_MARGIN_S
        cmd = [sys.executable, "bench/gpu/gpu.py", "--only", *sections, "targets", "--budget-s", f"{budget:.0f}",
               "--out", self.path(results), *(["--quick"] if self.args.quick else [])]
        log_name = f"gpu_{self.args.label}.log"
        self.commands.append(shown(cmd))
        log(f"[gpu_check] sections {' '.join(sections)}: {self.commands[-1]} ({self.left():.0f} s left)")
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        rc, seconds = run_process(cmd, self.path(log_name), self.left(), env)
        make_portable(self.path(log_name))
        self.files += [log_name] + [f for f in (results, results[:-3] + ".json", results[:-3] + "_cost_model.json")
                                    if os.path.exists(self.path(f))]
        try:
            with open(self.path(results[:-3] + ".json")) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        statuses, errors = data.get("section_status", {}), {e["section"]: e["error"] for e in data.get("failures", [])}
        for s in sections:
            st = statuses.get(s)
            if st is None:  # gpu.py ended (killed, crashed) before it wrote this section's status
                why = "killed at the end of the budget" if rc is None else f"gpu.py exit code {rc} before it"
                self.status[s].update(status="cut off" if rc is None else "failed", note=why)
                continue
            note = st.get("note", "") or (errors.get(s, "").splitlines() or [""])[0][:160]
            self.status[s].update(status=st["status"], seconds=st["seconds"], note=note, estimate_s=st["estimate_s"])
        log(f"[gpu_check] gpu.py: exit code {rc} in {seconds:.0f} s")

    # ---- the summary

    def left_out(self) -> list[str]:
        return [n for n, st in self.status.items() if st["status"] in ("skipped", "cut off", "not reached")
                and not st.get("note", "").startswith("none of --stream-methods")]

    def rerun_commands(self) -> list[str]:
        left = self.left_out()
        if not left:
            return []
        quick = " --quick" if self.args.quick else ""
        alone = f"bash scripts/gpu_check.sh --steps {' '.join(left)}{quick}"
        if self.args.part == 1 and not self.args.steps:
            return [alone, f"bash scripts/gpu_check.sh --part 2 --add {' '.join(left)}{quick}"]
        return [alone]

    def write(self) -> None:
        d = self.device
        rows = [[n, st["status"], "" if st["seconds"] is None else f"{st['seconds']:.0f}", f"{st['estimate_s']:.0f}",
                 st.get("note", "")] for n, st in self.status.items()]
        left, again = self.left_out(), self.rerun_commands()
        used = time.perf_counter() - STARTED
        lines = [f"# GPU check, {self.args.label.replace('part', 'part ')}: {d['name']}", "",
                 f"Command: `{self.command}`  ",
                 f"Device: {d['name']}{d['memory']}; torch {d['torch']}, CUDA {d['cuda']}; {os.cpu_count()} CPU "
                 f"cores, {platform.platform()}  ",
                 f"Code: commit {bench_common.commit()}  ",
                 f"Started {self.started_at}; {self.load}  ",
                 f"Budget: {self.args.budget_s:.0f} s (--budget-s); {used:.0f} s used.", ""]
        if self.args.quick:
            lines += ["> **Quick (`--quick`)**: one test of each suite and a tiny GPT, so that a CPU test runs the "
                      "whole command; it measures nothing.", ""]
        lines += ["| step | status | seconds | estimated | note |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
        lines += ["", "Statuses: passed / failed (a test step), done / failed (a section), cut off (killed at the end "
                  "of the budget), skipped (its estimate exceeded the time left), not reached (the call ended "
                  "first). Estimates: bench/gpu/gpu_budget.py.", ""]
        if left:
            lines += [f"**Not run to the end in this call: {', '.join(left)}.** To run them:", "", "```", *again, "```",
                      ""]
        else:
            lines += ["Every step ran to its end.", ""]
        lines += (["Commands run, in order:", "", "```", *self.commands, "```", ""] if self.commands else
                  ["No command ran.", ""])
        if self.files:
            lines += ["Files (beside this one): " + ", ".join(f"`{f}`" for f in self.files), ""]
        one, five, _ = bench_common.loadavg()
        lines.append(f"load average at end {one:.2f} (1 min) / {five:.2f} (5 min)")
        name = f"gpu_check_{self.args.label}"
        with open(self.path(name + ".md"), "w") as f:
            f.write(portable_here("\n".join(lines) + "\n"))
        data = {"schema": "megatron_po bench/gpu/gpu_check.py 1", "command": self.command, "part": self.args.part,
                "steps_planned": self.steps, "budget_s": self.args.budget_s, "seconds_used": used,
                "quick": self.args.quick, "device": self.device, "commit": bench_common.commit(),
                "started": self.started_at, "status": self.status, "not_run_to_the_end": left,
                "to_run_them": again, "commands": self.commands, "files": self.files}
        with open(self.path(name + ".json"), "w") as f:
            f.write(portable_here(json.dumps(data, indent=1) + "\n"))

    def run(self) -> int:
        self.write()
        # In the order of priority: adjacent test steps side by side (none is a timing; the CUDA suite leaves most
        # of 16 CPU cores idle), each in its own thread and process group; adjacent sections in one gpu.py, alone
        # on the machine.
        for is_tests, group in itertools.groupby(self.steps, key=lambda step: step in gpu_budget.TEST_STEPS):
            group = list(group)
            if is_tests:
                threads = [threading.Thread(target=self.run_tests, args=(name,)) for name in group]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                self.run_sections(group)
            self.write()
        failed = [n for n, st in self.status.items() if st["status"] == "failed"]
        left = self.left_out()
        log(f"[gpu_check] {self.args.label} in {time.perf_counter() - STARTED:.0f} s -> "
            f"{portable(self.path(f'gpu_check_{self.args.label}.md'))}"
            + (f"; FAILED: {', '.join(failed)}" if failed else "")
            + (f"; not run to the end: {', '.join(left)}; to run them: {self.rerun_commands()[0]}" if left else ""))
        return 1 if failed else 0


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


def planned_steps(args) -> list[str]:
    """The steps of this call in the order of priority: the part's (or --steps), --add, and their baselines."""
    steps = list(args.steps or gpu_budget.PARTS[args.part]) + list(args.add)
    return gpu_budget.with_baselines(steps)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_common.parser(__doc__)
    ap.add_argument("--part", type=int, choices=sorted(gpu_budget.PARTS), default=1,
                    help="which call: 1 (the tests and the top sections) or 2 (the rest)")
    ap.add_argument("--steps", nargs="+", choices=gpu_budget.STEPS, metavar="STEP",
                    help="run these steps instead of the part's: " + ", ".join(gpu_budget.STEPS))
    ap.add_argument("--add", nargs="+", choices=gpu_budget.STEPS, metavar="STEP", default=[],
                    help="run these steps too (what an earlier call left)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds for the whole call; the check ends before them (default 540)")
    ap.add_argument("--out-dir", default=None,
                    help="where the results go (default $OUT when set, else bench/results/gpu_check/)")
    ap.add_argument("--quick", action="store_true",
                    help="one test per test step and gpu.py --quick (a tiny GPT): the whole check on a CPU")
    args = ap.parse_args(argv)
    if args.budget_s <= END_RESERVE_S:
        ap.error(f"--budget-s must exceed {END_RESERVE_S:.0f} s (kept for ending the steps and the summary)")
    for module in ("torch", "pytest"):
        from importlib import util
        if util.find_spec(module) is None:
            ap.error(f"{sys.executable} cannot import {module}; run with an interpreter that has torch and pytest "
                     "(PYTHON=... bash scripts/gpu_check.sh)")
    args.label = "steps" if args.steps else f"part{args.part}"  # in the files' names
    out_dir = os.path.abspath(args.out_dir or os.environ.get("OUT") or os.path.join(RESULTS, "gpu_check"))
    os.makedirs(out_dir, exist_ok=True)
    via = os.environ.get("GPU_CHECK_VIA")  # scripts/gpu_check.sh says it started us
    command = portable(" ".join([via and f"bash {via}" or "python bench/gpu/gpu_check.py",
                                 *(shlex.quote(a) for a in argv)]))
    check = Check(args, command, out_dir)
    log(f"[gpu_check] {args.label} on {check.device['name']}, torch {check.device['torch']}: "
        f"{' '.join(check.steps)}; budget {args.budget_s:.0f} s -> {portable(out_dir)}")
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
