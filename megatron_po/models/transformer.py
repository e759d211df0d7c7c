"""Tensor-parallel transformer blocks (pre-LayerNorm), shared by the GPT and NMT models.

Activations are [seq, batch, hidden] as in Megatron, so sequence parallelism splits dim 0. Attention
runs through `F.scaled_dot_product_attention` (--attention-backend picks its kernel). The QKV projection's
output rows are laid out per key/value group, as Megatron Core's: for each group g the rows of its
query heads, then k_g, then v_g ([groups, heads/groups + 2, head_dim]). Without --group-query-attention
every head is its own group (q_h, k_h, v_h). A contiguous column-parallel split hands each TP rank whole
groups, and the TP=1 weight is exactly the concatenation of the TP shards.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import (ModelConfig, ffn_hidden_size, kv_channels, num_query_groups, recompute_modules,
                                 recomputes_core_attention)
from megatron_po.models.context_parallel_attention import context_parallel_attention
from megatron_po.models.moe.layer import MoELayer
from megatron_po.models.moe.layout import moe_layer_numbers
from megatron_po.models.recompute import maybe_recompute
from megatron_po.tensor_parallel import ColumnParallelLinear, RowParallelLinear, on_model_parallel_rng


def init_normal(std: float):
    def init_(w: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(w, mean=0.0, std=std)
    return init_


class ZeroCenteredNorm(nn.Module):
    """LayerNorm or RMSNorm that scales by (1 + weight), the weight starting at 0 (--apply-layernorm-1p):
    the same function as the plain norm with weight w + 1, stored centered on zero."""

    def __init__(self, normalization: str, hidden: int, eps: float):
        super().__init__()
        self.normalization, self.eps = normalization, eps
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden)) if normalization == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), 1 + self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), 1 + self.weight, self.bias, self.eps)


def build_norm(cfg: ModelConfig, hidden: int, sequence_parallel: bool, eps: float | None = None) -> nn.Module:
    """--normalization over `hidden` features, with --norm-epsilon unless `eps` is given."""
    eps = cfg.norm_epsilon if eps is None else eps
    if cfg.apply_layernorm_1p:
        norm = ZeroCenteredNorm(cfg.normalization, hidden, eps)
    else:
        norm = nn.RMSNorm(hidden, eps=eps) if cfg.normalization == "RMSNorm" else nn.LayerNorm(hidden, eps=eps)
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
        return on_model_parallel_rng(F.dropout, x, p, True)
    return F.dropout(x, p, True)


# Llama 3.1's frequency scaling (Megatron's --use-rope-scaling; HF's "llama3" rope type): these three are fixed
# there as here (Megatron has no flags for them); only the factor is a flag.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_MAX_POSITIONS = 1.0, 4.0, 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Frequencies with a wavelength 2 pi / f over LLAMA3_ORIGINAL_MAX_POSITIONS / LOW_FREQ_FACTOR are divided by
    `factor` (they never completed a turn within the original context, so they are stretched to the longer
    one), those under ORIGINAL / HIGH_FREQ_FACTOR kept (local positions), those between blended linearly in
    ORIGINAL / wavelength. The same operations in the same order as Megatron Core's and HF's, so the
    frequencies match theirs bit for bit."""
    low_freq_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    high_freq_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((LLAMA3_ORIGINAL_MAX_POSITIONS / wavelen - LLAMA3_LOW_FREQ_FACTOR)
              / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR))
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """RoPE's frequencies base^(-2i/d), i < d/2."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half (GPT-NeoX / Llama) convention over the first `rotary_dim` dimensions of a
    head (Megatron's --rotary-percent x head dimension); `apply_rotary` passes the rest through. Positions
    are divided by `interpolation_factor` (--rotary-seq-len-interpolation-factor); with `llama3_factor`
    (--use-rope-scaling --rope-scaling-factor) the frequencies are Llama 3.1's (`llama3_scaled_inv_freq`).
    `inv_freq` given: those frequencies instead (multi-latent attention's YaRN, models/mla.py), and cos and sin
    multiplied by `attention_factor` (YaRN's concentration factor)."""

    def __init__(self, rotary_dim: int, base: int, interpolation_factor: int | None = None,
                 llama3_factor: float | None = None, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0):
        super().__init__()
        self.interpolation_factor = interpolation_factor
        self.attention_factor = attention_factor
        if inv_freq is None:
            inv_freq = rope_inv_freq(rotary_dim, base)
            if llama3_factor is not None:
                inv_freq = llama3_scaled_inv_freq(inv_freq, llama3_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _cos_sin(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def forward(self, seq_len: int, device, position_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s, 1, 1, head_dim]; with `position_ids` [b, s] (--reset-position-ids) [s, b, 1, head_dim].
        `positions` [s]: the rows' places in the whole sequence (context parallelism), else 0 .. s-1."""
        if position_ids is not None:
            t = position_ids.t().to(torch.float32)  # [s, b]
            if self.interpolation_factor is not None:
                t = t / self.interpolation_factor
            freqs = t[..., None] * self.inv_freq.to(device)  # [s, b, d/2]
            cos, sin = self._cos_sin(torch.cat([freqs, freqs], dim=-1))
            return cos[:, :, None, :], sin[:, :, None, :]
        t = (torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None
             else positions.to(device=device, dtype=torch.float32))
        if self.interpolation_factor is not None:
            t = t / self.interpolation_factor
        freqs = torch.outer(t, self.inv_freq.to(device))
        cos, sin = self._cos_sin(torch.cat([freqs, freqs], dim=-1))  # [s, rotary_dim]
        return cos[:, None, None, :], sin[:, None, None, :]


def rotary_dim(cfg: ModelConfig) -> int:
    return int(kv_channels(cfg) * cfg.rotary_percent)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, heads, head_dim]; rotates the first cos.shape[-1] dimensions of each head."""
    rot = cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (x.float() * cos + rotated.float() * sin).to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def split_qkv(qkv: torch.Tensor, local_groups: int, heads_per_group: int, head_dim: int):
    """The QKV projection's output [s, b, groups x (heads_per_group + 2) x head_dim] (module docstring) ->
    q [s, b, groups x heads_per_group, head_dim], k and v [s, b, groups, head_dim]."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, local_groups, (heads_per_group + 2) * head_dim).split(
        [heads_per_group * head_dim, head_dim, head_dim], dim=-1)
    return q.reshape(s, b, local_groups * heads_per_group, head_dim), k, v


