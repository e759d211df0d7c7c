"""Checkpoints on a GPU, through `pretrain_gpt.py` as a user runs it (tests/cuda_harness.py: each test on "cpu"
everywhere and on "cuda" where there is one; every run with wandb, datasets and nltk unimportable).

- Resume on the same device is bitwise (issue 29's reproduction): 8 iterations saving at 4, against
  loading iteration 4 and running 5..8, with --deterministic and dropout 0.1 (the device's random
  generators restored): every resumed iteration's loss and grad norm equal the uninterrupted run's. For
  1F1B in bf16 (fp32 main params, AdamW), for PipeDream-2BW with error feedback, whose checkpoint also
  holds the weight policy's older version and the error-feedback buffers, and for an MoE GPT in bf16 with
  the routers' expert bias (a buffer), for FSDP2 (DTensor shards) and for DeepSeek-V3's pieces (MLA, an MTP
  depth, group routing). Before the fix of issue 29 the
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
import torch
from cli_args import flags_to_argv
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
    # FSDP2 (one rank): DTensor shards of fp32 master weights under a bf16 compute policy, loaded into the
    # shards a fresh run creates on the device
    "fsdp2-bf16": {"--bf16": True, "--use-torch-fsdp2": True},
    # DeepSeek-V3's pieces: multi-latent attention (YaRN), one multi-token-prediction depth, group-limited
    # sigmoid routing with the expert bias, in bf16
    "mla-mtp-moe-bf16": {"--bf16": True, "--multi-latent-attention": True, "--q-lora-rank": 32,
                         "--kv-lora-rank": 32, "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16,
                         "--position-embedding-type": "rope", "--rope-type": "yarn", "--rotary-scaling-factor": 4,
                         "--mtp-num-layers": 1,
                         "--num-experts": 4, "--moe-router-topk": 2, "--moe-router-num-groups": 2,
                         "--moe-router-group-topk": 1, "--moe-router-score-function": "sigmoid",
                         "--moe-router-enable-expert-bias": True},
}
# A run from an imported checkpoint: its model flags come from the import's flag line
TINY_FROM_IMPORT = {"--seq-length": 32, "--micro-batch-size": 2, "--global-batch-size": 4, "--train-iters": 2,
                    "--lr": 1e-3, "--min-lr": 1e-3, "--lr-warmup-iters": 0, "--log-interval": 1, "--eval-iters": 0,
                    "--seed": 5, "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": 127,
                    "--make-vocab-size-divisible-by": 16}


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


@pytest.mark.parametrize("device", DEVICES)
def test_a_hugging_face_import_trains_on_the_device(device, tmp_path):
    """A Qwen3-MoE built by transformers (fp32, q/k norms, 4 experts) imported by `import-hf` (a DCP checkpoint
    written on the CPU) and trained 2 iterations from it on `device` with the flag line the import printed: the
    state loads into the tensors the run made on the device (a CPU tensor left in the model or its optimizer fails
    the step on a GPU), and the losses are the CPU run's (bitwise on the CPU; on a GPU within 1e-4, fp32 on other
    kernels)."""
    from test_hf_continue_training import imported_qwen3_moe
    line = imported_qwen3_moe(tmp_path)
    assert line[line.index("--load") + 1] == str(tmp_path / "imported") and "--finetune" in line

    def run(where):
        out = tmp_path / where
        flags = {**TINY_FROM_IMPORT, "--data-cache-path": str(out / "cache"), "--metrics-file": str(out / "metrics.jsonl")}
        return curve(pretrain_cli(line + flags_to_argv(flags), where, out))

    on_cpu, on_device = run("cpu"), (run(device) if device != "cpu" else None)
    assert [i for i, *_ in on_cpu] == [1, 2]
    if on_device is None:
        return
    for (_, loss, norm), (_, want_loss, want_norm) in zip(on_device, on_cpu):
        assert abs(loss - want_loss) <= 1e-4 and abs(norm - want_norm) <= 1e-3 * want_norm, (on_device, on_cpu)
