"""tools/simulate_schedule.py --cost-model (the advisor): it prices every method it lists, PipeDream as the
asynchronous stream plus its stash, and prints a study's verdict with its horizon, seeds and speed-up range."""

import json
import os

import pytest

from megatron_po.errors import ConfigError
from megatron_po.pipeline import cost_model as cmm
from megatron_po.pipeline import sample_efficiency as se
from tools import simulate_schedule

MODEL = {"schema": "ttq-cost-model/1", "name": "t", "device": "d", "model": "m", "pipeline_stages": 4,
         "data_parallel": 1, "tokens_per_microbatch": 8, "forward_ms": 10.0,
         "ratios": {"backward": 2.0, "backward_input": 1.2, "backward_weight": 0.8,
                    "step": {"adamw": 0.7, "muon": 2.5},
                    "policy": {"pipeoptim": {"Forward": 0.1, "Step": 0.2, "stages": "stale"}}},
         "source": ["test"]}


def test_pipedream_is_the_stream_plus_its_stash():
    D, f = 8, 10.0 * 4 / 8 / 1000  # the same model over 8 stages, in seconds
    naive, _ = cmm.method_costs(MODEL, D, "muon", "async-naive")
    dream, notes = cmm.method_costs(MODEL, D, "muon", "pipedream")
    assert any("PipeDream's stash derived" in n for n in notes)
    swap, clone = 12 / 7 * 0.7 * f, 2 / 7 * 0.7 * f  # two 6-pass swaps per backward, a 2-pass clone per update
    for r in range(D - 1):  # the stages that stash
        assert dream.backward_input[r] == pytest.approx(naive.backward_input[r] + swap)
        assert dream.step[r] == pytest.approx(naive.step[r] + clone)
    assert dream.backward_input[D - 1] == naive.backward_input[D - 1] and dream.step[D - 1] == naive.step[D - 1]
    assert dream.forward == naive.forward and dream.backward_weight == naive.backward_weight
    for k in (1, 2, D):
        t_naive = cmm.async_per_microbatch(D, k, naive).seconds_per_microbatch
        t_dream = cmm.async_per_microbatch(D, k, dream).seconds_per_microbatch
        assert t_dream > t_naive
    # With nothing to copy (a free AdamW step prices the passes at 0) PipeDream is async-naive exactly.
    free = json.loads(json.dumps(MODEL))
    free["ratios"]["step"]["adamw"] = 0.0
    zero, _ = cmm.method_costs(free, D, "muon", "pipedream")
    base, _ = cmm.method_costs(free, D, "muon", "async-naive")
    assert cmm.async_per_microbatch(D, 2, zero).seconds_per_microbatch == pytest.approx(
        cmm.async_per_microbatch(D, 2, base).seconds_per_microbatch)
    # A model that measured the stash uses its own figure.
    measured = json.loads(json.dumps(MODEL))
    measured["ratios"]["policy"]["pipedream"] = {"Backward": 0.05, "stages": "stale"}
    c, notes = cmm.method_costs(measured, D, "muon", "pipedream")
    assert c.backward_input[0] == pytest.approx(naive.backward_input[0] + 0.05 * f) and not notes


def _write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def _table(tmp_path, *extra):
    """The table at D = 8, M = 4 on MODEL, without predictions (their own test below) unless `extra` asks."""
    model = _write(tmp_path, "model.json", MODEL)
    return simulate_schedule.methods_table(simulate_schedule.parse_args(
        ["--cost-model", model, "--optimizer", "muon", "--num-stages", "8", "--num-microbatches", "4",
         "--predictions", "", *extra]))


def test_advisor_prices_every_method_it_lists(tmp_path):
    out = _table(tmp_path, "--verdicts", str(tmp_path / "none_*.json"))
    assert "not priced" not in out
    rows = [line for line in out.splitlines() if line.startswith("PipeDream ")]
    assert len(rows) == 3  # k = 1, 2, M
    ms = {int(line.split()[1]): float(line.split()[3]) for line in rows}  # ms per micro-batch
    naive = {int(line.split()[1]): float(line.split()[3]) for line in out.splitlines() if line.startswith("async-naive ")}
    assert all(ms[k] > naive[k] for k in ms), (ms, naive)
    assert "study: no verdict" in out


