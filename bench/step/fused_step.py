"""The optimizer step fused with PipeOptim's prediction (issue 30): bytes moved, step time, stream time.

A pipeline stage's work per micro-batch at k = 1 besides its forward and backward: the optimizer step
and, for PipeOptim, the prediction Ŵ = W − s·lr·ΔW of the next forward's weights and the restore after
that forward. Three variants, on the same parameters and gradients (AdamW, one stage-like set of
matrices; bf16 = bf16 model weights and gradients, fp32 main params in MixedPrecisionOptimizer):

  naive     the step alone (async-naive: no prediction)
  separate  the path before issue 30: the step keeps its factored ΔW (`keep_direction`), the prediction
            runs right before the forward (fp32: `predicted` + pointer swap; bf16: `predict_model_params`
            into the model weights) and the restore after it (bf16: the main -> model copy)
  fused     the step writes Ŵ (`PredictionRequest`, optim/fused_prediction.py); pointer swap and back

1. Bytes per parameter read + written per micro-batch, counted op by op in eager execution
   (`optim/memory.count_bytes_moved`), next to the figure of one compiled pass (the CUDA path: inductor
   fuses the step's and the prediction's foreach ops, so each tensor is read and written once): AdamW
   reads W, g, m, v and writes W, m, v (+ the bf16 live weights), and the fused prediction adds only the
   write of Ŵ (4 B/param fp32, 2 B/param bf16).
2. Time per micro-batch of those variants on this machine (alternated rep by rep, median).
3. The asynchronous stream's time per micro-batch in the emulator (D = 4, tiny GPT, fp32, AdamW):
   async-naive, PipeOptim fused, PipeOptim separate (`fuse_prediction = False`), alternated segment by
   segment, median; every step eager, then every step compiled; the machine's load recorded before and
   after. (Times 2 and 3 use inductor's CPU code for "compiled"; a CPU pays for each fresh Ŵ tensor in
   page faults, which a GPU's caching allocator does not.)

On a GPU, bench/gpu/gpu.py calls `time_step_variants(device)` (one 302 M-parameter stage by default, eager
and compiled; returns the table rows).

    python bench/step/fused_step.py [--quick] [--reps 7] [--out bench/results/fused_step.md]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402

from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.optim import build_optimizer  # noqa: E402
from megatron_po.optim.fused_prediction import PredictionRequest  # noqa: E402
from megatron_po.optim.memory import count_bytes_moved  # noqa: E402
from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer  # noqa: E402
from megatron_po.pipeline.async_pipeline import AsyncEmulator  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed  # noqa: E402

VARIANTS = ("naive", "separate", "fused")
S = 3.0  # the prediction's staleness (stage 0 of D = 4)
COLS = 2048  # the matrices' width (GPT 1.3B's hidden size)
# One compiled pass, bytes per parameter (AdamW; bf16 gradients with bf16 weights): see the docstring.
COMPILED_PASS = {"fp32": {"naive": 16 + 12, "separate": None, "fused": 16 + 12 + 4},
                 "bf16": {"naive": 14 + 12 + 2, "separate": None, "fused": 14 + 12 + 2 + 2}}


def make_stage(numel: int, bf16: bool, device, compiled: bool = False):
    """(model params, optimizer) of a stage of about `numel` parameters (matrices COLS wide), gradients
    set; AdamW, mixed precision for bf16. `compiled`: the fused step under torch.compile (--torch-compile)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    rows = max(1, min(1024, numel // COLS))
    count = max(1, numel // (rows * COLS))
    params = [torch.nn.Parameter((0.02 * torch.randn(rows, COLS, device=device)).to(dtype)) for _ in range(count)]
    for p in params:
        p.grad = (1e-3 * torch.randn(rows, COLS, device=device)).to(dtype)

    def adamw(groups):
        return build_optimizer("adamw", groups, lr=1e-4, weight_decay=0.1)
    groups = [{"params": params, "weight_decay": 0.1}]
    opt = MixedPrecisionOptimizer(adamw, groups) if bf16 else adamw(groups)
    getattr(opt, "optimizer", opt).compile_fused_step = compiled
    return params, opt


def run_variant(params, opt, variant: str, steps: float = S) -> None:
    """One micro-batch's step + prediction + restore of `variant` (see the docstring)."""
    inner = getattr(opt, "optimizer", opt)
    inner.keep_direction = variant == "separate"
    if variant == "fused":
        request = PredictionRequest(steps)
        opt.plan_prediction(request)
        opt.step()
        live = [(p, p.data) for p, _ in request.predicted]
        for p, w in request.predicted:
            p.data = w
        for p, w in live:  # after the forward
            p.data = w
        return
    opt.step()
    if variant == "naive":
        return
    if hasattr(opt, "predict_model_params"):
        opt.predict_model_params(steps)
        opt.restore_model_params()
        return
    pairs = opt.predicted(steps)
    live = [(p, p.data) for p, _ in pairs]
    for p, w in pairs:
        p.data = w
    for p, w in live:
        p.data = w


def bytes_per_param(numel: int = 1 << 21) -> dict[str, dict[str, tuple[float, float]]]:
    """{"fp32"/"bf16": {variant: (read, written) bytes per parameter per micro-batch}}, eager CPU."""
    out = {}
    for bf16 in (False, True):
        row = {}
        for variant in VARIANTS:
            params, opt = make_stage(numel, bf16, "cpu", compiled=False)
            for _ in range(2):  # state exists, ΔW kept from the last step where the variant keeps it
                run_variant(params, opt, variant)
            with count_bytes_moved() as counted:
                run_variant(params, opt, variant)
            n = sum(p.numel() for p in params)
            row[variant] = (counted.read / n, counted.written / n)
        out["bf16" if bf16 else "fp32"] = row
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_step_variants(device, numel: int = 302_000_000, bf16: bool = True, reps: int = 20,
                       compiled=(False, True)) -> list[dict]:
    """ms per micro-batch of each variant (step + prediction + restore) on one stage of `numel` parameters,
    eager and/or compiled, the variants alternated rep by rep (median): [{"variant", "compiled", "ms",
    "vs_naive"}]. For bench/gpu/gpu.py; on the CPU use a small `numel`."""
    params, opt = make_stage(numel, bf16, device)
    inner = getattr(opt, "optimizer", opt)
    times = {(v, c): [] for c in compiled for v in VARIANTS}
    for c in compiled:  # warm-up: state, and the compiled graphs (first step eager, then two compilations)
        inner.compile_fused_step = c
        for v in VARIANTS:
            for _ in range(3):
                run_variant(params, opt, v)
    _sync(device)
    for rep in range(reps):
        for c in compiled:
            inner.compile_fused_step = c
            for v in VARIANTS[::1 if rep % 2 == 0 else -1]:  # the order reversed every other rep
                start = time.perf_counter()
                run_variant(params, opt, v)
                _sync(device)
                times[(v, c)].append(time.perf_counter() - start)
    rows = []
    for (v, c), ts in times.items():
        ms = 1e3 * statistics.median(ts)
        rows.append({"variant": v, "compiled": c, "ms": ms})
    for row in rows:
        naive = next(r["ms"] for r in rows if r["variant"] == "naive" and r["compiled"] == row["compiled"])
        row["vs_naive"] = row["ms"] / naive
    return rows


# ---- the stream ---------------------------------------------------------------------------------------

STREAM_GPT = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                         attention_dropout=0.0, untie_embeddings_and_output_weights=True)
STREAM_VOCAB, STREAM_BATCH, STREAM_D = 1024, 2, 4
STREAMS = {"async-naive": ("async-naive", True), "pipeoptim fused": ("pipeoptim", True),
           "pipeoptim separate": ("pipeoptim", False)}


def stream_times(microbatches: int = 16, reps: int = 5, compiled: bool = False) -> dict[str, float]:
    """{variant: median ms per micro-batch of a segment} of the D = 4 emulator stream (STREAMS), fp32 (bf16
    matmuls are slow enough on a CPU to hide the step), every step compiled or eager."""
    cfg = Config()
    cfg.model = STREAM_GPT
    cfg.training.seed = 1
    batches = bench_common.gpt_batches(microbatches, STREAM_BATCH, STREAM_GPT.seq_length, STREAM_VOCAB)
    emulators = {}
    for name, (method, fuse) in STREAMS.items():
        model_parallel_seed(1)
        emulators[name] = AsyncEmulator(cfg, STREAM_VOCAB, method, STREAM_D, 1, 1, "adamw",
                                        {"lr": 1e-4, "weight_decay": 0.01}, None, 0.0)
        for stage in emulators[name].stages:
            stage.policy.fuse_prediction = fuse
            for opt in stage.optimizers:
                opt.compile_fused_step = compiled
        emulators[name].train_segment(batches)  # warm-up (state, first allocations, compilation)
    times = {name: [] for name in STREAMS}
    for rep in range(reps):
        for name in list(emulators)[::1 if rep % 2 == 0 else -1]:  # the order reversed every other rep
            emu = emulators[name]
            start = time.perf_counter()
            emu.train_segment(batches)
            times[name].append((time.perf_counter() - start) / microbatches)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (the CPU test)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", help="also write the report to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 2 if args.quick else args.reps
    numel = 1 << 18 if args.quick else 1 << 22
    started = time.perf_counter()
    lines = [*bench_common.header(__file__, sys.argv[1:], "The optimizer step fused with PipeOptim's prediction "
                                  "(bench/step/fused_step.py)"), "CPU, 1 thread.", "",
             f"## Bytes per parameter per micro-batch: step + prediction (s = {S:g}) + restore, AdamW", "",
             "Counted op by op in eager execution (read / written / total); `compiled` = one pass reading and "
             "writing each tensor once (the CUDA path; analytic). `vs naive`: total minus async-naive's.", "",
             "| weights | variant | read | written | total | vs naive | compiled pass | vs naive |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    counted = bytes_per_param(numel)
    for precision, row in counted.items():
        base = sum(row["naive"])
        for v in VARIANTS:
            read, written = row[v]
            analytic = COMPILED_PASS[precision][v]
            comp = "-" if analytic is None else f"{analytic} | {analytic - COMPILED_PASS[precision]['naive']:+d}"
            lines.append(f"| {precision} | {v} | {read:.1f} | {written:.1f} | {read + written:.1f} | "
                         f"{read + written - base:+.1f} | {comp} |")
    actual = sum(p.numel() for p in make_stage(numel, False, "cpu")[0])
    lines += ["", f"## Time per micro-batch: step + prediction + restore, one stage of {actual / 1e6:.2f} M "
              f"parameters (CPU, median of {reps}; compiled = inductor's C++ for the CPU, as on CUDA)", "",
              "| weights | step | variant | ms | vs naive |", "|---|---|---|---:|---:|"]
    for bf16 in (False, True):
        for row in time_step_variants("cpu", numel, bf16, reps):
            lines.append(f"| {'bf16' if bf16 else 'fp32'} | {'compiled' if row['compiled'] else 'eager'} | "
                         f"{row['variant']} | {row['ms']:.2f} | {row['vs_naive']:.3f} |")
    microbatches = 8 if args.quick else 64  # long segments: the warm-up (no fused step before it) is a small share
    lines += ["", f"## The stream: ms per micro-batch, emulator D = {STREAM_D}, GPT {STREAM_GPT.num_layers} x "
              f"{STREAM_GPT.hidden_size}, seq {STREAM_GPT.seq_length}, micro-batch {STREAM_BATCH}, fp32, AdamW, "
              f"segments of {microbatches}, median of {reps} (variants alternated, order reversed every other rep)", "",
              "| step | variant | ms / micro-batch | vs async-naive |", "|---|---|---:|---:|"]
    for compiled in (False, True):
        streams = stream_times(microbatches, reps, compiled)
        for name, ms in streams.items():
            lines.append(f"| {'compiled' if compiled else 'eager'} | {name} | {ms:.2f} | "
                         f"{ms / streams['async-naive']:.3f} |")
    lines += ["", bench_common.load_at_end(started)]
    bench_common.publish(lines, args.out)


if __name__ == "__main__":
    main()
