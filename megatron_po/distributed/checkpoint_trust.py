"""Reading a checkpoint without letting it run code (docs/reliability.md, "Trust").

A pickle can call any importable function while it is read, so every pickle a checkpoint holds is read
here, by an unpickler that admits a fixed list of globals, or not at all:

- DCP's `.metadata` (torch's FileSystemReader reads it with plain `pickle.load`): `MetadataUnpickler`
  admits only the classes torch.distributed.checkpoint's metadata is made of. `TrustedReader` is the
  FileSystemReader that reads it so; every load (`--load`, `--finetune`, `--use-checkpoint-args`,
  tools/checkpoint_convert.py, tools/translate.py) goes through it (checkpoint_dcp.py).
- The tensors: DCP reads them with `torch.load(weights_only=True)` already; `TrustedReader` names the entry
  that call refuses (torch's own refusal is many lines of advice, terminal escape codes included).
- Non-tensor entries (DCP's BYTE_IO items, `read_byte_entry`): ours are JSON since this format
  (checkpoint_data.py). Entries torch.save'd by DCP -- the previous format's metadata, pickled bytes
  inside, and non-tensor optimizer state -- are read with `torch.load(weights_only=True)` (DCP itself
  uses weights_only=False), and the previous format's pickled bytes by `LegacyUnpickler`, which admits
  only the types that format wrote: containers and numbers (no globals needed), torch dtypes and CPU
  tensors (the RNG states), NumPy arrays (NumPy's RNG state).

A refused global fails the load with one line naming the file and the entry (`UntrustedCheckpoint`), the same
for a tensor entry and any other, before anything is loaded into the model; nothing of the pickle has run. A
garbled entry (a load that skipped the checksums) is named the same way, as corrupt (`UserError`).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
from collections import OrderedDict

import numpy as np
import torch

from megatron_po.distributed import checkpoint_data
from megatron_po.distributed.checkpoint_read_into import read_into_destinations
from megatron_po.errors import UserError

# How the refusals end: what the rule is for.
_WHY = "a checkpoint is data, and loading it must not run code it carries"


class UntrustedCheckpoint(UserError):
    """A checkpoint entry that is not data we wrote (a pickle reaching for a global not admitted)."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, what: str):
        super().__init__(what)
        self.global_name = what


class _AllowListUnpickler(pickle.Unpickler):
    """The C unpickler (as fast as plain `pickle.load`) whose only way to reach code, `find_class` (every
    GLOBAL, STACK_GLOBAL, INST, OBJ and EXT opcode goes through it), looks the name up in `ALLOWED`."""

    ALLOWED: dict[tuple[str, str], object] = {}

    def find_class(self, module: str, name: str):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid):
        raise _Refused(f"a persistent id ({str(pid)[:40]})")


def _torch_constants() -> dict:
    """torch.<dtype>, torch.<layout>, torch.<memory_format> by name (pickled as globals)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", k): v for k, v in vars(torch).items() if isinstance(v, kinds)}


def _metadata_classes() -> dict:
    from torch.distributed.checkpoint import filesystem, metadata
    allowed = {("torch.distributed.checkpoint.metadata", n): getattr(metadata, n)
               for n in ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
               if hasattr(metadata, n)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> torch.layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", cls)] = getattr(pathlib, cls)  # StorageMeta.checkpoint_id
    return {**allowed, **_torch_constants()}


class MetadataUnpickler(_AllowListUnpickler):
    """DCP's `.metadata`: its dataclasses, torch.Size, dtypes, layouts, memory formats and paths."""


