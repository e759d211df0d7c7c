"""Parameter names and weight layouts of the Transformer Engine path next to the local one (pure PyTorch:
nothing here imports transformer_engine).

Checkpoints always hold the LOCAL names and layouts (`layers.3.attention.qkv.weight`, TP-independent
global tensors), whichever `--transformer-impl` wrote them: `distributed/checkpoint_format.py` names every
parameter through `local_name`, so a checkpoint loads into either implementation, under any TP/PP layout,
and back. Two Transformer Engine layouts are mapped here.

1. The TE model (`te_transformer.TETransformerLayer`): every TE parameter has a local twin with the same
   shape, values and tensor-parallel partition; only the names differ (per layer, `layers.N.` prefix kept):

   local                          TE model (LayerNorm or RMSNorm; biases only with --add-bias-linear)
   input_norm.weight / .bias      self_attention.layernorm_qkv.layer_norm_weight / layer_norm_bias
   attention.qkv.weight / .bias   self_attention.layernorm_qkv.weight / bias     (rows per head: q_h k_h v_h)
   attention.proj.weight / .bias  self_attention.proj.weight / bias
   GELU MLP (te.LayerNormMLP, fused):
   post_attention_norm.*          layernorm_mlp.layer_norm_weight / layer_norm_bias
   mlp.fc1.weight / .bias         layernorm_mlp.fc1_weight / fc1_bias
   mlp.fc2.weight / .bias         layernorm_mlp.fc2_weight / fc2_bias
   SwiGLU MLP (te.LayerNormLinear whose [gate; up] weight buffer is split into two parameters, + te.Linear):
   post_attention_norm.*          layernorm_mlp.fc1.layer_norm_weight / layer_norm_bias
   mlp.fc1_gate.weight / .bias    layernorm_mlp.fc1.gate_weight / gate_bias
   mlp.fc1.weight / .bias         layernorm_mlp.fc1.up_weight / up_bias
   mlp.fc2.weight / .bias         layernorm_mlp.fc2.weight / bias

   The QKV rows are already in TE's layout: `te.TransformerLayer` with fuse_qkv_params=True and
   qkv_weight_interleaved=True (its default) reads [num_heads, (q, k, v), head_dim] rows, as ours.

2. `te.pytorch.TransformerLayer`'s own state dict (hidden_size, ffn_hidden_size, num_attention_heads,
   set_parallel_mode=True, fuse_qkv_params=True, activation "gelu"/"swiglu"), one dict per TP rank: the
   names of layout 1 for attention and the GELU MLP, while for SwiGLU its LayerNormMLP holds ONE fused
   `fc1_weight` whose TP-rank-r shard is [gate_r; up_r] (TE's swiglu is silu(first half) * second half),
   so the TP=1 fused tensor is not the concatenation of the TP shards: the conversion works per rank.
   Every TE module also has an `_extra_state` entry (FP8 scaling metadata; an empty uint8 tensor when
   there is none): written empty, dropped on the way back (weights only). Non-layer parameters
   (embedding, final norm, output layer) keep their local names, sharded like the local TP layers.
   `tools/checkpoint_convert.py export-te / import-te` use these two functions.
"""

from __future__ import annotations

import re

import torch

from megatron_po.config import ffn_hidden_size, kv_channels, model_config_from_dict, num_query_groups

