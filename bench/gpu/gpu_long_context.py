"""The `long_context` section of the GPU check (issue 49): the GPT of the check's size at a long sequence, one GPU,
CP = 1 (context parallelism needs more GPUs than a lease has; its CPU figures: bench/memory/cp_memory.py).

Full size: GPT-1.3B (bench/gpu/gpu_worker.py's "full": 24 layers, hidden 2048, 16 heads) at 16,384 tokens per
sequence, micro-batch 1, global batch 4, bf16, mock data, through pretrain_gpt.py (gpu_run.Run.pretrain): the median
ms per iteration after the warm-up, tokens/s, model TFLOP/s and MFU against the measured bf16 peak (section `peak`),
each with the attention counted two ways: Megatron's convention (the full s x s square, what --log-throughput and
the other sections report) and the causal half (megatron_po/flops.py `causal=True`), the work a kernel that skips the
masked blocks does; at 16,384 tokens attention is about a third of the model FLOPs, so the two MFUs differ by that
much. An out-of-memory (CP = 1 "where it fits") is reported as the section's failure with its command.
Quick size (`--quick`, a CPU): the tiny GPT at 256 tokens; its figures measure nothing, they run every path.

bench/gpu/gpu.py's check calls `section_long_context(run)` (bench/gpu_check/gpu_budget.py's TABLE names it).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()

from bench_common import markdown_table  # noqa: E402
from gpu_run import Run, Section, gib, num, pct, peak_tflops  # noqa: E402
from gpu_worker import padded_vocab  # noqa: E402

SHAPE = {"full": {"seq": 16384, "micro_batch": 1, "global_batch": 4},
         "quick": {"seq": 256, "micro_batch": 1, "global_batch": 2},
         "small": {"seq": 1024, "micro_batch": 1, "global_batch": 2}}


def long_context_flags(run: Run) -> list[str]:
    """pretrain_gpt.py's flags: the size's GPT (gpu_worker.Size.gpt_flags) with the long shape in place of its own."""
    s, shape = run.size, SHAPE[run.size_name]
    at = {"--seq-length": shape["seq"], "--max-position-embeddings": shape["seq"],
          "--micro-batch-size": shape["micro_batch"], "--global-batch-size": shape["global_batch"]}
    flags = s.gpt_flags()
    for i, flag in enumerate(flags[:-1]):
        if flag in at:
            flags[i + 1] = str(at[flag])
    return flags + ["--bf16", "--train-iters", str(s.iterations), "--log-interval", "1", "--log-throughput",
                    "--eval-interval", str(10 * s.iterations), "--eval-iters", "1"]


def section_long_context(run: Run) -> Section:
    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    s, shape = run.size, SHAPE[run.size_name]
    flags = long_context_flags(run)
    records, command, _ = run.pretrain("long_context", flags)
    tokens = shape["global_batch"] * shape["seq"]
    timed = [r for r in records if "tokens_per_sec" in r][s.warmup:]
    times = sorted(tokens / r["tokens_per_sec"] * 1e3 for r in timed)
    ms = times[len(times) // 2]
    cfg, vocab, peak = parse_args(flags), padded_vocab(s), peak_tflops(run)
    figures = {"seq_length": shape["seq"], "micro_batch": shape["micro_batch"], "global_batch": shape["global_batch"],
               "ms_per_iteration": ms, "tokens_per_s": tokens / ms * 1e3, "iterations_timed": len(times),
               "max_memory_bytes": records[-1].get("max_memory_gb", 0.0) * 2**30, "peak_tflops": peak}
    rows = []
    for name, causal in (("megatron", False), ("causal", True)):
        flops = gpt_flops_per_token(cfg, vocab, causal=causal) * tokens
        tflops = flops / ms * 1e3 / 1e12
        figures[name] = {"flops_per_iteration": flops, "model_tflops": tflops, "mfu": tflops / peak if peak else None}
        rows.append([{"megatron": "full s x s square (Megatron's convention)", "causal": "causal half"}[name],
                     num(flops / 1e12), num(tflops), pct(figures[name]["mfu"])])
    full, causal = gpt_flops_per_token(cfg, vocab), gpt_flops_per_token(cfg, vocab, causal=True)
    figures["attention_share_causal"] = (full - causal) / causal  # causal attention (half the square) / the causal total
    return Section(f"Long context: {shape['seq']:,} tokens per sequence, CP = 1", [command], figures, [
        f"GPT of this size ({s.layers} layers, hidden {s.hidden}) at {shape['micro_batch']} x {shape['seq']:,} tokens "
        f"per micro-batch, global batch {shape['global_batch']}, bf16; median of the {len(times)} iterations after "
        f"{s.warmup} warm-up: **{ms:.1f} ms per iteration, {figures['tokens_per_s']:,.0f} tokens/s**, peak memory "
        f"{gib(figures['max_memory_bytes'])} GiB. Causal attention is "
        f"{100 * figures['attention_share_causal']:.1f} % of the causal count.", "",
        markdown_table(["attention counted", "TFLOP / iteration", "model TFLOP/s", "MFU"], rows)])
