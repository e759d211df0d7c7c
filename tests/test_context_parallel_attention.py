"""Context-parallel attention (models/context_parallel_attention.py) equals the attention of the whole sequence.

Every CP rank builds the same whole-sequence q, k, v and output gradient (one seed), runs the split attention
on its two chunks (data/context_split.py) and compares its rows of the output and its rows of dq, dk, dv with
F.scaled_dot_product_attention over the whole sequence (causal, or the document mask of
--reset-attention-mask with a boundary inside a chunk and one on a chunk border). fp32; the blocks' merge
and the ring's fp32 accumulation change the order of sums only: rtol 1e-5, atol 5e-6 (values ~1).
Also: the load-balanced split itself, a block whose mask leaves a row without keys, and the rank layout and
process groups (TP fastest, then CP, DP, PP; gradients over DP x CP).
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed

from megatron_po import parallel_state as ps
from megatron_po.data.context_split import split_batch, token_indices
from megatron_po.data.document_masks import document_causal_mask
from megatron_po.models import attention_blocks
from megatron_po.models.context_parallel_attention import context_parallel_attention

B, HEADS, D = 2, 4, 8


def _whole(seq, groups, documents, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HEADS, seq, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, groups, seq, D, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(B, HEADS, seq, D, generator=g, dtype=dtype)
    doc = None
    if documents:  # row 0: boundaries inside chunks and on a chunk border; row 1: one document
        doc = torch.zeros(B, seq, dtype=torch.long)
        for start in (seq // 8 + 1, seq // 2, 3 * seq // 4 + 1):
            doc[0, start:] += 1
    return q, k, v, dout, doc


def _reference(q, k, v, dout, doc):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = HEADS // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if doc is None:
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=document_causal_mask(doc))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _split_attention(seq, groups, documents, comm_type, math_kernel):
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    q, k, v, dout, doc = _whole(seq, groups, documents)
    idx = token_indices(seq, cp, rank)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, doc, comm_type, math_kernel=math_kernel)
    out.backward(dout[:, :, idx])
    ref = _reference(q, k, v, dout, doc)
    for name, mine, full in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad), ref):
        torch.testing.assert_close(mine, full[:, :, idx], rtol=1e-5, atol=5e-6, msg=lambda m: f"{name}: {m}")
    return True


CASES = [  # cp, seq, K/V groups, documents, comm type, math kernel
    (2, 16, 4, False, "p2p", False),
    (4, 32, 4, False, "p2p", False),
    (2, 16, 2, True, "p2p", False),  # GQA: 2 groups travel, repeated to 4 heads where computed
    (4, 32, 1, True, "p2p", False),  # MQA with documents
    (4, 32, 2, True, "p2p", True),  # the explicit fp32 kernel (--attention-backend local)
    (2, 16, 2, False, "all_gather", False),
    (4, 32, 1, True, "all_gather", False),
]


@pytest.mark.parametrize("cp,seq,groups,documents,comm_type,math_kernel", CASES,
                         ids=[f"cp{c[0]}-g{c[2]}{'-docs' if c[3] else ''}-{c[4]}{'-math' if c[5] else ''}"
                              for c in CASES])
def test_split_attention_equals_whole_sequence(cp, seq, groups, documents, comm_type, math_kernel):
    assert all(run_distributed(partial(_split_attention, seq, groups, documents, comm_type, math_kernel), cp, cp=cp))


def test_load_balanced_split_gives_rank_i_chunks_i_and_its_mirror():
    assert token_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert token_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(sum((token_indices(24, 3, r).tolist() for r in range(3)), [])) == list(range(24))
    tokens = torch.arange(16).view(2, 8)
    mask = torch.tensor([[1.0] * 8, [1.0] * 4 + [0.0] * 4])
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": mask, "document_ids": torch.zeros(2, 8)}
    part = split_batch(batch, 2, 1)
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["labels"].tolist() == [[3, 4, 5, 6], [11, 12, 13, 14]]
    assert part["document_ids"].shape == (2, 8)  # whole: the key blocks' masks need every token's document
    assert float(part["loss_normalizer"]) == 12 / 2  # the micro-batch's loss tokens / CP


def test_block_kernel_gives_empty_rows_no_weight():
    """A query row that the mask leaves without keys in a block: out 0, lse -inf (the CPU kernel says 0),
    so the merge ignores the block; with the math kernel likewise."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    for math_kernel in (False, True):
        out, lse = attention_blocks.forward(q, k, v, mask=mask, math_kernel=math_kernel)
        assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8)) and torch.isinf(lse[:, :, 1]).all()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out[:, :, [0, 2, 3]], ref[:, :, [0, 2, 3]], rtol=1e-5, atol=1e-6)


