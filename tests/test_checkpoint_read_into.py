"""The one-process reader reads tensor entries straight into their destinations (checkpoint_read_into.py), bit for
bit what DCP's own read gives, and leaves to DCP exactly what it cannot do so.

One DCP checkpoint written in this process (no process group) holds whole tensors of several dtypes (a scalar and
an empty one too) and two tensors saved as chunks, as a sharded run writes them: split by rows (a layout whose
shards split dim 0) and by columns (TP's row-parallel weights). It is read with and without `without_copy`, into
whole tensors (CheckpointReader, read_full_checkpoint), into a distributed-optimizer piece (`FlatRange`: partial
rows, from the middle of an entry's bytes) and into another dtype. Cheap: kilobytes, one process.
"""

import dataclasses
import os
import warnings

import pytest
import torch

from megatron_po.distributed import checkpoint_trust
from megatron_po.distributed.checkpoint_dcp import FlatRange, dcp_load
from megatron_po.distributed.checkpoint_load import CheckpointReader, read_full_checkpoint

g = torch.Generator().manual_seed(0)
WHOLE = {"fp32": torch.randn(5, 7, generator=g), "bf16": torch.randn(33, 16, generator=g).bfloat16(),
         "int64": torch.arange(11), "scalar": torch.tensor(3.25), "empty": torch.zeros(0, 3)}
CHUNKED = {"rows": torch.randn(6, 8, generator=g), "columns": torch.randn(6, 8, generator=g)}
CHUNKS = {"rows": [(0, 0), (2, 0)], "columns": [(0, 0), (0, 5)]}  # offsets of each chunk of CHUNKED[name]


def _chunks(name):
    t, starts = CHUNKED[name], CHUNKS[name]
    ends = starts[1:] + [tuple(t.shape)]
    out = {}
    for start, end in zip(starts, ends):
        dim = 0 if name == "rows" else 1
        out[torch.Size(start)] = t.narrow(dim, start[dim], end[dim] - start[dim]).contiguous()
    return out


def save(path):
    """WHOLE as plain tensors, CHUNKED as the chunks CHUNKS names (a sharded save's entries), model.* names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    blocks = {f"model.{name}": _chunks(name) for name in CHUNKED}

    class Planner(dcp.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, t.shape),
                                                           size=CHUNKED[fqn[len("model."):]].shape,
                                                           properties=TensorProperties.create_from_tensor(t)))
                     for fqn, chunks in blocks.items() for offsets, t in chunks.items()]
            self.plan = dataclasses.replace(plan, items=plan.items + items)
            return self.plan

        def lookup_object(self, index):
            return blocks[index.fqn][index.offset] if index.fqn in blocks else super().lookup_object(index)

    state = {f"model.{k}": v for k, v in WHOLE.items()}
    state["extra"] = {"note": 1}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), planner=Planner(flatten_state_dict=False))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint directory (iteration 0 of a --save directory, its parent)."""
    path = str(tmp_path_factory.mktemp("read_into") / "iter_0000000")
    with warnings.catch_warnings():  # DCP warns that it saves in one process
        warnings.simplefilter("ignore")
        save(path)
    return path


@pytest.fixture
def left_to_dcp(monkeypatch):
    """The entries each read left to DCP's own read_data (as {entry, ...}), recorded."""
    seen = []
    original = checkpoint_trust.read_into_destinations

    def spy(reader, plan, planner):
        left = original(reader, plan, planner)
        seen.append({item.dest_index.fqn for item in left.items})
        return left
    monkeypatch.setattr(checkpoint_trust, "read_into_destinations", spy)
    return seen


def _empty_like(name, dtype=None):
    t = WHOLE.get(name, CHUNKED.get(name))
    return torch.full(t.shape, 7, dtype=dtype or t.dtype)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_whole_tensors_read_in_place_like_dcp_and_strided_destinations_left_to_it(ckpt, left_to_dcp):
    names = list(WHOLE) + list(CHUNKED)
    read = {}
    for without_copy in (True, False):
        state = {f"model.{n}": _empty_like(n) for n in names}
        dcp_load(state, ckpt, without_copy=without_copy)
        read[without_copy] = state
    for n in names:
        expected = WHOLE.get(n, CHUNKED.get(n))
        assert _same(read[True][f"model.{n}"], expected), n
        assert _same(read[False][f"model.{n}"], expected), n
    # Column chunks land in strided views of the destination, and DCP skips empty tensors: only they go DCP's way.
    assert left_to_dcp[0] <= {"model.columns", "model.empty"} and "model.columns" in left_to_dcp[0], left_to_dcp
    assert left_to_dcp[1:] == []  # without_copy=False: DCP alone


def test_the_one_process_readers_read_without_copy(ckpt, left_to_dcp):
    root = os.path.dirname(ckpt)
    reader = CheckpointReader(root)
    got = reader.read([f"model.{n}" for n in ("fp32", "bf16", "rows", "scalar")])
    assert all(_same(got[f"model.{n}"], WHOLE.get(n, CHUNKED.get(n))) for n in ("fp32", "bf16", "scalar", "rows"))
    assert left_to_dcp == [set()]  # read(): every item read into its destination
    whole, extra, _ = read_full_checkpoint(root, progress=False)
    assert extra == {"note": 1}
    assert set(whole) == set(WHOLE) | set(CHUNKED)
    assert all(_same(whole[n], WHOLE.get(n, CHUNKED.get(n))) for n in whole)


def test_a_piece_of_partial_rows_and_another_dtype(ckpt, left_to_dcp):
    """A FlatRange (a distributed-optimizer piece, elements 4..43 of `rows`: a partial row, full rows, a partial
    row) reads from the middle of the chunks' bytes; a bf16 destination of an fp32 entry is converted by DCP."""
    source = CHUNKED["rows"]
    piece = torch.zeros(40)
    converted = _empty_like("fp32", torch.bfloat16)
    dcp_load({"model.rows": FlatRange(source, 4, piece), "model.fp32": converted}, ckpt, without_copy=True)
    assert torch.equal(piece, source.reshape(-1)[4:44])
    assert _same(converted, WHOLE["fp32"].bfloat16())
    assert left_to_dcp == [{"model.fp32"}]  # the conversion; every block of the piece read in place
