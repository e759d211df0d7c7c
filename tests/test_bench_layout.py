"""The benchmark scripts' layout (issue 20): bench/convergence/convergence.py and bench/schedules/schedules.py are split into small
modules (settings, workloads, runs, measure, stats, report, plots; stages, measure, runs, report) sharing
bench/bench_common.py. Checks that no bench module grows past 600 lines again, that bench/'s own modules
import one another without a circle, and that every name other scripts take from a benchmark module
(`cv.<name>` after `import convergence as cv`, `from schedules_runs import ...`) is still defined there,
since those scripts (bench/time_to_quality/ttq_run.py, ttq_report.py, delay_robust.py, ...) are only run by hand. A script
that overrides a function for the jobs must do it in the module that calls it: rebinding a name that
convergence.py only re-exports would not reach the jobs.

Issue 37: bench/ reads as families, one folder each (bench_common.FAMILIES, bench/README.md is the index): no
module left at bench/'s root but the shared harness, no folder over MAX_FOLDER_LINES lines, module names unique
across the folders (every family is on sys.path at once), and every folder named in the index."""

import ast
import dataclasses
import importlib
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
MAX_LINES = 600


MAX_FOLDER_LINES = 2500


def families() -> list[str]:
    return sorted(d for d in os.listdir(BENCH) if os.path.isdir(os.path.join(BENCH, d)) and d != "results"
                  and not d.startswith((".", "__")))


def bench_modules() -> dict[str, str]:
    """Every bench module by its flat name: the harness at bench/'s root and each family's modules."""
    paths = [os.path.join(BENCH, f) for f in os.listdir(BENCH) if f.endswith(".py")]
    paths += [os.path.join(BENCH, d, f) for d in families() for f in os.listdir(os.path.join(BENCH, d))
              if f.endswith(".py")]
    return {os.path.basename(p)[:-3]: p for p in sorted(paths)}


def lines(path: str) -> int:
    return sum(1 for _ in open(path))


def test_bench_reads_as_families(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import bench_common
    bench_common.add_repo_to_path()
    assert families() == sorted(bench_common.FAMILIES)
    assert sorted(f for f in os.listdir(BENCH) if f.endswith(".py")) == ["bench_common.py"]
    names = [f for d in families() for f in os.listdir(os.path.join(BENCH, d)) if f.endswith(".py")]
    assert len(names) == len(set(names)), "a module name appears in two families"
    per_folder = {d: sum(lines(os.path.join(BENCH, d, f)) for f in os.listdir(os.path.join(BENCH, d))
                         if f.endswith(".py")) for d in families()}
    assert {d: n for d, n in per_folder.items() if n > MAX_FOLDER_LINES} == {}
    index = open(os.path.join(BENCH, "README.md")).read()
    assert [d for d in families() if f"bench/{d}/" not in index] == []


def test_every_bench_module_imports_from_a_fresh_interpreter():
    """Each module finds its siblings and the shared harness however it is reached (run as a script or
    imported by path): only bench_common's sys.path set-up may be relied on."""
    import subprocess
    code = ("import importlib.util, sys\n"
            "for name, path in %r:\n"
            "    spec = importlib.util.spec_from_file_location('probe_' + name, path)\n"
            "    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n")
    cheap = {n: p for n, p in bench_modules().items()}
    out = subprocess.run([sys.executable, "-c", code % sorted(cheap.items())], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def imported_bench_modules(path: str, local: set[str]) -> set[str]:
    """bench/ modules that `path` imports anywhere (module level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out & local


def test_no_bench_module_over_600_lines():
    sizes = {name: lines(path) for name, path in bench_modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
    # The split itself: the two benchmarks that were 1,544 and 1,050 lines are now entry points.
    assert sizes["convergence"] < 250 and sizes["schedules"] < 250


def test_no_import_circle_among_bench_modules():
    modules = bench_modules()
    graph = {name: imported_bench_modules(path, set(modules)) - {name} for name, path in modules.items()}
    assert graph["convergence_runs"] >= {"convergence_settings", "convergence_workloads", "convergence_measure"}

    def cycle_from(node, stack, done):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = cycle_from(nxt, stack + [node], done)
            if found:
                return found
        done.add(node)
        return None

    done: set[str] = set()
    for name in modules:
        assert cycle_from(name, [], done) is None


def test_names_other_scripts_take_from_bench_modules_exist(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import bench_common
    bench_common.add_repo_to_path()
    modules = bench_modules()
    used: dict[str, set[str]] = {}
    for path in modules.values():
        text = open(path).read()
        for module, alias in re.findall(r"^\s*import (\w+) as (\w+)", text, re.M):
            if module in modules:
                used.setdefault(module, set()).update(re.findall(rf"\b{alias}\.(\w+)", text))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                used.setdefault(node.module, set()).update(a.name for a in node.names)
    # The scripts built on convergence.py use its names through the module (cv.Settings, cv.train_job, ...).
    assert {"Settings", "train_job", "calibrate_job", "PREDICTOR_VARIANTS", "LABELS", "REPO"} <= used["convergence"]
    for module, names in sorted(used.items()):
        mod = importlib.import_module(module)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert missing == [], f"{modules[module]} lacks {missing}"
    sys.modules.pop("convergence", None)  # loaded by name here; the other tests load it by path


def test_no_script_rebinds_a_re_exported_name(monkeypatch):
    """`cv.f = ...` on a name convergence.py imports from convergence_runs would leave the jobs calling the
    original: overrides belong in the defining module."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_common
    bench_common.add_repo_to_path()
    modules = bench_modules()
    for name, path in modules.items():
        text = open(path).read()
        aliases = {alias: module for module, alias in re.findall(r"^\s*import (\w+) as (\w+)", text, re.M)
                   if module in modules}
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in aliases:
                    module = importlib.import_module(aliases[target.value.id])
                    defined_in = getattr(getattr(module, target.attr, None), "__module__", module.__name__)
                    assert defined_in == module.__name__, (
                        f"{path}:{node.lineno} rebinds {module.__name__}.{target.attr}, defined in "
                        f"{defined_in}: override it there")
    sys.modules.pop("convergence", None)


def test_delay_robust_optimizer_override_reaches_the_jobs(monkeypatch):
    """delay_robust.train adds optimizer kwargs (NAdamW's beta1 ...) for one run: the jobs must see them
    (they read convergence_runs._optimizer_kwargs) and the original must be back afterwards."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_common
    bench_common.add_repo_to_path()
    import convergence
    import convergence_runs
    import delay_robust
    original = convergence_runs._optimizer_kwargs
    seen = {}

    def fake_train_job(s, D, optimizer, method, seed):  # what train_job would hand its optimizer
        seen.update(convergence_runs._optimizer_kwargs(s, optimizer))
        return {}

    monkeypatch.setattr(convergence, "train_job", fake_train_job)
    monkeypatch.setattr(convergence, "PREDICTOR_VARIANTS", dict(convergence.PREDICTOR_VARIANTS))
    monkeypatch.setattr(convergence, "LABELS", dict(convergence.LABELS))
    s = convergence.Settings(steps=64)
    s = dataclasses.replace(s, lr={**s.lr, "nadamw": 1e-3})
    delay_robust.train(s, "recipe", 1)
    assert seen == {"lr": 1e-3, "weight_decay": s.weight_decay, "sgd_momentum": s.sgd_momentum, "adam_beta1": 0.99}
    assert convergence_runs._optimizer_kwargs is original
    sys.modules.pop("convergence", None)
