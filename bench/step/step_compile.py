"""The compiled optimizer step's first compilation (--torch-compile): one graph per param group, or slices.

On an H100 GPT-1.3B's compiled step took ~100 s to compile (bench/results/gpu_nvidia_h100_80gb_hbm3_2026-11-27,
`compiled`: iteration 2, the step's first compiled one, took 110 s): one graph per param group held all of the
group's tensors (99 and 194), and inductor's lowering, fusion and scheduling grow with that count, faster than
linearly. The step now compiles a slice of STEP_SLICE parameters at a time, the slices alike (a model's repeating
layers) sharing one graph (megatron_po/optim/fused_prediction.py, `_slices`).

For a GPT of each --layers (hidden --hidden, GPT-1.3B's 12 tensors a layer in Megatron's two groups), bf16
weights and fp32 main params (MixedPrecisionOptimizer), AdamW, as `pretrain_gpt.py --bf16 --torch-compile`
builds them, this times the second step (the first runs eagerly and creates the state; the second compiles)
and counts the graphs and the kernels inductor made, for

  whole group   STEP_SLICE past every group's size: the code before the slices
  slices        STEP_SLICE as it is

in one fresh process per depth, with an empty inductor cache (the C++ compiled for the CPU is kept on disk
otherwise), after a small warm-up compilation (imports, the compiler's setup); then the steady step's time
in that process, the two alternated step by step, with the ratio: what the slices' extra calls cost. Both
end with the same weights (checked: bitwise). On a CPU inductor compiles C++; on a GPU Triton kernels, in
parallel worker processes, where the Python work per graph node (lowering, fusion, scheduling) is the same.

    python bench/step/step_compile.py [--layers 2,6,12,24] [--hidden 64] [--steps 100] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

MODES = {"whole group": 10**9, "slices": None}  # STEP_SLICE per mode (None: as it is)


def measure(layers: int, hidden: int, steps: int) -> dict:
    """{mode: {"compile_s", "graphs", "kernels", "step_ms"}} and "tensors", "max_weight_diff" (see the docstring)."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    from megatron_po.config import ModelConfig
    from megatron_po.models.gpt import GPTModel
    from megatron_po.optim import build_optimizer, fused_prediction, param_groups
    from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer

    torch.compile(lambda x: x * 2 + 1)(torch.ones(4))  # warm-up: imports and the C++ compiler's setup
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, seq_length=32,
                      untie_embeddings_and_output_weights=True)
    runs = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPTModel(cfg, 256, 0).to(torch.bfloat16)
        runs[mode] = (model, MixedPrecisionOptimizer(
            lambda groups: build_optimizer("adamw", groups, lr=1e-4, weight_decay=0.1, compile_step=True),
            param_groups([model], 0.1)))
    slice_as_is = fused_prediction.STEP_SLICE

    def step(mode: str, t: int) -> float:
        model, opt = runs[mode]
        gen = torch.Generator().manual_seed(t)
        for p in model.parameters():
            p.grad = (1e-3 * torch.randn(p.shape, generator=gen)).to(p.dtype)
        opt.param_groups[0]["lr"] = 1e-4 * (1 + t % 3)  # an input of the graph: no recompilation
        fused_prediction.STEP_SLICE = MODES[mode] or slice_as_is
        try:
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start
        finally:
            fused_prediction.STEP_SLICE = slice_as_is

    out = {"tensors": sum(1 for _ in runs["slices"][0].parameters())}
    for mode in MODES:
        step(mode, 0)  # eager: creates the state
        counters.clear()
        metrics.reset()
        out[mode] = {"compile_s": step(mode, 1), "graphs": counters["stats"]["unique_graphs"],
                     "kernels": metrics.generated_kernel_count}
    times = {mode: [] for mode in MODES}
    for t in range(2, 2 + steps):
        for mode in list(MODES)[::1 if t % 2 else -1]:
            times[mode].append(step(mode, t))
    for mode in MODES:
        out[mode]["step_ms"] = 1e3 * statistics.median(times[mode])
    weights = [[p.float() for p in runs[mode][0].parameters()] for mode in MODES]
    out["max_weight_diff"] = max(float((a - b).abs().max()) for a, b in zip(*weights))
    return out


def run_worker(layers: int, hidden: int, steps: int) -> dict:
    """`measure` in a fresh process with an empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--layers", str(layers),
                               "--hidden", str(hidden), "--steps", str(steps)],
                              env=env, capture_output=True, text=True, timeout=3600)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"step_compile worker (layers {layers}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(results[-1][len("RESULT "):])


def main(argv=None) -> None:
    ap = bench_common.parser(__doc__)
    ap.add_argument("--layers", default="2,6,12,24", help="comma-separated depths")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100, help="steady steps of each mode, alternated")
    ap.add_argument("--quick", action="store_true", help="depths 1 and 2, 10 steady steps (the CPU test)")
    ap.add_argument("--out", help="also write the report to this markdown file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # run_worker's process
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.steps = "1,2", 10
    depths = [int(x) for x in args.layers.split(",")]
    if args.worker:
        import torch
        torch.set_num_threads(1)
        print("RESULT " + json.dumps(measure(depths[0], args.hidden, args.steps)), flush=True)
        return
    started = time.perf_counter()
    lines = bench_common.Lines(bench_common.header(__file__, argv, "The compiled optimizer step's first compilation: one "
                                                   "graph per param group against slices (bench/step/step_compile.py)"))
    from megatron_po.optim.fused_prediction import STEP_SLICE
    lines.emit(f"GPT of hidden {args.hidden}, bf16 weights, fp32 main params, AdamW, two param groups; CPU, one "
               f"thread for the steps (inductor's compile workers as configured). STEP_SLICE = {STEP_SLICE}. "
               f"Compile: the second step's seconds; steady: median ms of {args.steps} steps, the modes alternated.")
    lines.emit()
    rows = []
    for layers in depths:
        r = run_worker(layers, args.hidden, args.steps)
        whole, sliced = r["whole group"], r["slices"]
        rows.append([layers, r["tensors"], f"{whole['compile_s']:.1f}", whole["graphs"], whole["kernels"],
                     f"{sliced['compile_s']:.1f}", sliced["graphs"], sliced["kernels"],
                     f"{sliced['compile_s'] / whole['compile_s']:.2f}", f"{whole['step_ms']:.2f}",
                     f"{sliced['step_ms']:.2f}", f"{sliced['step_ms'] / whole['step_ms']:.3f}",
                     f"{r['max_weight_diff']:.0e}"])
        print(f"  layers {layers}: {rows[-1]}", flush=True)
    lines.emit(bench_common.markdown_table(
        ["layers", "tensors", "whole: compile s", "graphs", "kernels", "slices: compile s", "graphs", "kernels",
         "compile ratio", "whole: step ms", "slices: step ms", "step ratio", "weights differ by"], rows))
    lines.emit()
    lines.emit(bench_common.load_at_end(started))
    if args.out:
        lines.write(args.out)


if __name__ == "__main__":
    main()
