"""Pipeline schedules: exact op orders for small cases, invariants over many (D, v, M), staleness."""

import re

import pytest

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedules import (SCHEDULES, Backward, DeadlockError, Forward, Schedule, Step,
                                            async_one_f_one_b, build_schedule, check_schedule, comm_of,
                                            gpipe, interleaved_one_f_one_b, message_tag, no_pipelining,
                                            one_f_one_b, rank_chunk_of, staleness, tag_period,
                                            virtual_stage)


def parse(row: str):
    """'F0 F1 B0 S' -> ops; 'F0.1' -> Forward(0, 1); 'S' -> Step(None); 'S.1' -> Step(1)."""
    ops = []
    for tok in row.split():
        if tok == "S":
            ops.append(Step(None))
        elif tok.startswith("S."):
            ops.append(Step(int(tok[2:])))
        else:
            mb, _, c = tok[1:].partition(".")
            ops.append((Forward if tok[0] == "F" else Backward)(int(mb), int(c or 0)))
    return ops


# --------------------------------------------------------------------------------------------------
# Virtual stages, communication, tags
# --------------------------------------------------------------------------------------------------


def test_virtual_stage_round_trip():
    for D in (1, 2, 4):
        for v in (1, 3):
            seen = set()
            for r in range(D):
                for c in range(v):
                    vs = virtual_stage(r, c, D)
                    assert rank_chunk_of(vs, D) == (r, c)
                    seen.add(vs)
            assert seen == set(range(D * v))
    assert virtual_stage(1, 2, 4) == 9  # Megatron: chunk * D + rank


def test_comm_of_straight_and_interleaved():
    D, v = 4, 2
    # virtual stage 0 (embedding) receives nothing in forward, sends nothing in backward
    assert comm_of(Forward(5, 0), 0, D, v) == (None, (1, ("act", 5, 1)))
    assert comm_of(Backward(5, 0), 0, D, v) == ((1, ("grad", 5, 0)), None)
    # rank 3 chunk 0 (vs 3) feeds rank 0 chunk 1 (vs 4): the wrap-around of the interleaved pipeline
    assert comm_of(Forward(2, 0), 3, D, v) == ((2, ("act", 2, 3)), (0, ("act", 2, 4)))
    assert comm_of(Forward(2, 1), 0, D, v) == ((3, ("act", 2, 4)), (1, ("act", 2, 5)))
    assert comm_of(Backward(2, 1), 0, D, v) == ((1, ("grad", 2, 4)), (3, ("grad", 2, 3)))
    # last virtual stage (rank 3 chunk 1) holds the loss: no send forward, no recv backward
    assert comm_of(Forward(0, 1), 3, D, v) == ((2, ("act", 0, 7)), None)
    assert comm_of(Backward(0, 1), 3, D, v) == (None, (2, ("grad", 0, 6)))
    assert comm_of(Step(None), 2, D, v) == (None, None)
    # one stage, one chunk: nothing to communicate
    assert comm_of(Forward(0), 0, 1, 1) == (None, None)
    assert comm_of(Backward(0), 0, 1, 1) == (None, None)


def test_message_tags_unique_in_range_and_distinct_for_act_and_grad():
    for D, v in ((2, 2), (4, 1), (3, 3), (16, 4)):
        tags = {}
        for kind in ("act", "grad"):
            for mb in range(40):
                for vs in range(D * v):
                    t = message_tag(kind, mb, vs, v, D)
                    assert 0 <= t < 2**31
                    assert t not in tags, (kind, mb, vs, tags.get(t))
                    tags[t] = (kind, mb, vs)
    # D = 2 interleaved: rank 0 sends an activation and a gradient to rank 1 for the same micro-batch
    D, v = 2, 2
    act = comm_of(Forward(7, 0), 0, D, v)[1]  # to rank 1 (vs 1)
    grad = comm_of(Backward(7, 1), 0, D, v)[1]  # to rank 1 (vs 1)
    assert act[0] == grad[0] == 1 and act[1][2] == grad[1][2] == 1
    assert message_tag(*act[1], v, D) != message_tag(*grad[1], v, D)


