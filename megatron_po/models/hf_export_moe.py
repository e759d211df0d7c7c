"""Our mixture-of-experts GPT -> Hugging Face `transformers` MoE checkpoints: Mixtral (`MixtralForCausalLM`),
Qwen2-MoE (`Qwen2MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`). Pure functions on {name: tensor}
dicts, as hf_export.py for the dense model; tools/checkpoint_convert.py does the file I/O.

All three are Llama-like around the MLP (RMSNorm, SwiGLU, RoPE, grouped-query attention: hf_export.py's
mapping) and route like our softmax router: the softmax of the router logits over all experts, its top-k, and
(`norm_topk_prob`) the k weights renormalized to sum 1, which is our default (softmax over the top-k logits:
the same numbers up to rounding) while --moe-router-pre-softmax is the unnormalized form. Which one a model
maps to is decided by what each class can hold:

  --qk-layernorm (per-head RMSNorm of q and k)                   -> Qwen3-MoE (it always has q_norm/k_norm)
  shared experts, dense layers (--moe-layer-freq) or pre-softmax  -> Qwen2-MoE
  every layer MoE, no shared experts, renormalized top-k          -> Mixtral

- Experts: ours are stacked [experts, ffn, hidden] (fc1 = up, fc1_gate = gate) and [experts, hidden, ffn] (fc2);
  written per expert under the names the Hub checkpoints use (`mlp.experts.<e>.gate_proj.weight`, Mixtral's
  `block_sparse_moe.experts.<e>.w1/w3/w2.weight`), which transformers loads into its fused layout.
- Dense layers (--moe-layer-freq) are `mlp_only_layers`, with --ffn-hidden-size as `intermediate_size`.
- Shared experts: Qwen2-MoE scales its shared expert by sigmoid(shared_expert_gate(x)); ours have no gate. The
  export writes a zero gate (sigmoid 0 = 1/2) and twice our down projection: 1/2 x (2 W a) is W a exactly (powers
  of two). Without shared experts Qwen2-MoE gets a shared expert of size 0 (an empty sum: zero).
- --apply-layernorm-1p stores norm weights (q/k norms too) as w - 1: exported as w + 1.

What no class here can express is refused, one line: sigmoid scores and DeepSeek-V3's expert bias, a capacity
(tokens dropped: HF's MoE blocks are dropless), --moe-router-topk-scaling-factor, biases (--add-bias-linear,
--add-qkv-bias), group-limited routing, shared experts with --qk-layernorm. The auxiliary losses and z-loss are training-only and need no equivalent;
--moe-aux-loss-coeff becomes `router_aux_loss_coef`, used by HF only with output_router_logits.
"""

from __future__ import annotations

import torch

from megatron_po.errors import UserError
from megatron_po.models.hf_export import (_groups, _head_dim, _is_norm_weight, _rope_parameters, check_llama_rope,
                                          ffn_size, llama_attention, refuse_multi_latent_attention, with_defaults)

MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
QWEN3_MOE = "qwen3_moe"
ARCHITECTURES = {MIXTRAL: "MixtralForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM"}


def _moe_layers(model: dict) -> list[bool]:
    from megatron_po.config import model_config_from_dict
    from megatron_po.models.moe.layout import moe_layer_pattern
    return moe_layer_pattern(model_config_from_dict(model))


def _expert_ffn(model: dict) -> int:
    from megatron_po.config import model_config_from_dict
    from megatron_po.models.moe.layout import expert_ffn_hidden_size
    return expert_ffn_hidden_size(model_config_from_dict(model))


def moe_architecture(model: dict) -> str:
    """"mixtral", "qwen2_moe" or "qwen3_moe" for a saved MoE `config["model"]` dict; UserError (one line) for
    what none of them can express."""
    model = with_defaults(model)
    refuse_multi_latent_attention(model)
    if model["num_experts"] is None:
        raise UserError("not a mixture of experts (no --num-experts): export it as GPT-2 or Llama")
    combo = (model["normalization"], "SwiGLU" if model["swiglu"] else "GELU", model["position_embedding_type"])
    if combo != ("RMSNorm", "SwiGLU", "rope"):
        raise UserError(f"no Hugging Face MoE class for normalization={combo[0]}, MLP={combo[1]}, positions={combo[2]}"
                        ": Mixtral and Qwen-MoE need RMSNorm + SwiGLU + rope")
    check_llama_rope(model)
    if model["moe_router_score_function"] != "softmax" or model["moe_router_enable_expert_bias"]:
        raise UserError("--moe-router-score-function sigmoid (and the expert bias): Mixtral and Qwen-MoE route by "
                        "softmax; no Hugging Face export")
    if model["moe_expert_capacity_factor"] is not None:
        raise UserError("--moe-expert-capacity-factor drops tokens; Hugging Face's MoE blocks are dropless: no export")
    if model["moe_router_topk_scaling_factor"] not in (None, 1.0):
        raise UserError(f"--moe-router-topk-scaling-factor {model['moe_router_topk_scaling_factor']}: Mixtral and "
                        "Qwen-MoE do not scale the routing weights")
    if model["add_bias_linear"]:
        raise UserError("--add-bias-linear: the MLPs of Mixtral and Qwen-MoE have no biases (export needs "
                        "--disable-bias-linear)")
    if model["add_qkv_bias"]:
        raise UserError("--add-qkv-bias: the attention of Mixtral and Qwen3-MoE has no QKV bias (and this export "
                        "writes none for Qwen2-MoE's): no Hugging Face export")
    if model["moe_router_group_topk"] and (model["moe_router_num_groups"] or 1) > 1:
        raise UserError("--moe-router-num-groups / --moe-router-group-topk: Mixtral and Qwen-MoE route without "
                        "groups; no Hugging Face export")
    shared = model["moe_shared_expert_intermediate_size"] is not None
    if model["qk_layernorm"]:
        if shared:
            raise UserError("--qk-layernorm with shared experts: Qwen3-MoE (q/k norms) has no shared experts and "
                            "Qwen2-MoE (shared experts) no q/k norms")
        return QWEN3_MOE
    if shared or not all(_moe_layers(model)) or model["moe_router_pre_softmax"]:
        return QWEN2_MOE
    return MIXTRAL


