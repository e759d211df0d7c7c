"""The `fp8` section of the GPU check (issue 43): FP8 training through torchao (--fp8-format hybrid, recipe
tensorwise) against our bf16, in the same run, eager and compiled, and against torchao's own recipe on the plain
PyTorch GPT the check already measures. Writes bench/results/gpu_fp8_<device>[_quick].md and a .json beside it.

    python bench/gpu/gpu_fp8.py                      # GPT-1.3B (bench/gpu/gpu_worker.py's "full" size), on a GPU
    python bench/gpu/gpu_fp8.py --quick --out x.md   # the tiny GPT on a CPU (FP8 emulated): runs every path
    python bench/gpu/gpu_fp8.py plain_fp8 --size full [--compile]   # one measurement: the plain GPT under FP8

Measured, each in a fresh process: the bf16 matmul peak (MFU's denominator, gpu_worker.py peak); ours through
pretrain_gpt.py --bf16 (gpu_run.measure_ours: median ms per iteration after the warm-up, tokens/s, model TFLOP/s,
MFU), without and with --fp8-format hybrid, eager and --torch-compile; and bench/step/overhead.py's plain GPT
with torchao's `convert_to_float8_training` (tensorwise, every nn.Linear of its blocks; its output layer is a
tied F.linear and stays bf16, like ours), compiled, run by gpu_worker.py's `plain` loop. The loss of the last
iteration of each of ours is compared with bf16's. Targets: FP8 compiled >= 1.25x our bf16 compiled (tokens/s),
>= 1.0x the plain FP8 GPT compiled, last loss within 0.02 of bf16's.

bench/gpu/gpu.py's check calls `section_fp8(run)` with its `Run` (then the bf16 figures of its sections `gpt`
and `compiled`, measured in the same run, are reused rather than measured again). torchao must be importable:
on a device call, carry `.gpu_wheels/` (scripts/gpu_wheels.sh, docs/fp8.md).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()

from bench_common import RESULTS, load_at_end, load_at_start, log, markdown_table, now, offline_env  # noqa: E402
from gpu_run import Run, Section, measure_ours, num, pct  # noqa: E402

FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
TARGETS = {"compiled_over_bf16_compiled": 1.25, "compiled_over_plain_fp8_compiled": 1.0, "loss_delta": 0.02}
ESTIMATED_SECONDS = {"full": 540, "quick": 420}  # with section gpt and compiled's bf16 runs reused: full ~300


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
    return {**result, "fp8": "torchao convert_to_float8_training, tensorwise" + (" (emulated)" if config.emulate else "")}


def worker(run: Run, *flags: str) -> tuple[dict, str]:
    """(result, command) of `python bench/gpu/gpu_fp8.py plain_fp8 --size <size> flags` in a fresh process."""
    argv = ["plain_fp8", "--size", run.size_name, *flags]
    shown = " ".join(["python", "bench/gpu/gpu_fp8.py", *argv])
    lines = run._stream([sys.executable, os.path.abspath(__file__), *argv], shown)
    result = next((ln[len("RESULT "):] for ln in reversed(lines) if ln.startswith("RESULT ")), None)
    if result is None:
        raise RuntimeError(f"no RESULT line from: {shown}")
    return json.loads(result), shown


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------


def last_loss(run: Run, label: str) -> float:
    """The lm loss of the last iteration of `measure_ours(run, label, ...)` (its metrics in the run's tmp)."""
    with open(os.path.join(run.tmp, label, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r][-1]["lm_loss"]


# bench/gpu/gpu.py's sections measuring our bf16 runs as this section would: name -> measure_ours's label
REUSED = {"gpt": "gpt", "compiled": "gpt_compiled"}


def ours(run: Run, label: str, extra: list[str], reuse: str | None = None) -> tuple[Section, float]:
    """(section, last loss) of ours with `extra` flags; a bf16 run the check measured already in this run (`reuse`:
    its section's name) is read from there."""
    if reuse in run.done:
        return run.done[reuse], last_loss(run, REUSED[reuse])
    return measure_ours(run, label, "", extra), last_loss(run, label)


def section_fp8(run: Run) -> Section:
    from gpu_run import throughput
    if "peak" not in run.done:  # MFU's denominator, measured in this run
        from gpu import section_peak
        run.done["peak"] = section_peak(run)
    bf16, bf16_loss = ours(run, "fp8_bf16", [], "gpt")
    bf16_c, bf16_c_loss = ours(run, "fp8_bf16_compiled", ["--torch-compile"], "compiled")
    fp8, fp8_loss = ours(run, "fp8_eager", FP8_FLAGS)
    fp8_c, fp8_c_loss = ours(run, "fp8_compiled", ["--torch-compile", *FP8_FLAGS])
    plain, plain_command = worker(run, "--compile")
    plain.update(throughput(run, plain["ms_per_iteration"]))
    figures = {"bf16": bf16.figures, "bf16_compiled": bf16_c.figures, "fp8": fp8.figures, "fp8_compiled": fp8_c.figures,
               "plain_fp8_compiled": plain, "loss": {"bf16": bf16_loss, "bf16_compiled": bf16_c_loss, "fp8": fp8_loss,
                                                        "fp8_compiled": fp8_c_loss}}
    ratios = {"eager_over_bf16_eager": fp8.figures["tokens_per_s"] / bf16.figures["tokens_per_s"],
              "compiled_over_bf16_compiled": fp8_c.figures["tokens_per_s"] / bf16_c.figures["tokens_per_s"],
              "compiled_over_plain_fp8_compiled": fp8_c.figures["tokens_per_s"] / plain["tokens_per_s"],
              "loss_delta": max(abs(fp8_loss - bf16_loss), abs(fp8_c_loss - bf16_c_loss))}
    figures["ratios"] = ratios
    met = {k: (ratios[k] <= bound if k == "loss_delta" else ratios[k] >= bound) for k, bound in TARGETS.items()}
    figures["targets"] = {k: {"bound": TARGETS[k], "measured": ratios[k], "met": met[k]} for k in TARGETS}
    rows = [[name, f"{f['ms_per_iteration']:.1f}", f"{f['tokens_per_s']:,.0f}", num(f["model_tflops"]), pct(f["mfu"]),
             "n/a" if loss is None else f"{loss:.4f}"]
            for name, f, loss in (("ours bf16, eager", bf16.figures, bf16_loss),
                                  ("ours bf16, --torch-compile", bf16_c.figures, bf16_c_loss),
                                  ("ours FP8, eager", fp8.figures, fp8_loss),
                                  ("ours FP8, --torch-compile", fp8_c.figures, fp8_c_loss),
                                  ("plain PyTorch GPT, torchao FP8, torch.compile", plain, None))]
    target_rows = [["FP8 compiled / bf16 compiled (tokens/s) >= 1.25", f"{ratios['compiled_over_bf16_compiled']:.3f}x",
                    "met" if met["compiled_over_bf16_compiled"] else "NOT MET"],
                   ["FP8 compiled / plain FP8 compiled (tokens/s) >= 1.0",
                    f"{ratios['compiled_over_plain_fp8_compiled']:.3f}x",
                    "met" if met["compiled_over_plain_fp8_compiled"] else "NOT MET"],
                   ["|last loss FP8 - bf16| <= 0.02 (eager, compiled)", f"{ratios['loss_delta']:.4f}", "met" if met["loss_delta"] else "NOT MET"]]
    commands = [c for s in (bf16, bf16_c, fp8, fp8_c) for c in s.commands] + [plain_command]
    reused = [name for name in ("gpt", "compiled") if run.done.get(name) in (bf16, bf16_c)]
    return Section("FP8 (torchao) against bf16 and the plain GPT under torchao's FP8", commands, figures, [
        f"--fp8-format hybrid (E4M3 forward, E5M2 gradients), recipe tensorwise, in the QKV, attention-projection and "
        f"MLP GEMMs; embedding and output layer bf16. FP8 eager / bf16 eager: "
        f"{ratios['eager_over_bf16_eager']:.3f}x tokens/s. MFU against the bf16 peak (section peak), model FLOPs "
        f"alike. Last loss: iteration {run.size.iterations}."
        + (f" bf16 figures from section(s) {', '.join(reused)} of this run." if reused else ""), "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "last loss"], rows), "",
        markdown_table(["target (issue 43)", "measured", ""], target_rows)])


# --------------------------------------------------------------------------------------------------
# On its own: the section and its results files
# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plain_fp8":  # the worker process
        import gpu_worker
        ap = bench_common.parser("python bench/gpu/gpu_fp8.py plain_fp8 --size SIZE [--compile]")
        ap.add_argument("worker", choices=["plain_fp8"])
        ap.add_argument("--size", choices=list(gpu_worker.SIZES), default="full")
        ap.add_argument("--compile", action="store_true")
        args = ap.parse_args(argv)
        print("RESULT " + json.dumps(plain_fp8(gpu_worker.SIZES[args.size], args)), flush=True)
        return 0
    offline_env()
    ap = bench_common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the tiny GPT: every path on a CPU (FP8 emulated)")
    ap.add_argument("--out", help="the .md to write (the .json beside it); default bench/results/gpu_fp8_<device>.md")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measuring process (default 600)")
    args = ap.parse_args(argv)
    from gpu import device_info
    t0, started, info = time.perf_counter(), now(), device_info()
    run = Run("quick" if args.quick else "full", args.timeout or 600)
    out = args.out or os.path.join(RESULTS, f"gpu_fp8_{info['slug']}{'_quick' if args.quick else ''}.md")
    command = bench_common.command_line("bench/gpu/gpu_fp8.py", argv)
    section = section_fp8(run)
    s = run.size
    lines = [f"# FP8 (torchao) on {info['name']}", "", f"Command: `{command}`  ", f"Started {started}; {load_at_start()}  ",
             f"Device: {info['name']}; torch {info['torch']}, CUDA {info['cuda']}  ", f"Code: commit {info['commit']}  ",
             f"Model: GPT, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, seq {s.seq}, micro-batch "
             f"{s.micro_batch}, global batch {s.global_batch}, vocab {s.vocab}, mock data, one process.", ""]
    if args.quick:
        lines += [f"> **Quick size on {info['name']}: FP8 emulated where there is no GPU; its numbers measure "
                  "nothing.**", ""]
    lines += [f"## {section.title}", "", "```", *section.commands, "```", "", *section.lines, "", load_at_end(t0)]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(bench_common.portable("\n".join(lines) + "\n"))
    data = {"schema": "megatron_po bench/gpu/gpu_fp8.py 1", "command": command, "size": run.size_name,
            "started": started, "device": info, "figures": section.figures, "commands": section.commands}
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        f.write(bench_common.portable(json.dumps(data, indent=1)))
    log(f"[gpu_fp8.py] wrote {out} in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