_SDPA_KERNELS = {"auto": None, "local": "MATH", "unfused": "MATH", "flash": "FLASH_ATTENTION",
                 "fused": "CUDNN_ATTENTION"}


def attention_kernel_context(backend: str, masked: bool = False):
    """The SDPA kernel of --attention-backend: auto lets PyTorch pick; local and unfused run the math
    kernel (explicit softmax(QK^T)V, any device); flash and fused the CUDA kernels (config_rules.validate
    refuses them without a GPU). Those take no explicit mask, so attention with one (NMT padding,
    incremental decoding) runs PyTorch's own choice under them."""
    kernel = _SDPA_KERNELS[backend]
    if kernel is None or (masked and kernel != "MATH"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, kernel))


def _one_head_dim_kernel(backend: str, device: torch.device) -> bool:
    """Whether the SDPA kernel of --attention-backend takes only one head dimension for queries, keys and values:
    flash and cuDNN (forced), and PyTorch's fused CPU kernel (auto on a CPU, which would otherwise fall back to the
    math kernel and keep the [b, heads, s, s] probabilities). CUDA's memory-efficient kernel (auto) takes both."""
    kernel = _SDPA_KERNELS[backend]
    return kernel in ("FLASH_ATTENTION", "CUDNN_ATTENTION") or (kernel is None and device.type == "cpu")


def sdpa_inputs(backend: str, *qkv: torch.Tensor) -> tuple:
    """q, k, v as the SDPA call gets them: unchanged, except in a compiled graph (--torch-compile) with the math
    kernel forced (--attention-backend local/unfused), where inductor (torch 2.13) lowers permuted inputs to
    wrongly shaped outputs, so they are made contiguous there."""
    if torch.compiler.is_compiling() and _SDPA_KERNELS[backend] == "MATH":
        return tuple(t.contiguous() for t in qkv)
    return qkv