def test_message_tag_wraps_micro_batch_ids_by_the_period():
    D, v = 4, 2
    period = tag_period(D, v)
    assert period == 2**31 // 16
    huge = 10**12 + 3  # async schedules stream micro-batches forever
    t = message_tag("grad", huge, 5, v, D)
    assert 0 <= t < 2**31
    assert t == message_tag("grad", huge % period, 5, v, D)
    assert message_tag("act", period - 1, D * v - 1, v, D) < 2**31  # the largest tag still fits
    with pytest.raises(ValueError):
        message_tag("act", 0, D * v, v, D)


# --------------------------------------------------------------------------------------------------
# Exact op orders (hand-written)
# --------------------------------------------------------------------------------------------------


def test_no_pipelining_is_gradient_accumulation():
    s = no_pipelining(1, 1, 3)
    assert s.ops == {0: parse("F0 B0 F1 B1 F2 B2 S")}
    s = no_pipelining(1, 2, 2)
    assert s.ops == {0: parse("F0.0 F0.1 B0.1 B0.0 F1.0 F1.1 B1.1 B1.0 S")}
    with pytest.raises(ConfigError, match="num_stages == 1"):
        no_pipelining(2, 1, 4)


def test_gpipe_order():
    s = gpipe(3, 1, 2)
    for r in range(3):
        assert s.ops[r] == parse("F0 F1 B0 B1 S")
    # v > 1: chunk-major, the order a GPipe over D*v virtual stages runs them
    s = gpipe(2, 2, 2)
    assert s.ops[1] == parse("F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 S")


def test_one_f_one_b_order():
    s = one_f_one_b(3, 1, 4)
    assert s.ops[0] == parse("F0 F1 F2 B0 F3 B1 B2 B3 S")
    assert s.ops[1] == parse("F0 F1 B0 F2 B1 F3 B2 B3 S")
    assert s.ops[2] == parse("F0 B0 F1 B1 F2 B2 F3 B3 S")
    # fewer micro-batches than warm-up slots: warm-up capped at M
    s = one_f_one_b(4, 1, 2)
    assert s.ops[0] == parse("F0 F1 B0 B1 S")
    with pytest.raises(ConfigError, match="num_chunks == 1"):
        one_f_one_b(4, 2, 8)


def test_interleaved_order_d2_v2_matches_megatron():
    # Forward ids 0..7 -> (mb, chunk): groups of D=2 micro-batches, chunk 0 then chunk 1.
    # Backward: same micro-batches, mirrored chunk. Warm-up: rank 0 (2-0-1)*2 + (2-1)*2 = 4, rank 1: 2.
    s = interleaved_one_f_one_b(2, 2, 4)
    assert s.ops[0] == parse("F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
                             "B2.1 B3.1 B2.0 B3.0 S")
    assert s.ops[1] == parse("F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 "
                             "F3.1 B3.1 B2.0 B3.0 S")


def test_interleaved_warmup_counts():
    D, v, M = 4, 3, 8
    s = interleaved_one_f_one_b(D, v, M)
    for r in range(D):
        first_backward = next(i for i, op in enumerate(s.ops[r]) if isinstance(op, Backward))
        # the op before the first backward is the first steady-state forward
        assert first_backward - 1 == min((D - r - 1) * 2 + (v - 1) * D, M * v)


def test_interleaved_with_one_chunk_is_one_f_one_b():
    for D in (1, 2, 3, 5):
        for M in (1, 2, 3, 7, 10):
            assert interleaved_one_f_one_b(D, 1, M).ops == one_f_one_b(D, 1, M).ops


