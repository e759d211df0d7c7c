"""Model FLOPs of one training iteration (forward + backward), Megatron's dense convention: what
`--log-throughput` divides by time for TFLOP/s and MFU, for the GPT and the encoder-decoder workloads."""

from __future__ import annotations

from megatron_po.config import Config, ffn_hidden_size, kv_channels, num_query_groups


def gpt_flops_per_token(cfg: Config, vocab_size: int, causal: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron's dense convention.

    Per layer and token the forward does 2 FLOPs per multiply-add of: QKV (3h^2), attention output
    (h^2), MLP (2 h f, or 3 h f with SwiGLU), and attention scores + weighted values (2 s h, counting
    the full s x s square as Megatron does, although causal masking needs only half). Plus the output
    layer (h V). With f = 4h and no SwiGLU this is Megatron's 72 L h^2 (1 + s/(6h) + V/(12 L h)) per
    token. `causal`: the attention counted over the causal half of the square (s h), the work a kernel that
    skips masked blocks does; at long sequences the two conventions part (bench/gpu/gpu_long_context.py).
    """
    m = cfg.model
    h, s, L, f = m.hidden_size, m.seq_length, m.num_layers, ffn_hidden_size(m)
    mlp = (3 if m.swiglu else 2) * h * f
    # Attention with a = heads x head dim (h by default) and g = key/value groups x head dim (GQA): QKV h (a + 2g),
    # output a h, scores + weighted values 2 s a; 4h^2 + 2 s h without GQA and --kv-channels.
    a, g = m.num_attention_heads * kv_channels(m), num_query_groups(m) * kv_channels(m)
    per_layer = 2 * (h * (a + 2 * g) + a * h + mlp + (1 if causal else 2) * s * a)
    return 3.0 * (L * per_layer + 2 * h * vocab_size)


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


