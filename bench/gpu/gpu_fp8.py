"""The `fp8` section of the GPU check (issue 43): FP8 training through torchao (--fp8-format hybrid, recipe
tensorwise) against our bf16, in the same run, eager and compiled, and against torchao's own recipe on the plain
PyTorch GPT the check already measures. Writes bench/results/gpu_fp8_<device>[_quick].md and a .json beside it.

    python bench/gpu/gpu_fp8.py                      # GPT-1.3B (bench/gpu/gpu_worker.py's "full" size), on a GPU
    python bench/gpu/gpu_fp8.py --quick --out x.md   # the tiny GPT on a CPU (FP8 emulated): every path, ~7 min
    python bench/gpu/gpu_fp8.py --quick --eager-only # without the compiled runs (tests/test_fp8.py)
    python bench/gpu/gpu_fp8.py plain_fp8 --size full [--compile]   # one measurement: the plain GPT under FP8

Measured, each in a fresh process: the bf16 matmul peak (MFU's denominator, gpu_worker.py peak); ours through
pretrain_gpt.py --bf16 (gpu_run.measure_ours: median ms per iteration after the warm-up, tokens/s, model TFLOP/s,
MFU), without and with --fp8-format hybrid, eager and --torch-compile; and bench/step/overhead.py's plain GPT
with torchao's `convert_to_float8_training` (tensorwise, every nn.Linear of its blocks; its output layer is a
tied F.linear and stays bf16, like ours), compiled, run by gpu_worker.py's `plain` loop. The loss of the last
iteration of each of ours is compared with bf16's. Targets: FP8 compiled >= 1.25x our bf16 compiled (tokens/s),
>= 1.0x the plain FP8 GPT compiled, last loss within 0.02 of bf16's.

bench/gpu/gpu.py's check can call `section_fp8(run)` with its `Run` (registered in its SECTIONS; then the peak and
the bf16 figures of its sections `gpt` and `compiled`, measured in the same run or, baselines, by an earlier call on
the same machine, are reused rather than measured again: their last loss travels with their figures). This module
imports nothing from gpu.py, so that gpu.py can import it. torchao must be importable: on a device call, carry
`.gpu_wheels/` (scripts/gpu_wheels.sh, docs/fp8.md).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import markdown_table  # noqa: E402
from gpu_run import Run, Section, measure_ours, measure_peak, num, pct, section_alone  # noqa: E402
from gpu_targets import FP8_BOUNDS  # noqa: E402

FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
TARGETS = FP8_BOUNDS  # bench/gpu_check/gpu_targets.py: the check's closing screen reads the same bounds


# --------------------------------------------------------------------------------------------------
# The plain PyTorch GPT under torchao's own FP8 recipe (a worker process)
# --------------------------------------------------------------------------------------------------


def plain_fp8(size, args) -> dict:
    """gpu_worker.plain (the same loop, optimizer, batches and timing) on a PlainGPT whose nn.Linears torchao's
    `convert_to_float8_training` has converted (tensorwise; emulated without a GPU)."""
    import gpu_worker
    import overhead
    import torch

    from megatron_po.tensor_parallel.fp8 import import_torchao
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    if not torch.cuda.is_available():
        config = float8.Float8LinearConfig(emulate=True)
    plain_gpt = overhead.PlainGPT

    class Float8PlainGPT(plain_gpt):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            float8.convert_to_float8_training(self, config=config)

    overhead.PlainGPT = Float8PlainGPT
    try:
        result = gpu_worker.plain(size, args)
    finally:
        overhead.PlainGPT = plain_gpt
    how = "torchao convert_to_float8_training, tensorwise" + (" (emulated)" if config.emulate else "")
    return {**result, "fp8": how}


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------


def ours(run: Run, label: str, extra: list[str], reuse: str | None = None) -> Section:
    """Ours with `extra` flags; a bf16 run gpu.py's section `reuse` measured as this section would is read from
    there: measured in this run, or a baseline an earlier call measured on this machine (gpu.py's --state-dir).
    Its figures carry the last loss (measure_ours); a baseline recorded before they did is measured here again."""
    done = run.done.get(reuse)
    if done is not None and done.figures.get("last_lm_loss") is not None:
        return done
    return measure_ours(run, label, "", extra)


# (key, row, label, flags, gpu.py's section measuring the same run) of ours; "_compiled" ones need --torch-compile
VARIANTS = [("bf16", "ours bf16, eager", "fp8_bf16", [], "gpt"),
            ("bf16_compiled", "ours bf16, --torch-compile", "fp8_bf16_compiled", ["--torch-compile"], "compiled"),
            ("fp8", "ours FP8, eager", "fp8_eager", FP8_FLAGS, None),
            ("fp8_compiled", "ours FP8, --torch-compile", "fp8_compiled", ["--torch-compile", *FP8_FLAGS], None)]


def section_fp8(run: Run, compiled: bool = True) -> Section:
    """The section; `compiled=False` (--eager-only) leaves out the compiled runs and their targets (a CPU test
    has not the minutes inductor takes there) and times the plain FP8 GPT eager instead."""
    from gpu_run import throughput
    measure_peak(run)
    measured, losses, commands, read = {}, {}, [], {}  # read: gpu.py's sections whose runs served here -> Section
    for key, _, label, flags, reuse in VARIANTS:
        if compiled or not key.endswith("_compiled"):
            section = ours(run, label, flags, reuse)
            measured[key], losses[key] = section.figures, section.figures["last_lm_loss"]
            commands += section.commands
            if section is run.done.get(reuse):
                read[reuse] = section
    plain_key = "plain_fp8_compiled" if compiled else "plain_fp8"
    plain, plain_command = run.worker("plain_fp8", *(["--compile"] if compiled else []), script="gpu_fp8.py")
    measured[plain_key] = {**plain, **throughput(run, plain["ms_per_iteration"])}
    commands.append(plain_command)
    tokens = {k: f["tokens_per_s"] for k, f in measured.items()}
    ratios = {"eager_over_bf16_eager": tokens["fp8"] / tokens["bf16"],
              "loss_delta": max(abs(losses[k] - losses[k.replace("fp8", "bf16")]) for k in losses if "fp8" in k)}
    if compiled:
        ratios["compiled_over_bf16_compiled"] = tokens["fp8_compiled"] / tokens["bf16_compiled"]
        ratios["compiled_over_plain_fp8_compiled"] = tokens["fp8_compiled"] / tokens["plain_fp8_compiled"]
    else:
        ratios["eager_over_plain_fp8_eager"] = tokens["fp8"] / tokens["plain_fp8"]
    met = {k: (ratios[k] <= bound if k == "loss_delta" else ratios[k] >= bound) for k, bound in TARGETS.items()
           if k in ratios}
    figures = {**measured, "loss": losses, "ratios": ratios,
               "targets": {k: {"bound": TARGETS[k], "measured": ratios[k], "met": met[k]} for k in met}}
    rows = [[name, f"{measured[key]['ms_per_iteration']:.1f}", f"{tokens[key]:,.0f}",
             num(measured[key]["model_tflops"]), pct(measured[key]["mfu"]), f"{losses[key]:.4f}"]
            for key, name, *_ in VARIANTS if key in measured]
    rows.append([f"plain PyTorch GPT, torchao FP8{', torch.compile' if compiled else ', eager'}",
                 f"{plain['ms_per_iteration']:.1f}", f"{tokens[plain_key]:,.0f}",
                 num(measured[plain_key]["model_tflops"]), pct(measured[plain_key]["mfu"]), "n/a"])
    described = {"compiled_over_bf16_compiled": ("FP8 compiled / bf16 compiled, tokens/s, >= 1.25", "x"),
                 "compiled_over_plain_fp8_compiled": ("FP8 compiled / plain FP8 compiled, tokens/s, >= 1.0", "x"),
                 "loss_delta": ("last loss, FP8 against bf16, absolute difference <= 0.02", "")}
    target_rows = [[what, "not measured (--eager-only)" if k not in ratios else f"{ratios[k]:.4f}{unit}",
                    "" if k not in met else ("met" if met[k] else "NOT MET")] for k, (what, unit) in described.items()]
    return Section("FP8 (torchao) against bf16 and the plain GPT under torchao's FP8", commands, figures, [
        f"--fp8-format hybrid (E4M3 forward, E5M2 gradients), recipe tensorwise, in the QKV, attention-projection and "
        f"MLP GEMMs; embedding and output layer bf16. FP8 eager / bf16 eager: "
        f"{ratios['eager_over_bf16_eager']:.3f}x tokens/s. MFU against the bf16 peak (section peak), model FLOPs "
        f"alike. Last loss: iteration {run.size.iterations}."
        + (" bf16 figures from section(s) " + ", ".join(
            f"{name} ({'an earlier call on this machine' if section.reused else 'this run'})"
            for name, section in read.items()) + "." if read else ""), "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "last loss"], rows), "",
        markdown_table(["target (issue 43)", "measured", ""], target_rows)])


# --------------------------------------------------------------------------------------------------
# On its own: the section and its results files (gpu_run.section_alone), or the worker process
# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plain_fp8":  # the worker process
        import gpu_worker
        ap = bench_common.parser("python bench/gpu/gpu_fp8.py plain_fp8 --size SIZE [--compile]")
        ap.add_argument("worker", choices=["plain_fp8"])
        ap.add_argument("--size", choices=list(gpu_worker.SIZES), default="full")
        ap.add_argument("--compile", action="store_true")
        ap.set_defaults(gpipe=False)  # gpu_worker.plain's order: each micro-batch's forward then its backward
        args = ap.parse_args(argv)
        print("RESULT " + json.dumps(plain_fp8(gpu_worker.SIZES[args.size], args)), flush=True)
        return 0
    return section_alone(argv, __file__, __doc__, "FP8 (torchao)", section_fp8, "FP8 emulated where there is no GPU")


if __name__ == "__main__":
    sys.exit(main())
