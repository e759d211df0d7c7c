"""Zero-bubble pipelining (ZB-H1, interleaved ZB-H1, ZB-H2): the schedules and the split backward.

- schedules: every (mb, chunk) runs F, then B (BackwardInput), then W (BackwardWeight); the ranks cannot
  deadlock (isend + blocking recv); D in {2,3,4,8}, M in {D..4D};
- simulator: the bubbles the paper predicts at t_F = t_B = t_W (ZB-H1: (D-1) t_F; 1F1B: (D-1) 3 t_F);
- numerics: PP=2 and PP=4 runs (with TP=2 or DP=2 beside) equal the single-process model (fp32, the
  tolerance of test_pipeline_parallel: rtol=1e-5, atol=1e-6: the W op sums a weight's gradient in
  another order than a fused backward); the emulator equals the distributed executor bit for bit;
  recomputation under zero bubble is bitwise the run without it.
"""

import pytest
import torch
from dist_harness import run_distributed
from test_pipeline_parallel import check_against_reference, emulated_run, pipeline_run, reference
from test_recompute import GRANULARITIES, NONE, assert_same, sync_pipeline_run

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedules import (BackwardInput, BackwardWeight, DeadlockError, Forward, Schedule, Step,
                                            build_schedule, check_schedule, one_f_one_b)
from megatron_po.pipeline.simulator import simulate
from megatron_po.pipeline.zero_bubble import zb_h1, zb_h2, zb_v
from megatron_po.tensor_parallel import weight_grads
from megatron_po.tensor_parallel.layers import linear

# (name, builder, chunks per rank)
SCHEDULES = [("zb-h1", zb_h1, 1), ("zb-h1-interleaved", zb_h1, 2), ("zb-h2", zb_h2, 1), ("zb-v", zb_v, 2)]


