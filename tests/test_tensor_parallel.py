"""Tensor parallelism reproduces the TP=1 computation.

Pattern: every rank builds the same full tensors from fixed seeds, takes its slice, runs the TP code and
returns its outputs and gradients; the parent process gathers the slices and compares them with plain
single-process torch on the full tensors. fp32 throughout; tolerance rtol = atol = 1e-5 (only summation
order differs), and exact equality where nothing is computed (initialization, RNG masks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_distributed
from torch.testing import assert_close

from megatron_po import parallel_state as ps
from megatron_po.errors import ConfigError
from megatron_po.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tensor_model_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    gather_tensor,
    get_rng_tracker,
    model_parallel_seed,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    shard_tensor,
    vocab_parallel_cross_entropy,
)

TOL = dict(rtol=1e-5, atol=1e-5)
EXACT = dict(rtol=0, atol=0)
S, B, H, FFN, V = 8, 2, 8, 16, 16  # seq, batch, hidden, MLP width, vocab: all divisible by TP=4
SEED = 1234


def _randn(seed, *shape):
    """The same tensor on every rank and in the parent, without touching the global generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tp():
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _run_backward(fn, inp, grad_out):
    """(output, input grad) of fn at inp, with upstream gradient grad_out."""
    inp = inp.clone().requires_grad_()
    out = fn(inp)
    out.backward(grad_out)
    return out.detach(), inp.grad


# --------------------------------------------------------------------------------------------------
# Mappings: each against its definition on the full tensors
# --------------------------------------------------------------------------------------------------


def _mapping_data(tp):
    X, G = _randn(1, S, B, H), _randn(2, S, B, H)
    Xs, Gs = _randn(3, tp, S, B, H), _randn(4, tp, S, B, H)  # different on each rank
    return X, G, Xs, Gs


def _run_mappings():
    tp, r = _tp()
    X, G, Xs, Gs = _mapping_data(tp)
    sh = lambda t, dim: shard_tensor(t, dim, r, tp)  # noqa: E731
    return {
        # replicated X enters a TP region; rank r's consumer sends back its own partial grad Gs[r]
        "copy": _run_backward(copy_to_tensor_model_parallel_region, X, Gs[r]),
        "reduce": _run_backward(reduce_from_tensor_model_parallel_region, Xs[r], G),
        "scatter": _run_backward(scatter_to_tensor_model_parallel_region, X, sh(G, -1)),
        "gather": _run_backward(gather_from_tensor_model_parallel_region, sh(X, -1), G),
        "scatter_sp": _run_backward(scatter_to_sequence_parallel_region, X, sh(G, 0)),
        "gather_sp_tp_grad": _run_backward(gather_from_sequence_parallel_region, sh(X, 0), Gs[r]),
        "gather_sp_replicated_grad": _run_backward(
            lambda x: gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False), sh(X, 0), G),
        "reduce_scatter_sp": _run_backward(reduce_scatter_to_sequence_parallel_region, Xs[r], sh(G, 0)),
    }


def _expected_mappings(tp, r):
    X, G, Xs, Gs = _mapping_data(tp)
    sh = lambda t, dim: shard_tensor(t, dim, r, tp)  # noqa: E731
    return {  # (forward output on rank r, input grad on rank r)
        "copy": (X, Gs.sum(0)),
        "reduce": (Xs.sum(0), G),
        "scatter": (sh(X, -1), G),
        "gather": (X, sh(G, -1)),
        "scatter_sp": (sh(X, 0), G),
        "gather_sp_tp_grad": (X, sh(Gs.sum(0), 0)),
        "gather_sp_replicated_grad": (X, sh(G, 0)),
        "reduce_scatter_sp": (sh(Xs.sum(0), 0), G),
    }


def test_mappings_are_noops_without_tensor_parallelism():
    assert not ps.model_parallel_is_initialized()
    assert_close(_run_mappings(), _expected_mappings(1, 0), **EXACT)


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_and_backward(tp):
    results = run_distributed(_run_mappings, tp, tp=tp)
    for r, got in enumerate(results):
        assert_close(got, _expected_mappings(tp, r), **TOL)


# --------------------------------------------------------------------------------------------------
# Initialization does not depend on the TP size
# --------------------------------------------------------------------------------------------------