class AttentionCore(nn.Module):
    """The core of a self-attention layer, softmax(QKᵀ·scale)V of its projected queries, keys and values, shared by
    SelfAttention and multi-latent attention (models/mla.py): on this rank's sequence, or with
    --context-parallel-size over the whole sequence split across the CP ranks (context_parallel_attention.py);
    recomputed in the backward with --recompute-granularity selective. `heads_per_group`: query heads per
    key/value head (GQA); `softmax_scale`: None is 1/√(query head dim)."""

    def __init__(self, cfg: ModelConfig, heads_per_group: int = 1, causal: bool = True,
                 softmax_scale: float | None = None):
        super().__init__()
        self.heads_per_group = heads_per_group
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention_backend
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        self.recompute_core = recomputes_core_attention(cfg)
        # --context-parallel-size > 1: this rank holds 2 of the sequence's 2 x CP chunks (context_parallel_attention.py)
        self.context_parallel = ps.get_context_parallel_world_size() > 1
        self.cp_comm_type = cfg.cp_comm_type

    def attend(self, q, k, v, attn_mask, causal: bool, context_parallel: bool) -> torch.Tensor:
        """q [b, heads, s, d], k and v [b, groups, s, d or the value's] -> [b, heads, s, value head dim]. `attn_mask`:
        [b, 1, s, s] bool, or under context parallelism the whole sequence's document ids [b, s] (or None)."""
        if context_parallel:
            return maybe_recompute(self.recompute_core, self.context_parallel_core, q, k, v, attn_mask)
        return maybe_recompute(self.recompute_core, self.core_attention, q, k, v, attn_mask, causal)

    def core_attention(self, q, k, v, attn_mask, causal: bool) -> torch.Tensor:
        """softmax(QKᵀ·scale)V with dropout, [b, heads, s, head_dim]: what selective recomputation recomputes
        (the key/value groups are repeated in here, so a recomputed core keeps only the unrepeated ones)."""
        if self.heads_per_group > 1:  # query head i reads key/value group i // heads_per_group
            k, v = k.repeat_interleave(self.heads_per_group, dim=1), v.repeat_interleave(self.heads_per_group, dim=1)
        p = self.attention_dropout if self.training else 0.0
        dtype = q.dtype
        if self.softmax_in_fp32:
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = sdpa_inputs(self.attention_backend, q, k, v)
        value_dim = v.shape[-1]
        if value_dim < q.shape[-1] and _one_head_dim_kernel(self.attention_backend, q.device):
            # Narrower values (multi-latent attention): zero columns give the kernel one head dimension, the same output
            v = F.pad(v, (0, q.shape[-1] - value_dim))
        scale = {} if self.softmax_scale is None else {"scale": self.softmax_scale}
        with attention_kernel_context(self.attention_backend, masked=attn_mask is not None):
            if p > 0.0:
                # Heads are split across TP ranks, so attention dropout must differ between them.
                ctx = on_model_parallel_rng(F.scaled_dot_product_attention, q, k, v, attn_mask=attn_mask, dropout_p=p,
                                            is_causal=causal, **scale)
            else:
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, **scale)
        return ctx[..., :value_dim].to(dtype)

    def context_parallel_core(self, q, k, v, document_ids) -> torch.Tensor:
        """The core of a causal layer over a sequence split across the CP ranks: only the key/value groups travel
        (no dropout: config rule context-parallel-attention-dropout). The split attention takes the default scale,
        so another one is folded into the queries."""
        assert self.causal, "context parallelism splits causal self-attention only"
        dtype = q.dtype
        if self.softmax_in_fp32:
            q, k, v = q.float(), k.float(), v.float()
        if self.softmax_scale is not None:
            q = q * (self.softmax_scale * math.sqrt(q.shape[-1]))
        ctx = context_parallel_attention(q, k, v, document_ids, self.cp_comm_type,
                                         math_kernel=_SDPA_KERNELS[self.attention_backend] == "MATH")
        return ctx.to(dtype)


class SelfAttention(AttentionCore):
    """Multi-head, grouped-query (--group-query-attention) or multi-query (one group) self-attention."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, causal: bool = True):
        h, nh, groups = cfg.hidden_size, cfg.num_attention_heads, num_query_groups(cfg)
        super().__init__(cfg, nh // groups, causal)
        tp = ps.get_tensor_model_parallel_world_size()
        self.head_dim = kv_channels(cfg)
        self.num_local_heads, self.num_local_groups = nh // tp, groups // tp
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias  # --add-qkv-bias: on this projection only
        self.qkv = ColumnParallelLinear(h, (nh + 2 * groups) * self.head_dim, bias=qkv_bias,
                                        gather_output=False, init_method=init_normal(cfg.init_method_std),
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(nh * self.head_dim, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                      init_method=init_normal(out_std), sequence_parallel=sequence_parallel)
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            # Shared by all heads, which are split over TP ranks: each rank's gradient is a partial sum, summed
            # over the TP group like the norms under sequence parallelism.
            self.q_norm = build_norm(cfg, self.head_dim, sequence_parallel=tp > 1)
            self.k_norm = build_norm(cfg, self.head_dim, sequence_parallel=tp > 1)

    def forward(self, x: torch.Tensor, rotary=None, attn_mask=None, kv_cache: dict | None = None) -> torch.Tensor:
        """`kv_cache` (incremental decoding): x holds only the newest positions, whose keys and values are
        appended to the cache's; `rotary` must then be the cos/sin of those positions."""
        qkv, _ = self.qkv(x)  # [s, b, (heads + 2 groups) x head_dim / tp], per-group (q.., k, v) blocks
        s, b, _ = qkv.shape
        q, k, v = split_qkv(qkv, self.num_local_groups, self.heads_per_group, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or groups, s, head_dim]
        if kv_cache is not None:
            if "k" in kv_cache:
                k, v = torch.cat([kv_cache["k"], k], dim=2), torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
            if self.causal and attn_mask is None and k.shape[2] > s > 1:  # new queries see the cache + their past
                attn_mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - s)
        # Without a cache k.shape[2] == s: a plain bool, also when torch.compile makes s symbolic (NMT lengths).
        causal = self.causal and attn_mask is None and (kv_cache is None or k.shape[2] == s)
        # attn_mask under context parallelism: the whole sequence's document ids, or None
        ctx = self.attend(q, k, v, attn_mask, causal, context_parallel=self.context_parallel and kv_cache is None)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_local_heads * self.head_dim)
        out, _ = self.proj(ctx)
        return out


