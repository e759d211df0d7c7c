"""Megatron-LM's model-architecture flags: GQA/MQA, --kv-channels, --qk-layernorm, --apply-layernorm-1p,
--rotary-percent, --attention-backend, --attention-softmax-in-fp32, and the spellings of its examples.

- The MODEL_ARGS of Megatron-LM's Llama-3 8B and GPT-3 175B example scripts (and the Llama-2 script's
  fusion switches) parse to their meaning here; only the sizes are changed.
- Attention has a closed form: for every head i, softmax(q_i k_g^T / sqrt(d) + causal mask) v_g with
  g = i // (heads / groups), q and k optionally normalized per head, RoPE on the first rotary_percent of
  each head. SelfAttention equals it for MHA, GQA and MQA (one group) at TP=1 (fp32, atol 1e-6).
- Grouped-query attention trains the same under TP=2 x PP=2 as in one process: pretrain_gpt.py's loss
  curve within 2e-3 (30 AdamW steps, as test_pretrain_gpt). Every asynchronous method's PP=2 rank equals
  the emulator bit for bit, and PipeDream under TP=2 x PP=2 with sequence parallelism at rtol 1e-5 /
  atol 1e-6 (test_async_pipeline's cases run on a GQA model with q/k norms). Gradient equality under
  TP=2/4 with sequence parallelism is test_gpt_parallel's "llama-gqa" configuration.
"""

import math
import pytest
import torch
import torch.nn.functional as F
from test_pretrain_gpt import assert_same_curve, run_layout

from megatron_po.config import ModelConfig, build_parser, parse_args
from megatron_po.config_rules import validate
from megatron_po.models.transformer import RotaryEmbedding, SelfAttention, apply_rotary, build_norm

# Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh MODEL_ARGS, sizes scaled down (32 heads -> 4,
# 8 query groups -> 2, kv-channels 128 -> 16, 4096 -> 64 hidden).
LLAMA3_MODEL_ARGS = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "auto", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
# The Llama-2 scripts' architecture and fusion switches.
LLAMA2_EXTRA = ["--normalization", "RMSNorm", "--no-position-embedding", "--no-masked-softmax-fusion",
                "--attention-softmax-in-fp32", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm"]
# Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh GPT_MODEL_ARGS (+ --init-method-std), scaled down.
GPT3_MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--max-position-embeddings", "32", "--attention-backend", "auto", "--init-method-std", "0.006"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def test_megatron_example_model_flags_parse_to_their_meaning():
    cfg = parse_args(LLAMA3_MODEL_ARGS + LLAMA2_EXTRA + MOCK)
    validate(cfg, 1)
    m = cfg.model
    assert (m.group_query_attention, m.num_query_groups, m.kv_channels) == (True, 2, 16)
    assert (m.position_embedding_type, m.rotary_base, m.rotary_percent) == ("rope", 1000000, 1.0)
    assert m.apply_layernorm_1p and m.swiglu and m.untie_embeddings_and_output_weights and m.use_mcore_models
    assert not m.add_bias_linear and not m.add_position_embedding and m.normalization == "RMSNorm"
    assert m.attention_softmax_in_fp32 and m.init_method_std == 0.0134 and m.ffn_hidden_size == 224
    assert not any((m.masked_softmax_fusion, m.bias_gelu_fusion, m.bias_dropout_fusion, m.bias_swiglu_fusion,
                    m.apply_rope_fusion, m.gradient_accumulation_fusion, m.persist_layer_norm))
    gpt3 = parse_args(GPT3_MODEL_ARGS + MOCK)
    validate(gpt3, 1)
    assert gpt3.model.attention_backend == "auto" and gpt3.model.init_method_std == 0.006
    # Megatron's spelling and ours are one flag
    assert parse_args(MOCK + ["--no-add-bias-linear"]).model == parse_args(MOCK + ["--disable-bias-linear"]).model


def test_help_describes_every_model_flag_and_the_no_ops():
    helps = {a.dest: (a.option_strings, a.help) for a in build_parser()._actions
             if a.help not in (None, "==SUPPRESS==")}
    for name in ModelConfig.__dataclass_fields__:
        assert name in helps and helps[name][1], name
    assert "no effect" in helps["use_mcore_models"][1]
    assert "--disable-bias-linear" in helps["add_bias_linear"][0]
    for fusion in ("masked_softmax_fusion", "bias_gelu_fusion", "apply_rope_fusion"):
        assert "no effect" in helps[fusion][1], fusion


# ---- the closed form of attention --------------------------------------------------------------------

def reference_attention(attn: SelfAttention, x, groups, heads, head_dim, rotary=None):
    """softmax(q_i k_g^T / sqrt(d) + causal) v_g per head i, g = i // (heads / groups), from the weights."""
    s, b, _ = x.shape
    w = attn.qkv.weight.detach()  # rows: per group, its query heads, then k, then v
    per_group = heads // groups
    blocks = w.view(groups, per_group + 2, head_dim, -1)
    wq, wk, wv = blocks[:, :per_group].reshape(heads, head_dim, -1), blocks[:, per_group], blocks[:, per_group + 1]
    outs = []
    for i in range(heads):
        g = i // per_group
        q, k, v = x @ wq[i].t(), x @ wk[g].t(), x @ wv[g].t()  # [s, b, d]
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = (apply_rotary(t[:, :, None], cos, sin)[:, :, 0] for t in (q, k))
        scores = torch.einsum("sbd,tbd->bst", q, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("bst,tbd->sbd", scores.softmax(-1), v))
    return torch.cat(outs, dim=-1) @ attn.proj.weight.detach().t()


@pytest.mark.parametrize("heads, groups, extra", [
    (4, 4, {}),                                                     # multi-head
    (4, 2, {"group_query_attention": True, "num_query_groups": 2}),  # grouped-query
    (4, 1, {"group_query_attention": True}),                         # multi-query (default --num-query-groups 1)
    (4, 2, {"group_query_attention": True, "num_query_groups": 2, "kv_channels": 12, "qk_layernorm": True,
            "normalization": "RMSNorm", "apply_layernorm_1p": True, "position_embedding_type": "rope",
            "rotary_percent": 0.5}),
], ids=["mha", "gqa", "mqa", "gqa-kv12-qknorm-rope-half"])
def test_attention_equals_its_closed_form(heads, groups, extra):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_attention_heads=heads, attention_dropout=0.0, add_bias_linear=False,
                      **extra)
    attn = SelfAttention(cfg, sequence_parallel=False).eval()
    head_dim = cfg.kv_channels or 32 // heads
    assert attn.qkv.weight.shape == ((heads + 2 * groups) * head_dim, 32)
    assert attn.proj.weight.shape == (32, heads * head_dim)
    if attn.q_norm is not None:  # give the per-head norms non-trivial weights
        with torch.no_grad():
            attn.q_norm.weight.normal_(), attn.k_norm.weight.normal_()
    x = torch.randn(10, 3, 32)
    rotary = None
    if cfg.position_embedding_type == "rope":
        rotary = RotaryEmbedding(int(head_dim * cfg.rotary_percent), cfg.rotary_base)(10, x.device)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, rotary), reference_attention(attn, x, groups, heads, head_dim, rotary),
                                   rtol=1e-5, atol=1e-6)