def _build_layers():
    """Layers in a fixed order from SEED: the TP=1 model and every TP slice of it draw the same numbers."""
    torch.manual_seed(SEED)
    return {
        "column": ColumnParallelLinear(H, FFN),
        "column_stride2": ColumnParallelLinear(H, FFN, stride=2),  # e.g. fused [gate; up] projections
        "row": RowParallelLinear(FFN, H),
        "embedding": VocabParallelEmbedding(V, H),
    }


def _run_init():
    return {name: {pname: (p.detach(), p.tensor_model_parallel, p.partition_dim, p.partition_stride,
                           param_is_not_tensor_parallel_duplicate(p))
                   for pname, p in layer.named_parameters()}
            for name, layer in _build_layers().items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_init_is_independent_of_tp_size(tp):
    with torch.random.fork_rng():
        full = _build_layers()  # TP=1 in this process
    results = run_distributed(_run_init, tp, tp=tp)
    for name, layer in full.items():
        for pname, p in layer.named_parameters():
            for r, got in enumerate(results):
                shard, is_tp, dim, stride, counted = got[name][pname]
                if is_tp:
                    assert_close(shard, shard_tensor(p.detach(), dim, r, tp, stride), **EXACT)
                else:
                    assert_close(shard, p.detach(), **EXACT)
                # Slices are counted by every rank in a norm, replicated params by TP rank 0 only.
                assert counted == (is_tp or r == 0)
    attrs = {(n, pn): v[1:4] for n, layer in results[0].items() for pn, v in layer.items()}
    assert attrs == {
        ("column", "weight"): (True, 0, 1), ("column", "bias"): (True, 0, 1),
        ("column_stride2", "weight"): (True, 0, 2), ("column_stride2", "bias"): (True, 0, 2),
        ("row", "weight"): (True, 1, 1), ("row", "bias"): (False, -1, 1),
        ("embedding", "weight"): (True, 0, 1),
    }
    # Non-zero draws: comparing zeros with zeros would prove nothing.
    assert full["column"].weight.abs().min() > 0


# --------------------------------------------------------------------------------------------------
# Column -> gelu -> Row (a transformer MLP), with and without sequence parallelism
# --------------------------------------------------------------------------------------------------


def _mlp_data():
    return _randn(10, S, B, H), _randn(11, S, B, H), _randn(12, FFN), _randn(13, H)  # X, dY, b1, b2


def _run_mlp(sequence_parallel):
    tp, r = _tp()
    X, G, b1, b2 = _mlp_data()
    torch.manual_seed(SEED)
    fc1 = ColumnParallelLinear(H, FFN, sequence_parallel=sequence_parallel)
    fc2 = RowParallelLinear(FFN, H, sequence_parallel=sequence_parallel)
    with torch.no_grad():  # non-zero biases, so a misplaced or doubled bias shows
        fc1.bias.copy_(shard_tensor(b1, 0, r, tp))
        fc2.bias.copy_(b2)
    # Sequence parallel: input and output are split along seq (dim 0); otherwise replicated.
    x = shard_tensor(X, 0, r, tp) if sequence_parallel else X
    g = shard_tensor(G, 0, r, tp) if sequence_parallel else G
    x = x.clone().requires_grad_()
    h, _ = fc1(x)
    y, _ = fc2(F.gelu(h))
    y.backward(g)
    # What the grad-sync code does with the attribute: sum partial grads of replicated params over TP.
    for p in (*fc1.parameters(), *fc2.parameters()):
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    out = {"y": y.detach(), "x_grad": x.grad, "fc1_w_grad": fc1.weight.grad, "fc1_b_grad": fc1.bias.grad,
           "fc2_w_grad": fc2.weight.grad, "fc2_b_grad": fc2.bias.grad,
           "fc2_b_sequence_parallel": fc2.bias.sequence_parallel}
    if not sequence_parallel:
        # The other entry/exit points: gathered column output into a row layer that scatters its
        # input, and a bias returned unadded (skip_bias_add) for the caller to add.
        torch.manual_seed(SEED)
        fc1g = ColumnParallelLinear(H, FFN, gather_output=True)
        fc2s = RowParallelLinear(FFN, H, input_is_parallel=False, skip_bias_add=True)
        with torch.no_grad():
            fc1g.bias.copy_(shard_tensor(b1, 0, r, tp))
            fc2s.bias.copy_(b2)
        x2 = X.clone().requires_grad_()
        h_full, none_bias = fc1g(x2)
        assert none_bias is None and h_full.shape == (S, B, FFN)
        y2, bias2 = fc2s(F.gelu(h_full))
        assert bias2 is fc2s.bias
        (y2 + bias2).backward(G)
        out.update(y2=(y2 + bias2).detach(), x2_grad=x2.grad, fc1g_w_grad=fc1g.weight.grad,
                   fc2s_w_grad=fc2s.weight.grad, fc2s_b_grad=fc2s.bias.grad)
    return out


def _mlp_reference():
    """Plain torch on the full TP=1 weights."""
    X, G, b1, b2 = _mlp_data()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        W1 = ColumnParallelLinear(H, FFN).weight.detach()
        W2 = RowParallelLinear(FFN, H).weight.detach()
    params = [t.clone().requires_grad_() for t in (X, W1, b1, W2, b2)]
    x, w1, b1, w2, b2 = params
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(G)
    return {"y": y.detach(), "x_grad": x.grad, "fc1_w_grad": w1.grad, "fc1_b_grad": b1.grad,
            "fc2_w_grad": w2.grad, "fc2_b_grad": b2.grad}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_parallel_mlp(tp, sequence_parallel):
    ref = _mlp_reference()
    results = run_distributed(_run_mlp, tp, tp=tp, args=(sequence_parallel,))
    cat = lambda key, dim: gather_tensor([res[key] for res in results], dim)  # noqa: E731
    if sequence_parallel:  # activations and their grads are split along seq
        assert_close(cat("y", 0), ref["y"], **TOL)
        assert_close(cat("x_grad", 0), ref["x_grad"], **TOL)
    else:  # replicated: every rank holds the full tensor
        for res in results:
            assert_close(res["y"], ref["y"], **TOL)
            assert_close(res["x_grad"], ref["x_grad"], **TOL)
    assert_close(cat("fc1_w_grad", 0), ref["fc1_w_grad"], **TOL)
    assert_close(cat("fc1_b_grad", 0), ref["fc1_b_grad"], **TOL)
    assert_close(cat("fc2_w_grad", 1), ref["fc2_w_grad"], **TOL)
    for res in results:  # replicated row bias: full grad on every rank (after the SP all-reduce)
        assert res["fc2_b_sequence_parallel"] is sequence_parallel
        assert_close(res["fc2_b_grad"], ref["fc2_b_grad"], **TOL)
    if not sequence_parallel:
        for res in results:
            assert_close(res["y2"], ref["y"], **TOL)
            assert_close(res["x2_grad"], ref["x_grad"], **TOL)
            assert_close(res["fc2s_b_grad"], ref["fc2_b_grad"], **TOL)
        assert_close(cat("fc1g_w_grad", 0), ref["fc1_w_grad"], **TOL)
        assert_close(cat("fc2s_w_grad", 1), ref["fc2_w_grad"], **TOL)


def test_layer_argument_checks():
    with pytest.raises(ValueError):
        ColumnParallelLinear(H, FFN, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError):
        RowParallelLinear(FFN, H, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ConfigError):
        divide(10, 4)


# --------------------------------------------------------------------------------------------------
# Vocab-parallel embedding, tied output layer and cross entropy: a miniature GPT head
# --------------------------------------------------------------------------------------------------


def _embedding_data():
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(20)).view(B, S)  # every id: all shards
    targets = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(21))
    return ids, targets, _randn(22, B, S, H), _randn(23, S, B)  # ids, targets, dEmb, dLoss


