"""examples/slurm/*.sbatch under a real single-node Slurm (tools/slurm_local.sh: Debian's slurm-wlm and
munge, installed when missing, slurmctld + slurmd on localhost).

Both scripts are submitted with 4 CPU tasks on the small test corpus: the srun one (one task per rank,
ranks from SLURM_*) as TP=2 x DP=2 with 1F1B; the torchrun one (one task per node, c10d rendezvous) as
PP=2 x DP=2 with PipeOptim, stopped by --exit-interval halfway and then requeued with `scontrol
requeue`, which restarts the same job: it must resume from its checkpoint and finish. Each run's loss
must fall. Skipped, with the check that failed, only where the Slurm daemons cannot be started (no
root to install them, no apt-get, a daemon that does not come up).
"""

import json
import os
import subprocess
import sys
import time

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_LOCAL = os.path.join(ROOT, "tools", "slurm_local.sh")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="session")
def slurm_env():
    """Environment for sbatch/scontrol against the local Slurm; its daemons are stopped afterwards when
    this session started them."""
    try:
        out = subprocess.run(["bash", SLURM_LOCAL, "start"], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("tools/slurm_local.sh start did not finish in 600 s")
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0:
        pytest.skip(lines[-1] if lines else f"tools/slurm_local.sh start failed: {out.stderr.strip()[-300:]}")
    env = dict(os.environ, SLURM_CONF=lines[-1].split("=", 1)[1])
    yield env
    if not any("already running" in line for line in lines):
        subprocess.run(["bash", SLURM_LOCAL, "stop"], capture_output=True, timeout=60)


def job_state(env, job_id):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode"), int(fields.get("Restarts", 0))


def wait(env, job_id, log, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state, code, restarts = job_state(env, job_id)
        if state in DONE:
            return state, code, restarts
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env)
    pytest.fail(f"job {job_id} still {state} after {timeout} s; log:\n{open(log).read()[-3000:] if os.path.exists(log) else ''}")


def submit(env, script, run_dir, variables, args):
    os.makedirs(run_dir)
    log = os.path.join(run_dir, "slurm.out")
    job_env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # ranks: Slurm's
    job_env.update(PYTHON=sys.executable, RUN_DIR=run_dir, **{k: str(v) for k, v in variables.items()})
    out = subprocess.run(["sbatch", "--parsable", "--output", log, os.path.join("examples", "slurm", script), *args],
                         cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0], log


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r]


def test_sbatch_scripts_train_and_requeue_resumes(slurm_env, corpus, tmp_path):
    tiny = {"DATA_PATH": corpus["prefix"], "TOKENIZER_MODEL": corpus["model"], "NUM_LAYERS": 2, "HIDDEN_SIZE": 64,
            "NUM_ATTENTION_HEADS": 4, "SEQ_LENGTH": 64, "MICRO_BATCH_SIZE": 4, "GLOBAL_BATCH_SIZE": 16,
            "TRAIN_ITERS": 12, "LR": 3e-3, "LR_WARMUP_ITERS": 2, "LOG_INTERVAL": 2, "EVAL_INTERVAL": 6,
            "SAVE_INTERVAL": 6}
    args = ["--eval-iters", "1", "--make-vocab-size-divisible-by", "16", "--split", "95,5,0",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    srun_dir, torchrun_dir = str(tmp_path / "srun"), str(tmp_path / "torchrun")
    srun_job, srun_log = submit(slurm_env, "pretrain_gpt_srun.sbatch", srun_dir, dict(tiny, TP=2), args)
    trun_job, trun_log = submit(slurm_env, "pretrain_gpt.sbatch", torchrun_dir,
                                dict(tiny, PP=2, METHOD="pipeoptim", GPUS_PER_NODE=4), args + ["--exit-interval", "6"])

    assert wait(slurm_env, trun_job, trun_log)[:2] == ("COMPLETED", "0:0"), open(trun_log).read()[-3000:]
    assert [it for it, _ in losses(torchrun_dir)] == [2, 4, 6]  # stopped at --exit-interval, checkpoint saved
    # A requeue (what Slurm does after a preemption or node failure) reruns the same job script; Slurm
    # holds requeued jobs for a while (BeginTime), so release it now.
    subprocess.run(["scontrol", "requeue", trun_job], env=slurm_env, check=True)
    # slurmd revokes the finished run's credential with one-second granularity; a relaunch within that
    # second is killed as "Job credential revoked" (seen under load), so release it 2 s later.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={trun_job}", "StartTime=now"], env=slurm_env, check=True)

    assert wait(slurm_env, srun_job, srun_log)[:2] == ("COMPLETED", "0:0"), open(srun_log).read()[-3000:]
    assert wait(slurm_env, trun_job, trun_log) == ("COMPLETED", "0:0", 1), open(trun_log).read()[-3000:]
    trun_out = open(trun_log).read()
    assert "restart 1" in trun_out and "resumed from" in trun_out and "continuing at iteration 6" in trun_out

    for run_dir in (srun_dir, torchrun_dir):
        curve = losses(run_dir)
        assert [it for it, _ in curve] == [2, 4, 6, 8, 10, 12], curve  # the requeued run added 8..12
        assert curve[-1][1] < curve[0][1] - 0.3, curve  # the loss falls
