"""bench/deep_pipelines/deep_pipelines.py (issues 36, 41): the equal wall-clock budget from the op-list clock (p2p
priced), the study's plan fixed before its runs, the common lr grid that grows for every unit, the verdict rule
(a) and (b) on curves with known answers, the committed run cache that --resume reuses, a real quick study end to
end with its interim (in-progress) report; and tools/simulate_schedule.py --cost-model, the user-facing table."""

import dataclasses
import glob
import json
import math
import os
import shutil
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
    return types.SimpleNamespace(**{**vars(deep_pipelines_runs), **vars(deep_pipelines)})


def test_units_and_budget(dp):
    from megatron_po.pipeline import cost_model as cmm
    units = dp.plan_units(["muon"], [4, 8], ["sync", *dp.ASYNC], ["1", "2", "M"])
    names = {(u.name, u.M, u.k) for u in units}
    assert ("pipedream-2bw", 8, 8) in names and not any(n == "pipedream-2bw" and M == 4 for n, M, _ in names)
    assert ("pipeoptim", 4, 4) in names and ("po-ef", 8, 2) in names
    only = dp.plan_units(["adamw"], [4], ["sync", "pipeoptim"], ["M"])
    assert [(u.name, u.k) for u in only] == [("sync", 4), ("pipeoptim", 4)]
    cm = cmm.load_cost_model(MEASURED)
    s = dataclasses.replace(dp.study_settings(), steps=2048)
    name, t_sync = dp.best_sync(cm, "muon", 4)
    assert name == "interleaved-zb-h1"  # interleaving admits M = 4 < D: 0.06 % ahead of ZB-V on this clock
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
    assert rep.first_reach(curve, 3.0) is None and rep.first_reach(curve, 4.75) == pytest.approx(48.0)
    assert rep.fmt_x(1.2499) == "1.249x"