def _run_embedding(sequence_parallel):
    tp, r = _tp()
    ids, targets, G, loss_grad = _embedding_data()
    torch.manual_seed(SEED)
    emb = VocabParallelEmbedding(V, H, reduce_scatter_embeddings=sequence_parallel)
    # The output layer shares the embedding's [V/tp, H] slice (skip_weight_param_allocation).
    head = ColumnParallelLinear(H, V, bias=False, skip_weight_param_allocation=True,
                                sequence_parallel=sequence_parallel)
    e = emb(ids)  # [B, S, H] replicated, or [S/tp, B, H] with reduce_scatter_embeddings
    (e_plain,) = torch.autograd.grad(e, emb.weight, shard_tensor(G.transpose(0, 1), 0, r, tp)
                                     if sequence_parallel else G, retain_graph=True)
    hidden = e if sequence_parallel else e.transpose(0, 1)  # [s, b, h] from here on
    logits, _ = head(hidden, weight=emb.weight)  # [S, B, V/tp]
    loss = vocab_parallel_cross_entropy(logits, targets)
    loss.backward(loss_grad)
    return {"emb": e.detach(), "emb_w_grad": e_plain, "loss": loss.detach(), "w_grad": emb.weight.grad}


def _embedding_reference():
    ids, targets, G, loss_grad = _embedding_data()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        W = VocabParallelEmbedding(V, H).weight.detach().clone().requires_grad_()
    e = F.embedding(ids, W)
    (e_plain,) = torch.autograd.grad(e, W, G, retain_graph=True)
    logits = F.linear(e.transpose(0, 1), W)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(S, B)
    loss.backward(loss_grad)
    return {"emb": e.detach(), "emb_w_grad": e_plain, "loss": loss.detach(), "w_grad": W.grad}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_tied_head_and_loss(tp, sequence_parallel):
    ref = _embedding_reference()
    results = run_distributed(_run_embedding, tp, tp=tp, args=(sequence_parallel,))
    cat = lambda key, dim: gather_tensor([res[key] for res in results], dim)  # noqa: E731
    if sequence_parallel:  # reduce-scattered along seq, in [s, b, h]
        assert_close(cat("emb", 0), ref["emb"].transpose(0, 1), **TOL)
    for res in results:
        if not sequence_parallel:
            assert_close(res["emb"], ref["emb"], **TOL)
        assert_close(res["loss"], ref["loss"], **TOL)
    assert_close(cat("emb_w_grad", 0), ref["emb_w_grad"], **TOL)
    # Gradient through both uses of the tied weight: lookup and output projection.
    assert_close(cat("w_grad", 0), ref["w_grad"], **TOL)


