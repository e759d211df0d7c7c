"""bench/time_to_quality/time_to_quality.py end to end on a minuscule setting (its --quick CLI path, shrunk further to a
2-layer model on a tiny generated corpus), so the study cannot silently rot: the lr sweep, the seeds at the
best lr, the calibration, both verdict tables and the plot, and that every number in the tables comes
from the runs (recomputed here from the run results), plus --resume reusing the cache without training."""

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys

import pytest
from test_convergence_bench import write_corpus  # the same tiny generated corpus
from test_deep_pipelines import assert_same_lrs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ttq():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_common  # noqa: E402
    bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
    spec = importlib.util.spec_from_file_location("bench_time_to_quality", os.path.join(
        REPO, "bench", "time_to_quality", "time_to_quality.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fmt(x: float) -> str:
    return f"{math.floor(x * 1000) / 1000:.3f}x"


def cells(md: str, first: str) -> dict:
    """{configuration/run column: cells} of the markdown rows whose first cell is `first`."""
    out = {}
    for line in md.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(parts) > 3 and parts[0] == first:
            out.setdefault(parts[2], []).append(parts)
    return out


def test_quick_study_tables_come_from_real_runs(ttq, tmp_path):
    corpus = tmp_path / "corpus.jsonl.gz"
    write_corpus(corpus)
    # (the derived seed model: it prices PipeDream, which the measured default does not)
    s, grid = ttq.settings_from_args(["--quick", "--depths", "2", "--methods", "1f1b", "zb-h1", "pipedream",
                                      "--jobs", "1", "--out", str(tmp_path / "out"),
                                      "--cost-model", "bench/results/time_to_quality/cost_model_h200_1p3b.json"])
    assert grid["adamw"] == [1e-3, 2e-3] and s.seeds == 2 and s.optimizers == ["adamw"]
    seed_model = (s.cost_model, s.cost_model_path)  # (not fields: dataclasses.replace drops them)
    s = dataclasses.replace(s, corpus=str(corpus), num_layers=2, hidden_size=16, num_attention_heads=2,
                            seq_length=16, micro_batch=2, vocab_size=120, split="90,10,0", steps=16,
                            eval_interval=8, eval_batches=8, tail=4, warmup=2, check_updates=2)
    s.cost_model, s.cost_model_path = seed_model
    out = ttq.run(s, grid, log=lambda *_: None)
    md_path, png, js = out["paths"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(md_path).read()
    study = out["study"]
    tr = ttq.tr
    units = {(u.name, u.M): u for u in study["units"]}
    # D = 2: the equal-updates sync run (M=1), the practical ones (M = 2D = 4, 4D = 8), PipeDream
    assert set(units) == {("sync", 1), ("sync", 4), ("sync", 8), ("pipedream", 1)}
    for u in study["units"]:
        # sweep: seed 1 at every lr, each a finite final loss; best = the lowest; seeds 1..2 at the best
        assert sorted(study["sweep"][u]) == grid["adamw"]
        assert all(math.isfinite(v) for v in study["sweep"][u].values())
        assert study["best"][u] == min(study["sweep"][u], key=study["sweep"][u].get)
        runs = study["runs"][u]
        assert [r["seed"] for r in runs] == [1, 2] and {r["lr"] for r in runs} == {study["best"][u]}
        assert [p[0] for p in runs[0]["curve"]] == [8, 16]  # on the clock of micro-batches of B, whatever M
        assert runs[0]["steps_taken"][0] == s.steps // (u.M if u.name == "sync" else 1)
    # verdict 1 rows: the final loss column is the mean ± std of the runs' final validation losses
    v1 = cells(md.split("## Verdict 1")[1].split("## Verdict 2")[0], "2")
    for (name, M), u in units.items():
        finals = [r["curve"][-1][1] for r in study["runs"][u]]
        expected = f"{statistics.fmean(finals):.3f} ± {statistics.stdev(finals):.3f}"
        assert v1[u.label][0][6].startswith(expected), (u.label, v1[u.label][0])
    # verdict 2 rows (one table per clock: CPU first, then the default cost model's): 1F1B and ZB-H1 at M = 4, 8,
    # sync at equal updates and PipeDream; T1 = 1F1B M=4's mean final loss
    v2 = cells(md.split("## Verdict 2")[1].split("## The goal")[0], "2")
    eq = "sync, 1 update per micro-batch (1F1B, M=D of B/D)"
    assert set(v2) == {"1F1B, M=4", "ZB-H1, M=4", "1F1B, M=8", "ZB-H1, M=8", eq, "PipeDream, k=1"}
    assert {k: len(v) for k, v in v2.items()} == {k: 2 for k in v2}  # CPU clock and GPU cost model
    ref_runs = study["runs"][units[("sync", 4)]]
    t1 = statistics.fmean(r["curve"][-1][1] for r in ref_runs)
    assert f"({t1:.3f})" in md
    rows = {r["label"]: r for r in ttq.ttq_report.configurations(s, study, 2, "adamw")}
    ref = rows["1F1B, M=4"]
    # columns: ..., time to T1, T2, T3, speed-up vs 1F1B M=2D, vs ZB-H1 M=2D, vs sync at equal updates
    assert v2["1F1B, M=4"][0][7].startswith(f"{s.steps * ref['sec_per_mb']:.3g} ± 0")  # reaches T1 at its end
    assert v2["1F1B, M=4"][0][-3] == "1.000x" and v2["ZB-H1, M=4"][0][-2] == "1.000x" and v2[eq][0][-1] == "1.000x"
    zb = rows["ZB-H1, M=4"]
    assert v2["1F1B, M=4"][0][-2] == fmt(zb["sec_per_mb"] / ref["sec_per_mb"])  # both reach T1 at their end
    pd = rows["PipeDream, k=1"]
    times = [ttq.ttq_report.time_to(r["curve"], t1, pd["sec_per_mb"]) for r in study["runs"][units[("pipedream", 1)]]]
    if all(t is not None for t in times):
        assert v2["PipeDream, k=1"][0][-3] == fmt(s.steps * ref["sec_per_mb"] / statistics.fmean(times))
        assert v2["PipeDream, k=1"][0][-2] == fmt(s.steps * zb["sec_per_mb"] / statistics.fmean(times))
    assert ref["tps"] > 0 and pd["tps"] > 0 and rows["ZB-H1, M=4"]["tps"] >= ref["tps"] * 0.999
    assert "## The goal" in md and ("MET" in md) and "Sensitivity" in md
    saved = json.load(open(js))
    assert len(saved["units"]) == 4 and saved["grid"]["adamw"] == grid["adamw"]
    assert saved["cost_model"]["name"] == "h200_1p3b" and saved["settings"]["steps"] == s.steps

    # --resume: the same study from the cache, no training
    def no_training(*a, **k):
        raise AssertionError("--resume retrained a finished run")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(tr.cv, "train_job", no_training)
    monkey.setattr(tr.cv, "calibrate_job", no_training)
    try:
        resumed = dataclasses.replace(s, resume=True)
        resumed.cost_model, resumed.cost_model_path = seed_model
        again = ttq.run(resumed, grid, log=lambda *_: None)["study"]
    finally:
        monkey.undo()
    assert again["best"] == study["best"] and again["sweep"] == study["sweep"]
    md = open(md_path).read()  # (the --resume run's report: its header, the same tables)

    # --from-json: the same report from its JSON, no training, no cache (the runs are the JSON's)
    import shutil
    shutil.rmtree(os.path.join(s.out, ".cache", "runs"))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(tr.cv, "train_job", no_training)
    monkey.setattr(tr.cv, "calibrate_job", no_training)
    try:
        regen = ttq.regenerate(js, ["--cost-model", "bench/results/time_to_quality/cost_model_h200_1p3b.json"])
    finally:
        monkey.undo()
    md2 = open(regen["paths"][0]).read()
    assert "Regenerated without training from `time_to_quality.json`" in md2
    assert md2.split("## Settings")[1] == md.split("## Settings")[1]  # every table and line the same
    assert md2.split("\n\nRegenerated without training")[0] == md.split("\n\n## Settings")[0]  # original header kept


def test_the_default_clock_is_the_measured_h200_model(ttq):
    s, _ = ttq.settings_from_args([])
    assert s.cost_model["name"] == "gpu_nvidia_h200_full"
    assert s.cost_model_path.endswith(os.path.join("bench", "results", "gpu_nvidia_h200_a_cost_model.json"))


def test_time_to_target_interpolates_between_evaluations(ttq):
    time_to = ttq.ttq_report.time_to
    curve = [(8, 6.0), (16, 5.0), (24, 4.0)]
    assert time_to(curve, 5.5, 2.0) == pytest.approx(24.0)  # halfway between mb 8 and 16, 2 s per mb
    assert time_to(curve, 6.5, 2.0) == pytest.approx(16.0)  # already below at the first evaluation
    assert time_to(curve, 3.9, 2.0) is None


def test_bad_sizes_fail_with_one_line(ttq):
    s, grid = ttq.settings_from_args(["--quick", "--depths", "4", "--steps", "72"])
    with pytest.raises(SystemExit, match="multiples of M=8"):
        ttq.tr.validate(s, grid)


def test_quick_nmt_study_has_bleu_and_accumulates_sync_updates(ttq, tmp_path):
    """--workload nmt: the translation model through the same study (sweep, seeds, calibration, both
    verdicts, goal) from real runs, the BLEU columns coming from the runs, and the practical synchronous
    runs (M = 2D, 4D) trained as M accumulated micro-batches of B per update (`train_accumulated`)."""
    from test_convergence_bench import write_parallel_corpus
    tr = ttq.tr
    corpus = tmp_path / "pairs.jsonl"
    write_parallel_corpus(corpus, ["Genesis", "Exodus", *tr.cv.NMTWorkload.VALID_BOOKS, *tr.cv.NMTWorkload.TEST_BOOKS])
    s, grid = ttq.settings_from_args(["--workload", "nmt", "--quick", "--depths", "2", "--jobs", "1",
                                      "--out", str(tmp_path / "out")])
    assert s.workload == "nmt" and grid["adamw"] == [2e-3, 4e-3] and s.seeds == 2
    grid["adamw"] = [2e-3]  # (one lr: the sweep is the GPT test's subject; this one's is the NMT wiring)
    s = dataclasses.replace(s, corpus=str(corpus), num_layers=2, hidden_size=16, num_attention_heads=2,
                            seq_length=24, micro_batch=2, vocab_size=360, steps=16, eval_interval=8, eval_batches=2,
                            tail=4, warmup=2, check_updates=2, methods=["1f1b", "pipedream"])
    out = ttq.run(s, grid, log=lambda *_: None)
    md_path, png, js = out["paths"]
    assert os.path.basename(md_path) == "time_to_quality_nmt.md" and os.path.isfile(png)
    md, study = open(md_path).read(), out["study"]
    assert md.startswith("# Which pipeline should I use? Time to quality (NMT, D = 2)")
    units = {(u.name, u.M): u for u in study["units"]}
    assert set(units) == {("sync", 1), ("sync", 4), ("sync", 8), ("pipedream", 1)}
    for (name, M), u in units.items():
        runs = study["runs"][u]
        assert [r["seed"] for r in runs] == [1, 2]
        assert [p[0] for p in runs[0]["curve"]] == [8, 16]  # the micro-batch clock, whatever M
        # M accumulated micro-batches per synchronous update: steps / M updates, on one unpipelined stage
        assert runs[0]["steps_taken"] == ([s.steps // M] if name == "sync" else [s.steps] * 2)
        assert all(r["bleu"] is not None and 0 <= r["bleu"] <= 100 for r in runs)
    # verdict 1's BLEU column = mean ± std of the runs' BLEU
    v1 = cells(md.split("## Verdict 1")[1].split("## Verdict 2")[0], "2")
    for u in study["units"]:
        b = [r["bleu"] for r in study["runs"][u]]
        assert v1[u.label][0][-1] == f"{statistics.fmean(b):.2f} ± {statistics.stdev(b):.2f}", v1[u.label][0]
    v2 = cells(md.split("## Verdict 2")[1].split("## The goal")[0], "2")
    assert set(v2) == {"1F1B, M=4", "1F1B, M=8", "sync, 1 update per micro-batch (1F1B, M=D of B/D)", "PipeDream, k=1"}
    assert v2["1F1B, M=4"][0][-1] == v1["sync, M=4"][0][-1]  # BLEU at the end (the same runs)
    assert "copy-the-source" in md and "- **D=2, AdamW**: CPU clock: vs 1F1B M=2D **" in md
    assert all("bleu" in r for u in json.load(open(js))["units"] for r in u["runs"])


def test_accumulated_sync_run_matches_the_reference_at_m1(ttq, tmp_path):
    """train_accumulated is convergence.train_job's synchronous reference with k = M: at M = 1 the two
    give the same losses and validation curve (same data order, init, lr clock); at M = 2 it makes half
    the updates on the same micro-batches (so the first micro-batch's loss agrees, the curve does not)."""
    from test_convergence_bench import write_parallel_corpus
    tr = ttq.tr
    corpus = tmp_path / "pairs.jsonl"
    write_parallel_corpus(corpus, ["Genesis", "Exodus", *tr.cv.NMTWorkload.VALID_BOOKS, *tr.cv.NMTWorkload.TEST_BOOKS])
    s = tr.nmt_study_settings(True, corpus=str(corpus), num_layers=2, hidden_size=16, num_attention_heads=2,
                              seq_length=24, micro_batch=2, vocab_size=360, steps=8, eval_interval=4, eval_batches=2,
                              warmup=2, lr={"adamw": 2e-3}, out=str(tmp_path / "out"))
    tr.cv.build_workload(s).prepare()
    ref = tr.cv.train_job(s, 2, "adamw", "sync", 1)
    one = tr.train_accumulated(s, 1, "adamw", 1)
    assert one["losses"] == ref["losses"] and one["val"] == ref["val"]  # exact: the same computation
    two = tr.train_accumulated(s, 2, "adamw", 1)
    assert two["steps_taken"] == [4] and two["losses"][0] == ref["losses"][0]
    assert two["val"][-1][1] != ref["val"][-1][1]


def test_sync_m_selects_units_and_needs_2d(ttq):
    tr = ttq.tr
    s, grid = ttq.settings_from_args(["--workload", "nmt", "--sync-m", "8"])
    assert [(u.name, u.M) for u in tr.plan_units(s)] == [("sync", 8), ("async-naive", 1), ("pipedream", 1),
                                                         ("pipeoptim", 1)]
    s, grid = ttq.settings_from_args(["--depths", "4", "--sync-m", "1", "16"])
    with pytest.raises(SystemExit, match="must include M = 2D = 8"):
        tr.validate(s, grid)


def test_calibration_of_fewer_methods_is_another_cache_entry(ttq):
    """A calibration times only the selected methods, so a study of more methods must not reuse it."""
    tr = ttq.tr
    s, _ = ttq.settings_from_args([])
    full = tr.job_path(s, ("calibrate", 4, "muon"))
    fewer = tr.job_path(dataclasses.replace(s, methods=["1f1b", "pipeoptim"]), ("calibrate", 4, "muon"))
    more = tr.job_path(dataclasses.replace(s, methods=["1f1b", "pipedream", "pipeoptim"]), ("calibrate", 4, "muon"))
    assert len({full, fewer, more}) == 3
    assert tr.job_path(s, ("train", tr.Unit("muon", "sync", 0, 8), 2e-3, 1)) == \
        tr.job_path(dataclasses.replace(s, methods=["1f1b"]), ("train", tr.Unit("muon", "sync", 0, 8), 2e-3, 1))


def test_committed_studies_keep_their_lrs(ttq):
    """Every unit at every lr of the committed studies' sweeps (AdamW, Muon, NAG, the NMT study's accumulated
    synchronous runs): the lr rule of optim/sample_schedule.py gives the lrs they ran at, bit for bit."""
    import glob
    tr, checked = ttq.tr, 0
    for path in sorted(glob.glob(os.path.join(REPO, "bench", "results", "time_to_quality", "time_to_quality*.json"))):
        data = json.load(open(path))
        s = tr.settings_from_record(data["settings"])
        for e in data["units"]:
            u = tr.Unit(e["opt"], e["name"], e["D"], e["M"])
            for lr in e["sweep"]:
                us = tr._unit_settings(s, u, float(lr))
                k = u.M if tr.accumulates(s, u) else 1 if u.name == "sync" else ttq.ttq_report.update_interval(u.name, u.D)
                checked += assert_same_lrs(tr.cv, us, u.opt, k)
    assert checked > 100_000
