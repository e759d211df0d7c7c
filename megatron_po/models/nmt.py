"""Encoder-decoder transformer for machine translation (pre-LN, tensor parallel), one pipeline chunk each.

The model is a stack of Le encoder layers followed by Ld decoder layers, numbered 0..Le+Ld-1 like GPT's
layers, so pipeline partitioning, layout-independent init (`_seeded`, one seed per global layer) and
checkpoint names (`layers.<global number>.`) work unchanged. One `NMTModel` instance is one model chunk:
a contiguous range of that stack, with the embeddings only on the first virtual stage (`pre_process`) and
the final norm, output layer and loss only on the last (`post_process`). The chunk holding layer Le-1
also applies the encoder's final norm.

Between stages travel two tensors, (encoder states [s_src, b, h], decoder states [s_tgt, b, h]): the
first stage embeds both sides, encoder layers update the first and pass the second along, decoder layers
read the (final-normed) encoder states for cross-attention and pass them along too, so every decoder
stage has them and their gradients flow back the same way.

Every stage reads the micro-batch (`reads_batch`): the source padding mask is needed by encoder
self-attention and by every cross-attention. A batch is
    src_tokens [b, s_src]  source ids + EOS, right-padded      src_mask [b, s_src]  True on real tokens
    tgt_tokens [b, s_tgt]  BOS + target ids (decoder input)    labels   [b, s_tgt]  target ids + EOS
    loss_mask  [b, s_tgt]  1.0 on real target positions
Decoder self-attention is causal; target padding sits at the end, so it needs no mask of its own.

The GPT chunk supplies the target (decoder) embedding, the final norm and the output layer, tied to the
target word embedding unless --untie-embeddings-and-output-weights (with the same first/last-stage copy
rule as GPT). The source embedding shares its word embedding with the target one unless
--untie-encoder-decoder-embeddings; position tables are separate. The loss is the label-smoothed
vocab-parallel cross entropy.

`decode_step` runs the same chunk incrementally for generation (pipeline/decode.py): the first call
encodes the source and caches every decoder layer's cross-attention keys/values; each call appends one
target position to the self-attention caches.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig, NMTConfig, recomputes_core_attention
from megatron_po.dynamo_import import import_dynamo
from megatron_po.models.gpt import Embedding, GPTModel, _seeded
from megatron_po.models.recompute import maybe_recompute
from megatron_po.models.transformer import (TransformerLayer, attention_kernel_context, build_norm, dropout,
                                             init_normal, sdpa_inputs)
from megatron_po.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                         gather_from_tensor_model_parallel_region, on_model_parallel_rng)

SOURCE_EMBEDDING_PART = -3  # `_seeded` part number of the source embedding (-1, -2: GPT's embedding, head)


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder states; heads split over TP ranks. The
    key/value projection's rows are laid out per head (k_h, v_h), so a contiguous column split hands each
    TP rank whole heads, as in SelfAttention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_local_heads, self.head_dim = nh // tp, h // nh
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention_backend
        self.recompute_core = recomputes_core_attention(cfg)
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.q = ColumnParallelLinear(h, h, bias=cfg.add_bias_linear, gather_output=False,
                                      init_method=init_normal(cfg.init_method_std))
        self.kv = ColumnParallelLinear(h, 2 * h, bias=cfg.add_bias_linear, gather_output=False,
                                       init_method=init_normal(cfg.init_method_std))
        self.proj = RowParallelLinear(h, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                      init_method=init_normal(out_std))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, attn_mask: torch.Tensor,
                kv_cache: dict | None = None) -> torch.Tensor:
        """x [s, b, h] decoder states, memory [s_src, b, h] (None when `kv_cache` already holds its keys and
        values), attn_mask [b, 1, 1, s_src] True where a source token may be attended."""
        s, b, _ = x.shape
        q, _ = self.q(x)
        q = q.view(s, b, self.num_local_heads, self.head_dim).permute(1, 2, 0, 3)
        if kv_cache is not None and "k" in kv_cache:
            k, v = kv_cache["k"], kv_cache["v"]
        else:
            kv, _ = self.kv(memory)
            k, v = kv.view(memory.shape[0], b, self.num_local_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            if kv_cache is not None:
                kv_cache["k"], kv_cache["v"] = k, v
        ctx = maybe_recompute(self.recompute_core, self.core_attention, q, k, v, attn_mask)
        out, _ = self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_local_heads * self.head_dim))
        return out

    def core_attention(self, q, k, v, attn_mask) -> torch.Tensor:
        """softmax(QKᵀ/√d)V over the source with dropout: what selective recomputation recomputes."""
        p = self.attention_dropout if self.training else 0.0
        q, k, v = sdpa_inputs(self.attention_backend, q, k, v)
        with attention_kernel_context(self.attention_backend, masked=True):
            if p > 0.0:  # heads are split across TP ranks: dropout must differ
                return on_model_parallel_rng(F.scaled_dot_product_attention, q, k, v, attn_mask=attn_mask, dropout_p=p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class EncoderLayer(TransformerLayer):
    """GPT's pre-LN block with bidirectional self-attention over the unpadded source tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, sequence_parallel=False)
        self.attention.causal = False

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, rotary=None) -> torch.Tensor:
        drop = lambda t: dropout(t, self.hidden_dropout, self.training, False)  # noqa: E731
        x = x + drop(self.attention(self.input_norm(x), rotary, attn_mask=attn_mask))
        x = x + drop(self.mlp(self.post_attention_norm(x)))
        return x