def test_build_schedule_dispatch_and_errors():
    assert build_schedule("1f1b", 4, 2, 8).name == "interleaved-1f1b"
    assert build_schedule("1f1b", 4, 1, 8).name == "1f1b"
    assert build_schedule("gpipe", 2, 1, 3).ops == gpipe(2, 1, 3).ops
    assert build_schedule("async", 3, 1, 6, update_interval=2).ops == async_one_f_one_b(3, 1, 6, 2).ops
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule 'pipedreem'.*gpipe.*1f1b"):
        build_schedule("pipedreem", 4, 1, 8)
    assert build_schedule("1f1b", 4, 2, 6).num_microbatches == 6  # synchronous interleaving takes any M
    with pytest.raises(ConfigError, match=r"stream's groups of D micro-batches end\), got M=6, D=4"):
        build_schedule("async", 4, 2, 6)
    with pytest.raises(ConfigError, match="only applies to the async"):
        build_schedule("gpipe", 4, 1, 8, update_interval=2)
    for bad in ((0, 1, 4), (2, 0, 4), (2, 1, 0), (-1, 1, 4)):
        with pytest.raises(ConfigError, match=">= 1"):
            build_schedule("1f1b", *bad)
    with pytest.raises(ConfigError, match="update_interval"):
        async_one_f_one_b(2, 1, 4, update_interval=0)
    for method in SCHEDULES:
        assert build_schedule(method, 1, 1, 2).num_stages == 1


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as e:
        build_schedule("async", 4, 2, 6)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# Invariants over many shapes
# --------------------------------------------------------------------------------------------------

SHAPES = [(D, v, M) for D in (1, 2, 3, 4, 5, 8) for v in (1, 2, 3) for M in (1, 2, 3, 4, 6, 8, 12, 16)]


def all_schedules():
    for D, v, M in SHAPES:
        for method in ("none", "gpipe", "1f1b"):
            try:
                yield build_schedule(method, D, v, M)
            except ConfigError:
                pass
        for k in (1, 2, 3):
            try:
                yield async_one_f_one_b(D, v, M, k)
            except ConfigError:
                pass


def test_every_schedule_passes_its_invariants():
    seen = {}
    for s in all_schedules():
        stats = check_schedule(s)
        n_compute = 2 * s.num_microbatches * s.num_chunks
        for r in range(s.num_stages):
            ops = s.ops[r]
            assert sum(not isinstance(op, Step) for op in ops) == n_compute
            assert stats.peak_activations[r] >= 1
        assert stats.total_ops == sum(len(ops) for ops in s.ops.values())
        # every message crosses one virtual-stage boundary, once per micro-batch each way
        assert stats.num_messages == 2 * s.num_microbatches * (s.num_stages * s.num_chunks - 1)
        seen[(s.name, s.num_stages, s.num_chunks)] = True
    # the grid really covered interleaved D=2, D=1 and async interleaved
    assert ("interleaved-1f1b", 2, 2) in seen and ("interleaved-1f1b", 2, 3) in seen
    assert ("none", 1, 1) in seen and ("1f1b", 1, 1) in seen and ("async", 2, 2) in seen


def test_synchronous_schedules_end_with_one_global_step():
    for s in all_schedules():
        if s.name == "async":
            continue
        for ops in s.ops.values():
            assert [op for op in ops if isinstance(op, Step)] == [Step(None)]
            assert ops[-1] == Step(None)


def test_peak_activations():
    for D in (1, 2, 3, 4, 6):
        for M in (1, 2, D, 2 * D + 1):
            one = check_schedule(one_f_one_b(D, 1, M)).peak_activations
            gp = check_schedule(gpipe(D, 1, M)).peak_activations
            for r in range(D):
                assert one[r] == min(D - r, M)  # <= D - r, reached once M >= D - r
                assert gp[r] == M
    # interleaved: warm-up + 1 forwards in flight (capped at all M*v)
    D, v, M = 4, 2, 8
    peak = check_schedule(interleaved_one_f_one_b(D, v, M)).peak_activations
    assert peak == {r: min((D - r - 1) * 2 + (v - 1) * D + 1, M * v) for r in range(D)}


# --------------------------------------------------------------------------------------------------
# The checker catches broken schedules
# --------------------------------------------------------------------------------------------------


