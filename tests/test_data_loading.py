"""Data loading: --num-workers (DataLoader workers, same order as none), --dataloader-type single|cyclic,
--no-mmap-bin-files, and --mock-data with --data-path refused."""

import pickle

import numpy as np
import pytest
import torch
from dist_harness import run_distributed
from test_pretrain_gpt import base_args, read_metrics, run_pretrain

from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.data.data_loader import MicroBatchLoader, sample_index
from megatron_po.data.gpt_dataset import GPTDataset, MockGPTDataset, build_gpt_datasets
from megatron_po.data.indexed_dataset import BinFileTokens, IndexedDataset, check_token_ids
from megatron_po.errors import ConfigError, DataError


def collect(loader, starts):
    return [loader.microbatch(s) for s in starts]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_workers_give_the_same_micro_batches_as_none(corpus):
    ds = GPTDataset(IndexedDataset(corpus["prefix"]), np.arange(200), 64, 32, seed=5)
    stride = 4  # micro-batch 2 x DP 2
    # in order, then a jump back (evaluation restarts at 0; a resume starts anywhere), then in order again
    starts = [0, 4, 8, 12, 16, 0, 4, 40, 44, 48]
    for rank in range(2):
        plain = collect(MicroBatchLoader(ds, 2, rank, 2), starts)
        workers = collect(MicroBatchLoader(ds, 2, rank, 2, num_workers=2), starts)
        assert_same_batches(plain, workers)
        # single: rank r of the micro-batch at s holds samples s + 2r, s + 2r + 1
        for s, batch in zip(starts, plain):
            expected = torch.stack([ds[s + 2 * rank + i]["tokens"] for i in range(2)])
            assert torch.equal(batch["tokens"], expected)
    assert plain[0]["tokens"].shape == (2, 32) and plain[0]["loss_mask"].dtype == torch.float32


def test_dp_ranks_split_the_global_micro_batch():
    ds = MockGPTDataset(40, 8, 50, seed=1)
    whole = MicroBatchLoader(ds, 4, 0, 1).microbatch(8)["tokens"]
    parts = [MicroBatchLoader(ds, 2, r, 2).microbatch(8)["tokens"] for r in range(2)]
    assert torch.equal(whole, torch.cat(parts))


def test_cyclic_reshuffles_every_pass_and_is_deterministic():
    n = 50
    passes = [[sample_index(p, n, "cyclic", seed=7) for p in range(e * n, (e + 1) * n)] for e in range(3)]
    for order in passes:
        assert sorted(order) == list(range(n))  # every sample once per pass
    assert passes[0] != passes[1] != passes[2] and passes[0] != list(range(n))
    assert passes[1] == [sample_index(p, n, "cyclic", seed=7) for p in range(n, 2 * n)]  # a function of p
    assert [sample_index(p, n, "cyclic", seed=8) for p in range(n)] != passes[0]
    assert [sample_index(p, n, "single", seed=7) for p in range(2 * n)] == list(range(n)) * 2
    ds = MockGPTDataset(n, 8, 50, seed=1)
    starts = list(range(0, 120, 6))
    assert_same_batches(collect(MicroBatchLoader(ds, 3, 1, 2, dataloader_type="cyclic", seed=7), starts),
                        collect(MicroBatchLoader(ds, 3, 1, 2, 2, dataloader_type="cyclic", seed=7), starts))


def test_no_mmap_reads_the_same_tokens(corpus):
    mapped = IndexedDataset(corpus["prefix"])
    read = IndexedDataset(corpus["prefix"], mmap=False)
    assert isinstance(read.tokens, BinFileTokens) and isinstance(mapped.tokens, np.memmap)
    assert len(read.tokens) == len(mapped.tokens)
    for i in [0, 1, len(mapped) // 2, len(mapped) - 1]:
        assert np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, 3, 5), mapped.get(i, 3, 5))
    assert read.tokens[-1] == mapped.tokens[-1] and read.tokens[10] == mapped.tokens[10]
    assert len(read.tokens[len(read.tokens):]) == 0
    with pytest.raises(IndexError):
        read.tokens[len(read.tokens)]
    copy = pickle.loads(pickle.dumps(read))  # a spawned DataLoader worker reopens it the same way
    assert copy.mmap is False and np.array_equal(copy[3], mapped[3])
    check_token_ids(read, 500, "corpus")
    with pytest.raises(DataError, match="outside the vocabulary of size 100"):
        check_token_ids(read, 100, "corpus")
    a = build_gpt_datasets([corpus["prefix"]], "90,10,0", 32, 1, (20, 4, 0), vocab_size=500)
    b = build_gpt_datasets([corpus["prefix"]], "90,10,0", 32, 1, (20, 4, 0), vocab_size=500, mmap_bin_files=False)
    for i in range(20):
        assert torch.equal(a[0][i]["tokens"], b[0][i]["tokens"])