class MLP(nn.Module):
    """The dense MLP; recomputed in the backward with --recompute-modules mlp (Megatron-core's name; the shared
    experts: shared_experts), keeping only its input."""

    recompute_module = "mlp"

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, hidden_size: int | None = None):
        """`hidden_size`: the MLP's own (MoE's shared experts), else --ffn-hidden-size."""
        super().__init__()
        self.recompute = self.recompute_module in recompute_modules(cfg)
        h, f = cfg.hidden_size, hidden_size or ffn_hidden_size(cfg)
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
        return maybe_recompute(self.recompute, self.compute, x, params=list(self.parameters()))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        up, _ = self.fc1(x)
        if self.swiglu:
            gate, _ = self.fc1_gate(x)
            act = F.silu(gate) * up
        else:
            act = F.gelu(up, approximate="tanh")
        out, _ = self.fc2(act)
        return out


class SharedExpertMLP(MLP):
    """An MoE layer's shared experts: the dense MLP every token goes through; with --moe-shared-expert-gate its
    output is scaled by sigmoid(x w), w [1, hidden] (Megatron's SharedExpertMLP gate; Qwen2-MoE's
    shared_expert_gate), drawn after the MLP's weights."""

    recompute_module = "shared_experts"

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, hidden_size: int):
        super().__init__(cfg, sequence_parallel, hidden_size)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(init_normal(cfg.init_method_std)(torch.empty(1, cfg.hidden_size)))
            # Replicated; under sequence parallelism each TP rank's gradient covers its own tokens: summed over TP.
            self.gate_weight.sequence_parallel = sequence_parallel

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        out = super().compute(x)
        return out if self.gate_weight is None else out * torch.sigmoid(F.linear(x, self.gate_weight))


def build_mlp(cfg: ModelConfig, sequence_parallel: bool, layer_number: int | None) -> nn.Module:
    """The MLP of global layer `layer_number`: a mixture of experts where --num-experts and --moe-layer-freq
    say so (models/moe/), else the dense MLP. The layers numbered after the decoder's are the MTP depths'
    (models/mtp.py): of the kind of the last layer, as Megatron builds them from the last layer's spec."""
    if layer_number is None or layer_number not in moe_layer_numbers(cfg):
        return MLP(cfg, sequence_parallel)
    size = cfg.moe_shared_expert_intermediate_size
    shared = (lambda: SharedExpertMLP(cfg, sequence_parallel, size)) if size else None  # noqa: E731
    return MoELayer(cfg, sequence_parallel, layer_number, shared_experts=shared)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))). `layer_number`: the global layer
    number (a mixture of experts for the MLP where --moe-layer-freq says; None: dense). `attention`: the
    attention's class, built as attention(cfg, sequence_parallel) (multi-latent attention, models/mla.py)."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, layer_number: int | None = None,
                 attention: type[nn.Module] = SelfAttention):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        self.input_norm = build_norm(cfg, cfg.hidden_size, sequence_parallel)
        self.attention = attention(cfg, sequence_parallel)
        self.post_attention_norm = build_norm(cfg, cfg.hidden_size, sequence_parallel)
        self.mlp = build_mlp(cfg, sequence_parallel, layer_number)

    def forward(self, x: torch.Tensor, rotary=None, attn_mask=None) -> torch.Tensor:
        """`attn_mask` [b, 1, s, s] bool (--reset-attention-mask's document-level causal mask; None: causal); with
        context parallelism the whole sequence's document ids [b, s] instead (each key block's mask is built there)."""
        drop = lambda t: dropout(t, self.hidden_dropout, self.training, self.sequence_parallel)  # noqa: E731
        x = x + drop(self.attention(self.input_norm(x), rotary, attn_mask))
        x = x + drop(self.mlp(self.post_attention_norm(x)))
        return x
