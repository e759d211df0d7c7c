"""Checkpoints on a GPU, through `pretrain_gpt.py` as a user runs it (tests/cuda_harness.py: each test on "cpu"
everywhere and on "cuda" where there is one; every run with wandb, datasets and nltk unimportable).

- Resume on the same device is bitwise (issue 29's reproduction): 8 iterations saving at 4, against
  loading iteration 4 and running 5..8, with --deterministic and dropout 0.1 (the device's random
  generators restored): every resumed iteration's loss and grad norm equal the uninterrupted run's. For
  1F1B in bf16 (fp32 main params, AdamW), for PipeDream-2BW with error feedback, whose checkpoint also
  holds the weight policy's older version and the error-feedback buffers, and for an MoE GPT in bf16 with
  the routers' expert bias (a buffer). Before the fix of issue 29 the
  resumed run failed on a GPU at its first step ("scalar tensor is expected to be on cuda:0 but is on cpu").
- A checkpoint moves CPU -> device -> CPU: iterations 1..4 on the CPU, 5..6 on the device from the
  CPU's checkpoint, 7..8 back on the CPU from the device's (fp32, AdamW, dropout 0). On the CPU that is
  bitwise the uninterrupted CPU run; on a GPU each iteration's loss is within 1e-4 and grad norm within
  1e-3 relative of it (fp32 on other kernels; losing the optimizer state on the way, --no-load-optim,
  moves the losses of iterations 6..8 by 4e-4 to 4e-3 and their grad norms by 0.3 % to 2.6 % on this
  project's CPU).

The asynchronous methods in the single-process emulator: tests/test_cuda_emulator.py.
"""

import pytest
from cuda_harness import one_thread  # noqa: F401  (autouse fixture)
from cuda_harness import DEVICES, pretrain_cli, tiny_args

CASES = {
    "1f1b-bf16": {"--bf16": True},
    "2bw-ef-fp32": {"--pipeline-method": "pipedream-2bw", "--async-error-feedback": True,
                    "--untie-embeddings-and-output-weights": True},
    # MoE: bf16 experts with fp32 main params, and the routers' expert bias (an fp32 buffer on the device)
    "moe-bf16-expert-bias": {"--bf16": True, "--num-experts": 4, "--moe-router-topk": 2,
                             "--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": True,
                             "--moe-aux-loss-coeff": 0.01},
}


def curve(records) -> list[tuple]:
    return [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in records]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_resume_on_the_same_device_is_bitwise(device, case, tmp_path):
    flags = {**CASES[case], "--deterministic": True, "--save-interval": 4}
    ckpt = str(tmp_path / "ck")
    straight = pretrain_cli(tiny_args(tmp_path / "straight", **flags, **{"--save": ckpt}), device, tmp_path / "straight")
    resumed = pretrain_cli(tiny_args(tmp_path / "resumed", **flags, **{"--load": ckpt, "--ckpt-step": 4,
                                                                        "--save": str(tmp_path / "ck2")}),
                           device, tmp_path / "resumed")
    assert [r["iteration"] for r in straight] == list(range(1, 9))
    assert curve(resumed) == curve(straight[4:])


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_moves_from_the_cpu_to_the_device_and_back(device, tmp_path):
    flags = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--save-interval": 2}
    on_cpu, on_device = str(tmp_path / "ck_cpu"), str(tmp_path / "ck_device")
    straight = pretrain_cli(tiny_args(tmp_path / "straight", **flags, **{"--save": on_cpu}), "cpu", tmp_path / "straight")
    middle = pretrain_cli(tiny_args(tmp_path / "middle", **flags, **{"--load": on_cpu, "--ckpt-step": 4,
                                                                      "--exit-interval": 6, "--save": on_device}),
                          device, tmp_path / "middle")
    back = pretrain_cli(tiny_args(tmp_path / "back", **{**flags, "--load": on_device, "--save-interval": None}), "cpu", tmp_path / "back")
    moved = middle + back
    assert [r["iteration"] for r in moved] == [5, 6, 7, 8]
    if device == "cpu":
        assert curve(moved) == curve(straight[4:])
        return
    for got, want in zip(moved, straight[4:]):
        assert abs(got["lm_loss"] - want["lm_loss"]) <= 1e-4, (curve(moved), curve(straight[4:]))
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-3 * want["grad_norm"], (curve(moved), curve(straight[4:]))
