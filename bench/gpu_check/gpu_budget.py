"""Every step a GPU check can run, in one table: what it is, what it costs, which files it measures, and what it
is read against. Adding a section is one entry here and its function (`run`, in bench/gpu/gpu.py or a module of
bench/gpu of its own); bench/gpu_check/gpu_plan.py orders the steps, bench/gpu_check/gpu_check.py runs them.

Torch-free (bench/gpu_check/gpu_check.py and gpu_plan.py read it before anything imports torch; bench/gpu/gpu.py too).

Estimated seconds are for one H100 or H200, from the leases (docs/gpu.md): one H200 on 2026-11-26 (peak 5 s,
gpt 25 s, plain 85 s of which its compile 51 s, compiled 162 s, muon 70 s, the eager stream 27 s a method, the
CUDA tests 88 s) and one H100 on 2026-11-27 (bench/results/gpu_nvidia_h100_80gb_hbm3_2026-11-27: peak 8-9 s, gpt
32-33 s, plain 50-88 s, compiled 166 s, the CUDA tests 137 s, the part-1 compile tests 205 s beside them), plus
process start-up, rounded up; estimated where no run measured it (marked *). A plan prefers a step's last
measured seconds to these (gpu_plan.py). The quick figures are a loaded 2-core CPU's, rounded up.

`files`: the code a step measures or tests, as globs over the checkout (`**` any folders, `!` excludes): its
code hash (gpu_plan.code_hash) changes when one of them does, and the plan then runs it before the unchanged
ones. The bench harness itself (bench/gpu/gpu.py, gpu_run.py, gpu_check.py, gpu_plan.py, this file) is in no
step's files: changing how a figure is reported does not make a measurement new.
"""

from __future__ import annotations

from dataclasses import dataclass

# The single-process training path every measurement of ours runs (pretrain_gpt.py at PP = TP = DP = 1), less
# the optimizers and pipelines the AdamW GPT does not run.
OURS = ("pretrain_gpt.py", "megatron_po/**/*.py", "!megatron_po/optim/muon*.py", "!megatron_po/optim/newton_schulz.py",
        "!megatron_po/optim/nag.py", "!megatron_po/optim/nadamw.py", "!megatron_po/pipeline/async_*.py",
        "!megatron_po/pipeline/pipenag.py", "!megatron_po/nmt_workload.py", "!megatron_po/models/nmt.py",
        "!megatron_po/data/nmt_dataset.py", "!megatron_po/models/hf/*.py", "!megatron_po/distributed/checkpoint_hf.py",
        "!megatron_po/models/te_*.py")
MUON = ("megatron_po/optim/muon*.py", "megatron_po/optim/newton_schulz.py")
STREAM = ("megatron_po/pipeline/**/*.py", "megatron_po/optim/**/*.py", "megatron_po/models/**/*.py",
          "megatron_po/tensor_parallel/**/*.py", "megatron_po/config*.py", "bench/gpu/gpu_worker.py",
          "bench/gpu/gpu_stream.py")


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # "tests" (on the GPU, timed with the sections), "section" (gpu.py), "cpu_tests" (beside them)
    seconds: tuple[float, float]  # estimated: (full size on one H100/H200, quick size on a CPU)
    files: tuple[str, ...]  # the code it measures (globs; module docstring)
    baselines: tuple[str, ...] = ()  # sections its figures are read against, in the same run or on the same machine
    run: str = ""  # a section's function: "section_x" in bench/gpu/gpu.py, or "module:function" in bench/gpu
    reusable: bool = False  # a baseline: its figures serve any later call on the same machine at the same code
    on_request: bool = False  # a diagnosis, not a target's figure: planned only when --steps names it