def _ce_data():
    logits = 3 * _randn(30, S, B, V)
    targets = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(31))
    return logits, targets, _randn(32, S, B)


def _run_cross_entropy():
    tp, r = _tp()
    full_logits, targets, loss_grad = _ce_data()
    out = {}
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    for smoothing in (0.0, 0.1):
        logits = shard_tensor(full_logits, -1, r, tp).requires_grad_()
        before = logits.detach().clone()
        calls.clear()
        dist.all_reduce = counting_all_reduce
        try:
            loss = vocab_parallel_cross_entropy(logits, targets, label_smoothing=smoothing)
        finally:
            dist.all_reduce = all_reduce
        loss.backward(loss_grad)
        assert torch.equal(logits.detach(), before), "the caller's logits were modified"
        out[smoothing] = (loss.detach(), logits.grad, len(calls))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy(tp):
    full_logits, targets, loss_grad = _ce_data()
    results = [_run_cross_entropy()] if tp == 1 else run_distributed(_run_cross_entropy, tp, tp=tp)
    for smoothing in (0.0, 0.1):
        x = full_logits.clone().requires_grad_()
        ref = F.cross_entropy(x.view(-1, V), targets.view(-1), reduction="none",
                              label_smoothing=smoothing).view(S, B)
        ref.backward(loss_grad)
        for loss, _, n_all_reduce in (res[smoothing] for res in results):
            assert_close(loss, ref.detach(), **TOL)
            assert n_all_reduce == (0 if tp == 1 else 3)  # max, target logit (+ smoothing sum), sum-exp
        assert_close(gather_tensor([res[smoothing][1] for res in results], -1), x.grad, **TOL)


# --------------------------------------------------------------------------------------------------
# Random streams
# --------------------------------------------------------------------------------------------------


def _dropout_mask(n=4096):
    return F.dropout(torch.ones(n), p=0.5) != 0


def _run_rng():
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    model_parallel_seed(SEED)
    tracker = get_rng_tracker()
    default_1 = _dropout_mask()
    states = tracker.get_states()
    with tracker.fork():
        forked = _dropout_mask()
    default_2 = _dropout_mask()
    tracker.set_states(states)  # a checkpoint restore replays the same forked stream
    with tracker.fork():
        forked_replay = _dropout_mask()
    return tp_rank, pp_rank, default_1, default_2, forked, forked_replay


