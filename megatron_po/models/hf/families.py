"""The Hugging Face families served, as data: for each, its config.json `model_type`, its class, its tensor table
(tensors.py's rules: every tensor the family can hold, our name <-> theirs) and the config keys its choices live
under. `FAMILIES` is the list; configs.py reads and writes config.json from these entries.

    family      class                  beyond Llama (RMSNorm + SwiGLU + RoPE + grouped-query attention)
    gpt2        GPT2LMHeadModel        LayerNorm + GELU + learned positions, biases, Conv1D (its own table)
    llama       LlamaForCausalLM       biases on every linear (attention_bias = mlp_bias), llama3 / linear RoPE
    mistral     MistralForCausalLM     (sliding_window must be off)
    qwen2       Qwen2ForCausalLM       q/k/v biases, always (--add-qkv-bias)
    qwen3       Qwen3ForCausalLM       per-head q/k RMSNorm, always (--qk-layernorm)
    mixtral     MixtralForCausalLM     every layer MoE, softmax top-k renormalized
    qwen2_moe   Qwen2MoeForCausalLM    q/k/v biases (qkv_bias), dense layers (mlp_only_layers), a shared expert
                                       with a sigmoid gate, norm_topk_prob (false: --moe-router-pre-softmax)
    qwen3_moe   Qwen3MoeForCausalLM    q/k norms, dense layers (mlp_only_layers), norm_topk_prob
    glm4_moe    Glm4MoeForCausalLM     q/k/v biases (attention_bias), q/k norms (use_qk_norm), partial rotary,
                                       the first k layers dense, shared experts, sigmoid scores with the expert
                                       bias (e_score_correction_bias), routed_scaling_factor, group routing,
                                       multi-token prediction (num_nextn_predict_layers: --mtp-num-layers)
    deepseek_v3 DeepseekV3ForCausalLM  GLM-4.5's MoE, routing and MTP, with multi-latent attention instead of
                                       grouped-query (--multi-latent-attention, configs.py): DeepSeek-V3/R1,
                                       Kimi K2 (model_type kimi_k2), Moonlight (no query latent); also a dense MLA
                                       model (first_k_dense_replace = the number of layers)

Qwen2-MoE scales its shared expert by sigmoid(shared_expert_gate(x)): --moe-shared-expert-gate (Megatron's), imported
as such. A model of ours with ungated shared experts exports as a zero gate (sigmoid 0 = 1/2) and twice its down
projection: 1/2 x (2 W a) is W a exactly (powers of two). A Qwen2-MoE without shared experts has one of size 0
(an empty sum, with a gate that gates nothing): written as zeros, not imported.
"""

from __future__ import annotations

import dataclasses

from typing import Callable

from megatron_po.models.hf.tensors import Mapping, Rule, rule

L = "model.layers.{i}."


def _swiglu(ours: str, theirs: str, bias: bool = False) -> tuple[Rule, ...]:
    """A SwiGLU MLP: our fc1_gate, fc1, fc2 <-> gate_proj, up_proj, down_proj (and their biases)."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return tuple(rule(f"{ours}{a}.{s}", f"{theirs}{b}.{s}") for a, b in
                 (("fc1_gate", "gate_proj"), ("fc1", "up_proj"), ("fc2", "down_proj")) for s in suffixes)


def _experts(theirs: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Our stacked experts <-> one tensor per expert (`theirs` holds {e})."""
    return tuple(rule(f"layers.{{i}}.mlp.experts.{ours}", theirs + name + ".weight", kind="experts")
                 for ours, name in (("fc1_gate", gate), ("fc1", up), ("fc2", down)))


# Every family's tensors but GPT-2's around the attention: embedding, head, final norm, the layer norms, a dense MLP.
AROUND_ATTENTION = (
    rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", kind="vocab"),
    rule("output_layer.weight", "lm_head.weight", kind="vocab"),
    rule("final_norm.weight", "model.norm.weight", kind="norm"),
    rule("layers.{i}.input_norm.weight", L + "input_layernorm.weight", kind="norm"),
    rule("layers.{i}.post_attention_norm.weight", L + "post_attention_layernorm.weight", kind="norm"),
    *_swiglu("layers.{i}.mlp.", L + "mlp.", bias=True),  # a dense layer's MLP
)
# The Llama family's attention (grouped-query, its biases and q/k norms) and its tensors around it.
LLAMA_LIKE = AROUND_ATTENTION + (
    *(rule(f"layers.{{i}}.attention.qkv.{s}", *(f"{L}self_attn.{x}_proj.{s}" for x in "qkv"), kind="qkv")
      for s in ("weight", "bias")),
    rule("layers.{i}.attention.proj.weight", L + "self_attn.o_proj.weight"),
    rule("layers.{i}.attention.proj.bias", L + "self_attn.o_proj.bias"),
    rule("layers.{i}.attention.q_norm.weight", L + "self_attn.q_norm.weight", kind="norm"),
    rule("layers.{i}.attention.k_norm.weight", L + "self_attn.k_norm.weight", kind="norm"),
)
# DeepSeek-V3's multi-latent attention (models/mla.py), every tensor a copy: the query from a latent (q_a_proj,
# q_a_layernorm, q_b_proj) or, without one (Moonlight), from q_proj; the key/value latent with the shared rotary
# key's rows after it (kv_a_proj_with_mqa), its norm and up-projection; o_proj. The rotary rows stay in DeepSeek's
# interleaved pairs both ways (rope_interleave true, what our MLA reads).
MLA = tuple(rule(f"layers.{{i}}.attention.{ours}.weight", f"{L}self_attn.{theirs}.weight",
                 kind="norm" if "norm" in ours else "copy")
            for ours, theirs in (("q_proj", "q_proj"), ("q_down", "q_a_proj"), ("q_norm", "q_a_layernorm"),
                                 ("q_up", "q_b_proj"), ("kv_down", "kv_a_proj_with_mqa"),
                                 ("kv_norm", "kv_a_layernorm"), ("kv_up", "kv_b_proj"), ("proj", "o_proj")))
