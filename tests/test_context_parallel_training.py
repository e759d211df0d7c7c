"""Context parallelism in whole runs: asynchronous pipelines against the emulator, the distributed optimizer,
FP8, pretrain_gpt.py's entry and checkpoints across CP sizes.

- PipeOptim (and PipeDream) at PP = 2 x CP = 2 equal the single-process emulator (`AsyncEmulator`, CP = 1) on the
  same micro-batches: per-micro-batch losses (the mean over the CP ranks, each holding its tokens' share), the
  evaluation loss and the final weights, rtol 1e-5 / atol 1e-6 (momentum SGD, as the DP x PP and TP x PP cases of
  tests/test_async_pipeline.py: CP changes the order of the attention's and the gradient reduction's sums); the
  two CP ranks of a stage hold bit-identical weights.
- The distributed optimizer sharded over DP x CP, with PipeOptim's packed prediction gather, equals the plain
  optimizer bitwise at PP = 2 x CP = 2 (gloo's reduce-scatter is an all-reduce over the same two ranks).
- Through `training.run_main` on mock data (AdamW, 8 iterations): CP = 2 follows CP = 1's loss curve within 1e-5,
  PipeOptim at PP = 2 x CP = 2 follows PP = 2's and DP = 2 x CP = 2 with the distributed optimizer (sharded over
  DP x CP) follows DP = 2's within 1e-5 (measured 4.8e-7, the losses ~4.8); FP8
  (torchao, emulated; its tensorwise scales see each rank's tokens, so the FP8 roundings differ) within 2e-3 of
  CP = 1 under FP8 (measured 6.2e-4), as TP = 2 is held in tests/test_fp8.py.
- Checkpoints: CP shards no weights, so a run saved at CP = 2 resumes at CP = 1 and at CP = 4 (its 4 next losses
  within 1e-5 of CP = 2's own continuation; measured 4.8e-7 and 6.0e-7) and at CP = 2 bit for bit; with the
  distributed optimizer too (its shards over DP x CP: 2, then 1 and 4).
- Bad input (CP not dividing the world, a sequence not cut into 2 x CP chunks, attention dropout, Megatron's a2a
  comm type): exit code 2 and one line from the entry point; every CP rule's line is a row of
  tests/test_config_rules.py.
"""

import os
from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)
from dist_harness import run_distributed
from test_checkpoint import losses, train

from megatron_po import parallel_state as ps
from megatron_po.data.context_split import split_for_this_rank

CP_FLAGS = {"--context-parallel-size": 2}


# ---- asynchronous pipelines: distributed PP x CP against the emulator --------------------------------------


def _train_split(method, optimizer, segments, clip_grad=0.0, precision=None):
    """test_async_pipeline.train_distributed's run (PP ranks, DP = 1) with every batch, training and evaluation,
    split into this CP rank's chunks; returns (losses, eval loss, weights, CP rank, PP rank)."""
    from test_async_pipeline import EVAL, get_batch, lr_fn_for, make_cfg, model_parallel_seed, optimizer_kwargs
    from test_async_policies import SEED, VOCAB

    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
    model_parallel_seed(SEED)
    cfg = make_cfg(2)
    cfg.parallel.ddp_bucket_size = 3000  # several buckets, shards cutting through parameters
    for key, value in (precision or {}).items():
        setattr(cfg.precision, key, value)
    rank = AsyncPipelineRank(cfg, VOCAB, method, 1, 1, optimizer, optimizer_kwargs(optimizer), lr_fn_for(optimizer),
                             clip_grad)
    losses = []
    for i, m in enumerate(segments):
        out = rank.train_segment(lambda mb: split_for_this_rank(get_batch(mb)), m)
        losses = None if out is None else losses + out
        if i == 0:
            eval_loss = rank.evaluate([split_for_this_rank(b) for b in EVAL])
    return losses, eval_loss, rank.full_state_dict(), ps.get_context_parallel_rank(), \
        ps.get_pipeline_model_parallel_rank()


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_async_pp2_cp2_equals_the_emulator(method):
    from test_async_pipeline import train_emulator
    args = (method, "sgd", 2, 1, 1, (4, 4))
    emu_losses, emu_eval, emu_weights, _ = run_distributed(partial(train_emulator, clip_grad=0.05), 1, args=args)[0]
    results = run_distributed(partial(_train_split, clip_grad=0.05), 4, pp=2, cp=2, args=(method, "sgd", (4, 4)))
    last = [r for r in results if r[4] == 1]
    cp_mean = [sum(x) / len(last) for x in zip(*(r[0] for r in last))]  # each CP rank: its tokens' share x CP
    torch.testing.assert_close(torch.tensor(cp_mean), torch.tensor(emu_losses), rtol=1e-5, atol=1e-6)
    assert abs(sum(r[1] for r in last) / len(last) - emu_eval) < 1e-5
    for stage in (0, 1):  # the CP ranks of a stage hold the same weights, bit for bit
        a, b = (r[2] for r in results if r[4] == stage)
        assert all(torch.equal(a[k], b[k]) for k in a)
    weights = {**results[0][2], **results[2][2]}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], emu_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def _plain_and_sharded():
    plain = _train_split("pipeoptim", "adam", (4, 4))
    sharded = _train_split("pipeoptim", "adam", (4, 4), precision={"use_distributed_optimizer": True})
    return plain, sharded


