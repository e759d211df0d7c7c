"""Reliability under faults (issue #9): lost ranks, restarts, NaN/inf, determinism.

- A rank SIGKILLed mid-training (PP=2 x DP=2, launched as Slurm tasks: no torchrun to clean up) makes
  every other rank exit non-zero, each with one line naming the lost rank, and leaves no process behind
  (bounded: a rank still running 4x --distributed-timeout-minutes after the fault fails the test; the
  seconds each took are printed, not asserted, since they grow with the machine's load): at a random iteration, and right after posting a pipeline
  send on rank 0, which also hosts the rendezvous store. A rank stuck there instead (alive) makes its
  peers time out and say so, and is stopped too.
- A run SIGKILLed mid-iteration at a random (seeded) pipeline send and relaunched with the same command resumes from its
  last checkpoint (auto-resume from --save) and its metrics file then holds, iteration by iteration,
  exactly (bit for bit) the losses of an uninterrupted run: 1F1B and PipeOptim at PP=2.
- A NaN loss or gradient stops a bf16/fp32 run before the optimizer step with one line naming the
  iteration, rank and stage, saving nothing after the last good checkpoint; fp16 skips the step.
- Same seed and layout: bit-identical losses in two runs.
"""

import json
import os
import random
import signal
import sys
import time
import uuid

import pytest
from dist_harness import run_distributed
from rank_launcher import ROOT, launch, tagged_processes
from test_checkpoint import tiny_args as checkpoint_tiny_args

from megatron_po.distributed.checkpoint_format import list_iterations, read_tracker

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
TIMEOUT_MINUTES = 0.5  # --distributed-timeout-minutes of the runs that lose a rank (exit_times' limit: 4x it)

