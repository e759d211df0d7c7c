"""What a GPU check runs first, what it reuses and what it keeps (issue 44), on a CPU:

- the plan (bench/gpu_check/gpu_plan.py) on a synthetic results tree: the CUDA suite first, then the sections never
  measured, then those whose code hash changed, then the unchanged ones; `--budget-s` keeps what fits, each step
  costed at its last measured seconds where a run measured it (else its estimate), a section with the baselines it
  brings, a baseline this machine measured at this code at no cost; `--plan` prints it on a CPU;
- the code hash: the git blob ids of a step's files, the same from the files on disk as from git at a commit, and
  changed by an edit to one of them only;
- the baselines once per machine: another (faked) boot id measures its own (tests/test_gpu_tools.py: a second call
  on the same machine reuses the first's, and its ratios say "same machine");
- a killed section keeps what it measured: a fake section's child process prints figures and waits until each is in
  the results file before going on, then is killed by the budget; both figures are in the results, `partial`;
- a section that raises says what, where and its last output lines, in gpu.py's status and on the check's closing
  screen (issue 58);
- the background tests' cores: the timed steps and the compile tests get disjoint halves, and a child is pinned.
"""

import json
import os
import subprocess
import sys
import time

from cuda_harness import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402,F401  (puts the bench family folders on sys.path)
import gpu_budget  # noqa: E402
import gpu_check  # noqa: E402
import gpu_outcome  # noqa: E402
import gpu_plan  # noqa: E402

ENV = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def results_file(root, name: str, commit: str, started: str, sections: dict) -> None:
    """A gpu.py results file: {section: (status, seconds, code hash)}."""
    data = {"schema": "megatron_po bench/gpu/gpu.py 1", "size": "full", "started": started,
            "device": {"name": "NVIDIA H100 80GB HBM3", "commit": commit},
            "sections": {n: {"figures": {}} for n, (st, _, _) in sections.items() if st == "done"},
            "section_status": {n: {"status": st, "seconds": sec} for n, (st, sec, _) in sections.items()},
            "code_hashes": {n: h for n, (_, _, h) in sections.items()}}
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, name), "w") as f:
        json.dump(data, f)


def synthetic(tmp_path) -> tuple[dict, dict]:
    """A results tree: peak and plain measured at today's code, gpt and fused at older code (fused's newer run cut
    off), muon measured at an older hash and again at today's, the rest never; the CUDA suite in a check summary."""
    root = tmp_path / "results"
    now = {name: f"h-{name}" for name in gpu_budget.BY_NAME}
    results_file(root / "a", "gpu_x_call1.json", "aaaa111", "2026-11-27 07:00:00", {
        "peak": ("done", 8.0, now["peak"]), "gpt": ("done", 33.0, "old-gpt"), "muon": ("done", 70.0, "old-muon"),
        "fused": ("done", 60.0, "old-fused")})
    results_file(root / "b", "gpu_x_call2.json", "bbbb222", "2026-11-28 07:00:00", {
        "plain": ("done", 50.0, now["plain"]), "muon": ("done", 75.0, now["muon"]),
        "fused": ("cut off", 194.0, now["fused"]), "stream": ("skipped", None, now["stream"])})
    with open(root / "b" / "gpu_check_call2.json", "w") as f:
        json.dump({"schema": "megatron_po bench/gpu/gpu_check.py 2", "size": "full", "started": "2026-11-28 07:00:00",
                   "commit": "bbbb222", "device": {"name": "H100"}, "code_hashes": {"cuda_tests": now["cuda_tests"]},
                   "status": {"cuda_tests": {"status": "failed", "seconds": 137.0}}}, f)
    recs = gpu_plan.records(gpu_plan.read_results(str(root), str(tmp_path)), str(tmp_path))
    return recs, now


def test_plan_runs_the_cuda_suite_then_never_measured_then_changed_then_unchanged(tmp_path):
    recs, now = synthetic(tmp_path)
    assert recs["fused"].last.code_hash == "old-fused" and recs["fused"].cut_off_seconds == 194.0
    assert recs["muon"].last.code_hash == now["muon"] and recs["muon"].seconds == [70.0, 75.0]  # the newest last
    plan = gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=None)
    order = [p.step for p in plan]
    never = ["compiled", "moe", "gpipe", "stream_compiled", "fp16", "stream", "stream_compiled_muon", "fp8",
             "long_context", "fsdp"]
    assert order == ["cuda_tests", *never, "gpt", "fused", "peak", "plain", "muon"]
    assert [p.why for p in plan] == ["first"] + ["never measured"] * 10 + ["code changed"] * 2 + ["unchanged"] * 3
    assert all(p.chosen for p in plan)  # no budget: everything, in that order
    assert "code changed since 2026-11-27 at aaaa111" in plan[order.index("gpt")].reason
    # the compile tests run beside the timed steps, not in this order
    assert not set(gpu_budget.CPU_TEST_STEPS) & set(order) and "targets" not in order
    # seconds: the last measured run's where one went to its end, else the estimate
    by = {p.step: p for p in plan}
    assert (by["cuda_tests"].seconds, by["cuda_tests"].source) == (137.0, "measured")
    assert (by["muon"].seconds, by["plain"].seconds) == (75.0, 50.0)
    assert (by["stream"].seconds, by["stream"].source) == (gpu_budget.seconds("stream", False), "estimated")
    # each section's baselines run right before it
    run = gpu_plan.run_order(plan)
    assert run.index("peak") < run.index("gpt") < run.index("plain") < run.index("compiled")
    assert run[0] == "cuda_tests"