class DecoderLayer(TransformerLayer):
    """Causal self-attention, then cross-attention to the encoder states, then the MLP, each pre-LN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, sequence_parallel=False)
        self.cross_attention_norm = build_norm(cfg, cfg.hidden_size, False)
        self.cross_attention = CrossAttention(cfg)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, attn_mask: torch.Tensor, rotary=None,
                cache: dict | None = None) -> torch.Tensor:
        """`cache` (decoding): {"self": {...}, "cross": {...}} key/value caches, filled on first use."""
        drop = lambda t: dropout(t, self.hidden_dropout, self.training, False)  # noqa: E731
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        x = x + drop(self.attention(self.input_norm(x), rotary, kv_cache=self_cache))
        x = x + drop(self.cross_attention(self.cross_attention_norm(x), memory, attn_mask, cross_cache))
        x = x + drop(self.mlp(self.post_attention_norm(x)))
        return x


def _embed_from(embedding: Embedding, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Embedding of `ids` [b, s] at positions start..start+s-1 (decoding; eval mode: no dropout)."""
    x = embedding.word_embeddings(ids)
    if embedding.position_embeddings is not None:
        x = x + embedding.position_embeddings(torch.arange(start, start + ids.shape[1], device=ids.device))[None]
    return x.transpose(0, 1).contiguous()


import_dynamo()  # `set_stance` below imports it: here, not from a caller's frames (dynamo_import.py)


