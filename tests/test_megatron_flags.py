"""Megatron's flags as a user meets them: `--help` gives every flag one line, docs/megatron_flags.md lists exactly
the flags of `--help`, and the run flags of Megatron's launch scripts do what they say.

- TP=2 equals one process (loss and --log-params-norm, rel 1e-5, fp32) with --calculate-per-token-loss,
  --eod-mask-loss, --log-num-zeros-in-grad, --manual-gc, --profile (a Perfetto/Chrome trace is written) and
  "TFLOP/s per rank" on the CPU console.
- --exit-duration-in-mins stops after the first iteration and saves; --no-save-optim leaves the optimizer out (a
  resume must say --no-load-optim); --use-checkpoint-args builds the saved architecture despite other flags.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from dist_harness import run_distributed

from megatron_po.config import build_parser
from tools import megatron_flags_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def test_help_gives_every_flag_one_line():
    for action in build_parser()._actions:
        if "-h" in action.option_strings:
            continue
        assert action.help and "\n" not in action.help, action.option_strings
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    for flag, _ in megatron_flags_table.flag_rows():
        assert flag in out.stdout, flag


def test_flag_table_lists_exactly_the_help_flags():
    with open(os.path.join(ROOT, "docs", "megatron_flags.md")) as f:
        page = f.read()
    in_table = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    in_help = {flag for flag, _ in megatron_flags_table.flag_rows()}
    assert in_table == in_help, (sorted(in_table - in_help), sorted(in_help - in_table))
    assert page == megatron_flags_table.render(), "docs/megatron_flags.md is stale: python -m tools.megatron_flags_table"


def _run(argv, world=1):
    from test_pretrain_gpt import run_pretrain
    return run_distributed(run_pretrain, world, args=(argv,), timeout=300)


def _base(out, iters=4):
    return MOCK + ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "3e-3",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "100",
                   "--eval-iters", "1", "--make-vocab-size-divisible-by", "4", "--metrics-file", str(out / "m.jsonl")]


def _records(out):
    with open(out / "m.jsonl") as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r]


def test_run_flags_tp2_equals_one_process(tmp_path, capfd):
    flags = ["--calculate-per-token-loss", "--eod-mask-loss", "--log-params-norm", "--log-num-zeros-in-grad",
             "--manual-gc", "--manual-gc-interval", "2", "--log-throughput", "--profile", "--profile-step-start", "2",
             "--profile-step-end", "3"]
    runs = {}
    for name, world, extra in [("one", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"])]:
        out = tmp_path / name
        assert _run(_base(out) + flags + extra + ["--tensorboard-dir", str(out / "tb")], world) == [0] * world
        runs[name] = _records(out)
        trace = json.loads((out / "tb" / "trace_rank0_iter2-3.pt.trace.json").read_text())
        assert trace["traceEvents"]
    assert "TFLOP/s per rank" in capfd.readouterr().out
    for key in ("lm_loss", "params_norm"):
        assert [r[key] for r in runs["tp2"]] == pytest.approx([r[key] for r in runs["one"]], rel=1e-5), key
    assert all(isinstance(r["num_zeros_in_grad"], int) for r in runs["one"])
    assert runs["one"][0]["params_norm"] > 0


def test_exit_duration_no_save_optim_and_checkpoint_args(tmp_path):
    out = tmp_path / "a"
    ck = str(tmp_path / "ck")
    assert _run(_base(out, iters=6) + ["--save", ck, "--no-save-optim", "--no-save-rng",
                                       "--exit-duration-in-mins", "1e-9"]) == [0]
    assert [r["iteration"] for r in _records(out)] == [1]  # stopped after the first iteration
    assert os.path.isdir(os.path.join(ck, "iter_0000001"))
    # the optimizer state was left out: a resume that wants it gets one line and exit code 2
    assert _run(_base(tmp_path / "b", iters=6) + ["--load", ck]) == [2]
    # --use-checkpoint-args: the saved hidden size 32, not the given 64, so the weights load
    assert _run(_base(tmp_path / "c", iters=2) + ["--load", ck, "--no-load-optim", "--use-checkpoint-args",
                                                  "--hidden-size", "64"]) == [0]
    assert _run(_base(tmp_path / "d", iters=2) + ["--load", ck, "--no-load-optim", "--hidden-size", "64"]) == [2]


def test_decoupled_lr_drives_embedding_and_output_only(tmp_path):
    """--decoupled-lr 0: the word embedding and output layer keep their initial values (a run at --lr 0 holds
    them), every other weight moves; with a distributed optimizer over DP=2 too."""
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    common = ["--untie-embeddings-and-output-weights", "--train-iters", "2", "--weight-decay", "0.1"]
    runs = {}
    for name, world, extra in [("init", 1, ["--lr", "0", "--min-lr", "0"]),
                               ("dec", 1, ["--decoupled-lr", "0"]),
                               ("dec_dp2", 2, ["--decoupled-lr", "0", "--use-distributed-optimizer"])]:
        out = tmp_path / name
        assert _run(_base(out, iters=2) + common + extra + ["--save", str(out / "ck")], world) == [0] * world
        runs[name], _, _ = read_full_checkpoint(str(out / "ck"), progress=False)
    init = runs["init"]
    decoupled = [k for k in init if "word_embeddings" in k or "output_layer" in k]
    assert len(decoupled) == 2, decoupled
    for name in ("dec", "dec_dp2"):
        for k, v in runs[name].items():
            if k in decoupled:
                assert torch.equal(v, init[k]), (name, k)
            elif v.ndim == 2:
                assert not torch.equal(v, init[k]), (name, k)


def test_async_pipeline_runs_the_run_flags(tmp_path):
    """PipeOptim on PP=2: --profile traces the segment holding the profiled iterations, --manual-gc and the
    document flags (every stage reads the batch) run through the asynchronous engine, and
    --exit-duration-in-mins stops it at the next drain (evaluation runs inside the stream; --async-drain-interval
    fixes the drains)."""
    out = tmp_path / "a"
    flags = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights", "--pipeline-method",
             "pipeoptim", "--manual-gc", "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
             "--tensorboard-dir", str(out / "tb"), "--reset-position-ids", "--reset-attention-mask",
             "--position-embedding-type", "rope", "--eval-interval", "3", "--async-drain-interval", "3",
             "--exit-duration-in-mins", "1e-9"]
    assert _run(_base(out, iters=6) + flags, 2) == [0, 0]
    assert json.loads((out / "tb" / "trace_rank0_iter2-3.pt.trace.json").read_text())["traceEvents"]
    assert [r["iteration"] for r in _records(out)] == [1, 2, 3]  # stopped at the first drain (iteration 3)


def test_per_token_loss_dp2_equals_one_process(tmp_path):
    """--calculate-per-token-loss with --eod-mask-loss (micro-batches hold different numbers of loss tokens):
    DP=2 equals one process (the token count is the whole global batch's), and the loss differs from the
    mean of per-micro-batch means."""
    base = _base(tmp_path / "x")[:-2] + ["--vocab-size", "6", "--eod-mask-loss"]  # many EODs
    runs = {}
    for name, world, extra in [("one", 1, ["--calculate-per-token-loss"]), ("dp2", 2, ["--calculate-per-token-loss"]),
                               ("mean", 1, [])]:
        out = tmp_path / name
        assert _run(base + extra + ["--metrics-file", str(out / "m.jsonl")], world) == [0] * world
        runs[name] = [r["lm_loss"] for r in _records(out)]
    assert runs["dp2"] == pytest.approx(runs["one"], rel=1e-5)
    assert runs["mean"][0] != pytest.approx(runs["one"][0], rel=1e-6)
