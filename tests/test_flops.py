"""The documented FLOPs formulas (flops.gpt_flops_per_token, flops.nmt_flops_per_sample) equal what
torch's FLOP counter measures for one forward + backward, exactly; a mixture of experts included, counted on its
active parameters (router, top-k routed experts, shared experts; experts as the loop over the local experts, whose
matmuls the counter sees: it does not count torch._grouped_mm).

The counter counts matmuls only (2 FLOPs per multiply-add; norms, softmax, GELU and embedding lookups
are left out, as in Megatron's convention) and sees attention as matmuls on SDPA's math path, where the
causal mask is applied to the full s x s square: the convention the formulas state.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_po.config import Config, ModelConfig
from megatron_po.models.gpt import GPTModel
from megatron_po.flops import gpt_flops_per_token, moe_mlp_flops_per_token, nmt_flops_per_sample


def measured_training_flops(run) -> int:
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        run().float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("extra", [{}, {"swiglu": True},
                                   {"group_query_attention": True, "num_query_groups": 2, "kv_channels": 24}],
                         ids=["gelu", "swiglu", "gqa-kv-channels"])
def test_gpt_formula_equals_the_flop_counter(extra):
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                            hidden_dropout=0.0, attention_dropout=0.0, **extra)
    vocab, batch = 256, 3
    model = GPTModel(cfg.model, vocab, seed=1)
    tokens = torch.randint(vocab, (batch, cfg.model.seq_length))
    flops = measured_training_flops(lambda: model(input_ids=tokens, labels=tokens))
    assert flops == gpt_flops_per_token(cfg, vocab) * batch * cfg.model.seq_length


def test_nmt_formula_equals_the_flop_counter_of_an_encoder_decoder():
    """torch.nn.Transformer (post-LN, the same matmuls as a pre-LN encoder-decoder) plus an output layer."""
    torch.manual_seed(0)
    h, f, enc, dec, S, T, vocab, batch = 64, 256, 2, 3, 20, 12, 300, 2
    model = torch.nn.Transformer(d_model=h, nhead=4, num_encoder_layers=enc, num_decoder_layers=dec,
                                 dim_feedforward=f, dropout=0.0, batch_first=True)
    output_layer = torch.nn.Linear(h, vocab, bias=False)
    src = torch.randn(batch, S, h, requires_grad=True)  # embedded source / target: their gradients flow too
    tgt = torch.randn(batch, T, h, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T)
    flops = measured_training_flops(lambda: output_layer(model(src, tgt, tgt_mask=causal, tgt_is_causal=True)))
    assert flops == nmt_flops_per_sample(h, f, enc, dec, S, T, vocab) * batch


def test_nmt_formula_without_encoder_and_cross_attention_is_the_gpt_formula():
    cfg = Config()
    cfg.model = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=40)
    vocab, T = 500, 40
    decoder_only = nmt_flops_per_sample(64, 256, 0, 3, 0, T, vocab)
    cross_attention_qo = 3 * 2 * 3 * T * 2 * 64 * 64  # 3 layers x T tokens x (query + output) h^2
    assert decoder_only - cross_attention_qo == gpt_flops_per_token(cfg, vocab) * T


MOE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
           attention_dropout=0.0, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48)


@pytest.mark.parametrize("extra", [
    {"swiglu": True, "moe_shared_expert_intermediate_size": 80, "moe_layer_freq": "([0]*1+[1]*3)",
     "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001},
    {"moe_layer_freq": "2", "moe_router_topk": 3, "moe_router_score_function": "sigmoid",
     "moe_router_enable_expert_bias": True, "moe_router_load_balancing_type": "none"},
], ids=["swiglu-shared-dense-first", "gelu-every-other-top3-sigmoid"])
def test_moe_gpt_formula_equals_the_flop_counter_on_active_parameters(extra):
    """Dropless routing sends every token through exactly k experts, so the counter's matmuls add up to the
    formula's router + k experts + shared experts, whatever the routing chose."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(**dict(MOE, **extra))
    vocab, batch = 256, 3
    model = GPTModel(cfg.model, vocab, seed=1)
    tokens = torch.randint(vocab, (batch, cfg.model.seq_length))
    flops = measured_training_flops(lambda: model(input_ids=tokens, labels=tokens))
    assert flops == gpt_flops_per_token(cfg, vocab) * batch * cfg.model.seq_length


@pytest.mark.parametrize("extra", [{}, {**MOE, "num_layers": 2, "moe_layer_freq": "([0]*1+[1]*1)"}],
                         ids=["dense", "moe-depths"])
def test_mtp_formula_equals_the_flop_counter(extra):
    """--mtp-num-layers 2 (models/mtp.py): each depth's 2h -> h projection, its layer (an MoE layer where the last
    layer is one) and the output layer once more, over all s positions, as `mtp_flops_per_token` counts them; the
    counter sees the training forward and backward of the depths (the chunked output loss's gradients included)."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                      hidden_dropout=0.0, attention_dropout=0.0), **extra,
                               "position_embedding_type": "rope", "mtp_num_layers": 2})
    vocab, batch = 256, 3
    model = GPTModel(cfg.model, vocab, seed=1)
    tokens = torch.randint(vocab, (batch, cfg.model.seq_length))
    micro_batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(batch, cfg.model.seq_length)}
    flops = measured_training_flops(lambda: model(micro_batch))
    assert flops == gpt_flops_per_token(cfg, vocab) * batch * cfg.model.seq_length
    without = Config()
    without.model = ModelConfig(**{**vars(cfg.model), "mtp_num_layers": None})
    assert gpt_flops_per_token(cfg, vocab) > gpt_flops_per_token(without, vocab) * 2  # 2 layers + 2 depths


def test_moe_formula_closed_form_counts_k_experts_not_all():
    """Against the dense GPT: k experts of f / k each are the dense MLP of f plus the router (h E per token and MoE
    layer, x 2 x 3); more experts add only their router columns; shared experts add a dense MLP of their size."""
    h, f, vocab, L = 64, 256, 512, 4
    dense, moe = Config(), Config()
    dense.model = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=4, seq_length=32, ffn_hidden_size=f)
    for E in (8, 64):
        moe.model = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=4, seq_length=32, ffn_hidden_size=f,
                                num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=f // 2, moe_layer_freq="2")
        assert gpt_flops_per_token(moe, vocab) - gpt_flops_per_token(dense, vocab) == 3 * 2 * (L // 2) * h * E
    moe.model.moe_shared_expert_intermediate_size = 96
    assert moe_mlp_flops_per_token(moe.model) == 2 * (h * 64 + 2 * 2 * h * (f // 2) + 2 * h * 96)
    moe.model.swiglu = True
    assert moe_mlp_flops_per_token(moe.model) == 2 * (h * 64 + 2 * 3 * h * (f // 2) + 3 * h * 96)


def test_causal_attention_counts_half_the_score_and_value_products():
    """`causal=True` (the long-context GPU section's MFU) counts half of what the flop counter measures for the
    attention's products (QK^T and AV with their backward, on the full square), and changes nothing else."""
    cfg = Config()
    cfg.model = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32)
    layers, s, vocab = 3, 32, 256
    full, causal = gpt_flops_per_token(cfg, vocab), gpt_flops_per_token(cfg, vocab, causal=True)
    q = torch.randn(1, 4, s, 16, requires_grad=True)  # one layer's attention over one sequence: a = 4 x 16 = 64
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    attention_per_token_and_layer = counter.get_total_flops() / s
    assert (full - causal) * 2 == attention_per_token_and_layer * layers
