"""megatron_po/pipeline/cost_model.py: the op-list clock against closed forms, the per-stage step of the
simulator, and the cost-model file's one-line errors."""

import json
import math

import pytest

from megatron_po.errors import ConfigError
from megatron_po.pipeline import cost_model as cmm
from megatron_po.pipeline.schedules import build_schedule
from megatron_po.pipeline.simulator import simulate


def uniform(D, f=1.0, b=1.0, w=1.0, step=0.36, p2p=0.0):
    return cmm.StageCosts((f,) * D, (b,) * D, (w,) * D, (step,) * D, p2p)


@pytest.mark.parametrize("D,M", [(4, 4), (4, 8), (8, 4), (8, 2)])
def test_1f1b_flush_is_closed_form(D, M):
    c = uniform(D)
    t = cmm.sync_iteration("1f1b", D, M, c)
    assert t.makespan == pytest.approx((M + D - 1) * (1 + 2) + 0.36)


@pytest.mark.parametrize("D,M", [(4, 8), (8, 8), (4, 12)])
def test_zb_h1_flush_is_closed_form(D, M):
    # Qi et al.: ZB-H1's bubble is (D-1)(F + B - W) for M >= D (input backward B, weight backward W).
    f, b, w = 1.0, 1.2, 0.8
    t = cmm.sync_iteration("zb-h1", D, M, uniform(D, f, b, w, step=0.5))
    assert t.makespan == pytest.approx(M * (f + b + w) + (D - 1) * (f + b - w) + 0.5)


def test_async_steady_state_pays_the_step_once_per_k():
    for k in (1, 2, 4, 8):
        s = cmm.async_per_microbatch(8, k, uniform(8, step=0.9))
        assert s.seconds_per_microbatch == pytest.approx(3 + 0.9 / k)
        assert abs(s.bubble_fraction) < 1e-9
    # The stream runs at its slowest stage's pace (steady state of the op list, not a mean).
    c = cmm.StageCosts((1.0, 1.0, 1.5, 1.0), (2.0,) * 4, (0.0,) * 4, (0.4, 0.4, 0.4, 2.0))
    s = cmm.async_per_microbatch(4, 2, c)
    assert s.seconds_per_microbatch == pytest.approx(max(1.5 + 2 + 0.2, 1 + 2 + 1.0))


def test_async_staleness_and_in_flight_come_from_the_op_list():
    s1, s4 = cmm.async_per_microbatch(8, 1, uniform(8)), cmm.async_per_microbatch(8, 4, uniform(8))
    assert (s1.max_staleness, s4.max_staleness) == (7, 2)  # ceil((D - 1) / k)
    assert s1.peak_activations == 8


def test_simulator_prices_steps_per_virtual_stage():
    sched = build_schedule("interleaved-1f1b", 2, 2, 2)
    steps = [0.1, 0.2, 0.3, 0.4]  # virtual stage c*D + r
    t = simulate(sched, 1.0, 2.0, t_step=steps)
    t0 = simulate(sched, 1.0, 2.0)
    ends = {r: max(e.end for e in t0.events if e.rank == r) for r in range(2)}
    # Step(None) on rank r costs the sum of its chunks' steps, after its last op.
    assert t.makespan == pytest.approx(max(ends[0] + 0.1 + 0.3, ends[1] + 0.2 + 0.4))
    with pytest.raises(ConfigError, match="t_step needs one value per virtual stage"):
        simulate(sched, 1.0, 2.0, t_step=[0.1, 0.2])


MODEL = {"schema": "ttq-cost-model/1", "name": "t", "device": "d", "model": "m", "pipeline_stages": 4,
         "data_parallel": 1, "tokens_per_microbatch": 8, "forward_ms": 10.0,
         "ratios": {"backward": 2.0, "backward_input": 1.2, "backward_weight": 0.8, "step": {"adamw": 0.5},
                    "policy": {"pipeoptim": {"Forward": 0.1, "Step": 0.2, "stages": "stale"}}},
         "source": ["test"]}


def test_stage_costs_scale_to_d_and_put_the_policy_on_stale_stages():
    c = cmm.stage_costs(MODEL, 8, "adamw", "pipeoptim")
    f = 10.0 * 4 / 8 / 1000  # the same model over 8 stages, in seconds
    assert c.forward[:7] == pytest.approx([f * 1.1] * 7) and c.forward[7] == pytest.approx(f)
    assert c.backward_input[0] == pytest.approx(1.2 * f) and c.backward_weight[0] == pytest.approx(0.8 * f)
    assert c.step[0] == pytest.approx(0.7 * f) and c.step[7] == pytest.approx(0.5 * f)
    with pytest.raises(ConfigError, match="prices no 'muon' step"):
        cmm.stage_costs(MODEL, 8, "muon")
    with pytest.raises(ConfigError, match="prices no weight policy for 'pipedream'"):
        cmm.stage_costs(MODEL, 8, "adamw", "pipedream")