def test_quick_study_end_to_end(dp, tmp_path):
    corpus = tmp_path / "corpus.jsonl.gz"
    write_corpus(corpus)
    out = tmp_path / "out"
    args = ["--quick", "--out", str(out), "--lr-grid", "adamw=2e-3,4e-3"]

    def plan_of(extra=()):
        plan = dp.plan_from_args(args + list(extra))
        plan.blocks = [dataclasses.replace(b, s=dataclasses.replace(
            b.s, corpus=str(corpus), hidden_size=16, num_attention_heads=2, seq_length=16, micro_batch=2,
            vocab_size=120, split="90,10,0", out=str(out))) for b in plan.blocks]
        plan.max_growth = 1
        return plan
    logs = []
    js, md, png, verdicts = dp.run(plan_of(), log=logs.append)
    assert os.path.basename(js) == "deep_pipelines_d8_m4_adamw_h32.json"
    assert any("study: " in line and "ETA" in line for line in logs)  # progress: runs done / planned, ETA
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
    # settings as they ran: the unit's own lr schedule, never the base settings' lr / warm-up
    assert "lr" not in data["settings"] and "warmup" not in data["settings"]
    assert units[("sync", 4)]["ran"]["updates"] == 8 and data["definition"]["adamw,M=4"]["H"] == 32
    assert data["planned_runs"] == data["done_runs"] == len(grid) * 2 + 2
    text = open(md).read()
    assert text.index("## The study (fixed before any run)") < text.index("## The verdict rule") < \
        text.index("## Result: D = 8, M = 4")
    assert "(MEASURED)" in text and "(DERIVED)" in text and "/tmp" not in text and str(tmp_path) not in text
    assert "p2p 0.10587 ms" in text and "IN PROGRESS" not in text and "5-27" not in text
    # the load the runs met: each run's own record (not the command's, which trains nothing with --report-only)
    lo, hi, n, total = data["run_loads"]
    assert n == total == data["done_runs"] and 0 <= lo <= hi
    assert f"the runs: 1-minute load at the end of each, {lo:.1f}-{hi:.1f} ({n} of the {n} runs record it)" in text
    assert open(png, "rb").read(4) == b"\x89PNG"
    v = json.load(open(verdicts))["verdicts"]["D=8,M=4,adamw"]
    assert set(v["rows"]) == {"PipeOptim, k=4"} and v["status"] == "final"
    assert v["horizon_microbatches"] == 32 and v["horizon_updates"] == 8 and v["seeds"] == 2 == v["sync_seeds"]
    assert v["speedup_p10"] <= v["speedup_median"] <= v["speedup_p90"] and v["rule"].startswith("(a)")
    # --from-json rebuilds the same report without training
    before = open(md).read()
    assert dp.main(["--from-json", js]) == 0 and open(md).read() == before
    # a --hidden run (its files named _hidden<N>) keys its verdicts apart: the advisor keeps the study's
    wide = js[:-len(".json")] + f"_hidden{data['settings']['hidden_size']}.json"
    shutil.copy(js, wide)
    assert dp.main(["--from-json", wide]) == 0
    wide_v = json.load(open(wide[:-len(".json")] + "_verdicts.json"))["verdicts"]
    assert list(wide_v) == [f"D=8,M=4,adamw,hidden={data['settings']['hidden_size']}"]
    for p in (out.glob("*_hidden*")):
        p.unlink()
    # the run cache is <out>/runs (committed for the real study); --report-only trains nothing and says what is
    # missing: one run taken away leaves an interim report, labelled as one
    runs = sorted((out / "runs").glob("dp-*.json"))
    assert len(runs) == data["planned_runs"]
    sync_seed2 = next(p for p in runs if json.load(open(p))["unit"]["name"] == "sync" and json.load(open(p))["seed"] == 2)
    sync_seed2.unlink()
    logs = []
    js2, md2, _, verdicts2 = dp.run(plan_of(["--report-only"]), log=logs.append)
    assert not any(line.startswith("[") for line in logs)  # no run trained
    partial = json.load(open(js2))
    assert partial["done_runs"] == partial["planned_runs"] - 1
    assert f"IN PROGRESS: {partial['done_runs']} OF {partial['planned_runs']} RUNS, VERDICT NOT YET DECIDED" in open(md2).read()
    assert "--report-only` (no training: the report from the committed runs)" in open(md2).read()
    assert partial["run_loads"][2] == partial["done_runs"] and "wall_minutes" in partial["provenance"]
    assert json.load(open(verdicts2))["verdicts"]["D=8,M=4,adamw"]["status"].startswith("in progress")


def test_resume_reuses_committed_runs(dp, tmp_path, monkeypatch):
    plan = dp.plan_from_args(["--study"])
    assert os.path.dirname(os.path.dirname(dp.job_path(plan.blocks[0].s, plan.blocks[0].units[0], 8e-3, 1, 1024))) \
        == os.path.join(REPO, "bench", "results", "deep_pipelines")
    import subprocess
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench/results/deep_pipelines/runs/dp-x.json"], cwd=REPO)
    assert ignored.returncode == 1  # not git-ignored: the cache is committed
    # a run file present at its key is read, not trained
    s = dataclasses.replace(plan.blocks[0].s, out=str(tmp_path), resume=True, jobs=1)
    u = plan.blocks[0].units[1]
    fake = {"unit": dataclasses.asdict(u), "lr": 8e-3, "seed": 1, "micro_batches": 64, "seconds": 1.0,
            "curve": [[32, 5.0], [64, 4.0]]}
    path = dp.job_path(s, u, 8e-3, 1, 64)
    os.makedirs(os.path.dirname(path))
    json.dump(fake, open(path, "w"))
    monkeypatch.setattr(sys.modules["deep_pipelines_runs"], "run_job", lambda *a: pytest.fail("trained a cached run"))
    progress = dp.Progress(2, 128)
    assert dp.run_jobs(s, [(u, 8e-3, 1, 64)], print, progress=progress) == {(u, 8e-3, 1): fake}
    assert (progress.done_runs, progress.done_mb, progress.trained_mb) == (1, 64, 0)