def test_checker_reports_deadlock_with_the_stuck_ops():
    # rank 0 waits for the gradient of mb 0 before it sends mb 1's activation; rank 1 wants mb 1 first
    s = Schedule("bad", 2, 1, 2, {0: parse("F0 B0 F1 B1 S"), 1: parse("F1 B1 F0 B0 S")})
    with pytest.raises(DeadlockError) as e:
        check_schedule(s)
    msg = str(e.value)
    assert "rank 0 at op #1 B0 waits for grad of micro-batch 0" in msg
    assert "rank 1 at op #0 F1 waits for act of micro-batch 1" in msg


def test_checker_reports_structural_errors():
    ok = {1: parse("F0 B0 F1 B1 S")}
    with pytest.raises(ValueError, match="before its forward"):
        check_schedule(Schedule("b", 2, 1, 2, {0: parse("B0 F0 F1 B1 S"), **ok}))
    with pytest.raises(ValueError, match="never runs B1"):
        check_schedule(Schedule("b", 2, 1, 2, {0: parse("F0 B0 F1 S"), **ok}))
    with pytest.raises(ValueError, match="twice"):
        check_schedule(Schedule("b", 2, 1, 2, {0: parse("F0 F0 B0 F1 B1 S"), **ok}))
    with pytest.raises(ValueError, match="gradients are never applied"):
        check_schedule(Schedule("b", 2, 1, 2, {0: parse("F0 B0 F1 B1"), **ok}))
    with pytest.raises(ValueError, match="outside"):
        check_schedule(Schedule("b", 2, 1, 2, {0: parse("F0 B0 F1 B1 F2 B2 S"), **ok}))
    with pytest.raises(ValueError, match="ranks 0..1"):
        check_schedule(Schedule("b", 2, 1, 2, ok))


# --------------------------------------------------------------------------------------------------
# Asynchronous schedule and staleness
# --------------------------------------------------------------------------------------------------


def as_table(stale, D, v=1):
    return {(r, c): [stale[(r, c)][mb] for mb in sorted(stale[(r, c)])] for r in range(D) for c in range(v)}


def test_async_op_order_straight():
    # (printed as plain "S" for v = 1; written S.0 here because these are per-chunk steps)
    s = async_one_f_one_b(3, 1, 6)
    assert s.ops[0] == parse("F0 F1 F2 B0 S.0 F3 B1 S.0 F4 B2 S.0 F5 B3 S.0 B4 S.0 B5 S.0")
    assert s.ops[1] == parse("F0 F1 B0 S.0 F2 B1 S.0 F3 B2 S.0 F4 B3 S.0 F5 B4 S.0 B5 S.0")
    assert s.ops[2] == parse("F0 B0 S.0 F1 B1 S.0 F2 B2 S.0 F3 B3 S.0 F4 B4 S.0 F5 B5 S.0")


def test_synchronous_schedules_have_zero_staleness():
    for s in all_schedules():
        if s.name == "async":
            continue
        for per_mb in staleness(s).values():
            assert set(per_mb) == set(range(s.num_microbatches))
            assert set(per_mb.values()) == {0}


def test_staleness_straight_d4_k1_is_d_minus_r_minus_1_in_steady_state():
    D, M = 4, 16
    stale = staleness(async_one_f_one_b(D, 1, M))
    for r in range(D):
        w = D - r - 1
        assert [stale[(r, 0)][mb] for mb in range(w, M)] == [w] * (M - w)  # steady state and drain
        assert [stale[(r, 0)][mb] for mb in range(w)] == list(range(w))  # warm-up: fewer steps so far
    assert [max(stale[(r, 0)].values()) for r in range(D)] == [3, 2, 1, 0]


def test_staleness_d3_m6_k1_hand_derived():
    # rank 0: F0 F1 F2 B0 S F3 B1 S ...: between F0 and B0 no step, F1..B1 one (after B0), F2..B2 two, ...
    stale = staleness(async_one_f_one_b(3, 1, 6))
    assert as_table(stale, 3) == {(0, 0): [0, 1, 2, 2, 2, 2],
                                  (1, 0): [0, 1, 1, 1, 1, 1],
                                  (2, 0): [0, 0, 0, 0, 0, 0]}


