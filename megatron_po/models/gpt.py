"""GPT: embedding -> pre-LN transformer layers -> final norm -> (vocab-parallel) output layer + loss.

One `GPTModel` instance is one model chunk: a contiguous range of layers, with the embedding only when
it is the first virtual pipeline stage (`pre_process`) and the final norm, output layer and loss only
when it is the last (`post_process`), and there too the multi-token prediction depths (--mtp-num-layers,
models/mtp.py). With one stage and one chunk it is the whole model.

Initialization does not depend on the parallel layout: every layer is built from its own seed
(derived from `--seed` and its global layer number), and tensor-parallel layers draw the full weight
and keep their slice. So the TP=2 x PP=2 model holds exactly the pieces of the TP=1 x PP=1 model,
which is what the equivalence tests compare against.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig
from megatron_po.data.context_split import this_rank_positions
from megatron_po.data.document_masks import document_causal_mask
from megatron_po.models.fp8 import enable_fp8, uses_torchao
from megatron_po.models.mtp import MTPDepth, MultiTokenPrediction
from megatron_po.models.recompute import layer_groups, run_layers
from megatron_po.models.transformer import (RotaryEmbedding, TransformerLayer, build_norm, dropout, init_normal,
                                             rotary_dim)
from megatron_po.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                         scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
from megatron_po.tensor_parallel.output_cross_entropy import output_layer_cross_entropy


@contextlib.contextmanager
def _seeded(seed: int, part: int):
    """Build one part of the model (a layer number, or -1/-2 for embedding/head) from its own seed,
    leaving the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + (part + 2) * 7919) % (2**63 - 1))
        yield


# --------------------------------------------------------------------------------------------------
# Implementation choice (--transformer-impl); here, above both transformer.py and te_transformer.py,
# so that the Transformer Engine layer (built on the local one) imports the local module and not back
# --------------------------------------------------------------------------------------------------


def build_transformer_layer(cfg: ModelConfig, sequence_parallel: bool, layer_number: int | None = None) -> nn.Module:
    """A pre-norm layer of the configured implementation. Both start from the same weights: the
    Transformer Engine layer copies those of the local layer built here (same seed, same draws).
    `layer_number`: the global layer number (which layers are MoE layers)."""
    layer = TransformerLayer(cfg, sequence_parallel, layer_number)
    if uses_torchao(cfg):  # --fp8-format on the local layers: their linears' GEMMs in FP8 (models/fp8.py)
        enable_fp8(layer, cfg)
    if cfg.transformer_impl == "transformer_engine":
        from megatron_po.models.te_transformer import TETransformerLayer  # imports transformer_engine
        layer = TETransformerLayer(cfg, sequence_parallel, initial=layer)
    return layer


