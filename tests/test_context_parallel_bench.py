"""The context-parallel benchmarks run at their quick sizes (issue 49 item 5): figures are the bench's to report
(bench/results/context_parallel.md), these check that the code paths run and that what is exact holds exactly.

- bench/memory/memory.py --context-parallel --quick (1,024 tokens, CP = 1, 2, 4 on forked gloo ranks): the ring's
  bytes counted at its isend calls equal the arithmetic on every rank; the activations a rank keeps for its
  backward are at most 1/CP of CP = 1's plus the ring's stated buffers (measured 0.516 and 0.263 of CP = 1);
- the GPU check's long_context section at its quick size (bench/gpu/gpu_long_context.py, a tiny GPT on the CPU):
  tokens/s and MFU with the attention counted as Megatron does and over its causal half.
"""

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402,F401  (puts the bench family folders on sys.path)
import memory  # noqa: E402


def test_context_parallel_memory_bench_quick(tmp_path):
    out = tmp_path / "cp.md"
    results = memory.context_parallel_main(argparse.Namespace(quick=True, seq=8192, reps=1, out=str(out)))
    base = results[1][0]
    for cp, ranks in results.items():
        assert len(ranks) == cp
        arithmetic = memory.cp_ring_bytes(memory.ModelConfig(seq_length=1024, **memory.CP_MODEL), cp)
        assert all(r["sent"] == arithmetic["sent"] for r in ranks), (cp, [r["sent"] for r in ranks], arithmetic)
        assert (arithmetic["sent"] > 0) == (cp > 1)
        assert all(r["kept"] <= base["kept"] / cp + arithmetic["buffers"] for r in ranks), cp
        assert all(r["cpu_seconds"] > 0 and r["seconds"] > 0 for r in ranks)
    md = out.read_text()
    assert "Command: `python bench/memory/memory.py --context-parallel --quick" in md
    assert md.count("| equal |") == 3 and "DIFFER" not in md


def test_long_context_gpu_section_quick(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, "bench/gpu/gpu.py", "--quick", "--only", "peak", "long_context", "targets",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    figures = data["sections"]["long_context"]["figures"]
    assert figures["seq_length"] == 256 and figures["tokens_per_s"] > 0
    megatron, causal = figures["megatron"], figures["causal"]
    assert causal["flops_per_iteration"] < megatron["flops_per_iteration"]
    assert causal["mfu"] == pytest.approx(causal["model_tflops"] / figures["peak_tflops"])
    assert 0 < figures["attention_share_causal"] < 1
    command = data["sections"]["long_context"]["commands"][0]
    assert command.count("--seq-length 256") == 1 and "--seq-length 32" not in command
