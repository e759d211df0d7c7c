"""What the routers did, as the training log shows it (issue 48 item 6): for every MoE layer, over the training
forwards since the last logged iteration (every micro-batch, every rank),

    moe/aux_loss/layer<i>                  the load-balancing loss (aux_loss or seq_aux_loss, without its coefficient),
                                           mean over the forwards; where --moe-aux-loss-coeff > 0
    moe/z_loss/layer<i>                    the router z-loss (without its coefficient); where --moe-z-loss-coeff > 0
    moe/tokens_per_expert_max/layer<i>     tokens (token-expert pairs) the busiest expert took,
    moe/tokens_per_expert_mean/layer<i>    and the mean over the experts: max / mean is 1 when balanced
    moe/dropped_tokens/layer<i>            token-expert pairs the capacity dropped (0 when dropless)

plus their summaries over the layers: moe/aux_loss and moe/z_loss (means, as Megatron logs them),
moe/tokens_per_expert_max_over_mean (the worst layer's) and moe/dropped_tokens (the sum). Layers are numbered
globally from 0, as the start-up line and the checkpoint names number them. The metrics file, W&B and
TensorBoard get these keys (sections "moe/" there); the console a line of its own (`moe_line`).

`moe_metrics` is collective over all ranks (one all-reduce of a [MoE layers, 4 + experts] tensor): every rank
holds its own layers' records (layer.py's MoERecord) and its own tokens, so the sums over the world are the
run's; a synchronous run calls it at every logged iteration, an asynchronous pipeline at each evaluation's cut
in its stream and at the drain that ends a segment (async_training.py: points every rank reaches; each layer's
numbers then cover its stage's forwards since the last call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config
from megatron_po.models.moe.layer import take_records
from megatron_po.models.moe.layout import moe_layer_numbers


def _reported_losses(cfg: Config) -> list[str]:
    m = cfg.model
    losses = []
    if m.moe_aux_loss_coeff and m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss"):
        losses.append("aux_loss")
    if m.moe_z_loss_coeff:
        losses.append("z_loss")
    return losses


def moe_metrics(cfg: Config, chunks) -> dict[str, float]:
    """The MoE metrics of the training forwards since the last call (module docstring); collective over every
    rank, the same dict on each. {} without --num-experts."""
    if cfg.model.num_experts is None:
        return {}
    layers = moe_layer_numbers(cfg.model)  # with the MTP depths' MoE layers, numbered after the decoder's
    row = {number: r for r, number in enumerate(layers)}
    losses = _reported_losses(cfg)
    # Per layer: the losses summed over the forwards, the forwards, dropped pairs, tokens per expert.
    sums = torch.zeros(len(layers), len(losses) + 2 + cfg.model.num_experts, dtype=torch.float64)
    for number, record in take_records(chunks).items():
        n = record["forwards"]
        sums[row[number], :len(losses)] = torch.tensor([record.get(k, 0.0) * n for k in losses], dtype=torch.float64)
        sums[row[number], len(losses):len(losses) + 2] = torch.tensor([n, record["dropped_tokens"]], dtype=torch.float64)
        sums[row[number], len(losses) + 2:] = torch.tensor(record["tokens_per_expert"], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = sums.to(ps.get_device())
        dist.all_reduce(sums)
        sums = sums.cpu()
    out: dict[str, float] = {}
    imbalance = []
    for r, number in enumerate(layers):
        forwards, dropped = sums[r, len(losses)].item(), sums[r, len(losses) + 1].item()
        for k, name in enumerate(losses):
            out[f"moe/{name}/layer{number}"] = sums[r, k].item() / max(forwards, 1.0)
        tokens = sums[r, len(losses) + 2:]
        out[f"moe/tokens_per_expert_max/layer{number}"] = tokens.max().item()
        out[f"moe/tokens_per_expert_mean/layer{number}"] = tokens.mean().item()
        out[f"moe/dropped_tokens/layer{number}"] = int(dropped)
        imbalance.append(tokens.max().item() / tokens.mean().item() if tokens.sum() > 0 else 1.0)
    for name in losses:
        out[f"moe/{name}"] = sum(out[f"moe/{name}/layer{i}"] for i in layers) / len(layers)
    out["moe/tokens_per_expert_max_over_mean"] = max(imbalance)
    out["moe/dropped_tokens"] = sum(out[f"moe/dropped_tokens/layer{i}"] for i in layers)
    return out


def moe_line(metrics: dict[str, float]) -> str:
    """The console line of `moe_metrics`: one value per MoE layer for each quantity, layers in order."""
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in metrics if k.startswith("moe/dropped_tokens/layer"))
    parts = [f" MoE layers {', '.join(map(str, layers))}"]
    for name, label in (("aux_loss", "aux loss"), ("z_loss", "z loss")):
        if f"moe/{name}" in metrics:
            parts.append(f"{label} " + ", ".join(f"{metrics[f'moe/{name}/layer{i}']:.4f}" for i in layers))
    ratios = []
    for i in layers:
        mean = metrics[f"moe/tokens_per_expert_mean/layer{i}"]
        ratios.append(f"{metrics[f'moe/tokens_per_expert_max/layer{i}'] / mean:.2f}" if mean else "-")
    parts.append("tokens per expert max/mean " + ", ".join(ratios))
    parts.append("dropped tokens " + ", ".join(str(metrics[f"moe/dropped_tokens/layer{i}"]) for i in layers))
    return " | ".join(parts)
