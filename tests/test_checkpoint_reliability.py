"""Checkpoints that survive their environment (issue #22, points 1-4).

- A dead launcher stops its workers: `torchrun --nproc-per-node 2 pretrain_gpt.py` saving every
  iteration; SIGKILL torchrun; every worker is gone (parent-death signal) and no `iter_*` appears after
  the kill (before: they trained and saved on for ~60-120 s, until the heartbeat watchdog found the store
  gone). The wait for their exit is a hang guard (30 s, below that watchdog's time), not a timing: the
  seconds they took are printed.
- One job per `--save`: a second job (2 ranks) on the directory of a running one exits 2 on every rank
  with one line naming the holder's pid; once the holder is SIGKILLed its lock is stale and the next job
  takes it over (says so) and resumes.
- Every output path (--save, --metrics-file, --tensorboard-dir, --data-cache-path) is checked at
  start-up: one line naming the flag, the path and the OS error, exit 2, before a model is built.
- A save that fails (ENOSPC raised inside DCP's writer on rank 1 of 2): every rank exits 1, one line on
  rank 0 naming the path and the OS error, the `.partial` is removed, the previous checkpoint is still
  the tracked one and a relaunch resumes from it.
- checksums.json: a flipped byte in a data file fails the load (2 ranks, the file verified by rank 1)
  with one line naming the file; --no-verify-checkpoint loads it; `checkpoint_convert.py verify`
  gives 0 on a good checkpoint and 2 with the line on the corrupt one.
"""

import contextlib
import errno
import io
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from dist_harness import run_distributed
from rank_launcher import ROOT, free_port, launch, tagged_processes, TAG_VAR
from test_checkpoint import tiny_args

from megatron_po.distributed.checkpoint_format import list_iterations, read_tracker
from megatron_po.distributed.checkpoint_integrity import MANIFEST

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
CONVERT = os.path.join(ROOT, "tools", "checkpoint_convert.py")


def small(out, **flags) -> list[str]:
    """test_checkpoint's tiny mock-data GPT, 2 layers, evaluation off."""
    return tiny_args(str(out), **{"--num-layers": 2, "--eval-interval": 100000, "--log-interval": 1, **flags})


def run_capturing(argv, patch=None):
    """run_main on this harness rank: (exit code, stdout, stderr). `patch(rank)` runs first."""
    import torch.distributed as dist

    from megatron_po.training import run_main
    if patch is not None:
        patch(dist.get_rank())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_main(argv)
    return code, out.getvalue(), err.getvalue()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def kill_tagged(tag):
    for pid in tagged_processes(tag):  # only processes this test started carry its tag
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def wait_for(condition, what, timeout=120, proc=None, log=None):
    deadline = time.time() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n" + (open(log).read()[-3000:] if log else ""))
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


# ---- 1. a dead launcher stops its workers -----------------------------------------------------------