def test_position_embedding_type_none_has_no_position_encoding():
    """A run of one repeated token: without position encoding every position computes the same logits
    (causal attention over identical keys and values returns that value); learned positions tell them apart."""
    from megatron_po.models.gpt import GPTModel
    ids = torch.full((1, 8), 5)
    logits = {}
    for kind in ("none", "learned_absolute"):
        model = GPTModel(ModelConfig(position_embedding_type=kind, hidden_dropout=0.0, attention_dropout=0.0,
                                     seq_length=8), 64, seed=0)
        assert (model.embedding.position_embeddings is None) == (kind == "none") and model.rotary is None
        with torch.no_grad():
            logits[kind] = model(ids)[:, 0]  # [s, V]
    torch.testing.assert_close(logits["none"], logits["none"][:1].expand(8, -1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits["learned_absolute"][0], logits["learned_absolute"][1], atol=1e-3)


def test_rotary_percent_and_interpolation_closed_form():
    x = torch.randn(6, 2, 3, 16)
    cos, sin = RotaryEmbedding(8, 10000)(6, x.device)  # --rotary-percent 0.5 of head dimension 16
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))
    # closed form of the rotated part: pairs (j, j + 4) turn by angle t * base^(-2j/8)
    t, j = torch.arange(6.0)[:, None], torch.arange(4.0)[None]
    angle = (t * 10000 ** (-2 * j / 8))[:, None, None, :]
    a, b = x[..., :4], x[..., 4:8]
    torch.testing.assert_close(out[..., :4], a * angle.cos() - b * angle.sin())
    torch.testing.assert_close(out[..., 4:8], b * angle.cos() + a * angle.sin())
    # --rotary-seq-len-interpolation-factor 2: position t turns as position t / 2 does (even t: exactly)
    cos2, sin2 = RotaryEmbedding(8, 10000, interpolation_factor=2)(6, x.device)
    torch.testing.assert_close(cos2[::2], cos[:3])
    torch.testing.assert_close(sin2[::2], sin[:3])


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_is_the_plain_norm_with_weight_plus_one(normalization):
    one_p = build_norm(ModelConfig(normalization=normalization, apply_layernorm_1p=True), 16, False)
    plain = build_norm(ModelConfig(normalization=normalization), 16, False)
    assert not one_p.weight.any()  # zero-centered: starts at 0, i.e. scale 1
    with torch.no_grad():
        one_p.weight.normal_()
        plain.weight.copy_(one_p.weight + 1)
        if normalization == "LayerNorm":
            one_p.bias.normal_()
            plain.bias.copy_(one_p.bias)
    x = torch.randn(5, 16)
    torch.testing.assert_close(one_p(x), plain(x))


