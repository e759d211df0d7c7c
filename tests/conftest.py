import os

# Tests never reach the network: datasets and the hub read local files only, W&B writes offline.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import gzip  # noqa: E402

import pytest  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data",
                      "bible_web.en.jsonl.gz")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small tokenizer and the first 300 chapters preprocessed to .bin/.idx (one per test session, shared
    by every module that asks for it)."""
    from tools import preprocess_data, train_tokenizer
    d = tmp_path_factory.mktemp("corpus")
    src = d / "bible300.jsonl"
    with gzip.open(CORPUS, "rt") as f, open(src, "w") as out:
        for i, line in enumerate(f):
            if i == 300:
                break
            out.write(line)
    assert train_tokenizer.main(["--input", str(src), "--json-keys", "text", "--vocab-size", "500",
                                 "--output-prefix", str(d / "tok")]) == 0
    assert preprocess_data.main(["--input", str(src), "--json-keys", "text", "--tokenizer-type",
                                 "SentencePieceTokenizer", "--tokenizer-model", str(d / "tok.model"),
                                 "--output-prefix", str(d / "bible"), "--append-eod", "--workers", "1"]) == 0
    return {"prefix": str(d / "bible_text_document"), "model": str(d / "tok.model"), "dir": d}
