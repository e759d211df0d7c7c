"""Zero-bubble pipeline schedules (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"), as pure functions.

Each backward is split in two ops (schedule_ops.py): `BackwardInput` (B) computes the gradient w.r.t. the
stage input and sends it upstream at once; `BackwardWeight` (W) computes the weight gradients later,
from what B left (saved inputs and output gradients, no forward re-run). W has no dependency on any
other rank, so a schedule can put it wherever a rank would otherwise wait: B's round trip through the
pipeline gets shorter (no W on the critical path) and the W passes fill the bubbles.

- `zb_h1` (ZB-H1, and its interleaved form for v > 1, the paper's ZB1P as in torch.distributed.pipelining's
  ScheduleInterleavedZeroBubble): 1F1B's warm-up and steady one-forward-one-backward, with rank r
  delaying its W passes by r steady steps. Peak in-flight micro-batches (forward run, W not yet) is D on
  every rank (1F1B's peak, on rank 0). Bubble about (D-1)(t_F + t_B - t_W) instead of 1F1B's
  (D-1)(t_F + t_B + t_W).
- `zb_h2` (ZB-H2, v = 1): up to 2D-1 micro-batches in flight on every rank (the paper's peak), so rank
  r runs 2(D-r)-1 forwards while the first gradient makes its round trip, and W passes deferred whenever
  a B or F can run (the tail fills with Ws). The op order comes from a list-scheduling pass on unit costs
  (t_F = t_B = t_W): at every free moment a rank runs a ready B, else a ready F under its in-flight cap,
  else its oldest pending W. Under a flush no schedule beats M(t_F+t_B+t_W) + (D-1)t_F (the last rank
  cannot start earlier); ZB-H2 reaches it at D=4, M=8 for t_W <= t_F (simulator, tests), ZB-H1 only at
  t_F = t_B = t_W. (The paper's "zero" also removes that start-up ramp by overlapping the optimizer step
  with the next iteration, which a synchronous flush here does not do.)

Every function validates its sizes and returns a `Schedule` that `check_schedule` accepts
(tests/test_zero_bubble.py proves it for D in 2..8, M in D..4D; tests/test_interleaved_any_m.py for
interleaved ZB-H1 at every M from 1 to 2D).
"""

from __future__ import annotations

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedule_ops import (BackwardInput, BackwardWeight, Forward, Op, Schedule, Step,
                                               check_sizes, interleaved_order, microbatch_groups,
                                               virtual_stage)


