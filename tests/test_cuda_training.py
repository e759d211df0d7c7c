"""Training on a GPU (tests/cuda_harness.py: each test runs on "cpu" everywhere and on "cuda" where there is one).

- Placement: the whole loop (`training.run_main`, this process) trains a tiny GPT on mock data on the
  device; parameters, gradients, the tensors the optimizer steps and its per-element state live there,
  step counters are 0-dim float32 CPU tensors (torch.optim's convention), batches arrive there. Resuming
  from the checkpoint the run saved leaves every one of them with the device, dtype and shape a step
  gave it, before and after the resumed run's steps (the loaded step counters landed on the GPU before
  the fix of issue 29: "scalar tensor is expected to be on cuda:0 but is on cpu"). For fp32 AdamW, bf16
  Muon, fp16 AdamW (loss scaler), the bf16 distributed optimizer and asynchronous PipeOptim (bf16).
- bf16 and fp16 training stay close to fp32: the same 8 iterations (AdamW, lr 1e-3, clip 1.0, dropout
  0), every iteration's loss within 0.01 (bf16) and 0.002 (fp16 from a loss scale of 2^12, no step
  skipped) of fp32's: 50x what this project's CPU gives (0.00021 and 0.00004), for the GPU's other
  kernels (tensor-core accumulation, flash attention); the loss moves by 0.08 over the 8 iterations.
- Activation recomputation (full uniform, full block, selective) gives bitwise the losses and gradients of
  the run without it, dropout 0.1 on (the device's random generator replayed), for one model and for
  PipeOptim in the emulator (weights change between a micro-batch's forward and backward); the GPU runs
  with deterministic kernels.
- Checkpoint integrity: a checkpoint saved from the device holds checksums.json, loads verified, and a
  garbled shard fails the load with one line naming the file and its SHA-256 mismatch.
"""

import dataclasses
import glob
import json
import os

import pytest
import torch
from cuda_harness import one_thread  # noqa: F401  (autouse fixture)
from cuda_harness import DEVICES, deterministic, misplaced, placement, synchronize, tiny_args, use_device

from megatron_po import training
from megatron_po.gpt_workload import GPTWorkload
from megatron_po.training import run_main


def observed_run(argv, monkeypatch) -> dict:
    """run_main(argv) in this process, watched: the model's placement right after the set-up and resume
    ("loaded") and after training ("trained"), the (device, dtype) of every gradient the backward produced,
    the devices of every batch tensor, the exit code."""
    seen = {"grads": set(), "batches": set()}
    real_resume, real_microbatches = training.resume, GPTWorkload.microbatches

    def on_grad(p):
        g = p.grad if p.grad is not None else p.main_grad
        seen["grads"].add((g.device.type, g.dtype))

    def resume(cfg, model):
        state = real_resume(cfg, model)
        seen["model"] = model
        seen["loaded"] = placement(model.chunks, model.optimizer)
        for chunk in model.chunks:
            for p in chunk.parameters():
                p.register_post_accumulate_grad_hook(on_grad)
        return state

    def microbatches(self, *args, **kwargs):
        out = real_microbatches(self, *args, **kwargs)
        seen["batches"] |= {v.device.type for b in out for v in b.values() if torch.is_tensor(v)}
        return out

    monkeypatch.setattr(training, "resume", resume)
    monkeypatch.setattr(GPTWorkload, "microbatches", microbatches)
    seen["code"] = run_main(argv)
    seen["trained"] = placement(seen["model"].chunks, seen["model"].optimizer)
    return seen


PLACEMENT_CASES = {
    "adamw-fp32": {},
    "muon-bf16": {"--optimizer": "muon", "--bf16": True},
    "adamw-fp16": {"--fp16": True, "--initial-loss-scale": 4096},
    "distopt-bf16": {"--bf16": True, "--use-distributed-optimizer": True},
    "pipeoptim-bf16": {"--bf16": True, "--pipeline-method": "pipeoptim", "--untie-embeddings-and-output-weights": True},
}


