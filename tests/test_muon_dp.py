"""Muon over data-parallel ranks (optim/muon_dp.py): every matrix is orthogonalised exactly once per step across
the DP ranks (counted), the work is balanced, the collectives per step are the ones the design names, and
DP=2 (plain and distributed optimizer) and TP=2 x DP=2 train like DP=1.

The model is the tiny Llama-style GPT with grouped-query attention (tests/test_gpt_parallel.py "llama-gqa":
2 layers, each with a fused QKV weight split into Q, K and V, the output projection and SwiGLU's three
matrices: 7 Newton-Schulz matrices per layer, 14 per step), fp32 Newton-Schulz for the equivalences.
Tolerance DP=2 / TP=2 x DP=2 vs DP=1: rtol 1e-4, atol 1e-6 on the weights after 3 steps (the DP mean
and the TP partial sums round differently from one process's sums; Newton-Schulz amplifies the difference
along U's smallest singular directions; measured max abs difference 6e-8 on the Muon matrices, 8e-7 on the
AdamW part, whose m/√v normalises rounding noise in tiny gradients).
"""

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from megatron_po import parallel_state as ps
from megatron_po.optim.muon_dp import assign_owners

NS_MATRICES_PER_STEP = 14
TOL = dict(rtol=1e-4, atol=1e-6)


def test_owners_are_balanced_largest_first():
    costs = [10.0, 9.0, 8.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    owners = assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert owners[:3] == [0, 1, 1] and sorted(loads) == [17.0, 17.0]
    assert assign_owners(costs, 1) == [0] * len(costs)
    owners = assign_owners([5.0] * 3, 4)  # more ranks than matrices: some own nothing
    assert sorted(owners) == [0, 1, 2]


def train_step(model, ddp, opt, step):
    """Global batch of 8 samples in 4 micro-batches of 2; DP rank d runs micro-batches d·4/DP ..., each loss
    divided by this rank's micro-batch count, and DDP averages over DP: the same mean at every DP size."""
    from test_gpt_parallel import make_batch

    from megatron_po.distributed.ddp import allreduce_sequence_parallel_grads
    from megatron_po.models.gpt import masked_mean_loss
    from megatron_po.optim.mixed_precision import MainParamsOptimizer
    batch = make_batch(n=8, seed=step)
    d, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = [{k: v[2 * m:2 * m + 2] for k, v in batch.items()} for m in range(4)][d * 4 // dp:(d + 1) * 4 // dp]
    ddp.zero_grad()
    for m, mb in enumerate(mine):
        loss = masked_mean_loss(model(input_ids=mb["tokens"], labels=mb["labels"]), mb["loss_mask"]) / len(mine)
        if m < len(mine) - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    ddp.finish_grad_sync()
    allreduce_sequence_parallel_grads(ddp.params)  # the q/k norms' gradients are partial sums over TP
    if isinstance(opt, MainParamsOptimizer):
        assert not opt.step().skipped
    else:
        opt.step()


def _train(kind, steps=3, precision="highest"):
    """kind: "plain" (DDP + Muon), "sharded" (the distributed optimizer). Returns per step the Newton-Schulz
    matrices this rank ran and the Muon collectives it called (name, group size, bytes sent), and the
    weights with TP slices gathered into whole tensors."""
    from test_distributed_optimizer import BUCKET
    from test_gpt_parallel import CONFIGS, SEED, VOCAB

    import megatron_po.optim.muon as muon
    import megatron_po.optim.muon_dp as muon_dp
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.models.gpt import GPTModel
    from megatron_po.optim import build_optimizer
    from megatron_po.optim.distributed_optimizer import DistributedOptimizer
    from megatron_po.tensor_parallel import model_parallel_seed

    ns_calls, collectives = [], []
    newton_schulz, all_to_all, gather_dp, gather_tp = (muon.newton_schulz, dist.all_to_all_single,
                                                       muon_dp.all_gather_single, muon.all_gather_single)

    def counting_ns(u, *args, **kwargs):
        ns_calls.append(u.shape[0] if u.ndim == 3 else 1)
        return newton_schulz(u, *args, **kwargs)

    def logged(name, fn, elements):  # bytes: what this rank contributes for the other ranks
        def call(*args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            collectives.append((name, dist.get_world_size(group), elements(group, *args) * args[1].element_size()))
            return fn(*args, **kwargs)
        return call
    muon.newton_schulz = counting_ns
    dist.all_to_all_single = logged("all_to_all", all_to_all,
                                    lambda group, out, inp, out_splits, in_splits: inp.numel() -
                                    in_splits[dist.get_rank(group)])
    muon_dp.all_gather_single = logged("all_gather DP", gather_dp, lambda group, out, inp, *a: inp.numel())
    muon.all_gather_single = logged("all_gather TP", gather_tp, lambda group, out, inp, *a: inp.numel())
    try:
        model_parallel_seed(SEED)
        model = GPTModel(CONFIGS["llama-gqa"], VOCAB, SEED)
        ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), bucket_size=BUCKET,
                                      grad_dtype=torch.float32, use_distributed_optimizer=kind == "sharded")
        groups = muon.optimizer_param_groups("muon", [model], 0.1)

        def factory(g):
            return build_optimizer("muon", g, lr=0.02, weight_decay=0.1, muon_fp32_matmul_prec=precision)
        if kind == "sharded":
            opt = DistributedOptimizer(factory, groups, ddp, model_parallel_group=ps.get_model_parallel_group())
        else:
            opt = factory(groups)
        per_step = []
        for s in range(steps):
            n_ns, n_coll = len(ns_calls), len(collectives)
            train_step(model, ddp, opt, s)
            per_step.append((sum(ns_calls[n_ns:]), collectives[n_coll:]))
        if kind == "sharded":
            opt.finish_param_sync()
    finally:
        muon.newton_schulz, dist.all_to_all_single = newton_schulz, all_to_all
        muon_dp.all_gather_single, muon.all_gather_single = gather_dp, gather_tp
    weights = {}
    tp = ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        w = p.detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(w) for _ in range(tp)]
            dist.all_gather(parts, w.contiguous(), group=ps.get_tensor_model_parallel_group())
            w = torch.cat(parts, dim=p.partition_dim)
        weights[name] = w
    return ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank(), per_step, weights


