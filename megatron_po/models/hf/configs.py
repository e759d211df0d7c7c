"""config.json <-> our ModelConfig, for the families of families.py; and which family can hold a model.

Import: `model_fields(family, config)` reads a transformers config object (config.json through its class, so the
class's defaults and its RoPE standardization apply) into ModelConfig fields; what no flag of ours expresses is
refused with one line (UserError). Export: `hf_config(family, model, vocab_size)` builds the config object;
`export_family(model)` picks the first family that can hold the model (`why_not` says why one cannot).

Mappings beyond the obvious (hidden size, layers, heads, ...):
- grouped-query attention: `num_key_value_heads` = --num-query-groups; `head_dim` = --kv-channels.
- RoPE (`rope_parameters`): `rope_theta` = --rotary-base; "linear" = --rotary-seq-len-interpolation-factor,
  "llama3" = --use-rope-scaling --rope-scaling-factor with Megatron's fixed constants (LLAMA3_CONSTANTS);
  `partial_rotary_factor` = --rotary-percent (GLM-4.5; our RoPE rotates the first dimensions, as theirs).
- `max_position_embeddings` <-> --seq-length; `tie_word_embeddings` <-> not --untie-embeddings-and-output-weights.
- MoE: the experts' count and size, `num_experts_per_tok` = --moe-router-topk, the dense layers (`mlp_only_layers`,
  `first_k_dense_replace`) <-> --moe-layer-freq's list form, the shared experts' size, `router_aux_loss_coef` <->
  --moe-aux-loss-coeff. Softmax routing: `norm_topk_prob` true is our default (the softmax of the top-k logits:
  the renormalized top-k of the softmax), false is --moe-router-pre-softmax. Sigmoid routing (GLM-4.5): the expert
  bias (--moe-router-enable-expert-bias), `routed_scaling_factor` (--moe-router-topk-scaling-factor), `n_group` /
  `topk_group` (--moe-router-num-groups / --moe-router-group-topk, where a group's score means the same:
  HF_GROUP_SCORE_TOPK); ours renormalizes the top-k when k > 1, so `norm_topk_prob` must be true exactly then.
- Multi-latent attention (DeepSeek-V3; `mla_fields`, `mla_config`): q_lora_rank (null: none, as Moonlight),
  kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim <-> --q-lora-rank, --kv-lora-rank, --qk-head-dim,
  --qk-pos-emb-head-dim, --v-head-dim; the latent norms, always there, <-> --qk-layernorm; RoPE "default" <->
  --rope-type rope, "yarn" <-> --rope-type yarn with factor, mscale, mscale_all_dim, original_max_position_embeddings,
  beta_fast, beta_slow, truncate <-> --rotary-scaling-factor, --mscale, --mscale-all-dim,
  --yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow,
  --[no-]yarn-correction-range-round-to-int. transformers scales cos/sin by mscale / mscale_all_dim's only when both
  are given (else by mscale(factor, 1)) and the softmax by mscale_all_dim's under YaRN only: what cannot say ours
  is one line. Its latent norms' epsilon is fixed at 1e-6 (DeepSeek's code), whatever rms_norm_eps (Moonlight's
  1e-5): imported as --mla-latent-norm-epsilon where they differ; a model of ours whose latent norms take another
  exports with a line saying so (`latent_norm_note`: transformers will compute them with 1e-6).
"""

from __future__ import annotations

from megatron_po.config import ModelConfig, ffn_hidden_size, kv_channels, num_query_groups
from megatron_po.errors import UserError
from megatron_po.models.hf.families import BY_TYPE, FAMILIES, Family
from megatron_po.models.mla import (YARN_BETA_FAST, YARN_BETA_SLOW, YARN_ORIGINAL_MAX_POSITIONS, latent_norm_epsilon,
                                     mla_sizes, rope_type, softmax_scale)
from megatron_po.models.moe.layout import expert_ffn_hidden_size, moe_layer_pattern
from megatron_po.models.transformer import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                            LLAMA3_ORIGINAL_MAX_POSITIONS)

# HF's "llama3" rope type spells out the constants Megatron's --use-rope-scaling fixes.
LLAMA3_CONSTANTS = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                    "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


