"""Asynchronous pipelines at scale: evaluation inside the stream leaves training untouched.

- Emulator: evaluating at the cuts before micro-batches 4, 8 and 12 gives bit for bit the losses and
  final weights of the run without evaluation (PipeOptim, PipeDream, 2BW; straight and interleaved); the
  values differ between cuts, and the one at the segment's end equals a drained evaluation after it.
- Distributed PP=2 equals the emulator bit for bit, evaluation values included.
- Through pretrain (PP=2 x DP=2): the loss curve is bitwise the same with --eval-interval 5 and 1000.
"""

from functools import partial

import pytest
import torch
from dist_harness import run_distributed
from test_async_pipeline import EVAL, optimizer_kwargs
from test_async_policies import SEED, VOCAB, get_batch, lr_fn_for, make_cfg

from megatron_po import parallel_state as ps
from megatron_po.errors import ConfigError
from megatron_po.pipeline.async_pipeline import AsyncEmulator, AsyncPipelineRank, segment_schedule
from megatron_po.pipeline.cuts import iteration_cuts
from megatron_po.pipeline.schedules import Backward, Forward, Schedule
from megatron_po.tensor_parallel import model_parallel_seed

EVAL_AT = (4, 8, 12)


def emulate_with_evaluations(method, optimizer, D, v, k, n, eval_at=EVAL_AT, **options):
    model_parallel_seed(SEED)
    emu = AsyncEmulator(make_cfg(D * v), VOCAB, method, D, v, k, optimizer, optimizer_kwargs(optimizer),
                        lr_fn_for(optimizer), **options)
    evals = {}
    evaluations = {at: (lambda at=at: evals.__setitem__(at, emu.evaluate(EVAL))) for at in eval_at}
    losses = emu.train_segment(lambda mb: get_batch(mb), n, evaluations=evaluations)
    evals["drained"] = emu.evaluate(EVAL)
    return losses, evals, emu.full_state_dict()


def distributed_with_evaluations(method, optimizer, v, k, n, eval_at=EVAL_AT, **options):
    model_parallel_seed(SEED)
    D = ps.get_pipeline_model_parallel_world_size()
    rank = AsyncPipelineRank(make_cfg(D * v), VOCAB, method, v, k, optimizer, optimizer_kwargs(optimizer),
                             lr_fn_for(optimizer), **options)
    evals = {}
    evaluations = {at: (lambda at=at: evals.__setitem__(at, rank.evaluate(EVAL))) for at in eval_at}
    losses = rank.train_segment(lambda mb: get_batch(mb), n, evaluations=evaluations)
    drained = rank.evaluate(EVAL)
    if drained is not None:
        evals["drained"] = drained
    return losses, evals, rank.full_state_dict()


CASES = [("pipeoptim", "adam", 3, 1, 1), ("pipedream", "adam", 3, 1, 1), ("pipedream-2bw", "adam", 2, 1, 2),
         ("pipeoptim", "sgd", 2, 2, 1)]


@pytest.mark.parametrize("method,optimizer,D,v,k", CASES, ids=[f"{c[0]}-D{c[2]}v{c[3]}" for c in CASES])
def test_evaluation_in_the_stream_changes_nothing(method, optimizer, D, v, k):
    def both():
        plain = emulate_with_evaluations(method, optimizer, D, v, k, 12, eval_at=())
        evaluated = emulate_with_evaluations(method, optimizer, D, v, k, 12)
        return plain, evaluated
    (losses, _, weights), (losses_e, evals, weights_e) = run_distributed(both, 1)[0]
    assert losses == losses_e  # bit for bit
    assert weights.keys() == weights_e.keys() and all(torch.equal(weights[n], weights_e[n]) for n in weights)
    drained = evals.pop("drained")
    assert sorted(evals) == list(EVAL_AT) and all(torch.isfinite(torch.tensor(x)) for x in evals.values())
    assert evals[4] != evals[8]  # the weights moved in between
    assert evals[12] == drained  # the cut at the end of the segment is the drained pipeline


def test_distributed_in_stream_evaluation_equals_the_emulator():
    emu = run_distributed(partial(emulate_with_evaluations, "pipeoptim", "adam", 2, 1, 1, 12), 1)[0]
    results = run_distributed(partial(distributed_with_evaluations, "pipeoptim", "adam", 1, 1, 12), 2, pp=2)
    losses, evals, _ = results[1]
    assert losses == emu[0] and evals == emu[1]  # bit for bit (PP only, one thread)
    assert results[0][1] == {4: None, 8: None, 12: None}  # the first stage takes part, the last one holds the loss


