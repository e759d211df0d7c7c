"""Megatron's learning-rate schedule as a pure function of the iteration.

Linear warm-up from 0 to `lr` over `lr_warmup_iters`, then decay to `min_lr` over the remaining
`lr_decay_iters - lr_warmup_iters` iterations: constant, linear, cosine (half period), or WSD
(warm-up, stable at `lr`, then a linear decay over the last `lr_wsd_decay_iters`). Past the decay
horizon the lr stays at `min_lr`. Being pure, it also tells the future lr a predictor may need.
"""

from __future__ import annotations

import math

from megatron_po.config import TrainingConfig


def lr_at(iteration: int, t: TrainingConfig) -> float:
    """Learning rate used by the optimizer step that completes iteration `iteration` (0-based)."""
    warmup = t.lr_warmup_iters
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if warmup > 0 and iteration < warmup:
        return t.lr * (iteration + 1) / warmup
    if t.lr_decay_style == "constant":
        return t.lr
    if iteration >= decay_iters:
        return t.min_lr
    if t.lr_decay_style == "wsd":
        wsd = t.lr_wsd_decay_iters if t.lr_wsd_decay_iters is not None else max(1, (decay_iters - warmup) // 10)
        stable_end = decay_iters - wsd
        if iteration < stable_end:
            return t.lr
        frac = (iteration - stable_end) / wsd
        return t.lr - (t.lr - t.min_lr) * frac
    frac = (iteration - warmup) / max(1, decay_iters - warmup)
    if t.lr_decay_style == "linear":
        coeff = 1.0 - frac
    elif t.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {t.lr_decay_style}")
    return t.min_lr + coeff * (t.lr - t.min_lr)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