def _storage_from_bytes(data: bytes):
    """torch.storage._load_from_bytes (how plain pickle stores a tensor's storage), weights-only: the
    original reads the bytes with torch.load(weights_only=False)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise _Refused(f"{_weights_only_reason(e).removeprefix('the global ')} (inside a tensor's storage)") from None


def _legacy_types() -> dict:
    allowed = {("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): torch.Size,
               ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
               ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # NumPy 1 / NumPy 2 pickle names
        allowed[(module, "_reconstruct")] = multiarray._reconstruct
        allowed[(module, "scalar")] = multiarray.scalar
    return {**allowed, **_torch_constants()}


class LegacyUnpickler(_AllowListUnpickler):
    """The previous format's pickled metadata entries: containers, numbers, strings, torch dtypes, CPU
    tensors and NumPy arrays."""


def _allow_lists() -> None:
    if not MetadataUnpickler.ALLOWED:
        MetadataUnpickler.ALLOWED = _metadata_classes()
        LegacyUnpickler.ALLOWED = _legacy_types()


# --------------------------------------------------------------------------------------------------
# DCP's .metadata
# --------------------------------------------------------------------------------------------------


def load_metadata(meta_file: str):
    """The DCP Metadata object of `.metadata` file `meta_file`, unpickled with `MetadataUnpickler`."""
    _allow_lists()
    with open(meta_file, "rb") as f:
        data = io.BytesIO(f.read())  # one read, not the unpickler's many small ones
        try:
            return MetadataUnpickler(data).load()
        except _Refused as e:
            raise UntrustedCheckpoint(
                f"{meta_file}: refused to unpickle {e.global_name}, which is not one of the classes "
                f"torch.distributed.checkpoint's metadata is made of ({_WHY})") from None


def trusted_reader(path: str, metadata=None, without_copy: bool = False):
    """A torch.distributed.checkpoint FileSystemReader of `path` that reads `.metadata` through
    `MetadataUnpickler` (the tensors it reads with weights_only=True already), or returns `metadata`,
    when given, read so before (a load reads a checkpoint in several dcp.load calls). A tensor entry that
    torch's weights-only unpickler refuses raises UntrustedCheckpoint naming the file and the entry.
    `without_copy`: the tensors it can are read straight into their destinations (checkpoint_read_into.py)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class TrustedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            given = metadata is not None and rank is None
            md = metadata if given else load_metadata(os.path.join(str(self.path), name))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def _slice_file(self, file, sinfo):
            self.reading = sinfo  # FileSystemReader slices each entry's bytes just before it reads them
            return super()._slice_file(file, sinfo)

        def _entry_being_read(self) -> tuple[str, str] | None:
            """(file, entry) of the entry `_slice_file` last handed to torch.load, or None before any."""
            sinfo = getattr(self, "reading", None)
            if sinfo is None:
                return None
            entries = [index.fqn for index, info in self.storage_data.items() if info is sinfo]
            return os.path.join(str(self.path), sinfo.relative_path), entries[0] if entries else "?"

        def read_data(self, plan, planner):
            try:
                if without_copy:
                    plan = read_into_destinations(self, plan, planner)
                return super().read_data(plan, planner)
            except pickle.UnpicklingError as e:  # a tensor's torch.load(weights_only=True): non-tensor
                where = self._entry_being_read() or (str(self.path), "?")  # entries raise UntrustedCheckpoint
                raise refused_by_weights_only(*where, e) from None
            except (UserError, AssertionError):  # a non-tensor entry's own line; DCP's size check (planned)
                raise
            except Exception as e:  # garbled bytes (a load that skipped the checksums): name the entry too
                where = self._entry_being_read()
                if where is None:
                    raise
                raise UserError(f"{where[0]}: entry '{where[1]}' is corrupt "
                                f"({type(e).__name__}: {_first_line(e)})") from None

    return TrustedReader(path)


# --------------------------------------------------------------------------------------------------
# Non-tensor entries
# --------------------------------------------------------------------------------------------------

_ZIP = b"PK\x03\x04"  # torch.save's format; our JSON entries start with a JSON value


def read_byte_entry(data: bytes, file: str, entry: str):
    """The value of a non-tensor checkpoint entry `entry` stored as `data` in `file`: a JSON entry of
    ours, or (torch.save'd by DCP) a weights-only value, whose bytes, in the previous format, are our
    pickled metadata. A pickle reaching for anything else raises UntrustedCheckpoint, bytes that are no
    such entry UserError, each naming the file and the entry."""
    if not data.startswith(_ZIP):
        try:
            return checkpoint_data.loads(data)
        except ValueError as e:
            raise UserError(f"{file}: entry '{entry}' is corrupt: {e}") from None
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused_by_weights_only(file, entry, e) from None
    except Exception as e:  # not a readable torch.save file
        raise UserError(f"{file}: entry '{entry}' is corrupt ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(value, bytes):
        return value  # e.g. a number in an optimizer's state
    _allow_lists()
    try:
        return LegacyUnpickler(io.BytesIO(value)).load()
    except _Refused as e:
        raise UntrustedCheckpoint(f"{file}: entry '{entry}' refused: its pickle (the previous format's metadata) "
                                  f"would call {e.global_name}, which that format never wrote ({_WHY})") from None
    except Exception as e:  # garbled
        raise UserError(f"{file}: entry '{entry}' is corrupt ({type(e).__name__}: {_first_line(e)})") from None


def refused_by_weights_only(file: str, entry: str, e: Exception) -> UntrustedCheckpoint:
    """The one line for an entry, tensor or not, that torch's weights-only unpickler refused (`e`)."""
    return UntrustedCheckpoint(f"{file}: entry '{entry}' refused: torch's weights-only unpickler does not admit "
                               f"{_weights_only_reason(e)} ({_WHY})")


def _weights_only_reason(e: Exception) -> str:
    """What torch's (long, multi-line) weights-only refusal refused: "the global <name>", else the unpickler's
    own error (torch's advice around it, to allow-list a global or to load with weights_only=False, is not
    ours to give), else its first line."""
    text = _ESCAPE.sub("", str(e))
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"the global {found.group(1)}"
    found = re.search(r"Unsupported operand (\S+)", text)
    if found:  # garbled bytes read as a pickle look the same as a hostile opcode: either way, not loaded
        return f"opcode {found.group(1)} (corrupt bytes, or a pickle that is not data)"
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    return found.group(1).strip() if found else _first_line(e)


_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal escape codes (torch's refusal sets bold type)


def _first_line(e: Exception) -> str:
    return next((ln.strip() for ln in _ESCAPE.sub("", str(e)).splitlines() if ln.strip()), "")
