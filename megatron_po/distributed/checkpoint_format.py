"""The on-disk format of a checkpoint: where it lives, how it is named, which entries it holds.

A `--save` directory holds one directory per published checkpoint, `iter_XXXXXXX/` (seven or more digits),
and `latest_checkpointed_iteration.txt`, the tracker naming the newest. A save in progress writes into
`iter_XXXXXXX.partial/`; rotation renames a doomed checkpoint to `iter_XXXXXXX.deleting/` before removing
it (checkpoint_save.py). Inside, DCP's (`torch.distributed.checkpoint`) `.metadata` and data files
(`__<rank>_<k>.distcp`) and `checksums.json` (checkpoint_integrity.py).

Every tensor is saved under its *global* name (layer numbers counted over the whole model, not the
pipeline stage; `named_parameters_global`) and tensor-parallel shards are saved as DTensors sharded along
their partition dim, MoE experts as blocks of the global [num_experts, ...] tensors, so DCP stores global
tensors and a checkpoint can be loaded under another TP/PP/DP/EP layout (checkpoint_dcp.py,
checkpoint_load.py). Optimizer state is keyed by parameter name
(`optimizer.<param>.<state>`) for the same reason; state shaped like its parameter ("like-param": Adam's
moments, momentum buffers) is sharded like it, so it reshards too. Which state keys exist is saved as
metadata; an optimizer that has not stepped yet creates its state before loading with its own
`init_state`, as its first step would (step counts on the CPU, the rest on the parameter's device), and
DCP loads into it in place. Weight versions an
asynchronous policy must keep across a drain (PipeDream-2BW's older version) are saved the same way
(`policy.<param>.<key>`).

Keys in a checkpoint directory `iter_XXXXXXX/`:
  model.<name>                   weights (global shapes); the fp32 main params under mixed precision, so
                                 a bf16 run's checkpoint keeps full precision and loads into fp32 runs too;
                                 persistent buffers too (an MoE router's expert_bias)
  optimizer.<name>.<key>         optimizer state; optimizer_state_keys.<name>: which keys exist, group lr
  policy.<name>.<key>            async weight-policy versions; policy_steps = steps every chunk had taken;
                                 policy_lr_steps.stage<vs> = each chunk's lr clock (its applied updates)
  extra                          dict from the caller (train state, config, vocab sizes)
  layout, optimizer_type         (tp, pp, dp, chunks per rank) and the inner optimizer's class
  grad_scaler                    fp16 loss-scaler state (grad_scaler.stage<vs>: each virtual stage's own
                                 in asynchronous training; another stage count takes the smallest scale)
  rng.rank<r>                    each rank's RNG states (restored only under the same layout)
The metadata entries (extra, layout, optimizer_type, optimizer_state_keys, policy_steps, policy_lr_steps,
grad_scaler, rng) are JSON documents (checkpoint_data.py); checkpoints of the previous format hold them pickled, read through an allow-list (checkpoint_trust.py, which also reads DCP's
`.metadata`). The vocabulary rows (padded to a multiple of --make-vocab-size-divisible-by x TP) are
re-padded on load when the new layout pads differently.

The modules, bottom up: checkpoint_format.py (this: names), checkpoint_data.py (metadata as JSON),
checkpoint_trust.py (reading without running code), checkpoint_dcp.py (how tensors reach DCP),
checkpoint_state.py (the entries of a model and its optimizer), checkpoint_rng.py, checkpoint_integrity.py
(SHA-256 manifest), then checkpoint_save.py and checkpoint_load.py, which use all of them.
"""

from __future__ import annotations

import os
import re

import torch

from megatron_po.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise UserError(f"corrupt checkpoint tracker {path}: {text!r} is not an iteration number")
    return int(text)


def list_iterations(root: str) -> list[int]:
    """Iterations of the published checkpoints under `root`, ascending (`.partial` ones excluded)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m)


def find_checkpoint(root: str, step: int | None = None) -> int | None:
    """The iteration `--load root [--ckpt-step step]` means, or None when there is no checkpoint yet.

    Without `step`: the tracker's iteration; if the tracker is missing but published checkpoints exist
    (a crash between publishing the first checkpoint and writing the tracker), the newest of them."""
    available = list_iterations(root)
    if step is not None:
        if step not in available:
            have = ", ".join(map(str, available)) or "none"
            raise UserError(f"--ckpt-step {step}: no checkpoint {checkpoint_dir(root, step)} "
                            f"(iterations available: {have})")
        return step
    iteration = read_tracker(root)
    if iteration is None:
        return available[-1] if available else None
    if iteration not in available:
        raise UserError(f"--load {root}: {TRACKER} names iteration {iteration} but "
                        f"{checkpoint_dir(root, iteration)} is missing")
    return iteration


def read_tracker_quietly(root: str) -> int | None:
    """`find_checkpoint(root)`, None where it would raise: for messages about the last good checkpoint."""
    try:
        return find_checkpoint(root)
    except (UserError, OSError):
        return None


# --------------------------------------------------------------------------------------------------
# Global names
# --------------------------------------------------------------------------------------------------


def named_parameters_global(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, param) for this rank's parameters, without the last stage's tied-embedding copy
    (it equals the first stage's embedding, which is saved). Transformer Engine layers' parameters get
    their local twins' names (te_layout.local_name), so either --transformer-impl loads the checkpoint."""
    from megatron_po.models.te_layout import local_name
    out, seen = [], set()
    for chunk in chunks:
        offset = chunk.layer_offset
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if getattr(p, "embedding_copy", False):
                continue
            out.append((local_name(_global_layer(name, offset)), p))
    return out


def _global_layer(name: str, offset: int) -> str:
    return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)


def named_buffers_global(chunks) -> list[tuple[str, torch.Tensor]]:
    """(global name, buffer) for the persistent buffers of this rank's chunks: state that is not a parameter
    and not stepped by the optimizer (an MoE router's expert bias, `layers.<i>.mlp.router.expert_bias`).
    Saved as `model.<name>` beside the weights, so a consolidated checkpoint is the model's state dict."""
    out = []
    for chunk in chunks:
        for prefix, module in chunk.named_modules():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and name not in module._non_persistent_buffers_set:  # as module.state_dict()
                    out.append((_global_layer(f"{prefix}.{name}" if prefix else name, chunk.layer_offset), b))
    return out


def copies_beside_their_embedding(chunks) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(copy, embedding) where this rank holds the word embedding and a copy of it (ZB-V's rank 0: the first and
    the last virtual stage, whose MTP block copies the embedding): one checkpoint entry serves both, loaded into
    the embedding (`named_parameters_for_load`), then copied into the copy (checkpoint_load.py)."""
    embedding = next((c.embedding.word_embeddings.weight for c in chunks if getattr(c, "embedding", None) is not None
                      and hasattr(c.embedding, "word_embeddings")), None)
    if embedding is None:
        return []
    return [(p, embedding) for c in chunks for p in c.parameters()
            if getattr(p, "embedding_copy", False) and p is not embedding]


def named_parameters_for_load(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """`named_parameters_global` plus the last stage's tied-embedding copy under the embedding's name
    (it must be loaded too, weights and optimizer state alike: it is stepped like the embedding)."""
    out = named_parameters_global(chunks)
    have = {name for name, _ in out}
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "embedding_copy", False) and "embedding.word_embeddings.weight" not in have:
                out.append(("embedding.word_embeddings.weight", p))
                have.add("embedding.word_embeddings.weight")
    return out
