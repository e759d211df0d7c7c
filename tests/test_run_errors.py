"""Issue 22, points 5-9: runs that misled their operator now stop with one line (docs/run_errors.md).

Most behaviours are shown in-process: a one-rank `run_main` (tiny mock-data GPT, a second or two), the
config validator, the preprocessing `main`s. One torchrun run shows the exit codes of a config error
under the launcher (point 7), where only a real launch can.
"""

import contextlib
import gzip
import io
import json
import os
import re
import subprocess
import sys

import pytest
from test_checkpoint import tiny_args

from megatron_po.config import parse_args, validate
from megatron_po.distributed.checkpoint_format import list_iterations, read_tracker
from megatron_po.errors import ConfigError, DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def run(argv, patch=None):
    """run_main in this process (world 1); returns (exit code, the stderr lines)."""
    from megatron_po.training import run_main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(argv)
    return code, [ln for ln in err.getvalue().splitlines() if ln.strip()]


def records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


# ---- 5. fp16: a hopeless run stops ------------------------------------------------------------------

def nan_losses(monkeypatch, from_call: int = 1):
    """Every micro-batch loss from the `from_call`-th on is NaN (forward blow-up)."""
    import megatron_po.pipeline.executor as executor
    loss_fn, count = executor.masked_mean_loss, [0]

    def nan_loss(*args):
        count[0] += 1
        loss = loss_fn(*args)
        return loss * float("nan") if count[0] >= from_call else loss
    monkeypatch.setattr(executor, "masked_mean_loss", nan_loss)


def test_fp16_nan_loss_at_the_loss_scale_floor_stops_with_exit_2(tmp_path, monkeypatch):
    """NaN loss from iteration 3 (4 micro-batches per iteration): scale 4 -> 2 -> 1 (hysteresis 1), and the
    NaN loss at scale 1 = --min-loss-scale stops iteration 5; before the issue it skipped every step and
    exited 0. A skipped step moves no weight: iteration 4's checkpoint (iteration 2's weights) is the last."""
    nan_losses(monkeypatch, from_call=9)
    ckpt = str(tmp_path / "ckpt")
    argv = tiny_args(str(tmp_path), **{"--fp16": True, "--initial-loss-scale": 4, "--hysteresis": 1,
                                       "--train-iters": 8, "--save": ckpt, "--save-interval": 2})
    code, lines = run(argv)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: fp16: the loss is NaN/inf at iteration 5 with the loss scale at its floor (1): "
                        f"a lower scale cannot help a non-finite loss; stopped, nothing saved; the last good "
                        f"checkpoint is iteration 4 in {ckpt}"), lines
    assert list_iterations(ckpt) == [2, 4]
    assert [r["skipped_iterations"] for r in records(tmp_path / "metrics.jsonl")] == [0, 0, 1, 1]


def test_consecutive_skipped_steps_are_bounded(tmp_path, monkeypatch):
    """Non-finite gradients at every step (a finite loss): --max-skipped-steps 3 stops iteration 3, even
    with the loss scale far from its floor."""
    from megatron_po.distributed.ddp import DistributedDataParallel
    sync = DistributedDataParallel.finish_grad_sync

    def nan_grad(self):
        sync(self)
        self.grad_buffer[0] = float("inf")
    monkeypatch.setattr(DistributedDataParallel, "finish_grad_sync", nan_grad)
    argv = tiny_args(str(tmp_path), **{"--fp16": True, "--max-skipped-steps": 3, "--train-iters": 8})
    code, lines = run(argv)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: 3 consecutive steps skipped for inf/NaN gradients up to iteration 3 "
                               "(--max-skipped-steps 3; loss scale 2.14748e+09)"), lines
    assert lines[0].endswith("stopped, nothing saved"), lines


