import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

__doc__ = """What a user's commands cost from process start to exit, against `python -c "import torch"` in the same run
(issue 42): `--help` and a bad flag of pretrain_gpt.py (target: at most 1.3x the bare import), and the runnable
blocks of the manual (what tests/test_docs.py runs; their budget: about 20 s of CPU together).

    python bench/micro/startup_time.py [--reps 5] [--only startup docs] [--quick] [--out FILE]

(`--before DIR`, the same commands in another checkout alternating with these, made the results file's
`(at 4546b20)` rows at commit 7fdb8b7; removed since.)

Each command is a fresh process (`subprocess.run`, stdout and stderr captured), timed from its start to its
exit: wall seconds (perf_counter around the call) and CPU seconds (user + system of the waited-for children,
getrusage, so torchrun's workers count). The start-up commands alternate, the order rotated every repetition,
after one warm-up round (the page cache); medians per command and their ratio to the bare import's median.
The runnable blocks run once each (`--reps-docs`), from a scratch copy of the checkout as the test runs them
(tests/test_docs.py: its block finder and scratch checkout, so the two never differ), each beside the bare
import's CPU time. Ratios, not seconds, compare across machines; on a loaded machine CPU time is steadier than
wall time. Writes bench/results/startup_time.md.
"""

import importlib.util  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

RESULTS = os.path.join(bench_common.RESULTS, "startup_time.md")
BASELINE = "python -c 'import torch'"
STARTUP = {  # label -> (argv after the interpreter, expected exit code)
    BASELINE: (["-c", "import torch"], 0),
    "python pretrain_gpt.py --help": (["pretrain_gpt.py", "--help"], 0),
    "python pretrain_gpt.py --no-such-flag": (["pretrain_gpt.py", "--no-such-flag"], 2),
}
TARGET = 1.3  # --help and a bad flag: at most this times the bare import (issue 42)
DOCS_CPU_BUDGET_S = 20.0  # the manual's runnable blocks together (tests/test_docs.py's docstring)


def env() -> dict:
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def timed(cmd: list[str], cwd: str, environ: dict, timeout: float = 600) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the process and its waited-for children, exit code) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, proc.returncode


def measure_startup(reps: int, warm_up: bool = True) -> dict[str, dict]:
    """Wall and CPU seconds per start-up command, `reps` each, alternating after a warm-up round."""
    labels, environ = list(STARTUP), env()
    out = {label: {"wall": [], "cpu": []} for label in labels}
    for rep in range(-1 if warm_up else 0, reps):  # -1: the warm-up round, not kept
        for i in range(len(labels)):
            label = labels[(rep + i) % len(labels)]
            argv, expected = STARTUP[label]
            wall, cpu, code = timed([sys.executable, *argv], bench_common.REPO, environ)
            if code != expected:
                raise SystemExit(f"error: `{label}` exited {code}, expected {expected}")
            if rep >= 0:
                out[label]["wall"].append(wall)
                out[label]["cpu"].append(cpu)
    return out


