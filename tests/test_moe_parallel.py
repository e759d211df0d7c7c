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
