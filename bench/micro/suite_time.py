import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

__doc__ = """How long the README's test command takes on a fresh clone (issue 60): `bash scripts/run_tests.sh` in a new
clone of this checkout's commit, first with an empty compile cache (cold), then again in the same clone (warm),
each timed from the command's start to its end, with the machine's cores and its load beside the figure, and where
the time went: per file and per test, and by what the tests spend it on. Writes bench/results/suite_time.md and
the .json beside it (each label's runs replace that label's earlier ones; the others stay).

    python bench/micro/suite_time.py --label after             # cold then warm, at HEAD (commit first)
    python bench/micro/suite_time.py --label before --ref main --runs cold
    python bench/micro/suite_time.py --label x --runs cold --keep --file-seconds   # and tests/file_seconds.json
    python bench/micro/suite_time.py --label x --runs warm --reuse DIR              # warm, in the kept folder
    python bench/micro/suite_time.py --report-only             # the .md again from the .json

A fresh clone: `git clone` of the checkout at --ref into a temporary folder, the checkout's .venv linked in (the
run makes no network call: scripts/setup_env.sh finds every requirement installed), TORCHINDUCTOR_CACHE_DIR a new
empty folder for the cold run and the same folder, now filled, for the warm one (the warm run also finds the
clone's __pycache__ and .pytest_cache). The suite runs with bench/micro/suite_time_plugin.py loaded (pytest -p),
which records each test's wall and CPU seconds, the processes it forked (ranks) and executed (Python processes:
each pays torch's import), and TorchDynamo's compile seconds in the pytest process; `--durations=0` is not needed.

Where the time goes is read from those records: the tests that start Python processes (their start-up estimated
as processes x the seconds of `python -c "import torch, megatron_po.training"` measured here before the run),
those that fork ranks joined by gloo (collectives and the ranks' steps), the in-process rest (training steps),
TorchDynamo's compiling among them, and what the warm cache saves (cold - warm). On a shared machine the absolute
figures carry its load: the load average is sampled every 30 s of each run and recorded beside it; compare ratios.
"""

import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from bench_common import RESULTS, REPO, loadavg, log, markdown_table, now  # noqa: E402

OUT = os.path.join(RESULTS, "suite_time.md")
PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_time_plugin.py")
# Issue 60's figures as reported (a fresh clone of main alone on a 2-core machine; not re-measured here)
REPORTED = [{"label": "issue 60, as reported", "kind": "cold", "wall_s": 56 * 60 + 26,
             "summary": "1865 passed, 40 skipped", "cores": 2, "note": "fresh 2-core machine, alone"},
            {"label": "issue 60, as reported", "kind": "warm", "wall_s": 22 * 60 + 20,
             "summary": "", "cores": 2, "note": "the machine that made the last submission"}]
STARTUP_CODE = "import torch, megatron_po.training"
TOP_FILES, TOP_TESTS = 30, 25


def minutes(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 60} min {whole % 60:02d} s"


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def fresh_clone(ref: str, where: str) -> tuple[str, str]:
    """A clone of this checkout at `ref` in `where`, the checkout's .venv linked in; (its folder, the commit)."""
    clone = os.path.join(where, "clone")
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", REPO, clone], check=True)
    commit = git("rev-parse", ref)
    git("checkout", "--quiet", commit, cwd=clone)
    os.symlink(os.path.realpath(os.path.join(REPO, ".venv")), os.path.join(clone, ".venv"))
    return clone, commit


def startup_seconds(clone: str, env: dict, reps: int = 3) -> float:
    """Median wall seconds of `python -c "import torch, megatron_po.training"` in the clone (one round first: the
    page cache)."""
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        subprocess.run([os.path.join(clone, ".venv", "bin", "python"), "-c", STARTUP_CODE], cwd=clone, env=env,
                       check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class LoadSampler(threading.Thread):
    """The 1-minute load average every `every` seconds while a run lasts."""

    def __init__(self, every: float = 30.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [loadavg()[0]], threading.Event()

    def run(self):
        while not self.stop.wait(self.every):
            self.samples.append(loadavg()[0])


def pytest_summary(text: str) -> str:
    """pytest's closing line without its time: "1865 passed, 40 skipped"."""
    found = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|error|xfailed|deselected).*?) in [\d.]+s", text, re.M)
    return found[-1] if found else "no summary line"