def test_study_plan_is_fixed(dp):
    plan = dp.plan_from_args(["--study"])
    assert [(b.units[0].opt, b.units[0].M, b.s.steps) for b in plan.blocks] == \
        [("muon", 2, 1024), ("muon", 4, 2048), ("adamw", 4, 2048)]  # M = 2 Muon first; 512 updates of S each
    m2 = plan.blocks[0]
    assert [(u.name, u.k) for u in m2.units] == [("sync", 2), ("async-naive", 2), ("pipeoptim", 2), ("po-ef", 2),
                                                  ("pipeoptim", 1)]
    assert [(u.name, u.k) for u in m2.conditional] == [("async-naive", 1), ("po-ef", 1)]
    assert [(u.name, u.k) for u in plan.blocks[2].units] == [("sync", 4), ("pipeoptim", 4), ("po-ef", 4)]
    assert plan.blocks[2].conditional == [] and m2.s.seeds == 5 and plan.far_seeds == 1
    assert dp.OPTIMIZERS["muon"][1] == {"muon_fp32_matmul_prec": "medium", "muon_split_qkv": True}
    assert plan.cm["p2p_ms"] > 0  # the clock that sets every budget prices the messages
    # the k = M/2 rule and the seeds rule, on made-up seed-1 results
    sync, po1, naive2 = m2.units[0], m2.units[4], m2.units[1]
    best = {u: 8e-3 for u in m2.units}
    res = lambda u, v: {(u, 8e-3, 1): {"curve": [(16, v)], "micro_batches": 16}}  # noqa: E731
    both = {**res(sync, 4.0), **res(po1, 4.09), **res(naive2, 4.2)}
    assert dp.conditional_units(both, best, m2.units, m2.conditional, 0.1) is True
    assert dp.conditional_units({**both, **res(po1, 4.11)}, best, m2.units, m2.conditional, 0.1) is False
    assert dp.conditional_units(res(sync, 4.0), best, m2.units, m2.conditional, 0.1) is None
    assert dp.seeds_of(po1, both, best, sync, 5, 1, 0.1) == 5 and dp.seeds_of(naive2, both, best, sync, 5, 1, 0.1) == 1
    assert dp.seeds_of(sync, both, best, sync, 5, 1, 0.1) == 5
    # --hidden: a wider model, another cache key
    wide = dp.plan_from_args(["--study", "--hidden", "128"])
    assert wide.blocks[0].s.hidden_size == 128 and wide.blocks[0].name.endswith("_hidden128")
    assert dp.job_path(wide.blocks[0].s, sync, 8e-3, 1, 1024) != dp.job_path(m2.s, sync, 8e-3, 1, 1024)
    with pytest.raises(SystemExit, match="--hidden 66"):
        dp.plan_from_args(["--study", "--hidden", "66"])


def lr_before_issue_50(iteration: int, t) -> float:
    """What the studies' runs were made with (the removed megatron_po/optim/lr_scheduler.lr_at, its cosine and
    linear branches as they were): micro-batch `iteration`'s lr."""
    if t.lr_warmup_iters > 0 and iteration < t.lr_warmup_iters:
        return t.lr * (iteration + 1) / t.lr_warmup_iters
    if t.lr_decay_style == "constant":
        return t.lr
    if iteration >= t.train_iters:
        return t.min_lr
    frac = (iteration - t.lr_warmup_iters) / max(1, t.train_iters - t.lr_warmup_iters)
    coeff = 1.0 - frac if t.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
    return t.min_lr + coeff * (t.lr - t.min_lr)


def assert_same_lrs(cv, us, optimizer: str, k: int) -> int:
    """Every step of a run of settings `us` stepping every k micro-batches: the lr train_job hands the emulator
    (sample_schedule.microbatch_lr) is, to the bit, the one the run was made with. Returns the steps checked."""
    from megatron_po.optim.sample_schedule import microbatch_lr
    t = cv._training_config(us, optimizer)
    steps = us.steps // k + 1
    assert [microbatch_lr(i, k, t) for i in range(steps)] == [lr_before_issue_50(i * k, t) for i in range(steps)]
    return steps


