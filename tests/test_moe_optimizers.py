"""Optimizers over expert shards (issue 48 item 4).

- The distributed optimizer shards the MoE experts over their expert-data-parallel group (the ranks holding
  the same experts), the dense parameters over DP as before: at EP 2 x DP 4 (expert DP 2) each rank's main
  params and optimizer state hold half of its experts. Two steps with clipping always active equal the
  one-process run at the same global batch (the loss, every updated weight, the gradient norm that clipping
  used, which counts every expert once): Adam and Muon, with the reduce-scatter and with the all-reduce of the
  gradients, fp32: losses rtol 1e-5 / atol 1e-6, weights rtol 1e-5 / atol 1e-5 (reduction orders over 4 ranks,
  which Adam's normalisation amplifies in small gradients; see ATOL), the norm rel 1e-5.
- Muon orthogonalises each expert's matrix on its own, each by one owner among the expert-data-parallel ranks
  (and the plain optimizer's replicated state: owners over the same group), giving the one-process step.
- PipeOptim with the distributed optimizer, PP 2 x DP 2 with MoE chunks: each DP rank predicts its shard of
  the experts and the dense weights, and the updated and predicted shards travel in ONE packed all-gather per
  bucket per micro-batch, the expert buckets over their expert-data-parallel group (counted as the dense test in
  tests/test_async_stream.py counts), bitwise equal to the plain optimizer (Adam, Muon), at EP 1 (the experts
  sharded over DP 2) and EP 2 (each expert on one rank: nothing of it to gather).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from moe_harness import BASE, M, SEED, VOCAB, full_grad, microbatches

from megatron_po import parallel_state as ps
from megatron_po.config import Config
from megatron_po.distributed.checkpoint_format import named_parameters_global
from megatron_po.distributed.ddp import DistributedDataParallel, allreduce_sequence_parallel_grads, is_expert
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.optim import build_optimizer
from megatron_po.optim.clip_grads import clip_grad_norm_
from megatron_po.optim.distributed_optimizer import DistributedOptimizer
from megatron_po.optim.muon import optimizer_param_groups
from megatron_po.pipeline.executor import synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.tensor_parallel import model_parallel_seed

STEPS, CLIP, LR, WD = 2, 0.05, 1e-2, 0.1
# Weights: Adam(W) normalises the rounding differences of small gradients (reduction orders over 4 ranks) into
# differences up to 3e-6 (measured, Muon's AdamW part); a wrong step is off by about lr = 1e-2.
ATOL = 1e-5
# No linear biases: the attention key bias has an exactly zero true gradient, whose rounding noise Adam would
# normalise into ±lr steps that differ between reduction orders (tests/test_distributed_optimizer.py).
MODEL = {"moe_grouped_gemm": True}


def cfg_of(**model) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(BASE, **model)
    cfg.training.seed = SEED
    return cfg


def inner(name: str):
    return lambda groups: build_optimizer(name, groups, LR, weight_decay=WD, muon_fp32_matmul_prec="highest")


def reference(name: str, world: int):
    """One process, `STEPS` steps of the global batch (M micro-batches per DP rank x `world` ranks), clipped:
    ([losses], [grad norms], {name: weights})."""
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    net = GPTModel(cfg_of(**MODEL).model, VOCAB, SEED)
    opt = inner(name)(optimizer_param_groups(name, [net], WD))
    n = M * world
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for b in microbatches(n * (step + 1))[n * step:]:
            loss = masked_mean_loss(net(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
            with aux_loss_scale(1.0 / n):
                (loss / n).backward()
            total += loss.item() / n
        losses.append(total)
        norms.append(clip_grad_norm_(list(net.parameters()), CLIP))
        opt.step()
    return losses, norms, {f"model.{k}": p.detach().clone() for k, p in net.named_parameters()}


def sharded_run(name: str, ep: int, reduce_scatter: bool | None, etp: int | None = None):
    """This rank's share of the same steps under DP x EP (x TP) with the distributed optimizer: (losses averaged
    over DP, grad norms, {name: full weights}, (expert elements this rank steps, local expert elements), expert DP)."""
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(ep, etp)
    model_parallel_seed(SEED)
    cfg = cfg_of(**MODEL)
    cfg.parallel.sequence_parallel = ps.get_tensor_model_parallel_world_size() > 1  # MoE with TP needs it
    chunks = build_chunks_for_rank(cfg, VOCAB, 0, 1, 1)
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), bucket_size=3000,
                                  use_distributed_optimizer=True, reduce_scatter=reduce_scatter)
    opt = DistributedOptimizer(inner(name), optimizer_param_groups(name, chunks, WD), ddp, None, CLIP,
                               ps.get_model_parallel_group(), expert_group=ps.get_expert_tensor_model_pipeline_parallel_group())
    owned = []  # Muon: the expert matrices this rank orthogonalised, per step
    if name == "muon":
        orthogonalise = opt.optimizer._orthogonalise_owned

        def counting(group, layout, mine):
            if group.get("experts"):
                owned.append(len(mine))
            return orthogonalise(group, layout, mine)
        opt.optimizer._orthogonalise_owned = counting
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        ddp.zero_grad()
        batches = microbatches(M * dp * (step + 1))[M * dp * step:][d * M:(d + 1) * M]
        loss = synchronous_forward_backward("1f1b", chunks, ddp, batches)
        ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(ddp.params)  # TP: the norms saw only this rank's tokens
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        losses.append(loss.item() / dp)
        norms.append(opt.step().grad_norm)
    weights = {}
    for n, p in named_parameters_global(chunks):
        p.grad = p.detach()  # full_grad gathers `.grad` over the expert ranks: the weights here
        weights[f"model.{n}"] = full_grad(p)
    stepped = sum(piece.end - piece.start for piece in opt.pieces if is_expert(piece.param))
    local = sum(p.numel() for p in ddp.params if is_expert(p))
    return losses, norms, weights, (stepped, local), dist.get_world_size(ps.get_expert_data_parallel_group()), owned


@pytest.mark.parametrize("name,reduce_scatter", [("adam", False), ("adam", True), ("muon", False)],
                         ids=["adam-allreduce", "adam-reduce-scatter", "muon"])
def test_distributed_optimizer_over_expert_shards_equals_one_process(name, reduce_scatter):
    ref_losses, ref_norms, ref_weights = reference(name, 4)
    results = run_distributed(sharded_run, 4, args=(name, 2, reduce_scatter), timeout=240)
    for losses, norms, weights, (stepped, local), edp, _ in results:
        assert edp == 2 and 0 < stepped < local and abs(stepped - local / 2) <= 64 * 4  # half, up to the padding
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for norm, ref in zip(norms, ref_norms):  # clipping was active: every step scaled by CLIP / norm
            assert ref > CLIP and abs(norm - ref) <= 1e-5 * ref, (norms, ref_norms)
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            torch.testing.assert_close(w, ref_weights[k], rtol=1e-5, atol=ATOL, msg=k)
    if name == "muon":  # one owner per expert matrix: the two ranks of each expert-DP group ({0, 2}, {1, 3}) split
        owned = [r[5] for r in results]  # the 3 MoE layers x 4 local experts x 3 matrices (fc1, gate, fc2)
        assert all(len(o) == STEPS for o in owned)
        assert all(a + b == 36 and a > 0 and b > 0 for a, b in zip(owned[0], owned[2]))
        assert all(a + b == 36 and a > 0 and b > 0 for a, b in zip(owned[1], owned[3]))


def test_muon_plain_optimizer_owners_over_expert_data_parallel_ranks():
    """Without the distributed optimizer (replicated state), Muon's owners of the expert matrices are ranks of
    the expert-data-parallel group: at EP 2 x DP 4 the step equals the one-process Muon step."""
    ref_losses, ref_norms, ref_weights = reference("muon", 4)

    def run():
        torch.set_num_threads(1)
        ps.initialize_expert_parallel(2)
        model_parallel_seed(SEED)
        chunks = build_chunks_for_rank(cfg_of(**MODEL), VOCAB, 0, 1, 1)
        ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), bucket_size=3000)
        opt = inner("muon")(optimizer_param_groups("muon", chunks, WD))
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        norms = []
        for step in range(STEPS):
            ddp.zero_grad()
            batches = microbatches(M * dp * (step + 1))[M * dp * step:][d * M:(d + 1) * M]
            synchronous_forward_backward("1f1b", chunks, ddp, batches)
            ddp.finish_grad_sync()
            norms.append(clip_grad_norm_(ddp.params, CLIP, ps.get_model_parallel_group(),
                                         ps.get_expert_tensor_model_pipeline_parallel_group()))
            opt.step()
        weights = {}
        for n, p in named_parameters_global(chunks):
            p.grad = p.detach()
            weights[f"model.{n}"] = full_grad(p)
        return norms, weights

    for norms, weights in run_distributed(run, 4, timeout=240):
        for norm, ref in zip(norms, ref_norms):
            assert abs(norm - ref) <= 1e-5 * ref
        for k, w in weights.items():
            torch.testing.assert_close(w, ref_weights[k], rtol=1e-5, atol=ATOL, msg=k)


def test_expert_biases_get_no_weight_decay_and_adamw_under_muon():
    """Megatron's rule: no decay on biases, the experts' per-expert biases [experts, size] included; Muon takes
    the stacked expert weights (in a group of their own) and leaves their biases to AdamW."""
    net = GPTModel(cfg_of(add_bias_linear=True).model, VOCAB, SEED)
    experts = net.layers[1].mlp.experts
    biases = {id(experts.fc1_bias), id(experts.fc1_gate_bias), id(experts.fc2_bias)}
    weights = {id(experts.fc1), id(experts.fc1_gate), id(experts.fc2)}
    groups = optimizer_param_groups("adam", [net], WD)
    assert biases <= {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert weights <= {id(p) for g in groups if g["weight_decay"] == WD for p in g["params"]}
    muon = optimizer_param_groups("muon", [net], WD)
    assert weights <= {id(p) for g in muon if g["use_muon"] and g.get("experts") for p in g["params"]}
    assert biases <= {id(p) for g in muon if not g["use_muon"] for p in g["params"]}
    assert not any(is_expert(p) for g in muon if g["use_muon"] and not g.get("experts") for p in g["params"])


# --------------------------------------------------------------------------------------------------
# PipeOptim over expert shards: one packed all-gather per micro-batch
# --------------------------------------------------------------------------------------------------


def _gathers(optimizer: str, ep: int):
    """PP 2 x DP 2 PipeOptim (k = 1) over 8 micro-batches, with and without the distributed optimizer: this
    rank's parameter all-gathers as (calls per gathering bucket, [(bytes, group size)]), and both runs' losses
    and weights."""
    from test_moe_async import train_distributed
    from megatron_po.distributed import ddp as ddp_module
    calls, stages = [], []
    gather = ddp_module.all_gather_single

    def counting(output, input_, group, async_op):
        calls.append((output.numel() * output.element_size(), dist.get_world_size(group)))
        return gather(output, input_, group, async_op)

    args = ("pipeoptim", optimizer, 1, 1, (8,), {}, {})
    plain = train_distributed(*args, ep=ep, mbs=4, masked=False, clip_grad=CLIP)
    ddp_module.all_gather_single = counting
    try:
        sharded = train_distributed(*args, ep=ep, mbs=4, masked=False, clip_grad=CLIP,
                                    precision={"use_distributed_optimizer": True},
                                    on_rank=lambda rank: stages.append(rank.stage))
    finally:
        ddp_module.all_gather_single = gather
    ddp = stages[0].ddps[0]
    gathering = [b for b in ddp.buckets if b.size > 1]
    round_bytes = sum(b.end - b.start for b in gathering) * ddp.param_buffer.element_size()  # each bucket once, 1x
    assert all(n > CLIP for n in stages[0].grad_norms)  # clipping was active at the last step
    return (ps.get_pipeline_model_parallel_rank(), len(calls) / len(gathering), calls, round_bytes,
            sum(b.expert for b in gathering), sum(b.expert for b in ddp.buckets), stages[0].policy.gathers, plain,
            sharded)


@pytest.mark.parametrize("optimizer,ep", [("adam", 1), ("adam", 2), ("muon", 1)])
def test_pipeoptim_gathers_expert_shards_once_per_microbatch(optimizer, ep):
    """Stage 0 (s = 1): 8 rounds over 8 micro-batches, one per micro-batch, each bucket gathered once per round
    (F0, F1 run before the first step: the updates of the last two steps travel alone, the other six with the
    predicted shard packed in, 2x the bytes); stage 1 (s = 0): the updates alone. At EP 1 the expert buckets are
    gathered over their expert-data-parallel group (DP 2); at EP 2 no rank shares an expert: nothing to gather
    there. Losses and weights are those of the plain optimizer, bit for bit, with clipping always active (the
    stage-local norm counts every expert once either way: the plain optimizer's is proven against the emulator
    in tests/test_moe_async.py)."""
    for pp_rank, rounds, calls, round_bytes, gathered_experts, expert_buckets, swaps, plain, sharded in run_distributed(
            _gathers, 4, pp=2, args=(optimizer, ep), timeout=300):
        assert swaps == [True]  # MoE chunks predict by pointer swaps, so the gathers are packed
        assert expert_buckets > 0 and gathered_experts == (expert_buckets if ep == 1 else 0)
        assert rounds == 8 and all(size == 2 for _, size in calls)
        # stage 0: six rounds of 2x (update + prediction) and two of 1x; stage 1: eight of 1x
        assert sum(nbytes for nbytes, _ in calls) == round_bytes * (6 * 2 + 2 if pp_rank == 0 else 8)
        if plain[0] is not None:
            assert sharded[0] == plain[0]
        assert all(torch.equal(sharded[1][n], plain[1][n]) for n in plain[1])
