"""Cutting an asynchronous stream between two iterations without draining it.

An action between the micro-batches below N and those from N on (an evaluation in the stream) runs on
every pipeline rank at its cut: just before the rank's first forward of a micro-batch >= N. The ranks
reach their cuts independently when no receive before a cut waits for a send after one
(`iteration_cuts` checks it), so nothing in the training op lists moves.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedules import Forward, Schedule, comm_of

EVAL_ID_OFFSET = 2**20  # evaluation micro-batch ids start this far past the cut's training ids (p2p tags, keys)


def iteration_cuts(schedule: Schedule, first_new_microbatches) -> dict[int, dict[int, int]]:
    """{N: {rank: op index}}: where the stream is cut for an action between the micro-batch ids below N
    and those from N on, for every N given: each rank's first forward of a micro-batch >= N (len(ops) if
    none). A cut must be consistent: no receive before a rank's cut may wait for a send after another
    rank's cut (then the ops before the cuts are a dependency-closed part of a deadlock-free schedule and
    run to the cuts); otherwise a ConfigError names the rank. One pass over the ops for all N."""
    D, v = schedule.num_stages, schedule.num_chunks
    ns = sorted(set(first_new_microbatches))
    cuts: dict[int, dict[int, int]] = {n: {} for n in ns}
    sends, recvs = {}, {}  # (destination rank, key) -> (rank, op index) of the send / the receive
    for r, ops in schedule.ops.items():
        top, reach = -1, []  # the largest forwarded micro-batch so far: first index where it reaches N
        for i, op in enumerate(ops):
            if isinstance(op, Forward) and op.microbatch > top:
                top = op.microbatch
                reach.append((top, i))
            recv, send = comm_of(op, r, D, v, schedule.placement)
            if recv is not None:
                recvs[(r, recv[1])] = (r, i)
            if send is not None:
                sends[(send[0], send[1])] = (r, i)
        tops = [t for t, _ in reach]
        for n in ns:
            j = bisect.bisect_left(tops, n)
            cuts[n][r] = reach[j][1] if j < len(reach) else len(ops)
    pairs = [(sends[key], at) for key, at in recvs.items() if key in sends]
    if pairs:
        sender, send_at, receiver, recv_at = (torch.tensor(x) for x in zip(*[(s[0], s[1], r[0], r[1])
                                                                            for s, r in pairs]))
        for n in ns:
            cut = torch.tensor([cuts[n][r] for r in range(D)])
            bad = (send_at >= cut[sender]) & (recv_at < cut[receiver])
            if bad.any():
                r = int(receiver[bad][0])
                raise ConfigError(f"the asynchronous stream cannot stop before micro-batch {n} on rank {r} without "
                                  f"waiting for work after the cut of another rank (schedule {schedule.name}, "
                                  f"D={D}, v={v}): evaluate at a drain instead")
    return cuts


def hooks_at_cuts(schedule: Schedule, actions: dict[int, Callable], rank: int) -> dict[int, Callable]:
    """{op index: fn} for `run_rank`: each action at this rank's cut (several at one cut run in order)."""
    hooks: dict[int, list] = {}
    cuts = iteration_cuts(schedule, actions) if actions else {}
    for n in sorted(actions):
        hooks.setdefault(cuts[n][rank], []).append(actions[n])
    return {i: (lambda fns=fns: [fn() for fn in fns]) for i, fns in hooks.items()}
