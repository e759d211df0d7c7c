"""Our checkpoint's tensors <-> a Hugging Face checkpoint's, as data: a family's table of `Rule`s, each naming one
of our tensors, the HF tensors it is made of, and how (`KINDS`). Pure functions on tensors; the files are
read and written elsewhere (files.py, distributed/checkpoint_hf.py), one tensor at a time.

Which rules apply is decided by our side: the names of the model the checkpoint holds (a GPTModel built on
the meta device from its config, `expected_tensors`). A rule whose tensor the model lacks (a bias, a q/k norm,
a dense layer's MLP in an MoE layer) is skipped; one of our tensors no rule makes is an error, and so, on
import, is an HF tensor no rule reads. So the tables list every tensor a family can have and never say when.

Kinds (our tensor <- HF tensors on import, -> on export):
  copy        the same tensor
  norm        the same, but --apply-layernorm-1p stores w - 1: exported as w + 1 (imports never use 1p)
  vocab       the vocabulary's rows: imported as they are (the HF config's vocab_size; a run pads them to its
              multiple of --make-vocab-size-divisible-by x TP when it loads them, as after a layout change), exported
              as the first vocab_size rows of ours (a run's checkpoint holds them padded)
  qkv         our fused QKV rows per key/value group [(q heads of g, k_g, v_g) for g] <- q, k, v projections
  experts     our experts stacked [experts, ...] <- one tensor per expert (the template's {e})
  conv1d      GPT-2's Conv1D stores [in, out]: transposed
  conv1d_qkv  GPT-2's c_attn weight [hidden, q | k | v]: transposed, then split and regrouped per head
  fused_qkv   GPT-2's c_attn bias [q | k | v]: regrouped per head
  double      twice ours (a Qwen2-MoE shared expert exported from our ungated one, see families.py)
  shared      another HF name of one of our tensors (an MTP layer's copies of the embedding and the head, which
              the Hub's checkpoints hold): exported as a copy, not imported
  zeros       an HF tensor with no counterpart here: exported as zeros of `Mapping.shape`, not imported
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import torch

from megatron_po.errors import UserError


@dataclasses.dataclass(frozen=True)
class Rule:
    """Our tensor `ours` (a global name; {i}: a layer number) and the HF tensors `theirs` ({i}; {e}: an expert)."""
    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"


def rule(ours: str, *theirs: str, kind: str = "copy") -> Rule:
    return Rule(ours, theirs, kind)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the transforms need to know of the model."""
    heads: int
    groups: int            # key/value groups (= heads without grouped-query attention)
    num_experts: int       # 0: dense
    hf_vocab: int          # the HF config's vocab_size
    one_p: bool = False    # --apply-layernorm-1p


@dataclasses.dataclass
class Mapping:
    """One of our tensors (`ours`; None for an export-only HF tensor) and the HF tensors it maps to."""
    ours: str | None
    theirs: list[str]
    kind: str
    shape: tuple | None = None  # kind "zeros": the HF tensor's shape


# --------------------------------------------------------------------------------------------------
# The kinds: to_ours(read, names, layout) -> tensor; to_theirs(tensor, layout) -> [tensors]
# `read(name)` gives one HF tensor (from the files, or a meta tensor of its shape when only planning).
# --------------------------------------------------------------------------------------------------


