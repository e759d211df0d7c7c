"""Megatron's tokenizer types give the reference library's ids on the bundled corpus, and .bin/.idx written
with each loads; tools/preprocess_data.py's --split-sentences, --keep-newlines and --partitions."""

import gzip
import itertools
import json

import numpy as np
import pytest

import tools.preprocess_data as preprocess_data
from megatron_po.data.indexed_dataset import IndexedDataset
from megatron_po.data.tokenizer import build_tokenizer
from megatron_po.errors import DataError, UserError
from tests.conftest import CORPUS


def chapters(n, skip=0):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, skip, skip + n)]


# Text the tokenizers were not trained on (chapters 300+), plus the awkward cases: accents, CJK, emoji,
# digits, contractions, runs of spaces and newlines.
EDGE_TEXTS = ["naïve café — “quoted” 漢字 🙂 x²", "It's 1,234.5 they'll  \n\n  end\t tab", "", " ", "\n"]


@pytest.fixture(scope="module")
def texts():
    return chapters(40, skip=300) + chapters(20) + EDGE_TEXTS


def test_gpt2_bpe_equals_transformers(byte_bpe, texts):
    import transformers
    d = byte_bpe["dir"]
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(d / "vocab.json"), merge_file=str(d / "merges.txt"))
    reference = transformers.GPT2Tokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    assert ours.vocab_size == len(reference) == 1000
    assert ours.eod == reference.convert_tokens_to_ids("<|endoftext|>") == 0
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == reference(text, add_special_tokens=False).input_ids, text[:60]
        assert ours.detokenize(ids) == text
    assert len(ours.tokenize(texts[0])) < len(texts[0]) // 2  # merges happened


def test_hf_tokenizer_equals_autotokenizer_and_tokenizer_json(byte_bpe, texts):
    import tokenizers
    import transformers
    d = byte_bpe["dir"]
    from_dir = build_tokenizer("HuggingFaceTokenizer", str(d))
    from_file = build_tokenizer("HuggingFaceTokenizer", str(d / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    raw = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert from_dir.vocab_size == from_file.vocab_size == len(auto) == 1000
    assert (from_dir.bos, from_dir.eod, from_dir.pad) == (1, 0, -1)  # <|begin_of_text|>, <|endoftext|>, none
    assert (from_file.bos, from_file.eod) == (-1, -1)  # a bare tokenizer.json names no special tokens
    for text in texts:
        ids = from_dir.tokenize(text)
        assert ids == auto(text).input_ids == raw.encode(text).ids == from_file.tokenize(text), text[:60]
        assert ids[0] == 1  # Megatron calls the tokenizer with its special tokens: BOS first
    # The byte-level BPE is the same model under both names: HF ids are GPT-2's behind the BOS.
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(d / "vocab.json"), merge_file=str(d / "merges.txt"))
    assert from_dir.tokenize(texts[0])[1:] == gpt2.tokenize(texts[0])


def test_sentencepiece_types_equal_sentencepiece_with_megatron_bos_eos(corpus, texts):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    gpt = build_tokenizer("GPTSentencePieceTokenizer", corpus["model"])
    legacy = build_tokenizer("SentencePieceTokenizer", corpus["model"])
    llama = build_tokenizer("Llama2Tokenizer", corpus["model"])
    for tok in (gpt, legacy, llama):
        assert (tok.vocab_size, tok.bos, tok.eos, tok.eod, tok.pad) == (500, 2, 3, 3, 0)
    for text in texts:
        plain = sp.encode(text, out_type=int)
        assert gpt.tokenize(text) == legacy.tokenize(text) == plain
        assert llama.tokenize(text) == [sp.bos_id()] + plain  # BOS, no EOS (Megatron's text-completion default)
        assert llama.detokenize(llama.tokenize(text)) == sp.decode(plain)


TYPES = ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
         "Llama2Tokenizer", "NullTokenizer"]


def tokenizer_flags(kind, byte_bpe, corpus):
    d = byte_bpe["dir"]
    return {"GPT2BPETokenizer": ["--vocab-file", str(d / "vocab.json"), "--merge-file", str(d / "merges.txt")],
            "HuggingFaceTokenizer": ["--tokenizer-model", str(d)],
            "NullTokenizer": ["--vocab-size", "5000"]}.get(kind, ["--tokenizer-model", corpus["model"]])


@pytest.mark.parametrize("kind", TYPES)
def test_bin_idx_written_with_each_tokenizer_loads(kind, byte_bpe, corpus, tmp_path):
    rows = chapters(12, skip=400)
    if kind == "NullTokenizer":
        rows = [" ".join(str(b) for b in text.encode("utf-8")[:300]) for text in rows]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    flags = ["--tokenizer-type", kind, *tokenizer_flags(kind, byte_bpe, corpus)]
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--append-eod",
                                 *flags]) == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    options = {flag[2:].replace("-", "_"): value for flag, value in zip(flags[2::2], flags[3::2])}
    if "vocab_size" in options:
        options["vocab_size"] = int(options["vocab_size"])
    tok = build_tokenizer(kind, **options)
    assert ds.num_documents == len(rows) == len(ds)
    assert ds.dtype == np.uint16
    for i, text in enumerate(rows):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]


def test_fixtures_for_pretraining(bpe_corpus, hf_corpus):
    bpe, hf = IndexedDataset(bpe_corpus["prefix"]), IndexedDataset(hf_corpus["prefix"])
    assert bpe.num_documents == hf.num_documents == 300
    assert int(bpe.tokens.max()) < 1000 and int(hf.tokens.max()) < 1000
    assert hf[0][0] == 1 and hf[0][-1] == 0 and bpe[0][-1] == 0  # BOS ... EOD; EOD
    assert hf[5][1:].tolist() == bpe[5].tolist()


