"""Megatron-compatible memory-mapped indexed dataset: a `.bin` of concatenated token arrays and an `.idx`.

The byte layout is Megatron-core's (`megatron/core/datasets/indexed_dataset.py`), so corpora preprocessed
by Megatron load here as-is and ours load there:

    <prefix>.idx  b"MMIDIDX\\x00\\x00"            9-byte magic
                  version              "<Q"   always 1
                  dtype code           "<B"   DTYPE_CODES below
                  sequence count N     "<Q"
                  document count D     "<Q"   = len(document_indices) = number of documents + 1
                  sequence lengths     N x int32   tokens per sequence
                  sequence pointers    N x int64   byte offset of each sequence in the .bin
                  document indices     D x int64   document d = sequences [idx[d], idx[d+1]); idx[0] = 0
    <prefix>.bin  the sequences' tokens, back to back, in the dtype above

Without Megatron's --split-sentences every document is exactly one sequence. Everything in the .idx is
checked against the file sizes before anything is memory-mapped, so a truncated or mismatched pair fails
with one line naming the file instead of reading garbage or crashing inside numpy.
"""

from __future__ import annotations

import functools
import os
import shutil
import struct

import numpy as np

from megatron_po.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

# Megatron's DType enum: the code is what the .idx stores.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}

# Validation and the token-id check walk big arrays in chunks of this many elements to bound memory.
CHUNK = 1 << 24


def best_dtype(vocab_size: int | None) -> type:
    """Smallest token dtype that holds every id: uint16 below 65500 (Megatron's threshold), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _read_and_check_index(idx_path: str):
    """Parse the .idx header and return (dtype, sequence_count, document_count), validating sizes only."""
    idx_size = os.path.getsize(idx_path)
    if idx_size < HEADER_SIZE:
        raise DataError(f"{idx_path}: truncated index: {idx_size} bytes, shorter than the {HEADER_SIZE}-byte header")
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_SIZE)
    magic = header[: len(INDEX_MAGIC)]
    if magic != INDEX_MAGIC:
        raise DataError(f"{idx_path}: not a Megatron MMap index: magic is {magic!r}, expected {INDEX_MAGIC!r}")
    version, dtype_code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: unsupported index version {version} (only version {INDEX_VERSION} exists)")
    if dtype_code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {dtype_code} (known: {sorted(DTYPE_CODES)})")
    if document_count < 1:
        raise DataError(f"{idx_path}: document count is 0, but the document index always holds at least the 0 start")
    # Megatron's multimodal indices append one int8 mode per sequence; we accept and ignore them.
    expected = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
    if idx_size not in (expected, expected + sequence_count):
        raise DataError(f"{idx_path}: truncated or corrupt index: header says {sequence_count} sequences and "
                        f"{document_count} document entries ({expected} bytes) but the file has {idx_size} bytes")
    return np.dtype(DTYPE_CODES[dtype_code]), sequence_count, document_count


def _check_arrays(idx_path, bin_path, dtype, lengths, pointers, document_indices):
    """Lengths, pointers and document indices must describe exactly the .bin, back to back."""
    bin_size = os.path.getsize(bin_path)
    itemsize = dtype.itemsize
    expected_pointer = 0  # Megatron's writer lays sequences out contiguously in order; anything else is corrupt
    for start in range(0, len(lengths), CHUNK):
        part_lengths = lengths[start:start + CHUNK].astype(np.int64)
        if (part_lengths < 0).any():
            i = start + int(np.argmax(part_lengths < 0))
            raise DataError(f"{idx_path}: sequence {i} has negative length {lengths[i]}")
        part_bytes = part_lengths * itemsize
        expected_pointers = expected_pointer + np.cumsum(part_bytes) - part_bytes
        mismatch = pointers[start:start + CHUNK] != expected_pointers
        if mismatch.any():
            i = int(np.argmax(mismatch))
            raise DataError(f"{idx_path}: sequence {start + i} starts at byte {pointers[start + i]} but the lengths "
                            f"before it put it at byte {expected_pointers[i]}: corrupt index")
        expected_pointer += int(part_bytes.sum())
    if expected_pointer != bin_size:
        raise DataError(f"{bin_path}: has {bin_size} bytes but {idx_path} describes {expected_pointer} bytes "
                        f"({len(lengths)} sequences of {dtype.name}): truncated .bin or mismatched .idx")
    if document_indices[0] != 0:
        raise DataError(f"{idx_path}: document index starts at {document_indices[0]}, expected 0")
    if document_indices[-1] != len(lengths):
        raise DataError(f"{idx_path}: document index ends at {document_indices[-1]} but there are "
                        f"{len(lengths)} sequences")
    for start in range(0, len(document_indices) - 1, CHUNK):
        steps = np.diff(document_indices[start:start + CHUNK + 1])
        if (steps < 0).any():
            d = start + int(np.argmax(steps < 0))
            raise DataError(f"{idx_path}: document index decreases at document {d} "
                            f"({document_indices[d]} -> {document_indices[d + 1]})")


class BinFileTokens:
    """A .bin's tokens read with positional file reads instead of a memory map (Megatron's
    --no-mmap-bin-files, for file systems where mmap is slow or unsupported). Supports what the readers
    use: len(tokens), tokens[i] and tokens[a:b] (a fresh array per read)."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.length = os.path.getsize(path) // self.dtype.itemsize
        self._fd, self._pid = None, None

    def _descriptor(self) -> int:
        if self._pid != os.getpid():  # a DataLoader worker forked from us opens its own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def __del__(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                raise IndexError("BinFileTokens reads contiguous ranges only")
            count = max(0, stop - start)
            data = os.pread(self._descriptor(), count * self.dtype.itemsize, start * self.dtype.itemsize)
            return np.frombuffer(data, self.dtype)
        i = int(key) + (self.length if int(key) < 0 else 0)
        if not 0 <= i < self.length:
            raise IndexError(f"token {key} out of range for {self.length} tokens in {self.path}")
        return self[i:i + 1][0]


