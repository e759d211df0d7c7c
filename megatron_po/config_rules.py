"""Every cross-flag rule of the config, as data, and `validate`, which walks them.

`RULES` is one ordered table of `Rule`s and `Check`s (config_check.py: a rule is a condition, where it
applies and its one error line; a check is a rule that needs code to find its line: the data-path parser,
the tokenizer's needs, Transformer Engine's import). `validate` raises a ConfigError for the first broken
rule, so the table's order decides which line a config that breaks several rules gets (size rules before
the rules that divide by those sizes). The error carries the rule's `name`, which names its row in
tests/test_config_rules.py: that test reads this table and fails when a rule has no row.

The Transformer Engine rules live with its import check in models/te_transformer.py (`TE_RULES`), the FP8
backend's and recipe's in models/fp8.py (`FP8_RULES`), the Mixture of Experts' in models/moe/rules.py
(`MOE_RULES`), multi-latent attention's in models/mla_rules.py (`MLA_RULES`), multi-token prediction's in
models/mtp.py (`MTP_RULES`), the Megatron recipes' launcher and logging flags' in config_recipe_rules.py
(`RECIPE_RULES`), the split of the layers over pipeline stages' in layer_split_rules.py (`SPLIT_RULES`). This
module sits above config.py (the tree and its derived values) and models/, so config.py imports nothing
from models/.
"""

from __future__ import annotations

import math
import os

from megatron_po import config_check
from megatron_po.config import (Config, DataConfig, TrainingConfig, ffn_hidden_size, fsdp2_reshard_after_forward,
                                kv_channels, recompute_granularity, recomputes_moe_layers, uses_fsdp2,
                                virtual_pipeline_size)
from megatron_po.config_check import Check, Ctx, Rule, at_least, each, raised
from megatron_po.config_recipe_rules import RECIPE_RULES
from megatron_po.data.tokenizer import tokenizer_flag_error
from megatron_po.errors import ConfigError
from megatron_po.layer_split_rules import SPLIT_RULES
from megatron_po.models.fp8 import FP8_RULES
from megatron_po.models.mla_rules import MLA_RULES
from megatron_po.models.moe.rules import MOE_RULES
from megatron_po.models.mtp import MTP_RULES
from megatron_po.models.te_transformer import TE_RULES
from megatron_po.optim.newton_schulz import coefficients
from megatron_po.run_rules import SEED_LIMIT, SEED_STRIDE_PER_STAGE


def validate(cfg: Config, world_size: int, workload: str = "gpt") -> None:
    """Every cross-flag rule, checked before any process group exists (`workload`: "gpt" or "nmt")."""
    c = Ctx(cfg, world_size, workload)
    for rule in RULES:
        message = rule.error(c)
        if message is not None:
            error = ConfigError(message)
            error.rule = rule.name  # which rule (tests/test_config_rules.py matches it to its row)
            raise error


# --------------------------------------------------------------------------------------------------
# The checks that need code
# --------------------------------------------------------------------------------------------------


def _nccl_usable(c: Ctx) -> bool:
    import torch
    return torch.cuda.is_available()


def _data_path_error(c: Ctx) -> str | None:
    # Megatron's forms: 'A', '0.3 A 0.7 B' (weighted), 'A B' (unweighted: weighted by size).
    from megatron_po.data.gpt_dataset import parse_data_path
    return raised(lambda: parse_data_path(c.d.data_path))


def _split_error(c: Ctx) -> str | None:
    from megatron_po.data.gpt_dataset import parse_split
    return raised(lambda: parse_split(c.d.split))


def _ns_coefficients_error(c: Ctx) -> str | None:
    """A coefficient set takes only some step counts (optim/newton_schulz.py `coefficients`)."""
    try:
        coefficients(c.t.muon_coefficient_type, c.t.muon_num_ns_steps)
    except ValueError as e:
        t = c.t
        return f"--muon-coefficient-type {t.muon_coefficient_type} with --muon-num-ns-steps {t.muon_num_ns_steps}: {e}"
    return None


def _fp32_weights(c: Ctx) -> bool:
    return not (c.pr.bf16 or c.pr.fp16 or c.pr.use_distributed_optimizer)


# --------------------------------------------------------------------------------------------------
# The table, in the order the rules are checked
# --------------------------------------------------------------------------------------------------


def _cp(c: Ctx) -> bool:
    return c.cp > 1