def test_distributed_optimizer_over_dp_x_cp_equals_plain_under_pipeoptim():
    """Sharded over the 2 CP ranks of each stage (DP = 1): PipeOptim's prediction of the own shard and its packed
    all-gather with the update give the plain optimizer's run bitwise."""
    for plain, sharded in run_distributed(_plain_and_sharded, 4, pp=2, cp=2):
        if plain[0] is not None:
            assert sharded[0] == plain[0] and sharded[1] == plain[1]
        assert all(torch.equal(sharded[2][k], plain[2][k]) for k in plain[2])


# ---- whole runs through pretrain_gpt.py's entry ------------------------------------------------------------------


def _run(tmp_path, name, world, **flags):
    """test_checkpoint's tiny run, 8 iterations, without dropout (CP needs none on the attention; hidden dropout
    would draw other masks for other token layouts)."""
    return losses(train(str(tmp_path / name), world, **{"--train-iters": 8, "--global-batch-size": 4,
                                                        "--eval-interval": 4, "--attention-dropout": 0.0,
                                                        "--hidden-dropout": 0.0, **flags}))


def max_delta(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_cp2_run_follows_cp1(tmp_path):
    one = _run(tmp_path, "cp1", 1)
    two = _run(tmp_path, "cp2", 2, **CP_FLAGS)
    assert len(one) == 8 and max_delta(two, one) <= 1e-5


def test_pipeoptim_pp2_cp2_run_follows_pp2(tmp_path):
    flags = {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
             "--untie-embeddings-and-output-weights": True}
    pp2 = _run(tmp_path, "pp2", 2, **flags)
    pp2_cp2 = _run(tmp_path, "pp2cp2", 4, **flags, **CP_FLAGS)
    assert max_delta(pp2_cp2, pp2) <= 1e-5


def test_cp2_dp2_distributed_optimizer_follows_dp2(tmp_path):
    """Synchronous training with the distributed optimizer sharded over DP x CP (4 shards) against DP = 2 (2)."""
    flags = {"--use-distributed-optimizer": True, "--global-batch-size": 8}
    dp2 = _run(tmp_path, "dp2", 2, **flags)
    dp2_cp2 = _run(tmp_path, "dp2cp2", 4, **flags, **CP_FLAGS)
    assert max_delta(dp2_cp2, dp2) <= 1e-5


def test_cp2_under_fp8_follows_cp1(tmp_path):
    fp8 = {"--fp8-format": "hybrid"}
    one = _run(tmp_path, "cp1", 1, **fp8)
    two = _run(tmp_path, "cp2", 2, **fp8, **CP_FLAGS)
    assert max_delta(two, one) <= 2e-3


# ---- checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_checkpoint_saved_at_cp2_resumes_at_cp1_cp4_and_bitwise_at_cp2(tmp_path, optimizer):
    """With the distributed optimizer the shards change with CP (DP x CP of them): 2, then 1 and 4."""
    flags = {**CP_FLAGS, "--seq-length": 32, "--save-interval": 4,
             "--use-distributed-optimizer": optimizer == "distributed"}
    ckpt = str(tmp_path / "ckpt")
    straight = _run(tmp_path, "straight", 2, **flags, **{"--save": ckpt})
    assert os.path.isdir(ckpt) and len(straight) == 8
    resume = {"--load": ckpt, "--ckpt-step": 4}
    same = _run(tmp_path, "same", 2, **flags, **resume, **{"--save": str(tmp_path / "ck2")})
    assert same == straight[4:]  # bit for bit at the same CP
    for cp, world in ((1, 1), (4, 4)):
        other = _run(tmp_path, f"cp{cp}", world, **{**flags, "--context-parallel-size": cp}, **resume,
                     **{"--save": str(tmp_path / f"ck-cp{cp}")})
        assert max_delta(other, straight[4:]) <= 1e-5, (cp, other, straight[4:])


# ---- bad input: one line at start-up -------------------------------------------------------------------------

BAD = {  # id: (world size, flags, words of the line)
    "cp-vs-world": (3, {"--context-parallel-size": 2}, ["world size 3 is not divisible", "--context-parallel-size (2)"]),
    "seq-vs-2cp": (4, {"--context-parallel-size": 4, "--seq-length": 36},
                   ["--seq-length (36) is not divisible by 2 x --context-parallel-size (4) = 8"]),
    "attention-dropout": (2, {"--context-parallel-size": 2, "--attention-dropout": 0.1},
                          ["--attention-dropout 0.1", "add --attention-dropout 0"]),
    "comm-type": (2, {"--context-parallel-size": 2, "--cp-comm-type": "a2a"}, ["--cp-comm-type", "a2a"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_context_parallel_input_is_one_line_at_start_up(case, tmp_path, monkeypatch, capsys):
    """Through run_main before any process group (the world size read from the launch environment): exit code
    2 and one `error:` line naming the flags."""
    from test_checkpoint import tiny_args

    from megatron_po.training import run_main
    world, flags, words = BAD[case]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = run_main(tiny_args(str(tmp_path), **{"--attention-dropout": 0.0, **flags}))
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