# transformers' group-limited routers (GLM-4.5, DeepSeek-V3) score a group by the sum of its top 2 scores; Megatron's
# --moe-router-group-topk by the sum of its top top-k / group-topk: the same when that is 2 (DeepSeek-V3: 8 / 4).
HF_GROUP_SCORE_TOPK = 2
# DeepseekV3's latent norms (q_a_layernorm, kv_a_layernorm) take RMSNorm's default epsilon, not rms_norm_eps.
HF_LATENT_NORM_EPS = 1e-6


def family_of(config: dict) -> Family:
    """The family of a config.json dict; UserError (one line) for an architecture not served."""
    kind, archs = config.get("model_type"), config.get("architectures") or []
    family = BY_TYPE.get(kind)
    if family is None or any(a != family.architecture for a in archs):
        served = ", ".join(f.architecture for f in FAMILIES)
        raise UserError(f"config.json names {archs[0] if archs else kind!r} (model_type {kind!r}): not served; "
                        f"import-hf reads {served}")
    return family


def model_config(fields: dict) -> ModelConfig:
    """ModelConfig(**fields); a field this build lacks is one line."""
    missing = [k for k in fields if k not in ModelConfig.__dataclass_fields__]
    if missing:
        raise UserError(f"this build has no --{missing[0].replace('_', '-')}, which the checkpoint needs")
    return ModelConfig(**fields)


# --------------------------------------------------------------------------------------------------
# Import: config -> ModelConfig fields
# --------------------------------------------------------------------------------------------------


def model_fields(family: Family, c) -> dict:
    """ModelConfig fields of a transformers config `c` of `family`."""
    if family.model_type == "gpt2":
        return _gpt2_fields(c)
    if getattr(c, "quantization_config", None):
        q = c.quantization_config
        kind = q.get("quant_method", "quantized") if isinstance(q, dict) else type(q).__name__
        raise UserError(f"quantization_config ({kind}): quantized weights are not read; dequantize the checkpoint "
                        "first")
    h, nh = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or nh
    head_dim = getattr(c, "head_dim", None) or h // nh
    if family.mla and kv != nh:
        raise UserError(f"num_key_value_heads {kv} with multi-latent attention's {nh} heads: each MLA head has its "
                        "own keys and values")
    if nh % kv:
        raise UserError(f"num_key_value_heads ({kv}) does not divide num_attention_heads ({nh})")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")
    _check_no_sliding_window(family, c)
    fields = dict(num_layers=c.num_hidden_layers, hidden_size=h, num_attention_heads=nh,
                  group_query_attention=kv != nh, num_query_groups=kv if kv != nh else 1,
                  kv_channels=None if head_dim * nh == h else head_dim, ffn_hidden_size=c.intermediate_size,
                  seq_length=c.max_position_embeddings, position_embedding_type="rope", normalization="RMSNorm",
                  norm_epsilon=c.rms_norm_eps, swiglu=True,
                  untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                  hidden_dropout=0.0, attention_dropout=getattr(c, "attention_dropout", 0.0),
                  init_method_std=c.initializer_range, add_bias_linear=False,
                  **(mla_fields(c) if family.mla else _rope_fields(family, c)))
    if family.mla:  # its head dimensions are its own (mla_fields): no --kv-channels
        fields["kv_channels"] = None
    if family.linear_bias:
        if bool(getattr(c, "attention_bias", False)) != bool(getattr(c, "mlp_bias", False)):
            raise UserError("attention_bias and mlp_bias differ: --add-bias-linear covers both")
        fields["add_bias_linear"] = bool(c.attention_bias)
    for key in family.refused:
        if getattr(c, key, False):
            raise UserError(f"{key} {getattr(c, key)!r}: no equivalent here ({family.architecture})")
    if _has(c, family.qkv_bias):
        fields["add_qkv_bias"] = True
    fields["qk_layernorm"] = _has(c, family.qk_norm)
    dense = family.holds_dense and not any(_is_moe_layer(family, c, i) for i in range(c.num_hidden_layers))
    if family.experts is not None and not dense:
        fields.update(_moe_fields(family, c))
    if family.mtp and getattr(c, family.mtp, 0):
        fields["mtp_num_layers"] = getattr(c, family.mtp)
    return fields