def test_mock_data_with_data_path_is_one_error():
    with pytest.raises(ConfigError, match="--mock-data and --data-path A exclude each other"):
        validate(parse_args(["--mock-data", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
                             "--data-path", "A"]), 1)


def _run(corpus, tmp_path, name, world, **flags):
    out = tmp_path / name
    out.mkdir()
    argv = base_args(corpus, out, **{"--train-iters": 6, "--log-interval": 1, "--eval-interval": 3,
                                     "--lr-warmup-iters": 1, **flags})
    assert run_distributed(run_pretrain, world, args=(argv,), timeout=300) == [0] * world
    return read_metrics(out / "metrics.jsonl")


def losses(records, key="lm_loss"):
    return [r[key] for r in records if key in r]


def test_pretrain_with_workers_and_without_mmap_matches(corpus, tmp_path):
    """Workers and file reads change how samples are read, not which: the same losses, bit for bit; cyclic
    order over DP=2 equals it over one process (fp32, tolerance 2e-3 for the reduction order)."""
    plain = _run(corpus, tmp_path, "plain", 1)
    workers = _run(corpus, tmp_path, "workers", 1, **{"--num-workers": 2, "--no-mmap-bin-files": True})
    assert losses(plain) == losses(workers) and len(losses(plain)) == 6
    assert losses(plain, "val_loss") == losses(workers, "val_loss")
    cyclic = _run(corpus, tmp_path, "cyclic", 1, **{"--dataloader-type": "cyclic"})
    cyclic_dp2 = _run(corpus, tmp_path, "cyclic_dp2", 2, **{"--dataloader-type": "cyclic", "--num-workers": 1})
    assert losses(cyclic) != losses(plain)
    torch.testing.assert_close(losses(cyclic_dp2), losses(cyclic), rtol=0, atol=2e-3)
    assert losses(cyclic)[-1] < losses(cyclic)[0]


def run_counting_restarts(argv):
    """run_main, returning (exit code, worker-pool starts of each MicroBatchLoader built)."""
    from megatron_po.data import data_loader
    loaders = []
    original = data_loader.MicroBatchLoader.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        loaders.append(self)

    data_loader.MicroBatchLoader.__init__ = init
    try:
        return run_pretrain(argv), [loader.restarts for loader in loaders]
    finally:
        data_loader.MicroBatchLoader.__init__ = original


def test_async_pipeline_with_workers_matches_and_streams(corpus, tmp_path):
    """PipeOptim over PP=2 reads micro-batches one at a time as its stages stream them: with a worker the
    losses are the same bit for bit, and the workers start once per segment (training) and evaluation."""
    flags = {"--pipeline-model-parallel-size": 2, "--untie-embeddings-and-output-weights": True,
             "--pipeline-method": "pipeoptim", "--train-iters": 8, "--log-interval": 1, "--eval-interval": 4,
             "--lr-decay-iters": 8}
    runs = {}
    for workers in (0, 1):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        argv = base_args(corpus, out, **flags, **{"--num-workers": workers})
        results = run_distributed(run_counting_restarts, 2, args=(argv,), timeout=300)
        assert [code for code, _ in results] == [0, 0]
        runs[workers] = (losses(read_metrics(out / "metrics.jsonl")), [r for _, r in results])
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 8
    for train_restarts, valid_restarts in runs[1][1]:  # the train and valid loaders of each rank (no test split)
        assert train_restarts <= 2 and valid_restarts <= 2 * 2  # 2 segments; 2 evaluations restart at 0


def test_split_in_quotes_as_megatrons_llama3_script_passes_it():
    from megatron_po.data.gpt_dataset import parse_split
    assert parse_split("'99,1,0'") == parse_split('"99,1,0"') == parse_split("99,1,0") == [0.99, 0.01, 0.0]
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
                      "--split", "'99,1,0'", "--no-mmap-bin-files", "--num-workers", "1"])
    validate(cfg, 1)
    assert cfg.data.mmap_bin_files is False and cfg.data.num_workers == 1