def test_workers_die_with_their_killed_torchrun_launcher(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = small(tmp_path, **{"--train-iters": 100000, "--save": ckpt, "--save-interval": 1})
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1"})
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    log = str(tmp_path / "torchrun.log")
    with open(log, "w") as f:
        launcher = subprocess.Popen([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                                     PRETRAIN, *argv], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: len(list_iterations(str(ckpt))) >= 2, "two checkpoints", proc=launcher, log=log)
        workers = [pid for pid in tagged_processes(tag) if pid != launcher.pid]
        assert len(workers) >= 2, workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed_at = time.time()
        published = set(os.listdir(ckpt))
        wait_for(lambda: not tagged_processes(tag), "exit of every worker", timeout=30)
        gone_after = time.time() - killed_at
        time.sleep(2)  # an orphan would save again within this (a save every iteration, ~0.1 s each)
        new = sorted(n for n in set(os.listdir(ckpt)) - published if n.startswith("iter_") and "." not in n)
        assert new == [], new
        print(f"workers {workers} gone {gone_after:.2f} s after the launcher's SIGKILL")
    finally:
        kill_tagged(tag)
        if launcher.poll() is None:
            launcher.kill()


# ---- 1. one job per --save ----------------------------------------------------------------------------

def test_a_second_job_on_the_same_save_refuses_and_a_stale_lock_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    tag = uuid.uuid4().hex
    first_logs = str(tmp_path / "first")
    try:
        first = launch(PRETRAIN, small(tmp_path, **{"--train-iters": 100000, "--save": ckpt, "--save-interval": 5}),
                       1, first_logs, tag)[0]
        wait_for(lambda: read_tracker(str(ckpt)) is not None, "the first job's checkpoint", proc=first,
                 log=os.path.join(first_logs, "rank0.log"))
        second_logs = str(tmp_path / "second")
        second = launch(PRETRAIN, small(tmp_path / "b", **{"--train-iters": 10, "--save": ckpt}), 2, second_logs, tag)
        assert [p.wait(timeout=120) for p in second] == [2, 2]
        texts = [open(os.path.join(second_logs, f"rank{r}.log")).read() for r in range(2)]
        errors = error_lines(texts[0]) + error_lines(texts[1])
        assert len(errors) == 1 and "Traceback" not in "".join(texts), texts
        assert errors[0].startswith(f"error: --save {ckpt} is in use by another job (host ")
        assert f"pid {first.pid}, job 1, since " in errors[0], errors[0]
        assert "holds" not in texts[0]  # refused before a model was built
        assert first.poll() is None  # the holder goes on

        first.send_signal(signal.SIGKILL)  # no release: its lock file still names it, but the flock is free
        first.wait()
        resume_from = read_tracker(str(ckpt))
        third_logs = str(tmp_path / "third")
        third = launch(PRETRAIN, small(tmp_path / "c", **{"--train-iters": resume_from + 2, "--save": ckpt}),
                       1, third_logs, tag)[0]
        assert third.wait(timeout=120) == 0
        text = open(os.path.join(third_logs, "rank0.log")).read()
        assert f"> --save {ckpt}: took over the stale lock of host " in text and f"pid {first.pid}," in text, text
        assert f"resumed from {ckpt} iteration {resume_from}" in text
        assert open(ckpt / ".lock").read() == ""  # released at the end
    finally:
        kill_tagged(tag)


# ---- 2. output paths checked at start-up ----------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--save", "--metrics-file", "--tensorboard-dir", "--data-cache-path"])
def test_an_unwritable_output_path_fails_at_start_up_with_one_line(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "sub" / ("m.jsonl" if flag == "--metrics-file" else "dir")
    argv = small(tmp_path, **{"--train-iters": 2, flag: bad})
    [(code, out, err)] = run_distributed(run_capturing, 1, args=(argv,), timeout=120)
    assert code == 2
    assert err.splitlines() == [f"error: {flag} {bad}: cannot write there ([Errno {errno.ENOTDIR}] Not a directory: "
                                f"'{blocker / 'sub'}')"], err
    assert "holds" not in out  # no model was built


# ---- 3. a failed save ---------------------------------------------------------------------------------

def _disk_full_on_rank1_at_second_save(rank):
    """The second save (iteration 4): DCP's writer on rank 1 fails as on a full disk."""
    import torch.distributed.checkpoint.filesystem as fs
    if rank != 1:
        return
    write = fs._write_item

    def full(transforms, stream, *args, **kwargs):
        name = str(getattr(stream, "name", ""))
        if "iter_0000004" in name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return write(transforms, stream, *args, **kwargs)
    fs._write_item = full


def test_a_failed_save_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = small(tmp_path, **{"--train-iters": 6, "--save": ckpt, "--save-interval": 2})
    results = run_distributed(run_capturing, 2, args=(argv, _disk_full_on_rank1_at_second_save), timeout=180)
    assert [code for code, _, _ in results] == [1, 1], results
    assert error_lines(results[1][2]) == [] and "Traceback" not in results[0][2] + results[1][2]
    [line] = results[0][2].splitlines()
    partial = ckpt / "iter_0000004.partial"
    assert line.startswith(f"error: saving checkpoint iteration 4 to {ckpt} failed (rank 1: [Errno 28] "
                           f"No space left on device: '{partial}/"), line
    assert line.endswith(f"removed {partial}; the last good checkpoint, iteration 2, is untouched"), line
    assert sorted(n for n in os.listdir(ckpt) if n != ".lock") == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert read_tracker(str(ckpt)) == 2
    # The disk has room again: the same command resumes from iteration 2 and finishes.
    results = run_distributed(run_capturing, 2, args=(argv,), timeout=180)
    assert [code for code, _, _ in results] == [0, 0], results
    assert f"resumed from {ckpt} iteration 2" in results[0][1]
    assert list_iterations(str(ckpt)) == [2, 4, 6]


# ---- 4. checksums ---------------------------------------------------------------------------------------

def _flip_a_weight_byte(path: str) -> str:
    """Flip one byte inside the largest tensor stored in `__0_0.distcp` (the payload of a weight, so
    that only the checksum can tell); returns the file."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    info = max((v for k, v in md.storage_data.items() if k.fqn.startswith("model.")
                and v.relative_path == "__0_0.distcp"), key=lambda v: v.length)
    f = os.path.join(path, info.relative_path)
    with open(f, "r+b") as fh:
        fh.seek(info.offset + info.length // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    return f


def _verify(target) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CONVERT, "verify", str(target)], capture_output=True, text=True, cwd=ROOT)


def test_a_flipped_byte_fails_the_load_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    results = run_distributed(run_capturing, 2, args=(small(tmp_path, **{"--train-iters": 2, "--save": ckpt}),),
                              timeout=180)
    assert [code for code, _, _ in results] == [0, 0], results
    path = str(ckpt / "iter_0000002")
    assert sorted(__import__("json").load(open(os.path.join(path, MANIFEST)))["files"]) == \
        sorted(n for n in os.listdir(path) if n != MANIFEST)
    good = _verify(ckpt)
    assert good.returncode == 0 and f"{path}: " in good.stdout and good.stderr == "", good

    corrupt = _flip_a_weight_byte(path)
    argv = small(tmp_path, **{"--train-iters": 4, "--save": ckpt})
    results = run_distributed(run_capturing, 2, args=(argv,), timeout=180)
    assert [code for code, _, _ in results] == [2, 2], results
    assert results[1][2] == ""
    assert results[0][2].splitlines() == [f"error: {corrupt} is corrupt: its SHA-256 differs from the one in "
                                          f"{MANIFEST} written at save (use --no-verify-checkpoint to load it anyway)"]
    bad = _verify(path)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [f"error: {corrupt} is corrupt: its SHA-256 differs "
                                                               f"from the one in {MANIFEST} written at save (use "
                                                               f"--no-verify-checkpoint to load it anyway)"], bad
    # Skipping the check loads the (silently corrupt) weights, as before checksums.
    results = run_distributed(run_capturing, 2, args=(argv + ["--no-verify-checkpoint"],), timeout=180)
    assert [code for code, _, _ in results] == [0, 0], results
    assert f"resumed from {ckpt} iteration 2" in results[0][1]


def test_the_parent_death_signal_is_armed_only_under_torchrun():
    from megatron_po.distributed import launcher_death
    assert not launcher_death.under_torchrun({"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "0"})
    assert launcher_death.under_torchrun({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"})
    assert launcher_death.arm({"SLURM_PROCID": "0"}) is False  # srun / plain python: nothing armed