def mla_fields(c) -> dict:
    """The multi-latent attention's fields of a DeepseekV3 config `c` (module docstring)."""
    if not c.rope_interleave:
        raise UserError("rope_interleave false (rotary rows laid out rotate-half): this MLA reads DeepSeek's "
                        "interleaved layout (rope_interleave true) only")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    out = dict(multi_latent_attention=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
               qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
               rotary_base=_rotary_base(rope))
    if c.rms_norm_eps != HF_LATENT_NORM_EPS:
        out["mla_latent_norm_epsilon"] = HF_LATENT_NORM_EPS
    if kind == "default":
        return dict(out, rope_type="rope")
    if kind != "yarn":
        raise UserError(f"RoPE type {kind!r} with multi-latent attention is not supported (default and yarn are)")
    factor, mscale, mscale_all_dim = rope.get("factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise UserError(f"yarn RoPE factor {factor!r} is not a number > 0")
    if rope.get("attention_factor") is not None:
        raise UserError(f"yarn RoPE attention_factor {rope['attention_factor']}: set here by --mscale and "
                        "--mscale-all-dim only (give mscale and mscale_all_dim instead)")
    if not (mscale and mscale_all_dim):  # transformers: cos/sin scaled by mscale(factor, 1)
        if mscale_all_dim:
            raise UserError(f"yarn RoPE mscale_all_dim {mscale_all_dim} without mscale: transformers then scales "
                            "cos/sin by mscale(factor, 1) and the softmax by mscale_all_dim's, which --mscale and "
                            "--mscale-all-dim cannot say")
        mscale, mscale_all_dim = 1.0, 0.0
    original = rope.get("original_max_position_embeddings") or c.max_position_embeddings
    out.update(rope_type="yarn", rotary_scaling_factor=float(factor), mscale=float(mscale),
               mscale_all_dim=float(mscale_all_dim), yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
    for field, value, default in (("yarn_original_max_position_embeddings", original, YARN_ORIGINAL_MAX_POSITIONS),
                                  ("yarn_beta_fast", rope.get("beta_fast") or YARN_BETA_FAST, YARN_BETA_FAST),
                                  ("yarn_beta_slow", rope.get("beta_slow") or YARN_BETA_SLOW, YARN_BETA_SLOW)):
        if value != default:
            out[field] = type(default)(value)
    return out


def _rotary_base(rope: dict) -> int:
    theta = rope.get("rope_theta", 10000.0)
    if float(theta) != int(theta):
        raise UserError(f"rope_theta {theta} is not an integer (--rotary-base is)")
    return int(theta)


def latent_norm_note(m: ModelConfig) -> str | None:
    """The line saying an MLA model's latent norms take an epsilon DeepseekV3's cannot (it fixes 1e-6), if so."""
    if not m.multi_latent_attention or not m.qk_layernorm or latent_norm_epsilon(m) == HF_LATENT_NORM_EPS:
        return None
    return (f"note: the latent norms here take epsilon {latent_norm_epsilon(m):g}; DeepseekV3ForCausalLM's "
            f"(q_a_layernorm, kv_a_layernorm) always {HF_LATENT_NORM_EPS:g}, so transformers' logits will differ "
            "a little (--mla-latent-norm-epsilon)")


def _has(c, choice: str | bool) -> bool:
    return choice if isinstance(choice, bool) else bool(getattr(c, choice, False))


def _check_no_sliding_window(family: Family, c) -> None:
    window = getattr(c, "sliding_window", None) if family.sliding_window else None
    layer_types = getattr(c, "layer_types", None)
    sliding = any(t == "sliding_attention" for t in layer_types) if layer_types else bool(window)
    if sliding and window and window < c.max_position_embeddings:
        raise UserError(f"sliding_window {window} (< max_position_embeddings {c.max_position_embeddings}): "
                        "sliding-window attention is not supported")


def _rope_fields(family: Family, c) -> dict:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear", "llama3"):
        raise UserError(f"RoPE type {kind!r} is not supported (default, linear and llama3 are)")
    out = dict(rotary_base=_rotary_base(rope))
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        if not family.partial_rotary:
            raise UserError(f"partial_rotary_factor {partial}: {family.architecture} rotates whole heads here")
        out["rotary_percent"] = float(partial)
    if kind == "llama3":
        got = {k: rope.get(k) for k in LLAMA3_CONSTANTS}
        if got != LLAMA3_CONSTANTS:
            raise UserError(f"llama3 RoPE scaling with {got}: --use-rope-scaling (as Megatron's) fixes "
                            f"{LLAMA3_CONSTANTS}")
        if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] < 1:
            raise UserError(f"llama3 RoPE scaling factor {rope.get('factor')!r} is not a number >= 1")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    if kind == "linear":
        factor = rope.get("factor")
        if not isinstance(factor, (int, float)) or float(factor) != int(factor):
            raise UserError(f"linear RoPE scaling factor {factor} is not an integer "
                            "(--rotary-seq-len-interpolation-factor is)")
        out["rotary_seq_len_interpolation_factor"] = int(factor)
    return out


def _moe_fields(family: Family, c) -> dict:
    E, L, topk = getattr(c, family.experts), c.num_hidden_layers, c.num_experts_per_tok
    moe_ffn = getattr(c, family.expert_ffn)
    out = dict(num_experts=E, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
               moe_layer_freq=layer_freq([_is_moe_layer(family, c, i) for i in range(L)]))
    if family.expert_ffn == "intermediate_size":  # Mixtral: no dense layers, one size
        out["ffn_hidden_size"] = moe_ffn
    if family.shared == "shared_expert_intermediate_size" and c.shared_expert_intermediate_size:
        out.update(moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size, moe_shared_expert_gate=True)
    if family.shared == "n_shared_experts" and c.n_shared_experts:
        out["moe_shared_expert_intermediate_size"] = c.n_shared_experts * moe_ffn
    if getattr(c, "router_jitter_noise", 0.0):
        raise UserError(f"router_jitter_noise {c.router_jitter_noise}: router input jitter is not supported")
    if family.router == "softmax":
        out["moe_router_pre_softmax"] = family.topk_norm and not c.norm_topk_prob
        out["moe_aux_loss_coeff"] = float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)
        return out
    if c.norm_topk_prob != (topk > 1):
        raise UserError(f"norm_topk_prob {c.norm_topk_prob} with num_experts_per_tok {topk}: sigmoid routing here "
                        "renormalizes the top-k weights exactly when k > 1")
    out.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    if c.routed_scaling_factor != 1.0:
        out["moe_router_topk_scaling_factor"] = float(c.routed_scaling_factor)
    if c.n_group > 1:
        if topk // c.topk_group != HF_GROUP_SCORE_TOPK:
            raise UserError(f"n_group {c.n_group}, topk_group {c.topk_group}, num_experts_per_tok {topk}: a group "
                            f"scores the sum of its top {HF_GROUP_SCORE_TOPK} here only when top-k / group-topk is "
                            f"{HF_GROUP_SCORE_TOPK} (--moe-router-group-topk sums the top {topk // c.topk_group})")
        out.update(moe_router_num_groups=c.n_group, moe_router_group_topk=c.topk_group)
    return out