def test_attention_backends_and_fp32_softmax_compute_the_same_function():
    torch.manual_seed(1)
    x = torch.randn(12, 2, 32)
    outs = {}
    for backend in ("auto", "local", "unfused"):
        torch.manual_seed(2)
        attn = SelfAttention(ModelConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                                         attention_backend=backend), False).eval()
        with torch.no_grad():
            outs[backend] = attn(x)
    torch.testing.assert_close(outs["local"], outs["auto"], rtol=1e-5, atol=1e-6)
    assert torch.equal(outs["local"], outs["unfused"])
    # --attention-softmax-in-fp32: a bf16 layer's attention runs on the fp32 casts of its bf16 q, k, v
    torch.manual_seed(2)
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.0, attention_softmax_in_fp32=True)
    attn = SelfAttention(cfg, False).eval().to(torch.bfloat16)
    captured = {}
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        captured["dtype"] = q.dtype
        return real_sdpa(q, k, v, **kw)

    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            out = attn(x.to(torch.bfloat16))
    finally:
        F.scaled_dot_product_attention = real_sdpa
    assert captured["dtype"] == torch.float32 and out.dtype == torch.bfloat16


def test_attention_backend_on_transformer_engine_sets_megatrons_nvte_switches():
    from megatron_po.models.te_transformer import te_attention_backend_env
    assert te_attention_backend_env("auto") == {}
    for backend, on in [("flash", "NVTE_FLASH_ATTN"), ("fused", "NVTE_FUSED_ATTN"), ("unfused", "NVTE_UNFUSED_ATTN"),
                        ("local", "NVTE_UNFUSED_ATTN")]:
        env = te_attention_backend_env(backend)
        assert env[on] == "1" and sorted(env.values()) == ["0", "0", "1"], backend


# ---- GQA under model parallelism ---------------------------------------------------------------------

GQA_FLAGS = {"--num-attention-heads": 4, "--group-query-attention": True, "--num-query-groups": 2,
             "--kv-channels": 24, "--qk-layernorm": True, "--apply-layernorm-1p": True,
             "--normalization": "RMSNorm", "--swiglu": True, "--position-embedding-type": "rope",
             "--rotary-percent": 0.5, "--no-position-embedding": True, "--disable-bias-linear": True,
             "--untie-embeddings-and-output-weights": True}


def test_gqa_tp2_pp2_pretrain_matches_single_process(corpus, tmp_path):
    single = run_layout(corpus, tmp_path, "single", 1, **GQA_FLAGS)
    parallel = run_layout(corpus, tmp_path, "tp2pp2", 4, **GQA_FLAGS, **{"--tensor-model-parallel-size": 2,
                                                                            "--pipeline-model-parallel-size": 2})
    losses = [r["lm_loss"] for r in single if "lm_loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    assert_same_curve(single, parallel)


@pytest.fixture
def gqa_async_model(monkeypatch):
    """test_async_pipeline's trainers on their model with GQA (4 heads, 2 groups), head dim 12, q/k norms."""
    import test_async_pipeline

    def make_cfg(num_layers, tied=False, base=test_async_pipeline.make_cfg):
        cfg = base(num_layers, tied)
        cfg.model.num_attention_heads, cfg.model.group_query_attention, cfg.model.num_query_groups = 4, True, 2
        cfg.model.kv_channels, cfg.model.qk_layernorm = 12, True
        return cfg

    monkeypatch.setattr(test_async_pipeline, "make_cfg", make_cfg)  # the forked ranks inherit it
    model = test_async_pipeline.make_cfg(2).model
    assert model.group_query_attention and model.kv_channels == 12 and model.qk_layernorm
    return test_async_pipeline


@pytest.mark.parametrize("method, optimizer, k", [("async-naive", "adam", 1), ("pipedream", "adam", 1),
                                                  ("pipedream-2bw", "adam", 2), ("spectrain", "sgd", 1),
                                                  ("pipeoptim", "adam", 1)])
def test_gqa_async_methods_pp2_equal_emulator_bitwise(gqa_async_model, method, optimizer, k):
    gqa_async_model.test_distributed_equals_emulator_bitwise(method, optimizer, 2, 1, k, (4, 6), {})


def test_gqa_async_tp2_pp2_sequence_parallel_equals_emulator(gqa_async_model):
    """PipeDream, TP=2 (one key/value group per rank) x PP=2, sequence parallel, clipping always active:
    rtol 1e-5 / atol 1e-6 as test_async_pipeline's TP case."""
    gqa_async_model.test_tp2_pp2_sequence_parallel_equals_emulator_with_clipping()