def test_committed_runs_keep_their_lrs(dp):
    """The lr rule moved to optim/sample_schedule.py (one rule for training and the studies): every committed run
    of the cache (--resume reads them by their key, which holds the settings, not the lrs) would be trained again
    at the same lrs, bit for bit."""
    paths = sorted(glob.glob(os.path.join(dp.OUT, "runs", "dp-*.json")))
    assert len(paths) >= 156
    s, checked = dp.study_settings(), 0
    for path in paths:
        r = json.load(open(path))
        u = dp.Unit(**r["unit"])
        us = dp.unit_settings(s, u, r["lr"], r["micro_batches"])
        checked += assert_same_lrs(dp.cv, us, dp.OPTIMIZERS[u.opt][0], 1 if u.name == "sync" else u.k)
    assert checked > 100_000


@pytest.mark.parametrize("bad", ["25:00", "abc", "9:5", "12:60"])
def test_bad_deadline_is_one_line(dp, bad, capsys):
    with pytest.raises(SystemExit) as e:
        dp.plan_from_args(["--study", "--deadline", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"argument --deadline: expected a UTC time HH:MM, got {bad!r}") and "Traceback" not in err
    assert dp.plan_from_args(["--study", "--deadline", "09:05"]).deadline is not None


def test_rule_a_and_b_on_known_curves(dp):
    import deep_pipelines_report as rep
    # (a): diff against one standard error of the difference of the means
    a = rep.rule_a([4.02, 4.04], [4.00, 4.02])  # diff 0.02, se = sqrt(2 * 0.01414^2 / 2) = 0.01414
    assert a["diff"] == pytest.approx(0.02) and a["se"] == pytest.approx(math.sqrt(0.0002 / 2 + 0.0002 / 2))
    assert not a["pass"] and rep.rule_a([4.01, 4.03], [4.00, 4.02])["pass"]  # diff 0.01 < se
    one = rep.rule_a([4.05], [4.0, 4.1])  # one seed: S's sd taken for it
    assert one["se"] == pytest.approx(math.sqrt(0.005 / 1 + 0.005 / 2))  # S's variance 0.005, n = 1 and 2
    # (b): S's budget H x t_S = 100 x 1.0 s; a unit at t_u = 0.5 s whose curve falls linearly 5 -> 3 over
    # 200 micro-batches reaches S's final loss 4.0 at 100 micro-batches (2.0x) and 3.5 at 150 (1.333x)
    unit = [{"curve": [(0, 5.0), (200, 3.0)]}]
    sync = [{"curve": [(100, 4.0)], "micro_batches": 100}, {"curve": [(100, 3.5)], "micro_batches": 100},
            {"curve": [(100, 2.0)], "micro_batches": 100}]
    speeds = rep.pair_speedups(unit, sync, 100.0, 0.5)
    assert speeds == pytest.approx([2.0, 100 / 75, 0.0])  # never reaching 2.0 counts as 0
    assert rep.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 10) == pytest.approx(2.0)
    assert rep.percentile([0.0, 4 / 3, 2.0], 50) == pytest.approx(4 / 3)
    st = rep.speed_stats(speeds)
    assert st["p10"] == pytest.approx(0.2 * 4 / 3) and not st["b"]
    assert rep.speed_stats([1.3] * 24 + [1.0])["b"]  # 10th percentile of 25 pairings: one low pairing passes
    assert not rep.speed_stats([1.3] * 22 + [1.0] * 3)["b"]


def test_tool_prints_every_method_at_d_and_m(capsys):
    from tools import simulate_schedule
    assert simulate_schedule.main(["--cost-model", MEASURED, "--optimizer", "muon", "--num-stages", "8",
                                   "--num-microbatches", "4", "--verdicts", ""]) == 0
    out = capsys.readouterr().out
    assert "(MEASURED)" in out
    assert any(line.startswith("interleaved ZB-H1 (v=2)") and "1.000x" in line for line in out.splitlines())
    # ZB-V's turn within one rank pays no transfer (issue 57; it printed 0.995x when it paid one)
    assert any(line.startswith("ZB-V") and "0.999x" in line for line in out.splitlines())
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