@pytest.mark.parametrize("name,builder,v", SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("D", [2, 3, 4, 8])
def test_invariants_and_deadlock_freedom(name, builder, v, D):
    for M in range(D, 4 * D + 1):  # every M, M % D != 0 too (M < D: tests/test_interleaved_any_m.py)
        s = builder(D, v, M)
        stats = check_schedule(s)  # raises on any broken invariant or a deadlock
        for r, ops in s.ops.items():
            assert sum(isinstance(op, BackwardWeight) for op in ops) == M * v
            assert not any(type(op).__name__ == "Backward" for op in ops)
            assert ops[-1] == Step(None)
        if name == "zb-h1":  # ZB-H1 keeps 1F1B's peak (D on rank 0) on every rank
            assert max(stats.peak_activations.values()) == min(D, M)
        if name == "zb-h2":
            assert max(stats.peak_activations.values()) <= 2 * D - 1
        if name == "zb-v":  # 2D half-size chunk activations: 1F1B's peak of D whole-stage ones
            assert max(stats.peak_activations.values()) <= 2 * D
            assert s.placement == "v"


def test_checker_rejects_w_before_b_and_deadlock():
    bad = Schedule("bad", 1, 1, 1, {0: [Forward(0), BackwardWeight(0), BackwardInput(0), Step(None)]})
    with pytest.raises(ValueError, match="before its BackwardInput"):
        check_schedule(bad)
    # Rank 0 waits for B0's gradient before sending F1's activation that rank 1 needs first.
    stuck = Schedule("stuck", 2, 1, 2, {
        0: [Forward(0), BackwardInput(0), Forward(1), BackwardInput(1), BackwardWeight(0), BackwardWeight(1),
            Step(None)],
        1: [Forward(0), Forward(1), BackwardInput(0), BackwardInput(1), BackwardWeight(0), BackwardWeight(1),
            Step(None)]})
    with pytest.raises(DeadlockError):
        check_schedule(stuck)


def test_zb_h2_rejects_chunks_and_build_schedule_names():
    with pytest.raises(ConfigError, match="zb-h2 needs num_chunks == 1"):
        zb_h2(4, 2, 8)
    with pytest.raises(ConfigError, match="zb-v needs num_chunks == 2"):
        zb_v(4, 1, 8)
    assert build_schedule("zb-h1", 4, 2, 8).name == "zb-h1"
    with pytest.raises(ConfigError, match="only applies to the async schedule"):
        build_schedule("zb-h2", 4, 1, 8, update_interval=2)


def test_simulated_bubbles_match_the_paper():
    """t_F = t_B = t_W = 20 ms, D=4, M=8: 1F1B idles (D-1)(t_F+t_B+t_W) per rank, ZB-H1 (D-1)(t_F+t_B-t_W);
    ZB-H2 reaches the flush's lower bound M(t_F+t_B+t_W) + (D-1) t_F, also with a cheaper W."""
    D, M, t = 4, 8, 20.0
    ideal = M * 3 * t
    assert simulate(one_f_one_b(D, 1, M), t, 2 * t).makespan == ideal + (D - 1) * 3 * t
    assert simulate(zb_h1(D, 1, M), t, t, t_weight=t).makespan == ideal + (D - 1) * t
    assert simulate(zb_h2(D, 1, M), t, t, t_weight=t).makespan == ideal + (D - 1) * t
    assert simulate(zb_h2(D, 1, M), t, t, t_weight=t / 2).makespan == M * 2.5 * t + (D - 1) * t
    assert simulate(zb_h1(D, 1, M), t, t, t_weight=t / 2).makespan > M * 2.5 * t + (D - 1) * t
    # ZB-V (chunks at half cost) is within one chunk-forward (t/2) of the flush minimum for v = 2.
    assert simulate(zb_v(D, 2, M), t / 2, t / 2, t_weight=t / 2).makespan == ideal + (D - 1) * t / 2 + t / 2
    # A fused Backward costs t_backward + t_weight: 1F1B is unchanged by splitting the cost.
    assert simulate(one_f_one_b(D, 1, M), t, t, t_weight=t).makespan == ideal + (D - 1) * 3 * t


def test_deferred_linear_weight_grads_equal_fused():
    """B queues the linear's weight gradient (no weight grad yet), W accumulates exactly the fused one."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, requires_grad=True)
    w, b = torch.nn.Parameter(torch.randn(4, 5)), torch.nn.Parameter(torch.randn(4))
    g = torch.randn(3, 2, 4)
    linear(x, w, b).backward(g)
    fused = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    with weight_grads.defer_weight_grads() as queue:
        linear(x, w, b).backward(g)
    assert w.grad is None and b.grad is None and len(queue) == 1
    torch.testing.assert_close(x.grad, fused[0], rtol=0, atol=0)
    weight_grads.apply_weight_grads(queue)
    torch.testing.assert_close(w.grad, fused[1], rtol=0, atol=0)
    torch.testing.assert_close(b.grad, fused[2], rtol=0, atol=0)
    assert not weight_grads.deferring()


@pytest.mark.parametrize("pp,method,v", [(2, "zb-h1", 1), (4, "zb-h1", 1), (2, "zb-h1", 2), (2, "zb-h2", 1),
                                         (4, "zb-h2", 1)])
def test_zero_bubble_matches_unpipelined(pp, method, v):
    ref_loss, ref_grads = reference("llama")
    check_against_reference(run_distributed(pipeline_run, pp, pp=pp, args=("llama", method, v)), ref_loss, ref_grads)


@pytest.mark.parametrize("method", ["zb-h1", "zb-h2"])
def test_zero_bubble_pp2_dp2_matches_single_process(method):
    """DP=2 beside: the chunk's gradient reduction starts at its last W (and the rest at the flush)."""
    ref_loss, ref_grads = reference("gpt2", n=2 * 4)
    check_against_reference(run_distributed(pipeline_run, 4, pp=2, args=("gpt2", method, 1)), ref_loss, ref_grads)


def test_zero_bubble_tp2_pp2_matches_single_process():
    ref_loss, ref_grads = reference("gpt2")
    check_against_reference(run_distributed(pipeline_run, 4, tp=2, pp=2, args=("gpt2", "zb-h1", 1)),
                            ref_loss, ref_grads)


def test_v_placement_routes_messages_down_and_back_up():
    from megatron_po.pipeline.partition import chunk_placements
    from megatron_po.pipeline.schedules import comm_of
    D = 4
    assert [p["layer_offset"] for r in range(D) for p in chunk_placements([2] * 8, r, D, 2, "v")] == [
        0, 14, 2, 12, 4, 10, 6, 8]
    assert chunk_placements([2] * 8, 0, D, 2, "v")[1]["post_process"]
    # The last forward of chunk 0 (rank D-1) feeds chunk 1 on the same rank; rank 0's chunk 1 is the loss.
    assert comm_of(Forward(0, 0), D - 1, D, 2, "v") == ((D - 2, ("act", 0, D - 1)), (D - 1, ("act", 0, D)))
    assert comm_of(Forward(0, 1), 0, D, 2, "v") == ((1, ("act", 0, 2 * D - 1)), None)


def v_pipeline_run(method, v):
    """pipeline_run with the config naming the method, so the chunks are placed as its schedule needs."""
    return pipeline_run("llama", method, v, parallel={"pipeline_method": method})


def v_emulated_run(method, D, v):
    """test_pipeline_parallel.emulated_run with the chunks placed for `method` (ZB-V: the loss on rank 0)."""
    from test_gpt_parallel import SEED, VOCAB
    from test_pipeline_parallel import M, global_grads, make_cfg, microbatches

    from megatron_po.distributed.ddp import allreduce_embedding_grads
    from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate
    from megatron_po.pipeline.partition import build_chunks_for_rank
    from megatron_po.pipeline.schedules import placement_of
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(SEED)
    cfg = make_cfg("llama", {"pipeline_method": method})
    mbs, mailbox, runners = microbatches(), Mailbox(), {}
    for r in range(D):
        runners[r] = StageRunner(rank=r, num_stages=D, chunks=build_chunks_for_rank(cfg, VOCAB, r, D, v),
                                 transport=mailbox, get_batch=mbs.__getitem__, loss_scale=1.0 / M,
                                 placement=placement_of(method))
    emulate(build_schedule(method, D, v, M), runners)
    all_chunks = [c for r in range(D) for c in runners[r].chunks]
    allreduce_embedding_grads([p for c in all_chunks for p in c.parameters()])
    losses = next(runner.losses for runner in runners.values() if runner.losses)
    return torch.stack([losses[m] for m in range(M)]).mean().item(), global_grads(all_chunks)


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_v_matches_unpipelined(pp):
    ref_loss, ref_grads = reference("llama")
    check_against_reference(run_distributed(v_pipeline_run, pp, pp=pp, args=("zb-v", 2)), ref_loss, ref_grads)


def test_zb_v_pp2_dp2_matches_single_process():
    ref_loss, ref_grads = reference("llama", n=2 * 4)
    check_against_reference(run_distributed(v_pipeline_run, 4, pp=2, args=("zb-v", 2)), ref_loss, ref_grads)


@pytest.mark.parametrize("method,D,v", [("zb-h1", 4, 1), ("zb-h2", 2, 1), ("zb-h1", 2, 2), ("zb-v", 4, 2)])
def test_emulator_equals_distributed_executor(method, D, v):
    emu_loss, emu_grads = run_distributed(v_emulated_run, 1, args=(method, D, v))[0]
    results = run_distributed(v_pipeline_run, D, pp=D, args=(method, v))
    assert [r[0] for r in results if r[0] is not None][0] == emu_loss
    merged = {}
    for _, g in results:
        merged.update(g)
    assert merged.keys() == emu_grads.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], emu_grads[k], rtol=0, atol=0, msg=k)


