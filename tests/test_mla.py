"""Multi-latent attention (issue 54 item 1): its math, and what composes with it in one process.

- transformers' DeepseekV3Attention on the same weights (fp32, atol 1e-5 on outputs of magnitude ~10, reduction
  orders): with and without query compression (--q-lora-rank), YaRN with a factor, mscale and mscale_all_dim that
  change frequencies, cos/sin and the softmax scale (its frequencies bitwise transformers'), and plain RoPE
  (--rope-type rope); DeepSeek's interleaved rotary layout (rope_interleave=True, Megatron's under MLA). A
  checkpoint laid out rotate-half (rope_interleave=False) is the same attention with the rotary rows of q_b_proj
  and kv_a_proj_with_mqa permuted (evens first): the test does that permutation.
- One GPT process: recomputation (full uniform and block, selective) gives bitwise the run without it (dropout on);
  compiled layers (TorchDynamo + AOTAutograd, aot_eager) the eager losses and gradients within 1e-6; the chunked
  output loss the unchunked one within 1e-6; FP8 (torchao, emulated) runs every MLA projection in FP8 and no
  norm, and trains; a document mask with reset positions gives a document the losses it has alone (1e-5); on a
  CPU the core runs PyTorch's fused kernel (the values padded to the query/key head dimension), which keeps no
  [b, heads, s, s] probabilities for the backward, and gives the math kernel's output (1e-6).
- FLOPs: Megatron's MLA count (num_floating_point_operations), by hand for a DeepSeek-V3-shaped layer, and equal to
  torch's FLOP counter on an MLA GPT's forward + backward but for the latent norms' terms Megatron adds.
- Hugging Face export picks DeepseekV3ForCausalLM, or says in one line why it cannot; the start-up line says what
  runs.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by compile: once here)
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from megatron_po.config import Config, ModelConfig
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.mla import MultiLatentAttention, mla_rotary
from megatron_po.tensor_parallel import model_parallel_seed

H, HEADS, SEQ, B = 64, 4, 16, 2
# Small original context and a factor: YaRN interpolates some frequencies at these lengths; mscale_all_dim != mscale
# makes the cos/sin factor and the softmax scale both differ from 1.
YARN = {"factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8}
OURS = dict(hidden_size=H, num_attention_heads=HEADS, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-6,
            add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0)
WEIGHTS = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "q_proj": "q_proj",
           "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "proj": "o_proj"}


def pair(q_lora_rank, rope: str, interleaved: bool = True):
    """(ours, transformers' attention, transformers' rotary) on the same random weights."""
    rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN} if rope == "yarn" else \
        {"rope_type": "default", "rope_theta": 10000.0}
    hf_cfg = DeepseekV3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=12, attention_bias=False, attention_dropout=0.0, max_position_embeddings=64,
                              rope_interleave=interleaved, rope_parameters=rope_parameters)
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    yarn = dict(rope_type="yarn", rotary_scaling_factor=YARN["factor"], mscale=YARN["mscale"],
                mscale_all_dim=YARN["mscale_all_dim"],
                yarn_original_max_position_embeddings=YARN["original_max_position_embeddings"])
    cfg = ModelConfig(**OURS, q_lora_rank=q_lora_rank, **(yarn if rope == "yarn" else {"rope_type": "rope"}))
    ours = MultiLatentAttention(cfg, sequence_parallel=False).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, hf_name in WEIGHTS.items():
            mine, theirs = getattr(ours, name), getattr(hf, hf_name)
            assert (mine is None) == (theirs is None), name
            if mine is None:
                continue
            w = theirs.weight
            if "norm" in name:
                w.copy_(torch.rand(w.shape, generator=g) + 0.5)
            else:
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
            mine.weight.copy_(w)
    return ours, hf, DeepseekV3RotaryEmbedding(hf_cfg), cfg


def outputs(ours, hf, hf_rotary, cfg, x):
    positions = torch.arange(SEQ)[None].expand(B, SEQ)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    ref, _ = hf(x, hf_rotary(x, positions), causal)
    rotary = mla_rotary(cfg)
    out = ours(x.transpose(0, 1), rotary(SEQ, x.device)).transpose(0, 1)
    return out, ref, rotary


@pytest.mark.parametrize("q_lora_rank,rope", [(16, "yarn"), (None, "yarn"), (16, "rope")],
                         ids=["q-lora-yarn", "no-q-lora-yarn", "q-lora-plain-rope"])
def test_equals_transformers_deepseek_v3_attention(q_lora_rank, rope):
    ours, hf, hf_rotary, cfg = pair(q_lora_rank, rope)
    x = torch.randn(B, SEQ, H, generator=torch.Generator().manual_seed(2))
    out, ref, rotary = outputs(ours, hf, hf_rotary, cfg, x)
    assert torch.equal(rotary.inv_freq, hf_rotary.inv_freq)  # YaRN's frequencies bit for bit
    assert rotary.attention_factor == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)
    scale = ours.softmax_scale if ours.softmax_scale is not None else 1 / (8 + 8) ** 0.5  # None: the default
    assert scale == pytest.approx(hf.scaling, rel=1e-12)
    if rope == "yarn":  # the settings mattered: interpolated frequencies, scaled cos/sin, another softmax scale
        assert not torch.equal(rotary.inv_freq, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        assert rotary.attention_factor != 1.0 and ours.softmax_scale is not None
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert ref.abs().max() > 1.0


def test_rotate_half_checkpoint_is_a_row_permutation():
    """rope_interleave=False (rotary rows laid out rotate-half) equals this code with those rows permuted: the
    pe rows of q_b_proj (per head) and kv_a_proj_with_mqa, position 2i <- i and 2i+1 <- d/2 + i."""
    ours, hf, hf_rotary, cfg = pair(16, "yarn", interleaved=False)
    d_n, d_r, r = 8, 8, 16
    to_interleaved = torch.stack([torch.arange(d_r // 2), torch.arange(d_r // 2) + d_r // 2], dim=1).reshape(-1)
    with torch.no_grad():
        q = ours.q_up.weight.view(HEADS, d_n + d_r, -1)
        q[:, d_n:] = q[:, d_n:][:, to_interleaved]
        kv = ours.kv_down.weight
        kv[r:] = kv[r:][to_interleaved]
    x = torch.randn(B, SEQ, H, generator=torch.Generator().manual_seed(2))
    out, ref, _ = outputs(ours, hf, hf_rotary, cfg, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# ---- one GPT process ---------------------------------------------------------------------------------------

VOCAB, SEED = 64, 11
GPT_MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, make_vocab_size_divisible_by=8,
               untie_embeddings_and_output_weights=True, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
               position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16,
               qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, rotary_scaling_factor=4.0,
               mscale_all_dim=0.8, yarn_original_max_position_embeddings=8)


def gpt_cfg(**model) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**GPT_MLA), **model)


def batch(salt: int = 0) -> dict:
    g = torch.Generator().manual_seed(5 + salt)
    tokens = torch.randint(0, VOCAB, (B, SEQ + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(B, SEQ)}


def loss_and_grads(model_cfg: ModelConfig, prepare=None, steps: int = 1):
    """Mean loss and every gradient after `steps` forward/backward passes (dropout drawn from SEED's streams)."""
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    net = GPTModel(model_cfg, VOCAB, SEED)
    if prepare is not None:
        prepare(net)
    losses = []
    for step in range(steps):
        b = batch(step)
        loss = masked_mean_loss(net(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {k: p.grad.clone() for k, p in net.named_parameters()}


def test_recomputation_changes_nothing():
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)
    plain = loss_and_grads(gpt_cfg(**dropout), steps=2)
    for recompute in (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                      dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                      dict(recompute_granularity="selective")):
        losses, grads = loss_and_grads(gpt_cfg(**dropout, **recompute), steps=2)
        assert torch.equal(losses, plain[0]), recompute
        assert all(torch.equal(grads[k], plain[1][k]) for k in grads), recompute


def test_compiled_layers_and_chunked_loss_follow_eager(monkeypatch):
    """No dropout: a compiled graph draws its masks from inductor's generator (docs/compile.md), and it would cut the
    layer into more graphs."""
    from megatron_po.models import compiled_layers
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    quiet = dict(hidden_dropout=0.0, attention_dropout=0.0)
    eager = loss_and_grads(gpt_cfg(**quiet), steps=2)
    # the layers only: the chunked output loss compiles for MLA as for any model (tests/test_compiled_layers.py)
    compiled = loss_and_grads(gpt_cfg(torch_compile=True, **quiet),
                              lambda net: compiled_layers.compile_layers([types.SimpleNamespace(layers=net.layers)]),
                              steps=2)
    unchunked = loss_and_grads(gpt_cfg(chunked_output_loss=False, **quiet), steps=2)
    for losses, grads in (compiled, unchunked):
        torch.testing.assert_close(losses, eager[0], rtol=1e-6, atol=1e-6)
        for k in grads:
            torch.testing.assert_close(grads[k], eager[1][k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-lora", "no-q-lora"])
def test_fp8_runs_every_mla_projection_in_fp8(q_lora_rank):
    cfg = gpt_cfg(q_lora_rank=q_lora_rank, kv_lora_rank=32, v_head_dim=16, fp8_format="hybrid")
    model_parallel_seed(SEED)
    net = GPTModel(cfg, VOCAB, SEED)
    marked = {n.split(".", 2)[2] for n, m in net.named_modules() if n.startswith("layers.0.")
              and getattr(m, "fp8", None) is not None}
    q = {"attention.q_down", "attention.q_up"} if q_lora_rank else {"attention.q_proj"}
    assert marked == q | {"attention.kv_down", "attention.kv_up", "attention.proj", "mlp.fc1", "mlp.fc1_gate",
                          "mlp.fc2"}
    fp8_losses, grads = loss_and_grads(cfg, steps=2)
    plain_losses, _ = loss_and_grads(dataclasses.replace(cfg, fp8_format=None), steps=2)
    assert not torch.equal(fp8_losses, plain_losses)  # the roundings of FP8 happened
    torch.testing.assert_close(fp8_losses, plain_losses, rtol=0, atol=0.02)
    assert all(g.isfinite().all() and g.any() for g in grads.values())


def test_document_mask_gives_a_document_its_losses_alone():
    """[A | B] with --reset-attention-mask and --reset-position-ids: B's token losses are those of B alone."""
    model_parallel_seed(SEED)
    net = GPTModel(gpt_cfg(), VOCAB, SEED).eval()
    b = batch()
    half = SEQ // 2
    packed = {**b, "document_ids": (torch.arange(SEQ) >= half).long().expand(B, SEQ),
              "position_ids": (torch.arange(SEQ) % half).expand(B, SEQ)}
    with torch.no_grad():
        together = net(packed)
        alone = net(input_ids=b["tokens"][:, half:], labels=b["labels"][:, half:])
        first = net(input_ids=b["tokens"][:, :half], labels=b["labels"][:, :half])
    torch.testing.assert_close(together[:, half:], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(together[:, :half], first, rtol=0, atol=1e-5)


# ---- FLOPs ----------------------------------------------------------------------------------------------------

def test_flops_count_megatrons_mla_projections():
    """Megatron's num_floating_point_operations, MLA branch (per token, 3 x 2 x multiply-adds): q (with the latent
    norm's rank counted once more), kv latent and up-projection (likewise), the shared rotary key, the output
    projection; the core over the causal half, scores at the query/key head dimension and values at the value's."""
    from megatron_po.flops import gpt_flops_per_token
    cfg = Config()
    cfg.model = ModelConfig(num_layers=1, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                            ffn_hidden_size=18432, swiglu=True, multi_latent_attention=True, q_lora_rank=1536,
                            kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    h, n, s, V = 7168, 128, 4096, 1000
    q = 1536 * (h + n * 192 + 1)
    kv = 512 * (h + n * (128 + 128) + 1) + h * 64
    projections = q + kv + n * 128 * h
    core = s * n * (192 + 128) / 2
    mlp = 3 * h * 18432
    expected = 3 * 2 * (projections + core + mlp + h * V)
    assert gpt_flops_per_token(cfg, V, causal=True) == pytest.approx(expected, rel=1e-12)
    assert gpt_flops_per_token(cfg, V) == pytest.approx(expected + 3 * 2 * core, rel=1e-12)  # the full square
    cfg.model.q_lora_rank = None  # Moonlight: the query projected from the hidden state
    assert gpt_flops_per_token(cfg, V, causal=True) == pytest.approx(expected - 3 * 2 * (q - h * n * 192), rel=1e-12)


def test_core_keeps_no_probabilities_on_the_cpu():
    """The values' narrower head dimension would send SDPA to the math kernel, which saves the [b, heads, s, s]
    probabilities for the backward; padded with zero columns it stays on the fused CPU kernel (the same output).
    64 tokens: below some length PyTorch picks the math kernel whatever the head dimensions."""
    seq = 64
    x = torch.randn(seq, B, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    outs = {}
    for backend in ("auto", "local"):
        model_parallel_seed(SEED)
        cfg = gpt_cfg(attention_backend=backend, attention_dropout=0.0, seq_length=seq)
        attention = MultiLatentAttention(cfg, sequence_parallel=False)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            outs[backend] = attention(x, mla_rotary(cfg)(seq, x.device))
        square = [shape for shape in saved if shape[-2:] == (seq, seq)]
        assert bool(square) == (backend == "local"), (backend, square)
    torch.testing.assert_close(outs["auto"], outs["local"], rtol=0, atol=1e-6)


def test_hugging_face_export_is_deepseek_v3_or_one_line():
    """MLA exports as DeepseekV3ForCausalLM (tests/test_hf_families.py round-trips it); what that class cannot hold
    (softmax routing, no latent norms) is one line, and no other class takes MLA."""
    from megatron_po.errors import UserError
    from megatron_po.models.hf.configs import export_family
    assert export_family(gpt_cfg()).model_type == "deepseek_v3"
    for extra, needle in [({"num_experts": 4}, "DeepseekV3ForCausalLM: softmax routing"),
                          ({"qk_layernorm": False}, "DeepseekV3ForCausalLM: multi-latent attention without the latent")]:
        with pytest.raises(UserError, match=needle) as e:
            export_family(dataclasses.replace(gpt_cfg(), **extra))
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="Qwen3ForCausalLM cannot hold this model: multi-latent attention"):
        export_family(gpt_cfg(), "qwen3")


def test_start_up_line_says_what_runs():
    from megatron_po.models.mla import mla_summary
    line = mla_summary(gpt_cfg(), tp=2)
    assert line == ("> MLA: 4 heads, query/key 8 + 8 rotary (one key head shared), value 12; query latent 16, "
                    "key/value latent 16, latent norms; YaRN factor 4 over 8, mscale 1 / 0.8, softmax scale 1.234 / "
                    "sqrt(16); down-projections whole on each of the 2 TP rank(s), up-projections split by heads")


def test_flops_equal_the_flop_counter_but_for_the_latent_norms():
    """torch's FLOP counter (matmuls only, SDPA on its math path over the full square) on an MLA GPT's forward +
    backward: Megatron's count minus the latent norms' r_q + r_kv multiply-adds per token and layer it adds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_po.flops import gpt_flops_per_token
    cfg = Config()
    cfg.model = gpt_cfg(attention_backend="local", hidden_dropout=0.0, attention_dropout=0.0)
    model_parallel_seed(SEED)
    net = GPTModel(cfg.model, VOCAB, SEED)
    b = batch()
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        net(input_ids=b["tokens"], labels=b["labels"]).sum().backward()
    norms = 3 * 2 * (16 + 16) * cfg.model.num_layers  # per token: r_q + r_kv, forward + backward
    assert counter.get_total_flops() == (gpt_flops_per_token(cfg, VOCAB) - norms) * B * SEQ