def test_cuts_are_where_the_next_iteration_starts():
    """Straight async 1F1B: rank r stops before F(N); it has run B(j) for j < N - (D-r-1), so exactly
    one gradient (of micro-batch N - (D-r-1)) is on its way to it; a cut that would wait is refused."""
    schedule = segment_schedule(3, 1, 12, 1)
    cuts = iteration_cuts(schedule, [6, 12])
    for r, i in cuts[6].items():
        assert schedule.ops[r][i] == Forward(6)
        done = schedule.ops[r][:i]
        assert Backward(6 - (3 - r - 1) - 1) in done and Backward(6 - (3 - r - 1)) not in done
    assert cuts[12] == {r: len(ops) for r, ops in schedule.ops.items()}  # after the last op: the drain
    interleaved = segment_schedule(2, 2, 8, 1)
    assert all(interleaved.ops[r][i] == Forward(4, 0) for r, i in iteration_cuts(interleaved, [4])[4].items())
    # rank 1 would need F(0) of rank 0 before its cut, which rank 0 runs after its own
    bad = Schedule("made-up", 2, 1, 2, {0: [Forward(1), Forward(0)], 1: [Forward(0), Forward(1)]})
    with pytest.raises(ConfigError, match="cannot stop before micro-batch 1"):
        iteration_cuts(bad, [1])


# ---- through pretrain: PP=2 x DP=2 ------------------------------------------------------------------

@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_loss_curve_is_bitwise_the_same_whatever_the_eval_interval(corpus, tmp_path, method):
    from test_pretrain_gpt import ASYNC, run_layout
    flags = dict(ASYNC, **{"--pipeline-method": method, "--log-interval": 1, "--train-iters": 10})
    often = run_layout(corpus, tmp_path, "often", 4, **dict(flags, **{"--eval-interval": 5}))
    never = run_layout(corpus, tmp_path, "never", 4, **dict(flags, **{"--eval-interval": 1000}))
    curve = lambda records: [r["lm_loss"] for r in records if "lm_loss" in r]  # noqa: E731
    assert len(curve(often)) == 10 and curve(often) == curve(never)  # bit for bit
    assert [r["iteration"] for r in often if "val_loss" in r] == [5, 10]
    assert [r["iteration"] for r in never if "val_loss" in r] == [10]
    five = next(r for r in often if r["iteration"] == 5)
    assert "lm_loss" in five and "val_loss" in five  # the validation joins its iteration's record


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_saves_leave_training_untouched_and_resume_exactly(corpus, tmp_path, method):
    """With --async-drain-interval the drains are the same with and without --save-interval: the run that
    saves (at 4 and 8, exiting at 8) has the loss curve of the run that never saves, bit for bit, and
    the run resumed from its checkpoint continues that curve bit for bit."""
    from test_pretrain_gpt import ASYNC, run_layout
    flags = dict(ASYNC, **{"--pipeline-method": method, "--log-interval": 1, "--async-drain-interval": 4,
                           "--eval-interval": 3})
    curve = lambda records: [r["lm_loss"] for r in records if "lm_loss" in r]  # noqa: E731
    straight = curve(run_layout(corpus, tmp_path, "straight", 4, **flags))
    ckpt = str(tmp_path / "ckpt")
    first = curve(run_layout(corpus, tmp_path, "first", 4, **flags, **{"--save": ckpt, "--save-interval": 4,
                                                                       "--exit-interval": 8}))
    resumed = curve(run_layout(corpus, tmp_path, "resumed", 4, **flags, **{"--load": ckpt}))
    assert len(straight) == 12 and first == straight[:8] and resumed == straight[8:]  # bit for bit


# ---- asynchronous DP: bucketed gradient all-reduce issued from the backward ---------------------------

def _record_dp_reduces(log, rank):
    """Wrap each chunk's DDP: note every bucket launch and whether the step's finish_grad_sync made it."""
    for ddp in rank.stage.ddps:
        launch, finish, state = ddp._launch, ddp.finish_grad_sync, {"in_finish": False}

        def recording_launch(bucket, launch=launch, state=state, ddp=ddp):
            if bucket.handle is None:
                log.append((ddp.buckets.index(bucket), len(ddp.buckets), state["in_finish"]))
            launch(bucket)

        def recording_finish(finish=finish, state=state):
            state["in_finish"] = True
            finish()
            state["in_finish"] = False
        ddp._launch, ddp.finish_grad_sync = recording_launch, recording_finish


def dp_reduce_launches(method):
    from test_async_pipeline import train_distributed
    log = []
    train_distributed(method, "sgd", 1, 1, (6,), mbs=4, on_rank=partial(_record_dp_reduces, log))
    return log