def zb_recompute_run(method, D, v, recompute):
    """test_recompute.sync_pipeline_run, with the chunks placed as `method` needs (ZB-V's V)."""
    import test_recompute as tr
    from megatron_po.pipeline.schedules import placement_of
    make_cfg, runner = tr.make_cfg, tr.StageRunner
    def cfg_for(n):
        cfg = make_cfg(n)
        cfg.parallel.pipeline_method = method
        return cfg
    tr.make_cfg = cfg_for
    tr.StageRunner = lambda **kw: runner(placement=placement_of(method), **kw)
    try:
        return sync_pipeline_run(method, D, v, recompute)
    finally:
        tr.make_cfg, tr.StageRunner = make_cfg, runner


@pytest.mark.parametrize("method,D,v", [("zb-h1", 2, 1), ("zb-h1", 2, 2), ("zb-h2", 2, 1), ("zb-v", 2, 2)])
@pytest.mark.parametrize("granularity", ["full-uniform", "selective"])
def test_recompute_under_zero_bubble_bitwise(method, D, v, granularity):
    assert_same(zb_recompute_run(method, D, v, GRANULARITIES[granularity]), zb_recompute_run(method, D, v, NONE),
                f"{method} {granularity}")


def test_simulate_schedule_tool_reports_every_schedule(capsys):
    from tools import simulate_schedule
    simulate_schedule.main(["--pipeline-method", "all", "--num-stages", "4", "--num-microbatches", "8",
                            "--t-forward", "20", "--t-backward", "40", "--t-weight", "20"])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb-h1", "zb-h2", "zb-v", "async"}
    assert rows["zb-h1"][2:4] == ["540", "0.1111"] and rows["zb-h1"][5:] == ["4", "4", "4", "4"]
    assert rows["1f1b"][2] == "660" and rows["1f1b"][5:] == ["4", "3", "2", "1"]


