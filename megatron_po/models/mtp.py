"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-core's --mtp-num-layers and multi_token_prediction.py).

The last virtual pipeline stage of a GPT holds, after its final norm and output layer, N sequential MTP depths.
Depth d (1..N) takes h^(d-1) [s, b, h] (h^0: the main model's final-normed states, what its output layer reads,
as in Megatron, whose decoder block ends in that norm) and the word embedding of the tokens d places ahead:

    h^d = final_norm_d(layer_d(eh_proj_d([enorm_d(Emb(t_(i+d))) ; hnorm_d(h_i^(d-1))])))

the embedding half first (Megatron's order), eh_proj_d a 2h -> h projection without bias (column-parallel, then
gathered over TP and, under sequence parallelism, split over the sequence again, as Megatron's), layer_d one
transformer layer of the kind of the model's last layer (dense or MoE; the main model's attention, rotary and
mask). The shared output layer turns h^d into the logits of token i+d+1; their cross entropy against the labels
rolled d places to the left, the loss mask rolled alike (Megatron's roll: the last d positions get label 0 and
mask 0), is depth d's loss

    L_d = sum_i mask_d,i ce_d,i / sum_i mask_d,i

and the MTP loss added to the LM loss for the backward is (--mtp-loss-scaling-factor / N) x sum_d L_d. It reaches
the backward as the MoE auxiliary losses do (moe/aux_losses.py): attached to the LM's per-token losses by an
identity whose backward gives it the gradient the LM loss gets (1/M, times the fp16 loss scale: the executor's
`aux_loss_scale`), so no stage sends a loss anywhere and no schedule changes. Where the LM loss is divided by a
`loss_normalizer` instead of its micro-batch's own tokens (--calculate-per-token-loss: a sum over the global
batch's tokens; context parallelism: the whole micro-batch's tokens / CP), each depth's sum is rescaled by the
micro-batch's loss tokens over its own before that division, as Megatron does, so the MTP term keeps its weight.

Context parallelism: each CP rank holds 2 of the sequence's 2 x CP chunks (data/context_split.py), so a roll
crosses the ranks. The tokens, labels and loss mask (small integer and float [b, s / CP] tensors, no gradient) are
gathered into the whole sequences once per micro-batch, rolled there, and each rank keeps its share; the token
counts are the whole micro-batch's (Megatron exchanges the chunks' boundary elements instead: the same values).

Positions: MTP takes RoPE or no position embedding (--position-embedding-type rope or none, Megatron's rule):
the depths use the main model's rotary (not rolled, as Megatron). Only training forwards run the depths:
evaluation reports the LM loss, which MTP does not change. Each depth is recomputed in the backward under
--recompute-granularity full (as Megatron's).

The shared embedding. Where the MTP block sits on the chunk that holds the embedding (one stage, one chunk), it
reads that embedding. Elsewhere (the last virtual stage of a pipeline) the block holds a copy, drawn from the
embedding's own seed, so equal at the start:
- synchronous methods: the copy is tied to the first stage's (`shared_embedding`, `embedding_copy`), its gradient
  summed with the embedding's (ddp.allreduce_embedding_grads, over the embedding group: Megatron's way, which
  adds the MTP stage to the embedding ranks); with tied input/output embeddings it is the output layer's copy;
- asynchronous methods, whose stages step apart and sum no gradient across stages: the copy is the last stage's
  own parameter (`mtp.embedding.word_embeddings.weight`, checkpointed), trained by the MTP loss only, predicted
  and stashed like any other weight of the stage.

`record`: the depths' losses (detached) summed over the training forwards since `mtp_metrics` last read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig, mtp_loss_scale, recompute_granularity
from megatron_po.config_check import Rule, at_least
from megatron_po.data.context_split import this_rank_share, whole_sequences
from megatron_po.models.moe.aux_losses import attach
from megatron_po.models.recompute import maybe_recompute, recompute_state
from megatron_po.models.transformer import build_norm, init_normal
from megatron_po.tensor_parallel import (ColumnParallelLinear, gather_from_tensor_model_parallel_region,
                                         scatter_to_sequence_parallel_region)


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """Megatron's roll_tensor(shifts=-1) along the sequence (the last dim of [b, s]): position i takes i+1's
    value, the last position 0."""
    out = torch.roll(t, -1, dims=-1)
    out[..., -1] = 0
    return out


class MTPDepth(nn.Module):
    """One depth: the two input norms, the 2h -> h projection, one transformer layer, the depth's final norm."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, transformer_layer: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.sequence_parallel = sequence_parallel
        self.enorm = build_norm(cfg, h, sequence_parallel)
        self.hnorm = build_norm(cfg, h, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, gather_output=False,
                                            init_method=init_normal(cfg.init_method_std),
                                            sequence_parallel=sequence_parallel)
        self.transformer_layer = transformer_layer
        self.final_norm = build_norm(cfg, h, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary, *extra) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h / tp]
        x = gather_from_tensor_model_parallel_region(x)  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        return self.final_norm(self.transformer_layer(x, rotary, *extra))


class MTPRecord:
    """The depths' losses summed over the training forwards since the last `take`, kept on the model's device."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums, self.forwards = None, 0

    def add(self, losses: torch.Tensor) -> None:
        self.sums = losses.double() if self.sums is None else self.sums + losses.double()
        self.forwards += 1

    def take(self, depths: int) -> tuple[torch.Tensor, int]:
        out = (torch.zeros(depths, dtype=torch.float64) if self.sums is None else self.sums.cpu(), self.forwards)
        self.reset()
        return out


class MultiTokenPrediction(nn.Module):
    """The N depths of the last virtual stage (module docstring). `embedding`: the block's own copy of the word
    embedding (set by GPTModel where the chunk holds none), else None."""

    def __init__(self, cfg: ModelConfig, depths: list[MTPDepth]):
        super().__init__()
        self.layers = nn.ModuleList(depths)
        self.embedding = None
        self.loss_scale = mtp_loss_scale(cfg) / len(depths)
        self.recompute = recompute_granularity(cfg) == "full"
        self.record = MTPRecord()

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor | None, lm_losses: torch.Tensor, *, embedding, output_loss, rotary,
                extra=(), loss_normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """`lm_losses` [b, s] with the MTP loss attached (same values). `hidden` [s, b, h]: the final-normed
        states; `tokens`, `labels`, `loss_mask` [b, s]; `embedding` the word embedding to read (a gpt.Embedding),
        `output_loss` the output layer's per-token loss (GPTModel.output_loss); `loss_normalizer`: what the caller
        divides the summed LM losses by, where not the micro-batch's own loss tokens."""
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        # Rolled over the whole sequences (context parallelism: gathered from the CP ranks, each keeping its share)
        whole = [whole_sequences(t) for t in (tokens, labels, mask)]
        micro_batch_tokens, cp = whole[2].sum(), ps.get_context_parallel_world_size()
        total, per_depth = 0.0, []
        for depth in self.layers:
            whole = [roll_left(t) for t in whole]
            tokens, labels, mask = (this_rank_share(t) for t in whole)
            hidden = maybe_recompute(self.recompute, depth, hidden, embedding(tokens), rotary, *extra,
                                     params=list(depth.parameters()),
                                     state=recompute_state([depth]) if self.recompute else ())
            summed = (output_loss(hidden, labels, loss_mask=mask) * mask).sum()  # this CP rank's tokens
            tokens_d = whole[2].sum().clamp(min=1.0)  # the whole micro-batch's
            per_depth.append(summed.detach() * cp / tokens_d)  # the mean over the CP ranks is the depth's loss
            if loss_normalizer is None:
                total = total + summed / tokens_d
            else:  # Megatron's per-token form: rescaled to the micro-batch's tokens, then divided as the LM loss
                total = total + summed * (micro_batch_tokens / tokens_d) / loss_normalizer
        self.record.add(torch.stack(per_depth))
        return attach(lm_losses, total * self.loss_scale)


def mtp_blocks(chunks) -> list[MultiTokenPrediction]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MultiTokenPrediction)]