def test_skip_guard_counts_consecutive_steps_only():
    """A clean step resets the count; 0 means no bound; the loss check only runs at the floor."""
    from megatron_po.run_rules import SkipGuard
    cfg = parse_args(MOCK + ["--fp16", "--max-skipped-steps", "2"])
    guard, asked = SkipGuard(cfg), []

    def agree(flag):
        asked.append(flag)
        return flag
    for skipped in (True, False, True, False):
        guard.after_step(1, skipped, 8.0, True, lambda: "", agree)
    assert asked == []  # scale 8 > floor 1: no agreement round
    guard.after_step(2, True, 8.0, False, lambda: "", agree)
    with pytest.raises(Exception, match="2 consecutive steps"):
        guard.after_step(3, True, 8.0, False, lambda: "", agree)
    unbounded = SkipGuard(parse_args(MOCK + ["--fp16", "--max-skipped-steps", "0"]))
    for _ in range(1000):
        unbounded.after_step(1, True, 8.0, False, lambda: "", agree)


def test_skip_guard_of_an_asynchronous_loss_stage():
    """Asynchronous methods: the loss stage's optimizer counts its skipped steps in a row (steps, several per
    iteration at --async-update-interval 1); the guard stops at the bound with the caller's error class."""
    from megatron_po.run_rules import SkipGuard

    class StageStop(Exception):
        pass
    guard = SkipGuard(parse_args(MOCK + ["--fp16", "--max-skipped-steps", "8"]))
    guard.after_iteration(1, 7, True, 2.0**20, False, lambda: "nothing saved", StageStop, "rank 1")
    guard.after_iteration(2, 0, False, 2.0**20, True, lambda: "nothing saved", StageStop, "rank 1")  # clean
    with pytest.raises(StageStop, match=r"^8 consecutive steps skipped for inf/NaN gradients up to iteration 3 on "
                                        r"rank 1 \(--max-skipped-steps 8; loss scale 1.04858e\+06\)"):
        guard.after_iteration(3, 8, True, 2.0**20, False, lambda: "nothing saved", StageStop, "rank 1")


# `python inject.py pretrain_gpt.py ...`: on rank 1 every micro-batch loss from the N-th on is NaN
INJECT = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
if os.environ.get("SLURM_PROCID") == "1":
    import megatron_po.pipeline.executor as executor
    loss_fn, count, n = executor.masked_mean_loss, [0], int(os.environ["NAN_FROM"])
    def nan_loss(*args):
        count[0] += 1
        loss = loss_fn(*args)
        return loss * float("nan") if count[0] >= n else loss
    executor.masked_mean_loss = nan_loss
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_fp16_nan_loss_in_an_asynchronous_pipeline_stops_at_the_floor(tmp_path):
    """PipeOptim, PP=2, fp16 (steps are stage-local): NaN losses from iteration 4 on; the loss stage's scale
    falls 4 -> 2 -> 1 within that iteration (a step per micro-batch) and it stops there with one line; rank 0
    is stopped by its watchdog. Before the issue the run skipped every step and exited 0."""
    from rank_launcher import launch, tagged_processes
    import uuid
    logs, tag = str(tmp_path / "logs"), uuid.uuid4().hex
    argv = tiny_args(str(tmp_path), **{"--pipeline-model-parallel-size": 2, "--train-iters": 8,
                                       "--untie-embeddings-and-output-weights": True, "--pipeline-method": "pipeoptim",
                                       "--fp16": True, "--initial-loss-scale": 4, "--hysteresis": 1,
                                       "--distributed-timeout-minutes": 0.5})
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    procs = launch(str(script), [os.path.join(ROOT, "pretrain_gpt.py"), *argv], 2, logs, tag, {"NAN_FROM": "13"})
    codes = [p.wait(timeout=240) for p in procs]
    log = [open(os.path.join(logs, f"rank{r}.log")).read() for r in range(2)]
    assert codes == [1, 2], log
    mine = [ln for ln in log[1].splitlines() if ln.startswith("error: ")]
    assert mine == ["error: fp16: the loss is NaN/inf at iteration 4 on rank 1 (pipeline stage 1, data-parallel "
                    "rank 0, tensor-parallel rank 0) with the loss scale at its floor (1): a lower scale cannot "
                    "help a non-finite loss; stopped, nothing saved"], log[1][-2000:]
    assert tagged_processes(tag) == []


