"""Model FLOPs of one training iteration (forward + backward), Megatron's dense convention: what
`--log-throughput` divides by time for TFLOP/s and MFU, for the GPT and the encoder-decoder workloads.

A mixture of experts is counted on its *active* parameters, the FLOPs a token really runs through: the
router (h x E), its top-k routed experts of --moe-ffn-hidden-size f_e and the shared experts of
--moe-shared-expert-intermediate-size f_s, never all E experts. Per MoE layer and token the forward is

    2 (h E + k g h f_e + g h f_s),   g = 3 with SwiGLU, else 2

in the place of the dense MLP's 2 g h f (`moe_mlp_flops_per_token`), on the layers --moe-layer-freq marks.
Model FLOPs, as MFU takes them: a capacity (--moe-expert-capacity-factor) that drops token-expert pairs or
pads an expert's input is not subtracted or added (Megatron's convention, which leaves the router out).
docs/tracking.md#flops-and-mfu states the whole formula.
"""

from __future__ import annotations

from megatron_po.config import Config, ModelConfig, ffn_hidden_size, kv_channels, num_query_groups
from megatron_po.models.moe.layout import expert_ffn_hidden_size, moe_layer_pattern


def _mlp_multiply_adds(m: ModelConfig, f: int) -> int:
    """Multiply-adds per token of one MLP of hidden size f (SwiGLU: up, gate and down projections)."""
    return (3 if m.swiglu else 2) * m.hidden_size * f


def moe_mlp_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer's MLP: router, the top-k routed experts and the shared experts."""
    shared = m.moe_shared_expert_intermediate_size or 0
    return 2 * (m.hidden_size * m.num_experts + m.moe_router_topk * _mlp_multiply_adds(m, expert_ffn_hidden_size(m))
                + _mlp_multiply_adds(m, shared))


def gpt_flops_per_token(cfg: Config, vocab_size: int, causal: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron's dense convention.

    Per layer and token the forward does 2 FLOPs per multiply-add of: QKV (3h^2), attention output
    (h^2), MLP (2 h f, or 3 h f with SwiGLU; an MoE layer's active MLP: `moe_mlp_flops_per_token`), and
    attention scores + weighted values (2 s h, counting the full s x s square as Megatron does, although
    causal masking needs only half). Plus the output layer (h V). With f = 4h and no SwiGLU this is
    Megatron's 72 L h^2 (1 + s/(6h) + V/(12 L h)) per token. Multi-token prediction adds its depths
    (`mtp_flops_per_token`). `causal`: the attention counted over the causal
    half of the square (s h), the work a kernel that skips masked blocks does; at long sequences the two
    conventions part (bench/gpu/gpu_long_context.py).
    """
    m = cfg.model
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    # Attention with a = heads x head dim (h by default) and g = key/value groups x head dim (GQA): QKV h (a + 2g),
    # output a h, scores + weighted values 2 s a; 4h^2 + 2 s h without GQA and --kv-channels.
    a, g = m.num_attention_heads * kv_channels(m), num_query_groups(m) * kv_channels(m)
    attention = 2 * (h * (a + 2 * g) + a * h + (1 if causal else 2) * s * a)
    pattern = moe_layer_pattern(m)
    dense_mlp = 2 * _mlp_multiply_adds(m, ffn_hidden_size(m))
    moe_layers = sum(pattern)
    mlps = (L - moe_layers) * dense_mlp
    if moe_layers:
        mlps += moe_layers * moe_mlp_flops_per_token(m)
    return 3.0 * (L * attention + mlps + 2 * h * vocab_size + mtp_flops_per_token(m, vocab_size, attention, dense_mlp))


def mtp_flops_per_token(m: ModelConfig, vocab_size: int, attention: float, dense_mlp: float) -> float:
    """Forward FLOPs per token of the --mtp-num-layers depths (models/mtp.py), Megatron's MTP terms: each depth runs
    one layer of the last layer's kind (`attention` + its MLP), the 2h -> h projection (2h^2 multiply-adds) and the
    shared output layer once more (h V). Their norms are not counted, as no norm is here (Megatron adds 3h)."""
    if not m.mtp_num_layers:
        return 0.0
    h = m.hidden_size
    mlp = moe_mlp_flops_per_token(m) if moe_layer_pattern(m)[-1] else dense_mlp
    return m.mtp_num_layers * (attention + mlp + 2 * (2 * h * h + h * vocab_size))


def nmt_flops_per_sample(hidden_size: int, ffn_hidden_size: int, encoder_num_layers: int, decoder_num_layers: int,
                         src_length: int, tgt_length: int, vocab_size: int, swiglu: bool = False) -> float:
    """Training FLOPs of one (source, target) pair of an encoder-decoder transformer, the same dense
    convention as `gpt_flops_per_token` (2 FLOPs per multiply-add, x 3 for forward + backward).

    Encoder layer, per source token: QKV + output (4 h^2), MLP (2 h f or 3 h f), self-attention scores
    + weighted values (2 S h, bidirectional: the full square is the real work).
    Decoder layer, per target token: self-attention like the GPT layer (4 h^2 + 2 T h, full T x T square
    although causal), cross-attention query + output (2 h^2) and scores + weighted values over the
    source (2 S h), MLP; plus, per source token, the cross-attention key/value projection of the
    encoder output (2 h^2). Output layer: h V per target token. With S = T, no encoder and no
    cross-attention this is `gpt_flops_per_token` x T.
    """
    h, f, S, T = hidden_size, ffn_hidden_size, src_length, tgt_length
    mlp = (3 if swiglu else 2) * h * f
    encoder = encoder_num_layers * S * (4 * h * h + mlp + 2 * S * h)
    decoder = decoder_num_layers * (T * (4 * h * h + 2 * T * h + 2 * h * h + 2 * S * h + mlp) + S * 2 * h * h)
    return 3.0 * 2 * (encoder + decoder + T * h * vocab_size)
