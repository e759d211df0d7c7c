"""A MoE GPT under expert parallelism, composed with tensor (sequence), data and pipeline parallelism, equals
the one-process model at the same global batch: the mean loss and every parameter's gradient (experts gathered
from their EP and expert-TP ranks), fp32, rtol=1e-5 / atol=1e-6 (reduction orders only), and the routers'
records summed over the ranks: the same tokens per expert and, with a capacity, the same dropped tokens.

Layouts: EP = 2 and 4 (alltoall and allgather dispatchers), EP x DP (expert data parallel 2), EP x TP with
expert TP = TP and with expert TP 1 (experts whole, EP spanning the TP ranks; there with the shared experts'
sigmoid gate, --moe-shared-expert-gate, whose gradient each sequence-parallel rank takes over its own tokens), EP x PP under 1F1B, interleaved
1F1B, ZB-H1, ZB-H2 and ZB-V (its two chunks in a V, the loss on rank 0), EP x CP (context parallelism: experts carved out of DP x CP, the router gathering the whole
sequence over CP), with TP and DP; dropless and with a capacity (both drop policies, padded or not).
"""

import pytest
import torch
from dist_harness import run_distributed
from moe_harness import M, check_equal, distributed_run, reference

from megatron_po.errors import ConfigError
from megatron_po.parallel_state import expert_layout

CAPACITY = {"moe_expert_capacity_factor": 1.0}


def test_expert_layout_is_megatrons():
    """A stage of TP 2 x DP 4 (ranks 0-7, TP fastest) read as expert TP x EP x expert DP. With expert TP = TP
    an EP group is EP consecutive data-parallel ranks of one TP coordinate (DP ranks of tp 0: 0, 2, 4, 6)."""
    layout = expert_layout(list(range(8)), etp=2, ep=2)
    assert layout["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["dispatch"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    whole = expert_layout(list(range(8, 12)), etp=1, ep=4)  # experts whole, EP over TP and DP ranks of stage 2
    assert whole["ep"] == [[8, 9, 10, 11]] and whole["edp"] == [[8], [9], [10], [11]]
    with pytest.raises(ConfigError, match="does not divide the 8 ranks"):
        expert_layout(list(range(8)), etp=1, ep=3)


def _experts_at_each_ep():
    """Per EP size 1, 2, 4 on these 4 ranks: (this rank's expert weights {name: tensor} with their first expert,
    the elements the build drew from a normal distribution, the local expert elements)."""
    from megatron_po import parallel_state as ps
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    from megatron_po.pipeline.partition import build_chunks_for_rank
    from megatron_po.tensor_parallel import model_parallel_seed
    from moe_harness import SEED, VOCAB, make_cfg
    out = {}
    normal = torch.Tensor.normal_
    for ep in (1, 2, 4):
        ps.initialize_expert_parallel(ep)
        model_parallel_seed(SEED)
        drawn = [0]

        def counting(self, *args, **kwargs):
            drawn[0] += self.numel()
            return normal(self, *args, **kwargs)
        torch.Tensor.normal_ = counting
        try:
            chunks = build_chunks_for_rank(make_cfg(), VOCAB, 0, 1, 1)
        finally:
            torch.Tensor.normal_ = normal
        experts = {f"model.{n}": p.detach() for n, p in named_parameters_global(chunks) if ".experts." in n}
        out[ep] = (experts, 8 // ep * ps.get_expert_model_parallel_rank(), drawn[0],
                   sum(p.numel() for p in experts.values()))
    return out


def test_each_rank_draws_only_its_experts_the_same_at_any_ep():
    """The experts' weights of EP 1, 2 and 4 are the slices of the one-process model's (seeded per expert), and a
    rank draws and holds only its own experts: what the build draws drops by the other ranks' experts exactly
    (8 experts in 3 MoE layers, fc1, gate and fc2 of 32 x 32 each), so a 256-expert layer is never materialized
    whole on a rank."""
    from moe_harness import SEED, VOCAB, make_cfg
    from megatron_po.models.gpt import GPTModel
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(SEED)
    whole = {f"model.{n}": p.detach() for n, p in GPTModel(make_cfg().model, VOCAB, SEED).named_parameters()}
    per_expert = 3 * 3 * 32 * 32  # 3 MoE layers x (fc1, gate, fc2) of one expert
    for rank in run_distributed(_experts_at_each_ep, 4):
        for ep, (experts, first, drawn, held) in rank.items():
            local = 8 // ep
            assert held == local * per_expert
            assert drawn - rank[1][2] == -(8 - local) * per_expert  # the other ranks' experts are never drawn
            for name, w in experts.items():
                assert torch.equal(w, whole[name][first:first + local]), (ep, name)


@pytest.mark.parametrize("world,ep,model", [
    (2, 2, {}),
    (4, 4, {}),
    (2, 2, {"moe_token_dispatcher_type": "allgather"}),
    (4, 2, {}),  # EP 2 x expert DP 2
    (2, 2, {**CAPACITY, "moe_token_drop_policy": "probs"}),
    (4, 4, {**CAPACITY, "moe_token_drop_policy": "position", "moe_pad_expert_input_to_capacity": True}),
    (4, 2, {**CAPACITY, "moe_token_dispatcher_type": "allgather", "moe_router_score_function": "sigmoid",
            "moe_router_load_balancing_type": "seq_aux_loss"}),
], ids=["ep2", "ep4", "ep2-allgather", "ep2xdp2", "ep2-capacity-probs", "ep4-capacity-position-padded",
        "ep2xdp2-allgather-capacity-sigmoid-seq-aux"])
def test_expert_and_data_parallel_match_one_process(world, ep, model):
    ref = reference(M * world, **model)
    assert all(r["dropped_tokens"] > 0 for r in ref[2].values()) == ("moe_expert_capacity_factor" in model)
    check_equal(run_distributed(distributed_run, world, args=(model, ep)), ref)


@pytest.mark.parametrize("etp,model", [
    (2, {}),  # expert TP = TP: EP carved from the DP ranks
    (1, {"moe_shared_expert_gate": True}),  # experts whole: EP 2 spans the TP ranks of a DP rank pair; gated
    (1, {**CAPACITY, "moe_token_drop_policy": "position"}),  # the capacity over the micro-batch, not a TP slice
    (2, {"moe_token_dispatcher_type": "allgather"}),
], ids=["etp2", "etp1-shared-expert-gate", "etp1-capacity", "etp2-allgather"])
def test_expert_parallel_with_tensor_parallel_matches_one_process(etp, model):
    ref = reference(M * 2, **model)  # TP 2 x DP 2: two data-parallel replicas
    assert all(r["dropped_tokens"] > 0 for r in ref[2].values()) == ("moe_expert_capacity_factor" in model)
    check_equal(run_distributed(distributed_run, 4, tp=2, args=(model, 2, etp, "1f1b", 1, True)), ref)


@pytest.mark.parametrize("method,v", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
def test_expert_parallel_with_pipeline_matches_one_process(method, v):
    ref = reference(M * 2)  # PP 2 x DP 2, EP 2 on each stage
    check_equal(run_distributed(distributed_run, 4, pp=2, args=({}, 2, None, method, v)), ref)


@pytest.mark.parametrize("model", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"torch_compile": True},
], ids=["full-recompute", "torch-compile"])
def test_recomputation_and_compiled_layers_under_expert_parallelism(model, monkeypatch):
    """The recomputation runs the dispatch's collectives again in the backward on every EP rank alike (and
    counts nothing twice); compiled layers leave the routed part eager between their graphs. TorchDynamo and
    AOTAutograd without code generation (aot_eager): the subject is where the graphs are cut."""
    from megatron_po.models import compiled_layers
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    check_equal(run_distributed(distributed_run, 2, args=(model, 2)), reference(M * 2))


