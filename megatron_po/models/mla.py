"""Multi-latent attention (MLA; DeepSeek-V2/V3, Kimi K2, Moonlight), Megatron-core's flags and meanings.

Per token x (hidden h), with n heads, head dimensions d_n (--qk-head-dim), d_r (--qk-pos-emb-head-dim) and
d_v (--v-head-dim), latent ranks r_q (--q-lora-rank) and r_kv (--kv-lora-rank):

    query:  c_q = norm(W_qa x) [r_q],  q_h = (W_qb c_q)_h = [q_nope_h (d_n), q_pe_h (d_r)]
            (no --q-lora-rank: q_h = (W_q x)_h, as Moonlight)
    keys:   [c_kv (r_kv), k_pe (d_r)] = W_kva x,   [k_nope_h (d_n), v_h (d_v)] = (W_kvb norm(c_kv))_h
    head h: softmax([q_nope_h, rope(q_pe_h)] · [k_nope_h, rope(k_pe)] · scale) V_h, then W_o over the heads

The rotary key k_pe is one head shared by every head. `norm` is --normalization over the latent, present with
--qk-layernorm (Megatron's meaning of that flag under MLA; DeepSeek-V3's recipes pass it), with --norm-epsilon
unless --mla-latent-norm-epsilon says otherwise (DeepSeek's own code and transformers fix it at 1e-6 whatever
rms_norm_eps is: Moonlight's norms take 1e-5, its latent norms 1e-6). The weights and
transformers' DeepseekV3Attention's: q_down = q_a_proj, q_norm = q_a_layernorm, q_up = q_b_proj
(q_proj without --q-lora-rank), kv_down = kv_a_proj_with_mqa, kv_norm = kv_a_layernorm, kv_up = kv_b_proj,
proj = o_proj; the same math on the same weights (tests/test_mla.py). Biases: only the output projection's
(--add-bias-linear), as Megatron.

RoPE (`mla_rotary`): --rope-type yarn (the default under MLA) or rope, over the d_r rotary dimensions, whose
weights are laid out in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: they are de-interleaved, then
rotated in the rotate-half convention (Megatron under MLA; transformers' rope_interleave=True). YaRN with
factor s = --rotary-scaling-factor, original context --yarn-original-max-position-embeddings (4096),
beta_fast / beta_slow (32 / 1): frequencies that turn fewer than beta_slow times over the original context are
divided by s, those turning more than beta_fast times kept, a linear ramp between (over the rounded
correction range); cos and sin are scaled by mscale(s, --mscale) / mscale(s, --mscale-all-dim), with
mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1). The softmax scale is mscale(s, --mscale-all-dim)^2 / √(d_n + d_r)
with either rope type, as Megatron.

Tensor parallelism, as Megatron splits MLA: the down-projections W_qa, W_kva and the latent norms whole on every
TP rank (tensor_parallel.ReplicatedLinear), the up-projections W_qb, W_kvb (and W_q) column-parallel by heads,
W_o row-parallel. Under sequence parallelism the down-projections run on this rank's tokens, the up-projections
gather the latents (r_q, r_kv wide, not h), and the shared rotary key is gathered alone; the replicated weights'
gradients are then partial sums over TP (summed before the step, as the norms'). Without it the rotary key's
gradient from this rank's heads is summed over TP in the backward (copy_to_tensor_model_parallel_region).

Context parallelism: the keys and values travel as any layer's (context_parallel_attention.py takes a value head
dimension other than the query's). Selective recomputation recomputes the core softmax(QKᵀ)V.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig
from megatron_po.models.transformer import (AttentionCore, RotaryEmbedding, apply_rotary, build_norm, init_normal,
                                             rope_inv_freq)
from megatron_po.tensor_parallel import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                         copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)

# Megatron's defaults: its MLA flags' (sizes) and MLATransformerConfig's (YaRN settings it has no MLA flag for).
DEFAULT_SIZES = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
YARN_ORIGINAL_MAX_POSITIONS, YARN_BETA_FAST, YARN_BETA_SLOW = 4096, 32.0, 1.0


class MLASizes(NamedTuple):
    q_lora_rank: int | None  # None: the query projected from the hidden state
    kv_lora_rank: int
    qk_head_dim: int  # d_n, the query/key dimensions without position
    qk_pos_emb_head_dim: int  # d_r, the rotary dimensions
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim


def mla_sizes(m: ModelConfig) -> MLASizes:
    """The MLA sizes of the flags, Megatron's defaults where not given."""
    given = {name: getattr(m, name) for name in DEFAULT_SIZES}
    return MLASizes(m.q_lora_rank, **{name: DEFAULT_SIZES[name] if v is None else v for name, v in given.items()})


