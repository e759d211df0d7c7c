"""The shape of the training loop (issue 20): `pretrain()` reads in one screen, calling named set-up, step and
periodic-work functions; training.py stays small; the names callers imported from training.py before the
split still import from there, as the very objects of their new modules. Plus the loop's own bookkeeping
(`TrainState.advance`, `next_boundary`) on small inputs. No process group: each test runs in well under a
second. The loop's behaviour end to end is what test_pretrain_gpt, test_checkpoint, test_reliability and
test_run_errors check."""

import inspect
import os

from megatron_po import training
from megatron_po.async_training import ASYNC_SEGMENT_ITERATIONS, next_boundary
from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.training_step import TrainState

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
SCREEN = 60  # lines: pretrain() with its docstring
MAX_TRAINING_LINES = 600


def test_pretrain_reads_in_one_screen_and_training_py_is_small():
    lines = inspect.getsource(training.pretrain).splitlines()
    assert len(lines) <= SCREEN, f"pretrain() is {len(lines)} lines (at most {SCREEN}: move the work into named functions)"
    with open(training.__file__) as f:
        n = sum(1 for _ in f)
    assert n <= MAX_TRAINING_LINES, f"{os.path.basename(training.__file__)} is {n} lines"
    body = "\n".join(lines)
    for step in ("initialize(", "build_model(", "build_datasets(", "resume(", "synchronous_iteration(",
                 "train_asynchronous(", "periodic("):
        assert step in body, step


def test_names_callers_import_from_training_are_the_split_modules_objects():
    from megatron_po import flops, gpt_workload, training_log, training_setup, training_step
    from megatron_po.errors import RankError
    kept = {"gpt_flops_per_token": flops, "nmt_flops_per_sample": flops, "build_model_chunks": gpt_workload,
            "GPTWorkload": gpt_workload, "truncate_metrics": training_log, "build_optimizer_for": training_setup,
            "train_step": training_step}
    for name, module in kept.items():
        assert getattr(training, name) is getattr(module, name), name
    assert training.RankError is RankError


def test_train_state_advances_by_each_iterations_own_batch():
    cfg = parse_args(MOCK + ["--micro-batch-size", "2", "--global-batch-size", "32", "--rampup-batch-size", "8", "8",
                             "100", "--train-iters", "20"])
    validate(cfg, 2)
    schedule = SampleSchedule(cfg, 2)
    state = TrainState()
    for i in range(20):
        assert (state.iteration, state.consumed_samples) == (i, schedule.consumed_before(i))
        state.advance(schedule)
    assert (state.iteration, state.consumed_samples) == (20, schedule.total_samples)
    assert schedule.batch(0) == 8 and schedule.batch(19) == 32  # the ramp: batches differ, so the test can fail


def test_next_boundary_drains_at_saves_exits_and_the_end():
    def cfg(*flags):
        return parse_args(MOCK + ["--train-iters", "50", "--eval-interval", "7"] + list(flags))

    plain = cfg()
    assert next_boundary(0, plain) == 50  # evaluation runs inside the stream
    assert next_boundary(0, plain, eval_drains=True) == 7 and next_boundary(7, plain, eval_drains=True) == 14
    saving = cfg("--save", "/nonexistent", "--save-interval", "20", "--exit-interval", "30")
    assert [next_boundary(i, saving) for i in (0, 19, 20, 29, 30, 40)] == [20, 20, 30, 30, 40, 50]
    fixed = cfg("--save", "/nonexistent", "--save-interval", "20", "--async-drain-interval", "10")
    assert [next_boundary(i, fixed) for i in (0, 10, 45)] == [10, 20, 50]  # the drain interval alone
    long = parse_args(MOCK + ["--train-iters", str(3 * ASYNC_SEGMENT_ITERATIONS)])
    assert next_boundary(0, long) == ASYNC_SEGMENT_ITERATIONS  # segments stay bounded without saves


def test_a_loss_is_averaged_over_dp_on_the_backends_device(monkeypatch):
    """NCCL takes only GPU tensors: `average_over_dp` moves its input (an evaluation's float arrives as a CPU
    tensor) to `ps.get_device()` before the all-reduce. Found by the CUDA suite on an H200 (an asynchronous run's
    evaluation failed with "No backend type associated with device type cpu"); here the backend's device is
    played by "meta", which a CPU tensor handed on unmoved is not."""
    import pytest
    import torch
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    from megatron_po.training_step import average_over_dp

    class Reduced(Exception):
        pass

    seen = []

    def all_reduce(x, group=None):
        seen.append((x.device, x.dtype))
        raise Reduced  # a meta tensor has no value to return: stop here

    monkeypatch.setattr(ps, "get_device", lambda: torch.device("meta"))
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda with_context_parallel=False: None)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Reduced):
        average_over_dp(torch.tensor(2.5))
    assert seen == [(torch.device("meta"), torch.float64)]