# ---- 6. --finetune relaunched resumes -------------------------------------------------------------

def test_relaunched_finetune_resumes_from_save(tmp_path):
    """A base run saves iteration 4; the finetune command (--load base --save ft --finetune) is stopped at
    iteration 3 (--exit-interval) and relaunched with the same command (no exit interval is reached again):
    the relaunch resumes at 3 from --save, keeps the metrics of iterations 1-3 and ends at 6, the same
    losses as a finetune run never interrupted (bit for bit: dropout's RNG state is in the checkpoint)."""
    base = str(tmp_path / "base")
    assert run(tiny_args(str(tmp_path / "b"), **{"--train-iters": 4, "--save": base}))[0] == 0

    def finetune(out, **extra):
        return tiny_args(str(out), **{"--train-iters": 6, "--load": base, "--finetune": True,
                                      "--save": str(out / "ckpt"), **extra})
    ref = tmp_path / "ref"
    assert run(finetune(ref))[0] == 0
    reference = [(r["iteration"], r["lm_loss"]) for r in records(ref / "metrics.jsonl")]
    assert [i for i, _ in reference] == [1, 2, 3, 4, 5, 6]

    ft = tmp_path / "ft"
    assert run(finetune(ft, **{"--exit-interval": 3}))[0] == 0
    assert read_tracker(str(ft / "ckpt")) == 3
    # the relaunch: the same command (--exit-interval 3 would stop it at once; a requeue reruns the job as is
    # and its --exit-interval lies behind it)
    assert run(finetune(ft, **{"--exit-interval": 300}))[0] == 0
    assert [(r["iteration"], r["lm_loss"]) for r in records(ft / "metrics.jsonl")] == reference
    assert list_iterations(str(ft / "ckpt")) == [3, 6]


def test_load_plan():
    from megatron_po.run_rules import load_plan

    def plan(argv, saved):
        ck = parse_args(MOCK + argv).checkpoint
        return load_plan(ck, lambda d: 7 if d in saved else None)
    assert plan(["--load", "B", "--save", "S", "--finetune"], set()) == ("B", True, None)
    assert plan(["--load", "B", "--save", os.getcwd(), "--finetune", "--ckpt-step", "2"], {os.getcwd()}) \
        == (os.getcwd(), False, None)
    assert plan(["--save", os.getcwd()], {os.getcwd()}) == (os.getcwd(), False, None)
    assert plan(["--load", "B", "--save", os.getcwd()], {os.getcwd()}) == ("B", False, None)  # Megatron's --load


def test_finetune_with_save_equal_to_load_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--finetune with --save equal to --load"):
        validate(parse_args(MOCK + ["--load", str(tmp_path), "--save", str(tmp_path) + "/", "--finetune"]), 1)


# ---- 7. a config error under torchrun: once, exit 2 on every rank -----------------------------------