def run_suite(clone: str, kind: str, env: dict, records: str, pytest_args: list[str], log_path: str) -> dict:
    """One `bash scripts/run_tests.sh` in the clone, timed, its per-test records read back."""
    shutil.rmtree(records, ignore_errors=True)
    os.makedirs(records)
    sampler = LoadSampler()
    sampler.start()
    started, t0 = now(), time.perf_counter()
    with open(log_path, "w") as out:
        rc = subprocess.run(["bash", "scripts/run_tests.sh", "-p", "suite_time_plugin", *pytest_args], cwd=clone,
                            env=dict(env, SUITE_TIME_RECORDS=records), stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    sampler.stop.set()
    with open(log_path, errors="replace") as f:
        text = f.read()
    tests = []
    for name in sorted(os.listdir(records)):
        with open(os.path.join(records, name)) as f:
            tests += [json.loads(line) for line in f if line.strip()]
    workers = len(os.listdir(records))
    one, five, _ = loadavg()
    # what the suite left in the checkout (untracked or ignored): a place two parallel pytest processes share
    left = [line[3:] for line in git("status", "--porcelain", "--ignored", cwd=clone).splitlines()]
    left = sorted(p for p in left if not p.startswith((".venv", ".pytest_cache", ".cache/")) and "__pycache__" not in p)
    return {"kind": kind, "started": started, "wall_s": wall, "exit_code": rc, "summary": pytest_summary(text),
            "cores": os.cpu_count(), "workers": workers,
            "load": {"start_1min": sampler.samples[0], "mean_1min": statistics.mean(sampler.samples),
                     "max_1min": max(sampler.samples), "end_1min": one, "end_5min": five},
            "left_in_the_checkout": left, "tests": tests}


def summarize(run: dict, startup_s: float) -> dict:
    """Per file, the slowest tests, and the buckets of where the time went, from a run's per-test records."""
    tests = run.pop("tests")
    files: dict[str, dict] = {}
    for t in tests:
        f = files.setdefault(t["file"], {"file": t["file"], "tests": 0, "wall_s": 0.0, "cpu_self_s": 0.0,
                                         "cpu_children_s": 0.0, "forks": 0, "python_execs": 0, "compile_s": 0.0})
        f["tests"] += 1
        for k in ("wall_s", "cpu_self_s", "cpu_children_s", "forks", "python_execs", "compile_s"):
            f[k] += t[k]
    execs = [t for t in tests if t["python_execs"]]
    forks = [t for t in tests if t["forks"] and not t["python_execs"]]
    rest = [t for t in tests if not t["forks"] and not t["python_execs"]]
    total = sum(t["wall_s"] for t in tests)
    n_execs = sum(t["python_execs"] for t in tests)
    buckets = {
        "tests starting Python processes": {"tests": len(execs), "wall_s": sum(t["wall_s"] for t in execs)},
        "of which Python + torch start-up (estimated)": {"tests": len(execs), "wall_s": n_execs * startup_s},
        "tests forking ranks (gloo collectives, the ranks' steps)": {"tests": len(forks),
                                                                     "wall_s": sum(t["wall_s"] for t in forks)},
        "in-process tests (model steps, data, tools)": {"tests": len(rest), "wall_s": sum(t["wall_s"] for t in rest)},
        "TorchDynamo compiling in the pytest process (in the rows above)": {
            "tests": sum(1 for t in tests if t["compile_s"] > 0), "wall_s": sum(t["compile_s"] for t in tests)},
    }
    run.update(tests_recorded=len(tests), sum_test_wall_s=total, python_execs=n_execs, startup_s=startup_s,
               forks=sum(t["forks"] for t in tests), buckets=buckets,
               files=sorted(files.values(), key=lambda f: -f["wall_s"]),
               slowest=sorted(tests, key=lambda t: -t["wall_s"])[:100])
    return run


def write_file_seconds(run: dict) -> None:
    """tests/file_seconds.json: each file's wall seconds in `run`, which tests/conftest.py orders the files by."""
    seconds = {f["file"]: round(f["wall_s"], 1) for f in run["files"]}
    data = {"written_by": "python bench/micro/suite_time.py --file-seconds",
            "run": f"{run['label']}, {run['kind']}, commit {run['commit'][:7]}, {run['started']}, {run['workers']} "
                   f"pytest processes on {run['cores']} cores, load {run['load']['mean_1min']:.1f}",
            "seconds": dict(sorted(seconds.items(), key=lambda kv: -kv[1]))}
    bench_common.write_text(os.path.join(bench_common.TESTS, "file_seconds.json"), json.dumps(data, indent=1) + "\n")


def render(data: dict) -> str:
    runs = data["runs"]
    lines = ["# The test suite's time on a fresh clone (issue 60)", "",
             "Command: `python bench/micro/suite_time.py` (see its --help): `bash scripts/run_tests.sh` in a fresh "
             "clone, cold (empty TORCHINDUCTOR_CACHE_DIR) then warm (the same clone and cache again). Each run's "
             "machine load is beside it: the machine was shared while these ran, so its absolute figures are "
             "inflated by the load; compare ratios across rows measured at similar load.", "",
             "## Wall time of `bash scripts/run_tests.sh`", ""]
    rows = [[r["label"], r["kind"], minutes(r["wall_s"]), r.get("summary", ""), r.get("cores", ""), "", "",
             r.get("note", "")] for r in REPORTED]
    for r in runs:
        ld = r["load"]
        rows.append([r["label"], r["kind"], minutes(r["wall_s"]), r["summary"], r["cores"],
                     r["workers"], f"{ld['mean_1min']:.1f} (max {ld['max_1min']:.1f})",
                     f"commit {r['commit'][:7]}, {r['started']}, exit code {r['exit_code']}"])
    lines += [markdown_table(["label", "cache", "wall", "pytest", "cores", "pytest processes", "load (1-min mean)",
                              "run"], rows), ""]
    for r in runs:
        cpu = sum(f["cpu_self_s"] + f["cpu_children_s"] for f in r["files"])
        lines += [f"## {r['label']}, {r['kind']}: where the time went", "",
                  f"{r['tests_recorded']} tests recorded; their walls sum to {minutes(r['sum_test_wall_s'])} over "
                  f"{r['workers']} pytest process(es) (side by side), against {minutes(r['wall_s'])} of wall for the "
                  f"command; the CPU time they and the processes they waited for used: {minutes(cpu)} (what the "
                  f"load does not inflate; compile workers kept for the next compile not counted). "
                  f"{r['python_execs']} Python processes started by tests at "
                  f"{r['startup_s']:.2f} s of start-up each (`python -c \"{STARTUP_CODE}\"`, measured before the "
                  f"run); {r['forks']} processes forked.", ""]
        total = r["sum_test_wall_s"] or 1.0
        lines += [markdown_table(["bucket", "tests", "seconds", "share of the tests' sum"],
                                 [[k, b["tests"], f"{b['wall_s']:.0f}", f"{100 * b['wall_s'] / total:.0f} %"]
                                  for k, b in r["buckets"].items()]), ""]
        lines += [f"Slowest {TOP_FILES} files:", "",
                  markdown_table(["file", "tests", "wall s", "CPU s (pytest)", "CPU s (children)", "forks",
                                  "Python processes", "compile s"],
                                 [[f["file"], f["tests"], f"{f['wall_s']:.1f}", f"{f['cpu_self_s']:.1f}",
                                   f"{f['cpu_children_s']:.1f}", f["forks"], f["python_execs"], f"{f['compile_s']:.1f}"]
                                  for f in r["files"][:TOP_FILES]]), ""]
        left = r.get("left_in_the_checkout")
        if left is not None:
            lines += ["What the run left in the checkout (untracked or git-ignored; .venv, caches and __pycache__ "
                      "aside): " + (", ".join(f"`{p}`" for p in left) or "nothing") + ".", ""]
        lines += [f"Slowest {TOP_TESTS} tests:", "",
                  markdown_table(["test", "wall s", "CPU s (children)", "forks", "Python processes", "compile s"],
                                 [[t["test"], f"{t['wall_s']:.1f}", f"{t['cpu_children_s']:.1f}", t["forks"],
                                   t["python_execs"], f"{t['compile_s']:.1f}"] for t in r["slowest"][:TOP_TESTS]]), ""]
    pairs = {}
    for r in runs:
        pairs.setdefault(r["label"], {})[r["kind"]] = r
    saved = [[label, minutes(p["cold"]["wall_s"] - p["warm"]["wall_s"]),
              f"{p['warm']['wall_s'] / p['cold']['wall_s']:.2f}"] for label, p in pairs.items() if len(p) == 2]
    if saved:
        lines += ["## What a warm cache saves", "", markdown_table(["label", "cold - warm", "warm / cold"], saved), ""]
    if data.get("notes"):
        lines += ["## Notes", "", *data["notes"], ""]
    return bench_common.portable("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_common.parser(__doc__)
    ap.add_argument("--ref", default="HEAD", help="the commit to clone (default HEAD: commit first)")
    ap.add_argument("--label", default=None, help="the runs' label in the results (default: the commit)")
    ap.add_argument("--runs", nargs="+", choices=["cold", "warm"], default=["cold", "warm"],
                    help="which runs, in order, in one clone and cache (default cold warm; a warm run is warm only "
                         "after a cold one)")
    ap.add_argument("--pytest-args", nargs="*", default=[], help="passed to run_tests.sh after the plugin")
    ap.add_argument("--out", default=OUT, help="the .md (the .json beside it); default bench/results/suite_time.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json, run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the clone, its logs and records (printed)")
    ap.add_argument("--reuse", metavar="DIR", help="the folder a --keep run kept: its clone (moved to --ref) and its "
                                                   "compile cache, for a warm run after a cold one at another commit")
    ap.add_argument("--file-seconds", action="store_true",
                    help="write tests/file_seconds.json from the first run (each file's wall seconds): the order "
                         "tests/conftest.py collects the files in, slowest first")
    args = ap.parse_args(argv)
    json_path = os.path.splitext(args.out)[0] + ".json"
    data = {"runs": []}
    if os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    if not args.report_only:
        if args.reuse:  # a kept folder: its clone moved to --ref, its compile cache as the last run left it
            where, clone = args.reuse, os.path.join(args.reuse, "clone")
            git("fetch", "--quiet", REPO, cwd=clone)
            commit = git("rev-parse", args.ref)
            git("checkout", "--quiet", commit, cwd=clone)
        else:
            where = tempfile.mkdtemp(prefix="suite_time_")
            clone, commit = fresh_clone(args.ref, where)
        label = args.label or commit[:7]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TORCHINDUCTOR_"))}
        shutil.copy(PLUGIN, where)
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(where, "inductor_cache"),
                   PYTHONPATH=os.pathsep.join([where, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        startup = startup_seconds(clone, env)
        log(f"[suite_time] {label}: clone of {commit[:7]} in {where}; start-up {startup:.2f} s")
        runs = []
        for kind in args.runs:
            log(f"[suite_time] {label}, {kind}: bash scripts/run_tests.sh ({now()}, load {loadavg()[0]:.2f})")
            run = run_suite(clone, kind, env, os.path.join(where, f"records_{kind}"), args.pytest_args,
                            os.path.join(where, f"{kind}.log"))
            runs.append(summarize({"label": label, "commit": commit, **run}, startup))
            log(f"[suite_time] {label}, {kind}: {minutes(run['wall_s'])}, {run['summary']}, exit code "
                f"{run['exit_code']}")
            data["runs"] = [r for r in data["runs"] if (r["label"], r["kind"]) != (label, kind)] + [runs[-1]]
            bench_common.write_text(json_path, bench_common.portable(json.dumps(data, indent=1)) + "\n")
            bench_common.write_text(args.out, render(data))
        if args.file_seconds and runs[0]["exit_code"] in (0, 1):  # every file ran to its end (1: a test failed)
            write_file_seconds(runs[0])
        if args.keep or args.reuse:
            log(f"[suite_time] kept {where}")
        else:
            shutil.rmtree(where, ignore_errors=True)
    bench_common.write_text(args.out, render(data))
    log(f"[suite_time] wrote {os.path.relpath(args.out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
