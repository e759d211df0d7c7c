"""How many transformer layers each virtual pipeline stage holds: Megatron-core's split rules, as pure functions.

Virtual stage `vs = c*D + r` (rank r of D, chunk c of v, Megatron's numbering) holds the next `counts[vs]`
layers; pipeline/partition.py `chunk_placements` turns the counts into each chunk's layer offset. The rules
(megatron/core/transformer/transformer_block.py `get_num_layers_to_build`, transformer_layer.py
`get_transformer_layer_offset`, pipeline_parallel_layer_layout.py):
- even: L layers, plus one for the embedding with --account-for-embedding-in-pipeline-split and one for the
  loss with --account-for-loss-in-pipeline-split, split evenly over the D x v virtual stages; the first
  (last) virtual stage then builds one layer fewer, its embedding (loss) taking that place;
- uneven: --decoder-first-pipeline-num-layers F and/or --decoder-last-pipeline-num-layers G layers on the
  first / last rank, the rest split evenly over the other ranks; each rank's layers split evenly over its v
  chunks (not with the account-for flags, as Megatron);
- --pipeline-model-parallel-layout: the string names every virtual stage's layers ('|' between stages, E the
  embedding, t a transformer layer, m a multi-token prediction depth, L the loss, `(...)*n` and `x*n` repeat,
  commas cosmetic); its stage count / D is the number of chunks v.

This module sits with config.py at the bottom of the layering (config.py reads the layout's stage count) and
imports nothing from the package but errors.py. Every broken rule is one ConfigError line naming the flag.
"""

from __future__ import annotations

import re

from megatron_po.errors import ConfigError

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG, LOSS_FLAG = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"


def parse_layout(text: str) -> list[str]:
    """Megatron's layout grammar unrolled: one string of layer letters (E, t, m, L) per virtual stage.
    "Et|(tt|)*2mL" -> ["Et", "tt", "tt", "mL"]."""
    unrolled = text.replace(",", "").replace(" ", "")
    unrolled = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    unrolled = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    bad = sorted(set(unrolled) - set("EtmL|"))
    if bad:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: unknown layer letter(s) {' '.join(bad)}: E embedding, t "
                          f"transformer layer, m MTP depth, L loss, '|' between virtual stages, (...)*n and x*n repeat")
    return unrolled.split("|")


def layout_stage_count(text: str) -> int:
    return len(parse_layout(text))


def check_layout(text: str, num_layers: int, mtp_num_layers: int | None, num_virtual_stages: int) -> list[str]:
    """The parsed layout where this code's model can build it, else one ConfigError line: E first on virtual
    stage 0, L last on the last virtual stage, the MTP depths (--mtp-num-layers of them) on the last virtual
    stage after its transformer layers (where models/mtp.py places them), every virtual stage holding
    something. Megatron's own checks (E and L once, t counted, m after every t) come first."""
    stages = parse_layout(text)
    flat = "".join(stages)
    where = f"{LAYOUT_FLAG} {text!r}"
    if len(stages) != num_virtual_stages:
        raise ConfigError(f"{where} names {len(stages)} virtual stages; this run has {num_virtual_stages}")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{where}: the embedding E comes once, first on virtual stage 0 (as Megatron requires)")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{where}: the loss L comes once, last on the last virtual stage (as Megatron requires)")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{where} places {flat.count('t')} transformer layers t; --num-layers is {num_layers}")
    mtp = mtp_num_layers or 0
    if flat.count("m") != mtp:
        raise ConfigError(f"{where} places {flat.count('m')} MTP depths m; --mtp-num-layers is {mtp}")
    if mtp and (stages[-1].count("m") != mtp or "t" in stages[-1][stages[-1].index("m"):]):
        raise ConfigError(f"{where}: the MTP depths m go on the last virtual stage after its transformer layers, "
                          f"beside the loss (Megatron's standalone MTP stage is not built here)")
    empty = [vs for vs, s in enumerate(stages) if not s]
    if empty:
        raise ConfigError(f"{where}: virtual stage {empty[0]} holds nothing (no parameter to train): refused here")
    return stages