def split_qkv(w: torch.Tensor, groups: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our per-group [(q heads of g, k_g, v_g) for g] rows -> q [heads * head_dim, ...], k and v
    [groups * head_dim, ...]."""
    rest, per_group = w.shape[1:], heads // groups
    blocks = w.reshape(groups, per_group + 2, w.shape[0] // (groups * (per_group + 2)), *rest)
    q, k, v = blocks[:, :per_group], blocks[:, per_group], blocks[:, per_group + 1]
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    hd = k.shape[0] // groups
    if k.shape[0] % groups or q.shape[0] % (groups * hd) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not split into {groups} "
                         "key/value groups")
    blocks = [q.reshape(groups, -1, hd, *rest), k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)]
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def _vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] != rows:
        raise ValueError(f"{t.shape[0]} vocabulary rows, not vocab_size {rows}")
    return t


def _stack(read, names, layout):
    """[experts, ...] filled one expert at a time (no second copy of the layer's experts)."""
    first = read(names[0])
    out = torch.empty(len(names), *first.shape, dtype=first.dtype, device=first.device)
    out[0] = first
    for e, name in enumerate(names[1:], start=1):
        t = read(name)
        if t.shape != first.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, {names[0]} {tuple(first.shape)}")
        out[e] = t
    return out


def _gpt2_qkv_to_theirs(t, layout):
    return [torch.cat(split_qkv(t, layout.heads, layout.heads))]


KINDS: dict[str, tuple[Callable, Callable]] = {
    "copy": (lambda read, n, lo: read(n[0]), lambda t, lo: [t]),
    "norm": (lambda read, n, lo: read(n[0]), lambda t, lo: [t + 1 if lo.one_p else t]),
    "vocab": (lambda read, n, lo: _vocab_rows(read(n[0]), lo.hf_vocab), lambda t, lo: [t[:lo.hf_vocab]]),
    "qkv": (lambda read, n, lo: join_qkv(*(read(x) for x in n), lo.groups),
            lambda t, lo: list(split_qkv(t, lo.groups, lo.heads))),
    "experts": (_stack, lambda t, lo: list(t.unbind(0))),
    "conv1d": (lambda read, n, lo: read(n[0]).t(), lambda t, lo: [t.t()]),
    "conv1d_qkv": (lambda read, n, lo: join_qkv(*read(n[0]).t().chunk(3), lo.heads),
                   lambda t, lo: [_gpt2_qkv_to_theirs(t, lo)[0].t()]),
    "fused_qkv": (lambda read, n, lo: join_qkv(*read(n[0]).chunk(3), lo.heads), _gpt2_qkv_to_theirs),
    "double": (lambda read, n, lo: read(n[0]) / 2, lambda t, lo: [t * 2]),
    "shared": (None, lambda t, lo: [t[:lo.hf_vocab]]),
}


def to_ours(m: Mapping, read: Callable[[str], torch.Tensor], layout: Layout) -> torch.Tensor:
    return KINDS[m.kind][0](read, m.theirs, layout).contiguous()


def to_theirs(m: Mapping, t: torch.Tensor | None, layout: Layout, dtype: torch.dtype,
              device: str | torch.device = "cpu") -> Iterator[torch.Tensor]:
    """The HF tensors of `m` from our tensor `t` (kind "zeros": from nothing, in `dtype`), each made contiguous
    when it is asked for (a q, k, v split copies one of them at a time)."""
    if m.kind == "zeros":
        yield torch.zeros(m.shape, dtype=dtype, device=device)
        return
    for x in KINDS[m.kind][1](t, layout):
        yield x.contiguous()


# --------------------------------------------------------------------------------------------------
# A family's table, applied to one model's tensors
# --------------------------------------------------------------------------------------------------


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def mtp_alias(name: str, num_layers: int) -> str:
    """The name the tables give one of our multi-token prediction tensors: depth d is the Hub's layer num_layers + d
    (DeepSeek-V3's and GLM-4.5's checkpoints), its transformer layer that layer's tensors, its own tensors that
    layer's `mtp.` ones (`layers.<L + d>.mtp.eh_proj.weight`); other names unchanged."""
    found = re.match(r"mtp\.layers\.(\d+)\.(transformer_layer\.)?(.*)$", name)
    if found is None:
        return name
    depth, in_layer, rest = found.groups()
    return f"layers.{num_layers + int(depth)}.{'' if in_layer else 'mtp.'}{rest}"


def expand(rules: tuple[Rule, ...], ours: list[str], num_experts: int, family: str, num_layers: int) -> list[Mapping]:
    """One Mapping per name in `ours` (in its order), from the rule whose template it matches (`mtp_alias`);
    UserError naming the first of our tensors that no rule of `family` makes (the family cannot hold it)."""
    compiled = [(_pattern(r.ours), r) for r in rules]
    out = []
    for name in ours:
        found = next(((m, r) for p, r in compiled if (m := p.match(mtp_alias(name, num_layers)))), None)
        if found is None:
            raise UserError(f"{family} has no tensor for our {name}: the model does not fit that class")
        match, r = found
        layer = match.groupdict().get("i")
        theirs = []
        for t in r.theirs:
            t = t.replace("{i}", layer) if layer is not None else t
            theirs += [t.replace("{e}", str(e)) for e in range(num_experts)] if "{e}" in t else [t]
        out.append(Mapping(name, theirs, r.kind))
    return out