# --------------------------------------------------------------------------------------------------
# Issue 50: the prediction made before the runs (deep_pipelines_predict.py, pipeline/sample_efficiency.py)
# --------------------------------------------------------------------------------------------------


def test_mean_staleness_is_read_off_the_op_lists():
    from megatron_po.pipeline.sample_efficiency import mean_staleness
    for D in (2, 4, 8, 16):
        for k in (1, 2, 4):
            # the straight stream: stage r's micro-batches see (D - r - 1) / k updates on average
            assert mean_staleness(D, k) == pytest.approx((D - 1) / (2 * k))


def test_predict_closed_form_and_never():
    from megatron_po.pipeline import sample_efficiency as se
    fit = {"methods": ["pipeoptim", "async-naive"], "coefficients": [0.2, 0.3, -0.1], "sigma": 0.0,
           "covariance": [[0.0] * 3 for _ in range(3)], "dof": 3, "seed_offsets": [-0.05, 0.05]}
    p = se.predict(fit, "pipeoptim", 8, 4, 2, bound=2.0)
    ln_r = 0.2 * 1.75 - 0.1 * 1.0  # tau(8, 2) = 1.75, log2(4 / 2) = 1
    assert p["r"] == pytest.approx(math.exp(ln_r)) and p["speedup"] == pytest.approx(2.0 / math.exp(ln_r))
    assert p["speedup_p10"] == pytest.approx(2.0 / math.exp(ln_r + 0.05))
    assert p["median_lo"] == pytest.approx(p["speedup"]) and p["firm"]  # no model error: a point interval
    assert p["verdict"] == ("met" if p["speedup_p10"] >= 1.25 else "not met")
    assert se.predict(fit, "async-naive", 16, 1, 1, bound=3.0)["speedup"] == 0.0  # r = e^2.25 > bound: never
    assert se.predict(fit, "pipedream", 8, 4, 4, bound=2.0) is None  # no coefficient: no prediction


def test_committed_predictions_refit_from_the_committed_runs(dp):
    """predictions.json holds what the fit of the committed D = 8 runs gives (nothing typed in by hand), and it
    predicts every unit of issue 50's study."""
    import deep_pipelines_predict as pr
    with open(pr.PREDICTIONS) as f:
        committed = json.load(f)
    obs = [o for name in pr.FIT_FILES for o in pr.observations(os.path.join(dp.OUT, name))]
    model = pr.fit(obs)
    assert model["coefficients"] == pytest.approx(committed["fit"]["coefficients"], rel=1e-9)
    assert model["sigma"] == pytest.approx(committed["fit"]["sigma"], rel=1e-9)
    assert {(p["D"], p["M"], p["method"], p["k"]) for p in committed["predictions"]} == set(pr.new_settings())
    assert all(o["D"] == 8 for o in obs)  # fitted on D = 8 alone


# --------------------------------------------------------------------------------------------------
# Issue 57: the refit on every depth, its interval calibrated by leaving each depth out
# --------------------------------------------------------------------------------------------------


def _point(D, M, k, ln_r, method="pipeoptim"):
    return {"file": "x.json", "method": method, "D": D, "M": M, "k": k, "seeds": 5, "median": math.exp(ln_r),
            "p10": math.exp(ln_r - 0.05), "p90": math.exp(ln_r + 0.05), "own_ratio": 3.0, "r": []}