def test_split_sentences_and_keep_newlines(corpus, tmp_path):
    text = "In the beginning God created. The earth was empty!\nAnd God said: light?  Yes."
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "   "}) + "\n")
    common = ["--input", str(src), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              corpus["model"], "--append-eod", "--split-sentences"]
    tok = build_tokenizer("SentencePieceTokenizer", corpus["model"])
    for keep, sentences in [(False, ["In the beginning God created.", "The earth was empty!", "And God said: light?",
                                     "Yes."]),
                            (True, ["In the beginning God created. ", "The earth was empty!\n",
                                    "And God said: light?  ", "Yes."])]:
        prefix = tmp_path / f"keep{keep}"
        assert preprocess_data.main([*common, "--output-prefix", str(prefix)]
                                    + (["--keep-newlines"] if keep else [])) == 0
        ds = IndexedDataset(str(prefix) + "_text_sentence")
        assert ds.num_documents == 2 and len(ds) == 4  # the blank document has no sentences (Megatron)
        expected = [tok.tokenize(s) for s in sentences]
        expected[-1].append(tok.eod)  # EOD ends the document's last sentence
        assert [ds[i].tolist() for i in range(4)] == expected
        assert ds.document_indices.tolist() == [0, 4, 4]


def test_partitions_give_the_same_bytes(corpus, tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in chapters(30, skip=500)))
    common = ["--input", str(src), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              corpus["model"], "--append-eod"]
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "one")]) == 0
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "three"), "--partitions", "3",
                                 "--workers", "3", "--log-interval", "4"]) == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"three_text_document{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if "partition" in p.name) == []  # partials removed


def test_partition_error_is_one_line_and_leaves_nothing(tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1 2", "3 4", "5 x", "6"]))
    status = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                                   "NullTokenizer", "--vocab-size", "10", "--partitions", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert "rows.jsonl', row 2: NullTokenizer: 'x' is not an integer token id" in err[-1]  # the input row
    assert list(tmp_path.iterdir()) == [src]


def test_vocab_and_merge_files_alone_mean_gpt2_bpe():
    """Megatron's GPT-3 example script gives --vocab-file and --merge-file without --tokenizer-type."""
    from megatron_po.config import parse_args
    cfg = parse_args(["--mock-data", "--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert parse_args(["--vocab-file", "v.json"]).data.tokenizer_type == "SentencePieceTokenizer"
    explicit = parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "d", "--vocab-file", "v",
                           "--merge-file", "m"])
    assert explicit.data.tokenizer_type == "HuggingFaceTokenizer"


def test_bad_tokenizer_flags_are_one_line_errors(byte_bpe, tmp_path):
    with pytest.raises(UserError, match="GPT2BPETokenizer needs --vocab-file .* and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")
    for kind in ("HuggingFaceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer"):
        with pytest.raises(UserError, match=f"{kind} needs --tokenizer-model PATH"):
            build_tokenizer(kind)
    with pytest.raises(UserError, match="'BertWordPieceCase' is not one of GPT2BPETokenizer"):
        build_tokenizer("BertWordPieceCase")
    with pytest.raises(DataError, match="--vocab-file '.*nope.json' does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file="m")
    bad = tmp_path / "vocab.json"
    bad.write_text('{"a": 0}')
    with pytest.raises(DataError, match="has no <|endoftext|> token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=str(byte_bpe["dir"] / "merges.txt"))
    with pytest.raises(DataError, match="neither a directory nor a tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is not a loadable Hugging Face tokenizer") as info:
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "empty"))
    assert "\n" not in str(info.value)
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("garbage")
    with pytest.raises(DataError, match="'.*tokenizer.json' is not a loadable Hugging Face tokenizer: expected value"):
        build_tokenizer("HuggingFaceTokenizer", str(garbage))


def test_preprocess_flag_errors(byte_bpe, tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text('{"text": "a"}\n')
    d = byte_bpe["dir"]
    base = ["--input", str(src), "--output-prefix", str(tmp_path / "o")]
    assert preprocess_data.main([*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "5",
                                 "--keep-newlines"]) == 2
    assert "--keep-newlines applies to --split-sentences" in capsys.readouterr().err
    assert preprocess_data.main([*base, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 str(d / "tokenizer.json"), "--append-eod"]) == 2
    assert "--append-eod: the HuggingFaceTokenizer" in capsys.readouterr().err
    assert preprocess_data.main([*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "5",
                                 "--partitions", "0"]) == 2
    assert "--partitions must be >= 1 (got 0)" in capsys.readouterr().err


@pytest.mark.parametrize("fixture", ["bpe_corpus", "hf_corpus"])
def test_pretrain_on_gpt2_bpe_and_hf_data_loss_falls(fixture, request, tmp_path):
    """pretrain_gpt.py's flags take the tokenizer (--vocab-file/--merge-file, or a HF directory) and train on
    the data it wrote: vocabulary 1000, padded to 1024."""
    from dist_harness import run_distributed
    from test_pretrain_gpt import base_args, read_metrics, run_pretrain
    data = request.getfixturevalue(fixture)
    argv = base_args({"prefix": data["prefix"], "model": None}, tmp_path,
                     **{"--train-iters": 12, "--log-interval": 1, "--eval-interval": 12, "--lr": 3e-3})
    argv += data["args"]
    assert run_distributed(run_pretrain, 1, args=(argv,), timeout=300) == [0]
    losses = [r["lm_loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "lm_loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
