"""What a GPU check runs and how long each piece takes: the steps in order of priority, their split over two
device calls, and the seconds each is estimated to take, so that a time budget starts only what can finish.

Torch-free (bench/gpu/gpu_check.py reads it before anything imports torch; bench/gpu/gpu.py reads it too).

Full-size figures are for one H100 or H200: measured on one H200 on 2026-11-26 (docs/gpu.md, "Results on an
H200": peak 5 s, gpt 25 s, plain 85 s of which its compile 51 s, compiled 162 s, muon 70 s, the eager stream
27 s a method, the CUDA tests 88 s) and on one H100 on 2026-11-27 (bench/results/gpu_nvidia_h100_80gb_hbm3_2026-11-27:
peak 8-9 s, gpt 32-33 s, plain 50-88 s, compiled 166 s, the CUDA tests 137 s, the part-1 compile tests 205 s beside
them) plus process start-up, rounded up; estimated where no run measured it (marked *). The quick figures are a
loaded 2-core CPU's, rounded up.
"""

from __future__ import annotations

# bench/gpu/gpu.py's sections, in the order they run, which is their priority (issue 34), except that gpt runs
# before plain and compiled, whose ratios read it. `targets` measures nothing: it reads the others.
SECTION_ORDER = ["peak", "gpt", "plain", "compiled", "stream_compiled", "fused", "muon", "fp16", "stream",
                 "stream_compiled_muon", "targets"]

# seconds: (full size on one H100/H200, quick size on a CPU)
SECTION_SECONDS = {
    "peak": (10, 10),
    "gpt": (35, 15),
    "plain": (90, 25),
    "compiled": (190, 20),  # H100: 166 s, of which the compiled optimizer step's first compile ~100 s (iteration 2)
    # * 2 methods at 150 s: start-up and build 20 s, its layers' compile about as long as compiled's (140 s less
    # the run) but for 6 layers a stage, 4 stages' optimizer steps, then 24 micro-batches
    "stream_compiled": (300, 25),
    # 3 compiled step graphs (naive, separate, fused) of the stage's 144 tensors, 1024 x 2048: cut off after 194 s on
    # an H100 when each graph held all 144 (the same graphs took 203 s on a 2-core CPU at 1024 x 2), now one 8-tensor
    # slice each (34 s there; optim/fused_prediction.py's `_slices`), plus start-up and 120 timed steps
    "fused": (90, 15),  # *
    "muon": (80, 35),  # plus gpt's when that section does not run (muon then measures AdamW's iteration itself)
    "fp16": (35, 15),  # *
    "stream": (190, 60),  # 7 methods at 27 s
    "stream_compiled_muon": (330, 25),  # * 2 methods, Newton-Schulz in each step's graph
    "targets": (0, 0),
}

# The test steps of bench/gpu/gpu_check.py; adjacent ones run side by side (none is a timing).
TEST_STEPS = ["cuda_tests", "cpu_compile_tests", "cpu_compile_tests_rest"]
TEST_SECONDS = {
    "cuda_tests": (140, 40),  # H100: 137 s (26 of 28 passing)
    # the compile tests on the device's CPU (gpu_check.CPU_COMPILE_TESTS): 205 s on the H100's 16 cores beside the
    # CUDA tests; * the rest: all of them took 1,460 s on a 2-core CPU at a load of 15-20, 520 s of it the subset
    "cpu_compile_tests": (210, 45),
    "cpu_compile_tests_rest": (300, 60),
}

# Every step a check can run, by priority: the CUDA suite, the sections (targets always runs with them), then the
# compile tests on the device's CPU (the subset that found torch-2.11 bugs, then the rest). The first H100 run had
# the compile tests second, beside the CUDA suite: they took 205 s there and pushed `compiled`, the section with
# issue 34's main target, out of part 1; at that commit they passed on torch 2.11.
STEPS = TEST_STEPS[:1] + [name for name in SECTION_ORDER if name != "targets"] + TEST_STEPS[1:]

# Two device calls: part 1 the CUDA suite and the top sections (about 465 s by the estimates above, inside the
# default 540 s budget), part 2 the rest (about 1,600 s, more than a call: it runs by priority what its --budget-s
# allows, stream_compiled first, and names the rest in its summary).
PARTS = {
    1: ["cuda_tests", "peak", "gpt", "plain", "compiled"],
    2: ["stream_compiled", "fused", "muon", "fp16", "stream", "stream_compiled_muon", "cpu_compile_tests",
        "cpu_compile_tests_rest"],
}

# The sections a section's figures are read against, in the same run (its ratios' baselines, MFU's peak): a check
# that runs a section adds these when its steps lack them.
BASELINES = {"gpt": ["peak"], "plain": ["peak", "gpt"], "compiled": ["peak", "gpt", "plain"]}


def seconds(name: str, quick: bool) -> float:
    """The estimated seconds of step or section `name` at the full or the quick size."""
    full, small = {**SECTION_SECONDS, **TEST_SECONDS}[name]
    return small if quick else full


def with_baselines(steps: list[str]) -> list[str]:
    """`steps` and the sections their figures are read against, in the order of priority."""
    chosen = set(steps)
    for name in steps:
        chosen.update(BASELINES.get(name, []))
    return [name for name in STEPS if name in chosen]
