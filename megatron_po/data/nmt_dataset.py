"""Sentence pairs for translation: paired `.bin/.idx` datasets and length-bucketed micro-batches.

tools/preprocess_nmt.py writes, per split and language, `<prefix>_<split>_<lang>.bin/.idx` (Megatron's
indexed format, one sentence = one document, token ids without BOS/EOS); the i-th sentences of the
source and target files are a pair. From a pair a micro-batch row is built as

    src_tokens = source + EOS        tgt_tokens = BOS + target        labels = target + EOS

(sentences longer than the model's bounds are cut to fit: `--seq-length` for the source,
`--decoder-seq-length` for the target), right-padded to the longest row of the micro-batch (see
models/nmt.py for the batch keys).

Micro-batches hold sentences of similar length (fairseq's bucketing): the split's pairs are put in a
random order (the epoch's seed) and sorted stably by (source, target) length, then cut into micro-batches
of at most `max_sentences` pairs and, with `max_tokens`, at most that many padded tokens of the longer side
(rows x longest row). The training micro-batches of an epoch are then shuffled; epochs follow one another
with fresh seeds. Item k of `PairBatches` is the k-th micro-batch of that endless sequence (training) or of
the one sorted pass (evaluation, modulo its length), so micro-batches are addressed like GPT samples.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from megatron_po.data.indexed_dataset import IndexedDataset, check_token_ids
from megatron_po.data.tokenizer import SentencePieceTokenizer
from megatron_po.errors import DataError

SPLITS = ("train", "valid", "test")


def split_prefix(prefix: str, split: str, lang: str) -> str:
    """`<prefix>_<split>_<lang>`: the indexed dataset of one side of one split."""
    return f"{prefix}_{split}_{lang}"


def load_tokenizer(path: str) -> SentencePieceTokenizer:
    """A sentencepiece model with the <pad>, <s> and </s> that translation batches need."""
    tok = SentencePieceTokenizer(path)
    missing = [name for name, i in (("<pad>", tok.pad), ("<s>", tok.bos), ("</s>", tok.eos)) if i < 0]
    if missing:
        raise DataError(f"tokenizer model {path!r} has no {', '.join(missing)} token; translation needs <pad>, "
                        f"<s> and </s> (tools/preprocess_nmt.py and tools/train_tokenizer.py models have them)")
    return tok


class ParallelCorpus:
    """One split of a parallel corpus: source and target indexed datasets with the same sentence count."""

    def __init__(self, prefix: str, split: str, src_lang: str, tgt_lang: str, src_vocab_size: int,
                 tgt_vocab_size: int, mmap: bool = True):
        self.src = IndexedDataset(split_prefix(prefix, split, src_lang), mmap=mmap)
        self.tgt = IndexedDataset(split_prefix(prefix, split, tgt_lang), mmap=mmap)
        if len(self.src) != len(self.tgt):
            raise DataError(f"{self.src.path_prefix} has {len(self.src)} sentences but {self.tgt.path_prefix} has "
                            f"{len(self.tgt)}: not a parallel corpus (preprocess both sides together with "
                            f"tools/preprocess_nmt.py)")
        check_token_ids(self.src, src_vocab_size, self.src.path_prefix)
        check_token_ids(self.tgt, tgt_vocab_size, self.tgt.path_prefix)

    def __len__(self) -> int:
        return len(self.src)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src[i], self.tgt[i]


def bucket_batches(order: np.ndarray, row_lengths: np.ndarray, max_sentences: int,
                   max_tokens: int | None) -> list[np.ndarray]:
    """Cut `order` (pair ids) into consecutive micro-batches: at most `max_sentences` rows and, with
    `max_tokens`, rows x longest row <= max_tokens (`row_lengths[i]`: the padded length pair i needs)."""
    batches, start, longest = [], 0, 0
    for pos, i in enumerate(order):
        longest_with = max(longest, int(row_lengths[i]))
        count = pos - start + 1
        if pos > start and (count > max_sentences or (max_tokens is not None and count * longest_with > max_tokens)):
            batches.append(order[start:pos])
            start, longest_with = pos, int(row_lengths[i])
        longest = longest_with
    if len(order) > start:
        batches.append(order[start:])
    return batches


class PairBatches:
    """Micro-batches of a `ParallelCorpus` (see the module docstring); item k is a dict of tensors."""

    def __init__(self, corpus: ParallelCorpus, *, bos: int, eos: int, pad: int, max_src_length: int,
                 max_tgt_length: int, max_sentences: int, max_tokens: int | None, seed: int, shuffle: bool):
        if len(corpus) == 0:
            raise DataError(f"{corpus.src.path_prefix}: the split has no sentence pairs")
        self.corpus = corpus
        self.bos, self.eos, self.pad = bos, eos, pad
        self.max_src, self.max_tgt = max_src_length, max_tgt_length
        self.max_sentences, self.max_tokens = max_sentences, max_tokens
        self.seed, self.shuffle = seed, shuffle
        # Row lengths as batched: EOS on the source, BOS (input) / EOS (labels) on the target, within bounds.
        self.src_lengths = np.minimum(corpus.src.sequence_lengths.astype(np.int64) + 1, max_src_length)
        self.tgt_lengths = np.minimum(corpus.tgt.sequence_lengths.astype(np.int64) + 1, max_tgt_length)
        self.epochs: list[list[np.ndarray]] = []
        self.epoch_starts: list[int] = [0]  # index of each epoch's first micro-batch
        self._add_epoch()

    def _add_epoch(self) -> None:
        e = len(self.epochs)
        rng = np.random.RandomState((self.seed + 1_000_003 * e) % 2**32)
        n = len(self.corpus)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        order = order[np.lexsort((self.tgt_lengths[order], self.src_lengths[order]))]  # stable: ties stay random
        batches = bucket_batches(order, np.maximum(self.src_lengths, self.tgt_lengths), self.max_sentences,
                                 self.max_tokens)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        self.epochs.append(batches)
        self.epoch_starts.append(self.epoch_starts[-1] + len(batches))

    def __len__(self) -> int:
        """Micro-batches in one pass over the split (the first epoch's)."""
        return len(self.epochs[0])

    def pair_ids(self, k: int) -> np.ndarray:
        """The pair ids of micro-batch k."""
        if not self.shuffle:
            return self.epochs[0][k % len(self.epochs[0])]
        while self.epoch_starts[-1] <= k:
            self._add_epoch()
        e = bisect.bisect_right(self.epoch_starts, k) - 1
        return self.epochs[e][k - self.epoch_starts[e]]

    def __getitem__(self, k: int) -> dict:
        return self.collate(self.pair_ids(k))

    def collate(self, ids) -> dict:
        pairs = [self.corpus.pair(int(i)) for i in ids]
        sources = [np.append(src[:self.max_src - 1], self.eos).astype(np.int64) for src, _ in pairs]
        targets = [tgt[:self.max_tgt - 1].astype(np.int64) for _, tgt in pairs]
        b, s, t = len(pairs), max(len(x) for x in sources), max(len(y) for y in targets) + 1
        src_tokens = torch.full((b, s), self.pad, dtype=torch.long)
        src_mask = torch.zeros(b, s, dtype=torch.bool)
        tgt_tokens = torch.full((b, t), self.pad, dtype=torch.long)
        labels = torch.full((b, t), self.pad, dtype=torch.long)
        loss_mask = torch.zeros(b, t)
        for r, (x, y) in enumerate(zip(sources, targets)):
            src_tokens[r, :len(x)] = torch.from_numpy(x)
            src_mask[r, :len(x)] = True
            tgt_tokens[r, 0] = self.bos
            tgt_tokens[r, 1:len(y) + 1] = torch.from_numpy(y)
            labels[r, :len(y)] = torch.from_numpy(y)
            labels[r, len(y)] = self.eos
            loss_mask[r, :len(y) + 1] = 1.0
        return {"src_tokens": src_tokens, "src_mask": src_mask, "tgt_tokens": tgt_tokens, "labels": labels,
                "loss_mask": loss_mask}

    def mean_tokens(self) -> tuple[float, float]:
        """Mean real (source, target) tokens per micro-batch over one pass."""
        n = len(self.epochs[0])
        return float(self.src_lengths.sum()) / n, float(self.tgt_lengths.sum()) / n
