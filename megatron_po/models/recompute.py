"""Activation recomputation (Megatron-LM's --recompute-*): which parts of a model chunk keep only their
inputs in the forward and run again in the backward.

  --recompute-granularity full --recompute-method uniform --recompute-num-layers N
        the chunk's layers in consecutive groups of N (the last may be shorter); each group keeps only its
        input and is recomputed as a whole when the backward reaches it
  --recompute-granularity full --recompute-method block --recompute-num-layers N
        the first N layers of each model chunk recomputed one by one, the others kept as usual
  --recompute-granularity selective (= --recompute-activations)
        only the attention core, softmax(QKᵀ)V with its dropout: no parameters, the largest activations
        (the [b, heads, s, s] probabilities of the unfused path)

Recomputation replays the random streams (`tensor_parallel.random.checkpoint`) and, under pipelines
whose weights move between a micro-batch's forward and backward, the weights of the forward (the
`recompute_weights` provider that the pipeline executor installs from its weight policy), so a run
with recomputation gives the same losses and gradients as one without, bit for bit (fp32).
Only training forwards that build a graph recompute; evaluation and decoding run plainly.
"""

from __future__ import annotations

import torch

from megatron_po.config import ModelConfig, recompute_granularity
from megatron_po.tensor_parallel import checkpoint


def layer_groups(cfg: ModelConfig, num_layers: int) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed) ranges covering the `num_layers` layers of one model chunk."""
    if recompute_granularity(cfg) != "full":
        return [(0, num_layers, False)] if num_layers else []
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    block = min(n, num_layers)  # block: the first n layers one by one, the rest as one plain range
    return [(i, i + 1, True) for i in range(block)] + ([(block, num_layers, False)] if block < num_layers else [])


def maybe_recompute(enabled: bool, function, *args, params=(), state=()):
    """`function(*args)`, recomputed in the backward when `enabled` and a graph is being built (training
    forwards; evaluation and decoding run under no_grad and keep nothing anyway). `state`: see `checkpoint`."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(function, *args, params=params, state=state)
    return function(*args)


def recompute_state(modules) -> list[torch.Tensor]:
    """The tensors besides parameters whose forward values a recomputation of `modules` must see: what their
    submodules' `recompute_state()` names (the MoE routers' expert bias, models/moe/router.py)."""
    return [t for module in modules for m in module.modules() if hasattr(m, "recompute_state")
            for t in m.recompute_state()]


def run_layers(layers, groups: list[tuple[int, int, bool]], x: torch.Tensor, *extra) -> torch.Tensor:
    """x through `layers` (each called as layer(x, *extra)), the recomputed groups checkpointed with the
    parameters they read."""
    for start, end, recomputed in groups:
        group = layers[start:end]

        def run(h, *rest, group=group):
            for layer in group:
                h = layer(h, *rest)
            return h

        x = maybe_recompute(recomputed, run, x, *extra, params=[p for layer in group for p in layer.parameters()],
                            state=recompute_state(group) if recomputed else ())
    return x
