"""The start-up rules of the recipe flags (config_recipe.py), a part of config_rules.RULES: each a `Rule` or
`Check` of config_check.py, one line naming the flag, before any process group; and `recipe_notes`, the start-up
lines of the flags accepted with no effect or as another's spelling."""

from __future__ import annotations

from megatron_po import config_check
from megatron_po.config import RECOMPUTE_MODULES, recompute_granularity, recompute_modules, uses_fsdp2
from megatron_po.config_check import Check, Ctx, Rule, each
from megatron_po.errors import UserError

# Megatron-core's --recompute-modules (transformer_config.py, Megatron-LM d98e8a6); RECOMPUTE_MODULES: those here
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                              "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")
# Megatron's --cuda-graph-scope / --cuda-graph-modules values (arguments.py, the same commit)
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration")


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


LAUNCHER_RULES = [
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


# --use-precision-aware-optimizer's dtype flags: fp32 unless it is given (Megatron's optimizer_config.py asserts)
_PRECISION_AWARE_DTYPES = [(f"--{name.replace('_', '-')}", lambda c, name=name: getattr(c.t, name) != "fp32")
                           for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype", "main_params_dtype")]


def _precision_aware(c: Ctx) -> bool:
    return c.t.use_precision_aware_optimizer


def _recompute_modules_error(c: Ctx) -> str | None:
    given = c.m.recompute_modules
    unknown = [m for m in given if m not in MEGATRON_RECOMPUTE_MODULES]
    if unknown:
        return (f"--recompute-modules {' '.join(unknown)}: not Megatron's module names (choose from "
                f"{', '.join(MEGATRON_RECOMPUTE_MODULES)})")
    missing = [m for m in given if m not in RECOMPUTE_MODULES]
    if missing:
        return (f"--recompute-modules {' '.join(missing)}: not implemented here (this code recomputes "
                f"{', '.join(RECOMPUTE_MODULES)}, or whole layers with --recompute-granularity full): drop them")
    return None


PRECISION_AWARE_RULES = [
    *each("{flag}-needs-precision-aware", _PRECISION_AWARE_DTYPES,
          lambda c, flag: f"{flag} other than fp32 needs --use-precision-aware-optimizer (as Megatron's)",
          when=lambda c: not _precision_aware(c)),
    Rule("precision-aware-adam", lambda c: c.t.optimizer in ("adam", "adamw"),
         lambda c: f"--use-precision-aware-optimizer holds Adam's state: --optimizer adam or adamw, not "
                   f"{c.t.optimizer}", when=_precision_aware),
    *each("{flag}-fp8-refused", [("--exp-avg-dtype", lambda c: c.t.exp_avg_dtype == "fp8"),
                                 ("--exp-avg-sq-dtype", lambda c: c.t.exp_avg_sq_dtype == "fp8")],
          lambda c, flag: f"{flag} fp8 (Transformer Engine's scaled fp8 state) is not implemented here: use bf16 or "
                          f"fp16"),
    Rule("main-params-dtype-fp16-refused", lambda c: c.t.main_params_dtype == "fp32",
         "--main-params-dtype fp16 is not implemented here: the main params are fp32", when=_precision_aware),
    Rule("main-grads-dtype-bf16-needs-bf16", lambda c: c.pr.bf16,
         "--main-grads-dtype bf16 needs --bf16 (the gradient buffer in the model's bf16)",
         when=lambda c: _precision_aware(c) and c.t.main_grads_dtype == "bf16"),
    Rule("main-grads-dtype-bf16-vs-fp32", lambda c: not c.pr.accumulate_allreduce_grads_in_fp32,
         "--main-grads-dtype bf16 and --accumulate-allreduce-grads-in-fp32 contradict (as in Megatron): drop one",
         when=lambda c: _precision_aware(c) and c.t.main_grads_dtype == "bf16"),
    Rule("main-grads-dtype-bf16-fsdp2", lambda c: c.pr.grad_reduce_in_bf16,
         "--main-grads-dtype bf16 under FSDP2: add --grad-reduce-in-bf16 (FSDP2 reduces the gradients in fp32 "
         "otherwise)", when=lambda c: _precision_aware(c) and c.t.main_grads_dtype == "bf16" and uses_fsdp2(c.cfg)),
    Rule("optimizer-cpu-offload-needs-precision-aware", _precision_aware,
         "--optimizer-cpu-offload needs --use-precision-aware-optimizer (as Megatron's: its hybrid optimizer is that "
         "code path)", when=lambda c: c.t.optimizer_cpu_offload),
    Rule("optimizer-cpu-offload-gpu", lambda c: not config_check.cuda_device(),
         "--optimizer-cpu-offload on a GPU: offloading the optimizer state and step to the CPU is not implemented "
         "here: drop it", when=lambda c: c.t.optimizer_cpu_offload),
    Rule("optimizer-offload-fraction-range", lambda c: 0 <= c.t.optimizer_offload_fraction <= 1,
         lambda c: f"--optimizer-offload-fraction ({c.t.optimizer_offload_fraction}) must be in [0, 1]"),
]

MODEL_RECIPE_RULES = [
    Check("recompute-modules", _recompute_modules_error,
          when=lambda c: c.m.recompute_modules is not None and recompute_granularity(c.m) == "selective"),
    Rule("recompute-modules-mlp-local", lambda c: c.m.transformer_impl == "local",
         "--recompute-modules mlp recomputes the local layers' MLP; Transformer Engine's LayerNormMLP is not: use "
         "--transformer-impl local or drop mlp", when=lambda c: "mlp" in recompute_modules(c.m)),
    Rule("cuda-graph-scope", lambda c: all(s in CUDA_GRAPH_SCOPES for s in c.m.cuda_graph_scope),
         lambda c: f"--cuda-graph-scope {' '.join(c.m.cuda_graph_scope)}: Megatron's scopes are "
                   f"{', '.join(CUDA_GRAPH_SCOPES)}", when=lambda c: c.m.cuda_graph_scope is not None),
]

RECIPE_RULES = LAUNCHER_RULES + PRECISION_AWARE_RULES + MODEL_RECIPE_RULES

# The flags accepted with no effect here: (flag as the line names it, given, what runs instead)
_NO_EFFECT = [
    ("--cuda-graph-impl", lambda cfg: cfg.model.cuda_graph_impl != "none",
     "nothing is captured in CUDA graphs: the layers run eagerly, or compiled with --torch-compile"),
    ("--cuda-graph-scope", lambda cfg: cfg.model.cuda_graph_scope is not None, "no capture (see --cuda-graph-impl)"),
    ("--te-rng-tracker", lambda cfg: cfg.model.te_rng_tracker,
     "the model-parallel random streams are tensor_parallel/random.py's"),
    ("--optimizer-cpu-offload", lambda cfg: cfg.training.optimizer_cpu_offload,
     "the optimizer state and step are on the CPU already"),
    ("--overlap-cpu-optimizer-d2h-h2d", lambda cfg: cfg.training.overlap_cpu_optimizer_d2h_h2d,
     "no device<->host copies to overlap"),
]


def recipe_notes(cfg) -> list[str]:
    """The start-up lines of the recipe flags given that are another flag's spelling, have no effect here, or
    change the optimizer's storage."""
    m, t = cfg.model, cfg.training
    lines = []
    if m.use_rotary_position_embeddings:
        lines.append("> --use-rotary-position-embeddings: Megatron's older spelling of --position-embedding-type "
                     "rope (in effect)")
    if m.recompute_modules is not None and recompute_granularity(m) != "selective":
        lines.append(f"> --recompute-modules {' '.join(m.recompute_modules)}: no effect without "
                     f"--recompute-granularity selective (as in Megatron)")
    given = [(flag, instead) for flag, on, instead in _NO_EFFECT if on(cfg)]
    if given:
        lines.append(f"> {', '.join(flag for flag, _ in given)}: accepted, no effect here (CUDA graphs, Transformer "
                     f"Engine's RNG tracker, CPU offload): {'; '.join(instead for _, instead in given)}")
    if t.use_precision_aware_optimizer:
        lines.append(f"> --use-precision-aware-optimizer: Adam's exp_avg stored in {t.exp_avg_dtype}, exp_avg_sq in "
                     f"{t.exp_avg_sq_dtype}, both computed in fp32; main params fp32; gradient buffer "
                     f"{'bf16' if t.main_grads_dtype == 'bf16' else 'as --accumulate-allreduce-grads-in-fp32 says'}")
    return lines