def mtp_metrics(cfg: Config, chunks) -> dict[str, float]:
    """The MTP losses of the training forwards since the last call, averaged over them and over the data-parallel
    replicas: `mtp_loss` (the mean over the depths, without the scaling factor) and `mtp_loss/depth<d>`. Called
    where the chunks hold the MTP block (the loss stage's ranks: a data-parallel all-reduce); {} elsewhere."""
    blocks = mtp_blocks(chunks)
    if not blocks:
        return {}
    depths = cfg.model.mtp_num_layers
    sums, forwards = blocks[0].record.take(depths)
    totals = torch.cat([sums, torch.tensor([float(forwards)], dtype=torch.float64)])
    if dist.is_initialized() and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        totals = totals.to(ps.get_device())
        dist.all_reduce(totals, group=group)
        totals = totals.cpu()
    means = (totals[:depths] / totals[depths].clamp(min=1.0)).tolist()
    out = {f"mtp_loss/depth{d + 1}": v for d, v in enumerate(means)}
    out["mtp_loss"] = sum(means) / depths
    return out


def mtp_text(metrics: dict[str, float]) -> str:
    """The console line's part for `mtp_metrics` (empty without)."""
    if "mtp_loss" not in metrics:
        return ""
    depths = sorted((k for k in metrics if k.startswith("mtp_loss/depth")), key=lambda k: int(k.rsplit("depth", 1)[1]))
    each = f" (depths {', '.join(f'{metrics[k]:.4f}' for k in depths)})" if len(depths) > 1 else ""
    return f" | mtp loss {metrics['mtp_loss']:.4f}{each}"


def _mtp(c) -> bool:
    return c.m.mtp_num_layers is not None


# Config rules (rows of config_rules.RULES, tests/test_config_rules.py).
MTP_RULES = [
    *at_least(1, [("--mtp-num-layers", lambda c: c.m.mtp_num_layers)], optional=True),
    Rule("mtp-loss-scaling-factor-needs-mtp", lambda c: c.m.mtp_loss_scaling_factor is None or _mtp(c),
         "--mtp-loss-scaling-factor weights the multi-token prediction loss: it needs --mtp-num-layers"),
    Rule("mtp-loss-scaling-factor>=0", lambda c: mtp_loss_scale(c.m) >= 0,
         lambda c: f"--mtp-loss-scaling-factor must be >= 0 (got {c.m.mtp_loss_scaling_factor})", when=_mtp),
    Rule("mtp-gpt-only", lambda c: c.workload == "gpt",
         "--mtp-num-layers predicts further tokens of pretrain_gpt.py's stream; pretrain_nmt.py has no MTP",
         when=_mtp),
    Rule("mtp-position-embedding", lambda c: c.m.position_embedding_type in ("rope", "none"),
         lambda c: f"--mtp-num-layers needs --position-embedding-type rope or none (got {c.m.position_embedding_type}"
                   f"): the MTP depths reuse the main model's positions, as Megatron requires", when=_mtp),
]