def test_docs_module():
    """tests/test_docs.py, loaded from its path: the runnable blocks and the scratch checkout it runs them in."""
    spec = importlib.util.spec_from_file_location("test_docs", os.path.join(bench_common.TESTS, "test_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_docs(blocks: list[str] | None, reps: int) -> list[dict]:
    """Wall and CPU seconds of each runnable block (`blocks`: their `page:line`, None for all)."""
    docs = test_docs_module()
    found = [(f"{docs.rel(page)}:{block['line']}", block) for page, block in docs.runnable_blocks()]
    if blocks is not None:
        unknown = sorted(set(blocks) - {where for where, _ in found})
        if unknown:
            raise SystemExit(f"error: no runnable block at {', '.join(unknown)} (runnable: "
                             f"{', '.join(where for where, _ in found)})")
        found = [(where, block) for where, block in found if where in blocks]
    rows = []
    with tempfile.TemporaryDirectory(prefix="startup-time-") as tmp:
        root, environ = docs.scratch_checkout(tmp)
        for where, block in found:
            runs = [timed(["bash", "-euo", "pipefail", "-c", block["code"]], root, environ) for _ in range(reps)]
            if any(code != 0 for *_, code in runs):
                raise SystemExit(f"error: the runnable block at {where} exited {[c for *_, c in runs]}")
            rows.append({"block": where, "wall": [w for w, _, _ in runs], "cpu": [c for _, c, _ in runs]})
    return rows


def main(argv=None) -> None:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--reps", type=int, default=5, help="runs of each start-up command (medians of them)")
    parser.add_argument("--reps-docs", type=int, default=1, help="runs of each runnable block")
    parser.add_argument("--only", nargs="+", choices=("startup", "docs"), default=["startup", "docs"])
    parser.add_argument("--block", nargs="+", metavar="PAGE:LINE", help="only these runnable blocks")
    parser.add_argument("--quick", action="store_true", help="1 run of each start-up command, no warm-up, and of "
                                                            "the runnable blocks only those --block names (a smoke test)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    started = time.perf_counter()
    out = bench_common.Lines(bench_common.card(
        __file__, argv, "Start-up time: commands from process start to exit, against `import torch` (issue 42)",
        "CPU only (fresh processes, OMP_NUM_THREADS=1)", f"start-up commands {reps} run(s) each"
        f"{'' if args.quick else ' after a warm-up round'}, alternating (order rotated); runnable blocks "
        f"{args.reps_docs} run(s) each"))

    # The bare import is measured even when only the blocks are: their ratios need it.
    startup = measure_startup(reps if "startup" in args.only or args.quick else max(reps, 3), not args.quick)
    base = {kind: bench_common.median(startup[BASELINE][kind]) for kind in ("wall", "cpu")}
    if "startup" in args.only:
        rows, verdicts = [], []
        for label, t in startup.items():
            wall, cpu = bench_common.median(t["wall"]), bench_common.median(t["cpu"])
            ratio = wall / base["wall"]
            rows.append([f"`{label}`", f"{wall:.2f}", f"{cpu:.2f}", f"{ratio:.2f}x", f"{cpu / base['cpu']:.2f}x"])
            if label != BASELINE:
                verdicts.append(f"`{label}`: {ratio:.2f}x (wall, medians) -> "
                                f"{'met' if ratio <= TARGET else 'NOT met'} (target <= {TARGET}x)")
        out.emit("## Start-up: `--help` and a bad flag")
        out.emit()
        out.emit(bench_common.markdown_table(["command", "wall s (median)", "CPU s (median)", "wall / import torch",
                                              "CPU / import torch"], rows))
        out.emit()
        for line in verdicts:
            out.emit(f"- {line}")
        out.emit()
    if "docs" in args.only:
        out.emit("## The manual's runnable blocks (tests/test_docs.py runs them)")
        out.emit()
        if args.quick and not args.block:
            out.emit("Not run (--quick without --block).")
        else:
            docs = measure_docs(args.block, args.reps_docs)
            rows = [[f"`{d['block']}`", f"{bench_common.median(d['wall']):.1f}", f"{bench_common.median(d['cpu']):.1f}",
                     f"{bench_common.median(d['cpu']) / base['cpu']:.1f}x"] for d in docs]
            total = sum(bench_common.median(d["cpu"]) for d in docs)
            rows.append(["together", f"{sum(bench_common.median(d['wall']) for d in docs):.1f}", f"{total:.1f}",
                         f"{total / base['cpu']:.1f}x"])
            out.emit(bench_common.markdown_table(["block", "wall s", "CPU s", "CPU / import torch"], rows))
            out.emit()
            out.emit(f"- together {total:.1f} s of CPU = {total / base['cpu']:.1f}x `import torch` "
                     f"({base['cpu']:.2f} s of CPU here): {'within' if total <= DOCS_CPU_BUDGET_S else 'OVER'} the "
                     f"manual's budget of about {DOCS_CPU_BUDGET_S:.0f} s (a budget on this machine; the ratio "
                     f"is what compares across machines)")
            out.emit()
    out.emit(bench_common.load_at_end(started))
    out.write(args.out)


if __name__ == "__main__":
    main()