def _counting_context_parallel_gathers(*args):
    """distributed_run, counting the calls of the one context-parallel gather (tensor_parallel/sequence_pieces.py)
    by (dim, sum_grads): the router's (dim 0, its own rows back) and the all-gather attention's (keys and values,
    dim -2, summed back)."""
    from collections import Counter

    from moe_harness import distributed_run
    from megatron_po.tensor_parallel import sequence_pieces
    calls, apply = Counter(), sequence_pieces._GatherFromContextParallelRegion.apply

    def counting(x, dim, sum_grads):
        calls[(dim, sum_grads)] += 1
        return apply(x, dim, sum_grads)
    sequence_pieces._GatherFromContextParallelRegion.apply = counting
    try:
        return distributed_run(*args) + (dict(calls),)
    finally:
        sequence_pieces._GatherFromContextParallelRegion.apply = apply


def test_router_and_attention_share_one_context_parallel_gather():
    """CP 2 with the all-gather attention (TP 2, sequence parallel): every router (3 MoE layers) and every attention
    (4 layers) gathers the sequence through the same autograd function, once per micro-batch; the run equals the
    one-process run."""
    model = {"cp_comm_type": "allgather"}
    results = run_distributed(_counting_context_parallel_gathers, 4, tp=2, cp=2,
                              args=(model, 2, None, "1f1b", 1, True))
    for *_, calls in results:
        assert calls == {(0, False): 3 * M, (-2, True): 4 * M}, calls
    check_equal([r[:4] for r in results], reference(M, **model))


@pytest.mark.parametrize("world,tp,cp,ep,model", [
    (2, 1, 2, 1, {**CAPACITY, "moe_token_drop_policy": "position"}),  # capacity by position over the whole sequence
    (2, 1, 2, 2, {}),  # EP carved out of the CP ranks
    (4, 1, 2, 2, {**CAPACITY, "moe_router_score_function": "sigmoid", "moe_router_load_balancing_type": "seq_aux_loss",
                  "moe_router_enable_expert_bias": True}),  # DP 2 x CP 2, per-sequence aux loss
    (4, 2, 2, 2, {**CAPACITY, "moe_token_dispatcher_type": "allgather"}),  # TP 2 (SP) x CP 2
], ids=["cp2-capacity-position", "cp2-ep2", "cp2xdp2-ep2-seq-aux-expert-bias", "tp2xcp2-ep2-allgather"])
def test_context_parallel_matches_one_process(world, tp, cp, ep, model):
    """Under context parallelism (each rank two chunks of every sequence) the router sees the whole sequence in its
    order: the same capacity drops, per-sequence losses and gradients as one process (the auxiliary losses' gradient
    taken CP times, as the language-model loss)."""
    ref = reference(M * world // (tp * cp), **model)
    check_equal(run_distributed(distributed_run, world, tp=tp, cp=cp, args=(model, ep, None, "1f1b", 1, tp > 1)), ref)
