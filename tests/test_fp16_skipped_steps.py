"""fp16 skipped iterations follow Megatron-LM: the lr schedule advances only with an applied update.

Megatron-LM's `train_step` (megatron/training/training.py) steps its scheduler only when the update
succeeded (`if update_successful: opt_param_scheduler.step(increment=batch)`), while `train` advances the
iteration and `consumed_train_samples` on every iteration. So here:
- synchronous: a run whose first steps overflow (fp16, initial loss scale 2^20, hysteresis 1) logs the
  same lr on every skipped iteration and on the first applied one, then the schedule's lrs shifted by the
  skips: lr(i) = the schedule's lr after the samples of the applied iterations before i, with the batch of
  iteration i (with --rampup-batch-size too, whose batch follows every consumed sample); consumed samples
  grow by every iteration's batch. A checkpoint saved after the skips resumes bit for bit (loss, lr, grad
  norm, loss scale).
- asynchronous: each chunk's lr clock (`policy.lr_steps`) counts its applied updates only, the
  schedule's step count (staleness, policies) every step; an emulator with the first steps of every chunk
  overflowing applies lr_fn(applied updates so far) at every step, and a pipeline run resumes bit for bit
  from a checkpoint saved after skipped steps.
"""

import json
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (model init imports it lazily: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)
from dist_harness import run_distributed
from test_async_policies import VOCAB, get_batch, make_cfg
from test_checkpoint import run_capturing, tiny_args

from megatron_po.config import parse_args
from megatron_po.optim.sample_schedule import SampleSchedule

OVERFLOWING = {"--fp16": True, "--initial-loss-scale": 2.0**20, "--hysteresis": 1, "--train-iters": 8,
               "--lr-warmup-iters": 3, "--save-interval": 4}


def records(out, world, extra=(), **flags):
    results = run_distributed(run_capturing, world, args=(tiny_args(out, **flags) + list(extra),), timeout=240)
    assert [c for c, _ in results] == [0] * world, results
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r]


def run_and_resume(tmp_path, world, extra=(), **flags):
    """Every iteration's record of a straight run saving at 4; checks a run resumed there logs the same."""
    ckpt = str(tmp_path / "ckpt")
    straight = records(str(tmp_path / "straight"), world, extra, **flags, **{"--save": ckpt})
    resumed = records(str(tmp_path / "resumed"), world, extra, **flags,
                      **{"--load": ckpt, "--ckpt-step": 4, "--save": str(tmp_path / "ckpt2")})
    keys = ("iteration", "lm_loss", "lr", "grad_norm", "loss_scale", "consumed_samples")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in straight[4:]]
    return straight


@pytest.mark.parametrize("ramp", [False, True], ids=["constant-batch", "rampup-batch-size"])
def test_skipped_iterations_keep_the_lr_and_consume_their_samples(ramp, tmp_path):
    extra = ["--rampup-batch-size", "4", "4", "16"] if ramp else []  # batches 4, 4, 4, 4, 8, ...
    straight = run_and_resume(tmp_path, 1, extra, **OVERFLOWING)
    skipped = [r["skipped_iterations"] > 0 for r in straight]  # logged every iteration: 0 or 1
    assert skipped[:2] == [True, True] and not any(skipped[2:]), skipped  # 2^20 -> 2^19 -> 2^18 fits

    lrs = [r["lr"] for r in straight]
    assert lrs[0] == lrs[1] == lrs[2] < lrs[3]  # the first applied step runs at the lr of a first step

    schedule = SampleSchedule(parse_args(tiny_args(str(tmp_path / "x"), **OVERFLOWING) + extra), 1)
    assert [schedule.batch(i) for i in range(5)] == ([4, 4, 4, 4, 8] if ramp else [8] * 5)
    assert lrs[2] != schedule.lr_at(2)  # which the iteration clock would not give
    updated = 0
    for i, (r, skip) in enumerate(zip(straight, skipped)):
        assert r["consumed_samples"] == schedule.consumed_before(i + 1)  # every iteration consumes its batch
        assert r["lr"] == schedule.lr_at(i, updated=updated)  # the lr of the applied updates' samples
        updated += 0 if skip else schedule.batch(i)


def _emulate_with_overflowing_first_steps():
    """PipeOptim on D = 2 stages, fp16 with every chunk's first steps overflowing; per step of each
    chunk: (lr set, skipped?)."""
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(5)
    cfg = make_cfg(2)
    cfg.precision.fp16, cfg.precision.initial_loss_scale, cfg.precision.hysteresis = True, 2.0**20, 1
    emu = AsyncEmulator(cfg, VOCAB, "pipeoptim", 2, 1, 1, "adam", {"lr": 1e-3}, lambda i: 1e-3 * (1 + i), 0.0)
    log = {s.rank: [] for s in emu.stages}
    for stage in emu.stages:
        step = stage.step

        def logged(c, stage=stage, step=step):
            skipped = stage.skipped_steps[c]
            step(c)
            log[stage.rank].append((stage.optimizers[c].param_groups[0]["lr"], stage.skipped_steps[c] > skipped))
        stage.step = logged
    emu.train_segment(lambda mb: get_batch(mb, mbs=2), 12)
    return log, [(s.steps, s.policy.steps, s.policy.lr_steps, s.skipped_steps) for s in emu.stages]


def test_a_skipped_async_step_does_not_advance_its_chunks_lr_clock():
    [(log, counts)] = run_distributed(_emulate_with_overflowing_first_steps, 1)
    for rank, steps in log.items():
        applied = 0
        for lr, skipped in steps:
            assert lr == pytest.approx(1e-3 * (1 + applied), rel=1e-12)  # lr_fn(applied updates so far)
            applied += not skipped
        assert any(s for _, s in steps) and not all(s for _, s in steps), steps
    for stage_steps, policy_steps, lr_steps, skipped in counts:
        assert stage_steps == policy_steps == [12]  # the schedule's count: every step
        assert lr_steps == [12 - skipped[0]] and skipped[0] > 0


def test_async_pipeline_resumes_exactly_after_skipped_steps(tmp_path):
    # 4 steps per iteration; the first 4 of each chunk overflow (2^22 .. 2^19)
    flags = dict(OVERFLOWING, **{"--initial-loss-scale": 2.0**22, "--pipeline-model-parallel-size": 2,
                                 "--pipeline-method": "pipeoptim", "--untie-embeddings-and-output-weights": True})
    straight = run_and_resume(tmp_path, 2, **flags)
    assert [r["skipped_iterations"] > 0 for r in straight[:3]] == [True, True, False]
    assert straight[0]["lr"] == straight[1]["lr"] < straight[2]["lr"]  # the loss chunk's clock waited