def test_async_dp_gradient_reduce_is_bucketed_and_issued_during_the_backward():
    """PP=2 x DP=2, PipeOptim, plain fp32 optimizer (no distributed optimizer): every step all-reduces
    the chunk's several buckets, each launched by the backward hooks (not by the step), once per bucket."""
    results = run_distributed(partial(dp_reduce_launches, "pipeoptim"), 4, pp=2, timeout=240)
    for log in results:
        num_buckets = log[0][1]
        assert num_buckets > 1  # bucket size 3000 elements
        assert len(log) == 6 * num_buckets  # 6 steps (k = 1), each bucket once per step
        assert not any(in_finish for _, _, in_finish in log)  # all issued from the backward hooks


# ---- PipeOptim over ZeRO-1 shards: one packed all-gather per micro-batch ------------------------------

def _count_gathers(precision, old_path=False):
    """PP=2 x DP=2 PipeOptim (Adam, k = 1) with the distributed optimizer over 8 micro-batches: the
    parameter all-gathers this rank issued, as (rounds = calls / buckets, bytes received, async)."""
    from megatron_po.distributed import ddp as ddp_module
    from test_async_pipeline import train_distributed
    calls, stages = [], []
    gather = ddp_module.all_gather_single

    def counting(output, input_, group, async_op):
        calls.append((output.numel() * output.element_size(), async_op))
        return gather(output, input_, group, async_op)

    def instrument(rank):
        stages.append(rank.stage)
        if old_path:  # the path before this change: predict, gather, restore by a gather
            rank.stage.policy.gathers = [False]
            for opt in rank.stage.optimizers:
                opt.defer_param_gather = False
    ddp_module.all_gather_single = counting
    try:
        losses, _, weights, *_ = train_distributed("pipeoptim", "adam", 1, 1, (8,), mbs=4, masked=False,
                                                   precision=precision, on_rank=instrument)
    finally:
        ddp_module.all_gather_single = gather
    buckets = len(stages[0].ddps[0].buckets)
    return (ps.get_pipeline_model_parallel_rank(), len(calls) / buckets, sum(b for b, _ in calls),
            all(a for _, a in calls), losses, weights)


def _gather_counts():
    plain = _count_gathers({"use_distributed_optimizer": True}, old_path=True)
    new = _count_gathers({"use_distributed_optimizer": True})
    overlapped = _count_gathers({"use_distributed_optimizer": True, "overlap_param_gather": True})
    return plain, new, overlapped


def test_pipeoptim_distributed_optimizer_gathers_once_per_microbatch():
    """Stage 0 (s = 1) gathered 3 times per micro-batch (update, prediction, restore), each 1x its
    parameters; now once, 2x (the updated and the predicted shards packed): 2/3 of the bytes; stage 1
    (s = 0) once, 1x, as before. With --overlap-param-gather every gather is asynchronous. Losses and
    weights are bitwise those of the old path (prediction and update per element, same shards)."""
    for (pp_rank, rounds_before, bytes_before, _, losses_before, weights_before), \
            (_, rounds, nbytes, _, losses, weights), (_, rounds_o, bytes_o, all_async, losses_o, weights_o) \
            in run_distributed(_gather_counts, 4, pp=2, timeout=240):
        assert rounds <= 8 and rounds_o == rounds and bytes_o == nbytes and all_async  # <= 1 per micro-batch
        if pp_rank == 0:
            # F0, F1 run before the first step (nothing to predict); F2..F7 predicted: 8 updates + 2 x 6
            assert rounds_before == 8 + 2 * 6 and rounds == 8
            assert nbytes * 20 == bytes_before * (6 * 2 + 2)  # 6 packed (2x) + the last 2 steps' plain (1x)
        else:
            assert rounds == rounds_before == 8 and nbytes == bytes_before
        assert losses == losses_before == losses_o
        assert all(torch.equal(weights[n], weights_before[n]) and torch.equal(weights_o[n], weights[n])
                   for n in weights)


# ---- timing ------------------------------------------------------------------------------------------

def test_async_run_at_timing_level_1_logs_forward_backward_communication_and_policy(corpus, tmp_path):
    from test_pretrain_gpt import ASYNC, run_layout
    records = run_layout(corpus, tmp_path, "timed", 4, **dict(ASYNC, **{
        "--pipeline-method": "pipeoptim", "--train-iters": 4, "--eval-interval": 4, "--timing-log-level": 1}))
    timed = [r for r in records if "lm_loss" in r]
    assert timed and all({"time/forward-compute", "time/backward-compute", "time/p2p", "time/prediction",
                          "time/optimizer", "time/grad-sync"} <= r.keys() for r in timed), timed[0].keys()
    assert all(r["time/forward-compute"] > 0 and r["time/backward-compute"] > 0 for r in timed)