# Runs `python inject.py pretrain_gpt.py ...`: on the rank MEGATRON_PO_INJECT_RANK, MEGATRON_PO_INJECT is
# "kill-after-sends:N" (SIGKILL itself right after posting its N-th pipeline isend, while it is under
# way), "hang-after-sends:N" (sleep there instead: alive but stuck) or "nan-loss:N" (its N-th
# micro-batch loss becomes NaN); then runs the script as __main__.
INJECT = """
import os, runpy, signal, sys, time
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script` would
import torch.distributed as dist
if os.environ.get("SLURM_PROCID", os.environ.get("RANK")) == os.environ.get("MEGATRON_PO_INJECT_RANK"):
    what, n = os.environ["MEGATRON_PO_INJECT"].split(":")
    count = [0]
    if what in ("kill-after-sends", "hang-after-sends"):
        isend = dist.isend
        def faulty_isend(*args, **kwargs):
            work = isend(*args, **kwargs)
            count[0] += 1
            if count[0] == int(n) and what == "kill-after-sends":
                os.kill(os.getpid(), signal.SIGKILL)
            if count[0] == int(n):
                print("INJECTED: hanging", flush=True)
                time.sleep(3600)  # alive (its heartbeat goes on) but stuck
            return work
        dist.isend = faulty_isend
    elif what == "nan-loss":
        import megatron_po.pipeline.executor as executor
        loss_fn = executor.masked_mean_loss
        def nan_loss(*args):
            count[0] += 1
            loss = loss_fn(*args)
            return loss * float("nan") if count[0] == int(n) else loss
        executor.masked_mean_loss = nan_loss
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tiny_args(out, **overrides) -> list[str]:
    """test_checkpoint's tiny mock-data GPT (dropout on, every iteration logged), at PP=2 with untied
    embeddings (4 micro-batches per iteration with one DP rank, 2 with two)."""
    return checkpoint_tiny_args(out, **{"--pipeline-model-parallel-size": 2, "--train-iters": 12,
                                        "--untie-embeddings-and-output-weights": True, "--eval-interval": 1000,
                                        **overrides})


def records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def losses(path) -> list[tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in records(path) if "lm_loss" in r]


def log_of(log_dir, rank) -> str:
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        return f.read()


def wait_until(condition, procs, log_dir, what, timeout=240, ignore=()):
    deadline = time.time() + timeout
    while not condition():
        early = [r for r, p in enumerate(procs) if p.poll() is not None and r not in ignore]
        assert not early, f"rank(s) {early} exited before {what}:\n" + log_of(log_dir, early[0])[-3000:]
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def exit_times(procs, since: float, limit: float) -> dict[int, float]:
    """Seconds after `since` at which each process exited (polled every 50 ms); the rest are killed."""
    done = {}
    try:
        while len(done) < len(procs) and time.time() - since < limit:
            for r, p in enumerate(procs):
                if r not in done and p.poll() is not None:
                    done[r] = time.time() - since
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def inject_script(tmp_path) -> str:
    path = tmp_path / "inject.py"
    path.write_text(INJECT)
    return str(path)


# ---- lost ranks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("victim, how", [(2, "sigkill-at-random-iteration"), (0, "sigkill-mid-pipeline-send"),
                                         (1, "hang-mid-pipeline-send")])
def test_a_lost_rank_stops_every_rank_in_bounded_time(tmp_path, victim, how):
    """PP=2 x DP=2 PipeOptim, 4 processes as Slurm tasks (no torchrun agent to clean up). Rank 2 is a
    last-stage rank; rank 0 a first-stage rank that also hosts the rendezvous store. A SIGKILLed rank:
    every other rank exits within --distributed-timeout-minutes naming it. A stuck rank (alive, its
    heartbeat going on): its peers time out after --distributed-timeout-minutes and say so, and the
    stuck rank is stopped by its watchdog."""
    logs, tag = str(tmp_path / "logs"), uuid.uuid4().hex
    argv = tiny_args(str(tmp_path), **{"--train-iters": 2000, "--pipeline-method": "pipeoptim",
                                       "--distributed-timeout-minutes": TIMEOUT_MINUTES})
    metrics = tmp_path / "metrics.jsonl"
    if how == "sigkill-at-random-iteration":
        procs = launch(PRETRAIN, argv, 4, logs, tag)
        kill_at = random.Random(victim).randint(3, 8)
        wait_until(lambda: len(losses(metrics)) >= kill_at, procs, logs, f"iteration {kill_at}")
        procs[victim].send_signal(signal.SIGKILL)
    else:  # right after posting its 5th activation send (iteration 3) it dies / hangs
        fault = "kill-after-sends:5" if how.startswith("sigkill") else "hang-after-sends:5"
        procs = launch(inject_script(tmp_path), [PRETRAIN, *argv], 4, logs, tag,
                       {"MEGATRON_PO_INJECT_RANK": str(victim), "MEGATRON_PO_INJECT": fault})
        if how.startswith("sigkill"):
            wait_until(lambda: procs[victim].poll() is not None, procs, logs, f"rank {victim}'s death",
                       ignore=(victim,))
        else:
            wait_until(lambda: "INJECTED: hanging" in log_of(logs, victim), procs, logs, f"rank {victim}'s hang")
    fault_at = time.time()
    exited = exit_times(procs, fault_at, limit=120)
    print(f"{how} of rank {victim}: seconds to exit {dict(sorted(exited.items()))}")
    for rank in range(4):
        if rank == victim and how.startswith("sigkill"):
            assert procs[rank].returncode == -signal.SIGKILL
            continue
        text = log_of(logs, rank)
        assert rank in exited, (rank, exited)  # exited by itself, before exit_times' limit
        assert procs[rank].returncode == 1, (rank, text[-2000:])
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
        assert errors[0].startswith(f"error: rank {rank} (pipeline stage {rank // 2}"), errors[0]
        if how.startswith("hang"):
            assert "no rank was lost: a stuck peer" in errors[0] or "failed in communication" in errors[0], errors[0]
            assert "Timed out" in errors[0], errors[0]
            continue
        lost = errors[0].split(" stops: ", 1)[1]
        if victim == 0:  # the store died with it; a peer may also have seen its heartbeat stop first
            assert lost.startswith(("lost the rendezvous store", "rank 0 (pipeline stage 0")), errors[0]
        else:
            assert lost.startswith(f"rank {victim} (pipeline stage {victim // 2}, data-parallel rank 0") \
                and "is lost" in lost, errors[0]
    assert tagged_processes(tag) == []


# ---- restart loses nothing -------------------------------------------------------------------------

def _run_main(argv):
    from megatron_po.training import run_main
    return run_main(argv)


@pytest.mark.parametrize("method", ["1f1b", "pipeoptim"])
def test_killed_run_relaunched_with_the_same_command_loses_nothing(tmp_path, method):
    """Dropout on (its RNG state is part of the checkpoint). The uninterrupted run drains at the same
    checkpoints (same command), so asynchronous numerics agree too."""
    flags = {"--pipeline-method": method, "--save-interval": 3, "--distributed-timeout-minutes": TIMEOUT_MINUTES}
    (tmp_path / "ref").mkdir()
    reference_argv = tiny_args(str(tmp_path / "ref"), **flags, **{"--save": str(tmp_path / "ref" / "ckpt")})
    assert run_distributed(_run_main, 2, args=(reference_argv,), timeout=240) == [0, 0]
    reference = losses(tmp_path / "ref" / "metrics.jsonl")
    assert [i for i, _ in reference] == list(range(1, 13))

    argv = tiny_args(str(tmp_path), **flags, **{"--save": str(tmp_path / "ckpt")})
    logs, tag = str(tmp_path / "logs"), uuid.uuid4().hex
    # The last stage (which writes the metrics) SIGKILLs itself right after posting its N-th gradient
    # send: 4 per iteration, so mid-iteration 4..10. Killing it from here at a logged iteration instead
    # raced the run's end on a fast machine (12 iterations take ~0.6 s).
    kill_after_sends = random.Random(method).randint(4 * 4 - 2, 4 * 10 - 2)
    procs = launch(inject_script(tmp_path), [PRETRAIN, *argv], 2, logs, tag,
                   {"MEGATRON_PO_INJECT_RANK": "1", "MEGATRON_PO_INJECT": f"kill-after-sends:{kill_after_sends}"})
    wait_until(lambda: procs[1].poll() is not None, procs, logs, "rank 1's death", ignore=(1,))
    assert procs[1].returncode == -signal.SIGKILL, log_of(logs, 1)[-2000:]
    exited = exit_times(procs, time.time(), limit=120)
    assert 0 in exited and procs[0].returncode == 1, log_of(logs, 0)[-2000:]  # by itself, before the limit
    killed_after = max(i for i, _ in losses(tmp_path / "metrics.jsonl"))
    resume_from = read_tracker(str(tmp_path / "ckpt"))
    assert resume_from is not None and resume_from <= killed_after < 12, (resume_from, killed_after)

    print(f"{method}: SIGKILL of rank 1 after iteration {killed_after} was logged; rank 0 exited {exited[0]:.1f} s "
          f"later; relaunch resumes from iteration {resume_from}")
    relaunched = launch(PRETRAIN, argv, 2, str(tmp_path / "logs2"), tag)  # the same command
    assert [p.wait(timeout=300) for p in relaunched] == [0, 0], log_of(str(tmp_path / "logs2"), 0)[-2000:]
    assert f"resumed from {tmp_path / 'ckpt'} iteration {resume_from}" in log_of(str(tmp_path / "logs2"), 0)
    assert losses(tmp_path / "metrics.jsonl") == reference  # every iteration once, bit for bit
    assert tagged_processes(tag) == []


# ---- numerical faults ------------------------------------------------------------------------------

def _with_nan(argv, kind, at):
    """run_main on this harness rank with a NaN injected: "loss" makes the last stage's `at`-th
    micro-batch loss NaN; "grad" puts a NaN into rank 0's gradients at the `at`-th gradient sync."""
    import contextlib
    import io

    import megatron_po.pipeline.executor as executor
    from megatron_po import parallel_state as ps
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.training import run_main
    count = [0]
    if kind == "loss" and ps.is_pipeline_last_stage():
        loss_fn = executor.masked_mean_loss

        def nan_loss(*args):
            count[0] += 1
            loss = loss_fn(*args)
            return loss * float("nan") if count[0] == at else loss
        executor.masked_mean_loss = nan_loss
    if kind == "grad" and ps.get_pipeline_model_parallel_rank() == 0:
        sync = DistributedDataParallel.finish_grad_sync

        def nan_grad(self):
            sync(self)
            count[0] += 1
            if count[0] == at:
                self.grad_buffer[0] = float("nan")
        DistributedDataParallel.finish_grad_sync = nan_grad
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("kind, precision", [("loss", "fp32"), ("grad", "fp32"), ("loss", "bf16")])
def test_nan_stops_the_run_before_the_step_naming_iteration_rank_and_stage(tmp_path, kind, precision):
    """1F1B, PP=2 (4 micro-batches per iteration): the NaN appears at iteration 4; checkpoints every 3
    iterations: iteration 3's stays the last, and nothing of iteration 4 is saved."""
    ckpt = str(tmp_path / "ckpt")
    argv = tiny_args(str(tmp_path), **{"--save": ckpt, "--save-interval": 3, "--bf16": precision == "bf16"})
    at = 13 if kind == "loss" else 4  # the 13th loss = micro-batch 0 of iteration 4; the 4th sync = iteration 4
    results = run_distributed(_with_nan, 2, args=(argv, kind, at), timeout=240)
    assert [code for code, _ in results] == [2, 2], results
    lines = [ln for ln in results[0][1].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: NaN/inf at iteration 4 (grad norm nan"), lines
    if kind == "loss":
        assert "rank 1 (pipeline stage 1, data-parallel rank 0, tensor-parallel rank 0): lm loss nan" in lines[0]
    else:  # only stage 0's gradients: the loss was fine
        assert "rank 0 (pipeline stage 0, data-parallel rank 0, tensor-parallel rank 0): non-finite gradients" \
            in lines[0] and "lm loss" not in lines[0]
    assert f"stopped before the optimizer step, nothing saved; the last good checkpoint is iteration 3 in {ckpt}" \
        in lines[0]
    assert read_tracker(ckpt) == 3 and list_iterations(ckpt) == [3]
    assert [i for i, _ in losses(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_fp16_skips_a_nan_step_and_goes_on(tmp_path):
    argv = tiny_args(str(tmp_path), **{"--fp16": True, "--train-iters": 6, "--initial-loss-scale": 1024})
    results = run_distributed(_with_nan, 2, args=(argv, "loss", 13), timeout=240)  # iteration 4
    assert [code for code, _ in results] == [0, 0], results
    logged = records(tmp_path / "metrics.jsonl")
    assert [r["skipped_iterations"] for r in logged if "lm_loss" in r] == [0, 0, 0, 1, 0, 0]


def test_without_the_check_a_nan_run_goes_on(tmp_path):
    argv = tiny_args(str(tmp_path), **{"--train-iters": 5, "--no-check-for-nan-in-loss-and-grad": True})
    results = run_distributed(_with_nan, 2, args=(argv, "loss", 13), timeout=240)
    assert [code for code, _ in results] == [0, 0], results
    logged = [r["lm_loss"] for r in records(tmp_path / "metrics.jsonl") if "lm_loss" in r]
    assert len(logged) == 5 and all(x == x for x in logged[:3]) and logged[3] != logged[3]  # NaN from iteration 4


def test_nan_loss_in_an_asynchronous_pipeline_stops_every_rank(tmp_path):
    """PipeOptim streams without a per-iteration sync point: the last stage checks each micro-batch's loss
    as it is computed (before its backward) and stops; rank 0 is stopped by its watchdog."""
    logs, tag = str(tmp_path / "logs"), uuid.uuid4().hex
    argv = tiny_args(str(tmp_path), **{"--pipeline-method": "pipeoptim", "--distributed-timeout-minutes": 0.5})
    procs = launch(inject_script(tmp_path), [PRETRAIN, *argv], 2, logs, tag,
                   {"MEGATRON_PO_INJECT_RANK": "1", "MEGATRON_PO_INJECT": "nan-loss:13"})
    exited = exit_times(procs, time.time(), limit=240)
    print(f"NaN loss on rank 1: rank 0 exited {exited[0] - exited[1]:.1f} s after rank 1")
    codes = [p.returncode for p in procs]
    assert codes == [1, 2], (log_of(logs, 0)[-2000:], log_of(logs, 1)[-2000:])
    stopped = "lm loss is nan at iteration 4 (micro-batch 12) on rank 1 (pipeline stage 1, data-parallel rank 0"
    mine = [ln for ln in log_of(logs, 1).splitlines() if ln.startswith("error: ")]
    assert len(mine) == 1 and mine[0].startswith(f"error: {stopped}") and "stopped before its backward" in mine[0]
    theirs = [ln for ln in log_of(logs, 0).splitlines() if ln.startswith("error: ")]
    assert len(theirs) == 1 and f"stops: rank 1 (pipeline stage 1, data-parallel rank 0, tensor-parallel rank 0) " \
        f"stopped: {stopped}" in theirs[0], theirs
    assert tagged_processes(tag) == []


# ---- determinism -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [{"--pipeline-method": "pipeoptim"},
                                    {"--pipeline-model-parallel-size": 1, "--tensor-model-parallel-size": 2,
                                     "--deterministic": True}],
                         ids=["pp2-pipeoptim", "tp2-dropout-deterministic"])
def test_same_seed_and_layout_give_bit_identical_losses(tmp_path, layout):
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        argv = tiny_args(str(tmp_path / name), **{"--train-iters": 6, **layout})
        assert run_distributed(_run_main, 2, args=(argv,), timeout=240) == [0, 0]
        runs.append(losses(tmp_path / name / "metrics.jsonl"))
    assert len(runs[0]) == 6 and runs[0] == runs[1]


def test_metrics_file_keeps_what_a_resume_does_not_redo(tmp_path):
    from megatron_po.training_log import truncate_metrics
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "lm_loss": 1.0 / i}) + "\n" for i in range(1, 8))
                    + '{"iteration": 8, "lm_lo')  # torn by the kill
    truncate_metrics(str(path), 5)
    assert [r["iteration"] for r in records(path)] == [1, 2, 3, 4, 5] and path.read_text().endswith("\n")
    truncate_metrics(str(path), 0)
    assert path.read_text() == ""


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
