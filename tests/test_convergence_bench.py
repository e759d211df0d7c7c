"""bench/convergence/convergence.py end to end on a minuscule setting, so the benchmark cannot silently rot.

Two methods (1F1B and PipeOptim), one optimizer, one seed, D = 2, 12 micro-batches of a 2-layer model
on a tiny generated corpus (tokenizer training and preprocessing included), one worker process. Checks
that the report and the plot are written and that the tables have the columns the report promises.
"""

import gzip
import importlib.util
import json
import os
import random
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convergence",
                                                  os.path.join(REPO, "bench", "convergence", "convergence.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def write_corpus(path, num_docs=40):
    words = ("the light and darkness was upon face of deep waters spirit god said let there be evening morning "
             "day heaven earth seas grass herb seed fruit tree kind lights stars sun moon birds fish").split()
    rng = random.Random(0)
    with gzip.open(path, "wt") as f:
        for d in range(num_docs):
            sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))).capitalize() + "."
                         for _ in range(rng.randint(8, 14))]
            f.write(json.dumps({"id": f"doc {d}", "text": " ".join(sentences)}) + "\n")


def test_minuscule_benchmark_writes_report_and_plot(bench, tmp_path):
    corpus = tmp_path / "corpus.jsonl.gz"
    write_corpus(corpus)
    s = bench.Settings(depths=[2], optimizers=["adam"], methods=["1f1b", "pipeoptim"], seeds=1, steps=12,
                       out=str(tmp_path / "out"), jobs=1, num_layers=2, hidden_size=16, num_attention_heads=2,
                       seq_length=16, micro_batch=2, vocab_size=120, corpus=str(corpus), split="90,10,0",
                       warmup=2, eval_interval=6, eval_batches=2, tail=4, check_updates=2, timing_rounds=1,
                       command="pytest tests/test_convergence_bench.py")
    result = bench.run_benchmark(s, log=lambda *_: None)

    assert os.path.isfile(result["md"]) and os.path.isfile(result["png"])
    with open(result["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(result["png"]) > 10_000

    header, rows = result["table"]
    assert header == ["D", "optimizer", "method", "updates", "samples/update", "final train loss",
                      "final val loss", "val gap to 1F1B", "tokens/s (sim.)",
                      "weight copies/stage: max (r0/…/rD-1)", "val vs 1F1B"]
    by_method = {r[2]: dict(zip(header, r)) for r in rows}
    assert set(by_method) == {"1F1B", "PipeOptim"}
    for row in by_method.values():
        assert row["D"] == "2" and row["optimizer"] == "Adam" and row["updates"] == "12"
        assert " ± " in row["final train loss"] and " ± " in row["final val loss"]
        assert float(row["tokens/s (sim.)"].replace(",", "")) > 0
    assert by_method["1F1B"]["weight copies/stage: max (r0/…/rD-1)"] == "1 (1/1)"
    assert by_method["PipeOptim"]["weight copies/stage: max (r0/…/rD-1)"] == "2 (2/1)"
    assert by_method["PipeOptim"]["val gap to 1F1B"].endswith("%")

    # The start-up check: the real 1F1B op list equals the unpipelined reference the columns come from.
    check = result["summary"]["calibrations"][(2, "adam")]["check"]
    assert check["1f1b"]["max_abs_diff"] < 1e-4 and check["gpipe"]["max_abs_diff"] < 1e-4

    text = open(result["md"]).read()
    assert text.splitlines()[2] == "Command: `pytest tests/test_convergence_bench.py`"
    for section in ("## Settings", "## How the comparison is made fair", "## Results", "## PipeOptim against",
                    "## Verdict", "## Notes", "Unigram baseline"):
        assert section in text
    assert "- D=2, Adam: PipeOptim vs 1F1B: " in text


def write_parallel_corpus(path, books, verses=40):
    """Verse pairs {"ref", "en", "fr"} of a word-for-word toy language pair, in the named books."""
    pairs = dict(zip("the light and darkness was upon face of deep waters spirit god said let there be".split(),
                     "la lumière et ténèbres était sur face de abîme eaux esprit dieu dit que il soit".split()))
    rng = random.Random(1)
    with open(path, "w") as f:
        for book in books:
            for v in range(1, verses + 1):
                words = [rng.choice(list(pairs)) for _ in range(rng.randint(3, 7))]
                f.write(json.dumps({"ref": f"{book} 1:{v}", "en": " ".join(words).capitalize() + ".",
                                    "fr": " ".join(pairs[w] for w in words).capitalize() + "."}) + "\n")


def test_minuscule_nmt_benchmark_has_bleu_columns(bench, tmp_path):
    """--workload nmt: the encoder-decoder model through the same jobs, with the BLEU columns; the
    one-target-length micro-batches keep the GPipe/1F1B check exact."""
    corpus = tmp_path / "pairs.jsonl"
    write_parallel_corpus(corpus, ["Genesis", "Exodus", *bench.NMTWorkload.VALID_BOOKS, *bench.NMTWorkload.TEST_BOOKS])
    s = bench.nmt_settings(bench.Settings())
    s = bench.dataclasses.replace(s, depths=[2], methods=["1f1b", "pipeoptim"], seeds=1, steps=8,
                                  out=str(tmp_path / "out"), jobs=1, num_layers=2, hidden_size=16,
                                  num_attention_heads=2, seq_length=24, micro_batch=2, vocab_size=360,
                                  corpus=str(corpus), warmup=2, eval_interval=4, eval_batches=2, tail=4,
                                  check_updates=2, timing_rounds=1, command="pytest nmt")
    result = bench.run_benchmark(s, log=lambda *_: None)
    header, rows = result["table"]
    assert header[-2:] == ["final val BLEU (greedy)", "BLEU vs 1F1B"]
    by_method = {r[2]: dict(zip(header, r)) for r in rows}
    assert set(by_method) == {"1F1B", "PipeOptim"}
    for row in by_method.values():
        assert " ± " in row["final val loss"] and " ± " in row["final val BLEU (greedy)"]
        assert float(row["final val BLEU (greedy)"].split(" ± ")[0]) >= 0
    check = result["summary"]["calibrations"][(2, "adam")]["check"]
    assert check["1f1b"]["max_abs_diff"] < 1e-4 and check["gpipe"]["max_abs_diff"] < 1e-4
    text = open(result["md"]).read()
    assert "encoder-decoder transformer, 1 encoder + 1 decoder layers" in text
    assert "Copy-the-source baseline" in text and "sentence pairs" in text


def test_predictor_variants_get_their_table_and_plot(bench, tmp_path):
    """Beyond the paper: predictor / gradient-side variants run as extra columns with their own table
    (gap to 1F1B, fraction of PipeOptim's gap closed, throughput vs PipeOptim) and predictors.png."""
    corpus = tmp_path / "corpus.jsonl.gz"
    write_corpus(corpus)
    s = bench.Settings(depths=[2], optimizers=["adam"], methods=["1f1b", "pipeoptim", "po-rollout", "pipedream-dc"],
                       seeds=1, steps=8, out=str(tmp_path / "out"), jobs=1, num_layers=2, hidden_size=16,
                       num_attention_heads=2, seq_length=16, micro_batch=2, vocab_size=120, corpus=str(corpus),
                       split="90,10,0", warmup=2, eval_interval=4, eval_batches=1, tail=4, check_updates=1,
                       timing_rounds=1, command="pytest predictors")
    result = bench.run_benchmark(s, log=lambda *_: None)
    assert {r[2] for r in result["table"][1]} == {"1F1B", "PipeOptim"}  # variants stay out of the main table
    header, rows = bench.predictor_table(s, result["summary"])
    by_method = {r[2]: dict(zip(header, r)) for r in rows}
    assert set(by_method) == {"PipeOptim", "PO rollout (first moment, +decay)", "PipeDream + delay comp."}
    assert by_method["PipeOptim"]["fraction of PipeOptim's gap closed"] == "0 (reference)"
    assert by_method["PipeDream + delay comp."]["weight copies/stage"] == "2 (2/1)"  # PipeDream's stash
    assert float(by_method["PO rollout (first moment, +decay)"]["tokens/s vs PipeOptim (sim.)"]) > 0
    text = open(result["md"]).read()
    assert "## Beyond the paper: weight predictors" in text and "Moonshot" in text
    assert os.path.getsize(os.path.join(s.out, "predictors.png")) > 10_000
    # The fraction closed: 1 at the synchronous loss, 0 at PipeOptim's, when PipeOptim's gap is real.
    po = {"val_ms": (6.0, 0.01), "seeds": [1, 2]}
    sync = {"val_ms": (5.0, 0.01), "seeds": [1, 2]}
    assert bench.gap_closed({"val_ms": (5.5, 0.0)}, po, sync) == 0.5
    assert bench.gap_closed({"val_ms": (5.5, 0.0)}, {"val_ms": (5.01, 0.01), "seeds": [1, 2]}, sync) is None