@pytest.mark.parametrize("case", list(PLACEMENT_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_training_state_lives_where_a_step_puts_it_also_after_a_resume(device, case, tmp_path, monkeypatch):
    use_device(device, monkeypatch)
    flags = {**PLACEMENT_CASES[case], "--train-iters": 4, "--save-interval": 2, "--save": str(tmp_path / "ck")}
    first = observed_run(tiny_args(tmp_path / "first", **flags, **{"--exit-interval": 2}), monkeypatch)
    assert first["code"] == 0
    assert misplaced(first["loaded"], device) == []  # fresh: parameters on the device, no state yet
    assert not any(k.startswith("state ") for k in first["loaded"])
    assert misplaced(first["trained"], device) == []
    assert any(k.endswith(" step") for k in first["trained"])  # step counters exist (checked on the CPU above)
    assert {d for d, _ in first["grads"]} == {device} and first["batches"] == {device}

    resumed = observed_run(tiny_args(tmp_path / "resumed", **flags, **{"--load": str(tmp_path / "ck")}),
                           monkeypatch)
    assert resumed["code"] == 0
    assert resumed["loaded"] == first["trained"]  # loaded in place: the devices, dtypes and shapes a step gave
    assert resumed["trained"] == first["trained"]
    assert {d for d, _ in resumed["grads"]} == {device} and resumed["batches"] == {device}


# ---- bf16 and fp16 against fp32 ----------------------------------------------------------------------------

PRECISIONS = {"fp32": ({}, 0.0), "bf16": ({"--bf16": True}, 0.01),
              "fp16": ({"--fp16": True, "--initial-loss-scale": 4096}, 0.002)}


def run_losses(out, monkeypatch, **flags) -> list[dict]:
    code = run_main(tiny_args(out, **{"--hidden-dropout": 0.0, "--attention-dropout": 0.0, **flags}))
    assert code == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_fp16_losses_stay_close_to_fp32(device, tmp_path, monkeypatch):
    use_device(device, monkeypatch)
    runs = {name: run_losses(str(tmp_path / name), monkeypatch, **flags) for name, (flags, _) in PRECISIONS.items()}
    reference = [r["lm_loss"] for r in runs["fp32"]]
    assert len(reference) == 8 and max(reference) - min(reference) > 0.05  # the weights moved
    for name, (_, tolerance) in PRECISIONS.items():
        losses = [r["lm_loss"] for r in runs[name]]
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        assert len(losses) == 8 and worst <= tolerance, (name, worst, losses, reference)
    assert [r["skipped_iterations"] for r in runs["fp16"]] == [0] * 8
    assert all(r["loss_scale"] == 4096 for r in runs["fp16"])


# ---- activation recomputation ------------------------------------------------------------------------------

RECOMPUTE = {"full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective")}


def with_recompute(cfg, recompute: dict):
    cfg.model = dataclasses.replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1, **recompute)
    return cfg


def one_model_run(device, recompute: dict):
    """Losses and gradients of two micro-batches through one GPT (3 layers) on `device`."""
    from test_async_policies import SEED, VOCAB, make_cfg

    from cuda_harness import batches_on
    from megatron_po.models.gpt import GPTModel, masked_mean_loss
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(SEED)
    model = GPTModel(with_recompute(make_cfg(3), recompute).model, VOCAB, SEED).to(device)
    get_batch = batches_on(device)
    losses = []
    for mb in range(2):
        b = get_batch(mb)
        loss = masked_mean_loss(model(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
        loss.backward()
        losses.append(loss.detach().cpu())
    return losses, {k: p.grad.cpu() for k, p in model.named_parameters()}


def emulated_run(device, recompute: dict):
    """Losses and weights after 8 micro-batches of PipeOptim (AdamW) in the D = 4 emulator on `device`."""
    from test_async_policies import make_cfg

    from cuda_harness import batches_on, build_emulator, emulator_state
    emu = build_emulator("pipeoptim-adamw", with_recompute(make_cfg(4), recompute))
    return emu.train_segment(batches_on(device), 8), emulator_state(emu)


def assert_equal(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert torch.equal(a[k], b[k]), f"{what}: {k}"
    else:
        assert len(a) == len(b) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b)), what


@pytest.mark.parametrize("granularity", list(RECOMPUTE))
@pytest.mark.parametrize("device", DEVICES)
def test_recomputation_changes_nothing(device, granularity, monkeypatch):
    where = use_device(device, monkeypatch)
    with deterministic():
        for run in (one_model_run, emulated_run):
            plain_losses, plain_state = run(where, {})
            losses, state = run(where, RECOMPUTE[granularity])
            synchronize()
            assert_equal(losses, plain_losses, f"{run.__name__} losses")
            assert_equal(state, plain_state, run.__name__)


# ---- checkpoint integrity ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_saved_from_the_device_is_verified_on_load(device, tmp_path, monkeypatch, capsys):
    use_device(device, monkeypatch)
    ckpt = str(tmp_path / "ck")
    flags = {"--bf16": True, "--train-iters": 2, "--save-interval": 2, "--save": ckpt}
    assert run_main(tiny_args(tmp_path / "save", **flags)) == 0
    saved = os.path.join(ckpt, "iter_0000002")
    with open(os.path.join(saved, "checksums.json")) as f:
        listed = json.load(f)
    shards = sorted(glob.glob(os.path.join(saved, "*.distcp")))
    assert shards and all(os.path.basename(s) in json.dumps(listed) for s in shards)
    capsys.readouterr()
    loading = {**flags, "--train-iters": 3, "--load": ckpt, "--save": None, "--save-interval": None}
    assert run_main(tiny_args(tmp_path / "load", **loading)) == 0  # verified, then one more iteration
    with open(shards[0], "r+b") as f:  # same size, garbled start
        f.write(b"\0" * 64)
    capsys.readouterr()
    code = run_main(tiny_args(tmp_path / "bad", **loading))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and os.path.basename(shards[0]) in lines[0] and "SHA-256" in lines[0], err
