"""Timeline simulator: closed-form bubbles, dependency timing, async throughput, plot and CLI."""

import pytest

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedules import (Step, async_one_f_one_b, build_schedule, comm_of, gpipe,
                                            interleaved_one_f_one_b, one_f_one_b)
from megatron_po.pipeline.simulator import plot_timeline, simulate
from tools import simulate_schedule

T_F, T_B = 1.0, 2.0  # one whole stage; a chunk of a stage split into v costs 1/v of it


def test_bubble_gpipe_and_1f1b_closed_form():
    # Equal stages, t_b = 2 t_f, free p2p: the last backward on rank 0 ends at (M+D-1)(t_f+t_b), each
    # rank computes M(t_f+t_b), so bubble = (D-1)/(M+D-1).
    for D in (1, 2, 3, 4, 8):
        for M in (1, 2, 3, D, 2 * D, 3 * D + 1, 16):
            for method in ("gpipe", "1f1b"):
                t = simulate(build_schedule(method, D, 1, M), T_F, T_B)
                assert t.bubble_fraction == pytest.approx((D - 1) / (M + D - 1), abs=1e-9), (method, D, M)
                assert t.makespan == pytest.approx((M + D - 1) * (T_F + T_B), abs=1e-9)
                assert all(b == pytest.approx(M * (T_F + T_B)) for b in t.busy.values())


def test_bubble_interleaved_closed_form():
    # Per-chunk cost t/v. The simulator gives makespan = M(t_f+t_b) + (D-1)(t_f+t_b)/v, i.e.
    #   bubble time / ideal compute  = (D-1)/(v*M)        (Megatron paper's "bubble time fraction")
    #   bubble fraction of wall time = (D-1)/(v*M + D-1)  (what Timeline.bubble_fraction reports)
    # both exactly 1/v of 1F1B's bubble *time*. Checked for D=2 and M == D too.
    for D in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for M in (D, 2 * D, 4 * D):
                t = simulate(interleaved_one_f_one_b(D, v, M), T_F / v, T_B / v)
                ideal = M * (T_F + T_B)
                assert (t.makespan - ideal) / ideal == pytest.approx((D - 1) / (v * M), abs=1e-9), (D, v, M)
                assert t.bubble_fraction == pytest.approx((D - 1) / (v * M + D - 1), abs=1e-9), (D, v, M)
                straight = simulate(one_f_one_b(D, 1, M), T_F, T_B)
                assert t.makespan - ideal == pytest.approx((straight.makespan - ideal) / v, abs=1e-9)


def test_bubble_chunked_gpipe_matches_interleaved_form():
    # GPipe over v chunks (chunk-major) keeps the pipeline full once M >= D: same closed form.
    for D, v, M in ((2, 2, 2), (4, 2, 4), (4, 3, 8), (3, 2, 5)):
        t = simulate(gpipe(D, v, M), T_F / v, T_B / v)
        assert t.bubble_fraction == pytest.approx((D - 1) / (v * M + D - 1), abs=1e-9)


def test_p2p_latency_adds_two_pipeline_traversals_to_gpipe():
    # each of the D-1 boundaries is crossed once by the last forward and once by the last backward
    for D, M, c in ((2, 3, 0.25), (4, 4, 0.5), (3, 7, 1.0)):
        t = simulate(gpipe(D, 1, M), T_F, T_B, t_p2p=c)
        assert t.makespan == pytest.approx((M + D - 1) * (T_F + T_B) + 2 * (D - 1) * c)
    # one stage never communicates
    assert simulate(one_f_one_b(1, 1, 5), T_F, T_B, t_p2p=9.0).makespan == pytest.approx(5 * (T_F + T_B))


def test_heterogeneous_stage_costs_flow_shop_formula():
    # GPipe forward phase is a flow shop of M identical jobs: sum(t) + (M-1)*max(t); same for backward,
    # which starts on the last stage when its last forward ends and the other stages are already idle.
    f, b, M = [1.0, 3.0, 2.0], [2.0, 6.0, 4.0], 4
    t = simulate(gpipe(3, 1, M), f, b)
    assert t.makespan == pytest.approx(sum(f) + (M - 1) * max(f) + sum(b) + (M - 1) * max(b))
    with pytest.raises(ConfigError, match="one value per virtual stage"):
        simulate(gpipe(3, 1, M), [1.0, 2.0], b)
    with pytest.raises(ConfigError, match=">= 0"):
        simulate(gpipe(3, 1, M), -1.0, b)


def test_events_respect_rank_order_and_messages():
    for D, v, M, method in ((3, 1, 5, "1f1b"), (2, 2, 4, "1f1b"), (4, 2, 8, "async"), (3, 1, 4, "gpipe"),
                            (4, 2, 8, "zb-v")):
        s = build_schedule(method, D, v, M)
        c = 0.3
        t = simulate(s, [0.5 + 0.1 * i for i in range(D * v)], 1.1, t_p2p=c, t_step=0.2)
        by_rank = {r: [e for e in t.events if e.rank == r] for r in range(D)}
        end_of = {}
        for r, evs in by_rank.items():
            assert [e.op for e in evs] == s.ops[r]  # ops run in list order
            for prev, nxt in zip(evs, evs[1:]):
                assert nxt.start >= prev.end - 1e-12  # a rank runs one op at a time
            for e in evs:
                send = comm_of(e.op, r, D, v, s.placement)[1]
                if send:
                    end_of[send] = (e.end, r)
        for r, evs in by_rank.items():
            for e in evs:
                recv = comm_of(e.op, r, D, v, s.placement)[0]
                if recv:
                    sent, sender = end_of[(r, recv[1])]
                    # input arrived first: from another rank after the message, from this rank's own chunk at once
                    assert e.start >= sent + (c if sender != r else 0.0) - 1e-12
        assert t.makespan == pytest.approx(max(e.end for e in t.events))


