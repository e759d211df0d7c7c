"""tools/preprocess_data.py end to end, and GPT samples, splits, caching and blending over its output."""

import gzip
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import tools.preprocess_data as preprocess_data
import tools.train_tokenizer as train_tokenizer
from megatron_po.data import gpt_dataset
from megatron_po.data.gpt_dataset import (BlendedDataset, GPTDataset, MockGPTDataset, build_gpt_datasets,
                                          get_split_indices, parse_split)
from megatron_po.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_po.data.tokenizer import build_tokenizer
from megatron_po.errors import DataError

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "bible_web.en.jsonl.gz"


# ---------------------------------------------------------------- preprocess_data

@pytest.fixture(scope="module")
def chapters(tmp_path_factory):
    """A 40-chapter jsonl (plus one empty document) and a small sentencepiece model trained on it."""
    directory = tmp_path_factory.mktemp("pre")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 40)]
    rows.insert(7, {"id": "Empty 1", "text": ""})
    corpus = directory / "chapters.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "200",
                                 "--output-prefix", str(directory / "tok")]) == 0
    return corpus, str(directory / "tok.model"), rows


def run_preprocess(corpus, model, prefix, workers, keys=("text",)):
    status = preprocess_data.main(["--input", str(corpus), "--output-prefix", str(prefix), "--json-keys", *keys,
                                   "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                                   "--append-eod", "--workers", str(workers), "--log-interval", "10"])
    assert status == 0


def test_preprocess_one_and_two_workers_write_identical_bytes(chapters, tmp_path):
    corpus, model, rows = chapters
    run_preprocess(corpus, model, tmp_path / "one" / "bible", 1, keys=("text", "id"))
    run_preprocess(corpus, model, tmp_path / "two" / "bible", 2, keys=("text", "id"))
    for name in ("bible_text_document.bin", "bible_text_document.idx", "bible_id_document.bin",
                 "bible_id_document.idx"):
        one, two = (tmp_path / "one" / name).read_bytes(), (tmp_path / "two" / name).read_bytes()
        assert len(one) > 0 and one == two


def test_preprocess_round_trip_one_document_per_row(chapters, tmp_path):
    corpus, model, rows = chapters
    run_preprocess(corpus, model, tmp_path / "bible", 2, keys=("text", "id"))
    tok = build_tokenizer("SentencePieceTokenizer", model)
    for key in ("text", "id"):
        ds = IndexedDataset(str(tmp_path / f"bible_{key}_document"))
        assert ds.dtype == np.uint16 and len(ds) == len(rows)
        assert ds.document_indices.tolist() == list(range(len(rows) + 1))
        for i, row in enumerate(rows):
            assert ds[i].tolist() == tok.tokenize(row[key]) + [tok.eod]
    text = IndexedDataset(str(tmp_path / "bible_text_document"))
    assert text[7].tolist() == [tok.eod]  # the empty document is still a document
    assert tok.detokenize(text[0][:12].tolist()).startswith("In the beginning")


def test_preprocess_keeps_input_order_with_workers(tmp_path):
    corpus = tmp_path / "ids.txt"  # .txt: one document per line
    corpus.write_text("".join(f"{i} {i + 1}\n" for i in range(300)))
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "n"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                                 "--workers", "2"]) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [s.tolist() for s in ds] == [[i, i + 1] for i in range(300)]


