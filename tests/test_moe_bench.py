"""The MoE benchmarks at their quick sizes (issue 48 item 9): what they count is exact, so it is asserted; their
timings are printed, never asserted.

- bench/step/moe_layer.py --quick: the alltoall dispatcher's token bytes per token and MoE layer, counted on a real
  EP = 2 run on gloo, equal hidden x top-k x 2 x bytes in the forward and again in the backward (fp32 and bf16),
  every call of both ranks seen; the expert parameter, gradient and Adam bytes of a rank at EP = 2 and 4 are
  1/EP of EP = 1's, exactly, the dense bytes unchanged; the grouped and looped experts give the same outputs
  (bitwise on the CPU) and every speed row is written with its ratio to the dense MLP.
- bench/gpu/gpu_moe.py --quick --eager-only (the GPU check's `moe` section, without the minutes inductor takes on
  a CPU): both variants train through pretrain_gpt.py, the same last loss, model FLOPs on the active parameters.
- the section is registered with the GPU check and planned before every other section no run has measured.
"""

import json
import os
import subprocess
import sys

from cuda_harness import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402,F401  (puts the bench family folders on sys.path)
import gpu_budget  # noqa: E402

ENV = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def run(script: str, *args: str, timeout: float = 600) -> None:
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_moe_layer_bench_counts_dispatcher_and_expert_bytes_exactly(tmp_path):
    out = tmp_path / "moe_layer.md"
    run("bench/step/moe_layer.py", "--quick", "--out", str(out))
    md, data = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert "Command: `python bench/step/moe_layer.py --quick" in md and "load average at start" in md
    figures = data["figures"]

    hidden = 32  # moe_layer.SIZES["quick"]["gpt"]
    for dtype, element in (("float32", 4), ("bfloat16", 2)):
        d = figures["dispatch"][dtype]
        assert d["arithmetic"] == hidden * 2 * 2 * element  # hidden x top-k x 2 directions x bytes
        for phase in ("forward", "backward"):
            assert d[phase] == d["arithmetic"], (dtype, phase, d)
            assert d[f"{phase}_calls"] == 2 * 2 * 2  # 2 ranks x 2 MoE layers x (dispatch, combine)
            assert 0 < d[f"{phase}_left_rank"] < d[phase]  # some rows stay on their rank, some leave it
        assert d["count_exchange_bytes"] == 8 * 8  # 8 experts' int64 counts
    assert md.count("| equal ") == 4 + 3 and "NOT EQUAL" not in md  # bytes per token (4 rows), EP = 1, 2, 4

    memory = {int(ep): f for ep, f in figures["memory"].items()}
    assert sorted(memory) == [1, 2, 4]
    for ep, f in memory.items():
        for key in ("params", "grads", "optimizer", "count"):
            assert f["expert"][key] * ep == memory[1]["expert"][key], (ep, key)
        assert f["dense"] == memory[1]["dense"]
        assert f["expert"]["optimizer"] == 2 * f["expert"]["params"]  # Adam: exp_avg and exp_avg_sq, fp32
        assert f["one_over_ep"]

    for dtype in ("float32", "bfloat16"):
        layer = figures["layer"][dtype]
        assert layer["grouped_vs_looped_max_diff"] == 0.0 and not layer["not_run"]
        assert all(layer[f"{v}_over_dense"] > 0 for v in ("looped", "grouped"))
    assert md.count("| MoE, looped  ") == 2 and md.count("| MoE, grouped ") == 2 and "target <= 1.5x" in md


def test_gpu_moe_section_runs_at_the_quick_size(tmp_path):
    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    out = tmp_path / "moe.md"
    run("bench/gpu/gpu_moe.py", "--quick", "--eager-only", "--out", str(out))
    md, data = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert "Quick size on cpu" in md and "--num-experts 8 --moe-router-topk 2" in md
    assert md.count("python pretrain_gpt.py") == 2 and md.count("--moe-grouped-gemm --metrics-file") == 1
    f = data["figures"]
    assert f["grouped"]["tokens_per_s"] > 0 and f["looped"]["tokens_per_s"] > 0 and not f["compiled"]
    assert f["loss"]["grouped"] == f["loss"]["looped"]  # the same numbers on the CPU, whichever way the GEMMs run
    assert f["active_parameters_millions"] < f["parameters_millions"]
    # model FLOPs on the active parameters: the formula at top-2, below the one over all 8 experts
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
             "--num-experts", "8", "--moe-ffn-hidden-size", "32"]
    per_iteration = 4 * 32  # global batch x sequence
    active = gpt_flops_per_token(parse_args(flags + ["--moe-router-topk", "2"]), 256) * per_iteration
    every_expert = gpt_flops_per_token(parse_args(flags + ["--moe-router-topk", "8"]), 256) * per_iteration
    assert f["grouped"]["flops_per_iteration"] == f["looped"]["flops_per_iteration"] == active < every_expert


def test_the_moe_section_is_registered_and_planned_first_among_the_unmeasured():
    import gpu
    import gpu_moe
    assert gpu.section_function("moe") is gpu_moe.section_moe and "moe" in gpu_budget.PLANNED
    assert gpu_budget.baselines("moe") == ["peak"]
    # the plan orders the never-measured sections by the table: moe before every other section no run measured
    # (gpu_plan's order), right after the sections the leases have measured already
    sections = gpu_budget.SECTION_ORDER
    assert sections.index("moe") < min(sections.index(s) for s in ("gpipe", "stream_compiled", "fp16",
                                                                    "stream_compiled_muon", "fp8"))