def test_staleness_d4_k2_hand_derived():
    # rank 0: F0 F1 F2 F3 B0 F4 B1 S F5 B2 F6 B3 S F7 B4 B5 S B6 B7 S
    s = async_one_f_one_b(4, 1, 8, update_interval=2)
    assert s.ops[0] == parse("F0 F1 F2 F3 B0 F4 B1 S.0 F5 B2 F6 B3 S.0 F7 B4 B5 S.0 B6 B7 S.0")
    assert as_table(staleness(s), 4) == {(0, 0): [0, 0, 1, 1, 2, 1, 2, 1],
                                         (1, 0): [0, 0, 1, 1, 1, 1, 1, 1],
                                         (2, 0): [0, 0, 1, 0, 1, 0, 1, 0],
                                         (3, 0): [0] * 8}


def test_async_partial_group_is_stepped_at_the_drain():
    s = async_one_f_one_b(1, 1, 4, update_interval=3)
    assert s.ops[0] == parse("F0 B0 F1 B1 F2 B2 S.0 F3 B3 S.0")  # B3 alone is stepped, not dropped
    s = async_one_f_one_b(2, 2, 4, update_interval=3)
    for ops in s.ops.values():
        for c in range(2):
            assert sum(op == Step(c) for op in ops) == 2  # ceil(4 / 3)
        assert Step(None) not in ops


def test_staleness_interleaved_d2_v2_hand_derived():
    s = async_one_f_one_b(2, 2, 4)
    assert s.ops[0] == parse("F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 S.1 F3.0 B1.1 S.1 F2.1 B0.0 S.0 "
                             "F3.1 B1.0 S.0 B2.1 S.1 B3.1 S.1 B2.0 S.0 B3.0 S.0")
    assert s.ops[1] == parse("F0.0 F1.0 F0.1 B0.1 S.1 F1.1 B1.1 S.1 F2.0 B0.0 S.0 F3.0 B1.0 S.0 "
                             "F2.1 B2.1 S.1 F3.1 B3.1 S.1 B2.0 S.0 B3.0 S.0")
    # rank 0 chunk 0: F3.0 .. B3.0 sees the chunk-0 steps after B0.0, B1.0, B2.0 -> 3
    # rank 0 chunk 1: F2.1 comes after B1.1's step and B2.1 right after F3.1 B1.0 S.0 -> 0
    # rank 1 chunk 1 is the last virtual stage: its backward follows its forward immediately -> 0
    assert as_table(staleness(s), 2, 2) == {(0, 0): [0, 1, 2, 3], (0, 1): [0, 1, 0, 1],
                                            (1, 0): [0, 1, 2, 2], (1, 1): [0, 0, 0, 0]}


def test_staleness_counts_global_steps_for_every_chunk():
    # a hand-made op list: Step(None) between F and B counts for both chunks, Step(1) only for chunk 1
    s = Schedule("x", 1, 2, 1, {0: [Forward(0, 0), Forward(0, 1), Step(None), Step(1), Backward(0, 1),
                                    Backward(0, 0), Step(None)]})
    assert staleness(s) == {(0, 0): {0: 1}, (0, 1): {0: 2}}


# --------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------


def test_str_prints_an_aligned_table():
    text = str(interleaved_one_f_one_b(4, 2, 8))
    head, *rows = text.splitlines()
    assert head == "interleaved-1f1b: D=4 v=2 M=8"
    assert len(rows) == 4 and rows[0].startswith("rank  0 | F0.0 F1.0")
    assert "B7.0 S" in rows[3]
    # column k starts at the same character offset in every row
    starts = [[m.start() for m in re.finditer(r"\S+", row.split("|", 1)[1])] for row in rows]
    assert all(st == starts[0] for st in starts)
    straight = str(one_f_one_b(3, 1, 4))
    assert "." not in straight.split("\n", 1)[1]  # no chunk suffix for v = 1
    assert straight.splitlines()[1] == "rank  0 | F0 F1 F2 B0 F3 B1 B2 B3 S"
    assert "S.1" in str(async_one_f_one_b(2, 2, 2))
