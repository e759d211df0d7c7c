"""Reading a checkpoint's tensors straight into their destinations (the one-process readers: tools/checkpoint_convert.py
export-hf, read_full_checkpoint).

DCP's FileSystemReader reads a tensor entry with torch.load, which allocates a tensor of the entry's bytes, and
then copies that into the destination: while a whole tensor is read, it is in memory twice (export-hf's peak held
the largest tensor twice, docs/reliability.md). `read_into_destinations` reads an entry's pickle alone instead --
torch.load onto the meta device, still weights_only (the same trust: a refused pickle raises as before), which
gives the tensor's shape, strides and, as `_checkpoint_offset` on its storage, where its bytes start in the
entry -- and reads the requested bytes into the destination with `readinto`. It takes the read items it can do
so: a tensor entry without stream transforms, saved in this machine's byte order, whose requested region is one
contiguous run of bytes, into a contiguous CPU destination of the same dtype and shape (every entry of a
checkpoint read whole, whatever layout saved it, when its chunks split dim 0). The others (a device or strided
destination, a dtype conversion, a region across rows, byte entries; every entry under a torch without the
offsets) go DCP's way, whose errors are the ones reported.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from megatron_po.errors import UserError


def read_into_destinations(reader, plan, planner):
    """Read the items of DCP LoadPlan `plan` that can be read in place (see above) for `planner` through the
    FileSystemReader `reader`, committing each; return the plan of the items left for DCP's own read_data."""
    by_file: dict[str, list] = {}
    for item in plan.items:
        by_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    left = []
    for relative_path, items in by_file.items():
        path = os.path.join(str(reader.path), relative_path)
        with open(path, "rb") as stream:
            left += [item for item in items if not _read_one(reader, stream, path, item, planner)]
    return dataclasses.replace(plan, items=left)


def _read_one(reader, stream, path: str, item, planner) -> bool:
    """Read `item` into its destination if it can be read in place; whether it was."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    storage = reader.storage_data[item.storage_index]
    if item.type != LoadItemType.TENSOR or storage.transform_descriptors:
        return False
    target = planner.resolve_tensor(item).detach()
    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return False
    entry = reader._slice_file(stream, storage)  # TrustedReader names this entry should torch.load refuse it
    if _byte_order(entry) != sys.byteorder:  # torch.load swaps the bytes (and cannot on the meta device)
        return False  # (None: a torch whose zip reader is not where this looks)
    entry.seek(0)
    saved = torch.load(entry, map_location="meta", weights_only=True)
    start = getattr(saved.untyped_storage(), "_checkpoint_offset", None)  # absent in an older torch
    region = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
    if (start is None or region.dtype != target.dtype or region.shape != target.shape
            or not region.is_contiguous()):
        return False
    start += region.storage_offset() * region.element_size()
    size = target.numel() * target.element_size()
    if start + size > storage.length:
        return False  # DCP's read reports it
    stream.seek(storage.offset + start)
    into = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < size:
        n = stream.readinto(into[done:])
        if not n:
            raise UserError(f"{path}: entry '{item.dest_index.fqn}' is truncated")
        done += n
    planner.commit_tensor(item, target)
    return True


def _byte_order(entry) -> str | None:
    """The byte order torch.save recorded in the entry ("little" when it did not, as torch.load assumes)."""
    zip_reader = getattr(torch._C, "PyTorchFileReader", None)  # the one torch.load reads the entry with
    if zip_reader is None:
        return None
    archive = zip_reader(entry)
    return archive.get_record("byteorder").decode() if archive.has_record("byteorder") else "little"