def test_rng_tracker_streams():
    # world 4 = TP 2 x PP 2: ranks 0,1 are stage 0 and ranks 2,3 stage 1.
    results = run_distributed(_run_rng, 4, tp=2, pp=2)
    for tp_rank, pp_rank, default_1, default_2, forked, forked_replay in results:
        with torch.random.fork_rng():
            # Default stream = seed + 100 * pp_rank, and forked draws do not consume it.
            torch.manual_seed(SEED + 100 * pp_rank)
            assert torch.equal(default_1, _dropout_mask())
            assert torch.equal(default_2, _dropout_mask())
            torch.manual_seed(SEED + 100 * pp_rank + 2718 + tp_rank)
            assert torch.equal(forked, _dropout_mask())
        assert torch.equal(forked_replay, forked)
    by_rank = {(t, p): res for t, p, *res in results}
    for p in (0, 1):  # within a TP group: replicated dropout matches, split-region dropout differs
        assert torch.equal(by_rank[0, p][0], by_rank[1, p][0])
        assert not torch.equal(by_rank[0, p][2], by_rank[1, p][2])
    assert not torch.equal(by_rank[0, 0][0], by_rank[0, 1][0])  # stages differ


def test_rng_tracker_rejects_duplicates_and_unknown_names():
    tracker = type(get_rng_tracker())()
    tracker.add("a", 1)
    with pytest.raises(ValueError):
        tracker.add("b", 1)
    with pytest.raises(ValueError):
        tracker.add("a", 2)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass


def _block(x):
    y = F.dropout(x.sin(), p=0.5)  # replicated activation: default stream
    with get_rng_tracker().fork():  # TP-split region: tracker stream
        return F.dropout(y * 2, p=0.5)


def test_checkpoint_recomputes_both_random_streams():
    x, g = _randn(40, 256), _randn(41, 256)

    def run(wrapper):
        model_parallel_seed(SEED)
        inp = x.clone().requires_grad_()
        out = wrapper(_block, inp)
        out.backward(g)
        return out.detach(), inp.grad, torch.get_rng_state(), get_rng_tracker().get_states()

    with torch.random.fork_rng():
        y_ref, grad_ref, default_ref, tracker_ref = run(lambda f, a: f(a))
        y, grad, default, tracker = run(checkpoint)
        # torch's checkpoint alone replays only the default stream: the forked mask changes.
        _, grad_plain, _, _ = run(lambda f, a: torch.utils.checkpoint.checkpoint(f, a, use_reentrant=False))
    get_rng_tracker().reset()
    assert_close(y, y_ref, **EXACT)
    assert_close(grad, grad_ref, **EXACT)
    assert not torch.equal(grad_plain, grad_ref)
    # The recomputation leaves both streams where an uncheckpointed run leaves them.
    assert torch.equal(default, default_ref)
    assert torch.equal(tracker["model-parallel-rng"], tracker_ref["model-parallel-rng"])


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128, 1) == 50304  # GPT-2
    assert pad_vocab_size(50257, 128, 2) == 50432  # multiple of 256
    assert pad_vocab_size(50257, 128, 8) == 51200  # multiple of 1024
    assert pad_vocab_size(32000, 128, 4) == 32256  # multiple of 512
    assert pad_vocab_size(32768, 128, 4) == 32768  # already a multiple: unchanged


def test_shard_and_gather_tensor():
    full = torch.arange(8)
    assert shard_tensor(full, 0, 1, 2).tolist() == [4, 5, 6, 7]
    # stride 2: cut into 4 chunks, rank r holds chunks r and r + 2
    assert shard_tensor(full, 0, 0, 2, stride=2).tolist() == [0, 1, 4, 5]
    assert shard_tensor(full, 0, 1, 2, stride=2).tolist() == [2, 3, 6, 7]
    m = torch.arange(48).view(4, 12)
    for world, stride, dim in [(2, 1, 1), (3, 2, 1), (4, 1, 0), (2, 2, 0)]:
        shards = [shard_tensor(m, dim, r, world, stride) for r in range(world)]
        assert torch.equal(gather_tensor(shards, dim, stride), m)