def layers_per_virtual_stage(num_layers: int, num_stages: int, num_chunks: int = 1, *, first: int | None = None,
                             last: int | None = None, account_for_embedding: bool = False,
                             account_for_loss: bool = False, layout: str | None = None,
                             mtp_num_layers: int | None = None) -> list[int]:
    """Transformer layers of each of the D x v virtual stages, in virtual-stage order (Megatron's rules, above).
    One virtual stage (D = v = 1) holds every layer whatever the flags."""
    D, v = num_stages, num_chunks
    if D * v == 1:
        return [num_layers]
    if layout is not None:
        return [s.count("t") for s in check_layout(layout, num_layers, mtp_num_layers, D * v)]
    if first is None and last is None:
        return _even(num_layers, D, v, account_for_embedding, account_for_loss)
    if account_for_embedding or account_for_loss:
        raise ConfigError(f"{FIRST_FLAG} / {LAST_FLAG} with {EMBEDDING_FLAG if account_for_embedding else LOSS_FLAG}:"
                          f" Megatron takes no standalone embedding or loss stage with an uneven split")
    per_rank = _uneven_ranks(num_layers, D, first, last)
    for r, n in enumerate(per_rank):
        if n % v:
            raise ConfigError(f"pipeline rank {r}'s {n} layers ({_rank_flag(r, D, first, last)}) do not split evenly "
                              f"over its {v} model chunks")
    counts = [per_rank[r] // v for c in range(v) for r in range(D)]
    _refuse_empty(counts, f"{FIRST_FLAG} / {LAST_FLAG}")
    return counts


def _even(num_layers: int, D: int, v: int, embedding: bool, loss: bool) -> list[int]:
    total = num_layers + int(embedding) + int(loss)
    if total % (D * v):
        counted = "".join([f" + 1 ({EMBEDDING_FLAG})" if embedding else "", f" + 1 ({LOSS_FLAG})" if loss else ""])
        raise ConfigError(f"--num-layers ({num_layers}){counted} is not divisible by pipeline stages ({D}) x model "
                          f"chunks ({v})")
    counts = [total // (D * v)] * (D * v)
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    if min(counts) < 0:
        flag, which, part = (EMBEDDING_FLAG, "first", "embedding") if counts[0] < 0 else (LOSS_FLAG, "last", "loss")
        raise ConfigError(f"{flag}: the {which} virtual stage has no layer left to give up for the {part}")
    return counts


def _uneven_ranks(num_layers: int, D: int, first: int | None, last: int | None) -> list[int]:
    for flag, n in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if n is not None and n < 1:  # Megatron's TransformerConfig: "must be larger than 0"
            raise ConfigError(f"{flag} must be >= 1, as Megatron (got {n}); a stage of the embedding or the loss "
                              f"alone is {LAYOUT_FLAG} 'E|...' or '...|L'")
    rest = num_layers - (first or 0) - (last or 0)
    middle = D - (first is not None) - (last is not None)
    given = " + ".join(f"{flag} ({n})" for flag, n in ((FIRST_FLAG, first), (LAST_FLAG, last)) if n is not None)
    if rest < 0 or (middle == 0 and rest != 0):
        raise ConfigError(f"{given} = {num_layers - rest} layers; --num-layers is {num_layers}")
    if middle and rest % middle:
        raise ConfigError(f"the {rest} layers left by {given} do not split evenly over the other {middle} "
                          f"pipeline stages (--num-layers {num_layers}, --pipeline-model-parallel-size {D})")
    per_middle = rest // middle if middle else 0
    return [first if r == 0 and first is not None else last if r == D - 1 and last is not None else per_middle
            for r in range(D)]


def _rank_flag(r: int, D: int, first: int | None, last: int | None) -> str:
    if r == 0 and first is not None:
        return FIRST_FLAG
    return LAST_FLAG if r == D - 1 and last is not None else "the even share of the middle stages"


def _refuse_empty(counts: list[int], flags: str) -> None:
    """A virtual stage between the first and the last with no layer holds no parameter: refused."""
    empty = [vs for vs in range(1, len(counts) - 1) if counts[vs] == 0]
    if empty:
        raise ConfigError(f"{flags} leave virtual stage {empty[0]} without a transformer layer (no parameter to "
                          f"train): refused here")


def pipeline_split(cfg, num_stages: int, num_chunks: int) -> list[int]:
    """`layers_per_virtual_stage` of a run's config (config.Config) at D = `num_stages`, v = `num_chunks`."""
    p, m = cfg.parallel, cfg.model
    return layers_per_virtual_stage(m.num_layers, num_stages, num_chunks,
                                    first=p.decoder_first_pipeline_num_layers,
                                    last=p.decoder_last_pipeline_num_layers,
                                    account_for_embedding=p.account_for_embedding_in_pipeline_split,
                                    account_for_loss=p.account_for_loss_in_pipeline_split,
                                    layout=p.pipeline_model_parallel_layout, mtp_num_layers=m.mtp_num_layers)


def split_flags(parallel) -> list[str]:
    """The uneven split flags a run's ParallelConfig gives, in the order above."""
    p = parallel
    return [flag for flag, given in ((FIRST_FLAG, p.decoder_first_pipeline_num_layers is not None),
                                     (LAST_FLAG, p.decoder_last_pipeline_num_layers is not None),
                                     (EMBEDDING_FLAG, p.account_for_embedding_in_pipeline_split),
                                     (LOSS_FLAG, p.account_for_loss_in_pipeline_split),
                                     (LAYOUT_FLAG, p.pipeline_model_parallel_layout is not None)) if given]


def split_summary(cfg, num_chunks: int) -> str | None:
    """The start-up line of an uneven split (None for the plain even one): the flags and each virtual stage's
    transformer layers, e.g. "> pipeline split (--decoder-first-pipeline-num-layers): transformer layers per
    virtual stage 1 | 3"."""
    flags = split_flags(cfg.parallel)
    if not flags:
        return None
    counts = pipeline_split(cfg, cfg.parallel.pipeline_model_parallel_size, num_chunks)
    return f"> pipeline split ({', '.join(flags)}): transformer layers per virtual stage {' | '.join(map(str, counts))}"
