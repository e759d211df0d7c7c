"""Tensor-parallel transformer blocks (pre-LayerNorm), shared by the GPT and NMT models.

Activations are [seq, batch, hidden] as in Megatron, so sequence parallelism splits dim 0. Attention
runs through `F.scaled_dot_product_attention`. The QKV projection's output rows are laid out per head
(q_h, k_h, v_h for each head h), so a contiguous column-parallel split hands each TP rank whole heads
and the TP=1 weight is exactly the concatenation of the TP shards.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig, ffn_hidden_size, recompute_granularity
from megatron_po.models.recompute import maybe_recompute
from megatron_po.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker


def init_normal(std: float):
    def init_(w: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(w, mean=0.0, std=std)
    return init_


def build_norm(cfg: ModelConfig, hidden: int, sequence_parallel: bool) -> nn.Module:
    norm = (nn.RMSNorm(hidden, eps=cfg.norm_epsilon) if cfg.normalization == "RMSNorm"
            else nn.LayerNorm(hidden, eps=cfg.norm_epsilon))
    for p in norm.parameters():
        # With sequence parallelism each TP rank sees a slice of the tokens, so the norm's (replicated)
        # gradients are partial sums that must be all-reduced over the TP group.
        p.sequence_parallel = sequence_parallel
    return norm


def dropout(x: torch.Tensor, p: float, training: bool, split_across_tp: bool) -> torch.Tensor:
    """Dropout on activations; draws from the TP-rank-specific RNG when the activation is split."""
    if p == 0.0 or not training:
        return x
    if split_across_tp:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half (GPT-NeoX / Llama) convention."""

    def __init__(self, head_dim: int, base: int):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)  # [s, head_dim]
        return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, causal: bool = True):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_local_heads = nh // tp
        self.head_dim = h // nh
        self.causal = causal
        self.attention_dropout = cfg.attention_dropout
        self.recompute_core = recompute_granularity(cfg) == "selective"
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(h, 3 * h, bias=cfg.add_bias_linear, gather_output=False,
                                        init_method=init_normal(cfg.init_method_std),
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(h, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                      init_method=init_normal(out_std), sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, rotary=None, attn_mask=None, kv_cache: dict | None = None) -> torch.Tensor:
        """`kv_cache` (incremental decoding): x holds only the newest positions, whose keys and values are
        appended to the cache's; `rotary` must then be the cos/sin of those positions."""
        qkv, _ = self.qkv(x)  # [s, b, 3h/tp], per-head (q, k, v) blocks
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.num_local_heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        if kv_cache is not None:
            if "k" in kv_cache:
                k, v = torch.cat([kv_cache["k"], k], dim=2), torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
            if self.causal and attn_mask is None and k.shape[2] > s > 1:  # new queries see the cache + their past
                attn_mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - s)
        causal = self.causal and attn_mask is None and k.shape[2] == s
        ctx = maybe_recompute(self.recompute_core, self.core_attention, q, k, v, attn_mask, causal)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_local_heads * self.head_dim)
        out, _ = self.proj(ctx)
        return out

    def core_attention(self, q, k, v, attn_mask, causal: bool) -> torch.Tensor:
        """softmax(QKᵀ/√d)V with dropout, [b, heads, s, head_dim]: what selective recomputation recomputes."""
        p = self.attention_dropout if self.training else 0.0
        if p > 0.0:
            # Heads are split across TP ranks, so attention dropout must differ between them.
            with get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size(cfg)
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        col = lambda: ColumnParallelLinear(h, f, bias=cfg.add_bias_linear, gather_output=False,  # noqa: E731
                                           init_method=init_normal(cfg.init_method_std),
                                           sequence_parallel=sequence_parallel)
        self.swiglu = cfg.swiglu
        self.fc1 = col()
        # SwiGLU keeps gate and up projections as two layers so each TP split stays TP-size independent.
        self.fc1_gate = col() if cfg.swiglu else None
        self.fc2 = RowParallelLinear(f, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                     init_method=init_normal(out_std), sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, _ = self.fc1(x)
        if self.swiglu:
            gate, _ = self.fc1_gate(x)
            act = F.silu(gate) * up
        else:
            act = F.gelu(up, approximate="tanh")
        out, _ = self.fc2(act)
        return out


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        self.input_norm = build_norm(cfg, cfg.hidden_size, sequence_parallel)
        self.attention = SelfAttention(cfg, sequence_parallel)
        self.post_attention_norm = build_norm(cfg, cfg.hidden_size, sequence_parallel)
        self.mlp = MLP(cfg, sequence_parallel)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        drop = lambda t: dropout(t, self.hidden_dropout, self.training, self.sequence_parallel)  # noqa: E731
        x = x + drop(self.attention(self.input_norm(x), rotary))
        x = x + drop(self.mlp(self.post_attention_norm(x)))
        return x


# --------------------------------------------------------------------------------------------------
# Implementation choice (--transformer-impl)
# --------------------------------------------------------------------------------------------------


def build_transformer_layer(cfg: ModelConfig, sequence_parallel: bool) -> nn.Module:
    """A pre-norm layer of the configured implementation. Both start from the same weights: the
    Transformer Engine layer copies those of the local layer built here (same seed, same draws)."""
    layer = TransformerLayer(cfg, sequence_parallel)
    if cfg.transformer_impl == "transformer_engine":
        from megatron_po.models.te_transformer import TETransformerLayer  # imports transformer_engine
        layer = TETransformerLayer(cfg, sequence_parallel, initial=layer)
    return layer


def layers_context(cfg: ModelConfig):
    """A zero-argument callable giving the context the layers of a forward run in: Transformer Engine's
    FP8 autocast with --fp8-format, else nothing."""
    if cfg.transformer_impl == "transformer_engine" and cfg.fp8_format is not None:
        from megatron_po.models.te_transformer import FP8Autocast
        return FP8Autocast(cfg)
    return contextlib.nullcontext