# Multi-token prediction as DeepSeek-V3's and GLM-4.5's Hub checkpoints hold it: depth d is layer L + d (tensors.py's
# mtp_alias), its transformer layer that layer's tensors (the tables above), these its own; plus copies of the
# embedding and the head in that layer (MTP_SHARED: written by export, not read by import).
MTP = (
    rule("layers.{i}.mtp.enorm.weight", L + "enorm.weight", kind="norm"),
    rule("layers.{i}.mtp.hnorm.weight", L + "hnorm.weight", kind="norm"),
    rule("layers.{i}.mtp.eh_proj.weight", L + "eh_proj.weight"),
    rule("layers.{i}.mtp.final_norm.weight", L + "shared_head.norm.weight", kind="norm"),
)
MTP_SHARED = (("embedding.word_embeddings.weight", L + "embed_tokens.weight"),
              ("output_layer.weight", L + "shared_head.head.weight"))
QWEN_MOE = (
    rule("layers.{i}.mlp.router.weight", L + "mlp.gate.weight"),
    *_experts(L + "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
)
GPT2 = (
    rule("embedding.word_embeddings.weight", "transformer.wte.weight", kind="vocab"),
    rule("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    rule("output_layer.weight", "lm_head.weight", kind="vocab"),
    rule("final_norm.weight", "transformer.ln_f.weight", kind="norm"),
    rule("final_norm.bias", "transformer.ln_f.bias"),
    rule("layers.{i}.input_norm.weight", "transformer.h.{i}.ln_1.weight", kind="norm"),
    rule("layers.{i}.input_norm.bias", "transformer.h.{i}.ln_1.bias"),
    rule("layers.{i}.post_attention_norm.weight", "transformer.h.{i}.ln_2.weight", kind="norm"),
    rule("layers.{i}.post_attention_norm.bias", "transformer.h.{i}.ln_2.bias"),
    rule("layers.{i}.attention.qkv.weight", "transformer.h.{i}.attn.c_attn.weight", kind="conv1d_qkv"),
    rule("layers.{i}.attention.qkv.bias", "transformer.h.{i}.attn.c_attn.bias", kind="fused_qkv"),
    rule("layers.{i}.attention.proj.weight", "transformer.h.{i}.attn.c_proj.weight", kind="conv1d"),
    rule("layers.{i}.attention.proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
    rule("layers.{i}.mlp.fc1.weight", "transformer.h.{i}.mlp.c_fc.weight", kind="conv1d"),
    rule("layers.{i}.mlp.fc1.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    rule("layers.{i}.mlp.fc2.weight", "transformer.h.{i}.mlp.c_proj.weight", kind="conv1d"),
    rule("layers.{i}.mlp.fc2.bias", "transformer.h.{i}.mlp.c_proj.bias"),
)


def qwen2_moe_shared_expert(mappings: list[Mapping], m) -> list[Mapping]:
    """Qwen2-MoE's gated shared expert (module docstring): a model of ours without the gate writes a zero one and
    twice its down projection; without shared experts theirs has size 0 (and a gate that gates nothing)."""
    out = []
    gated = m.moe_shared_expert_gate
    for mp in mappings:
        if mp.ours is not None and mp.ours.endswith(".mlp.shared_experts.fc2.weight") and not gated:
            mp = Mapping(mp.ours, mp.theirs, "double")
        out.append(mp)
        if mp.ours is not None and mp.ours.endswith(".mlp.router.weight") and not gated:
            block, h = mp.theirs[0].removesuffix("gate.weight"), m.hidden_size
            out.append(Mapping(None, [block + "shared_expert_gate.weight"], "zeros", (1, h)))
            if not m.moe_shared_expert_intermediate_size:
                out += [Mapping(None, [f"{block}shared_expert.{name}.weight"], "zeros", shape)
                        for name, shape in (("gate_proj", (0, h)), ("up_proj", (0, h)), ("down_proj", (h, 0)))]
    return out


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF family. Config keys name where config.json holds a choice; True/False: the class always/never has it."""
    model_type: str
    architecture: str
    tensors: tuple[Rule, ...]
    linear_bias: bool = False           # Llama: attention_bias and mlp_bias (--add-bias-linear)
    qkv_bias: str | bool = False        # q/k/v biases only (--add-qkv-bias)
    qk_norm: str | bool = False         # per-head q/k RMSNorm (--qk-layernorm)
    sliding_window: bool = False        # has a sliding-window option (must be off)
    partial_rotary: bool = False        # rope_parameters' partial_rotary_factor (--rotary-percent)
    experts: str | None = None          # config key of the routed experts' count; None: dense
    expert_ffn: str = "moe_intermediate_size"
    dense_layers: str | None = None     # "mlp_only_layers" (any), "first_k_dense_replace" (the first k); None: none
    shared: str | None = None           # "shared_expert_intermediate_size" (Qwen2-MoE, gated), "n_shared_experts" (GLM)
    router: str = "softmax"             # "softmax" (norm_topk_prob: `topk_norm`); "sigmoid" (+ bias, scaling, groups)
    topk_norm: bool = True              # has norm_topk_prob (Mixtral: always renormalized)
    refused: tuple[str, ...] = ()       # config keys whose true value nothing here expresses (import refuses)
    adjust: Callable | None = None      # adjust(mappings, model config) -> mappings: what the table cannot say
    mtp: str | None = None              # config key of the multi-token prediction depths (MTP rules); None: none
    mla: bool = False                   # multi-latent attention (DeepSeek-V3's) instead of grouped-query
    holds_dense: bool = False           # an MoE class that also holds a dense model (every layer dense)
    aliases: tuple[str, ...] = ()       # other model_types of config.json naming this class (Kimi K2's)
    # What transformers' config class takes besides our mapping (export) and checks nothing of (import).
    fixed: tuple[tuple[str, object], ...] = ()


FAMILIES = (
    Family("gpt2", "GPT2LMHeadModel", GPT2),
    Family("llama", "LlamaForCausalLM", LLAMA_LIKE, linear_bias=True),
    Family("mistral", "MistralForCausalLM", LLAMA_LIKE, sliding_window=True, fixed=(("sliding_window", None),)),
    Family("qwen2", "Qwen2ForCausalLM", LLAMA_LIKE, qkv_bias=True, sliding_window=True,
           fixed=(("use_sliding_window", False),)),
    Family("qwen3", "Qwen3ForCausalLM", LLAMA_LIKE, qk_norm=True, sliding_window=True, refused=("attention_bias",),
           fixed=(("use_sliding_window", False), ("attention_bias", False))),
    Family("mixtral", "MixtralForCausalLM", LLAMA_LIKE + (
        rule("layers.{i}.mlp.router.weight", L + "block_sparse_moe.gate.weight"),
        *_experts(L + "block_sparse_moe.experts.{e}.", "w1", "w3", "w2")),
        sliding_window=True, experts="num_local_experts", expert_ffn="intermediate_size", topk_norm=False,
        fixed=(("sliding_window", None), ("router_jitter_noise", 0.0))),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", LLAMA_LIKE + QWEN_MOE + (
        *_swiglu("layers.{i}.mlp.shared_experts.", L + "mlp.shared_expert."),
        rule("layers.{i}.mlp.shared_experts.gate_weight", L + "mlp.shared_expert_gate.weight")),
        qkv_bias="qkv_bias", sliding_window=True, experts="num_experts", dense_layers="mlp_only_layers",
        shared="shared_expert_intermediate_size", adjust=qwen2_moe_shared_expert,
        fixed=(("use_sliding_window", False), ("decoder_sparse_step", 1))),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", LLAMA_LIKE + QWEN_MOE, qk_norm=True, sliding_window=True,
           experts="num_experts", dense_layers="mlp_only_layers", refused=("attention_bias",),
           fixed=(("use_sliding_window", False), ("decoder_sparse_step", 1), ("attention_bias", False))),
    Family("glm4_moe", "Glm4MoeForCausalLM", LLAMA_LIKE + QWEN_MOE + MTP + (
        rule("layers.{i}.mlp.router.expert_bias", L + "mlp.gate.e_score_correction_bias"),
        *_swiglu("layers.{i}.mlp.shared_experts.", L + "mlp.shared_experts.")),
        qkv_bias="attention_bias", qk_norm="use_qk_norm", partial_rotary=True, experts="n_routed_experts",
        dense_layers="first_k_dense_replace", shared="n_shared_experts", router="sigmoid",
        mtp="num_nextn_predict_layers"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", AROUND_ATTENTION + MLA + QWEN_MOE + MTP + (
        rule("layers.{i}.mlp.router.expert_bias", L + "mlp.gate.e_score_correction_bias"),
        *_swiglu("layers.{i}.mlp.shared_experts.", L + "mlp.shared_experts.")),
        qk_norm=True, experts="n_routed_experts", dense_layers="first_k_dense_replace", shared="n_shared_experts",
        router="sigmoid", refused=("attention_bias",), mtp="num_nextn_predict_layers", mla=True, holds_dense=True,
        aliases=("kimi_k2",), fixed=(("attention_bias", False), ("rope_interleave", True))),
)
BY_TYPE = {t: f for f in FAMILIES for t in (f.model_type, *f.aliases)}
