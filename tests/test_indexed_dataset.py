"""The .bin/.idx format: byte layout against Megatron's, round trips, merging, and corrupt-file handling."""

import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_po.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, best_dtype,
                                              check_token_ids)
from megatron_po.errors import DataError

# Three documents: [1 2 3], [] (an empty sequence), and one of two sequences [7 8] + [9].
SEQUENCES = [[1, 2, 3], [], [7, 8], [9]]
DOCUMENT_INDICES = [0, 1, 2, 4]


def megatron_idx_bytes(dtype_code, itemsize, lengths, document_indices, magic=b"MMIDIDX\x00\x00", version=1):
    """The .idx exactly as Megatron-core's _IndexWriter lays it out, spelled with struct."""
    pointers = [itemsize * sum(lengths[:i]) for i in range(len(lengths))]
    return (magic + struct.pack("<Q", version) + struct.pack("<B", dtype_code)
            + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
            + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
            + struct.pack(f"<{len(document_indices)}q", *document_indices))


def write(prefix, sequences, document_indices, dtype):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for i, seq in enumerate(sequences):
        builder.add_item(np.array(seq))
        if i + 1 in document_indices[1:]:
            builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_idx_and_bin_bytes_match_megatron_layout(tmp_path):
    prefix = write(tmp_path / "d", SEQUENCES, DOCUMENT_INDICES, np.uint16)
    lengths = [len(s) for s in SEQUENCES]
    assert open(prefix + ".idx", "rb").read() == megatron_idx_bytes(8, 2, lengths, DOCUMENT_INDICES)
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 7, 8, 9)


@pytest.mark.parametrize("dtype, code, high", [(np.uint16, 8, 65535), (np.int32, 4, 2**31 - 1)])
def test_round_trip(tmp_path, dtype, code, high):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, high, size=n) for n in (5, 0, 17, 1, 300)]
    document_indices = [0, 2, 3, 5]
    prefix = write(tmp_path / "d", sequences, document_indices, dtype)
    assert open(prefix + ".idx", "rb").read(18)[-1] == code
    ds = IndexedDataset(prefix)
    assert len(ds) == 5 and ds.num_documents == 3 and ds.dtype == np.dtype(dtype)
    assert ds.document_indices.tolist() == document_indices
    assert ds.sequence_lengths.tolist() == [5, 0, 17, 1, 300]
    assert ds.sequence_pointers.tolist() == [t * np.dtype(dtype).itemsize for t in (0, 5, 5, 22, 23)]
    for got, want in zip(ds, sequences):
        assert got.dtype == np.dtype(dtype) and got.tolist() == want.tolist()
    assert ds.get(4, offset=10, length=3).tolist() == sequences[4][10:13].tolist()
    assert ds.get(2, offset=15).tolist() == sequences[2][15:].tolist()
    assert [s.tolist() for s in ds[3:5]] == [sequences[3].tolist(), sequences[4].tolist()]
    assert ds[-1].tolist() == sequences[4].tolist()
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=3, length=3)
    # Pickles as its path (DataLoader workers), not as a copy of the data.
    assert len(pickle.dumps(ds)) < 300 and pickle.loads(pickle.dumps(ds))[4].tolist() == sequences[4].tolist()


def test_best_dtype():
    assert best_dtype(32000) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32


