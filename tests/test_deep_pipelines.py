"""bench/deep_pipelines/deep_pipelines.py (issue 36): the equal wall-clock budget from the op-list clock, the
common lr grid that grows for every unit, a real quick study end to end and its report's verdict rule; and
tools/simulate_schedule.py --cost-model, the user-facing table."""

import dataclasses
import json
import math
import os
import sys

import pytest
from test_convergence_bench import write_corpus  # the same tiny generated corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(REPO, "bench", "results", "gpu_nvidia_h200_a_cost_model.json")


@pytest.fixture(scope="module")
def dp():
    """The study's command (run, main) and its runs module (units, budget, horizons) as one namespace."""
    import types
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_common
    bench_common.add_repo_to_path()
    import deep_pipelines
    import deep_pipelines_runs
    return types.SimpleNamespace(**vars(deep_pipelines_runs), run=deep_pipelines.run, main=deep_pipelines.main)


def test_units_and_budget(dp):
    from megatron_po.pipeline import cost_model as cmm
    units = dp.plan_units(["muon"], [4, 8], ["sync", *dp.ASYNC], ["1", "2", "M"])
    names = {(u.name, u.M, u.k) for u in units}
    assert ("pipedream-2bw", 8, 8) in names and not any(n == "pipedream-2bw" and M == 4 for n, M, _ in names)
    assert ("pipeoptim", 4, 4) in names and ("po-ef", 8, 2) in names
    only = dp.plan_units(["adamw"], [4], ["sync", "pipeoptim"], ["1", "M"], k1_methods=[])
    assert [(u.name, u.k) for u in only] == [("sync", 4), ("pipeoptim", 4)]
    cm = cmm.load_cost_model(MEASURED)
    s = dp.study_settings()
    name, t_sync = dp.best_sync(cm, "muon", 4)
    assert name == "interleaved-zb-h1"  # interleaving admits M = 4 < D: 0.6 % ahead of ZB-V on this clock
    for u in units:
        n = dp.horizon(s, cm, u)
        if u.name == "sync":
            assert n == s.steps
            continue
        t = dp.seconds_per_microbatch(cm, "muon", u.name, u.M, u.k)
        t_sync = dp.best_sync(cm, "muon", u.M)[1]
        # the most whole evaluation intervals that fit in the budget
        assert n % s.eval_interval == 0 and n * t <= s.steps * t_sync * (1 + 1e-12)
        assert (n + s.eval_interval) * t > s.steps * t_sync


def test_report_helpers(dp):
    import deep_pipelines_report as rep
    curve = [(32, 5.0), (64, 4.5), (96, 4.0)]
    assert rep.first_reach(curve, 4.25) == pytest.approx(80.0)
    assert rep.first_reach(curve, 3.0) is None and rep.at(curve, 48) == pytest.approx(4.75)
    assert rep.fmt_x(1.2499) == "1.249x"


def test_quick_study_end_to_end(dp, tmp_path):
    corpus = tmp_path / "corpus.jsonl.gz"
    write_corpus(corpus)
    plan = dp.plan_from_args(["--quick", "--out", str(tmp_path / "out"), "--lr-grid", "adamw=2e-3,4e-3",
                              "--equal-samples"])
    plan.s = dataclasses.replace(plan.s, corpus=str(corpus), hidden_size=16, num_attention_heads=2, seq_length=16,
                                 micro_batch=2, vocab_size=120, split="90,10,0", out=str(tmp_path / "out"))
    plan.max_growth = 1
    logs = []
    js, md, png, verdicts = dp.run(plan, log=logs.append)
    data = json.load(open(js))
    units = {(u["name"], u["k"]): u for u in data["units"]}
    assert set(units) == {("sync", 4), ("pipeoptim", 4)}
    grid = data["grid"]["adamw"]
    # a best lr at an edge grows the grid on that side for every unit (once here)
    assert len(grid) == 2 + data["grown"]["adamw"]["low"] + data["grown"]["adamw"]["high"]
    for u in data["units"]:
        assert sorted(float(x) for x in u["sweep"]) == sorted(grid)
        assert u["best_lr"] == min(u["sweep"].items(), key=lambda kv: (kv[1], float(kv[0])))[0] or \
            math.isclose(u["best_lr"], float(min(u["sweep"].items(), key=lambda kv: (kv[1], float(kv[0])))[0]))
        assert [r["seed"] for r in u["runs"]] == [1, 2] and all(r["micro_batches"] == u["horizon"] for r in u["runs"])
        assert u["runs"][0]["curve"][-1][0] == u["horizon"]
    assert units[("pipeoptim", 4)]["horizon"] > units[("sync", 4)]["horizon"]  # more samples in the same time
    # the equal-samples view as runs of their own: H micro-batches at the unit's best lr, every seed
    same = units[("pipeoptim", 4)]["equal_samples_runs"]
    assert [r["seed"] for r in same] == [1, 2] and {r["lr"] for r in same} == {units[("pipeoptim", 4)]["best_lr"]}
    assert all(r["micro_batches"] == units[("sync", 4)]["horizon"] == r["curve"][-1][0] for r in same)
    text = open(md).read()
    assert text.index("## The verdict rule") < text.index("## D = 8, M = 4")
    assert "run of H:" in text and "(MEASURED)" in text and "(DERIVED)" in text and "/tmp" not in text and str(tmp_path) not in text
    assert open(png, "rb").read(4) == b"\x89PNG"
    v = json.load(open(verdicts))["verdicts"]["D=8,M=4,adamw"]
    assert set(v["rows"]) == {"PipeOptim, k=4"}
    # --from-json rebuilds the same report without training
    before = open(md).read()
    assert dp.main(["--from-json", js]) == 0 and open(md).read() == before


def test_tool_prints_every_method_at_d_and_m(capsys):
    from tools import simulate_schedule
    assert simulate_schedule.main(["--cost-model", MEASURED, "--optimizer", "muon", "--num-stages", "8",
                                   "--num-microbatches", "4", "--verdicts", ""]) == 0
    out = capsys.readouterr().out
    assert "(MEASURED)" in out
    assert any(line.startswith("interleaved ZB-H1 (v=2)") and "1.000x" in line for line in out.splitlines())
    assert any(line.startswith("ZB-V") and "0.995x" in line for line in out.splitlines())
    assert any(line.startswith("interleaved 1F1B (v=2)") and "0.736x" in line for line in out.splitlines())
    k4 = [line for line in out.splitlines() if line.startswith("PipeOptim  ") and line[27:30].strip() == "4"]
    assert len(k4) == 1 and "staleness <= 2" in k4[0]


def test_tool_bad_cost_model_is_one_line(tmp_path, capsys):
    from tools import simulate_schedule
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        simulate_schedule.main(["--cost-model", str(bad), "--num-stages", "8", "--num-microbatches", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema must be" in err
