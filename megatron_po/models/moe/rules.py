"""The MoE config rules (rows of config_rules.RULES, tests/test_config_rules.py) and the MoE start-up line.

Megatron's own checks where it has them (top-k, experts divisible by EP, sequence parallelism with TP, the
expert bias with sigmoid scores, no bias under expert TP, padding needs a capacity), the layout (EP x ETP must
divide the ranks of a pipeline stage), the flags Megatron has and this code does not take (one line each),
and Muon with an expert TP other than 1 or TP.
"""

from __future__ import annotations

import torch

from megatron_po.config import fp8_backend, recompute_granularity, recomputes_moe_layers
from megatron_po.config_check import Check, Ctx, Rule, at_least, each, raised
from megatron_po.models.moe.experts import grouped_mm_error
from megatron_po.models.moe.layout import expert_ffn_hidden_size, moe_layer_numbers, parse_layer_freq


def _moe(c: Ctx) -> bool:
    return c.m.num_experts is not None


def _grouped(c: Ctx) -> bool:
    """Group-limited routing asked for (Megatron's condition: a group top-k, with its groups)."""
    return _moe(c) and c.m.moe_router_group_topk is not None and c.m.moe_router_num_groups is not None


def etp(c: Ctx) -> int:
    """--expert-tensor-parallel-size, defaulted to the TP size (Megatron's default)."""
    return c.p.expert_tensor_parallel_size or c.tp


def _stage_ranks(c: Ctx) -> int:
    return c.tp * c.cp * c.dp


# Flags that mean something only with --num-experts (given, not at their defaults).
_NEED_EXPERTS = [
    ("--expert-model-parallel-size", lambda c: c.p.expert_model_parallel_size != 1),
    ("--expert-tensor-parallel-size", lambda c: c.p.expert_tensor_parallel_size is not None),
    ("--moe-ffn-hidden-size", lambda c: c.m.moe_ffn_hidden_size is not None),
    ("--moe-shared-expert-intermediate-size", lambda c: c.m.moe_shared_expert_intermediate_size is not None),
    ("--moe-aux-loss-coeff", lambda c: c.m.moe_aux_loss_coeff != 0),
    ("--moe-z-loss-coeff", lambda c: c.m.moe_z_loss_coeff is not None),
    ("--moe-router-enable-expert-bias", lambda c: c.m.moe_router_enable_expert_bias),
    ("--moe-expert-capacity-factor", lambda c: c.m.moe_expert_capacity_factor is not None),
    ("--moe-pad-expert-input-to-capacity", lambda c: c.m.moe_pad_expert_input_to_capacity),
    ("--moe-grouped-gemm", lambda c: c.m.moe_grouped_gemm),
    ("--moe-layer-freq", lambda c: c.m.moe_layer_freq != "1"),
    ("--moe-layer-recompute", lambda c: c.m.moe_layer_recompute),
    ("--moe-router-num-groups", lambda c: c.m.moe_router_num_groups is not None),
    ("--moe-router-group-topk", lambda c: c.m.moe_router_group_topk is not None),
    ("--moe-router-dtype", lambda c: c.m.moe_router_dtype is not None),
    ("--moe-router-force-load-balancing", lambda c: c.m.moe_router_force_load_balancing),
    ("--moe-enable-deepep", lambda c: c.m.moe_enable_deepep),
]

# Megatron's MoE flags this code does not take: one line each, never silently ignored.
_REFUSED = [
    ("--moe-input-jitter-eps", lambda c: c.m.moe_input_jitter_eps is not None, "router input jitter"),
]


