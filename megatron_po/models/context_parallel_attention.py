"""Causal self-attention over a sequence split across the context-parallel (CP) ranks (--context-parallel-size).

Each CP rank holds 2 of the sequence's 2·CP chunks (data/context_split.py: rank i holds chunks i and
2·CP−1−i), so its queries need the keys and values of the other ranks. Two ways (--cp-comm-type p2p or
allgather), as
Megatron-LM / Transformer Engine's `attn_forward_func_with_cp`:

p2p (ring attention). The K/V blocks travel around the ring: at step t rank i holds the block of rank
j = i − t (mod CP), posts the send of that block to rank i + 1 and the receive of the next from i − 1
(one batched isend/irecv, `_Ring.shift`), and computes this block's attention while they travel. Which
queries see which keys follows from the chunk order (rank i's chunks are i < 2·CP−1−i):
    t = 0     its own block, causally (its two chunks in order are a causal sequence)
    j < i     every query sees the block's first chunk (j < i), none its second: q x K[:c], unmasked
    j > i     only the second query chunk sees anything, both key chunks: Q[c:] x k, unmasked
so every step after the first costs the same (c x 2c scores). The blocks' outputs merge by their
log-sum-exps (attention_blocks.py gives each block's lse, and `merge`): lse' = log(e^lse + e^lse_b),
out' = out + e^(lse_b − lse')·(out_b − out), the softmax-weighted sum. The backward passes the
blocks around the ring again, each with an fp32 accumulator of its dK/dV that every rank adds its share
to; after CP steps the accumulator of rank i's block has gone round and reaches rank i. Memory per rank:
its own q, k, v, out, lse (what one rank's attention keeps anyway) plus two K/V blocks in flight.

allgather. K and V are gathered from every CP rank once (into the whole sequence's order), each local
query chunk attends to the keys before it (F.scaled_dot_product_attention, causal from the bottom right),
and the backward reduce-scatters dK/dV. Memory: the whole sequence's K/V per layer, kept for the backward.

The values' head dimension may differ from the queries' and keys' (multi-latent attention, models/mla.py).
Grouped-query / multi-query attention: only the K/V groups travel; they are repeated to the query heads
where a block is computed. --reset-attention-mask: each (query block, key block) pair gets the document
mask of its tokens, built from the whole sequence's document ids and the global token positions. The
attention core takes no dropout here (config rule context-parallel-attention-dropout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_po import parallel_state as ps
from megatron_po.data.context_split import token_indices
from megatron_po.models import attention_blocks
from megatron_po.tensor_parallel.graph_breaks import runs_eagerly
from megatron_po.tensor_parallel.sequence_pieces import gather_from_context_parallel_region

_KV, _DKV = 0, 1  # p2p tags: K/V blocks and their gradient accumulators travel as separate messages


def _repeat(t: torch.Tensor, times: int) -> torch.Tensor:
    return t if times == 1 else t.repeat_interleave(times, dim=1)


def _sum_groups(t: torch.Tensor, times: int) -> torch.Tensor:
    """The gradient of `_repeat`: [b, groups x times, s, d] -> [b, groups, s, d]."""
    if times == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // times, times, s, d).sum(dim=2)


def _document_mask(document_ids, q_idx, k_idx) -> torch.Tensor:
    """[b, 1, sq, sk] bool: causal by global position and within one document."""
    dq, dk = document_ids[:, q_idx], document_ids[:, k_idx]
    return ((dq[:, :, None] == dk[:, None, :]) & (q_idx[:, None] >= k_idx[None, :]))[:, None]


class _Ring:
    """This rank's neighbours in the CP ring and the transfers in flight."""

    def __init__(self):
        self.group = ps.get_context_parallel_group()
        ranks = ps.get_context_parallel_ranks()
        self.size, self.rank = len(ranks), ps.get_context_parallel_rank()
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def shift(self, tensor: torch.Tensor, tag: int):
        """Send `tensor` to the next rank, receive the previous rank's into a new buffer: (buffer, works). The send
        and the receive go out as ONE batch (`batch_isend_irecv`), even ranks sending first and odd ranks receiving
        first, as Transformer Engine's flash_attn_p2p_communicate: at CP = 2 the next and the previous rank are one
        peer, and two separate NCCL calls to it could each wait for the other's match."""
        recv = torch.empty_like(tensor)
        send = dist.P2POp(dist.isend, tensor, self.next, self.group, tag)
        receive = dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)
        return recv, dist.batch_isend_irecv([send, receive] if self.rank % 2 == 0 else [receive, send])


def _wait(works) -> None:
    for w in works:
        w.wait()


def _step_blocks(t: int, ring: _Ring, c: int):
    """(query slice, key slice, causal, source rank) of ring step t (module docstring)."""
    j = (ring.rank - t) % ring.size
    full, first, second = slice(None), slice(0, c), slice(c, 2 * c)
    if t == 0:
        return full, full, True, j
    if j < ring.rank:
        return full, first, False, j
    return second, full, False, j