def _is_moe_layer(family: Family, c, i: int) -> bool:
    if family.dense_layers == "first_k_dense_replace":
        return i >= c.first_k_dense_replace
    if family.dense_layers == "mlp_only_layers":
        step = getattr(c, "decoder_sparse_step", 1) or 1
        return i not in (c.mlp_only_layers or []) and (i + 1) % step == 0
    return True


def layer_freq(pattern: list[bool]) -> str:
    """--moe-layer-freq of a per-layer MoE pattern: "1" when every layer is MoE, else the list form in runs,
    e.g. ([0]*1+[1]*3)."""
    if all(pattern):
        return "1"
    runs = []
    for moe in pattern:
        if runs and runs[-1][0] == moe:
            runs[-1][1] += 1
        else:
            runs.append([moe, 1])
    return "(" + "+".join(f"[{int(moe)}]*{n}" for moe, n in runs) + ")"


def _gpt2_fields(c) -> dict:
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise UserError(f"GPT-2 activation {c.activation_function!r} is not supported "
                        "(ours is the tanh GELU: gelu_new / gelu_pytorch_tanh)")
    if c.scale_attn_by_inverse_layer_idx or not c.scale_attn_weights or c.reorder_and_upcast_attn:
        raise UserError("GPT-2 attention variants (scale_attn_by_inverse_layer_idx, unscaled attention, "
                        "reorder_and_upcast_attn) are not supported")
    h = c.n_embd
    return dict(num_layers=c.n_layer, hidden_size=h, num_attention_heads=c.n_head, ffn_hidden_size=c.n_inner or 4 * h,
                seq_length=c.n_positions, max_position_embeddings=c.n_positions,
                position_embedding_type="learned_absolute", normalization="LayerNorm",
                norm_epsilon=c.layer_norm_epsilon, swiglu=False,
                untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=c.resid_pdrop,
                attention_dropout=c.attn_pdrop, init_method_std=c.initializer_range, add_bias_linear=True)