def test_rank_layout_is_tp_then_cp_then_dp_then_pp():
    """Megatron's order: TP fastest, then CP, then DP, then PP (parallel_state.rank_of / coords_of)."""
    from megatron_po.parallel_state import context_parallel_rank_of, coords_of, rank_of
    tp, cp, dp, pp = 2, 2, 3, 2
    seen = set()
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    r = rank_of(t, d, p, tp, dp, c, cp)
                    assert coords_of(r, tp, dp, cp) == (t, d, p) and context_parallel_rank_of(r, tp, cp) == c
                    seen.add(r)
    assert seen == set(range(tp * cp * dp * pp))
    assert [rank_of(0, 0, 0, tp, dp, c, cp) for c in range(cp)] == [0, 2]  # a CP ring: TP ranks apart
    assert rank_of(0, 1, 0, tp, dp, 0, cp) == 4 and rank_of(0, 0, 1, tp, dp, 0, cp) == 12


def _groups():
    return (ps.get_context_parallel_ranks(), ps.get_data_parallel_ranks(),
            ps.get_data_parallel_ranks(with_context_parallel=True), ps.get_pipeline_model_parallel_ranks(),
            ps.get_data_parallel_world_size(with_context_parallel=True), ps.get_data_parallel_rank(with_context_parallel=True))


def test_process_groups_at_tp2_cp2_dp2():
    """Rank 5 = (TP 1, CP 0, DP 1): its CP ring {5, 7}, its DP group {1, 5}, DP x CP {1, 3, 5, 7} (gradients), and
    its rank there, DP rank x CP + CP rank."""
    results = run_distributed(_groups, 8, tp=2, cp=2)
    cp_ranks, dp_ranks, dp_cp_ranks, pp_ranks, size, rank = results[5]
    assert (cp_ranks, dp_ranks, dp_cp_ranks, pp_ranks) == ((5, 7), (1, 5), (1, 3, 5, 7), (5,))
    assert (size, rank) == (4, 2) and results[7][5] == 3 and results[0][5] == 0


def _ring_transfers(cp_size):
    """The ring's p2p calls on this rank while the split attention runs forward and backward: every batch
    given to batch_isend_irecv as [(op, peer)], and the isend/irecv issued outside a batch."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    batches, loose = [], []
    batch, isend, irecv = dist.batch_isend_irecv, dist.isend, dist.irecv
    in_batch = [False]

    def record_batch(ops):
        batches.append([("isend" if op.op is dist.isend else "irecv", op.peer) for op in ops])
        in_batch[0] = True
        try:
            return batch(ops)
        finally:
            in_batch[0] = False

    def loose_call(fn, name):
        def call(*args, **kwargs):
            if not in_batch[0]:
                loose.append(name)
            return fn(*args, **kwargs)
        return call
    dist.batch_isend_irecv = record_batch
    # P2POp accepts only the isend/irecv that distributed_c10d names: both spellings get the counting ones
    dist.isend = c10d.isend = loose_call(isend, "isend")
    dist.irecv = c10d.irecv = loose_call(irecv, "irecv")
    try:
        _split_attention(8 * cp_size, 2, False, "p2p", False)
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = batch, isend, irecv
        c10d.isend, c10d.irecv = isend, irecv
    ranks = ps.get_context_parallel_ranks()
    me = ps.get_context_parallel_rank()
    return batches, loose, ranks[(me + 1) % cp_size], ranks[(me - 1) % cp_size], me


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_exchange_is_one_batched_send_and_receive(cp):
    """Every ring step's exchange (K/V forward and backward, dK/dV accumulators) is ONE batch_isend_irecv of a send
    to the next rank and a receive from the previous, even ranks sending first (Transformer Engine's order), and
    no isend/irecv goes out alone: at CP = 2 the two neighbours are one peer, and two separate NCCL calls to it
    can deadlock. The numbers stay those of the whole-sequence attention (checked inside)."""
    for batches, loose, nxt, prev, me in run_distributed(_ring_transfers, cp, cp=cp, args=(cp,)):
        assert not loose
        # forward: CP - 1 K/V shifts; backward: CP - 1 K/V shifts and CP accumulator shifts
        assert len(batches) == (cp - 1) + (cp - 1) + cp
        send, receive = ("isend", nxt), ("irecv", prev)
        assert all(b == ([send, receive] if me % 2 == 0 else [receive, send]) for b in batches), batches