def test_empty_dataset_round_trips(tmp_path):
    prefix = write(tmp_path / "d", [], [0], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_unterminated_last_document_is_closed_by_finalize(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    builder.add_item([3])
    builder.finalize(str(tmp_path / "d.idx"))
    assert IndexedDataset(str(tmp_path / "d")).document_indices.tolist() == [0, 1, 2]


def test_add_item_refuses_ids_that_do_not_fit_the_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    with pytest.raises(DataError, match=r"70000 do not fit .*uint16"):
        builder.add_item(np.array([1, 70000]))


def test_merge(tmp_path):
    a = write(tmp_path / "a", [[1, 2], [3]], [0, 1, 2], np.uint16)
    b = write(tmp_path / "b", [[4], [5, 6], [7]], [0, 2, 3], np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert [s.tolist() for s in merged] == [[1, 2], [3], [4], [5, 6], [7]]
    assert merged.document_indices.tolist() == [0, 1, 2, 4, 5]

    c = write(tmp_path / "c", [[1]], [0, 1], np.int32)
    with pytest.raises(DataError, match="dtypes differ"):
        builder = IndexedDatasetBuilder(str(tmp_path / "n.bin"), np.uint16)
        builder.add_index(c)


LENGTHS = [len(s) for s in SEQUENCES]


def idx_with(dtype_code=8, itemsize=2, document_indices=DOCUMENT_INDICES, **kwargs):
    return megatron_idx_bytes(dtype_code, itemsize, LENGTHS, document_indices, **kwargs)


VALID_IDX = idx_with()
POINTER_2 = 34 + 4 * 4 + 2 * 8  # header, 4 int32 lengths, 2 int64 pointers: where sequence 2's pointer sits

# (name, replacement .idx bytes, replacement .bin bytes, what the one-line message must say)
BREAKAGES = [
    ("bad magic", idx_with(magic=b"TNTIDX\x00\x00\x00"), None, r"d\.idx: not a Megatron MMap index: magic is b'TNTIDX"),
    ("bad version", idx_with(version=2), None, r"d\.idx: unsupported index version 2"),
    ("bad dtype code", idx_with(dtype_code=9), None, r"d\.idx: unknown dtype code 9"),
    ("truncated idx", VALID_IDX[:-8], None,
     r"d\.idx: truncated or corrupt index: header says 4 sequences and 4 document entries"),
    ("idx shorter than header", VALID_IDX[:10], None, r"d\.idx: truncated index: 10 bytes"),
    ("truncated bin", None, struct.pack("<5H", 1, 2, 3, 7, 8), r"d\.bin: has 10 bytes but .*d\.idx describes 12 bytes"),
    ("wrong dtype for the bin", idx_with(dtype_code=4, itemsize=4), None, r"d\.bin: has 12 bytes but .*describes 24"),
    ("document index not starting at 0", idx_with(document_indices=[1, 1, 2, 4]), None,
     r"d\.idx: document index starts at 1, expected 0"),
    ("document index decreasing", idx_with(document_indices=[0, 2, 1, 4]), None,
     r"d\.idx: document index decreases at document 1 \(2 -> 1\)"),
    ("document index not ending at the sequence count", idx_with(document_indices=[0, 1, 2, 3]), None,
     r"d\.idx: document index ends at 3 but there are 4 sequences"),
    ("sequence pointer off", VALID_IDX[:POINTER_2] + struct.pack("<q", 8) + VALID_IDX[POINTER_2 + 8:], None,
     r"d\.idx: sequence 2 starts at byte 8 but the lengths before it put it at byte 6"),
]


@pytest.mark.parametrize("name, idx, bin, message", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_corrupt_files_raise_one_line_data_error(tmp_path, name, idx, bin, message):
    prefix = write(tmp_path / "d", SEQUENCES, DOCUMENT_INDICES, np.uint16)
    IndexedDataset(prefix)  # valid before the breakage
    if idx is not None:
        open(prefix + ".idx", "wb").write(idx)
    if bin is not None:
        open(prefix + ".bin", "wb").write(bin)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(prefix)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file_names_the_prefix(tmp_path, missing):
    prefix = write(tmp_path / "d", SEQUENCES, DOCUMENT_INDICES, np.uint16)
    (tmp_path / f"d{missing}").unlink()
    with pytest.raises(DataError, match=rf"indexed dataset '.*d': missing .*d\{missing}"):
        IndexedDataset(prefix)


@pytest.fixture(scope="module")
def valid_dataset(tmp_path_factory):
    """A valid uint16 dataset (ids < 32768, so an int16 reading is value-equal) and its written sequences."""
    directory = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 1000, size=n).tolist() for n in (3, 0, 8, 1, 5, 2)]
    prefix = write(directory / "valid", sequences, [0, 1, 3, 3, 6], np.uint16)
    return directory, open(prefix + ".idx", "rb").read(), open(prefix + ".bin", "rb").read(), sequences


corruptions = st.one_of(
    st.tuples(st.just("truncate"), st.integers(min_value=0, max_value=10_000)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(min_value=0, max_value=10_000),
                                                   st.integers(min_value=0, max_value=255)), min_size=1, max_size=4)),
)


