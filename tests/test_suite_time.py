"""The suite's own time (issue 60):

- bench/micro/suite_time.py's pytest plugin (bench/micro/suite_time_plugin.py) records what each test spent, one
  JSON line per test into a file per pytest process (pytest-xdist's workers each their own): on a synthetic test
  file, the test that forks two processes counts two forks, the one that starts a Python process one Python
  process (and its CPU seconds among the children's), the one that compiles a function TorchDynamo's seconds,
  the idle one nothing; the report reads the records into per-file rows, the slowest tests and the buckets of
  where the time went (the start-up estimate: Python processes x the measured start-up);
- tests/conftest.py collects the files slowest first by tests/file_seconds.json (a file it does not name last, the
  tests of a file in their order), which scripts/run_tests.sh's parallel processes take in that order;
- tests/file_seconds.json names only test files that exist.
"""

import json
import os
import subprocess
import sys

import conftest
from cuda_harness import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402,F401  (puts the bench family folders on sys.path)
import suite_time  # noqa: E402

SYNTHETIC = '''
import multiprocessing as mp
import subprocess
import sys

import torch  # at collection, as the suite's modules do: the plugin times TorchDynamo from then on


def work():
    sum(range(10**5))


def test_forks_two():
    procs = [mp.get_context("fork").Process(target=work) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def test_starts_python():
    subprocess.run([sys.executable, "-c", "sum(range(10**6))"], check=True)


def test_compiles():
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]


def test_idle():
    pass
'''


def test_the_plugin_records_each_test_and_the_report_reads_them(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SYNTHETIC)
    records = tmp_path / "records"
    records.mkdir()
    env = dict(os.environ, SUITE_TIME_RECORDS=str(records), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "bench", "micro"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_time_plugin", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "load", "test_synthetic.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(os.listdir(records))
    assert set(files) <= {"gw0.jsonl", "gw1.jsonl"} and files  # one per pytest-xdist worker that ran a test
    tests = {}
    for name in files:
        for line in (records / name).read_text().splitlines():
            record = json.loads(line)
            tests[record["test"].split("::")[1]] = record
    assert set(tests) == {"test_forks_two", "test_starts_python", "test_compiles", "test_idle"}
    assert [tests[t]["forks"] for t in ("test_forks_two", "test_starts_python", "test_idle")] == [2, 0, 0]
    assert [tests[t]["python_execs"] for t in ("test_forks_two", "test_starts_python", "test_idle")] == [0, 1, 0]
    assert tests["test_starts_python"]["cpu_children_s"] > 0 and tests["test_forks_two"]["cpu_children_s"] > 0
    assert tests["test_compiles"]["compile_s"] > 0 and tests["test_idle"]["compile_s"] == 0
    assert all(r["wall_s"] > 0 and r["file"] == "test_synthetic.py" for r in tests.values())

    run = suite_time.summarize({"label": "synthetic", "commit": "0" * 40, "kind": "cold", "started": "now",
                                "wall_s": 60.0, "exit_code": 0, "summary": "4 passed", "cores": 2,
                                "workers": len(files), "load": dict.fromkeys(
                                    ("start_1min", "mean_1min", "max_1min", "end_1min", "end_5min"), 1.0),
                                "left_in_the_checkout": [], "tests": list(tests.values())}, startup_s=1.5)
    buckets = run["buckets"]
    assert run["tests_recorded"] == 4 and run["python_execs"] == 1 and run["forks"] == 2
    assert buckets["tests starting Python processes"]["tests"] == 1
    assert buckets["of which Python + torch start-up (estimated)"]["wall_s"] == 1.5
    assert buckets["tests forking ranks (gloo collectives, the ranks' steps)"]["tests"] == 1
    assert buckets["in-process tests (model steps, data, tools)"]["tests"] == 2
    assert [f["file"] for f in run["files"]] == ["test_synthetic.py"] and run["files"][0]["tests"] == 4
    md = suite_time.render({"runs": [run]})
    assert "| synthetic" in md and "56 min 26 s" in md and "test_synthetic.py::test_forks_two" in md
    assert "What the run left in the checkout" in md


class Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_files_are_collected_slowest_first(tmp_path, monkeypatch):
    seconds = tmp_path / "file_seconds.json"
    seconds.write_text(json.dumps({"seconds": {"tests/test_b.py": 300.0, "tests/test_c.py": 20.0}}))
    monkeypatch.setattr(conftest, "FILE_SECONDS", str(seconds))
    items = [Item(n) for n in ("tests/test_a.py::x", "tests/test_b.py::y", "tests/test_b.py::z", "tests/test_c.py::w",
                               "tests/test_d.py::v")]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["tests/test_b.py::y", "tests/test_b.py::z", "tests/test_c.py::w",
                                         "tests/test_a.py::x", "tests/test_d.py::v"]
    monkeypatch.setattr(conftest, "FILE_SECONDS", str(tmp_path / "missing.json"))
    conftest.pytest_collection_modifyitems(None, None, items)  # no table: the order stays
    assert [i.nodeid for i in items][0] == "tests/test_b.py::y"


def test_file_seconds_names_only_test_files_that_exist():
    with open(conftest.FILE_SECONDS) as f:
        data = json.load(f)
    assert data["seconds"] and all(os.path.isfile(os.path.join(ROOT, path)) for path in data["seconds"])
    assert all(path.startswith("tests/test_") for path in data["seconds"])
