import os

# Tests never reach the network: datasets and the hub read local files only, W&B writes offline.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import gzip  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data",
                      "bible_web.en.jsonl.gz")


def write_chapters(path, count: int):
    """The bundled corpus's first `count` chapters as a jsonl file (returns its path)."""
    with gzip.open(CORPUS, "rt") as f, open(path, "w") as out:
        for i, line in enumerate(f):
            if i == count:
                break
            out.write(line)
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a GPU (skipped with 'needs CUDA' without one); "
                                       "scripts/run_gpu_tests.sh selects these")


# Seconds each test file took in a measured run of the suite (bench/micro/suite_time.py --file-seconds writes it):
# the slowest files are collected first, so that scripts/run_tests.sh's parallel processes (pytest-xdist, a file per
# process, in collection order) start them first and no long file runs alone at the end. A file it does not name
# goes last.
FILE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def pytest_collection_modifyitems(session, config, items):
    try:
        with open(FILE_SECONDS) as f:
            seconds = json.load(f)["seconds"]
    except (OSError, ValueError, KeyError):
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    # stable: the tests of one file keep their order, files of equal weight their collection order
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0),
                                 first_seen[item.nodeid.split("::")[0]]))


@pytest.hookimpl(trylast=True)  # after pytest's durations report, before its closing line
def pytest_terminal_summary(terminalreporter):
    """scripts/run_tests.sh's wall time, its set-up included, just before pytest's closing line (issue 60)."""
    started = os.environ.get("RUN_TESTS_STARTED")
    if started:
        seconds = time.time() - float(started)
        terminalreporter.write_line(f"scripts/run_tests.sh: {int(seconds // 60)} min {int(seconds % 60):02d} s of wall "
                                    f"time on {len(os.sched_getaffinity(0))} cores, "
                                    f"{os.environ.get('RUN_TESTS_WORKERS', '1')} pytest processes")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small tokenizer and the first 300 chapters preprocessed to .bin/.idx (one per test session, shared
    by every module that asks for it)."""
    from tools import preprocess_data, train_tokenizer
    d = tmp_path_factory.mktemp("corpus")
    src = write_chapters(d / "bible300.jsonl", 300)
    assert train_tokenizer.main(["--input", str(src), "--json-keys", "text", "--vocab-size", "500",
                                 "--output-prefix", str(d / "tok")]) == 0
    assert preprocess_data.main(["--input", str(src), "--json-keys", "text", "--tokenizer-type",
                                 "SentencePieceTokenizer", "--tokenizer-model", str(d / "tok.model"),
                                 "--output-prefix", str(d / "bible"), "--append-eod", "--workers", "1"]) == 0
    return {"prefix": str(d / "bible_text_document"), "model": str(d / "tok.model"), "dir": d}


@pytest.fixture(scope="session")
def byte_bpe(tmp_path_factory):
    """A byte-level BPE (vocabulary 1000) trained on the first 300 chapters by tools/train_tokenizer.py: a
    directory holding GPT-2's vocab.json/merges.txt and a Hugging Face tokenizer (tokenizer.json + config)."""
    from tools import train_tokenizer
    d = tmp_path_factory.mktemp("byte_bpe")
    src = write_chapters(d / "bible300.jsonl", 300)
    assert train_tokenizer.main(["--input", str(src), "--model-type", "byte-bpe", "--vocab-size", "1000",
                                 "--output-prefix", str(d / "tok")]) == 0
    return {"dir": d / "tok", "src": src}


def _preprocess(src, prefix, tokenizer_args):
    from tools import preprocess_data
    assert preprocess_data.main(["--input", str(src), "--json-keys", "text", "--output-prefix", str(prefix),
                                 "--append-eod", "--workers", "1", *tokenizer_args]) == 0
    return str(prefix) + "_text_document"


@pytest.fixture(scope="session")
def bpe_corpus(byte_bpe):
    """The 300 chapters preprocessed with GPT2BPETokenizer. `args`: the tokenizer flags pretrain_gpt.py needs."""
    d = byte_bpe["dir"]
    args = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"),
            "--merge-file", str(d / "merges.txt")]
    return {"prefix": _preprocess(byte_bpe["src"], d.parent / "bpe", args), "vocab_file": str(d / "vocab.json"),
            "merge_file": str(d / "merges.txt"), "args": args, "dir": d.parent}


@pytest.fixture(scope="session")
def hf_corpus(byte_bpe):
    """The 300 chapters preprocessed with HuggingFaceTokenizer (BOS before, EOD after every document).
    `args`: the tokenizer flags pretrain_gpt.py needs."""
    d = byte_bpe["dir"]
    args = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d)]
    return {"prefix": _preprocess(byte_bpe["src"], d.parent / "hf", args), "model": str(d), "args": args,
            "dir": d.parent}