def _split_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A flat K/V block (or its gradient) as keys and values of k's and v's shapes (v's head dimension may differ:
    multi-latent attention)."""
    return (x.view(like.shape) for x, like in zip(kv.split([k.numel(), v.numel()]), (k, v)))


def _step(t: int, ring: "_Ring", c: int, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor,
          document_ids):
    """Ring step t's blocks (forward and backward alike): the query and key slices, whether the block is causal,
    its document mask (then not causal: the mask says it all), and the held K/V block's keys and values."""
    qs, ks, causal, j = _step_blocks(t, ring, c)
    kb, vb = (x[:, :, ks] for x in _split_kv(kv, k, v))
    mask = None
    if document_ids is not None:
        k_idx = token_indices(q_idx.numel() * ring.size, ring.size, j, q_idx.device)
        mask, causal = _document_mask(document_ids, q_idx[qs], k_idx[ks]), False
    return qs, ks, causal, mask, kb, vb


class _RingAttention(torch.autograd.Function):
    """p2p context-parallel attention (module docstring). q [b, heads, 2c, d]; k, v [b, groups, 2c, d]."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, math_kernel: bool):
        ring = _Ring()
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        seq = q.shape[2] * ring.size
        q_idx = token_indices(seq, ring.size, ring.rank, q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        out = lse = None
        for t in range(ring.size):
            works = []
            if t < ring.size - 1:
                next_kv, works = ring.shift(kv, _KV)
            qs, ks, causal, mask, kb, vb = _step(t, ring, c, kv, k, v, q_idx, document_ids)
            block_out, block_lse = attention_blocks.forward(q[:, :, qs], _repeat(kb, rep), _repeat(vb, rep), causal,
                                                            mask, math_kernel)
            if out is None:
                out, lse = block_out.float(), block_lse
            else:
                out[:, :, qs], lse[:, :, qs] = attention_blocks.merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            _wait(works)
            if t < ring.size - 1:
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.math_kernel = math_kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        ring = _Ring()
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        seq = q.shape[2] * ring.size
        q_idx = token_indices(seq, ring.size, ring.rank, q.device)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the accumulator of the block held
        dkv_works = []
        for t in range(ring.size):
            kv_works = []
            if t < ring.size - 1:
                next_kv, kv_works = ring.shift(kv, _KV)
            qs, ks, causal, mask, kb, vb = _step(t, ring, c, kv, k, v, q_idx, document_ids)
            dq_b, dk_b, dv_b = attention_blocks.backward(dout[:, :, qs], q[:, :, qs], _repeat(kb, rep), _repeat(vb, rep),
                                                         out[:, :, qs], lse[:, :, qs], causal, mask, ctx.math_kernel)
            dq[:, :, qs] += dq_b.float()
            if t > 0:  # the accumulator of this block, from the previous rank
                _wait(dkv_works)
                dkv = next_dkv
            dk_acc, dv_acc = _split_kv(dkv, k, v)
            dk_acc[:, :, ks] += _sum_groups(dk_b.float(), rep)
            dv_acc[:, :, ks] += _sum_groups(dv_b.float(), rep)
            next_dkv, dkv_works = ring.shift(dkv, _DKV)  # on to the next rank (at the last step: the owner)
            _wait(kv_works)
            if t < ring.size - 1:
                kv = next_kv
        _wait(dkv_works)
        dk, dv = (x.to(k.dtype) for x in _split_kv(next_dkv, k, v))
        return dq.to(q.dtype), dk, dv, None, None


def _all_gather_attention(q, k, v, document_ids):
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
    seq = 2 * c * cp
    # K and V of every CP rank in the sequence's order, as one gather of [K | V] (MLA's V head dim differs from
    # K's); the backward sums each rank's share of dK/dV over the ranks
    kv = gather_from_context_parallel_region(torch.cat([k, v], dim=-1), -2, True)
    k_all, v_all = (_repeat(t, rep) for t in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
    q_idx = token_indices(seq, cp, rank, q.device)
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):  # each query chunk sees the keys up to its end
        end = (chunk + 1) * c
        rows = q_idx[half * c:(half + 1) * c]
        keys = torch.arange(end, device=q.device)
        if document_ids is None:
            mask = (rows[:, None] >= keys[None, :])
        else:
            mask = _document_mask(document_ids, rows, keys)
        outs.append(F.scaled_dot_product_attention(q[:, :, half * c:(half + 1) * c], k_all[:, :, :end],
                                                   v_all[:, :, :end], attn_mask=mask))
    return torch.cat(outs, dim=2)


@runs_eagerly  # collectives and isend/irecv: between the graphs of a compiled layer (--torch-compile)
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None,
                               comm_type: str = "p2p", math_kernel: bool = False) -> torch.Tensor:
    """softmax(QKᵀ/√d)V, causal over the whole sequence (and within documents when `document_ids` [b, s] of the
    whole sequence are given), of this CP rank's queries q [b, heads, 2c, d] against every rank's keys and values
    k, v [b, groups, 2c, d] (module docstring). `math_kernel`: the explicit fp32 softmax for the ring's blocks
    (--attention-backend local/unfused)."""
    if comm_type in ("allgather", "all_gather"):  # Megatron's spelling, and the one with an underscore
        return _all_gather_attention(q, k, v, document_ids)
    return _RingAttention.apply(q, k, v, document_ids, math_kernel)