@settings(max_examples=50, deadline=None)
@given(corruption=corruptions, case=st.integers(min_value=0, max_value=10**12))
def test_corrupt_index_never_crashes_or_lies(valid_dataset, corruption, case):
    directory, idx, bin_bytes, sequences = valid_dataset
    kind, how = corruption
    data = bytearray(idx)
    if kind == "truncate":
        data = data[: how % len(idx)]
    else:
        for position, value in how:
            data[position % len(idx)] = value
    prefix = str(directory / f"case{case}")  # a fresh name: never rewrite a file another dataset maps
    open(prefix + ".idx", "wb").write(bytes(data))
    open(prefix + ".bin", "wb").write(bin_bytes)
    try:
        ds = IndexedDataset(prefix)
    except DataError:
        return
    assert len(ds) == len(sequences)
    for got, want in zip(ds, sequences):
        assert got.tolist() == want


def test_check_token_ids_names_document_and_id(tmp_path):
    # Document 2 ([5], [] , [9 99 4]) holds the offending 99 at offset 2 within the document.
    prefix = write(tmp_path / "d", [[1, 2], [3], [5], [], [9, 99, 4]], [0, 1, 2, 5], np.uint16)
    ds = IndexedDataset(prefix)
    check_token_ids(ds, 100, "corpus")  # all ids < 100: fine
    with pytest.raises(DataError, match=r"^corpus: document 2 has token id 99 at position 2, outside the "
                                        r"vocabulary of size 50"):
        check_token_ids(ds, 50, "corpus")


def test_check_token_ids_rejects_negative_ids(tmp_path):
    prefix = write(tmp_path / "d", [[1, 2], [-1]], [0, 1, 2], np.int32)
    with pytest.raises(DataError, match="document 1 has token id -1 at position 0"):
        check_token_ids(IndexedDataset(prefix), 100, "signed")


# Any header values at all (random counts, codes, versions around the real ones): a clean DataError or a
# dataset that reads back exactly what was written, never a crash, a huge allocation or garbage.
headers = st.fixed_dictionaries({
    "magic": st.sampled_from([b"MMIDIDX\x00\x00", b"MMIDIDX\x00\x01", b"\x00" * 9]),
    "version": st.sampled_from([0, 1, 2, 2**64 - 1]),
    "code": st.integers(min_value=0, max_value=255),
    "sequences": st.one_of(st.integers(min_value=0, max_value=12), st.integers(min_value=0, max_value=2**64 - 1)),
    "documents": st.one_of(st.integers(min_value=0, max_value=12), st.integers(min_value=0, max_value=2**64 - 1)),
})


@settings(max_examples=60, deadline=None)
@given(header=headers, case=st.integers(min_value=0, max_value=10**12))
def test_random_index_headers_never_crash_or_lie(valid_dataset, header, case):
    directory, idx, bin_bytes, sequences = valid_dataset
    data = (header["magic"] + struct.pack("<QBQQ", header["version"], header["code"], header["sequences"],
                                          header["documents"]) + idx[34:])
    prefix = str(directory / f"header{case}")
    open(prefix + ".idx", "wb").write(data)
    open(prefix + ".bin", "wb").write(bin_bytes)
    try:
        ds = IndexedDataset(prefix)
    except DataError as e:
        assert "\n" not in str(e) and f"header{case}" in str(e)
        return
    assert [s.tolist() for s in ds] == sequences


@settings(max_examples=40, deadline=None)
@given(length=st.integers(min_value=0, max_value=200), tail=st.binary(max_size=8))
def test_truncated_or_padded_bin_is_refused(valid_dataset, length, tail):
    """The .bin must be exactly the bytes the .idx describes: shorter or longer is a DataError naming it."""
    directory, idx, bin_bytes, sequences = valid_dataset
    data = bin_bytes[:length] + tail
    prefix = str(directory / f"bin{length}_{tail.hex()}")
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(data)
    if len(data) == len(bin_bytes):
        assert [s.tolist() for s in IndexedDataset(prefix)] == [
            np.frombuffer(data, np.uint16)[sum(map(len, sequences[:i])):][:len(s)].tolist()
            for i, s in enumerate(sequences)]
        return
    with pytest.raises(DataError, match=rf"bin{length}_{tail.hex()}\.bin: has {len(data)} bytes but .*describes "
                                        rf"{len(bin_bytes)} bytes"):
        IndexedDataset(prefix)