def test_budget_keeps_what_fits_in_order_and_reused_baselines_cost_nothing(tmp_path):
    recs, now = synthetic(tmp_path)
    est = {n: gpu_budget.seconds(n, False) for n in gpu_budget.PLANNED}
    # cuda 137 + compiled with its baselines (peak 8, gpt 33, plain 50) + ... in a budget that fits those and gpipe
    budget = 137 + est["compiled"] + 8 + 33 + 50 + est["gpipe"] + 1
    plan = gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=budget)
    chosen = gpu_plan.run_order(plan)
    assert chosen == ["cuda_tests", "peak", "gpt", "plain", "compiled", "gpipe"]
    by = {p.step: p for p in plan}
    assert by["compiled"].brings == ["peak", "gpt", "plain"]
    assert not by["stream_compiled"].chosen and "does not fit" in by["stream_compiled"].note
    # a smaller step later in the order still fits where a bigger one did not
    budget = 137 + est["fp16"] + 1
    chosen = gpu_plan.run_order(gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=budget))
    assert chosen == ["cuda_tests", "fp16"]
    # baselines this machine measured at this code: reused, at no cost, so compiled fits alone
    budget = 137 + est["compiled"] + 1
    plan = gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=budget, cached={"peak", "gpt", "plain"})
    by = {p.step: p for p in plan}
    assert by["compiled"].chosen and by["compiled"].brings == [] and by["peak"].seconds == 0.0
    assert gpu_plan.run_order(plan)[:2] == ["cuda_tests", "compiled"]
    # what an earlier call on this machine ran at this code does not run again, the CUDA suite included
    plan = gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=None, cached={"peak"},
                              done_here={"cuda_tests", "gpipe", "peak"})
    by = {p.step: p for p in plan}
    assert not by["cuda_tests"].chosen and not by["gpipe"].chosen and by["peak"].chosen  # peak: reused
    assert by["gpipe"].note == "not run again: the same code on the same machine"
    assert gpu_plan.run_order(plan)[:3] == ["gpt", "plain", "compiled"]  # its baselines but the reused peak
    # nothing fits: every row says why
    plan = gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, budget_s=5)
    assert gpu_plan.run_order(plan) == [] and all("does not fit" in p.note for p in plan)


def test_a_second_call_on_the_same_machine_runs_what_the_first_left(tmp_path):
    """The lease docs/gpu.md describes: call 1 in 540 s, then call 2 on the same warm machine in 300 s, which
    neither re-runs call 1's steps (the CUDA suite included) nor re-measures its baselines."""
    recs, now = synthetic(tmp_path)
    first = gpu_plan.run_order(gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, 540 - 14))
    here = [gpu_plan.Measured(s, "2026-12-01 00:00:00", "cccc333", now[s], 1.0, "this machine (call1)") for s in first]
    recs = gpu_plan.records(gpu_plan.read_results(str(tmp_path / "results"), str(tmp_path)), str(tmp_path), here)
    cached = {s for s in first if gpu_budget.BY_NAME[s].reusable}
    second = gpu_plan.run_order(gpu_plan.make_plan(gpu_budget.PLANNED, recs, now, 300 - 14, cached=cached,
                                                   done_here=set(first)))
    assert first[0] == "cuda_tests" and "cuda_tests" not in second
    assert not (set(first) - cached) & set(second) and second


