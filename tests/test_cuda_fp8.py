"""FP8 through torchao on a GPU (tests/cuda_harness.py: each test on "cpu" everywhere, FP8 emulated there, and on
"cuda" where there is one, FP8 on `torch._scaled_mm`): the twins of tests/test_fp8.py that one process can run.
torchao must be importable on the GPU: scripts/run_gpu_tests.sh installs it from a carried `.gpu_wheels/`
(scripts/gpu_wheels.sh, docs/fp8.md).

- The GEMM equals torchao's own Float8Linear bitwise (output, input and weight gradients; tensorwise hybrid and
  e4m3, rowwise e4m3; bf16) and is FP8, not the exact matmul (relative error in (1e-3, 0.1)).
- Training the tiny GPT (cuda_harness.TINY, 8 iterations, bf16, dropout 0) with --fp8-format hybrid stays within
  0.02 of bf16 at every iteration (the issue's GPU loss target; the CPU measures 3.4e-4 over 50 iterations in
  tests/test_fp8.py) and differs from it; the start-up line says FP8 ran emulated on the CPU, not on the GPU.
- An FP8 run resumes bitwise on the same device (deterministic kernels on a GPU), dropout on.
- PipeOptim (AdamW, constant lr 1e-3) in the D = 4 emulator under FP8 stays within 0.02 of the same emulator
  without FP8, every one of 8 micro-batches, on the device (CPU, emulated: 3.9e-3); every weight stays fp32.
- The compute-capability rule: on a GPU below 8.9 validation gives its one line; at 8.9 or above, or on the CPU
  (emulated), the FP8 flags pass. TP = 2 and PP = 2 need several processes: tests/test_fp8.py runs them (gloo).
"""

import json
import os

import pytest
import torch
from cuda_harness import one_thread  # noqa: F401  (autouse fixture)
from cuda_harness import DEVICES, deterministic, tiny_args, use_device
from test_fp8 import RECIPES, fp8_gemm_grads_on, rel

from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.models import fp8 as model_fp8
from megatron_po.training import run_main

QUIET = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--bf16": True}
FP8 = {"--fp8-format": "hybrid"}


def run_records(out, **flags) -> list[dict]:
    assert run_main(tiny_args(out, **flags)) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


def lm_losses(records) -> list[float]:
    return [r["lm_loss"] for r in records]


@pytest.mark.parametrize("recipe,fmt", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemm_is_torchaos_on_the_device(device, recipe, fmt, monkeypatch):
    use_device(device, monkeypatch)
    ours, theirs, exact = fp8_gemm_grads_on(device, recipe, fmt, torch.bfloat16, emulate=device == "cpu")
    for name, a, b, e in zip(("output", "grad input", "grad weight"), ours, theirs, exact):
        assert a.device.type == device and torch.equal(a, b), name
        assert 1e-3 < rel(a, e) < 0.1, (name, rel(a, e))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_trains_close_to_bf16_on_the_device(device, tmp_path, monkeypatch, capsys):
    use_device(device, monkeypatch)
    bf16 = lm_losses(run_records(str(tmp_path / "bf16"), **QUIET))
    capsys.readouterr()
    fp8 = lm_losses(run_records(str(tmp_path / "fp8"), **QUIET, **FP8))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("> FP8: torchao"))
    assert ("emulated on the CPU" in line) == (device == "cpu"), line
    assert len(fp8) == 8 and max(bf16) - min(bf16) > 0.05  # the weights moved
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) <= 0.02 and fp8 != bf16, (fp8, bf16)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_resume_on_the_same_device_is_bitwise(device, tmp_path, monkeypatch):
    use_device(device, monkeypatch)
    ckpt = str(tmp_path / "ckpt")
    flags = {"--bf16": True, "--save-interval": 4, **FP8}  # dropout on: the device's generator restored
    with deterministic():
        straight = lm_losses(run_records(str(tmp_path / "straight"), **flags, **{"--save": ckpt}))
        resumed = lm_losses(run_records(str(tmp_path / "resumed"), **flags, **{"--load": ckpt, "--ckpt-step": 4,
                                                                               "--save": str(tmp_path / "c2")}))
    assert len(straight) == 8 and resumed == straight[4:]


@pytest.mark.parametrize("device", DEVICES)
def test_pipeoptim_emulator_under_fp8_on_the_device(device, monkeypatch):
    from cuda_harness import batches_on, build_emulator, emulator_state
    from test_async_policies import make_cfg
    use_device(device, monkeypatch)
    runs = {}
    for name, fmt in (("plain", None), ("fp8", "hybrid")):
        cfg = make_cfg(4)
        cfg.model.fp8_format = fmt
        emu = build_emulator("pipeoptim-adamw", cfg, gentle=True)  # constant lr 1e-3
        runs[name] = (emu.train_segment(batches_on(device), 8), emulator_state(emu))
    (plain, _), (fp8, weights) = runs["plain"], runs["fp8"]
    assert max(abs(a - b) for a, b in zip(fp8, plain)) <= 0.02 and fp8 != plain
    assert {w.dtype for w in weights.values()} == {torch.float32}


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_needs_compute_capability_8_9(device, monkeypatch):
    use_device(device, monkeypatch)
    gpu = model_fp8._cuda_capability()
    assert (gpu is None) == (device == "cpu") and model_fp8.emulated() == (device == "cpu")
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--fp8-format",
                      "hybrid"])
    if gpu is not None and tuple(gpu[1]) < (8, 9):
        with pytest.raises(ConfigError, match="needs a GPU of compute capability >= 8.9"):
            validate(cfg, 1)
    else:
        validate(cfg, 1)
