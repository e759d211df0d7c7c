"""tools/preprocess_nmt.py: round trip, split by whole books, Megatron-compatible output, bad input.

A slice of the bundled English-French Bible (Genesis 1-6, Ruth, Jonah, Obadiah) keeps it to seconds.
"""

import gzip
import json
import os

import pytest

from megatron_po.data.indexed_dataset import IndexedDataset
from megatron_po.data.nmt_dataset import ParallelCorpus
from megatron_po.data.tokenizer import SentencePieceTokenizer
from tools import preprocess_nmt
from tools.preprocess_nmt import normalize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "examples", "data", "bible_web_lsg1910.en-fr.jsonl.gz")
BOOKS = ("Ruth", "Jonah", "Obadiah")


def bible_slice(path):
    rows = []
    with gzip.open(CORPUS, "rt") as f:
        for line in f:
            row = json.loads(line)
            book, chapter = row["ref"].rsplit(" ", 1)[0], int(row["ref"].rsplit(" ", 1)[1].split(":")[0])
            if (book == "Genesis" and chapter <= 6) or book in BOOKS:
                rows.append(row)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return rows


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    d = tmp_path_factory.mktemp("nmt")
    rows = bible_slice(d / "slice.jsonl")
    prefix = str(d / "out" / "bible")
    rc = preprocess_nmt.main(["--input", str(d / "slice.jsonl"), "--src-lang", "en", "--tgt-lang", "fr",
                              "--doc-key", "ref", "--doc-regex", r"^(.+?) [0-9]+:[0-9]+$",
                              "--valid-docs", "Ruth", "--test-docs", "Jonah", "--vocab-size", "600",
                              "--output-prefix", prefix, "--workers", "2"])
    assert rc == 0
    return rows, prefix


def book(row):
    return row["ref"].rsplit(" ", 1)[0]


def test_round_trip_split_by_books_and_no_held_out_verse_in_training(preprocessed):
    rows, prefix = preprocessed
    tok = SentencePieceTokenizer(prefix + ".model")
    texts = {s: [] for s in ("train", "valid", "test")}
    for s in texts:
        corpus = ParallelCorpus(prefix, s, "en", "fr", tok.vocab_size, tok.vocab_size)
        for i in range(len(corpus)):
            src, tgt = corpus.pair(i)
            texts[s].append((tok.detokenize(src), tok.detokenize(tgt)))
    normalized = {name: [(normalize(r["en"]), normalize(r["fr"])) for r in rows if book(r) == name]
                  for name in ("Genesis",) + BOOKS}
    # Whole books: validation is Ruth, test is Jonah, every verse, in order; decoding gives the normalised text.
    assert texts["valid"] == normalized["Ruth"] and len(texts["valid"]) == 84
    assert texts["test"] == normalized["Jonah"] and len(texts["test"]) == 48
    # Training: Genesis and Obadiah, deduplicated, never a sentence of a held-out book.
    held_out = {x for pair in normalized["Ruth"] + normalized["Jonah"] for x in pair}
    assert not any(src in held_out or tgt in held_out for src, tgt in texts["train"])
    assert set(texts["train"]) <= set(normalized["Genesis"] + normalized["Obadiah"])
    assert len(texts["train"]) == len(set(texts["train"])) > 0.95 * len(normalized["Genesis"] + normalized["Obadiah"])
    # The line files hold the same normalised validation/test text (references for tools/translate.py).
    with open(prefix + "_valid.fr", encoding="utf-8") as f:
        assert f.read().splitlines() == [t for _, t in normalized["Ruth"]]
    meta = json.load(open(prefix + ".json"))
    assert meta["documents"]["valid"] == ["Ruth"] and meta["documents"]["test"] == ["Jonah"]
    assert meta["pairs"] == {s: len(texts[s]) for s in texts}


def test_output_is_megatron_indexed_one_sentence_per_document(preprocessed):
    _, prefix = preprocessed
    for lang in ("en", "fr"):
        ds = IndexedDataset(f"{prefix}_valid_{lang}")
        assert len(ds) == ds.num_documents == 84
        assert list(ds.document_indices) == list(range(85))
        assert ds.dtype.name == "uint16"  # vocabulary < 65500, Megatron's choice


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def test_misaligned_parallel_files_name_both_line_counts(tmp_path, capsys):
    write_lines(tmp_path / "a.en", ["one", "two", "three"])
    write_lines(tmp_path / "b.fr", ["un", "deux"])
    rc = preprocess_nmt.main(["--input", str(tmp_path / "a.en"), str(tmp_path / "b.fr"), "--src-lang", "en",
                              "--tgt-lang", "fr", "--output-prefix", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (f"error: misaligned parallel files: {tmp_path / 'a.en'} has 3 lines but {tmp_path / 'b.fr'} "
                      f"has 2 lines (line i of one must translate line i of the other)")
    assert not os.path.exists(tmp_path / "out_train_en.bin")


def test_line_aligned_files_with_empty_lines(tmp_path, capsys):
    """A line empty in both files ends a document; a pair with one empty side is dropped."""
    en = ["The cat sleeps.", "The dog runs.", "", "A bird sings.", "Only English here.", "",
          "The sun is hot.", "The moon is cold."] + [f"Sentence number {i} is here." for i in range(30)]
    fr = ["Le chat dort.", "Le chien court.", "", "Un oiseau chante.", "   ", "",
          "Le soleil est chaud.", "La lune est froide."] + [f"La phrase numéro {i} est là." for i in range(30)]
    write_lines(tmp_path / "c.en", en)
    write_lines(tmp_path / "c.fr", fr)
    prefix = str(tmp_path / "c")
    rc = preprocess_nmt.main(["--input", str(tmp_path / "c.en"), str(tmp_path / "c.fr"), "--src-lang", "en",
                              "--tgt-lang", "fr", "--valid-docs", "1", "--test-docs", "0", "--vocab-size", "320",
                              "--output-prefix", prefix])
    assert rc == 0, capsys.readouterr().err
    meta = json.load(open(prefix + ".json"))
    assert meta["dropped"]["empty side"] == 1
    assert meta["documents"] == {"train": ["2"], "valid": ["1"], "test": ["0"]}
    assert open(prefix + "_valid.en").read().splitlines() == ["A bird sings."]
    assert open(prefix + "_test.fr").read().splitlines() == ["Le chat dort.", "Le chien court."]
    assert meta["pairs"]["train"] == 32


def test_unknown_held_out_document_is_one_clear_error(preprocessed, tmp_path, capsys):
    rows, _ = preprocessed
    src = tmp_path / "s.jsonl"
    write_lines(src, [json.dumps(r) for r in rows[:50]])
    rc = preprocess_nmt.main(["--input", str(src), "--src-lang", "en", "--tgt-lang", "fr", "--doc-key", "ref",
                              "--doc-regex", r"^(.+?) [0-9]+:[0-9]+$", "--valid-docs", "Exodus",
                              "--output-prefix", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        "error: --valid-docs: no document 'Exodus' in the input (documents look like 'Genesis', ...)"]
