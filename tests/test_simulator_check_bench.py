"""bench/schedules/simulator_check.py at its --quick size (D=4, M=2, 5 ms ops): it runs the executor and the
simulator on the same op lists, and writes a results file whose simulated column is the simulator's (checked
here against closed forms) and whose measured column is a real measurement beside it; then `--schedules zb-v`
into the same file (that schedule's row replaced, the others kept with the run they came from)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "schedules"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import simulator_check  # noqa: E402


def test_quick_check_writes_every_schedule_against_the_simulator(tmp_path):
    out = tmp_path / "simulator_check.md"
    assert simulator_check.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `python bench/schedules/simulator_check.py --quick" in text
    assert "load average at start" in text and ", commit " in text and "Load average (1 min)" in text
    rows = {cells[0]: cells for cells in simulator_check.table_rows(text.splitlines())}
    labels = [label for label, _, _ in simulator_check.SYNC_ROWS] + ["async PipeOptim k=1",
                                                                        "async PipeOptim k=2 (k = M at M=2)"]
    assert sorted(rows) == sorted(labels)
    t, t_step, D, M = 5.0, 2.0, 4, 2  # ms, the --quick settings
    # 1F1B: (M + D - 1) fused micro-batch slots plus one step; the stream: t_F + t_B + t_W + t_step / k per mb
    assert float(rows["1f1b"][3]) == (M + D - 1) * 3 * t + t_step
    assert float(rows["async PipeOptim k=1"][3]) == 3 * t + t_step
    assert float(rows["async PipeOptim k=2 (k = M at M=2)"][3]) == 3 * t + t_step / 2
    for cells in rows.values():
        sim, measured = float(cells[3]), float(cells[4])
        ratio = float(cells[5].split()[0])
        assert abs(ratio - measured / sim) < 2e-3
        assert ratio > 0.9  # a real run of the same untrimmed ops: each takes at least its nominal time
        assert ("outside 3 %" in cells[5]) == (abs(ratio - 1) > 0.03)
        assert 0 < float(cells[6]) <= ratio  # the best repetition / sim (one repetition here: equal)
        assert float(cells[9]) > 0  # measured / the simulator at the costs the ops took in the run
    # --schedules zb-v: that schedule run again, its row in place of the file's, the others kept with their run
    before = text
    assert simulator_check.main(["--quick", "--schedules", "zb-v", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `python bench/schedules/simulator_check.py --quick --schedules zb-v" in text
    tables = simulator_check.table_rows(text.splitlines())
    merged = {cells[0]: cells for cells in tables if len(cells) == 12}
    assert sorted(merged) == sorted(labels)
    earlier, this = simulator_check.run_of(before.splitlines())[0], simulator_check.run_of(text.splitlines())[0]
    for label, cells in merged.items():
        assert cells[-1] == (this if label.startswith("zb-v") else earlier)
        if not label.startswith("zb-v"):
            assert cells[:-1] == rows[label]  # kept as measured and priced
    assert f"- run `{earlier}`: `python bench/schedules/simulator_check.py --quick --out " in text
    replaced = [cells for cells in tables if len(cells) == 8]
    zbv = rows["zb-v (2 chunks, V)"]
    assert [cells[:5] for cells in replaced] == [["zb-v (2 chunks, V)", "2", "-", earlier, zbv[4]]]
    # re-priced from the costs the earlier run printed, by the same simulator: its own figure, to rounding
    assert replaced[0][5] == zbv[7] and abs(float(replaced[0][6]) - float(replaced[0][5])) <= 1e-3
    assert replaced[0][7] == zbv[9]  # `sim run` as that run printed it
    # into the merged file again (no run: its own row as the new one): the row the last run added is replaced,
    # re-priced from the costs that run printed, and both earlier runs are listed
    settings = next(line for line in text.splitlines() if line.startswith("D=")).split(" Async:")[0]
    again, runs, lines = simulator_check.merged(str(out), [merged["zb-v (2 chunks, V)"][:-1]], "later", ["zb-v"],
                                                settings)
    assert [row[-1] for row in again] == ["later" if row[0].startswith("zb-v") else earlier for row in again]
    assert [run.split("`")[1] for run in runs] == [this, earlier]
    repriced = [cells for cells in simulator_check.table_rows("\n".join(lines).splitlines()) if len(cells) == 8]
    assert [cells[3] for cells in repriced] == [this] and repriced[0][5] == merged["zb-v (2 chunks, V)"][7]


def test_a_hand_off_within_one_rank_costs_no_message_cpu():
    """Issue 57: `sim cal` and `sim run` charge a message's send call and receive (and the time posting it)
    only where it crosses two ranks: not at ZB-V's turn, where the executor keeps the tensor in memory."""
    from megatron_po.pipeline.schedules import build_schedule
    D, t, send, recv, extra = 4, 1.0, 0.5, 0.25, 0.125
    rank_costs = lambda rank: (t, t, t, extra)  # noqa: E731
    f, b, w = simulator_check.stage_costs(build_schedule("zb-v", D, 2, 4), rank_costs, (9.0, send, recv))
    for vs in range(2 * D):
        gets, sends = vs > 0 and vs != D, vs < 2 * D - 1 and vs != D - 1  # D - 1 -> D: the turn on rank D - 1
        assert f[vs] == t + (recv + extra if gets else 0) + (send if sends else 0), vs
        assert b[vs] == t + (recv + extra if sends else 0) + (send if gets else 0), vs
    assert w == [t] * 2 * D
    f, b, _ = simulator_check.stage_costs(build_schedule("1f1b", D, 2, 4), rank_costs, (9.0, send, recv))
    assert f[1:-1] == [t + recv + extra + send] * (2 * D - 2)  # interleaved: every boundary crosses two ranks
    # the time posting receives ahead is per received message: rank D - 1 receives 2 of its 4 ops' inputs per
    # micro-batch from another rank (F of chunk 0, B of chunk 1), the turn's 2 from itself
    assert simulator_check.op_counts(build_schedule("zb-v", D, 2, 4), D - 1)["P"] == 2 * 4
