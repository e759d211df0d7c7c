"""The `fsdp` section of the GPU check (issue 55): the GPT of the check's size through pretrain_gpt.py
--use-torch-fsdp2 on the one GPU a lease has, against the same GPT under DDP (the `gpt` section, reused when this run
measured it). At DP 1 FSDP2 shards over one rank: nothing is gathered over a network, each unit's fp32 shard is
cast into its bf16 unsharded parameters when it runs (MixedPrecisionPolicy) and its gradients are reduced into the
fp32 shard; so this measures the cost of FSDP2's path on a GPU (the per-unit copies, hooks and prefetch, fp32
master weights without a separate main copy), not the memory that sharding over more ranks saves (a lease has one
GPU; the per-rank bytes at DP 1, 2, 4 are measured on CPUs: bench/memory/memory.py --fsdp,
bench/results/fsdp.md).

Full size: bench/gpu/gpu_worker.py's GPT (24 layers, hidden 2048), bf16, mock data, gpu_run.measure_ours: median ms
per iteration after the warm-up, tokens/s, MFU, peak memory; the ratios FSDP2 / DDP of ms per iteration and of peak
memory. Quick size (`--quick`, a CPU): the tiny GPT; its figures measure nothing, they run every path.

bench/gpu/gpu.py's check calls `section_fsdp(run)` (bench/gpu_check/gpu_budget.py's TABLE names it).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import markdown_table  # noqa: E402
from gpu_run import Run, Section, gib, measure_ours, num, pct  # noqa: E402


def section_fsdp(run: Run) -> Section:
    ddp = run.done["gpt"] if "gpt" in run.done else measure_ours(run, "fsdp_ddp", "", [])
    fsdp = measure_ours(run, "fsdp", "", ["--use-torch-fsdp2"])
    a, b = ddp.figures, fsdp.figures
    ratios = {"ms_fsdp_over_ddp": b["ms_per_iteration"] / a["ms_per_iteration"],
              "memory_fsdp_over_ddp": b["max_memory_bytes"] / a["max_memory_bytes"] if a["max_memory_bytes"] else None}
    rows = [[name, f"{f['ms_per_iteration']:.1f}", f"{f['tokens_per_s']:,.0f}", num(f["model_tflops"]), pct(f["mfu"]),
             gib(f["max_memory_bytes"])] for name, f in (("DDP (--bf16)", a), ("FSDP2 at DP 1 (--bf16 --use-torch-fsdp2)", b))]
    memory = "n/a" if ratios["memory_fsdp_over_ddp"] is None else f"{ratios['memory_fsdp_over_ddp']:.3f}"
    return Section("FSDP2 at DP 1 against DDP", [*([] if "gpt" in run.done else ddp.commands), *fsdp.commands],
                   {"ddp": a, "fsdp": b, "ratios": ratios}, [
        "One GPU: FSDP2 shards over DP 1 (its path's cost, not sharding's savings; per-rank bytes at DP 1, 2, 4: "
        "bench/results/fsdp.md). bf16 compute from fp32 shards (MixedPrecisionPolicy), fp32 gradient reduction; DDP: "
        f"bf16 weights with fp32 main params in the optimizer{' (section gpt of this run)' if 'gpt' in run.done else ''}. "
        f"FSDP2 / DDP: {ratios['ms_fsdp_over_ddp']:.3f}x ms per iteration, {memory}x peak memory.", "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "peak GiB"], rows)])