def layers_context(cfg: ModelConfig):
    """A zero-argument callable giving the context the layers of a forward run in: Transformer Engine's
    FP8 autocast with --fp8-format (torchao's FP8 needs none: its linears carry their FP8 GEMM), else nothing."""
    if cfg.transformer_impl == "transformer_engine" and cfg.fp8_format is not None:
        from megatron_po.models.te_transformer import FP8Autocast
        return FP8Autocast(cfg)
    return contextlib.nullcontext


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size,
                                                      init_method=init_normal(cfg.init_method_std))
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings or cfg.seq_length, cfg.hidden_size)
            init_normal(cfg.init_method_std)(self.position_embeddings.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [s]: the tokens' places in the whole sequence (context parallelism), else 0 .. s-1."""
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                if positions is None:
                    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
                x = x + self.position_embeddings(positions)[None]
            else:  # --reset-position-ids: [b, s]
                x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        return dropout(x, self.hidden_dropout, self.training, self.sequence_parallel)


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, seed: int, *, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_layers: int | None = None,
                 sequence_parallel: bool = False, share_mtp_embedding: bool = True):
        """`share_mtp_embedding` False (asynchronous methods): an MTP block on a chunk without the embedding owns
        its copy of the word embedding instead of tying it to the first stage's (models/mtp.py)."""
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel
        self.layer_offset = layer_offset
        # --context-parallel-size > 1: the micro-batch holds this rank's 2 of 2 x CP chunks of every sequence
        self.context_parallel = ps.get_context_parallel_world_size() > 1
        n = cfg.num_layers if num_layers is None else num_layers
        self.tie_output = not cfg.untie_embeddings_and_output_weights

        self.embedding = None
        if pre_process:
            with _seeded(seed, -1):
                self.embedding = Embedding(cfg, padded_vocab_size, sequence_parallel)
            # Tied to the output layer, or read by the MTP block (here or on the last virtual stage): see
            # allreduce_embedding_grads.
            mtp_elsewhere = bool(cfg.mtp_num_layers) and not post_process and share_mtp_embedding
            self.embedding.word_embeddings.weight.shared_embedding = self.tie_output or mtp_elsewhere
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(rotary_dim(cfg), cfg.rotary_base, cfg.rotary_seq_len_interpolation_factor,
                                          cfg.rope_scaling_factor if cfg.use_rope_scaling else None)
        layers = []
        for i in range(layer_offset, layer_offset + n):
            with _seeded(seed, i):
                layers.append(build_transformer_layer(cfg, sequence_parallel, i))
        self.layers = nn.ModuleList(layers)
        self.recompute_groups = layer_groups(cfg, n)  # --recompute-granularity full: checkpointed layer ranges
        self.layers_context = layers_context(cfg)  # FP8 autocast with Transformer Engine + --fp8-format

        self.final_norm = self.output_layer = None
        self.output_loss_backend = None  # torch.compile's backend of the chunked output loss (compiled_layers.py)
        if post_process:
            self.final_norm = build_norm(cfg, cfg.hidden_size, sequence_parallel)
            with _seeded(seed, -2):
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, padded_vocab_size, bias=False,
                                                         gather_output=False,
                                                         init_method=init_normal(cfg.init_method_std),
                                                         sequence_parallel=sequence_parallel)
            if self.tie_output:
                if pre_process:
                    # One parameter serves both ends; the output layer reads the embedding's weight.
                    del self.output_layer.weight
                    self.output_layer.weight = self.embedding.word_embeddings.weight
                else:
                    # The last pipeline stage keeps a copy that starts equal to the embedding (same seed)
                    # and whose gradient is all-reduced with the first stage's (synchronous methods only).
                    with _seeded(seed, -1):
                        copy = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size,
                                                      init_method=init_normal(cfg.init_method_std))
                    self.output_layer.weight = copy.weight
                    self.output_layer.weight.shared_embedding = True
                    self.output_layer.weight.embedding_copy = True  # not counted twice in norms/checkpoints
        self.mtp = None
        if post_process and cfg.mtp_num_layers:
            self.mtp = self._build_mtp(cfg, padded_vocab_size, seed, sequence_parallel, share_mtp_embedding)
            self.reads_batch = True  # the executor hands this chunk the micro-batch: MTP reads its tokens

    def _build_mtp(self, cfg: ModelConfig, padded_vocab_size: int, seed: int, sequence_parallel: bool,
                   share_embedding: bool) -> MultiTokenPrediction:
        """The MTP depths, depth d's layer global layer L + d - 1 (its seed and, with MoE, its layer number), and
        the block's copy of the word embedding where this chunk has none (models/mtp.py)."""
        depths = []
        for number in range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers):
            with _seeded(seed, number):
                depths.append(MTPDepth(cfg, sequence_parallel, build_transformer_layer(cfg, sequence_parallel, number)))
        mtp = MultiTokenPrediction(cfg, depths)
        if not self.pre_process:
            with _seeded(seed, -1):  # the embedding's draws: equal to the first stage's at the start
                mtp.embedding = Embedding(cfg, padded_vocab_size, sequence_parallel)
            word = mtp.embedding.word_embeddings
            if self.tie_output:  # the output layer's copy of the embedding serves MTP too
                word.weight = self.output_layer.weight
            elif share_embedding:
                word.weight.shared_embedding = True
                word.weight.embedding_copy = True
        return mtp

    def forward(self, input_ids: torch.Tensor | dict | None = None, hidden_states: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                loss_normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes `input_ids` [b, s]; later stages take `hidden_states` [s, b, h].
        With `reads_batch` set (--reset-position-ids / --reset-attention-mask, or the MTP block here) every
        stage is handed the micro-batch dict instead, whose `position_ids` / `document_ids` [b, s] shape
        positions and mask.

        Returns hidden states [s, b, h] (not the last stage), per-token losses [b, s] (last stage with
        labels; in training with the MTP loss attached, models/mtp.py) or vocab-parallel logits [s, b, V/tp]
        (last stage without labels). `loss_mask` [b, s]: how the caller will weight the per-token losses (the
        chunked output loss then computes its gradients in the forward, `output_loss`); `loss_normalizer`: what
        the caller divides their masked sum by, where not the micro-batch's own loss tokens (the MTP loss
        follows it).
        """
        position_ids = attn_mask = None
        tokens = input_ids  # the MTP block reads them on the last stage
        if isinstance(input_ids, dict):
            batch = input_ids
            tokens = batch["tokens"]
            input_ids = tokens if self.pre_process else None
            labels = batch.get("labels") if self.post_process else None
            loss_mask = batch.get("loss_mask") if self.post_process else None
            loss_normalizer = batch.get("loss_normalizer") if self.post_process else None
            position_ids = batch.get("position_ids")
            if "document_ids" in batch:  # context parallelism: the attention masks each key block itself
                ids = batch["document_ids"]
                attn_mask = ids if self.context_parallel else document_causal_mask(ids)
        tp_split = ps.get_tensor_model_parallel_world_size() if self.sequence_parallel else 1
        seq = input_ids.shape[1] if self.pre_process else hidden_states.shape[0] * tp_split  # this rank's tokens
        positions = None
        if self.context_parallel and position_ids is None:
            positions = this_rank_positions(seq, input_ids.device if self.pre_process else hidden_states.device)
        x = self.embedding(input_ids, position_ids, positions) if self.pre_process else hidden_states
        rotary = None
        if self.rotary is not None:
            rotary = self.rotary(seq, x.device, position_ids, positions=positions)
        with self.layers_context():
            extra = () if attn_mask is None else (attn_mask,)
            x = run_layers(self.layers, self.recompute_groups, x, rotary, *extra)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        if labels is None:
            return self.output_layer(x)[0]  # [s, b, V/tp]; gathers the sequence under sequence parallel
        losses = self.output_loss(x, labels, loss_mask=loss_mask)
        if self.mtp is None or not self.training:
            return losses
        with self.layers_context():
            return self.mtp(x, tokens, labels, loss_mask, losses, rotary=rotary, extra=extra,
                            embedding=self.embedding if self.pre_process else self.mtp.embedding,
                            output_loss=self.output_loss, loss_normalizer=loss_normalizer)

    def output_loss(self, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                    loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token losses [b, s] of the final-normed states `x` [s, b, h] against `labels` [b, s]: chunked
        (--chunked-output-loss, tensor_parallel/output_cross_entropy.py), else the logits, then the
        vocab-parallel cross entropy. `loss_mask` [b, s]: the weights the caller gives the losses (the chunked
        path's gradients are computed in the forward where the backward's gradient is a multiple of them)."""
        target = labels.t().contiguous()
        if self.cfg.chunked_output_loss:
            weight = None if loss_mask is None else loss_mask.t()
            return output_layer_cross_entropy(self.output_layer, x, target, label_smoothing,
                                              self.output_loss_backend, weight).t()
        logits, _ = self.output_layer(x)
        return vocab_parallel_cross_entropy(logits.float(), target, label_smoothing).t()


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)