def test_config_error_under_torchrun_is_printed_once_and_workers_exit_2(tmp_path):
    """torchrun itself exits 1 when a worker fails (its ChildFailedError), whatever the worker's code; the
    workers' codes (2) are in its error report."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
           os.path.join(ROOT, "pretrain_gpt.py"), *MOCK, "--seed", "-1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("error: ")]
    assert lines == ["error: --seed must be in [0, 4294967296) (got -1): pipeline stage s seeds NumPy with seed + "
                     "100 x s, which must stay below 2**32 (--pipeline-model-parallel-size 1)"], done.stderr
    assert done.returncode == 1
    # its report lists each failed worker ("exitcode  : 2"); one it stopped first would show -15 (SIGTERM)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", done.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, done.stderr[-3000:]


def test_config_error_is_printed_by_rank_0_only(monkeypatch):
    for rank, expected in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        code, lines = run(MOCK + ["--seed", "-1"])
        assert code == 2 and len(lines) == expected, (rank, lines)


# ---- 8. seed and timeout ranges ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, world, words", [
    (["--seed", "-1"], 1, "--seed must be in [0, 4294967296) (got -1)"),
    (["--seed", str(2**32 - 100)], 2, "--seed must be in [0, 4294967196) (got 4294967196)"),
    (["--distributed-timeout-minutes", "inf"], 1, "--distributed-timeout-minutes must be finite (got inf)"),
    (["--distributed-timeout-minutes", "nan"], 1, "--distributed-timeout-minutes must be > 0 (got nan)"),
    (["--distributed-timeout-minutes", "-1"], 1, "--distributed-timeout-minutes must be > 0 (got -1.0)"),
])
def test_seed_and_timeout_out_of_range_are_config_errors(argv, world, words):
    pp = ["--pipeline-model-parallel-size", "2", "--num-layers", "2"] if world == 2 else []
    with pytest.raises(ConfigError) as e:
        validate(parse_args(MOCK + pp + argv), world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_largest_seed_runs(tmp_path):
    """2**32 - 1 - 100 x (PP - 1) is accepted and seeds every stage (was a NumPy traceback)."""
    validate(parse_args(MOCK + ["--seed", str(2**32 - 101), "--pipeline-model-parallel-size", "2",
                                "--num-layers", "2"]), 2)
    assert run(tiny_args(str(tmp_path), **{"--seed": 2**32 - 1, "--train-iters": 1}))[0] == 0


# ---- 9. smaller ones ----------------------------------------------------------------------------------

def test_split_without_validation_warns_once(tmp_path, capsys):
    from megatron_po.run_rules import no_validation_warning
    cfg = parse_args(["--data-path", "A", "--tokenizer-model", "t.model", "--split", "100,0,0"])
    assert no_validation_warning(cfg, None) == (
        "warning: --split 100,0,0 leaves no validation documents: evaluation (--eval-iters 10, --eval-interval "
        "1000) is skipped; pass --eval-iters 0 to silence this")
    assert no_validation_warning(cfg, object()) is None
    quiet = parse_args(["--data-path", "A", "--tokenizer-model", "t.model", "--split", "100,0,0",
                        "--eval-iters", "0"])
    assert no_validation_warning(quiet, None) is None


def corpus(prefix: str, documents: int, length: int = 50) -> str:
    """A tiny indexed dataset of `documents` documents of `length` token ids < 99."""
    import numpy as np

    from megatron_po.data.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        builder.add_item(rng.integers(0, 99, length))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_split_without_validation_warns_in_a_run(tmp_path, capsys):
    """A real (tiny) corpus with --split 100,0,0: the run says once that it will not evaluate."""
    prefix = corpus(str(tmp_path / "corpus"), 40)
    argv = [a for a in tiny_args(str(tmp_path), **{"--train-iters": 2, "--eval-interval": 1})
            if a != "--mock-data"] + ["--data-path", prefix, "--split", "100,0,0"]
    code, _ = run(argv)
    out = capsys.readouterr().out
    assert code == 0 and out.count("warning: --split 100,0,0 leaves no validation documents") == 1, out


def test_load_past_train_iters_is_one_line_and_exit_2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run(tiny_args(str(tmp_path), **{"--train-iters": 3, "--save": ckpt}))[0] == 0
    code, lines = run(tiny_args(str(tmp_path), **{"--train-iters": 2, "--save": ckpt, "--load": ckpt}))
    assert code == 2 and lines == [f"error: the checkpoint in {ckpt} is at iteration 3, past --train-iters (2): "
                                   f"nothing to train; raise --train-iters (or --train-samples) to continue, or "
                                   f"point --load elsewhere"], lines
    # exactly at --train-iters: a finished run relaunched; nothing to do, exit 0 (as Megatron)
    assert run(tiny_args(str(tmp_path), **{"--train-iters": 3, "--save": ckpt, "--load": ckpt}))[0] == 0


@pytest.mark.parametrize("value", ["-1e-3", "-.5", "-2E+1"])
def test_negative_lr_reaches_the_validator(value):
    cfg = parse_args(MOCK + ["--lr", value])
    assert cfg.training.lr == float(value)
    with pytest.raises(ConfigError, match=r"need 0 <= --min-lr \(0.0\) <= --lr"):
        validate(cfg, 1)


def test_unweighted_data_paths_are_accepted():
    from megatron_po.data.gpt_dataset import parse_data_path
    validate(parse_args(["--data-path", "A", "B", "--tokenizer-model", "t.model"]), 1)
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)
    assert parse_data_path(["A", "B", "C"]) == (["A", "B", "C"], None)
    with pytest.raises(DataError, match="weight 'x' is not a number"):
        parse_data_path(["x", "A", "0.7", "B"])


def test_unweighted_data_paths_blend_by_size(tmp_path):
    """Two prefixes without weights: one dataset drawing from both in proportion to their tokens."""
    from megatron_po.data.gpt_dataset import build_gpt_datasets
    prefixes = [corpus(str(tmp_path / name), docs, 40) for name, docs in (("a", 30), ("b", 10))]
    train, _, _ = build_gpt_datasets(prefixes, "100,0,0", 16, 1, (40, 0, 0), str(tmp_path / "cache"))
    assert train.weights == pytest.approx([0.75, 0.25])


def test_tokenizer_model_directory_is_reported_as_a_directory(tmp_path):
    from megatron_po.data.tokenizer import build_tokenizer
    with pytest.raises(DataError, match=f"tokenizer model '{tmp_path}' is a directory, not a file "
                                        r"\(SentencePieceTokenizer reads a .model file"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path))
    with pytest.raises(DataError, match=r"--vocab-file '.*' is a directory"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path), merge_file=str(tmp_path))


PREPROCESS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars of `datasets`


def test_preprocessing_names_the_line_of_invalid_json(tmp_path, capsys):
    from tools import preprocess_data
    out = ["--output-prefix", str(tmp_path / "out"), *PREPROCESS]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n{"text": "3"\n{"text": "4"}\n')
    assert preprocess_data.main(["--input", str(bad), *out]) == 2
    assert _last_error(capsys) == (f"error: input file '{bad}', line 2: invalid JSON: Expecting ',' delimiter "
                                   f"(column 13)")
    compressed = tmp_path / "bad.jsonl.gz"
    with gzip.open(compressed, "wt") as f:
        f.write('{"text": "1 2"}\n\n{"text": 3 4}\n')
    assert preprocess_data.main(["--input", str(compressed), *out]) == 2
    assert _last_error(capsys) == (f"error: input file '{compressed}', line 3: invalid JSON: Expecting ',' delimiter "
                                   f"(column 12)")
    array = tmp_path / "rows.json"  # one JSON document over several lines
    array.write_text('[\n{"text": "1"},\n{"text": }\n]')
    assert preprocess_data.main(["--input", str(array), *out]) == 2
    assert _last_error(capsys) == f"error: input file '{array}', line 3: invalid JSON: Expecting value (column 10)"


def test_preprocessing_says_empty_input_file(tmp_path, capsys):
    from tools import preprocess_data, preprocess_nmt
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert preprocess_data.main(["--input", str(empty), "--output-prefix", str(tmp_path / "o"), *PREPROCESS]) == 2
    assert _last_error(capsys) == f"error: empty input file '{empty}'"
    nmt = ["--output-prefix", str(tmp_path / "nmt"), "--src-lang", "en", "--tgt-lang", "fr"]
    assert preprocess_nmt.main(["--input", str(empty), *nmt]) == 2
    assert _last_error(capsys) == f"error: empty input file '{empty}'"
    (tmp_path / "t.en").write_text("")
    (tmp_path / "t.fr").write_text("")
    assert preprocess_nmt.main(["--input", str(tmp_path / "t.en"), str(tmp_path / "t.fr"), *nmt]) == 2
    assert _last_error(capsys) == f"error: empty input file '{tmp_path / 't.en'}'"