def test_advisor_prints_the_verdict_with_horizon_seeds_and_range(tmp_path):
    """The new study's verdicts file (bench/deep_pipelines/deep_pipelines_report.py's keys): each row's seeds
    and speed-up range from row_stats, the horizon, the synchronous run's seeds, the rule and the status."""
    new = {"verdicts": {"D=8,M=4,muon": {
        "cost_model": "t", "source": "bench/results/deep_pipelines/x.md", "summary": "met by PipeOptim, k=4",
        "status": "final", "horizon_updates": 512, "horizon_microbatches": 2048, "sync_seeds": 5,
        "rule": "(a) and (b), 10th percentile",
        "rows": {"PipeOptim, k=4": "MEETS the target (5 seeds)", "async-naive, k=4": "does not meet: (b) (1 seeds)"},
        "row_stats": {"PipeOptim, k=4": {"seeds": 5, "speedup_median": 1.4123, "speedup_p10": 1.2611,
                                         "speedup_p90": 1.5502},
                      "async-naive, k=4": {"seeds": 1, "speedup_median": None, "speedup_p10": None,
                                           "speedup_p90": None}}}}}
    out = _table(tmp_path, "--verdicts", _write(tmp_path, "new_verdicts.json", new))
    row = next(line for line in out.splitlines() if line.startswith("PipeOptim ") and line.split()[1] == "4")
    assert "MEETS the target (5 seeds); speed-up median 1.412x, 10-90 % 1.261x-1.550x" in row  # rounded down
    naive = next(line for line in out.splitlines() if line.startswith("async-naive ") and line.split()[1] == "4")
    assert "does not meet: (b) (1 seeds); range not computed" in naive
    # a 10th percentile that never reaches S's loss reads "never"; one seed is "1 seed"
    new["verdicts"]["D=8,M=4,muon"]["rows"]["async-naive, k=4"] = "does not meet: (b)"
    new["verdicts"]["D=8,M=4,muon"]["row_stats"]["async-naive, k=4"] = {"seeds": 1, "speedup_median": 1.0169,
                                                                          "speedup_p10": 0.0, "speedup_p90": 1.0889}
    out = _table(tmp_path, "--verdicts", _write(tmp_path, "never_verdicts.json", new))
    naive = next(line for line in out.splitlines() if line.startswith("async-naive ") and line.split()[1] == "4")
    assert naive.endswith("does not meet: (b); 1 seed; speed-up median 1.016x, 10-90 % never-1.088x")
    study = out.splitlines()[-1]
    assert study.startswith("study (bench/results/deep_pipelines/x.md): met by PipeOptim, k=4; horizon 512 updates")
    assert "(2048 micro-batches)" in study and "5 seeds of the synchronous run" in study
    assert "rule: (a) and (b), 10th percentile" in study and "status" not in study
    # A row given as a dict, and a study still running, are printed as such.
    new["verdicts"]["D=8,M=4,muon"].update(status="in progress (3 of 12 units)", row_stats={})
    new["verdicts"]["D=8,M=4,muon"]["rows"]["PipeOptim, k=4"] = {
        "verdict": "not yet decided", "seeds": 2, "speedup_median": 1.3, "speedup_p10": 1.1, "speedup_p90": 1.5}
    out = _table(tmp_path, "--verdicts", _write(tmp_path, "new_verdicts.json", new))
    row = next(line for line in out.splitlines() if line.startswith("PipeOptim ") and line.split()[1] == "4")
    assert row.endswith("not yet decided; 2 seeds; speed-up median 1.300x, 10-90 % 1.100x-1.500x")
    assert "status: in progress (3 of 12 units)" in out.splitlines()[-1]


def test_advisor_derives_horizon_and_seeds_of_an_older_study(tmp_path, monkeypatch):
    """An older verdicts file has no horizon or seeds: they come from the study's JSON beside its report."""
    monkeypatch.setattr(simulate_schedule, "REPO", str(tmp_path))
    study = {"settings": {"steps": 256}, "units": [
        {"label": "sync, M=4", "runs": [{}, {}, {}]}, {"label": "PipeOptim, k=4", "runs": [{}, {}]}]}
    os.makedirs(tmp_path / "r")
    _write(tmp_path / "r", "old.json", study)
    old = {"verdicts": {"D=8,M=4,muon": {"cost_model": "t", "source": "r/old.md", "summary": "not met",
                                         "rows": {"PipeOptim, k=4": "does not meet: (a)"}}}}
    out = _table(tmp_path, "--verdicts", _write(tmp_path, "old_verdicts.json", old))
    row = next(line for line in out.splitlines() if line.startswith("PipeOptim ") and line.split()[1] == "4")
    assert row.endswith("does not meet: (a); 2 seeds; range not computed")
    assert out.splitlines()[-1] == ("study (r/old.md): not met; horizon 64 updates of the synchronous run "
                                    "(256 micro-batches); 3 seeds of the synchronous run")


