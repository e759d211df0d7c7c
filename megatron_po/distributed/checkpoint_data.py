"""Our checkpoint metadata as data: JSON, never a pickle, so that reading it cannot run code.

Everything a checkpoint holds besides tensors -- `extra` (train state, config, vocabulary sizes), `layout`,
`optimizer_type`, `optimizer_state_keys.*`, `policy_steps`, `policy_lr_steps.*`, `grad_scaler*`, the
RNG states -- is written as one UTF-8 JSON document per entry (`JsonEntry`), which the DCP layer stores
as raw bytes (checkpoint_dcp.py). JSON has no tuples, tensors or dtypes, so a few tagged objects keep
the values exactly what was saved (decoding can only ever build these types):

    {"$tuple": [...]}                                  a tuple (a Python RNG state must be one)
    {"$dict": [[key, value], ...]}                     a dict whose keys are not all plain strings
    {"$dtype": "float32"}                              a torch.dtype
    {"$tensor": {"dtype", "shape", "data"}}            a CPU tensor; data: its bytes, base64
    {"$ndarray": {"dtype", "shape", "data"}}           a NumPy array (NumPy's RNG state); dtype: its .str

Floats round-trip exactly (JSON writes Python's shortest repr; NaN and infinities as Python's json does).
"""

from __future__ import annotations

import base64
import json

import numpy as np
import torch

TAGS = ("$tuple", "$dict", "$dtype", "$tensor", "$ndarray")


class JsonEntry:
    """A checkpoint entry stored as the raw bytes of a JSON document (not torch.save'd by DCP)."""

    __slots__ = ("data",)

    def __init__(self, value):
        self.data = dumps(value)


def dumps(value) -> bytes:
    return json.dumps(_encode(value), separators=(",", ":")).encode()


def loads(data: bytes):
    """The value of a JSON entry; ValueError when it is not one we could have written."""
    try:
        return _decode(json.loads(data))
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise ValueError(f"not a JSON checkpoint entry ({type(e).__name__}: {e})") from None


def _encode(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, tuple):
        return {"$tuple": [_encode(x) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _encode(x) for k, x in v.items()}
        return {"$dict": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"$dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"$tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "data": base64.b64encode(raw).decode()}}
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        return {"$ndarray": {"dtype": a.dtype.str, "shape": list(a.shape),
                             "data": base64.b64encode(a.tobytes()).decode()}}
    raise TypeError(f"cannot write a {type(v).__name__} into a checkpoint's JSON metadata")


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _decode(v):
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) != 1 or next(iter(v)) not in TAGS:
        return {k: _decode(x) for k, x in v.items()}
    tag, body = next(iter(v.items()))
    if tag == "$tuple":
        return tuple(_decode(x) for x in body)
    if tag == "$dict":
        return {_hashable(_decode(k)): _decode(x) for k, x in body}
    if tag == "$dtype":
        return _dtype(body)
    raw = base64.b64decode(body["data"], validate=True)
    shape = [int(n) for n in body["shape"]]
    if tag == "$tensor":
        dtype = _dtype(body["dtype"])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
    dtype = np.dtype(body["dtype"]) if isinstance(body["dtype"], str) else None
    if dtype is None or dtype.hasobject:  # an object array would be made of pickles
        raise ValueError("object arrays are not data")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _hashable(k):
    if isinstance(k, list):
        raise ValueError("a dict key cannot be a list")
    return k