@pytest.fixture(scope="module")
def dp1():
    return run_distributed(_train, 1, args=("plain",))[0]


@pytest.mark.parametrize("kind,world,tp", [("plain", 2, 1), ("sharded", 2, 1), ("sharded", 4, 2)],
                         ids=["dp2-plain", "dp2-sharded", "tp2-dp2-sharded"])
def test_each_matrix_orthogonalised_once_per_step_and_equal_to_dp1(kind, world, tp, dp1):
    assert all(ns == NS_MATRICES_PER_STEP and not coll for ns, coll in dp1[2])  # DP=1: all of them, no collective
    results = run_distributed(_train, world, tp=tp, args=(kind,))
    for step in range(3):
        for tp_rank in range(tp):  # per TP rank: the DP ranks share the matrices out, once each
            shares = [r[2][step][0] for r in results if r[1] == tp_rank]
            assert sum(shares) == NS_MATRICES_PER_STEP and min(shares) >= 5, shares  # balanced: 7 +- 2 each
        for dp_rank, tp_rank, per_step, _ in results:
            names = sorted(name for name, _, _ in per_step[step][1])
            expected = ["all_gather DP"] if kind == "plain" else ["all_to_all", "all_to_all"]
            assert names == sorted(expected + (["all_gather TP"] if tp > 1 else [])), names
    for dp_rank, tp_rank, _, weights in results:
        assert weights.keys() == dp1[3].keys()
        for name in weights:
            torch.testing.assert_close(weights[name], dp1[3][name], **TOL,
                                       msg=lambda m: f"dp {dp_rank} tp {tp_rank} {name}: {m}")


def test_sharded_moves_less_than_the_old_bucket_gather():
    """DP=2, distributed optimizer, bf16 Newton-Schulz: U pieces go to their owners in fp32 and O pieces
    come back in bf16; the old scheme all-gathered every Muon bucket's fp32 U (each rank sent 4 bytes per
    element of its owned ranges, i.e. half the Muon buckets)."""
    results = run_distributed(_train, 2, args=("sharded", 1, "medium"))
    from test_gpt_parallel import CONFIGS, SEED, VOCAB

    from megatron_po.models.gpt import GPTModel
    matrices = sum(p.numel() for n, p in GPTModel(CONFIGS["llama-gqa"], VOCAB, SEED).named_parameters()
                   if p.ndim == 2 and "embedding" not in n and "output_layer" not in n)
    for _, _, per_step, _ in results:
        sent = {name: b for name, _, b in per_step[0][1]}
        assert [name for name, _, _ in per_step[0][1]] == ["all_to_all", "all_to_all"]
        total = sum(b for _, _, b in per_step[0][1])
        assert 0 < total < 4 * matrices / 2, (sent, matrices)