# (local suffix, TE model suffix) per transformer layer.
_ATTENTION = [
    ("input_norm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
    ("input_norm.bias", "self_attention.layernorm_qkv.layer_norm_bias"),
    ("attention.qkv.weight", "self_attention.layernorm_qkv.weight"),
    ("attention.qkv.bias", "self_attention.layernorm_qkv.bias"),
    ("attention.proj.weight", "self_attention.proj.weight"),
    ("attention.proj.bias", "self_attention.proj.bias"),
]
_GELU_MLP = [
    ("post_attention_norm.weight", "layernorm_mlp.layer_norm_weight"),
    ("post_attention_norm.bias", "layernorm_mlp.layer_norm_bias"),
    ("mlp.fc1.weight", "layernorm_mlp.fc1_weight"),
    ("mlp.fc1.bias", "layernorm_mlp.fc1_bias"),
    ("mlp.fc2.weight", "layernorm_mlp.fc2_weight"),
    ("mlp.fc2.bias", "layernorm_mlp.fc2_bias"),
]
_SWIGLU_MLP = [
    ("post_attention_norm.weight", "layernorm_mlp.fc1.layer_norm_weight"),
    ("post_attention_norm.bias", "layernorm_mlp.fc1.layer_norm_bias"),
    ("mlp.fc1_gate.weight", "layernorm_mlp.fc1.gate_weight"),
    ("mlp.fc1_gate.bias", "layernorm_mlp.fc1.gate_bias"),
    ("mlp.fc1.weight", "layernorm_mlp.fc1.up_weight"),
    ("mlp.fc1.bias", "layernorm_mlp.fc1.up_bias"),
    ("mlp.fc2.weight", "layernorm_mlp.fc2.weight"),
    ("mlp.fc2.bias", "layernorm_mlp.fc2.bias"),
]
_TE_TO_LOCAL = {te: local for local, te in _ATTENTION + _GELU_MLP + _SWIGLU_MLP}
# "<prefix>layers.<N>." (an MTP depth's layer: "mtp.layers.<d>.transformer_layer.", models/mtp.py), the rest
_LAYER = re.compile(r"^(.*?layers\.\d+\.(?:transformer_layer\.)?)(.+)$")

# The TE modules of one `te.TransformerLayer` that carry an `_extra_state` entry.
TRANSFORMER_LAYER_MODULES = ("self_attention.layernorm_qkv", "self_attention.core_attention",
                             "self_attention.proj", "layernorm_mlp")


def layer_name_pairs(swiglu: bool) -> list[tuple[str, str]]:
    """(local suffix, TE model suffix) of one layer's parameters (those without a bias or norm bias
    simply do not occur in the state dicts)."""
    return _ATTENTION + (_SWIGLU_MLP if swiglu else _GELU_MLP)


def local_name(name: str) -> str:
    """The local name of a TE model parameter name; any other name unchanged. Checkpoints store these."""
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_TO_LOCAL:
        return m.group(1) + _TE_TO_LOCAL[m.group(2)]
    return name


def te_name(name: str, swiglu: bool) -> str:
    """The TE model name of a local parameter name (non-layer names unchanged)."""
    m = _LAYER.match(name)
    if m:
        for local, te in layer_name_pairs(swiglu):
            if m.group(2) == local:
                return m.group(1) + te
    return name


def local_to_te(state: dict, swiglu: bool) -> dict:
    """A local state dict under the TE model's names (same tensors: layouts are identical)."""
    return {te_name(k, swiglu): v for k, v in state.items()}


def te_to_local(state: dict) -> dict:
    """A TE model state dict under local names; `_extra_state` entries (FP8 metadata) are dropped."""
    return {local_name(k): v for k, v in state.items() if not k.endswith("._extra_state")}


# --------------------------------------------------------------------------------------------------
# Tensor-parallel shards of the local layout
# --------------------------------------------------------------------------------------------------

_COLUMN = ("attention.qkv.weight", "attention.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc1_gate.weight",
           "mlp.fc1_gate.bias")
_ROW = ("attention.proj.weight", "mlp.fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def partition_dim(name: str) -> int | None:
    """The dim a local parameter is split along over TP ranks (None: replicated), as tensor_parallel's
    column-parallel (dim 0), row-parallel (dim 1) and vocab-parallel (rows) layers split it."""
    m = _LAYER.match(name)
    suffix = m.group(2) if m else name
    if suffix in _COLUMN or name in _VOCAB:
        return 0
    if suffix in _ROW:
        return 1
    return None


def shard(state: dict, tp: int) -> list[dict]:
    """Full local tensors -> one state dict per TP rank (contiguous slices along `partition_dim`)."""
    out = [{} for _ in range(tp)]
    for k, t in state.items():
        dim = partition_dim(k)
        if dim is not None and t.shape[dim] % tp:
            raise ValueError(f"{k}: dim {dim} of shape {tuple(t.shape)} is not divisible by TP size {tp}")
        pieces = t.chunk(tp, dim) if dim is not None else [t] * tp
        for r in range(tp):
            out[r][k] = pieces[r].contiguous()
    return out


def unshard(shards: list[dict]) -> dict:
    """The inverse of `shard`; replicated tensors must agree across ranks."""
    out = {}
    for k in shards[0]:
        dim = partition_dim(k)
        if dim is not None:
            out[k] = torch.cat([s[k] for s in shards], dim)
        else:
            if any(not torch.equal(s[k], shards[0][k]) for s in shards[1:]):
                raise ValueError(f"{k}: replicated tensor differs between TP ranks")
            out[k] = shards[0][k]
    return out


# --------------------------------------------------------------------------------------------------
# te.pytorch.TransformerLayer's state dict (layout 2)
# --------------------------------------------------------------------------------------------------


def _transformer_layer_names(swiglu: bool) -> dict[str, str]:
    """local suffix -> TransformerLayer suffix, except SwiGLU's gate/up (fused)."""
    pairs = dict(_ATTENTION + _GELU_MLP)
    if swiglu:
        del pairs["mlp.fc1.weight"], pairs["mlp.fc1.bias"]
    return pairs


def to_transformer_layer(state: dict, swiglu: bool, tp: int = 1) -> list[dict]:
    """A full local state dict -> `te.TransformerLayer` state dicts (layer keys `layers.N.<TE key>`), one
    per TP rank, with empty `_extra_state` entries so `load_state_dict(strict=True)` accepts them."""
    names = _transformer_layer_names(swiglu)
    out = []
    for local in shard(state, tp):
        te, layers = {}, set()
        for k, t in local.items():
            m = _LAYER.match(k)
            if not m:
                te[k] = t
                continue
            prefix, suffix = m.groups()
            layers.add(prefix)
            if suffix in names:
                te[prefix + names[suffix]] = t
            elif swiglu and suffix in ("mlp.fc1.weight", "mlp.fc1.bias"):
                kind = suffix.rsplit(".", 1)[1]
                te[f"{prefix}layernorm_mlp.fc1_{kind}"] = torch.cat([local[f"{prefix}mlp.fc1_gate.{kind}"], t])
            elif not (swiglu and suffix.startswith("mlp.fc1_gate.")):
                raise KeyError(f"{k}: not a parameter of a GPT transformer layer")
        for prefix in layers:
            for module in TRANSFORMER_LAYER_MODULES:
                te[f"{prefix}{module}._extra_state"] = torch.empty(0, dtype=torch.uint8)
        out.append(te)
    return out


def from_transformer_layer(shards: list[dict], swiglu: bool) -> dict:
    """`te.TransformerLayer` state dicts, one per TP rank -> the full local state dict."""
    back = {te: local for local, te in _transformer_layer_names(swiglu).items()}
    local_shards = []
    for te in shards:
        local = {}
        for k, t in te.items():
            if k.endswith("._extra_state"):
                continue
            m = _LAYER.match(k)
            if not m:
                local[k] = t
                continue
            prefix, suffix = m.groups()
            if swiglu and suffix in ("layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias"):
                kind = suffix.rsplit("_", 1)[1]
                gate, up = t.chunk(2, 0)
                local[f"{prefix}mlp.fc1_gate.{kind}"], local[f"{prefix}mlp.fc1.{kind}"] = gate, up
            elif suffix in back:
                local[prefix + back[suffix]] = t
            else:
                raise KeyError(f"{k}: not a parameter of te.TransformerLayer as exported (fuse_qkv_params=True)")
        local_shards.append(local)
    return unshard(local_shards)


def transformer_layer_kwargs(model: dict) -> dict:
    """`te.pytorch.TransformerLayer(...)` keyword arguments whose layers take the state dicts of
    `to_transformer_layer` for a model config `model` (a ModelConfig dict); add tp_group / tp_size and
    sequence_parallel for more than one TP rank. RoPE (if used) is passed to its forward as
    `rotary_pos_emb` (non-interleaved halves, like ours)."""
    m = model_config_from_dict(model)
    return dict(hidden_size=model["hidden_size"], ffn_hidden_size=ffn_hidden_size(m),
                num_attention_heads=model["num_attention_heads"], num_gqa_groups=num_query_groups(m),
                kv_channels=kv_channels(m), zero_centered_gamma=m.apply_layernorm_1p,
                layernorm_epsilon=model["norm_epsilon"],
                hidden_dropout=model["hidden_dropout"], attention_dropout=model["attention_dropout"],
                normalization=model["normalization"], activation="swiglu" if model["swiglu"] else "gelu",
                bias=model["add_bias_linear"], fuse_qkv_params=True, qkv_weight_interleaved=True,
                set_parallel_mode=True, self_attn_mask_type="causal", attn_input_format="sbhd")
