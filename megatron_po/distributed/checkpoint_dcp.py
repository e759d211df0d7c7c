"""How a checkpoint's tensors reach `torch.distributed.checkpoint` (DCP) and come back.

Tensor-parallel shards are handed to DCP as DTensors sharded along their partition dim (`global_view`),
so DCP stores global tensors. MoE experts are stacked [local experts, ...] per expert-parallel rank (and
split along their ffn dim over the expert TP ranks): each rank hands DCP its block of the global
[num_experts, ...] tensor at its offset (`expert_block`, written like a distributed-optimizer piece below),
so the checkpoint does not depend on EP or ETP either, and expert-data-parallel replicas write one copy.
FSDP2 (distributed/fsdp.py) writes them too: each rank's rows of a parameter (and of its optimizer state) are
the flat range `shard_offset` onward of the TP-local tensor, a `FlatRange` like a distributed-optimizer piece.
The distributed optimizer (ZeRO-1) writes the same per-parameter tensors: its fp32 main params and
per-element state live in flat ranges of a padded buffer that ignore parameter boundaries, and each rank
writes the piece of each parameter it owns as DCP chunks of that parameter's global tensor at the piece's
offset (`FlatRange`: no gathering, no extra memory; an expert's piece lands inside its block). Loading
reads each rank's own ranges back, so sharded and unsharded runs and any DP (TP, PP, virtual pipeline,
EP) layouts load each other's checkpoints, optimizer state included.

`read_metadata` checks a checkpoint directory before anything reads it; `dcp_load` turns DCP's failures
into one-line UserErrors (`first_line`). Both read through checkpoint_trust.py, so that no pickle in the
checkpoint can run code; `JsonEntry` values (our metadata, checkpoint_data.py) are stored as raw JSON.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os

import torch

from megatron_po import parallel_state as ps
from megatron_po.distributed.checkpoint_data import JsonEntry
from megatron_po.distributed.checkpoint_trust import UntrustedCheckpoint, load_metadata, read_byte_entry, trusted_reader
from megatron_po.distributed.fsdp import shard_offset
from megatron_po.errors import UserError

def _tp_mesh():
    # parallel_state keeps one mesh per group and drops them with the groups (destroy_model_parallel)
    return ps.device_mesh(ps.get_tensor_model_parallel_group())


def is_tp_shard(p: torch.Tensor) -> bool:
    """A dense tensor-parallel shard (experts are placed by `expert_block`, whatever their TP flags)."""
    return (getattr(p, "tensor_model_parallel", False) and not getattr(p, "expert_parallel", False)
            and ps.get_tensor_model_parallel_world_size() > 1)


def expert_block(p: torch.Tensor) -> tuple[tuple, tuple] | None:
    """(global shape, offsets of this rank's tensor in it) of an expert parameter that is split over expert
    ranks: dim 0 (experts) over the expert-parallel ranks, `expert_tp_dim` over the expert TP ranks (ETP may
    differ from TP); None for any other tensor, or experts this rank holds whole."""
    if not getattr(p, "expert_parallel", False):
        return None
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    dim = p.expert_tp_dim
    if ep == 1 and (etp == 1 or dim < 0):
        return None
    shape, offsets = list(p.shape), [0] * p.dim()
    shape[0], offsets[0] = p.shape[0] * ep, p.shape[0] * ps.get_expert_model_parallel_rank()
    if etp > 1 and dim >= 0:
        shape[dim], offsets[dim] = p.shape[dim] * etp, p.shape[dim] * ps.get_expert_tensor_parallel_rank()
    return tuple(shape), tuple(offsets)


def global_view(p: torch.Tensor, t: torch.Tensor):
    """`t` (a param or a state tensor shaped like `p`) as DCP should see it: a DTensor when `p` is a
    tensor-parallel shard, this rank's block of the global tensor (a `FlatRange` covering all of `t`) when
    it holds a slice of the experts, else the plain tensor (replicated across TP/DP; DCP writes one copy)."""
    if ps.is_dtensor(p):  # FSDP2: this rank's rows of the (TP-local, expert-local) parameter
        if t.shape != p._local_tensor.shape:
            raise ValueError("a tensor checkpointed beside an FSDP2 parameter must be shaped like its shard")
        return FlatRange(p, shard_offset(p), t.reshape(-1))
    if expert_block(p) is not None and t.shape == p.shape:
        if not t.is_contiguous():  # the block must be a view of `t`, so that loading fills it in place
            raise ValueError("an expert tensor to checkpoint must be contiguous")
        return FlatRange(p, 0, t.view(-1))
    if is_tp_shard(p) and t.shape == p.shape:
        from torch.distributed.tensor import DTensor, Shard
        if getattr(p, "partition_stride", 1) != 1:  # Shard(dim) means contiguous slices
            raise UserError("checkpointing a strided tensor-parallel partition is not supported")
        return DTensor.from_local(t, _tp_mesh(), [Shard(p.partition_dim)], run_check=False)
    return t


def global_shape(p: torch.Tensor) -> tuple:
    block = expert_block(p)
    if block is not None:
        return block[0]
    shape = list(p.shape)
    if is_tp_shard(p):
        shape[p.partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return tuple(shape)


# --------------------------------------------------------------------------------------------------
# Distributed-optimizer pieces as chunks of the global tensors
# --------------------------------------------------------------------------------------------------


def _blocks(shape: tuple, a: int, b: int) -> list[tuple[int, tuple, tuple]]:
    """(flat start, offsets, sizes) of rectangular blocks that together cover the row-major flat range
    [a, b) of a tensor of `shape`, each contiguous in memory: a partial first row, full rows, a partial
    last row, the partial rows split the same way one dimension down (at most 2·ndim − 1 blocks)."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(a, (a,) if shape else (), (b - a,) if shape else ())]
    inner = math.prod(shape[1:])
    first, last = -(-a // inner), b // inner  # the full rows are [first, last)

    def in_row(row, lo, hi):
        return [(row * inner + s, (row, *o), (1, *z)) for s, o, z in _blocks(shape[1:], lo, hi)]

    if first > last:  # inside one row
        return in_row(last, a - last * inner, b - last * inner)
    out = in_row(first - 1, a - (first - 1) * inner, inner) if a < first * inner else []
    if first < last:
        out.append((first * inner, (first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    return out + (in_row(last, 0, b - last * inner) if last * inner < b else [])


class FlatRange:
    """The elements [offset, offset + numel) of a parameter's flattened (TP-local, expert-local) tensor, held
    by the 1-D `tensor` (a distributed-optimizer piece: fp32 main param or per-element state; or all of an
    expert tensor, `global_view`), as DCP chunks of the *global* parameter-shaped tensor. The range splits
    into rectangular blocks (`_blocks`) that are views of `tensor`, so DCP writes and reads them in place:
    no gather over data-parallel ranks, and the checkpoint holds the same per-parameter tensors as an
    unsharded optimizer's (DCP reshards on load).

    DCP finds tensors by chunk offset only for tensors, DTensors and ShardedTensors, so these entries
    travel beside the state dict, through the planners of `dcp_save` / `dcp_load`."""

    def __init__(self, p: torch.Tensor, offset: int, tensor: torch.Tensor):
        self.param, self.offset, self.tensor = p, offset, tensor
        self.shape = torch.Size(global_shape(p))  # of the global tensor
        block = expert_block(p)  # where this rank's (TP-local, expert-local) tensor starts in the global one
        shift = list(block[1]) if block is not None else [0] * p.dim()
        if is_tp_shard(p):
            shift[p.partition_dim] = ps.get_tensor_model_parallel_rank() * p.shape[p.partition_dim]
        self.blocks = {}  # global offsets -> view of `tensor`
        for start, offsets, sizes in _blocks(tuple(p.shape), offset, offset + tensor.numel()):
            view = tensor[start - offset:start - offset + math.prod(sizes)].view(sizes)
            self.blocks[torch.Size(o + d for o, d in zip(offsets, shift))] = view

    def chunks(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.blocks.items()]

    def write_items(self, fqn: str) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(self.tensor)))
                for chunk in self.chunks()]

    def copy_from_local(self, local: torch.Tensor) -> None:
        """Take this range's elements from `local`, a full TP-local parameter-shaped tensor."""
        self.tensor.copy_(local.reshape(-1)[self.offset:self.offset + self.tensor.numel()])


# --------------------------------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------------------------------


def read_metadata(path: str):
    """DCP metadata of a checkpoint directory, after checking that every data file it points to is
    there and long enough. Bad input raises UserError (one line naming the file); so does a `.metadata`
    that would unpickle anything but DCP's metadata classes (checkpoint_trust.py)."""
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(meta_file):
        raise UserError(f"{meta_file} is missing: not a complete checkpoint")
    try:
        md = load_metadata(meta_file)
        storage = md.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except UntrustedCheckpoint:
        raise
    except Exception as e:  # truncated or garbled pickle
        raise UserError(f"{meta_file} is corrupt or truncated ({type(e).__name__}: {first_line(e)})") from None
    for rel, size in sorted(needed.items()):
        if os.path.basename(rel) != rel or rel in ("", ".", ".."):  # DCP reads os.path.join(path, rel)
            raise UntrustedCheckpoint(f"{meta_file}: refused: it points at {rel!r}, outside the checkpoint directory")
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise UserError(f"{f} is missing (the checkpoint's .metadata refers to it)")
        have = os.path.getsize(f)
        if have < size:
            raise UserError(f"{f} is truncated: {have} bytes, the checkpoint's .metadata needs {size}")
    return md


class Deferred:
    """A tensor made only when DCP writes it (`make()`), of a known shape and dtype: a converter streams a
    checkpoint through it (tools/checkpoint_convert.py import-hf), each tensor made, written and released alone."""

    __slots__ = ("shape", "dtype", "make")

    def __init__(self, shape: tuple, dtype: torch.dtype, make):
        self.shape, self.dtype, self.make = tuple(shape), dtype, make


def _split_ranges(state: dict) -> tuple[dict, dict]:
    """(the state DCP takes as is, the `FlatRange` entries its planners must handle)."""
    ranges = {k: v for k, v in state.items() if isinstance(v, FlatRange)}
    return {k: v for k, v in state.items() if k not in ranges}, ranges


def dcp_save(state: dict, path: str) -> None:
    """dcp.save of `state`, `FlatRange` entries written as chunks of their global tensors, `JsonEntry`
    values as their raw JSON bytes (DCP would torch.save them: a pickle). `Deferred` entries are planned from
    their shape and made when written; DCP keeps every tensor of a file until the file is done, so a state
    with them is written one file per entry."""
    import torch.distributed.checkpoint as dcp  # heavy import (~1-3 s): only when checkpointing

    state, ranges = _split_ranges(state)
    deferred = {k: v for k, v in state.items() if isinstance(v, Deferred)}
    state.update({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in deferred.items()})

    class Planner(dcp.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.plan = dataclasses.replace(plan, items=plan.items + [item for fqn, r in ranges.items()
                                                                      for item in r.write_items(fqn)])
            return self.plan

        def lookup_object(self, index):
            if index.fqn in deferred:
                return deferred[index.fqn].make()
            return ranges[index.fqn].blocks[index.offset] if index.fqn in ranges else super().lookup_object(index)

        def transform_object(self, write_item, obj):
            return io.BytesIO(obj.data) if isinstance(obj, JsonEntry) else super().transform_object(write_item, obj)

    writer = dcp.FileSystemWriter(path, single_file_per_rank=not deferred)
    dcp.save(state, checkpoint_id=path, storage_writer=writer, planner=Planner())


def dcp_load(state: dict, path: str, metadata=None, without_copy: bool = False) -> None:
    """dcp.load whose failures (DCP raises them on every rank, as a BaseException) become UserError.
    Tensors are filled in place (`FlatRange` entries: the blocks of their pieces); other values are
    returned in `state`, read by checkpoint_trust.read_byte_entry (never by DCP's plain torch.load).
    `metadata`: the checkpoint's, from `read_metadata` (else read again). `without_copy`: CPU tensors read
    straight into `state`'s, without DCP's intermediate copy (checkpoint_read_into.py)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    plain, ranges = _split_ranges(state)

    class Planner(dcp.DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items, meta = [], self.metadata.state_dict_metadata
            for fqn, r in ranges.items():
                if fqn not in meta:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                items += create_read_items_for_chunk_list(fqn, meta[fqn], r.chunks())
            return dataclasses.replace(plan, items=plan.items + items)

        def lookup_tensor(self, index):
            return ranges[index.fqn].blocks[index.offset] if index.fqn in ranges else super().lookup_tensor(index)

        def load_bytes(self, read_item, value):
            fqn = read_item.dest_index.fqn
            file = os.path.join(path, self.metadata.storage_data[read_item.storage_index].relative_path)
            self.original_state_dict[fqn] = read_byte_entry(value.getvalue(), file, fqn)  # the dict dcp.load returns

    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it reads in one process
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(plain, storage_reader=trusted_reader(path, metadata, without_copy),
                     planner=Planner(flatten_state_dict=False))
    except (Exception, CheckpointException) as e:
        refused = _entry_error(e)
        if isinstance(refused, UntrustedCheckpoint):
            raise refused from None
        if refused is not None:
            raise UserError(f"--load {path}: cannot read the checkpoint: {refused}") from None
        raise UserError(f"--load {path}: cannot read the checkpoint: {first_line(e)}") from None
    state.update(plain)


def _entry_error(e: BaseException) -> UserError | None:
    """The refused or corrupt entry (read_byte_entry's UserError) behind a (DCP-wrapped, multi-rank)
    failure, if that is what it was; a refusal first."""
    failures = getattr(e, "failures", None) or {}
    found = [e] + [exc for _, (exc, _tb) in sorted(failures.items())]
    return next((x for x in found if isinstance(x, UntrustedCheckpoint)),
                next((x for x in found if isinstance(x, UserError)), None))


def first_line(e: BaseException) -> str:
    """A one-line summary of a (possibly long, chained, multi-rank) exception."""
    failures = getattr(e, "failures", None)
    if failures:  # DCP's CheckpointException: {rank: (exception, traceback)}
        rank, (exc, _) = sorted(failures.items())[0]
        return f"{type(exc).__name__} on rank {rank}: {first_line(exc)}"
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in text:
        if "size" in line or "shape" in line or "Missing key" in line or "missing" in line:
            return line
    return text[0] if text else type(e).__name__