def moe_hf_config(model: dict, vocab_size: int):
    """The transformers config of the MoE class `model` maps to."""
    arch = moe_architecture(model)
    model = with_defaults(model)
    common = dict(vocab_size=vocab_size, hidden_size=model["hidden_size"], num_hidden_layers=model["num_layers"],
                  num_attention_heads=model["num_attention_heads"], num_key_value_heads=_groups(model),
                  head_dim=_head_dim(model), hidden_act="silu", max_position_embeddings=model["seq_length"],
                  rms_norm_eps=model["norm_epsilon"], initializer_range=model["init_method_std"],
                  rope_parameters=_rope_parameters(model), attention_dropout=model["attention_dropout"],
                  tie_word_embeddings=not model["untie_embeddings_and_output_weights"],
                  num_experts_per_tok=model["moe_router_topk"], router_aux_loss_coef=model["moe_aux_loss_coeff"],
                  output_router_logits=False, bos_token_id=None, eos_token_id=None,
                  architectures=[ARCHITECTURES[arch]])
    if arch == MIXTRAL:
        from transformers import MixtralConfig
        return MixtralConfig(**common, intermediate_size=_expert_ffn(model), num_local_experts=model["num_experts"],
                             sliding_window=None, router_jitter_noise=0.0)
    dense = [i for i, moe in enumerate(_moe_layers(model)) if not moe]
    qwen = dict(common, intermediate_size=ffn_size(model), moe_intermediate_size=_expert_ffn(model),
                num_experts=model["num_experts"], norm_topk_prob=not model["moe_router_pre_softmax"],
                decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False)
    if arch == QWEN3_MOE:
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**qwen, attention_bias=False)
    from transformers import Qwen2MoeConfig
    return Qwen2MoeConfig(**qwen, qkv_bias=False,
                          shared_expert_intermediate_size=model["moe_shared_expert_intermediate_size"] or 0)


def moe_to_hf(weights: dict[str, torch.Tensor], model: dict, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our consolidated weights (global names) -> the Hub-layout state dict of the MoE class (tied head omitted)."""
    arch = moe_architecture(model)
    model = with_defaults(model)
    nh, groups, h = model["num_attention_heads"], _groups(model), model["hidden_size"]
    one_p = model["apply_layernorm_1p"]
    w = {k: v + 1 if one_p and (_is_norm_weight(k) or k.endswith(("q_norm.weight", "k_norm.weight"))) else v
         for k, v in weights.items()}
    out = {"model.embed_tokens.weight": w["embedding.word_embeddings.weight"][:vocab_size]}
    for i, moe in enumerate(_moe_layers(model)):
        o, g = f"layers.{i}.", f"model.layers.{i}."
        out.update(llama_attention(w, i, groups, nh, bias=False))
        if arch == QWEN3_MOE:
            out[g + "self_attn.q_norm.weight"] = w[o + "attention.q_norm.weight"]
            out[g + "self_attn.k_norm.weight"] = w[o + "attention.k_norm.weight"]
        if not moe:
            out.update(_mlp(w, o + "mlp.", g + "mlp."))
            continue
        block = g + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")
        out[block + "gate.weight"] = w[o + "mlp.router.weight"]
        names = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
        for e in range(model["num_experts"]):
            for name, ours in zip(names, ("fc1_gate", "fc1", "fc2")):
                out[f"{block}experts.{e}.{name}.weight"] = w[f"{o}mlp.experts.{ours}"][e]
        if arch == QWEN2_MOE:  # sigmoid(0) x (2 W a) = W a; no shared experts: size 0
            ffn = model["moe_shared_expert_intermediate_size"]
            dtype = w[o + "mlp.router.weight"].dtype
            shared = (_mlp(w, o + "mlp.shared_experts.", block + "shared_expert.") if ffn else
                      {block + "shared_expert.gate_proj.weight": torch.zeros(0, h, dtype=dtype),
                       block + "shared_expert.up_proj.weight": torch.zeros(0, h, dtype=dtype),
                       block + "shared_expert.down_proj.weight": torch.zeros(h, 0, dtype=dtype)})
            shared[block + "shared_expert.down_proj.weight"] = shared[block + "shared_expert.down_proj.weight"] * 2
            out.update(shared)
            out[block + "shared_expert_gate.weight"] = torch.zeros(1, h, dtype=dtype)
    out["model.norm.weight"] = w["final_norm.weight"]
    if model["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = w["output_layer.weight"][:vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def _mlp(w: dict, ours: str, theirs: str) -> dict:
    """A SwiGLU MLP (a dense layer's, the shared experts'): fc1_gate, fc1, fc2 -> gate_proj, up_proj, down_proj."""
    return {theirs + "gate_proj.weight": w[ours + "fc1_gate.weight"], theirs + "up_proj.weight": w[ours + "fc1.weight"],
            theirs + "down_proj.weight": w[ours + "fc2.weight"]}
