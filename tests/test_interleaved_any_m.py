"""Interleaved 1F1B and interleaved ZB-H1 for any number of micro-batches M (M < D and M % D != 0 too).

- groups: micro-batches run through the chunks in max(1, M // D) near-equal groups of at least D (all
  M when M < D); M % D == 0 keeps Megatron's groups of D, so those schedules are unchanged;
- schedules: invariants and deadlock freedom (isend + blocking recv) for D in {2,3,4,8}, v in {2,3},
  every M from 1 to 2D; for M >= D the simulated bubble is the interleaved one of the papers,
  (D-1)(t_F+t_B)/v for 1F1B and (D-1)(t_F+t_B-t_W)/v for ZB-H1, at every M, not only at multiples of D;
- why not Megatron's default table (groups of D, a short last group): the checker finds it deadlocks;
- numerics: PP=2 v=2 M=3 and PP=4 v=2 M=2, M=6 equal the single-process model (fp32, the tolerance of
  test_pipeline_parallel: rtol=1e-5, atol=1e-6, the loss within 1e-5 relative).
"""

import pytest
from dist_harness import run_distributed
from test_pipeline_parallel import check_against_reference, reference
from test_zero_bubble import v_pipeline_run

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedule_ops import microbatch_groups
from megatron_po.pipeline.schedules import (Backward, BackwardInput, DeadlockError, Forward, Schedule, Step,
                                            _one_f_one_b_ops, async_one_f_one_b, check_schedule,
                                            interleaved_one_f_one_b, interleaved_order, one_f_one_b)
from megatron_po.pipeline.simulator import simulate
from megatron_po.pipeline.zero_bubble import zb_h1

T_F, T_B, T_W = 1.0, 1.0, 1.0  # per whole stage; split backward B + W, fused 1F1B backward B + W


def test_microbatch_groups():
    assert microbatch_groups(8, 2) == [2] and microbatch_groups(8, 8) == [8]
    assert microbatch_groups(8, 10) == [10] and microbatch_groups(8, 17) == [9, 8]
    assert microbatch_groups(4, 12) == [4, 4, 4] and microbatch_groups(4, 15) == [5, 5, 5]
    for D in range(1, 9):
        for M in range(1, 4 * D + 1):
            groups = microbatch_groups(D, M)
            assert sum(groups) == M and max(groups) - min(groups) <= 1
            assert min(groups) >= min(D, M)
            if M % D == 0:
                assert groups == [D] * (M // D)


def test_order_walks_each_group_through_the_chunks():
    # D=4, M=6: one group of 6; forwards chunk 0 of mb 0..5, then chunk 1; backwards mirror the chunk.
    assert interleaved_order(4, 2, 6, forward=True) == [(mb, 0) for mb in range(6)] + [(mb, 1) for mb in range(6)]
    assert interleaved_order(4, 2, 6, forward=False) == [(mb, 1) for mb in range(6)] + [(mb, 0) for mb in range(6)]
    # D=2, M=5: groups [3, 2]
    assert interleaved_order(2, 2, 5, forward=True) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                                        (3, 0), (4, 0), (3, 1), (4, 1)]


@pytest.mark.parametrize("D", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_every_m_is_a_valid_deadlock_free_schedule_with_the_interleaved_bubble(D, v):
    for M in range(1, 2 * D + 1):
        straight = simulate(one_f_one_b(D, 1, M), T_F, T_B + T_W).makespan
        for name, builder, t_b, t_w, bubble in (
                ("interleaved-1f1b", interleaved_one_f_one_b, T_B + T_W, 0.0, (D - 1) * (T_F + T_B + T_W) / v),
                ("interleaved-zb-h1", zb_h1, T_B, T_W, (D - 1) * (T_F + T_B - T_W) / v)):
            s = builder(D, v, M)
            stats = check_schedule(s)  # raises on a broken invariant or a deadlock
            assert all(ops[-1] == Step(None) for ops in s.ops.values())
            assert stats.num_messages == 2 * M * (D * v - 1)
            makespan = simulate(s, T_F / v, t_b / v, t_weight=t_w / v).makespan
            ideal = M * (T_F + T_B + T_W)
            if M >= D:  # the papers' interleaved bubble at every M, not only at multiples of D
                assert makespan == pytest.approx(ideal + bubble), (name, D, v, M)
            else:  # fewer micro-batches than ranks: never slower than 1F1B without chunks
                assert makespan <= straight + 1e-9, (name, D, v, M)


def test_warmup_is_megatrons_with_the_first_group():
    D, v, M = 4, 2, 6  # one group of 6: rank r runs 2(D-r-1) + (v-1)*6 forwards before its first backward
    s = interleaved_one_f_one_b(D, v, M)
    z = zb_h1(D, v, M)
    n = M * v

    def first_backward_at(warmup):  # the warm-up forwards, then one steady forward unless all were warm-up
        return warmup + 1 if warmup < n else n

    for r in range(D):
        first = next(i for i, op in enumerate(s.ops[r]) if isinstance(op, Backward))
        assert first == first_backward_at(min(2 * (D - r - 1) + (v - 1) * 6, n))
        first = next(i for i, op in enumerate(z.ops[r]) if isinstance(op, BackwardInput))
        assert first == first_backward_at(min((D - r - 1) + (v - 1) * 6, n))


def test_megatrons_short_last_group_deadlocks_here():
    """Groups of D with the remainder last (Megatron's default table), warm-up 2(D-r-1) + (v-1)D: at D=8,
    v=2, M=10 (groups 8 and 2) the ranks wait on each other. Megatron refuses a last group shorter than D
    for the same reason; we use near-equal groups of at least D instead."""
    D, v, M = 8, 2, 10
    order = [(mb, c) for first, size in ((0, 8), (8, 2)) for c in range(v) for mb in range(first, first + size)]
    backward = [(mb, v - 1 - c) for mb, c in order]
    ops = {r: _one_f_one_b_ops(order, backward, min(2 * (D - r - 1) + (v - 1) * D, M * v)) + [Step(None)]
           for r in range(D)}
    with pytest.raises(DeadlockError):
        check_schedule(Schedule("megatron-table", D, v, M, ops))
    check_schedule(interleaved_one_f_one_b(D, v, M))


def test_the_async_stream_keeps_whole_groups():
    with pytest.raises(ConfigError, match="a segment must end where the stream's groups of D micro-batches end"):
        async_one_f_one_b(4, 2, 6)
    assert async_one_f_one_b(4, 2, 8).ops[0][0] == Forward(0, 0)


@pytest.mark.parametrize("method", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("pp,n", [(2, 3), (4, 2), (4, 6)])
def test_interleaved_any_m_matches_unpipelined(method, pp, n):
    ref_loss, ref_grads = reference("llama", n=n)
    results = run_distributed(_run_with_microbatches, pp, pp=pp, args=(method, n))
    check_against_reference(results, ref_loss, ref_grads)


def _run_with_microbatches(method, n):
    """test_zero_bubble.v_pipeline_run (v=2) with n micro-batches: the module's M is patched in the forked rank."""
    import test_pipeline_parallel as tpp
    tpp.M = n
    return v_pipeline_run(method, 2)