def test_code_hash_is_git_blob_ids_of_the_step_files(tmp_path):
    repo = tmp_path / "repo"
    for path, text in {"megatron_po/a.py": "a = 1\n", "megatron_po/optim/muon.py": "m = 1\n",
                       "megatron_po/sub/deep/b.py": "b = 1\n", "bench/step/overhead.py": "o = 1\n",
                       "pretrain_gpt.py": "p = 1\n", "tests/test_cuda_x.py": "t = 1\n"}.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    paths = gpu_plan.tree_files(str(repo))
    assert gpu_plan.select(paths, gpu_budget.OURS) == ["megatron_po/a.py", "megatron_po/sub/deep/b.py",
                                                        "pretrain_gpt.py"]  # muon excluded, ** any depth
    before = gpu_plan.current_hashes(str(repo))
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert gpu_plan.hashes_at_commit(str(repo), head, list(before)) == before  # disk and git agree
    assert gpu_plan.hashes_at_commit(str(repo), head + "-dirty", ["gpt"]) is None  # not a commit's code
    (repo / "megatron_po/optim/muon.py").write_text("m = 2\n")
    after = gpu_plan.current_hashes(str(repo))
    changed = {n for n in before if before[n] != after[n]}
    assert "muon" in changed and "cuda_tests" in changed and not {"gpt", "peak", "plain", "compiled"} & changed


def test_plan_prints_on_a_cpu():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check", "gpu_check.py"), "--plan",
                           "--budget-s", "540"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert rows and "| cuda_tests |" in rows[0] and "Timed steps chosen: cuda_tests" in proc.stdout
    assert "Beside them from the start, on cores of their own: cpu_compile_tests" in proc.stdout
    assert "| profile |" not in proc.stdout and "profile" in gpu_budget.STEPS  # a diagnosis: on request only


