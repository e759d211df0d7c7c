"""bench/step/mla_layer.py at its quick size (issue 54 item 10): the FLOP counts and the bytes are deterministic, so
they are asserted; the timings are printed, never asserted.

MHA's head dimension is the even one whose FLOPs come closest to MLA's (within 10 % at the quick size), every
variant ran in fp32 and bf16 with its ratio to MHA written, and MLA's core through the fused kernel keeps less for
the backward than through the math kernel (which keeps the [b, heads, s, s] probabilities).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402,F401  (puts the bench family folders on sys.path)
import mla_layer  # noqa: E402


def test_mla_layer_bench_quick(tmp_path):
    out = tmp_path / "mla_layer.md"
    assert mla_layer.main(["--quick", "--out", str(out)]) == 0  # in this process: its imports are already here
    md, data = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert "Command: `python bench/step/mla_layer.py --quick" in md and "load average at start" in md
    figures = data["figures"]
    flops = figures["flops_per_token"]
    assert abs(flops["MHA"] / flops["MLA"] - 1) < 0.1 and figures["mha_head_dim"] % 2 == 0
    for dtype in ("float32", "bfloat16"):
        rows = figures["dtypes"][dtype]
        assert set(rows) == {"MHA", "MLA", "MLA, math kernel"}
        assert rows["MLA"]["kept_bytes"] < rows["MLA, math kernel"]["kept_bytes"]
        assert all(r["cpu_median"] > 0 and r["kept_bytes"] > 0 for r in rows.values())
    assert md.count("| MLA, math kernel ") == 2