# In the order of priority (issue 34): the CUDA suite, then the sections (gpt before plain and compiled, whose
# ratios read it), `targets` (reads the others, measures nothing), then the compile tests on the device's torch,
# which run beside the timed steps from the start (bench/gpu_check/gpu_check.py).
TABLE = [
    Step("cuda_tests", "tests", (140, 40), ("tests/test_cuda_*.py", "tests/cuda_harness.py", "scripts/run_gpu_tests.sh",
                                            "pretrain_gpt.py", "megatron_po/**/*.py")),
    Step("peak", "section", (10, 10), ("bench/step/overhead.py",), run="section_peak", reusable=True),
    Step("gpt", "section", (35, 15), OURS, ("peak",), run="section_gpt", reusable=True),
    Step("plain", "section", (90, 25), ("bench/step/overhead.py",), ("peak", "gpt"), run="section_plain",
         reusable=True),
    # H100: 166 s, of which the compiled optimizer step's first compile ~100 s (iteration 2; sliced since: 19 s
    # instead of 103 s on a CPU)
    Step("compiled", "section", (190, 20), OURS, ("peak", "gpt", "plain"), run="section_compiled"),
    # * an MoE GPT of 1.34 B parameters (0.43 B active), 8 experts top-2, --torch-compile, the experts as one grouped
    # GEMM and as a loop (bench/gpu/gpu_moe.py, issue 48): two compiled runs of pretrain_gpt.py, guessed at 150 s
    # each (start-up, compile, 12 iterations); quick: 3 min compiled on a loaded 2-core CPU. Before the other
    # never-measured sections: the next lease measures it first
    Step("moe", "section", (300, 200), OURS + ("bench/gpu/gpu_moe.py",), ("peak",), run="gpu_moe:section_moe"),
    # * ours --torch-compile in GPipe's order (all forwards, then all backwards) beside the plain GPT compiled in
    # the same order: two processes of 4 iterations each, compiles included
    Step("gpipe", "section", (150, 40), OURS + ("bench/step/overhead.py",), run="section_gpipe"),
    # * 2 methods at 150 s: start-up and build 20 s, 6 layers a stage compiled, 4 stages' steps, 24 micro-batches
    Step("stream_compiled", "section", (300, 25), STREAM, run="section_stream_compiled"),
    # 3 compiled step graphs (naive, separate, fused) of 8-tensor slices (optim/fused_prediction.py's `_slices`;
    # cut off after 194 s on an H100 when each graph held a stage's 144 tensors), plus start-up and 120 timed steps
    Step("fused", "section", (90, 15), ("megatron_po/optim/*.py", "bench/step/fused_step.py"), run="section_fused"),
    # plus gpt's when that section does not run; now also the opt-in faster Newton-Schulz (Gram, Polar Express)
    Step("muon", "section", (110, 45), OURS + MUON + ("bench/step/muon_step.py",), ("gpt",), run="section_muon"),
    Step("fp16", "section", (35, 15), OURS, run="section_fp16"),  # *
    Step("stream", "section", (190, 60), STREAM, run="section_stream"),  # 7 methods at 27 s
    Step("stream_compiled_muon", "section", (330, 25), STREAM, run="section_stream_compiled_muon"),  # *
    # * one compiled iteration of ours and of the plain GPT profiled (graphs, kernels, host syncs, copies): ours'
    # compiles as in compiled, the plain's as in plain. On request (--steps profile): it would displace a target's
    # section from a lease's second call
    Step("profile", "section", (150, 60), OURS + ("bench/step/overhead.py",), run="section_profile", on_request=True),
    # * FP8 through torchao (bench/gpu/gpu_fp8.py, issue 43): ours bf16 and FP8, eager and compiled, and the plain GPT
    # under torchao's own recipe, compiled; 540 s full, ~300 s with gpt and compiled reused; needs torchao carried
    # in (.gpu_wheels/, docs/fp8.md)
    Step("fp8", "section", (300, 210), OURS + ("bench/gpu/gpu_fp8.py",), ("peak", "gpt", "compiled"),
         run="gpu_fp8:section_fp8"),
    # * GPT-1.3B at 16,384 tokens per sequence, CP = 1 (issue 49; bench/gpu/gpu_long_context.py): tokens/s and MFU with
    # causal attention FLOPs; 12 iterations of 4 sequences, the gpt section's start-up
    Step("long_context", "section", (150, 20), OURS + ("bench/gpu/gpu_long_context.py",), ("peak",),
         run="gpu_long_context:section_long_context"),
    # * the GPT of the check's size with --use-torch-fsdp2 at DP 1 against DDP (issue 55; bench/gpu/gpu_fsdp.py):
    # one run of pretrain_gpt.py as gpt's (gpt's own figures reused when it ran), guessed at 40 s
    Step("fsdp", "section", (45, 25), OURS + ("bench/gpu/gpu_fsdp.py",), ("peak", "gpt"),
         run="gpu_fsdp:section_fsdp"),
    Step("targets", "section", (0, 0), (), run="section_targets"),
    # the compile tests on the device's CPU (gpu_check.CPU_COMPILE_TESTS): 205 s on the H100's 16 cores beside the
    # CUDA tests; * the rest: all of them took 1,460 s on a 2-core CPU at a load of 15-20, 520 s of it the subset
    Step("cpu_compile_tests", "cpu_tests", (210, 45), ("tests/test_fused_prediction.py", "tests/test_compiled_layers.py",
                                                        "megatron_po/**/*.py")),
    Step("cpu_compile_tests_rest", "cpu_tests", (300, 60), ("tests/test_compiled_layers.py", "megatron_po/**/*.py")),
]
BY_NAME = {step.name: step for step in TABLE}
STEPS = [s.name for s in TABLE if s.name != "targets"]  # what --steps takes
PLANNED = [s.name for s in TABLE if s.name != "targets" and not s.on_request]  # what a check plans by default
SECTION_ORDER = [s.name for s in TABLE if s.kind == "section"]  # gpu.py's sections, in their priority
TEST_STEPS = [s.name for s in TABLE if s.kind in ("tests", "cpu_tests")]
CPU_TEST_STEPS = [s.name for s in TABLE if s.kind == "cpu_tests"]
REUSABLE = [s.name for s in TABLE if s.reusable]


def seconds(name: str, quick: bool) -> float:
    """The estimated seconds of step `name` at the full or the quick size."""
    full, small = BY_NAME[name].seconds
    return small if quick else full


def baselines(name: str) -> list[str]:
    """The sections step `name` is read against, and theirs, in the order of priority."""
    chosen: set[str] = set()
    todo = list(BY_NAME[name].baselines)
    while todo:
        base = todo.pop()
        if base not in chosen:
            chosen.add(base)
            todo += BY_NAME[base].baselines
    return [s for s in STEPS if s in chosen]


def with_baselines(steps: list[str]) -> list[str]:
    """`steps` and the sections their figures are read against, in the order of priority."""
    chosen = set(steps)
    for name in steps:
        chosen.update(baselines(name))
    return [name for name in STEPS if name in chosen]
