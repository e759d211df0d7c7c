"""The asynchronous emulator on a GPU (tests/cuda_harness.py: each test on "cpu" everywhere and on "cuda" where
there is one), for every asynchronous method of issue 29: PipeOptim with AdamW and with Muon, PipeDream,
PipeDream-2BW with error feedback (k = 4) and PipeNAG; D = 4 stages of the tiny GPT, fp32, segments of
8 micro-batches (each ends with a drain, where checkpoints are taken).

- On the device it equals the emulator on the CPU for a segment: every micro-batch's loss within 1e-4
  and every weight within 1e-3 absolute (the lr: one AdamW step of an element) and 1e-3 relative in
  norm per tensor, at a constant lr that keeps the stream from amplifying rounding (cuda_harness.GENTLE_LR:
  a 1e-7 relative perturbation of the weights moved losses by <= 1e-6 and weights by <= 3e-6), Muon's
  Newton-Schulz in fp32 (cuda_harness.GENTLE_EXTRA: bf16 kernels round differently on the two devices).
- Resume on the same device is bitwise: two segments against one segment, a checkpoint of every stage
  (cuda_harness.save_emulator: weights, optimizer state, the policy's versions and error-feedback buffers),
  a fresh emulator loading it, one segment; with the lr changing every step, deterministic kernels on a
  GPU. The loaded state sits where the uninterrupted run's steps put it (device, dtype, shape).
- A checkpoint moves CPU -> device -> CPU (a segment on each): on the CPU bitwise the uninterrupted CPU
  run, on a GPU within the tolerance above.
"""

import pytest
import torch
from cuda_harness import one_thread  # noqa: F401  (autouse fixture)
from cuda_harness import (DEVICES, EMULATED, SEGMENT, batches_on, build_emulator, deterministic, emulator_state,
                          load_emulator, misplaced, placement, save_emulator, single_process_group, synchronize,
                          use_device)

LOSS_ATOL, WEIGHT_ATOL, WEIGHT_RTOL = 1e-4, 1e-3, 1e-3


def assert_close_runs(losses, weights, ref_losses, ref_weights, exact: bool):
    if exact:
        assert losses == ref_losses
        assert weights.keys() == ref_weights.keys()
        assert all(torch.equal(weights[k], ref_weights[k]) for k in weights), [
            k for k in weights if not torch.equal(weights[k], ref_weights[k])]
        return
    assert len(losses) == len(ref_losses)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_ATOL, (worst, losses, ref_losses)
    assert weights.keys() == ref_weights.keys()
    for k, w in weights.items():
        diff = w - ref_weights[k]
        assert diff.abs().max().item() <= WEIGHT_ATOL, (k, diff.abs().max().item())
        assert diff.norm().item() <= WEIGHT_RTOL * ref_weights[k].norm().item(), (k, diff.norm().item())


def policy_placement(emu) -> dict:
    """Where each stage's weight policy keeps its extra versions (2BW's older weights, error-feedback updates)."""
    out = {}
    for s in emu.stages:
        for i, (p, versions) in enumerate(s.policy.state_dict()["weights"].items()):
            for key, t in versions.items():
                out[(s.rank, i, key)] = (t.device.type, t.dtype, tuple(t.shape), p.device.type, p.dtype)
    return out


def stage_placements(emu) -> list[dict]:
    return [placement(s.chunks, s.optimizers) for s in emu.stages]


@pytest.mark.parametrize("case", list(EMULATED))
@pytest.mark.parametrize("device", DEVICES)
def test_emulator_on_the_device_equals_the_emulator_on_the_cpu(device, case, monkeypatch):
    runs = {}
    for where in ("cpu", device):
        with monkeypatch.context() as mp:
            on = use_device(where, mp)
            emu = build_emulator(case, gentle=True)
            losses = emu.train_segment(batches_on(on), SEGMENT)
            synchronize()
            runs[where] = (losses, emulator_state(emu))
            assert all(misplaced(p, where) == [] for p in stage_placements(emu))
    assert_close_runs(*runs[device], *runs["cpu"], exact=device == "cpu")


@pytest.mark.parametrize("case", list(EMULATED))
@pytest.mark.parametrize("device", DEVICES)
def test_emulator_resume_on_the_same_device_is_bitwise(device, case, tmp_path, monkeypatch):
    get_batch = batches_on(use_device(device, monkeypatch))
    with deterministic(), single_process_group():
        straight = build_emulator(case)
        losses = straight.train_segment(get_batch, SEGMENT) + straight.train_segment(get_batch, SEGMENT)
        first = build_emulator(case)
        assert first.train_segment(get_batch, SEGMENT) == losses[:SEGMENT]
        save_emulator(first, str(tmp_path / "ck"), 1)
        del first
        resumed = build_emulator(case)
        load_emulator(resumed, str(tmp_path / "ck"))
        loaded, loaded_policy = stage_placements(resumed), policy_placement(resumed)
        again = resumed.train_segment(get_batch, SEGMENT)
        synchronize()
    assert loaded == stage_placements(straight) and loaded_policy == policy_placement(straight)
    assert all(misplaced(p, device) == [] for p in loaded)
    assert resumed.steps_taken() == straight.steps_taken()
    assert_close_runs(again, emulator_state(resumed), losses[SEGMENT:], emulator_state(straight), exact=True)


@pytest.mark.parametrize("case", list(EMULATED))
@pytest.mark.parametrize("device", DEVICES)
def test_emulator_checkpoint_moves_from_the_cpu_to_the_device_and_back(device, case, tmp_path, monkeypatch):
    legs = ["cpu", device, "cpu"]
    with single_process_group():
        with monkeypatch.context() as mp:
            use_device("cpu", mp)
            straight = build_emulator(case, gentle=True)
            ref_losses = []
            for _ in legs:
                ref_losses += straight.train_segment(batches_on("cpu"), SEGMENT)
        losses = []
        for i, where in enumerate(legs):
            with monkeypatch.context() as mp:
                on = use_device(where, mp)
                emu = build_emulator(case, gentle=True)
                if i:
                    load_emulator(emu, str(tmp_path / f"leg{i - 1}"))
                    assert all(misplaced(p, where) == [] for p in stage_placements(emu))
                losses += emu.train_segment(batches_on(on), SEGMENT)
                save_emulator(emu, str(tmp_path / f"leg{i}"), i + 1)
                synchronize()
    assert_close_runs(losses, emulator_state(emu), ref_losses, emulator_state(straight), exact=device == "cpu")