def test_leave_one_depth_out_on_known_points(dp):
    """Exact model points at D = 4 and 8 and a depth effect of +0.3 in ln r at D = 16: the fit to D = 4 and 8
    predicts D = 16 with an error of exactly +0.3; each calibrated interval is t at n x the RMS error of the
    OTHER depths' predictions; the coverage counts what lies inside; a method one depth alone ran is not
    predicted; and a prediction of the calibrated fit is ln r +- t at its dof x its sd."""
    import deep_pipelines_predict as pr
    from megatron_po.pipeline import sample_efficiency as se
    beta, gamma = 0.2, -0.1
    exact = lambda D, M, k: beta * (D - 1) / (2 * k) + gamma * math.log2(M / k)  # noqa: E731
    obs = [_point(D, M, k, exact(D, M, k) + (0.3 if D == 16 else 0.0))
           for D in (4, 8, 16) for M, k in ((2, 2), (2, 1), (4, 2))]
    obs.append(_point(8, 2, 2, 0.5, method="po-ef"))  # error feedback at D = 8 only
    lo = pr.lodo(obs)
    assert lo["not_predicted"] == [{"method": "po-ef", "D": 8, "M": 2, "k": 2}]
    rows = {(r["D"], r["M"], r["k"]): r for r in lo["rows"]}
    assert len(rows) == 9
    for M, k in ((2, 2), (2, 1), (4, 2)):
        assert rows[(16, M, k)]["error"] == pytest.approx(0.3, abs=1e-9)
        assert rows[(16, M, k)]["predicted"] == pytest.approx(math.exp(exact(16, M, k)), rel=1e-9)
    for d in (4, 8, 16):
        others = [r["error"] for r in lo["rows"] if r["D"] != d]
        want = se.t90(len(others)) * math.sqrt(sum(e * e for e in others) / len(others))
        assert all(r["calibrated_half"] == pytest.approx(want) for r in lo["rows"] if r["D"] == d)
    for c in lo["coverage"]:
        mine = [r for r in lo["rows"] if r["D"] == c["D"]]
        assert c["n"] == len(mine) == 3
        assert c["calibrated"] == sum(abs(r["error"]) <= r["calibrated_half"] for r in mine)
        assert c["own"] == sum(abs(r["error"]) <= r["own_half"] for r in mine)
    assert next(c for c in lo["coverage"] if c["D"] == 16)["own"] == 0  # an exact fold fit: a point interval
    errors = [r["error"] for r in lo["rows"]]
    assert lo["interval"]["dof"] == 9
    assert lo["interval"]["sd"] == pytest.approx(math.sqrt(sum(e * e for e in errors) / 9))
    model = pr.fit(obs) | {"interval": lo["interval"]}
    p = se.predict(model, "pipeoptim", 4, 2, 2, bound=2.0)
    h = se.t90(9) * lo["interval"]["sd"]
    assert p["median_lo"] == pytest.approx(2.0 / math.exp(math.log(p["r"]) + h))
    assert p["median_hi"] == pytest.approx(2.0 / math.exp(math.log(p["r"]) - h))


def test_committed_refit_is_the_refit_of_the_committed_runs(dp):
    """predictions_refit.json holds what the refit of every committed Muon study at hidden 64 gives (nothing typed
    in by hand): D = 4, 8 and 16, its calibrated interval and leave-one-depth-out coverage, and a prediction of
    every unit of issue 57's study; it is not rewritten once that study's runs have begun, nor is issue 50's."""
    import deep_pipelines_predict as pr
    with open(pr.REFIT) as f:
        committed = json.load(f)
    fresh = pr.predictions(57)
    assert {p["D"] for p in fresh["fit"]["points"]} == {4, 8, 16}
    assert fresh["fit"]["coefficients"] == pytest.approx(committed["fit"]["coefficients"], rel=1e-9)
    assert fresh["fit"]["interval"]["sd"] == pytest.approx(committed["fit"]["interval"]["sd"], rel=1e-9)
    assert fresh["fit"]["lodo"]["coverage"] == committed["fit"]["lodo"]["coverage"]
    assert {(p["D"], p["M"], p["method"], p["k"]) for p in committed["predictions"]} == set(pr.new_settings(57))
    for p in committed["predictions"]:  # the report and the advisor evaluate the committed fit the same way
        m = p["measured"]
        again = pr.se.predict(committed["fit"], p["method"], p["D"], p["M"], p["k"], m["bound"])
        assert again["median_lo"] == pytest.approx(m["median_lo"]) and again["verdict"] == m["verdict"]
    with pytest.raises(SystemExit, match="--map-study 50: its runs have begun"):
        pr.main(["--map-study", "50"])