def test_the_new_study_comes_first(tmp_path):
    first = {"verdicts": {"D=8,M=4,muon": {"cost_model": "t", "summary": "new", "rows": {}}}}
    second = {"verdicts": {"D=8,M=4,muon": {"cost_model": "t", "summary": "old", "rows": {}}}}
    out = _table(tmp_path, "--verdicts", _write(tmp_path, "a.json", first), "--verdicts", _write(tmp_path, "b.json", second))
    assert ": new;" in out.splitlines()[-1]
    assert simulate_schedule.VERDICTS[0].startswith(os.path.join("bench", "results", "deep_pipelines"))


def test_the_map_names_the_runner_up():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = simulate_schedule.throughput_map(simulate_schedule.parse_args(
        ["--cost-model", os.path.join(repo, "bench", "results", "gpu_nvidia_h200_a_cost_model.json"),
         "--optimizer", "muon", "--map", "8", "2,4"]))
    last = out.splitlines()[-1]
    assert last.startswith("where interleaved ZB-H1 (v=2) is the best (2 cells), the next synchronous schedule"), last


def test_advisor_prints_the_prediction_beside_the_bound(tmp_path, capsys):
    """Issue 50 item 3: at any (D, M) the fitted model's prediction, marked as one, with its interval, evaluated as
    the study's predictions file evaluates it; none for an optimizer it was not fitted on, none with ''."""
    path = os.path.join("bench", "results", "gpu_nvidia_h200_a_cost_model.json")
    fit = json.load(open(os.path.join(simulate_schedule.REPO, simulate_schedule.PREDICTIONS)))["fit"]
    simulate_schedule.main(["--cost-model", path, "--optimizer", "muon", "--num-stages", "16", "--num-microbatches", "4"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("PipeOptim ") and line.split()[1] == "4")
    bound = float(row.split()[4].rstrip("x"))
    p = se.predict(fit, "pipeoptim", 16, 4, 4, bound)
    assert simulate_schedule.FITTED in row and cmm.format_speedup(p["speedup"]) in row
    assert f"80 % interval {cmm.format_speedup(p['median_lo'])}" in row and p["verdict"] in row
    assert "MEETS the target" in row  # the measured verdict (issue 50's D = 16 study) beside the prediction
    simulate_schedule.main(["--cost-model", path, "--optimizer", "muon", "--num-stages", "16", "--num-microbatches", "8"])
    out = capsys.readouterr().out
    assert "study: no verdict" in out and simulate_schedule.FITTED in out  # no study here: the prediction alone
    simulate_schedule.main(["--cost-model", path, "--optimizer", "adamw", "--num-stages", "16", "--num-microbatches", "4"])
    out = capsys.readouterr().out
    assert simulate_schedule.FITTED not in out and "fitted on Muon" in out
    simulate_schedule.main(["--cost-model", path, "--optimizer", "muon", "--num-stages", "16", "--num-microbatches", "4",
                            "--predictions", ""])
    assert simulate_schedule.FITTED not in capsys.readouterr().out


# ---- long sequences (issue 49): the per-micro-batch cost at another sequence length and CP ------------------


def _shipped(name):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(repo, "bench", "results", *name.split("/"))


def test_sequence_scaling_reproduces_the_8192_token_derivation():
    """cost_model.at_sequence_length from the measured H200 model (4 x 2,048 tokens) to 1 x 8,192 gives every
    figure of issue 36's derived model (bench/time_to_quality/ttq_cost_model.py, written out on its own)."""
    measured = cmm.load_cost_model(_shipped("gpu_nvidia_h200_a_cost_model.json"))
    derived = cmm.load_cost_model(_shipped("time_to_quality/cost_model_h200_1p3b_seq8192_derived.json"))
    at = cmm.at_sequence_length(measured, 8192, 1)
    assert at["forward_ms"] == pytest.approx(derived["forward_ms"], rel=1e-6)
    assert at["p2p_ms"] == pytest.approx(derived["p2p_ms"], rel=1e-6)
    for key in ("backward", "backward_input", "backward_weight"):
        assert at["ratios"][key] == pytest.approx(derived["ratios"][key], rel=1e-5), key
    assert at["ratios"]["step"] == pytest.approx(derived["ratios"]["step"], rel=1e-5)
    assert at["ratios"]["policy"]["pipeoptim"]["Step"] == pytest.approx(
        derived["ratios"]["policy"]["pipeoptim"]["Step"], rel=1e-5)
    assert cmm.provenance(at) == "derived" and cmm.provenance(measured) == "measured"
    same = cmm.at_sequence_length(measured, 2048)  # its own shape: nothing moves
    assert same["forward_ms"] == pytest.approx(measured["forward_ms"]) and same["p2p_ms"] == measured["p2p_ms"]
    assert same["ratios"]["backward"] == pytest.approx(measured["ratios"]["backward"], rel=1e-5)


def test_context_parallelism_divides_a_ranks_work_and_messages():
    """CP = 2 prices each rank's half of the tokens and of the (load-balanced) attention: half the forward and the
    backward of the whole sequence, the same per-parameter step in ms, half the activation message's bytes."""
    measured = cmm.load_cost_model(_shipped("gpu_nvidia_h200_a_cost_model.json"))
    whole, split = cmm.at_sequence_length(measured, 16384, 1), cmm.at_sequence_length(measured, 16384, 1, 2)
    assert split["forward_ms"] == pytest.approx(whole["forward_ms"] / 2, rel=1e-5)
    assert split["ratios"]["backward"] == pytest.approx(whole["ratios"]["backward"], rel=1e-5)
    step_ms = lambda cm: cm["ratios"]["step"]["adamw"] * cm["forward_ms"]  # noqa: E731
    assert step_ms(split) == pytest.approx(step_ms(measured), rel=1e-4)
    assert split["p2p_ms"] == pytest.approx(cmm.p2p_message_ms(cmm.activation_bytes(8192, 2048)), rel=1e-5)
    assert whole["p2p_ms"] == pytest.approx(cmm.p2p_message_ms(cmm.activation_bytes(16384, 2048)), rel=1e-5)
    assert "dims" not in split  # priced per CP rank: not a stage's shape to rescale again
    with pytest.raises(ConfigError, match="states no dims"):
        cmm.at_sequence_length(MODEL, 4096)


def test_the_advisor_prices_a_long_sequence_and_says_it_is_derived():
    argv = ["--cost-model", _shipped("gpu_nvidia_h200_a_cost_model.json"), "--num-stages", "4",
            "--num-microbatches", "2"]
    plain = simulate_schedule.methods_table(simulate_schedule.parse_args(argv))
    long = simulate_schedule.methods_table(simulate_schedule.parse_args(
        argv + ["--seq-length", "16384", "--micro-batch-size", "1", "--context-parallel-size", "2"]))
    assert "(DERIVED)" in long.splitlines()[0] and "(MEASURED)" in plain.splitlines()[0]
    assert any(line.startswith("derived: At another shape") and "CP = 2" in line for line in long.splitlines())
    ms = lambda out: float(next(ln for ln in out.splitlines() if ln.startswith("1F1B ")).split()[2])  # noqa: E731
    assert ms(long) > ms(plain)  # 8,192 tokens per rank with 8,192-key attention cost more than 4 x 2,048
    with pytest.raises(ConfigError, match="apply with --seq-length"):
        simulate_schedule.methods_table(simulate_schedule.parse_args(argv + ["--context-parallel-size", "2"]))


def test_help_states_the_calibrated_interval_and_its_coverage(capsys):
    """Issue 57 item 5: --help prints the predictions' interval (t x sd in ln r) and the leave-one-depth-out
    coverage per depth, both read from the committed refit; a fit without a calibrated interval says so."""
    with pytest.raises(SystemExit):
        simulate_schedule.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    fit = json.load(open(os.path.join(simulate_schedule.REPO, simulate_schedule.PREDICTIONS)))["fit"]
    iv = fit["interval"]
    assert f"ln r +- {se.t90(iv['dof']):.3f} x {iv['sd']:.4f}" in text
    for c in fit["lodo"]["coverage"]:
        assert f"D = {c['D']} {c['calibrated']} of {c['n']}" in text and f"D = {c['D']} {c['own']} of {c['n']}" in text
    n = sum(c["n"] for c in fit["lodo"]["coverage"])
    assert f"({sum(c['calibrated'] for c in fit['lodo']['coverage'])} of {n}; nominal 80 %)" in text
    old = os.path.join("bench", "results", "deep_pipelines", "predictions.json")
    assert "(not calibrated)" in simulate_schedule.calibration_text(old)