def test_a_hand_off_within_one_rank_pays_no_transfer():
    """Issue 57: a send whose peer is the sending rank itself is no transfer (the executor keeps it in memory).
    Read off the op lists of every schedule: it happens at ZB-V's turn (2 per micro-batch at any D >= 2) and,
    at D = 1, between the chunks of any chunked schedule; nowhere else. The simulator charges t_p2p on every
    other send and nothing there: ZB-V at M = 1 crosses 2 (D - 1) rank boundaries each way, not 2D - 1."""
    from megatron_po.pipeline.schedules import SCHEDULES, ZB_SCHEDULES, check_schedule, execution_order
    found = set()
    for name in [*SCHEDULES, *ZB_SCHEDULES]:
        for D in (1, 2, 3, 4, 8):
            for v in (1, 2, 3):
                for M in (1, 2, 4, 8):
                    try:
                        s = build_schedule(name, D, v, M)
                    except (ConfigError, ValueError):
                        continue  # a (D, v, M) the schedule does not admit
                    sends = [(r, comm_of(s.ops[r][i], r, D, s.num_chunks, s.placement)[1])
                             for r, i in execution_order(s)]
                    local = sum(send is not None and send[0] == r for r, send in sends)
                    assert check_schedule(s).local_messages == local
                    if local:
                        found.add((s.name, D))
                        assert D == 1 or local == 2 * M, (s.name, D, v, M, local)
    assert {n for n, D in found if D > 1} == {"zb-v"}
    assert {n for n, D in found if D == 1} >= {"zb-v", "interleaved-1f1b", "gpipe"}
    for D in (1, 2, 4, 8):
        s = build_schedule("zb-v", D, 2, 1)
        grown = (simulate(s, 0.5, 0.5, 0.1, t_weight=0.5).makespan - simulate(s, 0.5, 0.5, 0.0, t_weight=0.5).makespan)
        assert grown == pytest.approx(4 * (D - 1) * 0.1), D
    # one stage split into chunks never communicates
    one = interleaved_one_f_one_b(1, 2, 4)
    assert simulate(one, T_F / 2, T_B / 2, t_p2p=9.0).makespan == pytest.approx(simulate(one, T_F / 2, T_B / 2).makespan)


def test_peak_activations_in_timeline():
    D, M = 4, 8
    t = simulate(one_f_one_b(D, 1, M), T_F, T_B)
    assert all(t.peak_activations[r] <= D - r for r in range(D))
    assert simulate(gpipe(D, 1, M), T_F, T_B).peak_activations == {r: M for r in range(D)}


def test_async_has_no_bubble_in_steady_state():
    # Throughput per micro-batch from the difference of two long runs (start-up and drain cancel):
    # exactly t_f + t_b, plus v*t_step/k when every chunk steps after every k backwards.
    for D, v, k, t_step in ((4, 1, 1, 0.0), (4, 2, 1, 0.0), (2, 2, 2, 0.0), (4, 1, 1, 0.5), (3, 2, 3, 0.6)):
        long = simulate(async_one_f_one_b(D, v, 120 * D, k), T_F / v, T_B / v, t_step=t_step)
        short = simulate(async_one_f_one_b(D, v, 60 * D, k), T_F / v, T_B / v, t_step=t_step)
        per_mb = (long.makespan - short.makespan) / (60 * D)
        assert per_mb == pytest.approx(T_F + T_B + v * t_step / k, abs=1e-9), (D, v, k, t_step)
    # with free steps the stream segment has the same makespan as the synchronous 1F1B order
    sync = simulate(one_f_one_b(4, 1, 12), T_F, T_B)
    assert simulate(async_one_f_one_b(4, 1, 12), T_F, T_B).makespan == pytest.approx(sync.makespan)


def test_table_and_plot(tmp_path):
    t = simulate(interleaved_one_f_one_b(2, 2, 4), T_F / 2, T_B / 2, t_step=0.1)
    text = t.table(events=True)
    assert "bubble" in text and "makespan" in text
    assert text.count("\n   0 ") >= 1 and "F3.1" in text
    png = tmp_path / "gantt.png"
    assert plot_timeline(t, str(png)) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # zero-cost steps and a single stage plot too
    plot_timeline(simulate(async_one_f_one_b(1, 1, 3), T_F, T_B), str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").exists()


def test_step_cost_is_busy_time():
    t = simulate(one_f_one_b(2, 1, 2), T_F, T_B, t_step=1.5)
    assert t.busy[0] == pytest.approx(2 * (T_F + T_B) + 1.5)
    (step,) = [e for e in t.events if e.rank == 0 and isinstance(e.op, Step)]
    assert step.end - step.start == pytest.approx(1.5) and step.end == pytest.approx(t.makespan)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_interleaved(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert simulate_schedule.main(["--pipeline-method", "1f1b", "--num-stages", "4", "--num-chunks", "2",
                                   "--num-microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "interleaved-1f1b: D=4 v=2 M=8" in out
    assert f"bubble {3 / 19:.4f}" in out  # (D-1)/(vM+D-1)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_async_prints_staleness(capsys):
    simulate_schedule.main(["--pipeline-method", "async", "--num-stages", "3", "--num-microbatches", "6"])
    out = capsys.readouterr().out
    assert "rank 0 chunk 0: max 2  0 1 2 2 2 2" in out
    assert "rank 2 chunk 0: max 0  0 0 0 0 0 0" in out


def test_cli_bad_input_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        simulate_schedule.main(["--pipeline-method", "async", "--num-stages", "4", "--num-chunks", "2",
                                "--num-microbatches", "6"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "M=6, D=4" in err and err.count("\n") == 1
