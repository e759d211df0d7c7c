"""bench/schedules/simulator_check.py at its --quick size (D=4, M=2, 5 ms ops): it runs the executor and the
simulator on the same op lists, and writes a results file whose simulated column is the simulator's (checked
here against closed forms) and whose measured column is a real measurement beside it."""

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
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                                          if line.startswith("| ") and not line.startswith("| schedule"))}
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
