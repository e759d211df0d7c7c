"""bench/step/muon_step.py at its --quick size: it runs, writes its results file with every variant as a ratio to
AdamW's step of the same run, and its GPU entry points work on the CPU."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import muon_step  # noqa: E402


def test_quick_bench_writes_ratios_to_adamw(tmp_path):
    out = tmp_path / "muon_step.md"
    assert muon_step.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `python bench/step/muon_step.py --quick" in text and "load average at start" in text
    for row in ("| AdamW ", "| Muon fp32 ", "| Muon bf16 ", "| Muon bf16 (distributed optimizer) "):
        assert row in text, row
    ratios = [line.split("|")[6].strip() for line in text.splitlines() if line.startswith("| AdamW")]
    assert ratios == ["1.00x"] * 3  # DP=1, DP=2 plain, DP=2 distributed: each Muon row is read against these
    assert "all-to-all, all-to-all" in text and "| plain optimizer       | Muon bf16 | all-gather " in text


def test_gpu_entry_points_run_on_cpu():
    times = muon_step.layer_newton_schulz_ms(hidden=16, ffn=64, device="cpu", reps=1, precisions=("highest", "medium"))
    assert set(times) == {(p, b) for p in ("highest", "medium") for b in ("unbatched", "batched")}
    assert all(t > 0 for t in times.values())


def test_newton_schulz_variants_against_the_default(tmp_path):
    """--newton-schulz-variants (issue 44) at a small hidden size: every variant in both tables, the default's
    distance to itself 0, the Gram iteration the default's to 1e-3 in fp32, fewer steps farther from U·Vᵀ."""
    out = tmp_path / "v.md"
    assert muon_step.main(["--newton-schulz-variants", "--hidden", "32", "--bf16-hidden", "16", "--out",
                           str(out)]) == 0
    text = out.read_text()
    assert "Command: `python bench/step/muon_step.py --newton-schulz-variants --hidden 32" in text
    for name, *_ in muon_step.NS_VARIANTS:
        assert text.count(f"| {name} ") == 2, name
    rows = {r["variant"]: r for r in muon_step.newton_schulz_variants(32)}
    default, gram = rows["default: simple, 5 steps"], rows["Gram, simple, 5 steps"]
    assert default["vs_default"] == 0 and gram["vs_default"] < 1e-3 and gram["gflops"] < default["gflops"]
    assert rows["simple, 4 steps"]["polar"] > default["polar"] > rows["polar_express, 8 steps"]["polar"]
    assert "Same result, to a stated tolerance" in text
