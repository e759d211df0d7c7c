"""Agreeing on a start-up or I/O error across ranks, so every rank takes the same decision (one line,
the same exit) instead of one rank failing while the others wait in the next collective."""

from __future__ import annotations

import torch.distributed as dist


def agree(error: str | None, payload=None) -> tuple[str | None, list]:
    """All-gather (error, payload) over every rank: returns the first rank's error (or None) and
    every rank's payload. A no-op gather without a process group or with one rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error, [payload]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, payload))
    return next((e for e, _ in gathered if e), None), [p for _, p in gathered]
