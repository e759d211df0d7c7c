"""End to end through pretrain_gpt.py's entry (`training.run_main`) on the bundled corpus.

- A 4-process TP=2 x DP=2 run of 30 iterations matches the 1-process run's loss curve
  (|delta loss| <= 2e-3 at every logged iteration: fp32, different reduction orders through 30 AdamW
  steps) and its loss falls; with PP=2 (1F1B) likewise.
- Bad input ends with exit code 2 and one `error:` line, no traceback.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_args import flags_to_argv
from dist_harness import run_distributed
from wandb_records import read_offline_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_args(corpus, out_dir, **overrides):
    args = {
        "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 64,
        "--micro-batch-size": 4, "--global-batch-size": 16, "--train-iters": 30, "--lr": 2e-3,
        "--min-lr": 2e-4, "--lr-warmup-iters": 3, "--hidden-dropout": 0.0, "--attention-dropout": 0.0,
        "--data-path": corpus["prefix"], "--tokenizer-model": corpus["model"], "--split": "95,5,0",
        "--log-interval": 5, "--eval-interval": 15, "--eval-iters": 2, "--make-vocab-size-divisible-by": 16,
        "--data-cache-path": str(out_dir / "cache"), "--metrics-file": str(out_dir / "metrics.jsonl"),
        "--seed": 3,
    }
    args.update(overrides)
    return flags_to_argv(args)


def run_pretrain(argv):
    from megatron_po.training import run_main
    return run_main(argv)  # reuses the harness's process group, builds its own model-parallel groups


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_layout(corpus, tmp_path, name, world, **flags):
    out = tmp_path / name
    out.mkdir()
    argv = base_args(corpus, out, **flags)
    codes = run_distributed(run_pretrain, world, args=(argv,), timeout=300)
    assert codes == [0] * world
    return read_metrics(out / "metrics.jsonl")


def assert_same_curve(a, b, tol=2e-3):
    la = [r["lm_loss"] for r in a if "lm_loss" in r]
    lb = [r["lm_loss"] for r in b if "lm_loss" in r]
    assert len(la) == len(lb) == 6
    for x, y in zip(la, lb):
        assert abs(x - y) <= tol, (la, lb)
    va = [r["val_loss"] for r in a if "val_loss" in r]
    vb = [r["val_loss"] for r in b if "val_loss" in r]
    assert len(va) == len(vb) == 2
    for x, y in zip(va, vb):
        assert abs(x - y) <= tol, (va, vb)


def test_tp2_dp2_matches_single_process_and_loss_falls(corpus, tmp_path):
    single = run_layout(corpus, tmp_path, "single", 1)
    parallel = run_layout(corpus, tmp_path, "tp2dp2", 4, **{"--tensor-model-parallel-size": 2})
    losses = [r["lm_loss"] for r in single if "lm_loss" in r]
    assert losses[-1] < losses[0] - 0.5 and losses == sorted(losses, reverse=True), losses  # falls steadily
    assert_same_curve(single, parallel)
    rec = parallel[-1]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "val_loss"):
        assert key in rec
    assert rec["iteration"] == 30


@pytest.mark.parametrize("flags", [{"--pipeline-model-parallel-size": 2},
                                   {"--pipeline-model-parallel-size": 2, "--pipeline-method": "gpipe"},
                                   {"--pipeline-model-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1}],
                         ids=["1f1b", "gpipe", "interleaved"])
def test_pp2_dp2_matches_single_process(corpus, tmp_path, flags):
    single = run_layout(corpus, tmp_path, "single", 1)
    piped = run_layout(corpus, tmp_path, "pp2", 4, **flags)
    assert_same_curve(single, piped)


# ---- bad input: one clear line ---------------------------------------------------------------------

def cli(args, env_extra=None, timeout=120):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def corrupt_copy(corpus, tmp_path, mutate):
    prefix = str(tmp_path / "bad_text_document")
    shutil.copy(corpus["prefix"] + ".bin", prefix + ".bin")
    data = bytearray(open(corpus["prefix"] + ".idx", "rb").read())
    open(prefix + ".idx", "wb").write(mutate(data))
    return prefix


BAD_INPUT_CASES = ["world", "hidden", "heads", "missing-data", "bad-magic", "truncated-idx", "vocab-mismatch",
                   "missing-tokenizer", "unknown-flag", "layers-vs-stages", "interleave-microbatches",
                   "unknown-schedule"]


def bad_input(case, corpus, tmp_path):
    """(flag overrides, environment, words the error line must contain) of each bad-input case."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    over, needles = {}, []
    if case == "world":
        env["WORLD_SIZE"] = "3"
        over = {"--tensor-model-parallel-size": 2}
        needles = ["world size 3", "--tensor-model-parallel-size"]
    elif case == "hidden":
        env["WORLD_SIZE"] = "2"
        over = {"--tensor-model-parallel-size": 2, "--hidden-size": 63, "--num-attention-heads": 3}
        needles = ["--hidden-size (63)", "--tensor-model-parallel-size (2)"]
    elif case == "heads":
        env["WORLD_SIZE"] = "2"
        over = {"--tensor-model-parallel-size": 2, "--hidden-size": 96, "--num-attention-heads": 3}
        needles = ["--num-attention-heads (3)"]
    elif case == "missing-data":
        over = {"--data-path": str(tmp_path / "nope_text_document")}
        needles = ["nope_text_document"]
    elif case == "bad-magic":
        over = {"--data-path": corrupt_copy(corpus, tmp_path, lambda b: b"XXXXXXXXX" + b[9:])}
        needles = ["bad_text_document.idx", "magic"]
    elif case == "truncated-idx":
        over = {"--data-path": corrupt_copy(corpus, tmp_path, lambda b: b[:len(b) // 2])}
        needles = ["bad_text_document.idx"]
    elif case == "vocab-mismatch":
        over = {"--tokenizer-type": "NullTokenizer", "--vocab-size": 50, "--tokenizer-model": None}
        needles = ["vocab"]
    elif case == "missing-tokenizer":
        over = {"--tokenizer-model": str(tmp_path / "missing.model")}
        needles = ["missing.model"]
    elif case == "unknown-flag":
        over = {"--no-such-flag": 1}
        needles = ["--no-such-flag"]
    elif case == "layers-vs-stages":
        env["WORLD_SIZE"] = "2"
        over = {"--pipeline-model-parallel-size": 2, "--num-layers": 4, "--num-layers-per-virtual-pipeline-stage": 3}
        needles = ["--num-layers (4)", "--pipeline-model-parallel-size (2)", "virtual"]
    elif case == "interleave-microbatches":
        # 12 / 4 = 3 micro-batches: the synchronous interleaved schedules take it, the asynchronous stream not
        env["WORLD_SIZE"] = "2"
        over = {"--pipeline-model-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1,
                "--num-layers": 4, "--global-batch-size": 12, "--pipeline-method": "pipeoptim",
                "--untie-embeddings-and-output-weights": True}
        needles = ["micro-batches (3", "--pipeline-model-parallel-size (2)"]
    elif case == "unknown-schedule":
        over = {"--pipeline-method": "zigzag"}
        needles = ["--pipeline-method", "zigzag"]
    # Should a check ever let a case through, its lone rank must not wait long for absent peers.
    over.setdefault("--distributed-timeout-minutes", 0.1)
    return base_args(corpus, tmp_path, **over), env, needles


def _free_port():
    from dist_harness import free_port
    return free_port()


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_gives_one_clear_error_line(case, corpus, tmp_path, monkeypatch, capsys):
    """In-process through run_main (fast): exit code 2, exactly one `error:` line naming the problem."""
    from megatron_po.training import run_main
    argv, env, needles = bad_input(case, corpus, tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = run_main(argv)
    err = capsys.readouterr().err
    assert_one_error_line(subprocess.CompletedProcess([], code, "", err), *needles)


@pytest.mark.parametrize("case", ["world", "bad-magic"])
def test_bad_input_through_the_real_cli(case, corpus, tmp_path):
    """The same through `python pretrain_gpt.py`: nothing but the one line reaches the terminal."""
    argv, env, needles = bad_input(case, corpus, tmp_path)
    assert_one_error_line(cli(argv, env), *needles)


# ---- checkpoints -----------------------------------------------------------------------------------

def test_resume_continues_exactly_and_loads_under_another_layout(corpus, tmp_path):
    """10 straight iterations vs 5 + save + exit (--exit-interval) + load + 5 (same layout: identical losses), and the TP=2 x DP=2
    checkpoint loaded by one process (TP=1) continues with the same losses within 2e-3."""
    sched = {"--train-iters": 10, "--lr-decay-iters": 10, "--log-interval": 1, "--eval-interval": 100}
    straight = run_layout(corpus, tmp_path, "straight", 4, **{"--tensor-model-parallel-size": 2}, **sched)

    first = tmp_path / "first"
    first.mkdir()
    ckpt = str(tmp_path / "ckpt")
    argv = base_args(corpus, first, **{**sched, "--exit-interval": 5, "--tensor-model-parallel-size": 2,
                                       "--save": ckpt})
    assert run_distributed(run_pretrain, 4, args=(argv,), timeout=300) == [0] * 4
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "5"

    def resume(name, world, tp):
        out = tmp_path / name
        out.mkdir()
        argv = base_args(corpus, out, **{**sched, "--tensor-model-parallel-size": tp, "--load": ckpt})
        assert run_distributed(run_pretrain, world, args=(argv,), timeout=300) == [0] * world
        return [r["lm_loss"] for r in read_metrics(out / "metrics.jsonl") if "lm_loss" in r]

    expected = [r["lm_loss"] for r in straight if "lm_loss" in r][5:]
    assert resume("same_layout", 4, 2) == expected  # bit for bit
    resharded = resume("one_process", 1, 1)
    assert len(resharded) == 5
    for a, b in zip(resharded, expected):
        assert abs(a - b) <= 2e-3, (resharded, expected)


def test_wandb_offline_run_records_config_and_metrics(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "wb"
    out.mkdir()
    argv = base_args(corpus, out, **{"--train-iters": 4, "--log-interval": 2, "--eval-interval": 4,
                                     "--wandb-project": "mpo-test", "--wandb-save-dir": str(out)})
    assert run_distributed(run_pretrain, 1, args=(argv,), timeout=300) == [0]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    config, history, summary = read_offline_run(str(runs[0]))
    assert {"model", "parallel", "training"} <= config, config
    assert [int(h["_step"]) for h in history] == [2, 4]
    for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec"):
        assert all(key in h for h in history), history
    assert "val_loss" in history[-1] and "val_loss" in summary


# ---- asynchronous methods through the entry point ---------------------------------------------------

ASYNC = {"--pipeline-model-parallel-size": 2, "--untie-embeddings-and-output-weights": True,
         "--train-iters": 12, "--log-interval": 2, "--eval-interval": 6, "--lr-decay-iters": 12}


@pytest.mark.parametrize("method", ["async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim"])
def test_async_methods_train_through_pretrain(corpus, tmp_path, method):
    flags = dict(ASYNC, **{"--pipeline-method": method})
    if method == "spectrain":
        flags.update({"--optimizer": "sgd", "--lr": 0.05})
    if method == "pipedream-2bw":
        flags["--async-update-interval"] = 2
    records = run_layout(corpus, tmp_path, method, 4, **flags)  # PP=2 x DP=2
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    assert [r["iteration"] for r in records if "val_loss" in r] == [6, 12]


@pytest.mark.parametrize("method_flags", [
    {"--pipeline-method": "pipeoptim"},
    # error feedback's u_{t-1} is checkpointed with the policy; 2BW's first step after the resume has delay 1,
    # so it uses the loaded u_{t-1} (PipeDream's first steps after a drain have s = 0 and would not notice)
    {"--pipeline-method": "pipedream-2bw", "--async-update-interval": 2, "--async-error-feedback": True},
], ids=["pipeoptim", "2bw-error-feedback"])
def test_async_resume_is_exact(corpus, tmp_path, method_flags):
    """Drain, save, exit, load, continue: the losses equal those of the uninterrupted run, bit for bit.
    Checkpoints are taken at drain points, so both runs drain at the same iterations (every save)."""
    flags = dict(ASYNC, **method_flags, **{"--log-interval": 1, "--save-interval": 4})
    straight = [r["lm_loss"] for r in run_layout(corpus, tmp_path, "straight", 2, **flags,
                                                 **{"--save": str(tmp_path / "straight_ckpt")}) if "lm_loss" in r]
    ckpt = str(tmp_path / "ckpt")
    first = run_layout(corpus, tmp_path, "first", 2, **flags, **{"--save": ckpt, "--exit-interval": 4})
    resumed = run_layout(corpus, tmp_path, "second", 2, **flags, **{"--load": ckpt, "--save": ckpt})
    assert [r["lm_loss"] for r in first if "lm_loss" in r] == straight[:4]
    assert [r["lm_loss"] for r in resumed if "lm_loss" in r] == straight[4:]


# ---- mixed precision and the distributed optimizer through the entry point -------------------------

def test_bf16_distributed_optimizer_tracks_fp32(corpus, tmp_path):
    """bf16 weights, fp32 grads and main params sharded over DP=2 (TP=2): the loss curve stays within
    0.05 of the fp32 run's (bf16 rounding of weights and activations)."""
    fp32 = run_layout(corpus, tmp_path, "fp32", 1)
    bf16 = run_layout(corpus, tmp_path, "bf16", 4, **{"--tensor-model-parallel-size": 2, "--bf16": True,
                                                     "--accumulate-allreduce-grads-in-fp32": True,
                                                     "--use-distributed-optimizer": True})
    assert_same_curve(fp32, bf16, tol=0.05)


def test_fp16_with_loss_scaling_trains(corpus, tmp_path):
    records = run_layout(corpus, tmp_path, "fp16", 2, **{"--pipeline-model-parallel-size": 2, "--fp16": True,
                                                        "--initial-loss-scale": 2.0**20})
    logged = [r for r in records if "lm_loss" in r]
    assert all("loss_scale" in r for r in logged)
    assert logged[-1]["lm_loss"] < logged[0]["lm_loss"] - 0.3


def test_fp16_pipeoptim_logs_its_skipped_steps_and_loss_scale(corpus, tmp_path):
    """Asynchronous fp16: the loss stage's overflowing steps (the default initial scale 2**32 overflows)
    are skipped stage-locally and show in the log as skipped iterations, with the loss scale falling."""
    records = run_layout(corpus, tmp_path, "fp16-async", 2, **dict(ASYNC, **{"--pipeline-method": "pipeoptim",
                                                                          "--fp16": True, "--log-interval": 1}))
    logged = [r for r in records if "lm_loss" in r]
    assert len(logged) == 12 and all("loss_scale" in r for r in logged)
    assert logged[0]["loss_scale"] < 2.0**32 and logged[-1]["loss_scale"] <= logged[0]["loss_scale"]
    skipped = [r["skipped_iterations"] for r in logged]
    assert skipped[0] == 1 and logged[0]["grad_norm"] is None  # the first steps overflow
    assert 0 < sum(skipped) < 12 and logged[-1]["grad_norm"] is not None


def test_bf16_pipeoptim_tracks_fp32_pipeoptim(corpus, tmp_path):
    """Asynchronous PipeOptim with bf16 chunks and fp32 main params (prediction written straight into
    the bf16 weights, restored from the main params: no extra copy) follows the fp32 run within 0.05."""
    flags = dict(ASYNC, **{"--pipeline-method": "pipeoptim"})
    fp32 = run_layout(corpus, tmp_path, "fp32", 2, **flags)
    bf16 = run_layout(corpus, tmp_path, "bf16", 2, **flags, **{"--bf16": True})
    a = [r["lm_loss"] for r in fp32 if "lm_loss" in r]
    b = [r["lm_loss"] for r in bf16 if "lm_loss" in r]
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) <= 0.05, (a, b)
    # --accumulate-allreduce-grads-in-fp32 (gradients accumulated in an fp32 buffer): with one backward
    # per step and one DP rank there is nothing to accumulate, so the run is bit for bit the bf16 one...
    fp32_grads = run_layout(corpus, tmp_path, "bf16-fp32-grads", 2, **flags,
                            **{"--bf16": True, "--accumulate-allreduce-grads-in-fp32": True})
    assert [r["lm_loss"] for r in fp32_grads if "lm_loss" in r] == b
    # ... and with k = 2 backwards per step it accumulates in fp32, not bf16: close to, not equal to, bf16's.
    k2 = {"--async-update-interval": 2, "--bf16": True}
    bf16_k2 = run_layout(corpus, tmp_path, "bf16-k2", 2, **flags, **k2)
    fp32_k2 = run_layout(corpus, tmp_path, "bf16-fp32-grads-k2", 2, **flags, **k2,
                         **{"--accumulate-allreduce-grads-in-fp32": True})
    c = [r["lm_loss"] for r in bf16_k2 if "lm_loss" in r]
    d = [r["lm_loss"] for r in fp32_k2 if "lm_loss" in r]
    assert c != d and max(abs(x - y) for x, y in zip(c, d)) <= 0.05, (c, d)
