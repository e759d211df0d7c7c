"""Our GPT <-> Hugging Face `transformers` checkpoints: GPT-2 (`GPT2LMHeadModel`) and Llama
(`LlamaForCausalLM`) weight layouts. Pure functions on {name: tensor} dicts; tools/checkpoint_convert.py
does the file I/O.

Which HF architecture a model maps to is decided by its three structural choices:
  LayerNorm + GELU (tanh) + learned positions  -> GPT-2
  RMSNorm + SwiGLU + RoPE                      -> Llama
anything else has no equivalent there and is refused (UserError).

Layout differences handled here:
- QKV: our fused projection's rows are laid out per key/value group, (q heads of g, k_g, v_g) for each
  group g (per head without GQA), so a contiguous TP split hands out whole groups. GPT-2's `c_attn` is
  [all q | all k | all v]; Llama has separate q/k/v projections, k/v with `num_key_value_heads` heads
  (grouped-query attention: query head i reads key/value head i // (heads / groups), in both).
- --kv-channels is Llama's `head_dim`; GPT-2 has neither GQA nor a head size other than hidden / heads.
- --apply-layernorm-1p stores norm weights as w - 1: exported as w + 1 (HF multiplies by the weight),
  imported as plain weights (the imported model does not use --apply-layernorm-1p).
- --qk-layernorm and --rotary-percent < 1 have no equivalent in either (refused).
- GPT-2 uses Conv1D modules whose weights are stored transposed ([in, out]) relative to nn.Linear.
- RoPE: ours is the rotate-half (GPT-NeoX) convention, which is what HF's Llama implements, so q/k rows
  need no permutation (the permutation in HF's own converter undoes Meta's interleaved convention).
- RoPE scaling: --rotary-seq-len-interpolation-factor is HF's "linear" rope type, --use-rope-scaling (Llama
  3.1's frequencies) its "llama3" type with Megatron's fixed constants (_LLAMA3_CONSTANTS); one config holds
  one type, so the two together are refused, and an import with other llama3 constants too.
- Biases: GPT-2 always has them (a model trained with --no-add-bias-linear exports zeros, which computes
  the same function); Llama's `attention_bias`/`mlp_bias` follow --add-bias-linear.
- Tied or untied output layer: `tie_word_embeddings`.
- Vocabulary padding: our embedding and output layer have `padded_vocab_size` rows (a multiple of
  --make-vocab-size-divisible-by x TP); the export keeps the tokenizer's `vocab_size` rows (the padded
  ids are never produced) and the import pads back with zero rows.
- GELU: ours is the tanh approximation, exported as "gelu_pytorch_tanh" (same formula as GPT-2's
  "gelu_new", computed by the same torch kernel as ours).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_po.errors import UserError
from megatron_po.models.transformer import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                            LLAMA3_ORIGINAL_MAX_POSITIONS)

GPT2 = "gpt2"
LLAMA = "llama"
# HF's "llama3" rope type spells out the constants Megatron's --use-rope-scaling fixes.
_LLAMA3_CONSTANTS = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                     "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def with_defaults(model: dict) -> dict:
    """A saved `config["model"]` dict with the fields it predates at their defaults."""
    from megatron_po.config import model_config_from_dict
    return dataclasses.asdict(model_config_from_dict(model))


def refuse_multi_latent_attention(model: dict) -> None:
    if model["multi_latent_attention"]:
        raise UserError("--multi-latent-attention: no Hugging Face export or import here yet (DeepSeek-V3's classes "
                        "are not wired; docs/mla.md names transformers' weights)")


def hf_architecture(model: dict) -> str:
    """"gpt2" or "llama" for a saved `config["model"]` dict; UserError for other combinations."""
    model = with_defaults(model)
    refuse_multi_latent_attention(model)
    if model["num_experts"] is not None:  # tools/checkpoint_convert.py sends MoE models to hf_export_moe.py
        raise UserError("a mixture of experts exports to an HF MoE class (hf_export_moe), not GPT-2 or Llama")
    combo = (model["normalization"], "SwiGLU" if model["swiglu"] else "GELU", model["position_embedding_type"])
    if model["qk_layernorm"]:
        raise UserError("--qk-layernorm has no equivalent in GPT-2 or Llama: no Hugging Face export")
    if model["add_qkv_bias"] and not model["add_bias_linear"]:
        raise UserError("--add-qkv-bias (a bias on the QKV projection only) has no equivalent in GPT-2 or Llama: no "
                        "Hugging Face export")
    if combo == ("LayerNorm", "GELU", "learned_absolute"):
        if model["group_query_attention"] or _head_dim(model) * model["num_attention_heads"] != model["hidden_size"]:
            raise UserError("GPT-2 has neither grouped-query attention nor --kv-channels other than hidden / heads")
        return GPT2
    if combo == ("RMSNorm", "SwiGLU", "rope"):
        check_llama_rope(model)
        return LLAMA
    raise UserError(f"no Hugging Face equivalent for normalization={combo[0]}, MLP={combo[1]}, positions={combo[2]}: "
                    "export supports LayerNorm + GELU + learned_absolute (GPT-2) and RMSNorm + SwiGLU + rope (Llama)")


def check_llama_rope(model: dict) -> None:
    """UserError for rotary settings a Llama-family config cannot hold (also the MoE classes')."""
    if model["rotary_percent"] != 1.0:
        raise UserError(f"--rotary-percent {model['rotary_percent']}: Llama rotates whole heads")
    if model["use_rope_scaling"] and model["rotary_seq_len_interpolation_factor"] is not None:
        raise UserError("--use-rope-scaling with --rotary-seq-len-interpolation-factor: a Llama config has one "
                        "RoPE type (llama3 or linear), not both")


def ffn_size(model: dict) -> int:
    from megatron_po.config import ffn_hidden_size, model_config_from_dict
    return ffn_hidden_size(model_config_from_dict(model))


def _head_dim(model: dict) -> int:
    from megatron_po.config import kv_channels, model_config_from_dict
    return kv_channels(model_config_from_dict(model))


def _groups(model: dict) -> int:
    from megatron_po.config import model_config_from_dict, num_query_groups
    return num_query_groups(model_config_from_dict(model))


def _split_qkv(w: torch.Tensor, groups: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our per-group [(q heads of g, k_g, v_g) for g] rows -> q [heads * head_dim, ...], k and v
    [groups * head_dim, ...]."""
    rest, per_group = w.shape[1:], heads // groups
    blocks = w.reshape(groups, per_group + 2, w.shape[0] // (groups * (per_group + 2)), *rest)
    q, k, v = blocks[:, :per_group], blocks[:, per_group], blocks[:, per_group + 1]
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    hd = k.shape[0] // groups
    blocks = [q.reshape(groups, -1, hd, *rest), k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)]
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def hf_config(model: dict, vocab_size: int):
    """The transformers config object of the architecture `model` maps to."""
    arch = hf_architecture(model)
    model = with_defaults(model)
    tied = not model["untie_embeddings_and_output_weights"]
    if arch == GPT2:
        from transformers import GPT2Config
        return GPT2Config(vocab_size=vocab_size, n_positions=model["max_position_embeddings"] or model["seq_length"],
                          n_embd=model["hidden_size"], n_layer=model["num_layers"], n_head=model["num_attention_heads"],
                          n_inner=ffn_size(model), activation_function="gelu_pytorch_tanh",
                          resid_pdrop=model["hidden_dropout"], embd_pdrop=model["hidden_dropout"],
                          attn_pdrop=model["attention_dropout"], layer_norm_epsilon=model["norm_epsilon"],
                          initializer_range=model["init_method_std"], tie_word_embeddings=tied,
                          bos_token_id=None, eos_token_id=None, architectures=["GPT2LMHeadModel"])
    from transformers import LlamaConfig
    h, nh = model["hidden_size"], model["num_attention_heads"]
    return LlamaConfig(vocab_size=vocab_size, hidden_size=h, intermediate_size=ffn_size(model),
                       num_hidden_layers=model["num_layers"], num_attention_heads=nh,
                       num_key_value_heads=_groups(model), head_dim=_head_dim(model), hidden_act="silu",
                       max_position_embeddings=model["seq_length"], rms_norm_eps=model["norm_epsilon"],
                       initializer_range=model["init_method_std"],
                       rope_parameters=_rope_parameters(model),
                       attention_bias=model["add_bias_linear"], mlp_bias=model["add_bias_linear"],
                       attention_dropout=model["attention_dropout"], tie_word_embeddings=tied,
                       bos_token_id=None, eos_token_id=None, architectures=["LlamaForCausalLM"])


def _rope_parameters(model: dict) -> dict:
    """--rotary-base, --rotary-seq-len-interpolation-factor as HF's "linear" scaling (positions / factor), and
    --use-rope-scaling as its "llama3" type with --rope-scaling-factor and Megatron's fixed constants."""
    theta, factor = float(model["rotary_base"]), model["rotary_seq_len_interpolation_factor"]
    if model["use_rope_scaling"]:
        return {"rope_type": "llama3", "rope_theta": theta, "factor": float(model["rope_scaling_factor"]),
                **_LLAMA3_CONSTANTS}
    if factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}


def to_hf(weights: dict[str, torch.Tensor], model: dict, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our consolidated weights (global names) -> the HF state dict (tied head omitted: HF ties it)."""
    arch = hf_architecture(model)
    model = with_defaults(model)
    L, nh, h, groups = model["num_layers"], model["num_attention_heads"], model["hidden_size"], _groups(model)
    bias = model["add_bias_linear"]
    tied = not model["untie_embeddings_and_output_weights"]
    # --apply-layernorm-1p stores w - 1: HF multiplies by the weight itself.
    w = {k: v + 1 if model["apply_layernorm_1p"] and _is_norm_weight(k) else v for k, v in weights.items()}
    out = {}
    if arch == GPT2:
        def b(name, n):  # GPT-2 always has biases: a bias-free model exports zeros
            return w[name] if bias else torch.zeros(n, dtype=w["final_norm.weight"].dtype)
        out["transformer.wte.weight"] = w["embedding.word_embeddings.weight"][:vocab_size]
        out["transformer.wpe.weight"] = w["embedding.position_embeddings.weight"]
        f = ffn_size(model)
        for i in range(L):
            o, g = f"layers.{i}.", f"transformer.h.{i}."
            out[g + "ln_1.weight"], out[g + "ln_1.bias"] = w[o + "input_norm.weight"], w[o + "input_norm.bias"]
            out[g + "ln_2.weight"] = w[o + "post_attention_norm.weight"]
            out[g + "ln_2.bias"] = w[o + "post_attention_norm.bias"]
            # Conv1D stores [in, out]: transpose every projection.
            out[g + "attn.c_attn.weight"] = torch.cat(_split_qkv(w[o + "attention.qkv.weight"], nh, nh)).t()
            out[g + "attn.c_attn.bias"] = (torch.cat(_split_qkv(w[o + "attention.qkv.bias"], nh, nh)) if bias
                                           else b(None, 3 * h))
            out[g + "attn.c_proj.weight"] = w[o + "attention.proj.weight"].t()
            out[g + "attn.c_proj.bias"] = b(o + "attention.proj.bias", h)
            out[g + "mlp.c_fc.weight"] = w[o + "mlp.fc1.weight"].t()
            out[g + "mlp.c_fc.bias"] = b(o + "mlp.fc1.bias", f)
            out[g + "mlp.c_proj.weight"] = w[o + "mlp.fc2.weight"].t()
            out[g + "mlp.c_proj.bias"] = b(o + "mlp.fc2.bias", h)
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = w["final_norm.weight"], w["final_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = w["embedding.word_embeddings.weight"][:vocab_size]
        for i in range(L):
            o, g = f"layers.{i}.", f"model.layers.{i}."
            out.update(llama_attention(w, i, groups, nh, bias))
            for suffix in ("weight", "bias") if bias else ("weight",):
                out[g + "mlp.gate_proj." + suffix] = w[o + "mlp.fc1_gate." + suffix]
                out[g + "mlp.up_proj." + suffix] = w[o + "mlp.fc1." + suffix]
                out[g + "mlp.down_proj." + suffix] = w[o + "mlp.fc2." + suffix]
        out["model.norm.weight"] = w["final_norm.weight"]
    if not tied:
        out["lm_head.weight"] = w["output_layer.weight"][:vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def llama_attention(w: dict[str, torch.Tensor], i: int, groups: int, heads: int, bias: bool) -> dict:
    """Layer i's norms and attention (our global names -> HF's Llama-family names, `model.layers.<i>.`)."""
    o, g = f"layers.{i}.", f"model.layers.{i}."
    out = {g + "input_layernorm.weight": w[o + "input_norm.weight"],
           g + "post_attention_layernorm.weight": w[o + "post_attention_norm.weight"]}
    for suffix in ("weight", "bias") if bias else ("weight",):
        q, k, v = _split_qkv(w[o + "attention.qkv." + suffix], groups, heads)
        out[g + "self_attn.q_proj." + suffix] = q
        out[g + "self_attn.k_proj." + suffix] = k
        out[g + "self_attn.v_proj." + suffix] = v
        out[g + "self_attn.o_proj." + suffix] = w[o + "attention.proj." + suffix]
    return out


def _is_norm_weight(name: str) -> bool:
    return name.endswith(("input_norm.weight", "post_attention_norm.weight")) or name == "final_norm.weight"


def model_config_from_hf(hf: dict) -> dict:
    """Our ModelConfig fields (a partial dict) from an HF config.json dict."""
    kind = hf.get("model_type")
    if kind == GPT2:
        if hf.get("activation_function") not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            raise UserError(f"GPT-2 activation {hf.get('activation_function')!r} is not supported "
                            "(ours is the tanh GELU: gelu_new / gelu_pytorch_tanh)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
            raise UserError("GPT-2 attention variants (scale_attn_by_inverse_layer_idx, unscaled attention) "
                            "are not supported")
        h = hf["n_embd"]
        return dict(num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
                    ffn_hidden_size=hf.get("n_inner") or 4 * h, seq_length=hf["n_positions"],
                    max_position_embeddings=hf["n_positions"], position_embedding_type="learned_absolute",
                    normalization="LayerNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), swiglu=False,
                    untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                    hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                    init_method_std=hf.get("initializer_range", 0.02), add_bias_linear=True)
    if kind == LLAMA:
        h, nh = hf["hidden_size"], hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or nh
        head_dim = hf.get("head_dim") or h // nh
        if nh % kv_heads != 0:
            raise UserError(f"num_key_value_heads ({kv_heads}) does not divide num_attention_heads ({nh})")
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"Llama activation {hf['hidden_act']!r} is not supported (SwiGLU needs silu)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UserError(f"RoPE scaling {rope_type!r} is not supported (default, linear and llama3 are)")
        if rope_type == "llama3":
            got = {k: rope.get(k) for k in _LLAMA3_CONSTANTS}
            if got != _LLAMA3_CONSTANTS:
                raise UserError(f"llama3 RoPE scaling with {got}: --use-rope-scaling (as Megatron's) fixes "
                                f"{_LLAMA3_CONSTANTS}")
            if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] < 1:
                raise UserError(f"llama3 RoPE scaling factor {rope.get('factor')!r} is not a number >= 1")
        factor = rope.get("factor") if rope_type == "linear" else None
        if factor is not None and float(factor) != int(factor):
            raise UserError(f"linear RoPE scaling factor {factor} is not an integer "
                            f"(--rotary-seq-len-interpolation-factor is)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise UserError(f"rope_theta {theta} is not an integer (--rotary-base is)")
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            raise UserError("attention_bias and mlp_bias differ: --add-bias-linear covers both")
        return dict(num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=nh,
                    group_query_attention=kv_heads != nh, num_query_groups=kv_heads if kv_heads != nh else 1,
                    kv_channels=None if head_dim * nh == h else head_dim, ffn_hidden_size=hf["intermediate_size"],
                    seq_length=hf.get("max_position_embeddings", 2048),
                    position_embedding_type="rope", rotary_base=int(theta), normalization="RMSNorm",
                    rotary_seq_len_interpolation_factor=None if factor is None else int(factor),
                    use_rope_scaling=rope_type == "llama3",
                    rope_scaling_factor=float(rope["factor"]) if rope_type == "llama3" else 8.0,
                    norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
                    untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                    hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
                    init_method_std=hf.get("initializer_range", 0.02),
                    add_bias_linear=bool(hf.get("attention_bias", False)))
    raise UserError(f"model_type {kind!r} is not supported: import-hf reads gpt2 and llama checkpoints")


def from_hf(hf_state: dict[str, torch.Tensor], model: dict, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """HF state dict -> our global weights (vocabulary padded with zero rows)."""
    arch = hf_architecture(model)
    model = with_defaults(model)
    L, nh, groups = model["num_layers"], model["num_attention_heads"], _groups(model)
    bias = model["add_bias_linear"]
    s = hf_state

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] > padded_vocab_size:
            raise UserError(f"vocabulary of {t.shape[0]} rows exceeds the padded size {padded_vocab_size}")
        return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])])

    def need(name):
        if name not in s:
            raise UserError(f"the Hugging Face checkpoint has no tensor {name}")
        return s[name]

    out = {}
    if arch == GPT2:
        out["embedding.word_embeddings.weight"] = pad(need("transformer.wte.weight"))
        out["embedding.position_embeddings.weight"] = need("transformer.wpe.weight")
        for i in range(L):
            o, g = f"layers.{i}.", f"transformer.h.{i}."
            out[o + "input_norm.weight"], out[o + "input_norm.bias"] = need(g + "ln_1.weight"), need(g + "ln_1.bias")
            out[o + "post_attention_norm.weight"] = need(g + "ln_2.weight")
            out[o + "post_attention_norm.bias"] = need(g + "ln_2.bias")
            out[o + "attention.qkv.weight"] = _join_qkv(*need(g + "attn.c_attn.weight").t().chunk(3), nh)
            out[o + "attention.qkv.bias"] = _join_qkv(*need(g + "attn.c_attn.bias").chunk(3), nh)
            out[o + "attention.proj.weight"] = need(g + "attn.c_proj.weight").t()
            out[o + "attention.proj.bias"] = need(g + "attn.c_proj.bias")
            out[o + "mlp.fc1.weight"], out[o + "mlp.fc1.bias"] = need(g + "mlp.c_fc.weight").t(), need(g + "mlp.c_fc.bias")
            out[o + "mlp.fc2.weight"] = need(g + "mlp.c_proj.weight").t()
            out[o + "mlp.fc2.bias"] = need(g + "mlp.c_proj.bias")
        out["final_norm.weight"], out["final_norm.bias"] = need("transformer.ln_f.weight"), need("transformer.ln_f.bias")
    else:
        out["embedding.word_embeddings.weight"] = pad(need("model.embed_tokens.weight"))
        for i in range(L):
            o, g = f"layers.{i}.", f"model.layers.{i}."
            out[o + "input_norm.weight"] = need(g + "input_layernorm.weight")
            out[o + "post_attention_norm.weight"] = need(g + "post_attention_layernorm.weight")
            for suffix in ("weight", "bias") if bias else ("weight",):
                out[o + "attention.qkv." + suffix] = _join_qkv(need(g + "self_attn.q_proj." + suffix),
                                                               need(g + "self_attn.k_proj." + suffix),
                                                               need(g + "self_attn.v_proj." + suffix), groups)
                out[o + "attention.proj." + suffix] = need(g + "self_attn.o_proj." + suffix)
                out[o + "mlp.fc1_gate." + suffix] = need(g + "mlp.gate_proj." + suffix)
                out[o + "mlp.fc1." + suffix] = need(g + "mlp.up_proj." + suffix)
                out[o + "mlp.fc2." + suffix] = need(g + "mlp.down_proj." + suffix)
        out["final_norm.weight"] = need("model.norm.weight")
    if model["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = pad(need("lm_head.weight"))
    return {k: v.contiguous() for k, v in out.items()}
