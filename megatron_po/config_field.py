"""`flag`: a config dataclass field that becomes one command-line flag (config.py generates the parser from
the fields; the help, choices, nargs and alias travel in the field's metadata). Below config.py and the
modules that add fields to its sections (config_recipe.py), so both use the one helper."""

from __future__ import annotations

from dataclasses import field


def flag(default, help: str, choices=None, nargs=None, alias=None):
    meta = {"help": help}
    if alias is not None:  # another spelling of the flag (of its --no- form for booleans that default to True)
        meta["alias"] = alias
    if choices is not None:
        meta["choices"] = choices
    if nargs is not None:
        meta["nargs"] = nargs
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