# What context parallelism (models/context_parallel_attention.py) serves: causal GPT self-attention of the local
# layers, without attention dropout, over sequences that cut into 2 x CP equal chunks.
CONTEXT_PARALLEL = [
    Rule("context-parallel-seq-length", lambda c: c.m.seq_length % (2 * c.cp) == 0,
         lambda c: f"--seq-length ({c.m.seq_length}) is not divisible by 2 x --context-parallel-size ({c.cp}) = "
                   f"{2 * c.cp}: each CP rank holds 2 of the sequence's {2 * c.cp} equal chunks", when=_cp),
    Rule("context-parallel-sequence-parallel", lambda c: (c.m.seq_length // c.cp) % c.tp == 0,
         lambda c: f"--sequence-parallel with --context-parallel-size {c.cp} needs each CP rank's "
                   f"{c.m.seq_length // c.cp} tokens (--seq-length / CP) divisible by --tensor-model-parallel-size "
                   f"({c.tp})", when=lambda c: _cp(c) and c.p.sequence_parallel),
    Rule("context-parallel-gpt-only", lambda c: c.workload == "gpt",
         lambda c: f"--context-parallel-size {c.cp} splits the causal self-attention of pretrain_gpt.py; "
                   f"pretrain_nmt.py's encoder and cross-attention are not split: use 1", when=_cp),
    Rule("context-parallel-local-layers", lambda c: c.m.transformer_impl == "local",
         lambda c: f"--context-parallel-size {c.cp} runs in the local layers' attention; the Transformer Engine "
                   f"layers here take no context parallelism: use --transformer-impl local", when=_cp),
    Rule("context-parallel-attention-dropout", lambda c: c.m.attention_dropout == 0,
         lambda c: f"--context-parallel-size {c.cp} with --attention-dropout {c.m.attention_dropout}: the split "
                   f"attention runs without dropout on its probabilities here; add --attention-dropout 0", when=_cp),
    Rule("context-parallel-attention-backend", lambda c: c.m.attention_backend in ("auto", "local", "unfused"),
         lambda c: f"--context-parallel-size {c.cp} with --attention-backend {c.m.attention_backend}: the split "
                   f"attention runs its key blocks through PyTorch's fused kernel of the device (auto) or the "
                   f"explicit softmax (local, unfused)", when=_cp),
]

SIZES = [
    *at_least(1, [("--tensor-model-parallel-size", lambda c: c.tp), ("--pipeline-model-parallel-size", lambda c: c.pp),
                  ("--context-parallel-size", lambda c: c.cp),
                  ("--num-layers", lambda c: c.m.num_layers), ("--hidden-size", lambda c: c.m.hidden_size),
                  ("--num-attention-heads", lambda c: c.m.num_attention_heads),
                  ("--seq-length", lambda c: c.m.seq_length), ("--micro-batch-size", lambda c: c.t.micro_batch_size),
                  ("--train-iters", lambda c: c.t.train_iters), ("--log-interval", lambda c: c.lg.log_interval),
                  ("--eval-interval", lambda c: c.t.eval_interval)]),
    *at_least(1, [("--global-batch-size", lambda c: c.t.global_batch_size),
                  ("--exit-interval", lambda c: c.t.exit_interval),
                  ("--lr-decay-iters", lambda c: c.t.lr_decay_iters),
                  ("--lr-wsd-decay-iters", lambda c: c.t.lr_wsd_decay_iters),
                  ("--ffn-hidden-size", lambda c: c.m.ffn_hidden_size),
                  ("--max-position-embeddings", lambda c: c.m.max_position_embeddings),
                  ("--make-vocab-size-divisible-by", lambda c: c.m.make_vocab_size_divisible_by),
                  ("--ddp-bucket-size", lambda c: c.p.ddp_bucket_size)], optional=True),
    *at_least(0, [("--eval-iters", lambda c: c.t.eval_iters), ("--num-workers", lambda c: c.d.num_workers),
                  ("--weight-decay", lambda c: c.t.weight_decay), ("--clip-grad", lambda c: c.t.clip_grad),
                  ("--pipeoptim-s-offset", lambda c: c.p.pipeoptim_s_offset)]),
    Rule("timeout>0", lambda c: c.p.distributed_timeout_minutes > 0,
         lambda c: f"--distributed-timeout-minutes must be > 0 (got {c.p.distributed_timeout_minutes})"),
    Rule("timeout-finite", lambda c: math.isfinite(c.p.distributed_timeout_minutes),
         lambda c: f"--distributed-timeout-minutes must be finite (got {c.p.distributed_timeout_minutes}); large "
                   f"values such as 1e6 are accepted"),
    Rule("adam-betas", lambda c: 0 <= c.t.adam_beta1 < 1 and 0 <= c.t.adam_beta2 < 1,
         lambda c: f"--adam-beta1 ({c.t.adam_beta1}) and --adam-beta2 ({c.t.adam_beta2}) must be in [0, 1)"),
    Rule("epsilons>0", lambda c: c.t.adam_eps > 0 and c.m.norm_epsilon > 0,
         lambda c: f"--adam-eps ({c.t.adam_eps}) and --norm-epsilon ({c.m.norm_epsilon}) must be > 0"),
    Rule("sgd-momentum", lambda c: 0 <= c.t.sgd_momentum < 1,
         lambda c: f"--sgd-momentum must be in [0, 1) (got {c.t.sgd_momentum})"),
    Rule("muon-settings",
         lambda c: 0 <= c.t.muon_momentum < 1 and c.t.muon_num_ns_steps >= 1 and c.t.muon_extra_scale_factor > 0,
         lambda c: f"--muon-momentum ({c.t.muon_momentum}) must be in [0, 1), --muon-num-ns-steps "
                   f"({c.t.muon_num_ns_steps}) >= 1 and --muon-extra-scale-factor ({c.t.muon_extra_scale_factor}) > 0"),
    Check("muon-ns-coefficients", lambda c: _ns_coefficients_error(c),
          when=lambda c: c.t.optimizer == "muon" and c.t.muon_num_ns_steps >= 1),
    Rule("nadam-momentum-decay>=0", lambda c: c.t.nadam_momentum_decay >= 0,
         lambda c: f"--nadam-momentum-decay must be >= 0 (got {c.t.nadam_momentum_decay})"),
    Rule("init-std>0", lambda c: c.m.init_method_std > 0,
         lambda c: f"--init-method-std must be > 0 (got {c.m.init_method_std})"),
    Rule("wsd-iters-need-wsd", lambda c: c.t.lr_wsd_decay_iters is None or c.t.lr_decay_style == "wsd",
         lambda c: f"--lr-wsd-decay-iters applies to --lr-decay-style wsd, not {c.t.lr_decay_style}"),
    Rule("pipeoptim-flags-need-pipeoptim",
         lambda c: c.p.pipeoptim_s_offset == 0 and not c.p.pipeoptim_extrapolate_weight_decay,
         lambda c: f"--pipeoptim-s-offset and --pipeoptim-extrapolate-weight-decay apply to --pipeline-method "
                   f"pipeoptim, not {c.meth}", when=lambda c: c.meth != "pipeoptim"),
    Rule("lookahead-needs-sgd", lambda c: c.p.pipeoptim_sgd_direction == "buffer" or c.t.optimizer == "sgd",
         lambda c: f"--pipeoptim-sgd-direction {c.p.pipeoptim_sgd_direction} applies to --optimizer sgd, not "
                   f"{c.t.optimizer}"),
    Rule("peak-tflops>0", lambda c: c.lg.peak_tflops is None or c.lg.peak_tflops > 0,
         lambda c: f"--peak-tflops must be > 0 (got {c.lg.peak_tflops})"),
]


LAYOUT = [
    Rule("world-vs-tpxpp", lambda c: c.world % (c.tp * c.pp) == 0,
         lambda c: f"world size {c.world} is not divisible by --tensor-model-parallel-size ({c.tp}) x "
                   f"--pipeline-model-parallel-size ({c.pp}) = {c.tp * c.pp}"),
    Rule("world-vs-tpxppxcp", lambda c: c.world % (c.tp * c.pp * c.cp) == 0,
         lambda c: f"world size {c.world} is not divisible by --tensor-model-parallel-size ({c.tp}) x "
                   f"--pipeline-model-parallel-size ({c.pp}) x --context-parallel-size ({c.cp}) = {c.tp * c.pp * c.cp}",
         when=lambda c: c.cp > 1),
    *CONTEXT_PARALLEL,
    Rule("hidden-vs-heads", lambda c: c.m.kv_channels is not None or c.m.hidden_size % c.m.num_attention_heads == 0,
         lambda c: f"--hidden-size ({c.m.hidden_size}) is not divisible by --num-attention-heads "
                   f"({c.m.num_attention_heads})", when=lambda c: not c.m.multi_latent_attention),
    Rule("kv-channels>=1", lambda c: c.m.kv_channels is None or c.m.kv_channels >= 1,
         lambda c: f"--kv-channels must be >= 1 (got {c.m.kv_channels})"),
    Rule("hidden-vs-tp", lambda c: c.m.hidden_size % c.tp == 0,
         lambda c: f"--hidden-size ({c.m.hidden_size}) is not divisible by --tensor-model-parallel-size ({c.tp})"),
    Rule("heads-vs-tp", lambda c: c.m.num_attention_heads % c.tp == 0,
         lambda c: f"--num-attention-heads ({c.m.num_attention_heads}) is not divisible by "
                   f"--tensor-model-parallel-size ({c.tp})"),
    Rule("query-groups-divide-heads",
         lambda c: c.m.num_query_groups >= 1 and c.m.num_attention_heads % c.m.num_query_groups == 0,
         lambda c: f"--num-query-groups ({c.m.num_query_groups}) must divide --num-attention-heads "
                   f"({c.m.num_attention_heads})", when=lambda c: c.m.group_query_attention),
    Rule("query-groups-vs-tp", lambda c: c.m.num_query_groups % c.tp == 0,
         lambda c: f"--num-query-groups ({c.m.num_query_groups}) is not divisible by --tensor-model-parallel-size "
                   f"({c.tp}): each TP rank holds whole key/value heads", when=lambda c: c.m.group_query_attention),
    Rule("rotary-percent-range", lambda c: 0.0 < c.m.rotary_percent <= 1.0,
         lambda c: f"--rotary-percent must be in (0, 1] (got {c.m.rotary_percent})"),
    Rule("rotary-interpolation>=1",
         lambda c: c.m.rotary_seq_len_interpolation_factor is None or c.m.rotary_seq_len_interpolation_factor >= 1,
         lambda c: f"--rotary-seq-len-interpolation-factor must be >= 1 (got "
                   f"{c.m.rotary_seq_len_interpolation_factor})"),
    Rule("rope-scaling-needs-rope", lambda c: c.m.position_embedding_type == "rope",
         lambda c: f"--use-rope-scaling applies to --position-embedding-type rope, not {c.m.position_embedding_type}",
         when=lambda c: c.m.use_rope_scaling),
    Rule("rope-scaling-factor>=1", lambda c: 1.0 <= c.m.rope_scaling_factor < math.inf,
         lambda c: f"--rope-scaling-factor must be a finite number >= 1 (got {c.m.rope_scaling_factor}): the low "
                   f"RoPE frequencies are divided by it", when=lambda c: c.m.use_rope_scaling),
    Rule("rope-scaling-factor-needs-scaling", lambda c: c.m.rope_scaling_factor == 8.0,
         lambda c: f"--rope-scaling-factor {c.m.rope_scaling_factor} has no effect without --use-rope-scaling "
                   f"(add it for Llama 3.1's frequency scaling)", when=lambda c: not c.m.use_rope_scaling),
    Rule("no-position-embedding-learned",
         lambda c: c.m.add_position_embedding or c.m.position_embedding_type != "learned_absolute",
         "--no-position-embedding with --position-embedding-type learned_absolute: choose --position-embedding-type "
         "rope or none"),
    Rule("attention-backend-needs-half", lambda c: c.pr.bf16 or c.pr.fp16,
         lambda c: f"--attention-backend {c.m.attention_backend} runs half-precision kernels: add --bf16 or --fp16 "
                   f"(or use auto)", when=lambda c: c.m.attention_backend in ("flash", "fused")),
    Rule("attention-backend-needs-cuda", lambda c: config_check.cuda_device(),
         lambda c: f"--attention-backend {c.m.attention_backend} needs a CUDA device (its kernels are GPU-only); on "
                   f"CPU use auto, local or unfused", when=lambda c: c.m.attention_backend in ("flash", "fused")),
    Rule("ffn-vs-tp", lambda c: ffn_hidden_size(c.m) % c.tp == 0,
         lambda c: f"the MLP hidden size ({ffn_hidden_size(c.m)}) is not divisible by --tensor-model-parallel-size "
                   f"({c.tp})"),
    Rule("rope-even-head-dim", lambda c: _rotary_dim(c) >= 2 and _rotary_dim(c) % 2 == 0,
         lambda c: f"RoPE needs an even number of rotated dimensions: head dimension {kv_channels(c.m)} x "
                   f"--rotary-percent {c.m.rotary_percent} = {_rotary_dim(c)}",
         when=lambda c: c.m.position_embedding_type == "rope" and not c.m.multi_latent_attention),
    Rule("seq-vs-positions", lambda c: c.m.seq_length <= (c.m.max_position_embeddings or c.m.seq_length),
         lambda c: f"--seq-length ({c.m.seq_length}) exceeds --max-position-embeddings "
                   f"({c.m.max_position_embeddings or c.m.seq_length})",
         when=lambda c: c.m.position_embedding_type == "learned_absolute"),
    Rule("dropout-range", lambda c: 0 <= c.m.hidden_dropout < 1 and 0 <= c.m.attention_dropout < 1,
         "dropout probabilities must be in [0, 1)"),
    Rule("recompute-activations-vs-full",
         lambda c: not (c.m.recompute_activations and c.m.recompute_granularity == "full"),
         "--recompute-activations means --recompute-granularity selective, which contradicts "
         "--recompute-granularity full: give one of them"),
    Rule("recompute-full-needs-method",
         lambda c: c.m.recompute_method is not None and c.m.recompute_num_layers is not None,
         "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers",
         when=lambda c: recompute_granularity(c.m) == "full"),
    Rule("recompute-num-layers>=1", lambda c: c.m.recompute_num_layers >= 1,
         lambda c: f"--recompute-num-layers must be >= 1 (got {c.m.recompute_num_layers})",
         when=lambda c: recompute_granularity(c.m) == "full"),
    Rule("recompute-full-gpt-only", lambda c: c.workload == "gpt",
         "--recompute-granularity full is wired for GPT (pretrain_gpt.py) only so far; the NMT model takes "
         "--recompute-granularity selective", when=lambda c: recompute_granularity(c.m) == "full"),
    Rule("recompute-method-needs-full", lambda c: c.m.recompute_method is None and c.m.recompute_num_layers is None,
         lambda c: f"--recompute-method and --recompute-num-layers apply to --recompute-granularity full, not "
                   f"{recompute_granularity(c.m) or 'none'}", when=lambda c: recompute_granularity(c.m) != "full"),
    Rule("sequence-parallel-seq", lambda c: c.m.seq_length % c.tp == 0,
         lambda c: f"--sequence-parallel needs --seq-length ({c.m.seq_length}) divisible by "
                   f"--tensor-model-parallel-size ({c.tp})", when=lambda c: c.p.sequence_parallel),
    *SPLIT_RULES,
    Rule("global-batch-vs-micro-x-dp", lambda c: c.gbs % c.mbs_dp == 0,
         lambda c: f"--global-batch-size ({c.gbs}) is not divisible by --micro-batch-size ({c.t.micro_batch_size}) "
                   f"x data-parallel size ({c.dp})"),
    Rule("interleaving-microbatches", lambda c: c.num_mb % c.pp == 0,
         lambda c: f"--pipeline-method {c.meth} with an interleaved pipeline ({virtual_pipeline_size(c.cfg)} model "
                   f"chunks per rank) "
                   f"needs the number of micro-batches ({c.num_mb} = --global-batch-size / (--micro-batch-size x DP)) "
                   f"divisible by --pipeline-model-parallel-size ({c.pp}): the asynchronous stream's segments must "
                   f"end where its groups of {c.pp} micro-batches end (the synchronous interleaved schedules take any "
                   f"number)",
         when=lambda c: virtual_pipeline_size(c.cfg) > 1 and c.is_async),
    Rule("zb-h2-one-chunk", lambda c: c.meth != "zb-h2",
         "--pipeline-method zb-h2 runs one model chunk per rank: drop --num-layers-per-virtual-pipeline-stage or use "
         "zb-h1 (interleaved zero bubble)", when=lambda c: virtual_pipeline_size(c.cfg) > 1),
    Rule("zb-v-two-chunks", lambda c: virtual_pipeline_size(c.cfg) == 2,
         lambda c: f"--pipeline-method zb-v runs 2 model chunks per rank (a V): set "
                   f"--num-layers-per-virtual-pipeline-stage to --num-layers / (2 x --pipeline-model-parallel-size) "
                   f"= {c.m.num_layers / (2 * c.pp):g}", when=lambda c: c.meth == "zb-v"),
    Rule("zb-v-untied", lambda c: c.m.untie_embeddings_and_output_weights,
         "--pipeline-method zb-v puts the embedding and the output layer on rank 0's two chunks: it needs "
         "--untie-embeddings-and-output-weights", when=lambda c: c.meth == "zb-v"),
]


def _rotary_dim(c: Ctx) -> int:
    return int(kv_channels(c.m) * c.m.rotary_percent)


def _lpv(c: Ctx) -> int | None:
    return c.p.num_layers_per_virtual_pipeline_stage


# Megatron's learning-rate schedule, counted in iterations or (with --train-samples) in samples, and
# --rampup-batch-size (batch steps that fit the micro-batch x DP grid).
_ITER_FLAGS = [("--lr-decay-iters", lambda c: c.t.lr_decay_iters is not None),
               ("--lr-warmup-iters", lambda c: c.t.lr_warmup_iters != 0),
               ("--lr-wsd-decay-iters", lambda c: c.t.lr_wsd_decay_iters is not None)]
_SAMPLE_FLAGS = [("--lr-decay-samples", lambda c: c.t.lr_decay_samples is not None),
                 ("--lr-warmup-samples", lambda c: c.t.lr_warmup_samples != 0),
                 ("--lr-wsd-decay-samples", lambda c: c.t.lr_wsd_decay_samples is not None)]


def _train_samples(c: Ctx) -> bool:
    return c.t.train_samples is not None


def _ramp(c: Ctx) -> bool:
    return c.ramp is not None


LEARNING_RATE = [
    Rule("min-lr<=lr", lambda c: c.t.lr >= 0 and c.t.min_lr >= 0 and c.t.min_lr <= c.t.lr,
         lambda c: f"need 0 <= --min-lr ({c.t.min_lr}) <= --lr ({c.t.lr})"),
    Rule("warmup>=0", lambda c: c.t.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0"),
    Rule("train-samples>=1", lambda c: c.t.train_samples >= 1,
         lambda c: f"--train-samples must be >= 1 (got {c.t.train_samples})", when=_train_samples),
    Rule("train-samples-xor-iters", lambda c: c.t.train_iters == TrainingConfig().train_iters,
         "--train-samples and --train-iters exclude each other: give one", when=_train_samples),
    *each("{flag}-vs-train-samples", _ITER_FLAGS,
          lambda c, flag: f"{flag} counts iterations: with --train-samples use its -samples twin",
          when=_train_samples),
    *each("{flag}-needs-train-samples", _SAMPLE_FLAGS,
          lambda c, flag: f"{flag} counts samples: it needs --train-samples (or use its -iters twin)",
          when=lambda c: not _train_samples(c)),
    *[Rule(f"{flag[2:]}>=0", lambda c, v=value: v(c) is None or v(c) >= 0,
           lambda c, flag=flag, v=value: f"{flag} must be >= 0 (got {v(c)})")
      for flag, value in [("--lr-warmup-samples", lambda c: c.t.lr_warmup_samples),
                          ("--lr-decay-samples", lambda c: c.t.lr_decay_samples),
                          ("--lr-wsd-decay-samples", lambda c: c.t.lr_wsd_decay_samples)]],
    Rule("wsd-samples-need-wsd", lambda c: c.t.lr_wsd_decay_samples is None or c.t.lr_decay_style == "wsd",
         lambda c: f"--lr-wsd-decay-samples applies to --lr-decay-style wsd, not {c.t.lr_decay_style}"),
    Rule("warmup-fraction-range", lambda c: 0 <= c.t.lr_warmup_fraction <= 1,
         lambda c: f"--lr-warmup-fraction must be in [0, 1] (got {c.t.lr_warmup_fraction})",
         when=lambda c: c.t.lr_warmup_fraction is not None),
    Rule("warmup-fraction-xor", lambda c: c.t.lr_warmup_iters == 0 and c.t.lr_warmup_samples == 0,
         "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples exclude each other: give one",
         when=lambda c: c.t.lr_warmup_fraction is not None),
    Rule("decoupled-min-needs-lr", lambda c: c.t.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr",
         when=lambda c: c.t.decoupled_min_lr is not None),
    Rule("decoupled-order", lambda c: 0 <= (c.t.decoupled_min_lr or 0.0) <= c.t.decoupled_lr,
         lambda c: f"need 0 <= --decoupled-min-lr ({c.t.decoupled_min_lr or 0.0}) <= --decoupled-lr "
                   f"({c.t.decoupled_lr})", when=lambda c: c.t.decoupled_lr is not None),
    Check("rampup-integers", lambda c: raised(lambda: c.ramp)),
    Rule("rampup-positive", lambda c: c.ramp[0] >= 1 and c.ramp[1] >= 1 and c.ramp[2] >= 0,
         lambda c: "--rampup-batch-size START INCR SAMPLES needs START >= 1, INCR >= 1, SAMPLES >= 0 (got {} {} {})"
         .format(*c.ramp), when=_ramp),
    Rule("rampup-reaches-gbs", lambda c: c.ramp[0] <= c.gbs and (c.gbs - c.ramp[0]) % c.ramp[1] == 0,
         lambda c: f"--rampup-batch-size: --global-batch-size ({c.gbs}) must be START ({c.ramp[0]}) plus a multiple "
                   f"of INCR ({c.ramp[1]})", when=_ramp),
    Rule("rampup-whole-microbatches", lambda c: c.ramp[0] % c.mbs_dp == 0 and c.ramp[1] % c.mbs_dp == 0,
         lambda c: f"--rampup-batch-size: START ({c.ramp[0]}) and INCR ({c.ramp[1]}) must be multiples of "
                   f"--micro-batch-size x data-parallel size ({c.mbs_dp}): every ramp batch is whole micro-batches on "
                   f"every DP rank", when=_ramp),
    Rule("rampup-sync-only", lambda c: not c.is_async,
         lambda c: f"--rampup-batch-size changes the micro-batches per iteration, which --pipeline-method {c.meth} "
                   f"streams at a fixed count (its update interval and staleness come from it): use gpipe or 1f1b",
         when=_ramp),
]

DATA = [
    Rule("mock-data-xor-data-path", lambda c: not c.d.data_path,
         lambda c: f"--mock-data and --data-path {' '.join(c.d.data_path)} exclude each other: drop --mock-data to "
                   f"train on the data, or --data-path for synthetic tokens", when=lambda c: c.d.mock_data),
    Rule("mock-needs-vocab",
         lambda c: c.d.vocab_size is not None or c.d.tokenizer_model is not None or c.d.vocab_file is not None,
         "--mock-data needs --vocab-size (with --tokenizer-type NullTokenizer) or --tokenizer-model",
         when=lambda c: c.d.mock_data),
    Rule("data-path-required", lambda c: len(c.d.data_path) > 0,
         "--data-path is required (or --mock-data for synthetic data)", when=lambda c: not c.d.mock_data),
    Check("data-path-format", _data_path_error, when=lambda c: not c.d.mock_data),
    Check("split-format", _split_error, when=lambda c: not c.d.mock_data),
    Check("tokenizer-flags",
          lambda c: tokenizer_flag_error(c.d.tokenizer_type, c.d.tokenizer_model, c.d.vocab_size, c.d.vocab_file,
                                         c.d.merge_file),
          # mock data with --vocab-size needs no tokenizer files (the default type included)
          when=lambda c: not (c.d.tokenizer_type == "SentencePieceTokenizer" and c.d.mock_data and c.d.vocab_size)),
]

PRECISION = [
    Rule("fp16-xor-bf16", lambda c: not (c.pr.bf16 and c.pr.fp16),
         "--fp16 and --bf16 are mutually exclusive: choose one model dtype"),
    Rule("loss-scale-needs-fp16", lambda c: c.pr.fp16,
         lambda c: f"--loss-scale {c.pr.loss_scale} applies only to --fp16 (bf16 and fp32 train unscaled)",
         when=lambda c: c.pr.loss_scale is not None),
    Rule("loss-scale>0", lambda c: c.pr.loss_scale > 0, lambda c: f"--loss-scale must be > 0, got {c.pr.loss_scale}",
         when=lambda c: c.pr.loss_scale is not None),
    Rule("initial-loss-scale>0", lambda c: c.pr.initial_loss_scale > 0,
         lambda c: f"--initial-loss-scale must be > 0, got {c.pr.initial_loss_scale}"),
    Rule("min-loss-scale>0", lambda c: c.pr.min_loss_scale > 0,
         lambda c: f"--min-loss-scale must be > 0, got {c.pr.min_loss_scale}"),
    Rule("min-vs-initial-loss-scale", lambda c: not c.pr.min_loss_scale > c.pr.initial_loss_scale,
         lambda c: f"--min-loss-scale ({c.pr.min_loss_scale}) exceeds --initial-loss-scale "
                   f"({c.pr.initial_loss_scale})"),
    Rule("loss-scale-window>=1", lambda c: isinstance(c.pr.loss_scale_window, int) and c.pr.loss_scale_window >= 1,
         lambda c: f"--loss-scale-window must be an integer >= 1, got {c.pr.loss_scale_window!r}"),
    Rule("hysteresis>=1", lambda c: isinstance(c.pr.hysteresis, int) and c.pr.hysteresis >= 1,
         lambda c: f"--hysteresis must be an integer >= 1, got {c.pr.hysteresis!r}"),
    Rule("overlap-needs-distopt", lambda c: not c.pr.overlap_param_gather or c.pr.use_distributed_optimizer,
         "--overlap-param-gather requires --use-distributed-optimizer"),
]


def _async(c: Ctx) -> bool:
    return c.is_async


def _drain(c: Ctx) -> bool:
    return c.is_async and c.p.async_drain_interval is not None


def _dc(c: Ctx) -> bool:
    return c.is_async and c.p.delay_compensation_lambda > 0


_PREDICTOR_FLAGS = [("--weight-predictor", lambda c: c.p.weight_predictor != "linear"),
                    ("--prediction-horizon", lambda c: c.p.prediction_horizon != "full"),
                    ("--rollout-gradient", lambda c: c.p.rollout_gradient != "first-moment")]

ASYNC = [
    Rule("async-no-overlap-gather", lambda c: not c.pr.overlap_param_gather or c.meth in ("pipeoptim", "spectrain"),
         lambda c: f"--overlap-param-gather applies to the synchronous methods, pipeoptim and spectrain: "
                   f"--pipeline-method {c.meth} swaps weights (stashing) outside the forward, where a pending "
                   f"all-gather would still be writing them", when=_async),
    Rule("async-interval>=1", lambda c: c.k >= 1, lambda c: f"--async-update-interval must be >= 1 (got {c.k})",
         when=_async),
    Rule("drain-interval>=1", lambda c: c.p.async_drain_interval >= 1,
         lambda c: f"--async-drain-interval must be >= 1 (got {c.p.async_drain_interval})", when=_drain),
    *[Rule(name, lambda c, every=every: every(c) is None or every(c) % c.p.async_drain_interval == 0,
           lambda c, flag=flag, every=every: f"{flag} ({every(c)}) must be a multiple of --async-drain-interval "
                                             f"({c.p.async_drain_interval}): an asynchronous stream is checkpointed "
                                             f"and left only where it drains", when=_drain)
      for name, flag, every in [("save-on-drains", "--save-interval", lambda c: c.ck.save_interval),
                                ("exit-on-drains", "--exit-interval", lambda c: c.t.exit_interval)]],
    Rule("async-needs-untied", lambda c: c.m.untie_embeddings_and_output_weights,
         lambda c: f"--pipeline-method {c.meth} is asynchronous: stages step independently, so tied input/output "
                   f"embeddings cannot stay equal; add --untie-embeddings-and-output-weights", when=_async),
    Rule("async-interval-divides-microbatches", lambda c: c.num_mb % c.k == 0,
         lambda c: f"--async-update-interval ({c.k}) must divide the micro-batches per iteration ({c.num_mb})",
         when=_async),
    Rule("spectrain-needs-sgd", lambda c: c.t.optimizer == "sgd" and c.t.sgd_momentum > 0,
         lambda c: f"--pipeline-method spectrain predicts from the momentum buffer: it needs --optimizer sgd with "
                   f"--sgd-momentum > 0 (got --optimizer {c.t.optimizer})", when=lambda c: c.meth == "spectrain"),
    Rule("pipenag-needs-nag", lambda c: c.t.optimizer == "nag",
         lambda c: f"--pipeline-method pipenag runs the paper's Nesterov step: it needs --optimizer nag (got "
                   f"--optimizer {c.t.optimizer})", when=lambda c: c.meth == "pipenag"),
    Rule("pipenag-fp32", _fp32_weights,
         "--pipeline-method pipenag keeps look-ahead points of fp32 weights: drop --bf16/--fp16/"
         "--use-distributed-optimizer", when=lambda c: c.meth == "pipenag"),
    Rule("error-feedback-fp32", lambda c: not c.p.async_error_feedback or _fp32_weights(c),
         "--async-error-feedback reads each update off fp32 model weights: drop --bf16/--fp16/"
         "--use-distributed-optimizer", when=_async),
    Rule("2bw-interval>=stages", lambda c: c.k >= c.pp,
         lambda c: f"--pipeline-method pipedream-2bw accumulates m >= D micro-batches per update: "
                   f"--async-update-interval ({c.k}) must be >= --pipeline-model-parallel-size ({c.pp})",
         when=lambda c: c.meth == "pipedream-2bw"),
    Rule("2bw-interleaved-staleness", lambda c: _async_staleness(c) <= 1,
         lambda c: f"--pipeline-method pipedream-2bw needs every micro-batch's forward and backward within one step "
                   f"of each other; interleaved over {virtual_pipeline_size(c.cfg)} chunks "
                   f"(--num-layers-per-virtual-pipeline-stage) with --async-update-interval {c.k} a micro-batch "
                   f"spans {_async_staleness(c)} steps: use a larger --async-update-interval",
         when=lambda c: c.meth == "pipedream-2bw" and virtual_pipeline_size(c.cfg) > 1),
    *each("{flag}-needs-pipeoptim", _PREDICTOR_FLAGS,
          lambda c, flag: f"{flag} applies to --pipeline-method pipeoptim, not {c.meth}",
          when=lambda c: c.is_async and c.meth != "pipeoptim"),
    Rule("rollout-gradient-needs-rollout",
         lambda c: c.p.rollout_gradient == "first-moment" or c.p.weight_predictor == "rollout",
         "--rollout-gradient applies to --weight-predictor rollout", when=_async),
    Rule("rollout-optimizers",
         lambda c: c.p.weight_predictor != "rollout" or c.t.optimizer in ("adam", "adamw", "sgd"),
         lambda c: f"--weight-predictor rollout knows the recurrences of adam, adamw and sgd, not --optimizer "
                   f"{c.t.optimizer}", when=_async),
    Rule("rollout-sgd-buffer", lambda c: (c.p.weight_predictor != "rollout" or c.t.optimizer != "sgd"
                                          or c.p.pipeoptim_sgd_direction == "buffer"),
         "--weight-predictor rollout with --optimizer sgd rolls the momentum buffer: use --pipeoptim-sgd-direction "
         "buffer", when=_async),
    Rule("delay-compensation>=0", lambda c: c.p.delay_compensation_lambda >= 0,
         lambda c: f"--delay-compensation-lambda must be >= 0 (got {c.p.delay_compensation_lambda})", when=_async),
    Rule("delay-compensation-methods", lambda c: c.meth in ("pipedream", "pipeoptim"),
         lambda c: f"--delay-compensation-lambda needs the weights each forward ran on: pipedream (its stash) or "
                   f"pipeoptim (keeps the predicted weights), not {c.meth}", when=_dc),
    Rule("delay-compensation-k1", lambda c: c.k == 1,
         lambda c: f"--delay-compensation-lambda corrects each micro-batch's gradient on its own: it needs "
                   f"--async-update-interval 1 (got {c.k})", when=_dc),
    Rule("delay-compensation-no-distopt", lambda c: not c.pr.use_distributed_optimizer,
         "--delay-compensation-lambda edits the gradients after the backward, which the distributed optimizer has "
         "already reduce-scattered: drop --use-distributed-optimizer", when=_dc),
    Rule("adaptive-needs-lambda", lambda c: not c.p.delay_compensation_adaptive or c.p.delay_compensation_lambda > 0,
         "--delay-compensation-adaptive needs --delay-compensation-lambda > 0", when=_async),
    Rule("drain-interval-needs-async", lambda c: c.p.async_drain_interval is None,
         lambda c: f"--async-drain-interval applies to asynchronous methods, not --pipeline-method {c.meth} "
                   f"(synchronous methods flush every iteration)", when=lambda c: not c.is_async),
    Rule("interval-needs-async", lambda c: c.p.async_update_interval in (None, 1),
         lambda c: f"--async-update-interval applies to asynchronous methods, not --pipeline-method {c.meth} "
                   f"(synchronous methods step once per global batch)", when=lambda c: not c.is_async),
    *each("{flag}-needs-async",
          _PREDICTOR_FLAGS + [("--delay-compensation-lambda", lambda c: c.p.delay_compensation_lambda != 0),
                              ("--delay-compensation-adaptive", lambda c: c.p.delay_compensation_adaptive),
                              ("--staleness-lr-scaling", lambda c: c.p.staleness_lr_scaling != "none"),
                              ("--async-error-feedback", lambda c: c.p.async_error_feedback)],
          lambda c, flag: f"{flag} applies to asynchronous pipeline methods, not --pipeline-method {c.meth}",
          when=lambda c: not c.is_async),
]

CHECKPOINTS = [
    Rule("save-interval-needs-save", lambda c: c.ck.save is not None, "--save-interval needs --save",
         when=lambda c: c.ck.save_interval is not None),
    Rule("save-interval>=1", lambda c: c.ck.save_interval >= 1, "--save-interval must be >= 1",
         when=lambda c: c.ck.save_interval is not None),
    Rule("keep-last-needs-save", lambda c: c.ck.save is not None, "--keep-last needs --save",
         when=lambda c: c.ck.keep_last is not None),
    Rule("keep-last>=1", lambda c: c.ck.keep_last >= 1, lambda c: f"--keep-last must be >= 1 (got {c.ck.keep_last})",
         when=lambda c: c.ck.keep_last is not None),
    *each("{flag}-needs-load", [("--ckpt-step", lambda c: c.ck.ckpt_step is not None and c.ck.load is None),
                                ("--finetune", lambda c: c.ck.finetune and c.ck.load is None)],
          lambda c, flag: f"{flag} needs --load"),
    # --no-load-optim / --no-load-rng without --load: accepted, as Megatron does (ModelZoo's recipes pass them
    # to every run); they act on the next load, and there is none
    Rule("ckpt-step>=0", lambda c: c.ck.ckpt_step >= 0, lambda c: f"--ckpt-step must be >= 0 (got {c.ck.ckpt_step})",
         when=lambda c: c.ck.ckpt_step is not None),
    # --seed: every rank seeds NumPy with seed + 100 x pipeline rank, which must stay in [0, 2**32)
    Rule("seed-range", lambda c: 0 <= c.t.seed < _seed_top(c),
         lambda c: f"--seed must be in [0, {_seed_top(c)}) (got {c.t.seed}): pipeline stage s seeds NumPy with seed "
                   f"+ {SEED_STRIDE_PER_STAGE} x s, which must stay below 2**32 (--pipeline-model-parallel-size "
                   f"{c.pp})"),
    Rule("max-skipped-steps>=0", lambda c: c.pr.max_skipped_steps >= 0,
         lambda c: f"--max-skipped-steps must be >= 0 (got {c.pr.max_skipped_steps}; 0: no bound)"),
    Rule("finetune-save-is-load", lambda c: os.path.realpath(c.ck.save) != os.path.realpath(c.ck.load),
         lambda c: f"--finetune with --save equal to --load ({c.ck.load}): a relaunch could not tell the base "
                   f"checkpoint from this run's own; save the finetuned run to another directory",
         when=lambda c: c.ck.finetune and c.ck.save is not None and c.ck.load is not None),
]


def _seed_top(c: Ctx) -> int:
    return SEED_LIMIT - SEED_STRIDE_PER_STAGE * (c.pp - 1)


# Megatron flags accepted for its launch scripts: the ones with a meaning here and their rules, and the
# GPU-only switches refused with one line where they have no meaning on this run.
MEGATRON_SWITCHES = [
    *each("{flag}-needs-local", [("--reset-position-ids", lambda c: c.d.reset_position_ids),
                                 ("--reset-attention-mask", lambda c: c.d.reset_attention_mask)],
          lambda c, flag: f"{flag} needs --transformer-impl local (the Transformer Engine layers take no "
                          f"per-document positions or mask here)",
          when=lambda c: c.m.transformer_impl != "local"),
    Rule("add-qkv-bias-needs-local", lambda c: c.m.transformer_impl == "local",
         "--add-qkv-bias needs --transformer-impl local (the Transformer Engine layers here put a bias on every "
         "projection or on none: --add-bias-linear)", when=lambda c: c.m.add_qkv_bias and not c.m.add_bias_linear),
    Rule("decoupled-lr-sync-only", lambda c: c.t.decoupled_lr is None or not c.is_async,
         lambda c: f"--decoupled-lr is wired for the synchronous methods (gpipe, 1f1b), not --pipeline-method "
                   f"{c.meth}, whose stages build their own optimizers"),
    Rule("exit-duration>0", lambda c: c.t.exit_duration_in_mins is None or c.t.exit_duration_in_mins > 0,
         lambda c: f"--exit-duration-in-mins must be > 0 (got {c.t.exit_duration_in_mins})"),
    Rule("manual-gc-interval>=0", lambda c: c.t.manual_gc_interval >= 0,
         lambda c: f"--manual-gc-interval must be >= 0 (got {c.t.manual_gc_interval})"),
    Rule("manual-gc-interval-needs-gc", lambda c: c.t.manual_gc or c.t.manual_gc_interval == 0,
         "--manual-gc-interval needs --manual-gc"),
    Rule("tensorboard-interval>=1", lambda c: c.lg.tensorboard_log_interval >= 1,
         lambda c: f"--tensorboard-log-interval must be >= 1 (got {c.lg.tensorboard_log_interval})"),
    Rule("profile-steps", lambda c: 1 <= c.lg.profile_step_start < c.lg.profile_step_end,
         lambda c: f"--profile needs 1 <= --profile-step-start ({c.lg.profile_step_start}) < --profile-step-end "
                   f"({c.lg.profile_step_end})", when=lambda c: c.lg.profile),
    Rule("grad-reduce-bf16-needs-bf16", lambda c: not c.pr.grad_reduce_in_bf16 or c.pr.bf16,
         "--grad-reduce-in-bf16 needs --bf16"),
    Rule("nccl-needs-cuda", _nccl_usable, "--distributed-backend nccl needs CUDA GPUs; on CPU use gloo (the default)",
         when=lambda c: c.p.distributed_backend == "nccl"),
    Rule("grad-reduce-bf16-vs-fp32",
         lambda c: not (c.pr.grad_reduce_in_bf16 and c.pr.accumulate_allreduce_grads_in_fp32),
         "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other: give one"),
    Rule("fp8-param-gather", lambda c: not c.pr.fp8_param_gather,
         "--fp8-param-gather (all-gather FP8 weights, Transformer Engine on GPUs) is not implemented here: the "
         "distributed optimizer gathers the model-dtype weights; drop it"),
    Rule("tiktoken-pattern", lambda c: c.d.tiktoken_pattern is None,
         lambda c: f"--tiktoken-pattern {c.d.tiktoken_pattern} configures TikTokenizer, which is not available here: "
                   f"drop it"),
    *each("{flag}-sync-only", [("--log-params-norm", lambda c: c.lg.log_params_norm),
                               ("--log-num-zeros-in-grad", lambda c: c.lg.log_num_zeros_in_grad)],
          lambda c, flag: f"{flag} is logged by the synchronous methods (gpipe, 1f1b); --pipeline-method {c.meth} "
                          f"steps its stages at different times: drop it", when=_async),
    Rule("calculate-per-token-loss-sync-only", lambda c: not (c.t.calculate_per_token_loss and c.is_async),
         lambda c: f"--calculate-per-token-loss normalizes by the loss tokens of a whole global batch, but "
                   f"--pipeline-method {c.meth} steps on micro-batches as they stream: drop one"),
    *each("{flag}-gpt-only", [("--eod-mask-loss", lambda c: c.d.eod_mask_loss),
                              ("--reset-position-ids", lambda c: c.d.reset_position_ids),
                              ("--reset-attention-mask", lambda c: c.d.reset_attention_mask),
                              ("--calculate-per-token-loss", lambda c: c.t.calculate_per_token_loss),
                              ("--decoupled-lr", lambda c: c.t.decoupled_lr is not None)],
          lambda c, flag: f"{flag} applies to pretrain_gpt.py (documents in one token stream), not pretrain_nmt.py",
          when=lambda c: c.workload == "nmt"),
    *each("{flag}-needs-save", [("--no-save-optim", lambda c: c.ck.no_save_optim and c.ck.save is None),
                                ("--no-save-rng", lambda c: c.ck.no_save_rng and c.ck.save is None)],
          lambda c, flag: f"{flag} needs --save"),
    Rule("use-checkpoint-args-needs-load", lambda c: not c.ck.use_checkpoint_args or c.ck.load is not None,
         "--use-checkpoint-args needs --load"),
]


def _async_staleness(c: Ctx) -> int:
    """The largest staleness (steps between a micro-batch's forward and backward) of the asynchronous schedule
    this run's policies validate themselves on (pipeline/async_stage.py), over every rank and chunk."""
    from megatron_po.pipeline.async_stage import _probe_schedule  # imported where a pipedream-2bw run starts
    from megatron_po.pipeline.schedules import staleness
    per_rank = staleness(_probe_schedule(c.pp, virtual_pipeline_size(c.cfg), c.k)).values()
    return max((s for per_mb in per_rank for s in per_mb.values()), default=0)


def _fsdp(c: Ctx) -> bool:
    return uses_fsdp2(c.cfg)


_FSDP_FLAG = "--use-torch-fsdp2 (--data-parallel-sharding-strategy optim_grads/optim_grads_params)"

# FSDP2 (distributed/fsdp.py): what it does not combine with.
FSDP = [
    Rule("fsdp-gpt-only", lambda c: c.workload != "nmt",
         f"{_FSDP_FLAG} is wired for GPT (pretrain_gpt.py) only: the encoder-decoder model reads its shared embedding "
         "outside the layers FSDP2 gathers", when=_fsdp),
    Rule("fsdp-no-distopt", lambda c: not c.pr.use_distributed_optimizer,
         f"{_FSDP_FLAG} shards the optimizer state itself: drop --use-distributed-optimizer "
         "(--data-parallel-sharding-strategy optim)", when=_fsdp),
    Rule("fsdp-local-layers", lambda c: c.m.transformer_impl == "local",
         f"{_FSDP_FLAG} shards this code's layers; --transformer-impl transformer_engine keeps its own weight "
         "copies (FP8 casts) outside FSDP2's gathers: use --transformer-impl local", when=_fsdp),
    Rule("fsdp-async-reshards", lambda c: fsdp2_reshard_after_forward(c.cfg),
         lambda c: f"--pipeline-method {c.meth} under FSDP2 needs each layer resharded after its forward: the "
                   f"backward gathers the weights the method put in the shards then; drop "
                   f"--torch-fsdp2-no-reshard-after-forward (--data-parallel-sharding-strategy optim_grads)",
         when=lambda c: _fsdp(c) and c.is_async),
    Rule("fsdp-async-recompute", lambda c: recompute_granularity(c.m) is None and not recomputes_moe_layers(c.m),
         lambda c: f"{'--recompute-granularity' if recompute_granularity(c.m) else '--moe-layer-recompute'} with "
                   f"--pipeline-method {c.meth} under FSDP2: the recomputation in the "
                   f"backward gathers the live shards, not the weights the forward ran on; recomputation composes "
                   f"with FSDP2 under the synchronous methods, pipedream and pipedream-2bw",
         when=lambda c: _fsdp(c) and c.meth in ("async-naive", "spectrain", "pipeoptim", "pipenag")),
    Rule("fsdp-delay-compensation", lambda c: c.p.delay_compensation_lambda == 0,
         f"--delay-compensation-lambda edits each gradient after its backward, which FSDP2 has already "
         f"reduce-scattered: drop it or {_FSDP_FLAG}", when=lambda c: _fsdp(c) and c.is_async),
]


def _nmt(c: Ctx) -> bool:
    return c.workload == "nmt"


# The encoder-decoder workload's rules (on a config `normalize_nmt` has seen).
NMT = [
    Rule("layers>=1", lambda c: (c.n.encoder_num_layers is not None and c.n.encoder_num_layers >= 1
                                 and c.n.decoder_num_layers >= 1),
         lambda c: f"--encoder-num-layers ({c.n.encoder_num_layers}) and --decoder-num-layers "
                   f"({c.n.decoder_num_layers}) must be >= 1", when=_nmt),
    Rule("decoder-seq>=2", lambda c: c.n.decoder_seq_length >= 2,
         lambda c: f"--decoder-seq-length must be >= 2 (got {c.n.decoder_seq_length})", when=_nmt),
    Rule("decoder-seq-vs-positions", lambda c: c.n.decoder_seq_length <= _nmt_max_pos(c),
         lambda c: f"--decoder-seq-length ({c.n.decoder_seq_length}) exceeds --max-position-embeddings "
                   f"({_nmt_max_pos(c)})",
         when=lambda c: _nmt(c) and c.m.position_embedding_type == "learned_absolute"),
    *each("{flag}-gpt-only", [("--group-query-attention", lambda c: c.m.group_query_attention),
                              ("--kv-channels", lambda c: c.m.kv_channels),
                              ("--qk-layernorm", lambda c: c.m.qk_layernorm)],
          lambda c, flag: f"{flag} applies to pretrain_gpt.py: the NMT model's cross-attention has one key/value "
                          f"head per query head of dimension hidden / heads", when=_nmt),
    Rule("add-qkv-bias-gpt-only", lambda c: not c.m.add_qkv_bias,
         "--add-qkv-bias applies to pretrain_gpt.py's self-attention; the NMT model's projections take "
         "--add-bias-linear", when=_nmt),
    Rule("no-sequence-parallel", lambda c: not c.p.sequence_parallel,
         "--sequence-parallel is not supported by pretrain_nmt.py (sentence lengths vary per batch)", when=_nmt),
    Rule("no-mock-data", lambda c: not c.d.mock_data,
         "pretrain_nmt.py needs a parallel corpus: --data-path PREFIX from tools/preprocess_nmt.py (--mock-data is "
         "GPT only)", when=_nmt),
    Rule("one-data-path", lambda c: len(c.d.data_path) == 1,
         lambda c: f"pretrain_nmt.py takes one --data-path PREFIX (tools/preprocess_nmt.py's --output-prefix), got "
                   f"{len(c.d.data_path)} values", when=_nmt),
    Rule("no-split", lambda c: c.d.split == DataConfig().split,
         lambda c: f"--split ({c.d.split}) does not apply to pretrain_nmt.py: tools/preprocess_nmt.py splits the "
                   f"corpus by documents", when=_nmt),
    Rule("no-data-loader-workers", lambda c: c.d.num_workers == 0 and c.d.dataloader_type == "single",
         lambda c: f"--num-workers ({c.d.num_workers}) and --dataloader-type ({c.d.dataloader_type}) apply to "
                   f"pretrain_gpt.py: pretrain_nmt.py batches sentence pairs by tokens in the training process",
         when=_nmt),
    Rule("sentencepiece", lambda c: c.d.tokenizer_type == "SentencePieceTokenizer",
         "pretrain_nmt.py needs --tokenizer-type SentencePieceTokenizer (it uses its <s>, </s> and <pad> ids)",
         when=_nmt),
    Rule("languages-differ", lambda c: c.n.src_lang != c.n.tgt_lang,
         lambda c: f"--src-lang and --tgt-lang are both {c.n.src_lang!r}", when=_nmt),
    Rule("tgt-tokenizer-needs-untied",
         lambda c: not (c.n.tgt_tokenizer_model is not None and c.n.tgt_tokenizer_model != c.d.tokenizer_model)
         or c.n.untie_encoder_decoder_embeddings,
         "--tgt-tokenizer-model gives the target its own vocabulary: add --untie-encoder-decoder-embeddings",
         when=_nmt),
    Rule("label-smoothing", lambda c: 0.0 <= c.n.label_smoothing < 1.0,
         lambda c: f"--label-smoothing must be in [0, 1) (got {c.n.label_smoothing})", when=_nmt),
    Rule("max-tokens-holds-a-sentence", lambda c: c.n.max_tokens >= _nmt_longest(c),
         lambda c: f"--max-tokens ({c.n.max_tokens}) must hold one sentence of the longest allowed length "
                   f"(max(--seq-length, --decoder-seq-length) = {_nmt_longest(c)})",
         when=lambda c: _nmt(c) and c.n.max_tokens is not None),
    Rule("eval-bleu-sentences>=0", lambda c: c.n.eval_bleu_sentences >= 0,
         lambda c: f"--eval-bleu-sentences must be >= 0 (got {c.n.eval_bleu_sentences})",
         when=lambda c: _nmt(c) and c.n.eval_bleu_sentences is not None),
]


def _nmt_max_pos(c: Ctx) -> int:
    return c.m.max_position_embeddings or max(c.m.seq_length, c.n.decoder_seq_length)


def _nmt_longest(c: Ctx) -> int:
    return max(c.m.seq_length, c.n.decoder_seq_length)


RULES: list[Rule | Check] = (SIZES + LAYOUT + LEARNING_RATE + DATA + PRECISION + ASYNC + CHECKPOINTS
                             + MEGATRON_SWITCHES + RECIPE_RULES + FSDP + MOE_RULES + MLA_RULES + MTP_RULES + FP8_RULES
                             + TE_RULES + NMT)
