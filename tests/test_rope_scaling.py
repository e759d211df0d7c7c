"""Llama 3.1's RoPE frequency scaling: Megatron's --use-rope-scaling --rope-scaling-factor F.

- The frequencies equal `transformers`' LlamaRotaryEmbedding with rope_parameters {"rope_type": "llama3",
  factor F, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192} bit for bit, and
  cos/sin at positions up to 16 x the original 8192 within atol 1e-6 (measured 0: the same float32 operations
  in the same order), for Llama-3.1-like (head 128, base 500000, F 8), Llama-3.2-like (F 32) and tiny heads.
- Closed form: frequencies with a wavelength under 8192 / 4 positions are kept, those over 8192 divided by F,
  those between blended linearly in 8192 / wavelength; so a low frequency turns at position F x p exactly as
  the unscaled one does at p (bitwise: F is a power of two there). F = 1 changes nothing.
- The flags reach the model (GPTModel's rotary); --reset-position-ids' per-token positions get the same
  cos/sin as the contiguous ones, with the scaling and with --rotary-seq-len-interpolation-factor.
- HF import reads the llama3 type back into the flags, and refuses constants Megatron does not have
  (one line); export refuses the scaling combined with position interpolation, which HF cannot express.
The export's logits (a trained TP=2 model with the scaling) are tests/test_checkpoint_convert.py's.
"""

import math

import pytest
import torch

from megatron_po.config import parse_args
from megatron_po.errors import UserError
from megatron_po.models.transformer import RotaryEmbedding, llama3_scaled_inv_freq

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def hf_rotary(head_dim: int, base: int, factor: float):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=16 * 8192,
                      rope_parameters={"rope_type": "llama3", "rope_theta": float(base), "factor": factor,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("head_dim, base, factor", [(128, 500000, 8.0), (64, 500000, 32.0), (16, 10000, 8.0)])
def test_cos_sin_equal_transformers_llama3_beyond_the_original_context(head_dim, base, factor):
    theirs, ours = hf_rotary(head_dim, base, factor), RotaryEmbedding(head_dim, base, llama3_factor=factor)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    assert not torch.equal(ours.inv_freq, RotaryEmbedding(head_dim, base).inv_freq)
    positions = torch.cat([torch.arange(0, 16 * 8192, 977), torch.tensor([8191, 8192, 8193, 16 * 8192 - 1])])
    cos, sin = theirs(torch.zeros(1, 1, head_dim), positions[None])  # [1, n, head_dim]
    by_id = ours(0, "cpu", positions[None])  # --reset-position-ids' path: [n, 1, 1, head_dim]
    contiguous = ours(3 * 8192, "cpu")  # positions 0 .. 24575: [s, 1, 1, head_dim]
    kept = positions < 3 * 8192
    for mine, hf in zip(by_id, (cos, sin)):
        torch.testing.assert_close(mine[:, 0, 0], hf[0], rtol=0, atol=1e-6)
    for mine, hf in zip(contiguous, (cos, sin)):
        torch.testing.assert_close(mine[positions[kept], 0, 0], hf[0, kept], rtol=0, atol=1e-6)


def test_llama3_scaling_closed_form():
    inv = RotaryEmbedding(16, 500000).inv_freq
    scaled = llama3_scaled_inv_freq(inv, 8.0)
    wavelen = 2 * math.pi / inv
    high, low = wavelen < 8192 / 4, wavelen > 8192
    medium = ~high & ~low
    assert high.sum() == 4 and medium.sum() == 1 and low.sum() == 3  # every regime present
    assert torch.equal(scaled[high], inv[high]) and torch.equal(scaled[low], inv[low] / 8)
    s = (8192 / wavelen[medium] - 1) / (4 - 1)
    torch.testing.assert_close(scaled[medium], (1 - s) * inv[medium] / 8 + s * inv[medium], rtol=1e-6, atol=0)
    assert (inv[medium] / 8 < scaled[medium]).all() and (scaled[medium] < inv[medium]).all()
    torch.testing.assert_close(llama3_scaled_inv_freq(inv, 1.0), inv, rtol=1e-6, atol=0)
    # the low frequencies stretched 8x: position 8 p turns as the unscaled position p did
    p = torch.arange(0, 16384, 7)
    plain_cos, _ = RotaryEmbedding(16, 500000)(0, "cpu", p[None])
    scaled_cos, _ = RotaryEmbedding(16, 500000, llama3_factor=8.0)(0, "cpu", 8 * p[None])
    lows = torch.cat([low, low])  # rotate-half: each frequency on dims j and j + 8
    assert torch.equal(scaled_cos[..., lows], plain_cos[..., lows])


def test_flags_reach_the_model_and_position_ids_match_contiguous_positions():
    from megatron_po.models.gpt import GPTModel
    rope = MOCK + ["--position-embedding-type", "rope", "--rotary-base", "500000", "--kv-channels", "16"]
    cfg = parse_args(rope + ["--use-rope-scaling"]).model
    assert cfg.use_rope_scaling and cfg.rope_scaling_factor == 8.0  # Megatron's default factor
    cfg = parse_args(rope + ["--use-rope-scaling", "--rope-scaling-factor", "32"]).model
    assert cfg.rope_scaling_factor == 32.0
    rotary = GPTModel(cfg, 128, seed=0).rotary
    assert torch.equal(rotary.inv_freq, llama3_scaled_inv_freq(RotaryEmbedding(16, 500000).inv_freq, 32.0))
    assert GPTModel(parse_args(rope).model, 128, seed=0).rotary.inv_freq.equal(RotaryEmbedding(16, 500000).inv_freq)
    # per-token positions (--reset-position-ids) and contiguous ones give the same cos/sin, interpolated or not
    for emb in (rotary, RotaryEmbedding(16, 500000, interpolation_factor=2, llama3_factor=8.0)):
        ids = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]])
        by_id, contiguous = emb(6, "cpu", ids), emb(6, "cpu")
        for a, b in zip(by_id, contiguous):
            assert torch.equal(a[:, 0], b[:, 0]) and torch.equal(a[:, 1], b[[3, 4, 5, 0, 1, 2], 0])


def test_hf_import_and_export_edges():
    from transformers import LlamaConfig

    from megatron_po.config import ModelConfig
    from megatron_po.models.hf.configs import export_family, family_of, model_fields

    def model_config_from_hf(config):
        return model_fields(family_of(config), LlamaConfig.from_dict(config))

    llama31 = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "intermediate_size": 160, "max_position_embeddings": 131072,
               "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
    model = model_config_from_hf(llama31)
    assert model["use_rope_scaling"] and model["rope_scaling_factor"] == 8.0 and model["rotary_base"] == 500000
    odd = dict(llama31, rope_scaling=dict(llama31["rope_scaling"], original_max_position_embeddings=4096))
    with pytest.raises(UserError, match="original_max_position_embeddings': 4096") as e:
        model_config_from_hf(odd)
    assert "\n" not in str(e.value)
    both = ModelConfig(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", use_rope_scaling=True,
                       rotary_seq_len_interpolation_factor=2)
    with pytest.raises(UserError, match="--use-rope-scaling with --rotary-seq-len-interpolation-factor"):
        export_family(both)