# --------------------------------------------------------------------------------------------------
# Export: which family holds a model, and its config
# --------------------------------------------------------------------------------------------------


def why_not(family: Family, m: ModelConfig) -> str | None:
    """Why `family` cannot hold the model `m` (None: it can), in one phrase."""
    combo = (m.normalization, "SwiGLU" if m.swiglu else "GELU", m.position_embedding_type)
    moe = m.num_experts is not None
    if m.multi_latent_attention != family.mla:
        return ("multi-latent attention (DeepseekV3ForCausalLM holds it)" if m.multi_latent_attention else
                "plain attention (it holds multi-latent attention)")
    if family.model_type == "gpt2":
        if combo != ("LayerNorm", "GELU", "learned_absolute"):
            return f"normalization={combo[0]}, MLP={combo[1]}, positions={combo[2]} (GPT-2: LayerNorm + GELU + learned)"
        if m.group_query_attention or kv_channels(m) * m.num_attention_heads != m.hidden_size:
            return "grouped-query attention or --kv-channels other than hidden / heads"
        if m.qk_layernorm or moe or getattr(m, "add_qkv_bias", False):
            return "q/k norms, experts or --add-qkv-bias"
        return None
    if combo != ("RMSNorm", "SwiGLU", "rope"):
        return f"normalization={combo[0]}, MLP={combo[1]}, positions={combo[2]} (needs RMSNorm + SwiGLU + rope)"
    if m.use_rope_scaling and m.rotary_seq_len_interpolation_factor is not None:
        return "--use-rope-scaling with --rotary-seq-len-interpolation-factor (one RoPE type: llama3 or linear)"
    if m.rotary_percent != 1.0 and not family.partial_rotary:
        return f"--rotary-percent {m.rotary_percent} (it rotates whole heads)"
    if m.add_bias_linear and (moe or not family.linear_bias):
        return "--add-bias-linear (no biases on its MLPs or experts)"
    qkv_bias = getattr(m, "add_qkv_bias", False) and not m.add_bias_linear
    if qkv_bias != _has_always(family.qkv_bias, qkv_bias):
        return "q/k/v biases (--add-qkv-bias) " + ("missing (it always has them)" if family.qkv_bias is True
                                                   else "(it has none)")
    if family.mla and _why_not_mla(m):
        return _why_not_mla(m)
    if m.qk_layernorm != _has_always(family.qk_norm, m.qk_layernorm):
        return "q/k norms (--qk-layernorm) " + ("missing (it always has them)" if family.qk_norm is True
                                                else "(it has none)")
    if moe != (family.experts is not None) and not (family.holds_dense and not moe):
        return "a mixture of experts" if moe else "a dense model"
    return _why_not_moe(family, m) if moe else None


def _why_not_mla(m: ModelConfig) -> str | None:
    """What of our multi-latent attention DeepseekV3's cannot say (module docstring)."""
    if not m.qk_layernorm:
        return "multi-latent attention without the latent norms (--qk-layernorm; it has q_a_layernorm, kv_a_layernorm)"
    if rope_type(m) == "rope":
        if softmax_scale(m) is not None:
            return (f"--rope-type rope with a softmax scale from --rotary-scaling-factor {m.rotary_scaling_factor:g} "
                    f"and --mscale-all-dim {m.mscale_all_dim:g} (it scales the softmax under YaRN only)")
        return None
    if m.rotary_scaling_factor > 1 and not (m.mscale and m.mscale_all_dim) and (m.mscale, m.mscale_all_dim) != (1, 0):
        return (f"--mscale {m.mscale:g} with --mscale-all-dim {m.mscale_all_dim:g} (its YaRN reads mscale only with "
                "mscale_all_dim, else scales cos/sin by mscale(factor, 1))")
    return None


def _has_always(choice: str | bool, wanted: bool) -> bool:
    """What the family has, given what the model wants: a config key can say either."""
    return wanted if isinstance(choice, str) else choice