class NMTModel(GPTModel):
    reads_batch = True  # the pipeline executor hands every stage the micro-batch (its padding masks)

    def __init__(self, cfg: ModelConfig, nmt: NMTConfig, src_vocab_size: int, tgt_vocab_size: int, seed: int, *,
                 pre_process: bool = True, post_process: bool = True, layer_offset: int = 0,
                 num_layers: int | None = None):
        """`cfg.num_layers` is the stacked count Le + Ld (config.normalize_nmt); vocab sizes are padded."""
        if nmt.encoder_num_layers + nmt.decoder_num_layers != cfg.num_layers:
            raise ValueError(f"num_layers ({cfg.num_layers}) must be encoder ({nmt.encoder_num_layers}) + decoder "
                             f"({nmt.decoder_num_layers}) layers: call config.normalize_nmt first")
        # One position table size for both sides: the longer of the source and target bounds.
        cfg = dataclasses.replace(cfg, max_position_embeddings=cfg.max_position_embeddings
                                  or max(cfg.seq_length, nmt.decoder_seq_length))
        # The GPT chunk without layers: target embedding, rotary, final norm, (tied) output layer.
        super().__init__(cfg, tgt_vocab_size, seed, pre_process=pre_process, post_process=post_process,
                         layer_offset=layer_offset, num_layers=0)
        self.num_encoder_layers = nmt.encoder_num_layers
        self.label_smoothing = nmt.label_smoothing
        self.tgt_vocab_size = tgt_vocab_size
        n = cfg.num_layers if num_layers is None else num_layers

        self.encoder_embedding = None
        if pre_process:
            with _seeded(seed, SOURCE_EMBEDDING_PART):
                self.encoder_embedding = Embedding(cfg, src_vocab_size, sequence_parallel=False)
            if not nmt.untie_encoder_decoder_embeddings:
                if src_vocab_size != tgt_vocab_size:
                    raise ValueError(f"shared embeddings need one vocabulary (source {src_vocab_size}, "
                                     f"target {tgt_vocab_size})")
                # One parameter, named after the target embedding (registered first).
                self.encoder_embedding.word_embeddings.weight = self.embedding.word_embeddings.weight
        layers = []
        for i in range(layer_offset, layer_offset + n):
            with _seeded(seed, i):
                layers.append(EncoderLayer(cfg) if i < self.num_encoder_layers else DecoderLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.encoder_final_norm = None
        if layer_offset <= self.num_encoder_layers - 1 < layer_offset + n:
            self.encoder_final_norm = build_norm(cfg, cfg.hidden_size, False)

    def _rotary(self, length: int, device, start: int = 0):
        if self.rotary is None:
            return None
        cos, sin = self.rotary(start + length, device)
        return cos[start:], sin[start:]

    def _run_layers(self, enc, dec, attn_mask, rot_src, rot_tgt, caches: dict | None = None):
        """The chunk's layers; with `caches` (decoding) encoder layers run only while `enc` is given."""
        for i, layer in enumerate(self.layers, start=self.layer_offset):
            if i < self.num_encoder_layers:
                if enc is not None:
                    enc = layer(enc, attn_mask, rot_src)
                    if i == self.num_encoder_layers - 1:
                        enc = self.encoder_final_norm(enc)
            else:
                dec = layer(dec, enc, attn_mask, rot_tgt, None if caches is None else caches.setdefault(i, {}))
        return enc, dec

    def forward(self, batch: dict, hidden_states: tuple | None = None) -> tuple | torch.Tensor:
        """Returns (encoder states, decoder states) on all but the last stage; there, per-token losses
        [b, s_tgt] when the batch has labels, else vocab-parallel logits [s_tgt, b, V/tp]."""
        if self.pre_process:
            enc = self.encoder_embedding(batch["src_tokens"])
            dec = self.embedding(batch["tgt_tokens"])
        else:
            enc, dec = hidden_states
        attn_mask = batch["src_mask"][:, None, None, :]
        enc, dec = self._run_layers(enc, dec, attn_mask, self._rotary(enc.shape[0], enc.device),
                                    self._rotary(dec.shape[0], dec.device))
        if not self.post_process:
            return enc, dec
        if "labels" not in batch:
            return self.output_layer(self.final_norm(dec))[0]  # [s_tgt, b, V/tp]
        return self.output_loss(self.final_norm(dec), batch["labels"], self.label_smoothing, batch.get("loss_mask"))

    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")  # --torch-compile: every step has a new length, so decode eagerly
    def decode_step(self, batch: dict, hidden_states: tuple | None, state: dict):
        """One incremental decoding step of this chunk. `batch`: src_tokens and src_mask (every step),
        tgt_tokens [b, s_new] (first stage: the newest target tokens). `state`: this chunk's caches, {} on
        the first step. The first step sends (encoder states, decoder states) on, later steps only
        (decoder states,). The last stage returns the full-vocabulary logits of the newest position
        [b, V] (gathered over TP), in fp32."""
        start = state.get("position", 0)
        if self.pre_process:
            enc = self.encoder_embedding(batch["src_tokens"]) if start == 0 else None
            dec = _embed_from(self.embedding, batch["tgt_tokens"], start)
        elif start == 0:
            enc, dec = hidden_states
        else:
            enc, (dec,) = None, hidden_states
        attn_mask = batch["src_mask"][:, None, None, :]
        rot_src = self._rotary(enc.shape[0], enc.device) if enc is not None else None
        enc, dec = self._run_layers(enc, dec, attn_mask, rot_src, self._rotary(dec.shape[0], dec.device, start),
                                    state.setdefault("layers", {}))
        state["position"] = start + dec.shape[0]
        if not self.post_process:
            return (enc, dec) if start == 0 else (dec,)
        logits, _ = self.output_layer(self.final_norm(dec[-1:]))
        return gather_from_tensor_model_parallel_region(logits)[0].float()


def reorder_decode_state(state: dict, index: torch.Tensor) -> None:
    """Beam search: keep the caches of hypotheses `index` (rows of the batch) in this chunk's state."""
    for cache in state.get("layers", {}).values():
        for kv in cache.values():
            for key in kv:
                kv[key] = kv[key].index_select(0, index)