def latent_norm_epsilon(m: ModelConfig) -> float:
    """The latent norms' epsilon: --mla-latent-norm-epsilon, else --norm-epsilon (Megatron's)."""
    return m.norm_epsilon if m.mla_latent_norm_epsilon is None else m.mla_latent_norm_epsilon


def rope_type(m: ModelConfig) -> str:
    """--rope-type, defaulted: yarn under MLA (Megatron's MLATransformerConfig), else rope."""
    return m.rope_type or ("yarn" if m.multi_latent_attention else "rope")


# --------------------------------------------------------------------------------------------------
# RoPE: YaRN (Megatron's YarnRotaryEmbedding, transformers' "yarn" rope type) or plain
# --------------------------------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                  beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN's frequencies over `dim` rotary dimensions (module docstring): the same operations in the same order
    as Megatron's and transformers', so the frequencies match theirs."""
    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the frequency kept (extrapolated), 0: divided by the factor
    return interpolated * (1 - keep) + extrapolated * keep


def mla_rotary(m: ModelConfig) -> RotaryEmbedding:
    """The RoPE of the d_r rotary dimensions: --rope-type yarn (module docstring) or rope (plain, --rotary-base)."""
    dim = mla_sizes(m).qk_pos_emb_head_dim
    if rope_type(m) == "rope":
        return RotaryEmbedding(dim, m.rotary_base, inv_freq=rope_inv_freq(dim, m.rotary_base))
    s, original = m.rotary_scaling_factor, m.yarn_original_max_position_embeddings or YARN_ORIGINAL_MAX_POSITIONS
    inv_freq = yarn_inv_freq(dim, m.rotary_base, s, original, m.yarn_beta_fast or YARN_BETA_FAST,
                             m.yarn_beta_slow or YARN_BETA_SLOW, m.yarn_correction_range_round_to_int)
    return RotaryEmbedding(dim, m.rotary_base, inv_freq=inv_freq,
                           attention_factor=yarn_mscale(s, m.mscale) / yarn_mscale(s, m.mscale_all_dim))


def softmax_scale(m: ModelConfig) -> float | None:
    """mscale(s, --mscale-all-dim)^2 / √(d_n + d_r); None where that is the default 1/√(d_n + d_r)."""
    mscale = yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim)
    return None if mscale == 1.0 else mscale * mscale / math.sqrt(mla_sizes(m).q_head_dim)


def mla_summary(m: ModelConfig, tp: int) -> str:
    """The start-up line: the sizes, the RoPE and where the projections are."""
    z = mla_sizes(m)
    query = f"query latent {z.q_lora_rank}" if z.q_lora_rank is not None else "no query latent"
    if rope_type(m) == "yarn":
        original = m.yarn_original_max_position_embeddings or YARN_ORIGINAL_MAX_POSITIONS
        rope = f"YaRN factor {m.rotary_scaling_factor:g} over {original}, mscale {m.mscale:g} / {m.mscale_all_dim:g}"
    else:
        rope = f"RoPE base {m.rotary_base}"
    scale = softmax_scale(m)
    scale = "" if scale is None else f", softmax scale {scale * math.sqrt(z.q_head_dim):.4g} / sqrt({z.q_head_dim})"
    return (f"> MLA: {m.num_attention_heads} heads, query/key {z.qk_head_dim} + {z.qk_pos_emb_head_dim} rotary "
            f"(one key head shared), value {z.v_head_dim}; {query}, key/value latent {z.kv_lora_rank}"
            f"{', latent norms' if m.qk_layernorm else ''}; {rope}{scale}; down-projections whole on each of the "
            f"{tp} TP rank(s), up-projections split by heads")


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on dimensions stored in interleaved pairs: de-interleaved (evens, then odds), then rotated half by half.
    Queries and keys get the same permutation, so their dot products are those of the pairs rotated in place."""
    return apply_rotary(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------


class MultiLatentAttention(AttentionCore):
    """Causal multi-latent self-attention of a GPT layer (module docstring); x [s, b, h] -> [s, b, h]."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__(cfg, softmax_scale=softmax_scale(cfg))
        tp = ps.get_tensor_model_parallel_world_size()
        self.sizes = sizes = mla_sizes(cfg)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_local_heads = nh // tp
        self.sequence_parallel = sequence_parallel
        init = init_normal(cfg.init_method_std)
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)

        def column(n_in, n_out):
            return ColumnParallelLinear(n_in, n_out, bias=False, gather_output=False, init_method=init,
                                        sequence_parallel=sequence_parallel)

        def norm(dim):
            return build_norm(cfg, dim, sequence_parallel, latent_norm_epsilon(cfg)) if cfg.qk_layernorm else None

        self.q_proj = self.q_down = self.q_norm = self.q_up = None
        if sizes.q_lora_rank is None:
            self.q_proj = column(h, nh * sizes.q_head_dim)
        else:
            self.q_down = ReplicatedLinear(h, sizes.q_lora_rank, init_method=init, sequence_parallel=sequence_parallel)
            self.q_norm = norm(sizes.q_lora_rank)
            self.q_up = column(sizes.q_lora_rank, nh * sizes.q_head_dim)
        self.kv_down = ReplicatedLinear(h, sizes.kv_lora_rank + sizes.qk_pos_emb_head_dim, init_method=init,
                                        sequence_parallel=sequence_parallel)
        self.kv_norm = norm(sizes.kv_lora_rank)
        self.kv_up = column(sizes.kv_lora_rank, nh * (sizes.qk_head_dim + sizes.v_head_dim))
        self.proj = RowParallelLinear(nh * sizes.v_head_dim, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                      init_method=init_normal(out_std), sequence_parallel=sequence_parallel)

    def linears(self) -> list[nn.Module]:
        """Every projection (FP8 runs their GEMMs, models/fp8.py)."""
        return [m for m in (self.q_proj, self.q_down, self.q_up, self.kv_down, self.kv_up, self.proj) if m is not None]

    def forward(self, x: torch.Tensor, rotary=None, attn_mask=None) -> torch.Tensor:
        """`rotary`: cos, sin of the rotary dimensions (`mla_rotary`); `attn_mask`: as `AttentionCore.attend`."""
        sizes, heads = self.sizes, self.num_local_heads
        if self.q_proj is not None:
            q, _ = self.q_proj(x)
        else:
            latent = self.q_down(x)
            q, _ = self.q_up(latent if self.q_norm is None else self.q_norm(latent))
        kv_latent, k_pe = self.kv_down(x).split([sizes.kv_lora_rank, sizes.qk_pos_emb_head_dim], dim=-1)
        kv, _ = self.kv_up(kv_latent if self.kv_norm is None else self.kv_norm(kv_latent))
        k_pe = self._whole_sequence(k_pe)
        s, b, _ = q.shape
        q_nope, q_pe = q.view(s, b, heads, sizes.q_head_dim).split([sizes.qk_head_dim, sizes.qk_pos_emb_head_dim], -1)
        k_nope, v = kv.view(s, b, heads, sizes.qk_head_dim + sizes.v_head_dim).split(
            [sizes.qk_head_dim, sizes.v_head_dim], dim=-1)
        k_pe = k_pe.view(s, b, 1, sizes.qk_pos_emb_head_dim)
        if rotary is not None:
            cos, sin = rotary
            q_pe, k_pe = apply_interleaved_rotary(q_pe, cos, sin), apply_interleaved_rotary(k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(s, b, heads, sizes.qk_pos_emb_head_dim)], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head dim]
        ctx = self.attend(q, k, v, attn_mask, self.causal and attn_mask is None, self.context_parallel)
        out, _ = self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, heads * sizes.v_head_dim))
        return out

    def _whole_sequence(self, k_pe: torch.Tensor) -> torch.Tensor:
        """The shared rotary key of every token every head of this rank reads; its backward sums the gradients of
        the TP ranks' heads (module docstring)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(k_pe, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(k_pe)