def _why_not_moe(family: Family, m: ModelConfig) -> str | None:
    if m.moe_expert_capacity_factor is not None:
        return "--moe-expert-capacity-factor (tokens dropped; its MoE blocks are dropless)"
    pattern = moe_layer_pattern(m)
    if family.dense_layers is None and not all(pattern):
        return "dense layers (--moe-layer-freq)"
    if family.dense_layers == "first_k_dense_replace" and pattern != sorted(pattern):
        return "dense layers other than the first ones (--moe-layer-freq)"
    shared = m.moe_shared_expert_intermediate_size
    if shared and family.shared is None:
        return "shared experts"
    if m.moe_shared_expert_gate and family.shared != "shared_expert_intermediate_size":
        return "a gated shared expert (--moe-shared-expert-gate)"
    if shared and family.shared == "n_shared_experts" and shared % expert_ffn_hidden_size(m):
        return "a shared expert size that is not a multiple of --moe-ffn-hidden-size"
    groups = router_groups(m)
    if family.router == "softmax":
        if m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias:
            return "--moe-router-score-function sigmoid / the expert bias (it routes by softmax)"
        if m.moe_router_topk_scaling_factor not in (None, 1.0):
            return (f"--moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor} (it does not scale the "
                    "weights)")
        if m.moe_router_pre_softmax and not family.topk_norm:
            return "--moe-router-pre-softmax (it renormalizes the top-k)"
        if groups > 1:
            return "group-limited routing (--moe-router-num-groups)"
        return None
    if m.moe_router_score_function != "sigmoid" or not m.moe_router_enable_expert_bias:
        return "softmax routing or sigmoid without the expert bias (it routes by sigmoid + e_score_correction_bias)"
    if groups > 1 and m.moe_router_topk // m.moe_router_group_topk != HF_GROUP_SCORE_TOPK:
        return (f"group-limited routing scoring a group by its top {m.moe_router_topk // m.moe_router_group_topk} "
                f"(it sums each group's top {HF_GROUP_SCORE_TOPK})")
    return None


def router_groups(m: ModelConfig) -> int:
    """The expert groups of group-limited routing (1: none; --moe-router-num-groups without a group top-k neither)."""
    groups, picked = getattr(m, "moe_router_num_groups", None), getattr(m, "moe_router_group_topk", None)
    return groups if groups and picked else 1


def export_family(m: ModelConfig, model_type: str | None = None) -> Family:
    """The family `m` exports to: `model_type` if given, else the first of FAMILIES that can hold it; UserError
    (one line) when it cannot."""
    if model_type is not None:
        family = BY_TYPE.get(model_type)
        if family is None:
            raise UserError(f"--model-type {model_type!r}: not one of {', '.join(BY_TYPE)}")
        reason = why_not(family, m)
        if reason:
            raise UserError(f"{family.architecture} cannot hold this model: {reason}")
        return family
    reasons = []
    for family in FAMILIES:
        if family.model_type == "mistral":  # the same tensors and config as Llama: chosen by name only
            continue
        reason = why_not(family, m)
        if reason is None:
            return family
        if (family.experts is None) == (m.num_experts is None) or family.holds_dense:  # dense for dense, MoE for MoE
            reasons.append(f"{family.architecture}: {reason}")
    raise UserError(f"no Hugging Face class holds this model ({'; '.join(reasons)})")


