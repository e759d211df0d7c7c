"""Megatron's --reset-position-ids / --reset-attention-mask inputs: where the documents packed into one
sample begin, read off its end-of-document tokens.

As Megatron's get_ltor_masks_and_position_ids: an EOD token ends its document, so a new document begins
right after it. `document_ids[j]` counts the EOD tokens before position j; `position_ids[j]` restarts at 0
where a document begins (or is j without --reset-position-ids). The model turns document ids into a
document-level causal mask (a token attends to the earlier tokens of its own document).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: the document index of every position (EODs strictly before it)."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def document_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: the position inside its document (0 right after every EOD)."""
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).expand(b, s)
    # index where the current document starts: one past the last EOD before j (0 if none)
    starts = torch.where(tokens == eod, pos + 1, torch.zeros_like(pos))
    starts = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)
    return pos - torch.cummax(starts, dim=1).values


def add_document_inputs(batch: dict, eod: int, reset_position_ids: bool, reset_attention_mask: bool) -> None:
    """Adds `position_ids` and/or `document_ids` to a micro-batch dict (tokens [b, s])."""
    if reset_position_ids:
        batch["position_ids"] = document_position_ids(batch["tokens"], eod)
    if reset_attention_mask:
        batch["document_ids"] = document_ids(batch["tokens"], eod)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool (True = may attend): causal and within the same document."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None] & causal
