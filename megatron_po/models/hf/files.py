"""A Hugging Face model directory's safetensors files, one tensor at a time.

`HFTensors` indexes a directory's tensors (model.safetensors, or the shards model.safetensors.index.json
lists) from the files' headers alone, and reads one tensor when asked (`safe_open`, closed again at once, so
the mapped pages of the file do not accumulate in the process). `ShardedWriter` writes HF's sharded layout
(model-0000k-of-0000n.safetensors + model.safetensors.index.json; one file is model.safetensors) one tensor
at a time: the plan (names, shapes, dtypes in order) fixes every shard's header before any data, so no shard
is ever held in memory. The safetensors library writes only whole dicts; its format is a little-endian u64
header length, the JSON header ({name: {dtype, shape, data_offsets}}, padded with spaces to a multiple of 8
bytes) and the tensors' bytes in order, which is all `ShardedWriter` writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import torch

from megatron_po.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_CODE = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Entry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file; UserError (one line) when it is not one."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    header.pop("__metadata__", None)
    return header


class HFTensors:
    """The tensors of an HF model directory: {name: Entry} from the headers; `read(name)` loads one."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
            if missing:
                raise UserError(f"--hf {hf_dir}: shard {missing[0]} is missing ({INDEX} lists it)")
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            weight_map, files = None, [SINGLE]
        else:
            raise UserError(f"--hf {hf_dir}: no {SINGLE} (or {INDEX}); only safetensors checkpoints are read")
        self.entries: dict[str, Entry] = {}
        for file in files:
            for name, info in read_header(os.path.join(hf_dir, file)).items():
                if info.get("dtype") not in BY_CODE:
                    raise UserError(f"{file}: tensor {name} has dtype {info.get('dtype')!r}, not one torch reads")
                self.entries[name] = Entry(file, tuple(info["shape"]), BY_CODE[info["dtype"]])
        if weight_map is not None:
            wrong = next((n for n, f in weight_map.items() if n not in self.entries or self.entries[n].file != f), None)
            if wrong is not None:
                raise UserError(f"--hf {hf_dir}: {INDEX} puts {wrong} in {weight_map[wrong]}, which does not hold it")

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of the shape and dtype of `name` (planning reads no data)."""
        if name not in self.entries:
            raise UserError(f"--hf {self.dir}: the checkpoint has no tensor {name}")
        e = self.entries[name]
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        e = self.entries[name]
        with safe_open(os.path.join(self.dir, e.file), "pt") as f:
            return f.get_tensor(name)


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


class ShardedWriter:
    """HF's sharded safetensors layout under `out_dir`, from a plan [(name, shape, dtype)] in writing order:
    consecutive tensors fill a shard up to `max_shard_bytes` (a larger tensor gets one alone). `write` takes the
    plan's tensors in order; `close` writes the index (several shards) and checks that all came."""

    def __init__(self, out_dir: str, plan: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int):
        shards, size = [[]], 0
        for name, shape, dtype in plan:
            n = nbytes(shape, dtype)
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += n
        self.dir, self.files = out_dir, shard_names(len(shards))
        self.shards, self.plan = shards, [p for s in shards for p in s]
        self.position, self.stream, self.shard = 0, None, -1

    def _open_next(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.shard += 1
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in self.shards[self.shard]:
            n = nbytes(shape, dtype)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.stream = open(os.path.join(self.dir, self.files[self.shard]), "wb")
        self.stream.write(struct.pack("<Q", len(text)) + text)
        self.left = len(self.shards[self.shard])

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.plan[self.position]
        if (name, tuple(t.shape), t.dtype) != want:
            raise RuntimeError(f"wrote {name} {tuple(t.shape)} {t.dtype}, planned {want}")
        if self.stream is None or self.left == 0:
            self._open_next()
        if t.numel():
            self.stream.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.position += 1
        self.left -= 1

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.position != len(self.plan):
            raise RuntimeError(f"wrote {self.position} of {len(self.plan)} planned tensors")
        if len(self.files) > 1:
            weight_map = {name: self.files[k] for k, shard in enumerate(self.shards) for name, _, _ in shard}
            total = sum(nbytes(shape, dtype) for _, shape, dtype in self.plan)
            with open(os.path.join(self.dir, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