def test_null_tokenizer_appends_eod_after_the_vocabulary(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text('{"text": "1 2 3"}\n{"text": "99"}\n{"text": ""}\n')
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "n"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"]) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [s.tolist() for s in ds] == [[1, 2, 3, 100], [99, 100], [100]]


def test_preprocess_errors_are_one_line_and_leave_no_output(tmp_path, capsys):
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text('{"body": "1 2", "title": "3"}\n')
    common = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    assert preprocess_data.main(["--input", str(corpus), *common]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars of `datasets`
    assert last_line == f"error: input file '{corpus}' has no key 'text' (--json-keys); its keys are ['body', 'title']"
    assert preprocess_data.main(["--input", str(tmp_path / "nope.jsonl"), *common]) == 2
    assert capsys.readouterr().err.strip() == f"error: input file '{tmp_path / 'nope.jsonl'}' does not exist"

    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\n3 x\n")
    assert preprocess_data.main(["--input", str(bad), *common, "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: input file '{bad}', row 1: NullTokenizer: 'x' is not an integer token id " \
                      f"(its text is whitespace-separated ids)"
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------- GPT samples

def write_documents(prefix, lengths, first_token=0):
    """Document d holds consecutive, globally unique ids, so every token names its own position."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    start = first_token
    for length in lengths:
        builder.add_item(np.arange(start, start + length))
        builder.end_document()
        start += length
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def samples(dataset):
    return [dataset[i] for i in range(len(dataset))]


def test_parse_split_and_split_indices():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("6/2/2") == pytest.approx([0.6, 0.2, 0.2])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert get_split_indices(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    # 3 + 3 + 3 = 9 documents: Megatron shifts every boundary after the first by the shortfall
    assert get_split_indices(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]
    for bad in ("a,b", "1,-1", "0,0,0", "1,1,1,1"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


def test_one_epoch_covers_every_token_exactly_once(tmp_path):
    seq_length = 7
    lengths = [5, 1, 13, 0, 8, 21, 3, 9, 2, 11]
    lengths.append(seq_length - (sum(lengths) - 1) % seq_length)  # total = num_samples * seq_length + 1
    total = sum(lengths)
    num_samples = (total - 1) // seq_length
    ds = IndexedDataset(write_documents(tmp_path / "d", lengths))
    gpt = GPTDataset(ds, np.arange(len(lengths)), num_samples, seq_length, seed=3)
    items = samples(gpt)
    for item in items:
        assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (seq_length,)
        assert item["labels"].dtype == torch.int64 and item["labels"].shape == (seq_length,)
        assert item["loss_mask"].dtype == torch.float32 and bool((item["loss_mask"] == 1).all())
        assert torch.equal(item["labels"][:-1], item["tokens"][1:])
    inputs = torch.cat([item["tokens"] for item in items])
    every_token = torch.cat([inputs, torch.cat([item["labels"] for item in items])]).unique()
    assert len(inputs.unique()) == len(inputs) == num_samples * seq_length  # no token twice
    assert every_token.tolist() == list(range(total))  # and none missed


def test_epochs_repeat_every_document(tmp_path):
    lengths = [4, 9, 6, 1, 12]
    ds = IndexedDataset(write_documents(tmp_path / "d", lengths))
    num_samples = 3 * sum(lengths) // 4 - 1  # just under three epochs of 4-token samples
    gpt = GPTDataset(ds, np.arange(5), num_samples, seq_length=4, seed=0)
    counts = np.bincount(torch.cat([s["tokens"] for s in samples(gpt)]).numpy(), minlength=sum(lengths))
    assert counts.min() >= 2 and counts.max() == 3  # each epoch is a full permutation of the documents


def test_samples_are_deterministic_per_seed(tmp_path):
    ds = IndexedDataset(write_documents(tmp_path / "d", [10] * 20))
    first = samples(GPTDataset(ds, np.arange(20), 25, 6, seed=1))
    again = samples(GPTDataset(ds, np.arange(20), 25, 6, seed=1))
    other = samples(GPTDataset(ds, np.arange(20), 25, 6, seed=2))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, again))
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, other))


def test_splits_are_disjoint_document_ranges(tmp_path):
    lengths = [3 + i % 5 for i in range(50)]
    prefix = write_documents(tmp_path / "d", lengths)
    starts = np.cumsum([0] + lengths)
    train, valid, test = build_gpt_datasets([prefix], "6,2,2", seq_length=5, seed=0, num_samples=(40, 20, 20))
    assert (train.document_ids.tolist(), valid.document_ids.tolist(), test.document_ids.tolist()) == \
           (list(range(0, 30)), list(range(30, 40)), list(range(40, 50)))
    for split in (train, valid, test):
        tokens = torch.cat([torch.cat([s["tokens"], s["labels"][-1:]]) for s in samples(split)]).numpy()
        documents = np.searchsorted(starts, tokens, side="right") - 1  # the document each token came from
        assert set(documents.tolist()) <= set(split.document_ids.tolist())


def test_split_edge_cases(tmp_path):
    prefix = write_documents(tmp_path / "d", [5] * 10)
    train, valid, test = build_gpt_datasets([prefix], "1,0,0", 4, 0, (10, 5, 5))
    assert train is not None and valid is None and test is None
    assert build_gpt_datasets([prefix], "8,1,1", 4, 0, (10, 0, 5))[1] is None
    with pytest.raises(DataError, match=r"the valid split \(98,1,1\) of its 10 documents is empty, but 5 valid "):
        build_gpt_datasets([prefix], "98,1,1", 4, 0, (10, 5, 5))
    with pytest.raises(DataError, match=r"indexed dataset '.*nowhere': missing"):
        build_gpt_datasets([str(tmp_path / "nowhere")], "1,0,0", 4, 0, (10, 0, 0))
    with pytest.raises(DataError, match="document 0 has token id 0 at position 0, outside the vocabulary of size 0"):
        build_gpt_datasets([prefix], "1,0,0", 4, 0, (10, 0, 0), vocab_size=0)
    with pytest.raises(DataError, match="odd number"):
        build_gpt_datasets(["0.5", prefix, "0.5"], "1,0,0", 4, 0, (10, 0, 0))


def test_index_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    prefix = write_documents(tmp_path / "d", [7] * 30)
    cache = tmp_path / "cache"
    first, _, _ = build_gpt_datasets([prefix], "1,0,0", 5, 0, (30, 0, 0), cache_dir=str(cache))
    files = sorted(p.name for p in cache.glob("*.npy"))
    assert len(files) == 3 and all("-train-" in f for f in files)
    assert not list(cache.glob("*.tmp"))

    def no_rebuild(*args):
        raise AssertionError("indices rebuilt despite the cache")

    monkeypatch.setattr(gpt_dataset, "build_indices", no_rebuild)
    second, _, _ = build_gpt_datasets([prefix], "1,0,0", 5, 0, (30, 0, 0), cache_dir=str(cache))
    assert isinstance(second.sample_index, np.memmap)  # memory-mapped from the cache
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(samples(first), samples(second)))
    with pytest.raises(AssertionError, match="rebuilt"):  # other parameters: another cache entry
        build_gpt_datasets([prefix], "1,0,0", 5, 1, (30, 0, 0), cache_dir=str(cache))


def _build_on_every_rank(prefix, cache):
    train, _, _ = build_gpt_datasets([prefix], "1,0,0", 5, 0, (30, 0, 0), cache_dir=cache)
    return [train[i]["tokens"].tolist() for i in range(len(train))], sorted(os.listdir(cache))


def test_index_cache_under_torch_distributed(tmp_path):
    from dist_harness import run_distributed

    prefix = write_documents(tmp_path / "d", [7] * 30)
    results = run_distributed(_build_on_every_rank, world_size=2, args=(prefix, str(tmp_path / "cache")))
    (tokens0, files0), (tokens1, files1) = results
    assert tokens0 == tokens1 and files0 == files1
    assert len([f for f in files0 if f.endswith(".npy")]) == 3


def test_blend_follows_the_weights(tmp_path):
    a = write_documents(tmp_path / "a", [9] * 40)
    b = write_documents(tmp_path / "b", [9] * 40, first_token=1_000_000)  # b's tokens are >= 1e6
    train, _, _ = build_gpt_datasets(["0.3", a, "0.7", b], "1,0,0", 8, 0, (200, 0, 0), cache_dir=str(tmp_path / "c"))
    assert isinstance(train, BlendedDataset) and len(train) == 200
    from_b = [bool((s["tokens"] >= 1_000_000).all()) for s in samples(train)]
    assert sum(from_b) == 140
    for n in range(1, 201):  # greedy blending stays within one sample of the target at every prefix
        assert abs(sum(from_b[:n]) - 0.7 * n) <= 1
    # each part was sized for its share plus Megatron's margin, so no wrap-around is needed
    assert [len(d) for d in train.datasets] == [61, 141]


def test_blending_indices_wrap_around_short_datasets():
    blend = BlendedDataset([["a0", "a1"], ["b0"]], [1, 1], 6, seed=0)
    assert [blend[i] for i in range(6)] == ["a0", "b0", "a1", "b0", "a0", "b0"]


def test_mock_dataset():
    mock = MockGPTDataset(num_samples=10, seq_length=16, vocab_size=50, seed=7)
    item = mock[3]
    assert item["tokens"].shape == (16,) and item["tokens"].dtype == torch.int64
    assert 0 <= int(item["tokens"].min()) and int(item["tokens"].max()) < 50
    assert torch.equal(item["labels"][:-1], item["tokens"][1:])
    assert torch.equal(mock[3]["tokens"], MockGPTDataset(10, 16, 50, seed=7)[3]["tokens"])
    assert not torch.equal(mock[3]["tokens"], mock[4]["tokens"])
    assert not torch.equal(mock[3]["tokens"], MockGPTDataset(10, 16, 50, seed=8)[3]["tokens"])
    train, valid, test = build_gpt_datasets([], "1,0,0", 16, 7, (10, 4, 0), mock=True, vocab_size=50)
    assert len(train) == 10 and len(valid) == 4 and test is None
    with pytest.raises(IndexError):
        mock[10]