# ---- end to end: pretrain_gpt's training loop -------------------------------------------------------------

@pytest.mark.parametrize("flags", [{"--pipeline-method": "zb-h1"},
                                   {"--pipeline-method": "zb-h2", "--use-distributed-optimizer": True}],
                         ids=["zb-h1-ddp", "zb-h2-zero1"])
def test_training_pp2_dp2_matches_single_process(corpus, tmp_path, flags):
    """The whole training loop (DDP / ZeRO-1 reduction after the last W, clipping, Adam, evaluation) at
    PP=2 x DP=2 follows the single-process loss curve (tolerance 2e-3, test_pretrain_gpt's)."""
    from test_pretrain_gpt import assert_same_curve, run_layout
    single = run_layout(corpus, tmp_path, "single", 1)
    piped = run_layout(corpus, tmp_path, "zb", 4, **{"--pipeline-model-parallel-size": 2, **flags})
    assert_same_curve(single, piped)


def test_training_bf16_fp32_grads_zero_bubble_tracks_1f1b(corpus, tmp_path):
    """bf16 with fp32 gradient accumulation (the DDP hook adds each W's bf16 gradient into main_grad):
    ZB-H1 and 1F1B give the same curve up to bf16 summation-order noise (tolerance 2e-2)."""
    from test_pretrain_gpt import assert_same_curve, run_layout
    flags = {"--pipeline-model-parallel-size": 2, "--bf16": True, "--accumulate-allreduce-grads-in-fp32": True}
    ref = run_layout(corpus, tmp_path, "1f1b", 2, **flags)
    zb = run_layout(corpus, tmp_path, "zb", 2, **{**flags, "--pipeline-method": "zb-h1"})
    assert_same_curve(ref, zb, tol=2e-2)


def test_training_zb_v_pp2_dp2_matches_single_process(corpus, tmp_path):
    """ZB-V through the training loop (the V placement of the chunks, rank 0 holding embedding and loss,
    a rank's chunk-0 output handed to its own chunk 1) follows the untied single-process curve."""
    from test_pretrain_gpt import assert_same_curve, run_layout
    untied = {"--untie-embeddings-and-output-weights": True, "--num-layers": 4}
    single = run_layout(corpus, tmp_path, "single", 1, **untied)
    piped = run_layout(corpus, tmp_path, "zbv", 4, **untied, **{
        "--pipeline-model-parallel-size": 2, "--pipeline-method": "zb-v", "--num-layers-per-virtual-pipeline-stage": 1})
    assert_same_curve(single, piped)