class IndexedDataset:
    """Read-only view of `<path_prefix>.bin/.idx`; items are sequences (numpy arrays backed by the mmap, or
    read from the file when mmap=False)."""

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = str(path_prefix)
        self.mmap = mmap
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise DataError(f"indexed dataset {self.path_prefix!r}: missing {' and '.join(missing)} "
                            f"(a dataset is given by the prefix both .idx and .bin extend)")
        self.dtype, sequence_count, document_count = _read_and_check_index(idx_path)

        self._idx_mmap = np.memmap(idx_path, mode="r", order="C")
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_mmap, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._idx_mmap, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._idx_mmap, np.int64, document_count, offset)
        _check_arrays(idx_path, bin_path, self.dtype, self.sequence_lengths, self.sequence_pointers,
                      self.document_indices)

        # np.memmap refuses empty files, and an empty dataset is valid.
        if os.path.getsize(bin_path) == 0:
            self.tokens = np.empty(0, self.dtype)
        elif not mmap:
            self.tokens = BinFileTokens(bin_path, self.dtype)
        else:
            self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", order="C")
        # `tokens` is every token of the .bin, flat: sequence i is tokens[sequence_starts[i]:][:length].

    @functools.cached_property
    def sequence_starts(self) -> np.ndarray:
        """Token (not byte) offset of each sequence in `tokens`; computed on first use (8 bytes per sequence)."""
        return self.sequence_pointers // self.dtype.itemsize

    # Pickle as the path (DataLoader workers under spawn), not as a copy of the memory-mapped arrays.
    def __getstate__(self):
        return self.path_prefix, self.mmap

    def __setstate__(self, state):
        self.__init__(*state)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None)."""
        i = int(idx)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        sequence_length = int(self.sequence_lengths[i])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length "
                             f"{sequence_length} in {self.path_prefix}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


def check_token_ids(ds: IndexedDataset, vocab_size: int, name: str) -> None:
    """Raise DataError naming the document and id when any token id is outside [0, vocab_size)."""
    tokens = ds.tokens
    for start in range(0, len(tokens), CHUNK):
        part = tokens[start:start + CHUNK]
        # min/max first: one cheap pass per chunk, the position is only looked up on failure
        if part.max() < vocab_size and part.min() >= 0:
            continue
        position = start + int(np.argmax((part >= vocab_size) | (part < 0)))
        # Empty sequences share their start with the next one; side="right" lands on the one holding tokens.
        sequence = int(np.searchsorted(ds.sequence_starts, position, side="right")) - 1
        document = int(np.searchsorted(ds.document_indices, sequence, side="right")) - 1
        document_start = int(ds.sequence_starts[ds.document_indices[document]])
        raise DataError(f"{name}: document {document} has token id {tokens[position]} at position "
                        f"{position - document_start}, outside the vocabulary of size {vocab_size} "
                        f"(was it preprocessed with another tokenizer?)")


class IndexedDatasetBuilder:
    """Write `.bin` as items arrive, then the `.idx` in `finalize`. Mirrors Megatron-core's builder."""

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self.bin_file = open(self.bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence (numpy array, torch CPU tensor or list of ints)."""
        array = np.asarray(tokens).reshape(-1)
        if array.dtype != self.dtype and array.size and np.issubdtype(self.dtype, np.integer):
            # Casting silently wraps ids that do not fit (70000 -> 4464 in uint16): refuse instead.
            info = np.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise DataError(f"{self.bin_path}: token ids {low}..{high} do not fit the file's dtype "
                                f"{self.dtype.name}; build it with a wider dtype (best_dtype(vocab_size))")
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.size > np.iinfo(np.int32).max:
            raise DataError(f"{self.bin_path}: a sequence of {array.size} tokens exceeds the int32 length field")
        self.bin_file.write(array.tobytes())
        self.sequence_lengths.append(array.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (its documents stay documents); dtypes must match."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge {path_prefix} ({other.dtype.name}) into {self.bin_path} "
                            f"({self.dtype.name}): token dtypes differ")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.bin_file)

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx. Sequences added after the last end_document form a last document."""
        self.bin_file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        byte_lengths = lengths.astype(np.int64) * self.dtype.itemsize
        pointers = np.cumsum(byte_lengths) - byte_lengths
        document_indices = np.asarray(self.document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.astype(np.int64).tobytes())
            f.write(document_indices.tobytes())