def run_check(tmp_path, out: str, gpu: str, boot: str, state: str, *args):
    env = dict(ENV, GPU_CHECK_GPU_UUID=gpu, GPU_CHECK_BOOT_ID=boot, GPU_CHECK_STATE_DIR=state, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--quick", *args, "--out-dir",
                           str(tmp_path / out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_baselines_are_measured_once_per_machine(tmp_path):
    """A machine's state is its GPU since its boot: another boot (a fresh machine) measures its own peak. (The same
    machine's second call reusing the first's baselines, its ratios saying "same machine": tests/test_gpu_tools.py's
    lease of two calls.)"""
    gpu, state = "GPU-test-0000", str(tmp_path / "state")
    run_check(tmp_path, "first", gpu, "boot-1", state, "--steps", "peak", "--budget-s", "300")
    first = json.loads((tmp_path / "first" / "gpu_check_call1.json").read_text())
    assert first["status"]["peak"]["status"] == "done" and first["machine"] == {"gpu_uuid": gpu, "boot_id": "boot-1"}
    run_check(tmp_path, "second", gpu, "boot-2", state, "--steps", "peak", "--budget-s", "300")
    second = json.loads((tmp_path / "second" / "gpu_check_call1.json").read_text())
    assert second["status"]["peak"]["status"] == "done"
    assert sorted(os.listdir(state)) == [f"{gpu}_boot-1", f"{gpu}_boot-2"]  # one state per machine


def test_a_killed_section_keeps_what_it_measured(tmp_path, monkeypatch):
    import gpu
    from gpu_run import Run
    out = tmp_path / "r.md"
    # the child prints a figure, waits until the results file holds it, prints the next, waits, then hangs: only a
    # rewrite after every figure lets it get that far before the budget kills it
    child = f"""
import json, time, sys
def wait_for(key):
    for _ in range(600):
        try:
            if key in json.load(open({str(out.with_suffix('.json'))!r})).get("partial", {{}}).get("fake", {{}}):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    sys.exit("the results were not rewritten after the figure " + key)
print('FIGURE {{"first": 1.5}}', flush=True); wait_for("w: first")
print('FIGURE {{"second": [2, 3]}}', flush=True); wait_for("w: second")
open({str(tmp_path / "confirmed")!r}, "w").write("both figures were in the results file as they came")
time.sleep(600)
"""

    def section_fake(run):
        run._stream([sys.executable, "-c", child], "the fake worker", prefix="w: ")
        raise AssertionError("the fake worker ends only when killed")

    monkeypatch.setitem(gpu.SECTIONS, "fake", gpu_budget.Step("fake", "section", (1, 1), (), run="section_fake"))
    monkeypatch.setattr(gpu, "section_function", lambda name: section_fake)
    run = Run("quick", 600, deadline=time.perf_counter() + 20)
    run.estimates["fake"] = 1.0
    info = {"name": "cpu", "slug": "cpu", "torch": "x", "cuda": None, "cpu_cores": 1, "platform": "p", "commit": "c"}

    def write(failures, statuses):
        gpu.write_results(str(out), info, "fake", run, "now", time.perf_counter(), failures, statuses, 20.0)
    failures, statuses = gpu.run_sections(run, ["fake"], write)
    write(failures, statuses)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["section_status"]["fake"]["status"] == "cut off", data
    assert data["partial"]["fake"] == {"w: first": 1.5, "w: second": [2, 3]}
    assert (tmp_path / "confirmed").exists()  # written while it ran, each figure as it came
    assert "`fake`: did not finish; what it measured before" in out.read_text()


def test_a_section_that_raises_says_what_where_and_its_last_lines_on_the_closing_screen(tmp_path, monkeypatch):
    """Issue 58: a section that raises is failed with its exception's type and message, where this checkout raised
    it and the section's last output lines, in gpu.py's status (the traceback in its results) and in the why of the
    check's closing screen, beside the command that runs it again; gpu.py's own crash says its exit code and the
    last lines of its log."""
    import gpu
    from gpu_run import Run
    out = tmp_path / "r.md"

    def section_fake(run):
        child = "print('building'); print('FIGURE {\"x\": 1}'); print('step 1 of 3'); print('step 2 of 3 | tokens')"
        run._stream([sys.executable, "-c", child], "the fake worker")
        return [][0]  # what fp8 met reading a loss its run did not write

    monkeypatch.setitem(gpu.SECTIONS, "fake", gpu_budget.Step("fake", "section", (1, 1), (), run="section_fake"))
    monkeypatch.setattr(gpu, "section_function", lambda name: section_fake)
    run = Run("quick", 600)
    run.estimates["fake"] = 1.0
    info = {"name": "cpu", "slug": "cpu", "torch": "x", "cuda": None, "cpu_cores": 1, "platform": "p", "commit": "c"}

    def write(failures, statuses):
        gpu.write_results(str(out), info, "fake", run, "now", time.perf_counter(), failures, statuses)
    failures, statuses = gpu.run_sections(run, ["fake"], write)
    write(failures, statuses)
    data = json.loads(out.with_suffix(".json").read_text())
    status = data["section_status"]["fake"]
    assert status["status"] == "failed", data
    line = [n for n, ln in enumerate(open(__file__).read().splitlines(), start=1) if "return [][0]" in ln][0]
    assert status["note"] == (f"IndexError: list index out of range (at tests/test_gpu_plan.py:{line} in section_fake); "
                              "last lines: `building` / `step 1 of 3` / `step 2 of 3 | tokens`")
    assert "Traceback (most recent call last)" in data["failures"][0]["error"] and "return [][0]" in out.read_text()

    update = gpu_outcome.section_statuses(data, ["fake"], 1, str(tmp_path / "gpu.log"))
    assert update["fake"]["status"] == "failed"  # (its FIGURE line: kept, and said so)
    assert update["fake"]["note"] == status["note"] + "; its figures so far are in the results (`partial`)"
    screen = "\n".join(gpu_outcome.closing_steps({"fake": {**update["fake"], "seconds": 2.0}}, " --quick"))
    row = next(ln for ln in screen.splitlines() if ln.startswith("| fake "))
    assert status["note"].replace("|", "/") in row and "`bash scripts/gpu_check.sh --steps fake --quick`" in row
    assert "Failed: fake; again: `bash scripts/gpu_check.sh --steps fake --quick`" in screen

    (tmp_path / "gpu.log").write_text("[gpu.py] fake (0.0 min)\nTraceback (most recent call last):\nMemoryError\n\n")
    crashed = gpu_outcome.section_statuses({"section_status": {}}, ["fake"], -9, str(tmp_path / "gpu.log"))["fake"]
    assert crashed == {"status": "failed", "note": "gpu.py exit code -9 before it; last lines: `[gpu.py] fake (0.0 "
                                                   "min)` / `Traceback (most recent call last):` / `MemoryError`"}


def test_the_timed_steps_and_the_background_tests_get_their_own_cores(tmp_path):
    timed, tests = gpu_check.split_cores()
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:
        assert timed and tests and not timed & tests and timed | tests == cores
    else:
        assert timed == tests == cores
    core = min(tests)
    rc, _ = gpu_check.run_process([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                  str(tmp_path / "log"), 60, preexec_fn=gpu_check.pinned({core}))
    assert rc == 0 and (tmp_path / "log").read_text().strip() == f"[{core}]"


def test_targets_table_reads_figures_and_says_same_machine():
    import gpu_targets
    sections = {"compiled": {"over_plain_compiled": 1.02, "mfu": 0.65, "max_memory_bytes": 30.0},
                "plain": {"plain PyTorch, torch.compile": {"max_memory_bytes": 40.0}},
                "muon": {"muon": {"over_adamw": 1.2}}}
    rows = {r[0]: r for r in gpu_targets.rows(sections, {"plain": "measured by call1"})}
    names = [t.name for t in gpu_targets.TARGETS]
    assert rows[names[0]][1:3] == ["1.020", "met"] and "plain: same machine, measured by call1" in rows[names[0]][3]
    assert rows[names[1]][1:3] == ["0.650", "NOT MET"] and rows[names[1]][3].endswith("same run")
    assert rows[names[2]][1:3] == ["0.750", "met"] and rows[names[3]][1] == "not measured"
    assert rows[names[5]][1:3] == ["1.200", "NOT MET"]
