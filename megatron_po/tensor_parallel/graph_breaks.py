"""What a compiled layer (--torch-compile, models/compiled_layers.py) leaves its graph for: functions marked
`@runs_eagerly` run as they are, and, called from code that torch.compile traces, eagerly between two graphs
(a graph break), as `torch.compiler.disable` would make them. Applying that imports TorchDynamo (~1.5 s of
CPU), which only compiled runs should pay: `install()`, called before the first layer is compiled, makes the
disabled versions."""

from __future__ import annotations

import functools

import torch

_functions: dict[str, object] = {}  # name -> the marked function
_disabled: dict[str, object] = {}  # name -> torch.compiler.disable(function), once installed


def runs_eagerly(fn):
    """Decorator: `fn`, run outside the graph of the torch.compile that traces its caller."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _functions[name] = fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _disabled[name](*args, **kwargs)  # KeyError: compiled without `install()`
        return fn(*args, **kwargs)
    return wrapper


def install() -> None:
    """The disabled versions of every marked function (idempotent)."""
    for name, fn in _functions.items():
        if name not in _disabled:
            _disabled[name] = torch.compiler.disable(fn)
