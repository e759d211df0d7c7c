"""The start-up rules of the recipe flags (config_recipe.py), a part of config_rules.RULES: each a `Rule` or
`Check` of config_check.py, one line naming the flag, before any process group."""

from __future__ import annotations

from megatron_po.config_check import Check, Ctx, Rule
from megatron_po.errors import UserError


def _tokenizer_vocab_size(c: Ctx) -> int | None:
    """The vocabulary of the tokenizer the data flags name (NullTokenizer: --vocab-size + its EOD id; a file
    tokenizer is loaded, as the set-up loads it), or None where it cannot be loaded: the set-up reports why."""
    from megatron_po.data.tokenizer import build_tokenizer_from
    try:
        return build_tokenizer_from(c.d).vocab_size
    except (UserError, OSError):
        return None


def _padded_vocab_error(c: Ctx) -> str | None:
    vocab = _tokenizer_vocab_size(c)
    if vocab is None or c.m.padded_vocab_size >= vocab:
        return None
    return (f"--padded-vocab-size ({c.m.padded_vocab_size}) is smaller than the tokenizer's vocabulary ({vocab}): "
            f"the model needs a row for every token id")


def _padded_vocab(c: Ctx) -> bool:
    return c.m.padded_vocab_size is not None


RECIPE_RULES = [
    Rule("lr-warmup-init-range", lambda c: 0 <= c.t.lr_warmup_init <= c.t.lr,
         lambda c: f"--lr-warmup-init ({c.t.lr_warmup_init}) must be in [0, --lr ({c.t.lr})]: the warm-up climbs "
                   f"from it to --lr"),
    Rule("logging-level>=0", lambda c: c.lg.logging_level >= 0,
         lambda c: f"--logging-level must be >= 0 (got {c.lg.logging_level}; Python's levels: 10 DEBUG, 20 INFO, "
                   f"30 WARNING, 40 ERROR, 50 CRITICAL)", when=lambda c: c.lg.logging_level is not None),
    Rule("tensorboard-queue-size>=1", lambda c: c.lg.tensorboard_queue_size >= 1,
         lambda c: f"--tensorboard-queue-size must be >= 1 (got {c.lg.tensorboard_queue_size})"),
    Rule("padded-vocab-size-gpt-only", lambda c: c.workload == "gpt",
         "--padded-vocab-size sets pretrain_gpt.py's one vocabulary; pretrain_nmt.py pads its source and target "
         "vocabularies by --make-vocab-size-divisible-by", when=_padded_vocab),
    Rule("padded-vocab-size-divides-by-tp", lambda c: c.m.padded_vocab_size % c.tp == 0,
         lambda c: f"--padded-vocab-size ({c.m.padded_vocab_size}) is not divisible by --tensor-model-parallel-size "
                   f"({c.tp}): each TP rank holds an equal slice of the vocabulary", when=_padded_vocab),
    Check("padded-vocab-size-holds-vocab", _padded_vocab_error, when=_padded_vocab),
    Rule("dist-ckpt-strictness-return", lambda c: not c.ck.dist_ckpt_strictness.startswith("return_"),
         lambda c: f"--dist-ckpt-strictness {c.ck.dist_ckpt_strictness} hands the mismatched keys to a Python caller "
                   f"of Megatron's load; a training run has none: use log_all, log_unexpected or a raise_ value",
         when=lambda c: c.ck.dist_ckpt_strictness is not None),
]
