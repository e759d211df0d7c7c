"""Context parallelism's split of every sequence (Megatron-LM's `get_batch_on_this_cp_rank`).

A sequence of s tokens is cut into 2·CP chunks of s / (2·CP); CP rank i holds chunks i and 2·CP−1−i,
concatenated. Under a causal mask a later chunk costs more attention than an earlier one, and each rank's
pair sums to the same work: rank i's queries see (i + 1) + (2·CP − i) chunk-lengths of keys, 2·CP + 1 on
every rank (the first and last chunk together, the second and the one before last, ...).

    s = 8, CP = 2: chunks [0 1][2 3][4 5][6 7]; rank 0 holds tokens 0 1 6 7, rank 1 holds 2 3 4 5

Every CP rank of one data-parallel rank reads the same micro-batch, and keeps its chunks of each
[b, s] tensor (tokens, labels, loss mask, --reset-position-ids' positions). --reset-attention-mask's
`document_ids` stay whole: the attention builds each key block's mask from the ids of both sides.
Positions (learned, RoPE) are each token's place in the whole sequence (`token_indices`).

The loss: each rank computes the summed loss of its tokens, divided by `loss_normalizer` = the loss
tokens of the whole micro-batch / CP. Gradients are averaged over DP x CP, so that factor CP makes them
the gradient of the whole micro-batch's masked mean (Megatron multiplies the loss by CP the same way),
and the mean of the ranks' losses over CP is that micro-batch's loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps

WHOLE = ("document_ids",)  # kept whole on every CP rank


def token_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions in the whole sequence of the tokens CP rank `cp_rank` holds, in its order: chunk
    `cp_rank`, then chunk 2·CP−1−cp_rank (int64 [seq_len / CP])."""
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def split_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's share of a micro-batch dict of [b, s] tensors (module docstring), with its
    `loss_normalizer` (the loss tokens of the whole micro-batch / CP, at least 1 / CP)."""
    s = batch["tokens"].shape[1]
    idx = token_indices(s, cp_size, cp_rank, batch["tokens"].device)
    out = {k: (v if k in WHOLE or v.dim() < 2 or v.shape[1] != s else v.index_select(1, idx).contiguous())
           for k, v in batch.items()}
    if "loss_mask" in batch:
        out["loss_normalizer"] = batch["loss_mask"].float().sum().clamp(min=1.0) / cp_size
    return out


def split_for_this_rank(batch: dict) -> dict:
    """`split_batch` for this rank's CP group (the batch unchanged without context parallelism)."""
    cp = ps.get_context_parallel_world_size()
    return batch if cp == 1 else split_batch(batch, cp, ps.get_context_parallel_rank())


def whole_sequences(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_for_this_rank` for one [b, s / CP] tensor (no gradient): every CP rank's share
    gathered into the whole sequences [b, s]; `t` itself without context parallelism. Collective over the CP
    group."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_context_parallel_group())
    s = t.shape[1] * cp
    whole = t.new_empty(t.shape[0], s)
    for r, part in enumerate(parts):
        whole[:, token_indices(s, cp, r, t.device)] = part
    return whole


def this_rank_share(whole: torch.Tensor) -> torch.Tensor:
    """This CP rank's share of a whole [b, s] tensor (`split_batch`'s); the tensor itself without CP."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return whole
    return whole.index_select(1, token_indices(whole.shape[1], cp, ps.get_context_parallel_rank(), whole.device))


def this_rank_positions(local_len: int, device) -> torch.Tensor | None:
    """Positions in the whole sequence of this CP rank's `local_len` tokens (None without CP: 0, 1, ...)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return None
    return token_indices(local_len * cp, cp, ps.get_context_parallel_rank(), device)
