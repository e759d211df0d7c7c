"""The `long_context` section of the GPU check (issue 49): the GPT of the check's size at a long sequence, one GPU,
CP = 1 (context parallelism needs more GPUs than a lease has; its CPU figures:
bench/memory/memory.py --context-parallel).

Full size: GPT-1.3B (bench/gpu/gpu_worker.py's "full": 24 layers, hidden 2048, 16 heads) at 16,384 tokens per
sequence, micro-batch 1, global batch 4, bf16, mock data, through pretrain_gpt.py (gpu_run.measure_ours): the median
ms per iteration after the warm-up, tokens/s, model TFLOP/s and MFU against the measured bf16 peak (section `peak`),
each with the attention counted two ways: Megatron's convention (the full s x s square, what --log-throughput and
the other sections report) and the causal half (megatron_po/flops.py `causal=True`), the work a kernel that skips the
masked blocks does; at 16,384 tokens attention is about a third of the model FLOPs, so the two MFUs differ by that
much. An out-of-memory (CP = 1 "where it fits") is reported as the section's failure with its command.
Quick size (`--quick`, a CPU): the tiny GPT at 256 tokens; its figures measure nothing, they run every path.

bench/gpu/gpu.py's check calls `section_long_context(run)` (bench/gpu_check/gpu_budget.py's TABLE names it).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import markdown_table  # noqa: E402
from gpu_run import Run, Section, gib, measure_ours, num, pct, peak_tflops  # noqa: E402
from gpu_worker import padded_vocab  # noqa: E402

SHAPE = {"full": {"seq": 16384, "micro_batch": 1, "global_batch": 4},
         "quick": {"seq": 256, "micro_batch": 1, "global_batch": 2},
         "small": {"seq": 1024, "micro_batch": 1, "global_batch": 2}}


def section_long_context(run: Run) -> Section:
    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    shape = SHAPE[run.size_name]
    s = dataclasses.replace(run.size, **shape)  # the size's GPT (gpu_worker.Size) with the long shape
    measured = measure_ours(run, "long_context", "", [], size=s)
    ours = measured.figures
    tokens, ms = s.global_batch * s.seq, ours["ms_per_iteration"]
    cfg, vocab, peak = parse_args(s.gpt_flags()), padded_vocab(s), peak_tflops(run)
    figures = {"seq_length": s.seq, "micro_batch": s.micro_batch, "global_batch": s.global_batch,
               "ms_per_iteration": ms, "peak_tflops": peak,
               **{k: ours[k] for k in ("tokens_per_s", "iterations_timed", "max_memory_bytes")}}
    rows = []
    for name, causal in (("megatron", False), ("causal", True)):
        flops = gpt_flops_per_token(cfg, vocab, causal=causal) * tokens
        tflops = flops / ms * 1e3 / 1e12
        figures[name] = {"flops_per_iteration": flops, "model_tflops": tflops, "mfu": tflops / peak if peak else None}
        rows.append([{"megatron": "full s x s square (Megatron's convention)", "causal": "causal half"}[name],
                     num(flops / 1e12), num(tflops), pct(figures[name]["mfu"])])
    full, causal = gpt_flops_per_token(cfg, vocab), gpt_flops_per_token(cfg, vocab, causal=True)
    figures["attention_share_causal"] = (full - causal) / causal  # causal attention (half the square) / causal total
    return Section(f"Long context: {s.seq:,} tokens per sequence, CP = 1", measured.commands, figures, [
        f"GPT of this size ({s.layers} layers, hidden {s.hidden}) at {s.micro_batch} x {s.seq:,} tokens "
        f"per micro-batch, global batch {s.global_batch}, bf16; median of the {ours['iterations_timed']} iterations "
        f"after {s.warmup} warm-up: **{ms:.1f} ms per iteration, {figures['tokens_per_s']:,.0f} tokens/s**, peak "
        f"memory {gib(figures['max_memory_bytes'])} GiB. Causal attention is "
        f"{100 * figures['attention_share_causal']:.1f} % of the causal count.", "",
        markdown_table(["attention counted", "TFLOP / iteration", "model TFLOP/s", "MFU"], rows)])