def zb_h1(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (v = 1) / interleaved ZB-H1 (v > 1, any M, in interleaved 1F1B's micro-batch groups).

    Rank r: w = (v-1)*N + (D-1-r) warm-up forwards, N the first micro-batch group (D when M % D == 0;
    torch's `_get_warmup_ops` with factor 1), then
    (F, B) pairs and the cool-down Bs, in interleaved 1F1B's micro-batch/chunk order; from the r-th
    backward on, each B is followed by the oldest pending W; the remaining Ws close the iteration."""
    check_sizes(num_stages, num_chunks, num_microbatches)
    D, v, M = num_stages, num_chunks, num_microbatches
    forwards = interleaved_order(D, v, M, forward=True)
    backwards = interleaved_order(D, v, M, forward=False)
    n = len(forwards)
    ops: dict[int, list[Op]] = {}
    for r in range(D):
        warmup = min((v - 1) * microbatch_groups(D, M)[0] + (D - 1 - r), n)
        rank_ops: list[Op] = [Forward(*f) for f in forwards[:warmup]]
        num_w = 0
        for i in range(n):
            if warmup + i < n:
                rank_ops.append(Forward(*forwards[warmup + i]))
            rank_ops.append(BackwardInput(*backwards[i]))
            if i >= r:  # the first r backwards go without W: their gradients reach rank 0 sooner
                rank_ops.append(BackwardWeight(*backwards[num_w]))
                num_w += 1
        rank_ops += [BackwardWeight(*b) for b in backwards[num_w:]]
        ops[r] = rank_ops + [Step(None)]
    return Schedule("zb-h1", D, v, M, ops)


def greedy_zero_bubble(num_stages: int, num_microbatches: int, max_in_flight: list[int], name: str,
                       num_chunks: int = 1, placement: str = "interleaved") -> Schedule:
    """List scheduling on unit costs (t_F = t_B = t_W, no p2p cost): at every time step each rank runs
    a ready B (its deepest virtual stage first), else a ready F if fewer than `max_in_flight[r]`
    (micro-batch, chunk) pairs are in flight on it (forward run, W not yet; the deepest chunk first),
    else its oldest pending W, else idles. Each (rank, chunk) runs its Fs and its Bs in micro-batch order.
    The op lists are a valid execution by construction: they cannot deadlock."""
    D, v, M = num_stages, num_chunks, num_microbatches
    if len(max_in_flight) != D or min(max_in_flight) < 1:
        raise ConfigError(f"{name}: max_in_flight needs D={D} values >= 1, got {max_in_flight}")
    last = D * v - 1
    vs_of = {(r, c): virtual_stage(r, c, D, placement) for r in range(D) for c in range(v)}
    # arrival[(kind, vs)][mb]: time the input of vs for mb is available (activation / output gradient)
    arrival: dict[tuple[str, int], dict[int, int]] = {(k, vs): {} for k in ("act", "grad") for vs in range(D * v)}
    arrival[("act", 0)] = {mb: 0 for mb in range(M)}  # the first stage reads its micro-batches itself
    next_f = {key: 0 for key in vs_of}
    next_b = {key: 0 for key in vs_of}
    in_flight = [0] * D
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(D)]
    ops: dict[int, list[Op]] = {r: [] for r in range(D)}
    by_depth = {r: sorted(range(v), key=lambda c: -vs_of[(r, c)]) for r in range(D)}
    t = 0
    while any(len(ops[r]) < 3 * M * v for r in range(D)):
        if t > 10 * (M * v + D * v):  # cannot happen for caps >= 1: the last virtual stage always progresses
            raise RuntimeError(f"{name}: list scheduling made no progress (D={D}, v={v}, M={M})")
        for r in range(D):
            chosen = None
            for c in by_depth[r]:  # B first: it unblocks the previous stage
                vs, mb = vs_of[(r, c)], next_b[(r, c)]
                if mb < next_f[(r, c)] and (vs == last or arrival[("grad", vs)].get(mb, t + 1) <= t):
                    chosen = BackwardInput(mb, c)
                    next_b[(r, c)] += 1
                    pending_w[r].append((mb, c))
                    if vs > 0:
                        arrival[("grad", vs - 1)][mb] = t + 1
                    break
            if chosen is None and in_flight[r] < max_in_flight[r]:
                for c in by_depth[r]:
                    vs, mb = vs_of[(r, c)], next_f[(r, c)]
                    if mb < M and arrival[("act", vs)].get(mb, t + 1) <= t:
                        chosen = Forward(mb, c)
                        next_f[(r, c)] += 1
                        in_flight[r] += 1
                        if vs < last:
                            arrival[("act", vs + 1)][mb] = t + 1
                        break
            if chosen is None and pending_w[r]:
                chosen = BackwardWeight(*pending_w[r].pop(0))
                in_flight[r] -= 1
            if chosen is not None:
                ops[r].append(chosen)
        t += 1
    return Schedule(name, D, v, M, {r: ops[r] + [Step(None)] for r in range(D)}, placement)


def zb_h2(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (v = 1): every rank keeps up to 2D-1 micro-batches in flight (the paper's peak), covering the
    first gradient's round trip with forwards; W passes fill every other gap."""
    check_sizes(num_stages, num_chunks, num_microbatches)
    if num_chunks != 1:
        raise ConfigError(f"zb-h2 needs num_chunks == 1, got num_chunks={num_chunks} (use zb-h1 for "
                          "interleaved zero bubble)")
    D = num_stages
    return greedy_zero_bubble(D, num_microbatches, [2 * D - 1] * D, "zb-h2")


def zb_v(num_stages: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """ZB-V: 2 chunks per rank in a V (chunk 0 = virtual stage r, chunk 1 = 2D-1-r: rank 0 holds the
    embedding and the loss), list-scheduled on unit costs with at most 2D (micro-batch, chunk) pairs in
    flight per rank: 1F1B's peak of D whole-stage activations, as in the paper."""
    check_sizes(num_stages, num_chunks, num_microbatches)
    if num_chunks != 2:
        raise ConfigError(f"zb-v needs num_chunks == 2 (a V over the ranks), got num_chunks={num_chunks}")
    D = num_stages
    return greedy_zero_bubble(D, num_microbatches, [2 * D] * D, "zb-v", num_chunks=2, placement="v")


ZB_SCHEDULES = {"zb-h1": zb_h1, "zb-h2": zb_h2, "zb-v": zb_v}