def hf_config(family: Family, m: ModelConfig, vocab_size: int):
    """The transformers config object of `family` for the model `m`."""
    import transformers
    cls = transformers.CONFIG_MAPPING[family.model_type]
    tied = not m.untie_embeddings_and_output_weights
    common = dict(vocab_size=vocab_size, tie_word_embeddings=tied, initializer_range=m.init_method_std,
                  bos_token_id=None, eos_token_id=None, architectures=[family.architecture])
    if family.model_type == "gpt2":
        return cls(**common, n_positions=m.max_position_embeddings or m.seq_length, n_embd=m.hidden_size,
                   n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=ffn_hidden_size(m),
                   activation_function="gelu_pytorch_tanh", resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
                   attn_pdrop=m.attention_dropout, layer_norm_epsilon=m.norm_epsilon)
    kw = dict(common, hidden_size=m.hidden_size, intermediate_size=ffn_hidden_size(m), num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_attention_heads, num_key_value_heads=num_query_groups(m),
              head_dim=kv_channels(m), hidden_act="silu", max_position_embeddings=m.seq_length,
              rms_norm_eps=m.norm_epsilon, rope_parameters=rope_parameters(m), attention_dropout=m.attention_dropout)
    if family.linear_bias:
        kw.update(attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)
    if isinstance(family.qkv_bias, str):
        kw[family.qkv_bias] = bool(getattr(m, "add_qkv_bias", False))
    if isinstance(family.qk_norm, str):
        kw[family.qk_norm] = m.qk_layernorm
    if family.mla:
        kw.update(mla_config(m))
    if family.experts is not None and m.num_experts is not None:
        kw.update(_moe_config(family, m))
    elif family.holds_dense:  # every layer dense
        kw["first_k_dense_replace"] = m.num_layers
    if family.mtp:
        kw[family.mtp] = m.mtp_num_layers or 0
    kw.update(family.fixed)
    return cls(**kw)


def mla_config(m: ModelConfig) -> dict:
    """DeepseekV3's attention keys of our multi-latent attention (module docstring)."""
    z = mla_sizes(m)
    if rope_type(m) == "rope":
        rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    else:
        rope = {"rope_type": "yarn", "rope_theta": float(m.rotary_base), "factor": m.rotary_scaling_factor,
                "original_max_position_embeddings": m.yarn_original_max_position_embeddings or YARN_ORIGINAL_MAX_POSITIONS,
                "beta_fast": m.yarn_beta_fast or YARN_BETA_FAST, "beta_slow": m.yarn_beta_slow or YARN_BETA_SLOW,
                "mscale": m.mscale, "mscale_all_dim": m.mscale_all_dim}
        if not m.yarn_correction_range_round_to_int:
            rope["truncate"] = False
    return dict(q_lora_rank=z.q_lora_rank, kv_lora_rank=z.kv_lora_rank, qk_nope_head_dim=z.qk_head_dim,
                qk_rope_head_dim=z.qk_pos_emb_head_dim, v_head_dim=z.v_head_dim, num_key_value_heads=m.num_attention_heads,
                head_dim=z.qk_pos_emb_head_dim, rope_parameters=rope)


def rope_parameters(m: ModelConfig) -> dict:
    """--rotary-base, --rotary-seq-len-interpolation-factor as HF's "linear" type (positions / factor),
    --use-rope-scaling as its "llama3" type with --rope-scaling-factor and Megatron's fixed constants, and
    --rotary-percent as `partial_rotary_factor`."""
    theta, factor = float(m.rotary_base), m.rotary_seq_len_interpolation_factor
    if m.use_rope_scaling:
        out = {"rope_type": "llama3", "rope_theta": theta, "factor": float(m.rope_scaling_factor), **LLAMA3_CONSTANTS}
    elif factor is None:
        out = {"rope_type": "default", "rope_theta": theta}
    else:
        out = {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if m.rotary_percent != 1.0:
        out["partial_rotary_factor"] = m.rotary_percent
    return out


def _moe_config(family: Family, m: ModelConfig) -> dict:
    moe_ffn, pattern = expert_ffn_hidden_size(m), moe_layer_pattern(m)
    out = {family.experts: m.num_experts, "num_experts_per_tok": m.moe_router_topk, family.expert_ffn: moe_ffn}
    if family.dense_layers == "mlp_only_layers":
        out["mlp_only_layers"] = [i for i, moe in enumerate(pattern) if not moe]
    elif family.dense_layers == "first_k_dense_replace":
        out["first_k_dense_replace"] = pattern.count(False)
    shared = m.moe_shared_expert_intermediate_size or 0
    if family.shared == "shared_expert_intermediate_size":
        out["shared_expert_intermediate_size"] = shared
    elif family.shared == "n_shared_experts":
        out["n_shared_experts"] = shared // moe_ffn
    if family.router == "softmax":
        if family.topk_norm:
            out["norm_topk_prob"] = not m.moe_router_pre_softmax
        out.update(router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=False)
    else:
        groups = router_groups(m)
        out.update(norm_topk_prob=m.moe_router_topk > 1, routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
                   n_group=groups, topk_group=m.moe_router_group_topk if groups > 1 else 1)
    return out
