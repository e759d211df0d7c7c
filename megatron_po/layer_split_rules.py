"""The start-up rules of how the layers split over pipeline stages (layer_split.py): the even split's
divisibility, and Megatron's uneven splits (--decoder-first/last-pipeline-num-layers, the embedding and loss
counted in the split, --pipeline-model-parallel-layout, --num-virtual-stages-per-pipeline-rank): which flags go
together, then the split itself. config_rules.py places SPLIT_RULES among its layout rules."""

from __future__ import annotations

from megatron_po.config import virtual_pipeline_size
from megatron_po.config_check import Check, Ctx, Rule, raised
from megatron_po.layer_split import (EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, parse_layout,
                                     pipeline_split, split_flags)


def _lpv(c: Ctx) -> int | None:
    return c.p.num_layers_per_virtual_pipeline_stage


def _split_flags(c: Ctx) -> list[str]:
    return split_flags(c.p)


def _uneven(c: Ctx) -> bool:
    """First / last stage sizes or a layout: the split is layer_split.py's, checked by `pipeline-split`."""
    return bool(set(_split_flags(c)) & {FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG})


def _split_layers(c: Ctx) -> int:
    """The layers of Megatron's even split: --num-layers, plus the embedding and the loss where counted."""
    p = c.p
    return c.m.num_layers + int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)


def _counted(c: Ctx) -> str:
    return "".join(f" + 1 ({flag})" for flag in _split_flags(c) if flag in (EMBEDDING_FLAG, LOSS_FLAG))


# Megatron's uneven pipeline splits (layer_split.py): which flags go together, before the split itself is checked.
UNEVEN_SPLIT = [
    Rule("uneven-split-needs-pp", lambda c: c.pp > 1,
         lambda c: f"{_split_flags(c)[0]} splits the layers over pipeline stages: it needs "
                   f"--pipeline-model-parallel-size > 1", when=_split_flags),
    Rule("uneven-split-gpt-only", lambda c: c.workload == "gpt",
         lambda c: f"{_split_flags(c)[0]} is pretrain_gpt.py's; pretrain_nmt.py splits its stacked encoder and "
                   f"decoder layers evenly", when=_split_flags),
    Rule("one-virtual-stage-flag", lambda c: _lpv(c) is None or _nvs(c) is None,
         "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set the model "
         "chunks per rank: give one of them (as Megatron)"),
    Rule("virtual-stages>=1", lambda c: _nvs(c) >= 1,
         lambda c: f"--num-virtual-stages-per-pipeline-rank must be >= 1 (got {_nvs(c)})",
         when=lambda c: _nvs(c) is not None),
    Rule("layout-alone", lambda c: _split_flags(c) == [LAYOUT_FLAG] and _lpv(c) is None and _nvs(c) is None,
         lambda c: f"{LAYOUT_FLAG} names every virtual stage's layers: drop {_beside_layout(c)} (Megatron takes no "
                   f"more than one of them)",
         when=lambda c: c.p.pipeline_model_parallel_layout is not None),
    Rule("uneven-split-vs-virtual-stages", lambda c: _lpv(c) is None,
         lambda c: f"{' / '.join(f for f in _split_flags(c) if f in (FIRST_FLAG, LAST_FLAG))} with "
                   f"--num-layers-per-virtual-pipeline-stage: as Megatron, an interleaved uneven split takes the "
                   f"number of chunks instead: give --num-virtual-stages-per-pipeline-rank",
         when=lambda c: bool(set(_split_flags(c)) & {FIRST_FLAG, LAST_FLAG})),
    Check("layout-grammar", lambda c: raised(lambda: parse_layout(c.p.pipeline_model_parallel_layout)),
          when=lambda c: c.p.pipeline_model_parallel_layout is not None),
    Rule("layout-stages-vs-pp", lambda c: _layout_stages(c) % c.pp == 0,
         lambda c: f"{LAYOUT_FLAG} {c.p.pipeline_model_parallel_layout!r} names {_layout_stages(c)} virtual stages, "
                   f"not a multiple of --pipeline-model-parallel-size ({c.pp})",
         when=lambda c: c.p.pipeline_model_parallel_layout is not None),
]


def _beside_layout(c: Ctx) -> str:
    """The first flag given with the layout that the layout replaces."""
    chunk_flags = [flag for flag, value in (("--num-layers-per-virtual-pipeline-stage", _lpv(c)),
                                            ("--num-virtual-stages-per-pipeline-rank", _nvs(c))) if value is not None]
    return next(f for f in _split_flags(c) + chunk_flags if f != LAYOUT_FLAG)


def _nvs(c: Ctx) -> int | None:
    return c.p.num_virtual_stages_per_pipeline_rank


def _layout_stages(c: Ctx) -> int:
    return len(parse_layout(c.p.pipeline_model_parallel_layout))


SPLIT_RULES = [
    *UNEVEN_SPLIT,
    Rule("virtual-stage>=1", lambda c: c.p.num_layers_per_virtual_pipeline_stage >= 1,
         "--num-layers-per-virtual-pipeline-stage must be >= 1", when=lambda c: _lpv(c) is not None),
    Rule("layers-vs-stages-x-chunks", lambda c: _split_layers(c) % (c.pp * _lpv(c)) == 0,
         lambda c: f"{c.layers_flag} ({c.m.num_layers}){_counted(c)} is not divisible by "
                   f"--pipeline-model-parallel-size ({c.pp}) x --num-layers-per-virtual-pipeline-stage ({_lpv(c)})",
         when=lambda c: _lpv(c) is not None),
    Rule("layers-vs-stages", lambda c: _split_layers(c) % c.pp == 0,
         lambda c: f"{c.layers_flag} ({c.m.num_layers}){_counted(c)} is not divisible by "
                   f"--pipeline-model-parallel-size ({c.pp})",
         when=lambda c: _lpv(c) is None and not _uneven(c)),
    Rule("layers-vs-stages-x-virtual-stages", lambda c: _split_layers(c) % (c.pp * _nvs(c)) == 0,
         lambda c: f"{c.layers_flag} ({c.m.num_layers}){_counted(c)} is not divisible by "
                   f"--pipeline-model-parallel-size ({c.pp}) x --num-virtual-stages-per-pipeline-rank ({_nvs(c)})",
         when=lambda c: _nvs(c) is not None and not _uneven(c)),
    Check("pipeline-split", lambda c: raised(lambda: pipeline_split(c.cfg, c.pp, virtual_pipeline_size(c.cfg))),
          when=lambda c: _split_flags(c) and c.workload == "gpt"),
]