def _grouped_gemm_error(c: Ctx) -> str | None:
    from megatron_po.parallel_state import get_device  # the one place that picks the device
    dtype = torch.bfloat16 if c.pr.bf16 else torch.float16 if c.pr.fp16 else torch.float32
    why = grouped_mm_error(get_device().type, dtype, (c.m.hidden_size, expert_ffn_hidden_size(c.m) // etp(c)))
    if why is None:
        return None
    return (f"--moe-grouped-gemm cannot run the {str(dtype)[6:]} expert GEMMs here: {why}; drop it (the loop over "
            f"the local experts gives the same numbers)")


MOE_RULES = [
    *at_least(1, [("--num-experts", lambda c: c.m.num_experts),
                  ("--moe-ffn-hidden-size", lambda c: c.m.moe_ffn_hidden_size),
                  ("--moe-shared-expert-intermediate-size", lambda c: c.m.moe_shared_expert_intermediate_size),
                  ("--expert-tensor-parallel-size", lambda c: c.p.expert_tensor_parallel_size),
                  ("--moe-router-num-groups", lambda c: c.m.moe_router_num_groups),
                  ("--moe-router-group-topk", lambda c: c.m.moe_router_group_topk)], optional=True),
    *at_least(1, [("--expert-model-parallel-size", lambda c: c.p.expert_model_parallel_size)]),
    *each("{flag}-needs-experts", _NEED_EXPERTS, lambda c, flag: f"{flag} applies to a mixture of experts: add "
                                                                 f"--num-experts", when=lambda c: not _moe(c)),
    *[Rule(f"{flag[2:]}-refused", lambda c, given=given: not given(c),
           lambda c, flag=flag, what=what: f"{flag} is Megatron's, not implemented here ({what}): drop it")
      for flag, given, what in _REFUSED],
    Rule("moe-sinkhorn-refused", lambda c: c.m.moe_router_load_balancing_type != "sinkhorn",
         "--moe-router-load-balancing-type sinkhorn is Megatron's, not implemented here: use aux_loss, seq_aux_loss "
         "or none"),
    Rule("moe-deepep-needs-flex", lambda c: c.m.moe_token_dispatcher_type == "flex",
         lambda c: f"--moe-enable-deepep needs --moe-token-dispatcher-type flex (got {c.m.moe_token_dispatcher_type}; "
                   f"DeepEP is the flex dispatcher's backend, as in Megatron)", when=lambda c: c.m.moe_enable_deepep),
    Rule("moe-flex-no-padding", lambda c: not c.m.moe_pad_expert_input_to_capacity,
         "--moe-token-dispatcher-type flex with --moe-pad-expert-input-to-capacity: Megatron's DeepEP dispatcher "
         "does not pad; use alltoall", when=lambda c: _moe(c) and c.m.moe_token_dispatcher_type == "flex"),
    Rule("moe-topk-range", lambda c: 1 <= c.m.moe_router_topk <= c.m.num_experts,
         lambda c: f"--moe-router-topk ({c.m.moe_router_topk}) must be in [1, --num-experts ({c.m.num_experts})]",
         when=_moe),
    Check("moe-layer-freq", lambda c: raised(lambda: parse_layer_freq(c.m.moe_layer_freq, c.m.num_layers)),
          when=_moe),
    # Group-limited routing: Megatron's checks (the groups need --moe-router-num-groups, equal groups, no more
    # picked than there are), and ours: each picked group is scored by its top (topk // group-topk) scores, and
    # the picked groups must hold the top-k (Megatron would route to -inf scores past them).
    Rule("moe-group-topk-needs-groups", lambda c: c.m.moe_router_num_groups is not None,
         "--moe-router-group-topk needs --moe-router-num-groups (group-limited routing, as in Megatron)",
         when=lambda c: _moe(c) and c.m.moe_router_group_topk is not None),
    Rule("moe-experts-vs-groups", lambda c: c.m.num_experts % c.m.moe_router_num_groups == 0,
         lambda c: f"--num-experts ({c.m.num_experts}) is not divisible by --moe-router-num-groups "
                   f"({c.m.moe_router_num_groups}): the groups are equal", when=lambda c: _grouped(c)),
    Rule("moe-group-topk-vs-groups", lambda c: c.m.moe_router_group_topk <= c.m.moe_router_num_groups,
         lambda c: f"--moe-router-group-topk ({c.m.moe_router_group_topk}) must be at most --moe-router-num-groups "
                   f"({c.m.moe_router_num_groups})", when=lambda c: _grouped(c)),
    Rule("moe-group-topk-vs-topk", lambda c: c.m.moe_router_group_topk <= c.m.moe_router_topk
         <= c.m.moe_router_group_topk * (c.m.num_experts // c.m.moe_router_num_groups),
         lambda c: f"--moe-router-group-topk {c.m.moe_router_group_topk} of --moe-router-num-groups "
                   f"{c.m.moe_router_num_groups} ({c.m.num_experts // c.m.moe_router_num_groups} experts each) with "
                   f"--moe-router-topk {c.m.moe_router_topk}: each picked group is scored by its top (topk // "
                   f"group-topk) scores and the picked groups must hold the top-k, so group-topk <= topk <= "
                   f"group-topk x experts per group", when=lambda c: _grouped(c)),
    Rule("experts-vs-ep", lambda c: c.m.num_experts % c.p.expert_model_parallel_size == 0,
         lambda c: f"--num-experts ({c.m.num_experts}) is not divisible by --expert-model-parallel-size "
                   f"({c.p.expert_model_parallel_size})", when=_moe),
    Rule("ep-x-etp-vs-stage", lambda c: _stage_ranks(c) % (c.p.expert_model_parallel_size * etp(c)) == 0,
         lambda c: f"--expert-model-parallel-size ({c.p.expert_model_parallel_size}) x --expert-tensor-parallel-size "
                   f"({etp(c)}) = {c.p.expert_model_parallel_size * etp(c)} does not divide the ranks of a pipeline "
                   f"stage (tensor x context x data parallel = {c.tp} x {c.cp} x {c.dp}): the experts are carved out "
                   f"of the data-parallel ranks", when=_moe),
    Rule("moe-tp-needs-sequence-parallel", lambda c: c.p.sequence_parallel,
         lambda c: f"MoE with --tensor-model-parallel-size {c.tp} needs --sequence-parallel (as in Megatron: each TP "
                   f"rank routes its own tokens)", when=lambda c: _moe(c) and c.tp > 1),
    Rule("moe-ffn-vs-etp", lambda c: expert_ffn_hidden_size(c.m) % etp(c) == 0,
         lambda c: f"the expert MLP size ({expert_ffn_hidden_size(c.m)}) is not divisible by "
                   f"--expert-tensor-parallel-size ({etp(c)})", when=_moe),
    Rule("moe-shared-expert-gate-needs-shared", lambda c: c.m.moe_shared_expert_intermediate_size is not None,
         "--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size",
         when=lambda c: c.m.moe_shared_expert_gate),
    Rule("moe-shared-vs-tp", lambda c: c.m.moe_shared_expert_intermediate_size % c.tp == 0,
         lambda c: f"--moe-shared-expert-intermediate-size ({c.m.moe_shared_expert_intermediate_size}) is not "
                   f"divisible by --tensor-model-parallel-size ({c.tp})",
         when=lambda c: _moe(c) and c.m.moe_shared_expert_intermediate_size is not None),
    Rule("moe-bias-vs-etp", lambda c: not c.m.add_bias_linear,
         lambda c: f"expert biases with --expert-tensor-parallel-size {etp(c)}: not supported, as in Megatron; add "
                   f"--disable-bias-linear or --expert-tensor-parallel-size 1", when=lambda c: _moe(c) and etp(c) > 1),
    Rule("moe-expert-bias-needs-sigmoid", lambda c: c.m.moe_router_score_function == "sigmoid",
         "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron)",
         when=lambda c: _moe(c) and c.m.moe_router_enable_expert_bias),
    Rule("moe-coefficients>=0", lambda c: c.m.moe_aux_loss_coeff >= 0 and (c.m.moe_z_loss_coeff or 0) >= 0
         and c.m.moe_router_bias_update_rate >= 0,
         lambda c: f"--moe-aux-loss-coeff ({c.m.moe_aux_loss_coeff}), --moe-z-loss-coeff ({c.m.moe_z_loss_coeff}) "
                   f"and --moe-router-bias-update-rate ({c.m.moe_router_bias_update_rate}) must be >= 0", when=_moe),
    Rule("moe-capacity>0", lambda c: c.m.moe_expert_capacity_factor > 0,
         lambda c: f"--moe-expert-capacity-factor must be > 0 (got {c.m.moe_expert_capacity_factor})",
         when=lambda c: _moe(c) and c.m.moe_expert_capacity_factor is not None),
    Rule("moe-pad-needs-capacity", lambda c: c.m.moe_expert_capacity_factor is not None,
         "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (a dropless router has no capacity)",
         when=lambda c: _moe(c) and c.m.moe_pad_expert_input_to_capacity),
    Rule("moe-drop-policy-needs-capacity", lambda c: c.m.moe_expert_capacity_factor is not None,
         "--moe-token-drop-policy position chooses the tokens an expert drops past its capacity: add "
         "--moe-expert-capacity-factor", when=lambda c: _moe(c) and c.m.moe_token_drop_policy != "probs"),
    Check("moe-grouped-gemm-dtype", _grouped_gemm_error, when=lambda c: _moe(c) and c.m.moe_grouped_gemm),
    Rule("moe-gpt-only", lambda c: c.workload == "gpt", "--num-experts is wired for pretrain_gpt.py only",
         when=_moe),
    Rule("moe-local-layers", lambda c: c.m.transformer_impl == "local",
         "--num-experts needs --transformer-impl local (the MoE layer is built from the local layers)", when=_moe),
    Rule("moe-per-token-loss", lambda c: not c.t.calculate_per_token_loss,
         "--calculate-per-token-loss with --num-experts: the auxiliary losses' per-token scaling is not wired: drop "
         "one", when=_moe),
    Rule("moe-muon-expert-tp", lambda c: etp(c) in (1, c.tp),
         lambda c: f"--optimizer muon with --expert-tensor-parallel-size {etp(c)} != --tensor-model-parallel-size "
                   f"{c.tp}: Muon gathers a sliced matrix over the TP group; use an expert TP of 1 or {c.tp}",
         when=lambda c: _moe(c) and c.t.optimizer == "muon"),
    Rule("moe-fp8-shared-dims", lambda c: (c.m.moe_shared_expert_intermediate_size // c.tp) % 16 == 0,
         lambda c: f"--fp8-format needs the shared experts' size per TP rank "
                   f"({c.m.moe_shared_expert_intermediate_size // c.tp}) divisible by 16",
         when=lambda c: _moe(c) and fp8_backend(c.m) == "torchao" and c.m.moe_shared_expert_intermediate_size),
]


# Megatron's MoE switches that change no number here: accepted, and what runs instead said once at start-up.
NO_OP_SWITCHES = [
    ("--moe-permute-fusion", lambda m: m.moe_permute_fusion,
     "the tokens are permuted by index_select and put back by index_add"),
    ("--moe-router-fusion", lambda m: m.moe_router_fusion, "the routing runs unfused (the same formulas)"),
    ("--moe-shared-expert-overlap", lambda m: m.moe_shared_expert_overlap,
     "the shared experts run after the routed ones, not overlapped with the dispatch"),
    ("--moe-token-dispatcher-type flex", lambda m: m.moe_token_dispatcher_type == "flex",
     "flex runs the alltoall dispatcher (the same tokens to the same experts)"),
    ("--moe-enable-deepep", lambda m: m.moe_enable_deepep, "no DeepEP kernels: torch.distributed's all-to-all"),
]


def no_op_switches_line(m) -> str | None:
    """The start-up line for the no-op MoE switches given (ModelConfig `m`), or None."""
    given = [(flag, instead) for flag, on, instead in NO_OP_SWITCHES if on(m)]
    if not given:
        return None
    return (f"> {', '.join(flag for flag, _ in given)}: accepted, no effect here (Transformer Engine and DeepEP "
            f"kernels, CUDA stream overlap): {'; '.join(instead for _, instead in given)}")


def moe_summary(cfg) -> str:
    """The start-up line: where the experts are and how tokens reach them."""
    import megatron_po.parallel_state as ps
    m = cfg.model
    layers = moe_layer_numbers(m)
    capacity = (f"capacity factor {m.moe_expert_capacity_factor} ({m.moe_token_drop_policy} drop policy"
                f"{', padded' if m.moe_pad_expert_input_to_capacity else ''})"
                if m.moe_expert_capacity_factor is not None else "dropless")
    groups = (f" in {m.moe_router_group_topk} of {m.moe_router_num_groups} groups"
              if m.moe_router_group_topk and (m.moe_router_num_groups or 1) > 1 else "")
    router = f", router in {m.moe_router_dtype}" if m.moe_router_dtype else ""
    return (f"> MoE: {m.num_experts} experts, top-{m.moe_router_topk}{groups} ({m.moe_router_score_function}{router}), "
            f"in layers "
            f"{layers}; EP {ps.get_expert_model_parallel_world_size()} x expert TP "
            f"{ps.get_expert_tensor_parallel_world_size()} per stage; {m.moe_token_dispatcher_type} dispatcher; "
            f"{capacity}; experts as {'one grouped GEMM' if m.moe_grouped_gemm else 'a loop over the local experts'}"
            f"{'; recomputed with their layers' if recompute_granularity(m) == 'full' else ''}"
            f"{'; MoE layers recomputed in the backward' if recomputes_moe_layers(m) else ''}")