def test_fsdp_prices_the_gathers_and_shards_the_step():
    """4 stages of 1.4e9 / 4 = 350 M weights at 350 GB/s over DP 2: a bf16 gather receives half of 700 MB (1 ms),
    an fp32 reduce-scatter sends half of 1.4 GB (2 ms); a forward of 10 ms hides them, one of 0.5 ms does not."""
    fsdp = cmm.with_fsdp(MODEL, 2, 1.4e9)
    assert fsdp["forward_ms"] == 10.0 and fsdp["ratios"]["backward_input"] == 1.2
    assert fsdp["ratios"]["step"]["adamw"] == 0.25 and fsdp["ratios"]["policy"]["pipeoptim"]["Step"] == 0.1
    assert cmm.provenance(fsdp) == "derived" and "FSDP2 over DP = 2" in fsdp["derivation"][-1]
    fast = dict(MODEL, forward_ms=0.5)  # comm-bound: each op takes its transfers' time
    c = cmm.with_fsdp(fast, 2, 1.4e9)
    assert c["forward_ms"] == pytest.approx(1.0)  # the gather
    assert c["ratios"]["backward_input"] == pytest.approx(1.0) and c["ratios"]["backward_weight"] == pytest.approx(2.0)
    kept = cmm.with_fsdp(fast, 2, 1.4e9, reshard_after_forward=False)  # no second gather: B its compute alone
    assert kept["ratios"]["backward_input"] == pytest.approx(1.2 * 0.5 / 1.0)
    assert cmm.with_fsdp(MODEL, 1, 1.4e9)["ratios"]["backward_weight"] == 0.8  # DP 1: nothing moves
    with pytest.raises(ConfigError, match="FSDP over 0 ranks"):
        cmm.with_fsdp(MODEL, 0, 1.4e9)


def test_load_errors_are_one_line(tmp_path):
    bad = dict(MODEL, ratios=dict(MODEL["ratios"], backward_input=1.5))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"backward_input \+ backward_weight must equal ratios.backward") as e:
        cmm.load_cost_model(str(path))
    assert "\n" not in str(e.value)
    path.write_text(json.dumps(dict(MODEL, provenance="guessed")))
    with pytest.raises(ConfigError, match="provenance must be one of measured, derived"):
        cmm.load_cost_model(str(path))
    with pytest.raises(ConfigError, match="file not found"):
        cmm.load_cost_model(str(tmp_path / "none.json"))


def test_weight_copies():
    assert cmm.weight_copies("zb-v", 8) == 1 and cmm.weight_copies("async-naive", 8) == 1
    assert cmm.weight_copies("pipedream", 8, 1) == 8  # s_max + 1 = D - r on rank 0
    assert cmm.weight_copies("pipedream", 8, 4) == 3
    assert cmm.weight_copies("pipeoptim", 8, 4, error_feedback=True) == 3


@pytest.mark.parametrize("path", ["bench/results/gpu_nvidia_h200_a_cost_model.json",
                                  "bench/results/time_to_quality/cost_model_h200_1p3b_seq8192_derived.json"])
def test_shipped_cost_models_load(path):
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cm = cmm.load_cost_model(os.path.join(repo, path))
    c = cmm.stage_costs(cm, 8, "muon", "pipeoptim")
    assert all(math.isfinite(x) and x > 0 for x in c.forward + c.step)
    assert cmm.provenance(cm) == ("derived" if "derived" in path else "measured")


def test_p2p_message_is_priced_from_its_size():
    # 33.6 MB (8192 tokens x hidden 2048 x bf16) at 350 GB/s one way + 10 us = 0.10587 ms
    assert cmm.activation_bytes(8192, 2048) == 8192 * 2048 * 2
    assert cmm.p2p_message_ms(8192 * 2048 * 2) == pytest.approx(0.01 + 33554432 / 350e9 * 1e3)
    assert cmm.p2p_message_ms(0, latency_us=0) == 0.0
    with pytest.raises(ConfigError, match="p2p message"):
        cmm.p2p_message_ms(1.0, bandwidth_gb_s=0)


@pytest.mark.parametrize("path", ["bench/results/gpu_nvidia_h200_a_cost_model.json",
                                  "bench/results/time_to_quality/cost_model_h200_1p3b_seq8192_derived.json"])
def test_both_h200_clocks_price_p2p_by_the_derivation(path):
    import os
    cm = cmm.load_cost_model(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path))
    ms, text = cmm.p2p_derivation(cm["tokens_per_microbatch"], 2048)
    assert cm["p2p_ms"] == pytest.approx(ms, abs=1e-6) and cm["p2p_ms"] > 0.1
    assert any(text in line for line in cm.get("derivation", []) + cm["source"])
    assert cmm.stage_costs(cm, 8, "adamw").p2p == pytest.approx(cm["p2p_ms"] / 1000)  # not scaled by D


def test_every_send_of_the_op_lists_pays_p2p():
    p = 0.1
    # D = 2, M = 1: one forward and one backward message on the critical path
    assert (cmm.sync_iteration("1f1b", 2, 1, uniform(2, p2p=p)).makespan
            - cmm.sync_iteration("1f1b", 2, 1, uniform(2)).makespan) == pytest.approx(2 * p)
    for name in ("1f1b", "zb-h1", "zb-v", "interleaved-zb-h1"):
        for M in (2, 4):
            grown = cmm.sync_iteration(name, 8, M, uniform(8, p2p=p)).makespan - \
                cmm.sync_iteration(name, 8, M, uniform(8)).makespan
            assert grown >= 2 * 7 * p - 1e-9  # the first forward down and the last backward up, at least
    # the asynchronous stream: a step every k micro-batches leaves a rank waiting for a message
    for k in (2, 4):
        assert cmm.async_per_microbatch(8, k, uniform(8, p2p=p)).seconds_per_microbatch > \
            cmm.async_per_microbatch(8, k, uniform(8)).seconds_per_microbatch + 0.05
