"""The `moe` section of the GPU check (issue 48): an MoE GPT of about 1.3 B parameters, 8 experts top-2, compiled,
through pretrain_gpt.py: tokens/s and MFU on its active parameters, the experts as one grouped GEMM
(--moe-grouped-gemm) against the loop over the experts, in the same run. Writes bench/results/gpu_moe_<device>[_quick]
.md and a .json beside it.

    python bench/gpu/gpu_moe.py                               # the 1.3 B MoE GPT, on a GPU
    python bench/gpu/gpu_moe.py --quick --out x.md            # a tiny MoE GPT on a CPU: every path, compiled
    python bench/gpu/gpu_moe.py --quick --eager-only          # without --torch-compile (tests/test_moe_bench.py)

The model ("full"): 18 layers, hidden 1024, 16 heads, seq 2048, micro-batch 4, global batch 16, vocab 50257, bf16,
mock data, dropout 0 (bench/gpu/gpu_worker.py's "full" run at this shape); every layer an MoE of 8 experts of 4096
(GELU), top-2, dropless, softmax router with the load-balancing loss at 1e-2: 1.34 B parameters, 0.43 B of them
active per token. Measured, each in a fresh process: the bf16 matmul peak (MFU's denominator; gpu.py's section peak
when it ran), then ours with --torch-compile, the experts grouped and looped (gpu_run.measure_ours: the median ms
per iteration after the warm-up, tokens/s, model TFLOP/s on the active parameters (megatron_po/flops.py), MFU). The
last iteration's loss of the two is compared (the same numbers up to the GEMMs' rounding).

bench/gpu/gpu.py's check calls `section_moe(run)` (bench/gpu_check/gpu_budget.py's TABLE: `moe`). This module
imports nothing from gpu.py, so that gpu.py can import it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import markdown_table  # noqa: E402
from gpu_run import (Run, Section, failed_lines, gib, measure_ours, measure_peak, num, pct,  # noqa: E402
                     section_alone)

EXPERTS, TOPK = 8, 2
# The model per size: (layers, hidden, heads, expert ffn); the run lengths, batch, sequence and vocab are the size's.
SHAPES = {"full": (18, 1024, 16, 4096), "small": (2, 128, 4, 256), "quick": (2, 32, 2, 32)}


def moe_size(run: Run):
    """gpu_worker's Size of this run with the MoE model's shape."""
    layers, hidden, heads, _ = SHAPES[run.size_name]
    return dataclasses.replace(run.size, layers=layers, hidden=hidden, heads=heads)


def moe_flags(run: Run) -> tuple[str, ...]:
    """The flags that make the GPT an MoE (they change its FLOPs: gpu_run.measure_ours's `model_flags`)."""
    ffn = SHAPES[run.size_name][3]
    return ("--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", str(ffn),
            "--moe-aux-loss-coeff", "1e-2")


def active_parameters(run: Run, total_millions: float | None) -> float | None:
    """Millions of parameters a token runs through: all, less the (E - k) experts of each MoE layer it skips
    (GELU experts: fc1 [f, h] + bias f, fc2 [h, f] + bias h)."""
    if total_millions is None:
        return None
    layers, hidden, _, ffn = SHAPES[run.size_name]
    per_expert = 2 * hidden * ffn + ffn + hidden
    return total_millions - layers * (EXPERTS - TOPK) * per_expert / 1e6


# (key, row, label, flags) of ours
VARIANTS = [("grouped", "experts as one grouped GEMM (--moe-grouped-gemm)", "moe_grouped", ["--moe-grouped-gemm"]),
            ("looped", "experts as a loop", "moe_looped", [])]


def section_moe(run: Run, compiled: bool = True) -> Section:
    """The section; `compiled=False` (--eager-only) runs both variants without --torch-compile (a CPU test has not
    the minutes inductor takes there)."""
    measure_peak(run)
    size, flags = moe_size(run), moe_flags(run)
    compile_flags = ["--torch-compile"] if compiled else []
    measured, losses, commands, errors = {}, {}, [], []
    for key, _, label, extra in VARIANTS:
        try:
            section = measure_ours(run, label, "", compile_flags + extra, size=size, model_flags=flags)
        except RuntimeError as e:  # one failing variant (an out-of-memory, a compile error) leaves the other
            errors.append((f"{label}: pretrain_gpt.py {' '.join(flags + tuple(compile_flags + extra))}", str(e)))
            continue
        measured[key], losses[key] = section.figures, section.figures["last_lm_loss"]
        commands += section.commands
        run.figure(f"{key}: tokens_per_s", section.figures["tokens_per_s"])
    total = next((f["parameters_millions"] for f in measured.values() if f.get("parameters_millions")), None)
    figures = {**measured, "loss": losses, "parameters_millions": total,
               "active_parameters_millions": active_parameters(run, total), "compiled": compiled}
    if len(measured) == 2:
        figures["grouped_over_looped_tokens_per_s"] = measured["grouped"]["tokens_per_s"] / measured["looped"]["tokens_per_s"]
        figures["loss_delta"] = abs(losses["grouped"] - losses["looped"])
    rows = [[name, f"{measured[key]['ms_per_iteration']:.1f}", f"{measured[key]['tokens_per_s']:,.0f}",
             num(measured[key]["model_tflops"]), pct(measured[key]["mfu"]), gib(measured[key]["max_memory_bytes"]),
             f"{losses[key]:.4f}"] for key, name, *_ in VARIANTS if key in measured]
    layers, hidden, heads, ffn = SHAPES[run.size_name]
    active = figures["active_parameters_millions"]
    ratio = figures.get("grouped_over_looped_tokens_per_s")
    return Section(f"MoE GPT, {EXPERTS} experts top-{TOPK}: grouped GEMM against the loop"
                   + (", --torch-compile" if compiled else ", eager"), commands, figures, [
        f"{layers} layers, hidden {hidden}, {heads} heads, every layer an MoE of {EXPERTS} experts of {ffn} (GELU), "
        f"top-{TOPK}, dropless, load-balancing loss 1e-2; {num(total) if total else 'n/a'} M parameters, "
        f"{num(active) if active else 'n/a'} M active per token. Model TFLOP/s and MFU count the active parameters "
        "(router, top-k experts: megatron_po/flops.py, docs/tracking.md); MFU against the bf16 peak (section peak). "
        + (f"Grouped / looped: **{ratio:.3f}x** tokens/s; last loss |difference| {figures['loss_delta']:.2g}."
           if ratio else "Grouped / looped: not measured (a variant failed)."), "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "peak GiB", "last loss"], rows),
        *failed_lines(errors)])


def main(argv=None) -> int:
    return section_alone(sys.argv[1:] if argv is None else argv, __file__, __doc__, "MoE GPT", section_moe,
                         "a tiny model", moe_size)

if __name__ == "__main__":
    sys.exit(main())
