"""bench/convergence.py end to end on a minuscule setting, so the benchmark cannot silently rot.

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
                                                  os.path.join(REPO, "bench", "convergence.py"))
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


def test_nmt_workload_is_a_clear_hook(bench):
    with pytest.raises(NotImplementedError, match="nmt"):
        bench.build_workload(bench.Settings(workload="nmt"))
