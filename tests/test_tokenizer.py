"""Tokenizers: a sentencepiece model trained by tools/train_tokenizer.py, the NullTokenizer, and bad input."""

import gzip
import itertools
import json
from pathlib import Path

import pytest

import tools.train_tokenizer as train_tokenizer
from megatron_po.data.tokenizer import NullTokenizer, build_tokenizer
from megatron_po.errors import DataError, UserError

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "bible_web.en.jsonl.gz"


def bible_chapters(n):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    corpus = directory / "chapters.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in bible_chapters(150)))
    prefix = directory / "out" / "bible"  # the tool creates the missing directory
    status = train_tokenizer.main(["--input", str(corpus), "--json-keys", "text", "--vocab-size", "300",
                                   "--output-prefix", str(prefix), "--user-defined-symbols", "<|sep|>"])
    assert status == 0
    return str(prefix) + ".model"


def test_trained_model_files_and_special_ids(spm_model):
    assert open(spm_model.replace(".model", ".vocab")).read().startswith("<pad>\t")
    tok = build_tokenizer("SentencePieceTokenizer", spm_model)
    assert tok.vocab_size == 300
    assert (tok.pad, tok.bos, tok.eos, tok.eod) == (0, 2, 3, 3)
    assert tok.sp.id_to_piece(1) == "<unk>" and tok.sp.id_to_piece(3) == "</s>"


def test_round_trip_of_a_sentence(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", spm_model)
    sentence = "In the beginning God created the heavens and the earth."
    ids = tok.tokenize(sentence)
    assert all(isinstance(i, int) and 4 <= i < 300 for i in ids)
    assert len(ids) < len(sentence) // 2  # BPE merged characters into longer pieces
    assert tok.detokenize(ids) == sentence


def test_user_defined_symbol_stays_whole(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", spm_model)
    sep = tok.sp.piece_to_id("<|sep|>")
    assert sep not in (tok.sp.unk_id(), -1)
    assert tok.tokenize("God <|sep|> light").count(sep) == 1


def test_split_long_line_respects_the_byte_limit():
    line = " ".join(f"wörd{i}" for i in range(500))  # multi-byte characters: the limit is in bytes
    pieces = list(train_tokenizer.split_long_line(line, 100))
    assert len(pieces) > 1
    assert all(len(p.encode("utf-8")) <= 100 for p in pieces)
    assert " ".join(pieces) == line
    assert list(train_tokenizer.split_long_line("short line", 100)) == ["short line"]


def test_vocab_too_large_for_the_corpus_is_a_one_line_error(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a b c\nabc cab\n")
    status = train_tokenizer.main(["--input", str(corpus), "--vocab-size", "5000",
                                   "--output-prefix", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("error: sentencepiece training on") and "Vocabulary size too high" in err[-1]


def test_tool_reports_missing_input_and_missing_key(tmp_path, capsys):
    assert train_tokenizer.main(["--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "100",
                                 "--output-prefix", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.strip() == f"error: input file '{tmp_path / 'nope.jsonl'}' does not exist"
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text('{"body": "x"}\n')
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "100",
                                 "--output-prefix", str(tmp_path / "t")]) == 2
    assert "has no key 'text' (--json-keys); its keys are ['body']" in capsys.readouterr().err


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 11 and tok.eod == 10  # Megatron: EOD is one past the given vocabulary
    assert (tok.pad, tok.bos, tok.eos) == (-1, -1, -1)
    assert tok.tokenize("1 2  3\n9") == [1, 2, 3, 9]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(DataError, match="'x' is not an integer token id"):
        tok.tokenize("1 x")
    with pytest.raises(DataError, match=r"token id 11 is outside \[0, 11\)"):
        tok.tokenize("11")


def test_missing_or_corrupt_model_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer model '.*missing\.model' does not exist"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(DataError, match=r"'.*bad\.model' is not a readable sentencepiece model") as info:
        build_tokenizer("SentencePieceTokenizer", str(bad))
    assert "\n" not in str(info.value)


def test_bad_tokenizer_flags():
    with pytest.raises(UserError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(UserError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(UserError, match="'GPT3Tokenizer' is not one of"):
        build_tokenizer("GPT3Tokenizer")
