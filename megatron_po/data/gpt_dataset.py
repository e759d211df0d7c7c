"""GPT pretraining samples from indexed datasets, with Megatron's GPTDataset and BlendedDataset semantics.

A sample is seq_length + 1 consecutive tokens of a stream that concatenates the split's documents, so
samples pack across document boundaries (the EOD token, if preprocessing appended it, separates them);
tokens = sample[:-1], labels = sample[1:]. Consecutive samples share one token (the last label of one is
the first token of the next), as in Megatron. Three index arrays make any sample O(1) to fetch:

    document_index  the split's document ids, shuffled, one permutation per epoch, epochs back to back
    sample_index    [num_samples + 1, 2]: (position in document_index, token offset) where sample i starts;
                    sample i ends at (and includes) the start of sample i + 1
    shuffle_index   permutation of the samples

With a cache_dir they are saved as .npy, named by an md5 of everything they depend on, built once (by
global rank 0 when torch.distributed is up) and memory-mapped by every process.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import tempfile

import numpy as np
import torch

from megatron_po.data.indexed_dataset import IndexedDataset, check_token_ids
from megatron_po.errors import DataError

SPLIT_NAMES = ("train", "valid", "test")
# Megatron asks each blended dataset for a little more than its share so the blend rarely wraps around.
BLEND_MARGIN = 1.005


def parse_split(split: str) -> list[float]:
    """"969,30,1" (or "969/30/1") -> [0.969, 0.03, 0.001]: train/valid/test fractions, missing ones 0.
    Quotes around it are dropped: Megatron's Llama-3 example script passes `--split '99,1,0'` quotes and all."""
    parts = [p for p in split.strip().strip("'\"").replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: expected up to 3 comma-separated numbers like 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) == 0:
        raise DataError(f"--split {split!r}: expected 1 to 3 non-negative numbers with a positive sum, like 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def get_split_indices(fractions: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [begin, end) document ranges per split, rounded like Megatron's _get_split_indices."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    excess = bounds[-1] - num_documents  # rounding may over- or undershoot by a document or two
    bounds = [bounds[0]] + [max(0, b - excess) for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def document_token_starts(indexed_dataset: IndexedDataset) -> np.ndarray:
    """[num_documents + 1] token offsets in the .bin: document d is tokens[starts[d]:starts[d + 1]]."""
    # The reader checked that sequences lie back to back, so a document's sequences form one token range.
    sequence_starts = np.append(indexed_dataset.sequence_starts, len(indexed_dataset.tokens))
    return sequence_starts[indexed_dataset.document_indices]


def build_indices(document_lengths: np.ndarray, document_ids: np.ndarray, num_samples: int, seq_length: int,
                  seed: int):
    """The three index arrays (see the module docstring). document_lengths is indexed by document id."""
    tokens_per_epoch = int(document_lengths[document_ids].sum())
    tokens_needed = num_samples * seq_length + 1  # +1: the last sample's last label
    num_epochs = -(-tokens_needed // tokens_per_epoch)
    rng = np.random.RandomState(seed)
    # One permutation per epoch (not one over all epochs) so every epoch sees every document exactly once.
    document_index = np.concatenate([rng.permutation(document_ids) for _ in range(num_epochs)]).astype(np.int64)
    document_ends = np.cumsum(document_lengths[document_index])
    sample_starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: the start lands in the document that holds that token.
    positions = np.searchsorted(document_ends, sample_starts, side="right")
    offsets = sample_starts - (document_ends[positions] - document_lengths[document_index[positions]])
    sample_index = np.stack([positions, offsets], axis=1).astype(np.int64)
    shuffle_index = rng.permutation(num_samples).astype(np.int64)
    return document_index, sample_index, shuffle_index


def _save_atomically(path: str, array: np.ndarray) -> None:
    # A reader must never see a half-written file: write beside it, then rename (atomic on POSIX).
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def load_or_build_indices(cache_dir: str | None, description: str, name: str, kinds: list[str], build):
    """The arrays `build()` returns, cached in cache_dir as <md5 of description>-<name>-<kind>.npy.

    One process builds (global rank 0 under torch.distributed; the others wait at a barrier), then every
    process memory-maps the files, so large indices are neither rebuilt nor copied per rank.
    """
    if cache_dir is None:
        return build()
    digest = hashlib.md5(description.encode()).hexdigest()
    paths = [os.path.join(cache_dir, f"{digest}-{name}-{kind}.npy") for kind in kinds]
    is_builder = not _distributed() or torch.distributed.get_rank() == 0
    if is_builder and not all(os.path.isfile(p) for p in paths):
        os.makedirs(cache_dir, exist_ok=True)
        for path, array in zip(paths, build()):
            _save_atomically(path, array)
        with open(os.path.join(cache_dir, f"{digest}-{name}-description.txt"), "w") as f:
            f.write(description + "\n")
    if _distributed():
        torch.distributed.barrier()
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"{missing[0]}: index cache written by rank 0 is not visible here; "
                        f"the cache directory must be on a file system all ranks share")
    return [np.load(p, mmap_mode="r") for p in paths]


def _tokens_sample(sample: np.ndarray) -> dict[str, torch.Tensor]:
    sample = torch.from_numpy(sample.astype(np.int64))
    return {"tokens": sample[:-1].contiguous(), "labels": sample[1:].contiguous(),
            "loss_mask": torch.ones(len(sample) - 1, dtype=torch.float32)}


class GPTDataset(torch.utils.data.Dataset):
    """num_samples samples of seq_length tokens from the given documents of an IndexedDataset."""

    def __init__(self, indexed_dataset: IndexedDataset, document_ids: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: str | None = None, name: str = "train"):
        self.indexed_dataset = indexed_dataset
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name
        if self.seq_length < 1 or self.num_samples < 1:
            raise ValueError(f"GPTDataset needs seq_length >= 1 and num_samples >= 1 "
                             f"(got {seq_length}, {num_samples})")
        self.document_starts = document_token_starts(indexed_dataset)
        document_lengths = np.diff(self.document_starts)
        if document_lengths[self.document_ids].sum() == 0:
            raise DataError(f"{indexed_dataset.path_prefix}: the {name} split ({len(self.document_ids)} documents) "
                            f"holds no tokens, but {num_samples} samples were requested")

        self.description = "\n".join([
            "GPTDataset indices v1",
            f"indexed dataset: {os.path.abspath(indexed_dataset.path_prefix)}",
            f"sequences: {len(indexed_dataset)}, tokens: {len(indexed_dataset.tokens)}",
            f"documents: {len(self.document_ids)}, md5 {hashlib.md5(self.document_ids.tobytes()).hexdigest()}",
            f"num_samples: {self.num_samples}", f"seq_length: {self.seq_length}", f"seed: {self.seed}",
        ])
        build = functools.partial(build_indices, document_lengths, self.document_ids, self.num_samples,
                                  self.seq_length, self.seed)
        self.document_index, self.sample_index, self.shuffle_index = load_or_build_indices(
            cache_dir, self.description, name, ["document_index", "sample_index", "shuffle_index"], build)

    def __len__(self) -> int:
        return self.num_samples

    def get_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample idx."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        j = int(self.shuffle_index[idx])
        (first, first_offset), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        tokens = self.indexed_dataset.tokens
        pieces = []
        for position in range(int(first), int(last) + 1):
            document_start = int(self.document_starts[self.document_index[position]])
            begin = document_start + (int(first_offset) if position == first else 0)
            end = (document_start + int(last_offset) + 1 if position == last
                   else int(self.document_starts[self.document_index[position] + 1]))
            pieces.append(tokens[begin:end])
        return np.concatenate(pieces)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return _tokens_sample(self.get_tokens(int(idx)))


class MockGPTDataset(torch.utils.data.Dataset):
    """Random tokens (for --mock-data): sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, int(idx)])
        return _tokens_sample(rng.integers(0, self.vocab_size, self.seq_length + 1))


def build_blending_indices(weights: list[float], num_samples: int):
    """Megatron's greedy blend: sample i comes from the dataset furthest behind its target,
    argmax(weights * (i + 1) - counts) (first one on ties), and takes that dataset's next sample."""
    dataset_index = [0] * num_samples
    dataset_sample_index = [0] * num_samples
    counts = [0] * len(weights)
    # Plain Python scalars (~3 s per million samples; numpy per step is slower). Cached with a cache_dir.
    for i in range(num_samples):
        best, best_error = 0, weights[0] * (i + 1) - counts[0]
        for k in range(1, len(weights)):
            error = weights[k] * (i + 1) - counts[k]
            if error > best_error:
                best, best_error = k, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return np.asarray(dataset_index, dtype=np.int64), np.asarray(dataset_sample_index, dtype=np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """num_samples samples drawn from several datasets in proportion to weights, evenly interleaved.

    A dataset's k-th draw is its sample k modulo its length. The greedy blend is deterministic, so `seed`
    only labels the blend (Megatron's signature); the indices depend on weights and num_samples alone.
    """

    def __init__(self, datasets: list, weights: list[float], num_samples: int, seed: int,
                 cache_dir: str | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset (got {len(datasets)}, {len(weights)})")
        total = float(sum(weights))
        if any(w < 0 for w in weights) or total <= 0:
            raise DataError(f"blend weights {list(weights)} must be non-negative with a positive sum")
        self.datasets = datasets
        self.weights = [float(w) / total for w in weights]
        self.num_samples = int(num_samples)
        self.seed = seed
        for k, dataset in enumerate(datasets):
            if self.weights[k] > 0 and len(dataset) == 0:
                raise DataError(f"blend: dataset {k} has no samples but weight {self.weights[k]:.4f}")
        description = f"BlendedDataset indices v1\nweights: {self.weights!r}\nnum_samples: {self.num_samples}"
        build = functools.partial(build_blending_indices, self.weights, self.num_samples)
        self.dataset_index, self.dataset_sample_index = load_or_build_indices(
            cache_dir, description, "blend", ["dataset_index", "dataset_sample_index"], build)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx]) % len(dataset)]


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: ["prefix"], ["w1", "p1", "w2", "p2", ...], or ["p1", "p2", ...] (no weights)."""
    if not data_path:
        raise DataError("--data-path is empty: give a dataset prefix (or weights and prefixes)")
    if len(data_path) == 1:
        return list(data_path), None
    def number(w):
        try:
            return float(w)
        except ValueError:
            return None

    parsed = [number(w) for w in data_path[0::2]]
    if any(w is None for w in parsed):
        # prefixes only (Megatron weights them by size); Megatron also refuses weights on some prefixes only
        if len(data_path) % 2 == 0 and any(w is not None for w in parsed):
            bad = next(w for w, n in zip(data_path[0::2], parsed) if n is None)
            raise DataError(f"--data-path {' '.join(data_path)}: weight {bad!r} is not a number; give a weight "
                            f"before every prefix ('0.3 A 0.7 B') or none ('A B')")
        return list(data_path), None
    weights = parsed
    if len(data_path) % 2:
        raise DataError(f"--data-path {' '.join(data_path)}: weights and prefixes must alternate "
                        f"(weight1 prefix1 weight2 prefix2 ...), got an odd number of values")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise DataError(f"--data-path weights {weights} must be non-negative with a positive sum")
    return list(data_path[1::2]), weights


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], cache_dir: str | None = None, mock: bool = False,
                       vocab_size: int | None = None, mmap_bin_files: bool = True):
    """(train, valid, test) datasets; a split with fraction 0 or 0 samples is None.

    Several prefixes are blended per split; without weights they are weighted by their token counts (all
    of each used, like one concatenated corpus). With vocab_size, every token id is checked to be below it.
    mmap_bin_files=False reads the .bin files with file reads instead of memory maps (--no-mmap-bin-files).
    """
    if mock:
        if vocab_size is None:
            raise ValueError("mock data needs vocab_size")
        # A different seed per split keeps the three splits' samples distinct.
        return tuple(MockGPTDataset(n, seq_length, vocab_size, seed + k) if n > 0 else None
                     for k, n in enumerate(num_samples))

    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    indexed = [IndexedDataset(prefix, mmap=mmap_bin_files) for prefix in prefixes]
    if vocab_size is not None:
        for prefix, ds in zip(prefixes, indexed):
            check_token_ids(ds, vocab_size, prefix)
    if weights is None:
        weights = [float(len(ds.tokens)) for ds in indexed]
    total_weight = sum(weights)
    if total_weight == 0:
        raise DataError(f"--data-path {' '.join(data_path)}: the datasets hold no tokens")
    weights = [w / total_weight for w in weights]
    ranges = [get_split_indices(fractions, ds.num_documents) for ds in indexed]

    splits = []
    for k, split_name in enumerate(SPLIT_NAMES):
        if num_samples[k] == 0 or fractions[k] == 0:
            splits.append(None)
            continue
        parts, part_weights = [], []
        for prefix, ds, weight, split_ranges in zip(prefixes, indexed, weights, ranges):
            if weight == 0:
                continue
            begin, end = split_ranges[k]
            if begin == end:
                raise DataError(f"{prefix}: the {split_name} split ({split}) of its {ds.num_documents} documents "
                                f"is empty, but {num_samples[k]} {split_name} samples were requested")
            # A single dataset gives exactly num_samples; blended ones a margin over their share.
            wanted = num_samples[k] if len(prefixes) == 1 else math.ceil(num_samples[k] * weight * BLEND_MARGIN)
            parts.append(GPTDataset(ds, np.arange(begin, end), wanted, seq_length, seed, cache_dir, split_name))
            part_weights.append(weight)
        splits.append(parts[0] if len(prefixes) == 1 else BlendedDataset(parts, part_weights, num_samples[k], seed,
                                                                           cache_dir))
    return tuple(splits)
