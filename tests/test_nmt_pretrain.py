"""pretrain_nmt.py end to end (`training.run_main` with the NMT workload) and tools/translate.py.

- A TP=2 x PP=2 run matches the single-process run's loss curve (|delta| <= 2e-3 at every logged
  iteration and at the evaluation: fp32, other reduction orders through 10 AdamW steps); both log the
  validation BLEU; the loss falls.
- tools/translate.py reads the single-process checkpoint and, decoding the same validation sentences
  greedily in the same batches, reproduces the BLEU logged at the last evaluation exactly; it also reads
  the TP=2 x PP=2 checkpoint (any layout) and scores within 1 BLEU of that run's own evaluation.
- PipeOptim (asynchronous, PP=2) trains the NMT model through the same loop.
- Micro-batches respect --micro-batch-size and --max-tokens, and one epoch holds every pair once.
- Bad input: one `error:` line, exit code 2.
"""

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from dist_harness import run_distributed

from megatron_po.nmt_workload import corpus_scores
from tools import preprocess_nmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "examples", "data", "bible_web_lsg1910.en-fr.jsonl.gz")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Genesis 1-15 for training, Ruth for validation, Jonah for test; a 992-piece joint vocabulary
    (a multiple of 16 x TP=2: the same padded vocabulary under TP=1 and TP=2)."""
    d = tmp_path_factory.mktemp("nmt_e2e")
    with gzip.open(CORPUS, "rt") as f, open(d / "slice.jsonl", "w") as out:
        for line in f:
            ref = json.loads(line)["ref"]
            name, chapter = ref.rsplit(" ", 1)[0], int(ref.rsplit(" ", 1)[1].split(":")[0])
            if (name == "Genesis" and chapter <= 15) or name in ("Ruth", "Jonah"):
                out.write(line)
    prefix = str(d / "bible")
    assert preprocess_nmt.main(["--input", str(d / "slice.jsonl"), "--src-lang", "en", "--tgt-lang", "fr",
                                "--doc-key", "ref", "--doc-regex", r"^(.+?) [0-9]+:[0-9]+$", "--valid-docs", "Ruth",
                                "--test-docs", "Jonah", "--vocab-size", "992", "--max-length", "100",
                                "--output-prefix", prefix]) == 0
    return {"prefix": prefix, "model": prefix + ".model", "dir": d}


def argv_for(data, out, **overrides):
    args = {"--encoder-num-layers": 1, "--decoder-num-layers": 1, "--hidden-size": 32, "--num-attention-heads": 4,
            "--seq-length": 64, "--decoder-seq-length": 40, "--micro-batch-size": 8, "--global-batch-size": 16,
            "--train-iters": 10, "--lr": 5e-3, "--lr-warmup-iters": 2, "--hidden-dropout": 0.0,
            "--attention-dropout": 0.0, "--make-vocab-size-divisible-by": 16, "--data-path": data["prefix"],
            "--tokenizer-model": data["model"], "--src-lang": "en", "--tgt-lang": "fr", "--log-interval": 2,
            "--eval-interval": 10, "--eval-bleu-sentences": 16, "--metrics-file": str(out / "metrics.jsonl"),
            "--save": str(out / "ckpt"), "--seed": 5}
    args.update(overrides)  # True: a switch; None: dropped
    return [x for k, v in args.items() if v is not None for x in ([k] if v is True else [k, str(v)])]


def run_nmt(argv):
    from megatron_po.nmt_workload import NMTWorkload
    from megatron_po.training import run_main
    return run_main(argv, workload_cls=NMTWorkload)


def run_layout(data, tmp_path, name, world, **flags):
    out = tmp_path / name
    out.mkdir()
    assert run_distributed(run_nmt, world, args=(argv_for(data, out, **flags),), timeout=300) == [0] * world
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], out


def translate(args, out_path):
    """tools/translate.py in this process: (BLEU, chrF) from its report line, and its output lines.
    (Not capsys: the forked ranks of run_distributed need a real stderr.)"""
    from tools import translate as tool
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert tool.main(["--no-progress", "--output", str(out_path), *args]) == 0, err.getvalue()
    line = err.getvalue().strip().splitlines()[-1]  # "BLEU 1.23 | chrF 4.56 | 16 sentences, beam 1"
    return float(line.split()[1]), float(line.split()[4]), out_path.read_text().splitlines()


def test_tp2_pp2_matches_single_process_and_translate_reproduces_bleu(data, tmp_path):
    single, single_dir = run_layout(data, tmp_path, "single", 1)
    parallel, parallel_dir = run_layout(data, tmp_path, "tp2pp2", 4, **{"--tensor-model-parallel-size": 2,
                                                                        "--pipeline-model-parallel-size": 2})
    for key in ("lm_loss", "val_loss"):
        a, b = [r[key] for r in single if key in r], [r[key] for r in parallel if key in r]
        assert len(a) == len(b) == (5 if key == "lm_loss" else 1)
        assert max(abs(x - y) for x, y in zip(a, b)) <= 2e-3, (key, a, b)
    losses = [r["lm_loss"] for r in single if "lm_loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("val_bleu" in r for r in single + parallel if "val_loss" in r)

    sources, references = tmp_path / "valid16.en", tmp_path / "valid16.fr"
    for path, suffix in ((sources, "en"), (references, "fr")):
        with open(f"{data['prefix']}_valid.{suffix}") as f:
            path.write_text("".join(f.readlines()[:16]))
    common = ["--input", str(sources), "--reference", str(references), "--batch-size", "8"]
    bleu, chrf, out = translate(["--load", str(single_dir / "ckpt"), *common], tmp_path / "hyp")
    refs = references.read_text().splitlines()
    assert corpus_scores(out, refs)["bleu"] == pytest.approx(single[-1]["val_bleu"], abs=1e-9)
    assert bleu == pytest.approx(single[-1]["val_bleu"], abs=0.005) and chrf > 0 and len(out) == 16
    bleu_parallel, _, _ = translate(["--load", str(parallel_dir / "ckpt"), *common, "--beam-size", "1"],
                                    tmp_path / "hyp2")
    assert abs(bleu_parallel - parallel[-1]["val_bleu"]) <= 1.0
    # The copy-the-source baseline needs no model.
    _, copy_chrf, copied = translate(["--copy-source", *common], tmp_path / "copy")
    assert copied == sources.read_text().splitlines() and copy_chrf > 0


def test_pipeoptim_trains_the_nmt_model(data, tmp_path):
    metrics, _ = run_layout(data, tmp_path, "pipeoptim", 2, **{
        "--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim", "--optimizer": "adam",
        "--untie-embeddings-and-output-weights": True, "--global-batch-size": 32, "--save": None})
    losses = [r["lm_loss"] for r in metrics if "lm_loss" in r]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses
    assert [r["iteration"] for r in metrics if "val_bleu" in r] == [10]


def test_eval_iters_zero_trains_without_validation(data, tmp_path):
    """--eval-iters 0 means no validation (Megatron's meaning): the run ends cleanly, logs no val_loss (it
    used to divide by zero in the end-of-training evaluation)."""
    metrics, _ = run_layout(data, tmp_path, "noeval", 1, **{"--train-iters": 4, "--eval-interval": 2,
                                                            "--eval-iters": 0, "--save": None})
    assert [r["iteration"] for r in metrics if "lm_loss" in r] == [2, 4]
    assert not any("val_loss" in r for r in metrics)


def test_micro_batches_respect_sentence_and_token_caps(data):
    from megatron_po.data.nmt_dataset import PairBatches, ParallelCorpus
    corpus = ParallelCorpus(data["prefix"], "train", "en", "fr", 992, 992)
    make = lambda: PairBatches(corpus, bos=2, eos=3, pad=0, max_src_length=48, max_tgt_length=40,  # noqa: E731
                               max_sentences=16, max_tokens=400, seed=1, shuffle=True)
    batches = make()
    epoch = [batches.pair_ids(k) for k in range(len(batches))]
    assert sorted(np.concatenate(epoch).tolist()) == list(range(len(corpus)))  # every pair once
    for k in range(len(batches) + 3):  # into the second epoch
        b = batches[k]
        rows, longest = b["src_tokens"].shape[0], max(b["src_tokens"].shape[1], b["tgt_tokens"].shape[1])
        assert rows <= 16 and rows * longest <= 400
        assert b["src_tokens"].shape[1] <= 48 and b["tgt_tokens"].shape[1] <= 40
        assert (b["src_mask"].sum(1) == (b["src_tokens"] != 0).sum(1)).all()
        assert (b["labels"][b["loss_mask"] == 1] != 0).all() and (b["tgt_tokens"][:, 0] == 2).all()
    assert any(len(batches.pair_ids(k)) < 16 for k in range(len(batches)))  # the token cap binds somewhere
    assert all((a == b).all() for a, b in zip(epoch, [make().pair_ids(k) for k in range(len(batches))]))


def test_bad_flag_through_the_command_line_is_one_error_line(data, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_nmt.py"),
                           *argv_for(data, tmp_path, **{"--save": None, "--sequence-parallel": True})],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --sequence-parallel is not supported by pretrain_nmt.py (sentence lengths vary per batch)"]


@pytest.mark.parametrize("flags,message", [
    ({"--tgt-tokenizer-model": "other.model"}, "error: --tgt-tokenizer-model gives the target its own vocabulary"),
    ({"--max-tokens": 32}, "error: --max-tokens (32) must hold one sentence of the longest allowed length"),
    ({"--split": "90,5,5"}, "error: --split (90,5,5) does not apply to pretrain_nmt.py"),
    ({"--data-path": "/nonexistent/corpus"}, "error: indexed dataset '/nonexistent/corpus_train_en': missing"),
    ({"--encoder-num-layers": 2, "--pipeline-model-parallel-size": 2},
     "error: --encoder-num-layers + --decoder-num-layers (3) is not divisible by --pipeline-model-parallel-size (2)"),
])
def test_bad_input_is_one_error_line(data, tmp_path, flags, message, capsys, monkeypatch):
    if "--pipeline-model-parallel-size" in flags:
        monkeypatch.setenv("WORLD_SIZE", "2")  # the layer rule is checked before any process group exists
    assert run_nmt(argv_for(data, tmp_path, **{"--save": None, **flags})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
