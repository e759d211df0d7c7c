"""One dataclass config tree; the command-line flags are generated from it.

Every leaf field becomes a Megatron-named flag: `hidden_size` -> `--hidden-size`. Booleans that default
to False are `store_true` flags; booleans that default to True get a `--no-...` flag instead. Field
names are unique across the tree so the flag namespace stays flat, as Megatron users expect.

`validate(cfg, world_size)` checks every cross-flag rule before any process group exists, raising
`ConfigError` with one line that names the flags and the rule.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import get_args, get_origin, get_type_hints

from megatron_po.errors import ConfigError, UserError


def _f(default, help: str, choices=None, nargs=None):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if nargs is not None:
        meta["nargs"] = nargs
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "number of transformer layers")
    hidden_size: int = _f(128, "transformer hidden size")
    ffn_hidden_size: int | None = _f(None, "MLP hidden size (default 4 x hidden; 8/3 x hidden rounded for SwiGLU)")
    num_attention_heads: int = _f(4, "number of attention heads")
    seq_length: int = _f(128, "training sequence length")
    max_position_embeddings: int | None = _f(None, "size of the learned position table (default seq_length)")
    position_embedding_type: str = _f("learned_absolute", "position encoding", choices=["learned_absolute", "rope"])
    rotary_base: int = _f(10000, "RoPE base")
    normalization: str = _f("LayerNorm", "normalization layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "epsilon of the normalization layers")
    swiglu: bool = _f(False, "SwiGLU MLP instead of GELU")
    untie_embeddings_and_output_weights: bool = _f(False, "separate output layer weights (required by async pipelines)")
    hidden_dropout: float = _f(0.1, "dropout on hidden states")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities")
    init_method_std: float = _f(0.02, "std of the normal weight init; output projections get std/sqrt(2*layers)")
    add_bias_linear: bool = _f(True, "biases in linear layers (--no-add-bias-linear to drop them)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this x TP size")
    transformer_impl: str = _f("local", "transformer layers: local (PyTorch) or transformer_engine (NVIDIA "
                                        "Transformer Engine, GPUs; requirements-gpu.txt)",
                               choices=["local", "transformer_engine"])
    fp8_format: str | None = _f(None, "FP8 GEMMs in the transformer layers (Transformer Engine): hybrid (E4M3 "
                                      "forward, E5M2 gradients) or e4m3", choices=["hybrid", "e4m3"])
    fp8_margin: int = _f(0, "FP8 delayed scaling: scaling factor margin (powers of 2)")
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling: amax history length")
    fp8_amax_compute_algo: str = _f("most_recent", "FP8 delayed scaling: amax taken from the history",
                                    choices=["most_recent", "max"])


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual stage (interleaved pipeline)")
    sequence_parallel: bool = _f(False, "split LayerNorm/dropout activations along the sequence over TP ranks")
    pipeline_method: str = _f("1f1b", "pipeline schedule (synchronous: gpipe, 1f1b) or asynchronous method",
                              choices=["gpipe", "1f1b", "async-naive", "pipedream", "pipedream-2bw", "spectrain",
                                       "pipeoptim"])
    async_update_interval: int = _f(1, "asynchronous methods: a stage steps after every k of its backwards")
    async_drain_interval: int | None = _f(None, "asynchronous methods: drain the stream every this many iterations "
                                          "(checkpoints are taken at drains); default: at every --save-interval")
    pipeoptim_s_offset: int = _f(0, "PipeOptim: added to the schedule's staleness s (0 = paper, 1 = reference code)")
    pipeoptim_sgd_direction: str = _f("buffer", "PipeOptim with SGD momentum: the direction extrapolated",
                                      choices=["buffer", "lookahead"])
    pipeoptim_extrapolate_weight_decay: bool = _f(False, "PipeOptim: also extrapolate decoupled weight decay")
    weight_predictor: str = _f("linear", "PipeOptim: how far along ΔW to predict: linear = s·lr (paper), lr-schedule "
                               "= the schedule's next s lrs, rollout = the optimizer's recurrences rolled s steps",
                               choices=["linear", "lr-schedule", "rollout"])
    rollout_gradient: str = _f("first-moment", "--weight-predictor rollout: the next gradients' assumed mean",
                               choices=["first-moment", "zero-mean"])
    prediction_horizon: str = _f("full", "PipeOptim: extrapolate h(s) steps' worth: full = s, sqrt = √s (random-walk rule)",
                                 choices=["full", "sqrt"])
    delay_compensation_lambda: float = _f(0.0, "pipedream/pipeoptim: correct each gradient by "
                                          "λ·g⊙g⊙(W_live − W_used) before the step (DC-ASGD; 0 = off)")
    delay_compensation_adaptive: bool = _f(False, "delay compensation: divide λ by the gradient's RMS per tensor")
    staleness_lr_scaling: str = _f("none", "asynchronous methods: divide the lr of a step whose gradient is s steps "
                                   "stale by 1+s (inverse) or √(1+s) (inverse-sqrt)",
                                   choices=["none", "inverse", "inverse-sqrt"])
    ddp_bucket_size: int = _f(40_000_000, "DDP gradient bucket size in elements")
    distributed_timeout_minutes: float = _f(10.0, "timeout of every collective and p2p operation; a dead rank is "
                                                  "detected (heartbeat) within half of it, at most 60 s")


@dataclass
class DataConfig:
    data_path: list = _f([], "dataset prefix(es), optionally weighted: '0.3 A 0.7 B'", nargs="*")
    split: str = _f("969,30,1", "train,valid,test proportions of documents")
    mock_data: bool = _f(False, "synthetic random tokens instead of a corpus")
    data_cache_path: str | None = _f(None, "where to cache the dataset index files (default: next to the data)")
    tokenizer_type: str = _f("SentencePieceTokenizer", "tokenizer",
                             choices=["SentencePieceTokenizer", "NullTokenizer"])
    tokenizer_model: str | None = _f(None, "sentencepiece .model file")
    vocab_size: int | None = _f(None, "vocabulary size (NullTokenizer)")
    num_workers: int = _f(0, "data loader worker processes")


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(4, "samples per micro-batch")
    global_batch_size: int | None = _f(None, "samples per optimizer step (default micro_batch x DP)")
    train_iters: int = _f(100, "optimizer iterations")
    optimizer: str = _f("adamw", "optimizer",
                        choices=["adam", "adamw", "sgd", "nesterov", "rmsprop", "adagrad", "lion"])
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    lr_decay_style: str = _f("cosine", "learning-rate decay", choices=["constant", "linear", "cosine", "wsd"])
    lr_warmup_iters: int = _f(0, "linear warm-up iterations")
    lr_decay_iters: int | None = _f(None, "iterations of decay (default train_iters)")
    lr_wsd_decay_iters: int | None = _f(None, "WSD: iterations of the final decay (default 10%% of decay iters)")
    weight_decay: float = _f(0.01, "weight decay (decoupled for AdamW/Lion, L2 otherwise); not on biases and norms")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    sgd_momentum: float = _f(0.9, "SGD momentum")
    clip_grad: float = _f(1.0, "clip gradients to this global L2 norm (0 disables)")
    seed: int = _f(1234, "random seed")
    eval_interval: int = _f(1000, "evaluate every this many iterations")
    eval_iters: int = _f(10, "validation micro-batch groups per evaluation")
    exit_interval: int | None = _f(None, "stop (after saving, with --save) once the iteration is a multiple of this")
    check_for_nan_in_loss_and_grad: bool = _f(True, "stop, naming the iteration, rank and stage, at a NaN/inf loss or "
                                                    "gradient (bf16/fp32) before the step; fp16 skips the step")
    deterministic: bool = _f(False, "bit-reproducible runs on GPUs: deterministic kernels (torch, cuDNN, cuBLAS "
                                    "workspace) and NCCL_ALGO=Ring; CPU runs are deterministic without it")


@dataclass
class PrecisionConfig:
    bf16: bool = _f(False, "bf16 model weights and activations; fp32 main params in the optimizer")
    fp16: bool = _f(False, "fp16 model weights with dynamic loss scaling; fp32 main params")
    accumulate_allreduce_grads_in_fp32: bool = _f(False, "accumulate and all-reduce gradients in fp32")
    loss_scale: float | None = _f(None, "constant loss scale (fp16); default: dynamic")
    initial_loss_scale: float = _f(2.0**32, "initial dynamic loss scale (fp16)")
    min_loss_scale: float = _f(1.0, "minimum dynamic loss scale (fp16)")
    loss_scale_window: int = _f(1000, "iterations without overflow before the loss scale grows (fp16)")
    hysteresis: int = _f(2, "overflows tolerated before the loss scale shrinks (fp16)")
    use_distributed_optimizer: bool = _f(False, "shard optimizer state and fp32 main params over DP (ZeRO-1)")
    overlap_param_gather: bool = _f(False, "overlap the distributed optimizer's parameter all-gather with the forward")


@dataclass
class LoggingConfig:
    log_interval: int = _f(10, "log every this many iterations")
    metrics_file: str | None = _f(None, "append one JSON object per logged iteration to this file")
    wandb_project: str | None = _f(None, "Weights & Biases project (enables W&B)")
    wandb_exp_name: str | None = _f(None, "W&B run name")
    wandb_entity: str | None = _f(None, "W&B entity")
    wandb_save_dir: str | None = _f(None, "W&B local directory")
    tensorboard_dir: str | None = _f(None, "write TensorBoard event files (the same scalars as W&B) here")
    log_throughput: bool = _f(False, "also log the model TFLOP/s per GPU and, with a known peak, MFU")
    peak_tflops: float | None = _f(None, "peak dense TFLOP/s of one device for MFU (default: known GPUs by name)")
    timing_log_level: int = _f(0, "timers to log: 0 none, 1 forward-backward/grad-sync/optimizer, 2 also "
                                  "forward/backward compute, p2p and weight prediction", choices=[0, 1, 2])


@dataclass
class CheckpointConfig:
    save: str | None = _f(None, "checkpoint directory to save to")
    load: str | None = _f(None, "checkpoint directory to resume from (latest checkpoint)")
    save_interval: int | None = _f(None, "save every this many iterations (and at the end)")
    ckpt_step: int | None = _f(None, "load the checkpoint of this iteration instead of the latest")
    keep_last: int | None = _f(None, "after each save, delete all but the newest N checkpoints (never the tracked one)")
    no_load_optim: bool = _f(False, "do not load the optimizer state (fresh optimizer, weights loaded)")
    no_load_rng: bool = _f(False, "do not load the random generators' states")
    finetune: bool = _f(False, "load the weights only: iteration and consumed samples restart at 0, "
                               "optimizer and random states are not loaded")


@dataclass
class NMTConfig:
    """Encoder-decoder translation (pretrain_nmt.py, tools/translate.py); pretrain_gpt.py ignores it.
    With pretrain_nmt.py `--seq-length` bounds the source side and `--num-layers` is the default depth of
    both stacks (Megatron's T5 convention); `normalize_nmt` turns them into the stacked layer count."""
    encoder_num_layers: int | None = _f(None, "NMT: encoder layers (default --num-layers)")
    decoder_num_layers: int | None = _f(None, "NMT: decoder layers (default --num-layers)")
    decoder_seq_length: int | None = _f(None, "NMT: longest target sequence in tokens, BOS/EOS included "
                                              "(default --seq-length, which bounds the source)")
    src_lang: str = _f("en", "NMT: source language (reads <data-path>_<split>_<src-lang>.bin/.idx)")
    tgt_lang: str = _f("fr", "NMT: target language (reads <data-path>_<split>_<tgt-lang>.bin/.idx)")
    tgt_tokenizer_model: str | None = _f(None, "NMT: target-side sentencepiece model (default --tokenizer-model: "
                                               "one joint vocabulary)")
    untie_encoder_decoder_embeddings: bool = _f(False, "NMT: separate source and target word embeddings "
                                                       "(required with --tgt-tokenizer-model)")
    max_tokens: int | None = _f(None, "NMT: cap a micro-batch at this many padded tokens of its longer side too "
                                      "(token-based batching; --micro-batch-size caps its sentences)")
    label_smoothing: float = _f(0.1, "NMT: label smoothing of the cross entropy")
    eval_bleu_sentences: int | None = _f(None, "NMT: validation sentences greedily decoded for BLEU at each "
                                               "evaluation (default: all)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nmt: NMTConfig = field(default_factory=NMTConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Flags generated from the tree
# --------------------------------------------------------------------------------------------------


def _sections(cfg_cls=Config):
    hints = get_type_hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        yield f.name, hints[f.name]


def _scalar_type(tp):
    """`int | None` -> int; `list` -> str (items)."""
    if get_origin(tp) is not None and type(None) in get_args(tp):
        tp = next(a for a in get_args(tp) if a is not type(None))
    return str if tp is list else tp


def build_parser(description: str = "megatron_po") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    for section, section_cls in _sections():
        group = parser.add_argument_group(section)
        hints = get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_ = f.metadata.get("help", "")
            tp = _scalar_type(hints[f.name])
            if tp is bool:
                if default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", help=help_)
                    # the positive spelling (Megatron accepts e.g. --check-for-nan-in-loss-and-grad): the default
                    group.add_argument(flag, dest=f.name, action="store_true", help=argparse.SUPPRESS)
                else:
                    group.add_argument(flag, dest=f.name, action="store_true", help=help_)
                continue
            kwargs = dict(dest=f.name, type=tp, default=default, help=help_)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(flag, **kwargs)
    return parser


class _ArgumentError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgumentError(message)


def parse_args(argv=None, description: str = "megatron_po") -> Config:
    """Parse flags into a Config. Unknown or malformed flags raise ConfigError (one line)."""
    parser = build_parser(description)
    parser.__class__ = _RaisingParser
    try:
        ns = parser.parse_args(argv)
    except _ArgumentError as e:
        raise ConfigError(str(e)) from None
    return config_from_namespace(ns)


def config_from_namespace(ns: argparse.Namespace) -> Config:
    values = vars(ns)
    sections = {}
    for section, section_cls in _sections():
        sections[section] = section_cls(**{f.name: values[f.name] for f in dataclasses.fields(section_cls)})
    return Config(**sections)


# --------------------------------------------------------------------------------------------------
# Derived values and validation
# --------------------------------------------------------------------------------------------------


ASYNC_METHODS = ("async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim")


def is_async(cfg: "Config") -> bool:
    return cfg.parallel.pipeline_method in ASYNC_METHODS


def ffn_hidden_size(m: ModelConfig) -> int:
    if m.ffn_hidden_size is not None:
        return m.ffn_hidden_size
    if m.swiglu:  # keep the MLP's parameter count of a 4h GELU MLP, rounded to a multiple of 64
        return ((int(8 * m.hidden_size / 3) + 63) // 64) * 64
    return 4 * m.hidden_size


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size)


def num_microbatches(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return global_batch_size(cfg, world_size) // (cfg.training.micro_batch_size * dp)


def global_batch_size(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return cfg.training.global_batch_size or cfg.training.micro_batch_size * dp


def virtual_pipeline_size(cfg: Config) -> int:
    """Model chunks per pipeline rank (1 without interleaving)."""
    p = cfg.parallel
    if p.num_layers_per_virtual_pipeline_stage is None:
        return 1
    return cfg.model.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)


def validate(cfg: Config, world_size: int, workload: str = "gpt") -> None:
    """Every cross-flag rule, checked before any process group exists (`workload`: "gpt" or "nmt")."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    # NMT stacks the encoder and decoder layers (normalize_nmt); the pipeline splits their sum.
    layers_flag = "--encoder-num-layers + --decoder-num-layers" if workload == "nmt" else "--num-layers"
    for name, value in [("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        (layers_flag, m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--micro-batch-size", t.micro_batch_size), ("--train-iters", t.train_iters),
                        ("--log-interval", cfg.logging.log_interval), ("--eval-interval", t.eval_interval)]:
        need(value >= 1, f"{name} must be >= 1 (got {value})")
    for name, value in [("--global-batch-size", t.global_batch_size), ("--exit-interval", t.exit_interval),
                        ("--lr-decay-iters", t.lr_decay_iters), ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters),
                        ("--ffn-hidden-size", m.ffn_hidden_size),
                        ("--max-position-embeddings", m.max_position_embeddings),
                        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
                        ("--ddp-bucket-size", p.ddp_bucket_size)]:
        need(value is None or value >= 1, f"{name} must be >= 1 (got {value})")
    for name, value in [("--eval-iters", t.eval_iters), ("--num-workers", d.num_workers),
                        ("--weight-decay", t.weight_decay), ("--clip-grad", t.clip_grad),
                        ("--pipeoptim-s-offset", p.pipeoptim_s_offset)]:
        need(value >= 0, f"{name} must be >= 0 (got {value})")
    need(p.distributed_timeout_minutes > 0,
         f"--distributed-timeout-minutes must be > 0 (got {p.distributed_timeout_minutes})")
    need(0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1,
         f"--adam-beta1 ({t.adam_beta1}) and --adam-beta2 ({t.adam_beta2}) must be in [0, 1)")
    need(t.adam_eps > 0 and m.norm_epsilon > 0,
         f"--adam-eps ({t.adam_eps}) and --norm-epsilon ({m.norm_epsilon}) must be > 0")
    need(0 <= t.sgd_momentum < 1, f"--sgd-momentum must be in [0, 1) (got {t.sgd_momentum})")
    need(m.init_method_std > 0, f"--init-method-std must be > 0 (got {m.init_method_std})")
    need(t.lr_wsd_decay_iters is None or t.lr_decay_style == "wsd",
         f"--lr-wsd-decay-iters applies to --lr-decay-style wsd, not {t.lr_decay_style}")
    if p.pipeline_method != "pipeoptim":
        need(p.pipeoptim_s_offset == 0 and not p.pipeoptim_extrapolate_weight_decay,
             f"--pipeoptim-s-offset and --pipeoptim-extrapolate-weight-decay apply to --pipeline-method pipeoptim, "
             f"not {p.pipeline_method}")
    need(p.pipeoptim_sgd_direction == "buffer" or t.optimizer == "sgd",
         f"--pipeoptim-sgd-direction {p.pipeoptim_sgd_direction} applies to --optimizer sgd, not {t.optimizer}")
    need(cfg.logging.peak_tflops is None or cfg.logging.peak_tflops > 0,
         f"--peak-tflops must be > 0 (got {cfg.logging.peak_tflops})")
    need(world_size % (tp * pp) == 0,
         f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
         f"--pipeline-model-parallel-size ({pp}) = {tp * pp}")
    dp = world_size // (tp * pp)
    need(m.hidden_size % m.num_attention_heads == 0,
         f"--hidden-size ({m.hidden_size}) is not divisible by --num-attention-heads ({m.num_attention_heads})")
    need(m.hidden_size % tp == 0,
         f"--hidden-size ({m.hidden_size}) is not divisible by --tensor-model-parallel-size ({tp})")
    need(m.num_attention_heads % tp == 0,
         f"--num-attention-heads ({m.num_attention_heads}) is not divisible by --tensor-model-parallel-size ({tp})")
    need(ffn_hidden_size(m) % tp == 0,
         f"the MLP hidden size ({ffn_hidden_size(m)}) is not divisible by --tensor-model-parallel-size ({tp})")
    if m.position_embedding_type == "rope":
        need((m.hidden_size // m.num_attention_heads) % 2 == 0, "RoPE needs an even head dimension")
    else:
        max_pos = m.max_position_embeddings or m.seq_length
        need(m.seq_length <= max_pos,
             f"--seq-length ({m.seq_length}) exceeds --max-position-embeddings ({max_pos})")
    need(0 <= m.hidden_dropout < 1 and 0 <= m.attention_dropout < 1, "dropout probabilities must be in [0, 1)")
    if p.sequence_parallel:
        need(m.seq_length % tp == 0,
             f"--sequence-parallel needs --seq-length ({m.seq_length}) divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        lpv = p.num_layers_per_virtual_pipeline_stage
        need(lpv >= 1, "--num-layers-per-virtual-pipeline-stage must be >= 1")
        need(m.num_layers % (pp * lpv) == 0,
             f"{layers_flag} ({m.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
             f"--num-layers-per-virtual-pipeline-stage ({lpv})")
    else:
        need(m.num_layers % pp == 0,
             f"{layers_flag} ({m.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    gbs = t.global_batch_size or t.micro_batch_size * dp
    need(gbs % (t.micro_batch_size * dp) == 0,
         f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size ({t.micro_batch_size}) x "
         f"data-parallel size ({dp})")
    num_mb = gbs // (t.micro_batch_size * dp)
    if virtual_pipeline_size(cfg) > 1:
        need(num_mb % pp == 0,
             f"interleaved pipeline (--num-layers-per-virtual-pipeline-stage) needs the number of micro-batches "
             f"({num_mb} = --global-batch-size / (--micro-batch-size x DP)) divisible by "
             f"--pipeline-model-parallel-size ({pp})")
    need(t.lr >= 0 and t.min_lr >= 0 and t.min_lr <= t.lr, f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    need(t.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
    if d.mock_data:
        need(d.vocab_size is not None or d.tokenizer_model is not None,
             "--mock-data needs --vocab-size (with --tokenizer-type NullTokenizer) or --tokenizer-model")
    else:
        need(len(d.data_path) > 0, "--data-path is required (or --mock-data for synthetic data)")
        if len(d.data_path) > 1:
            need(len(d.data_path) % 2 == 0,
                 "--data-path with several datasets takes weight/prefix pairs: '0.3 A 0.7 B'")
            for w in d.data_path[::2]:
                try:
                    float(w)
                except ValueError:
                    raise ConfigError(f"--data-path weight {w!r} is not a number ('0.3 A 0.7 B')") from None
        from megatron_po.data.gpt_dataset import parse_split
        try:
            parse_split(d.split)
        except UserError as e:  # the data module's DataError: here a flag
            raise ConfigError(str(e)) from None
    if d.tokenizer_type == "SentencePieceTokenizer" and not (d.mock_data and d.vocab_size):
        need(d.tokenizer_model is not None, "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
    if d.tokenizer_type == "NullTokenizer":
        need(d.vocab_size is not None and d.vocab_size > 0, "--tokenizer-type NullTokenizer needs --vocab-size")
    pr = cfg.precision
    from megatron_po.optim.mixed_precision import validate_precision_flags
    validate_precision_flags(pr.bf16, pr.fp16, pr.accumulate_allreduce_grads_in_fp32, pr.loss_scale,
                             pr.initial_loss_scale, pr.min_loss_scale, pr.loss_scale_window, pr.hysteresis,
                             pr.use_distributed_optimizer, pr.overlap_param_gather)
    if p.pipeline_method in ASYNC_METHODS:
        meth, k = p.pipeline_method, p.async_update_interval
        need(not pr.overlap_param_gather or meth in ("pipeoptim", "spectrain"),
             f"--overlap-param-gather applies to the synchronous methods, pipeoptim and spectrain: --pipeline-method "
             f"{meth} swaps weights (stashing) outside the forward, where a pending all-gather would still be "
             f"writing them")
        need(k >= 1, f"--async-update-interval must be >= 1 (got {k})")
        drain = p.async_drain_interval
        if drain is not None:
            need(drain >= 1, f"--async-drain-interval must be >= 1 (got {drain})")
            for flag, every in [("--save-interval", cfg.checkpoint.save_interval),
                                ("--exit-interval", t.exit_interval)]:
                need(every is None or every % drain == 0,
                     f"{flag} ({every}) must be a multiple of --async-drain-interval ({drain}): an asynchronous "
                     f"stream is checkpointed and left only where it drains")
        need(m.untie_embeddings_and_output_weights,
             f"--pipeline-method {meth} is asynchronous: stages step independently, so tied input/output "
             f"embeddings cannot stay equal; add --untie-embeddings-and-output-weights")
        need(num_mb % k == 0, f"--async-update-interval ({k}) must divide the micro-batches per iteration ({num_mb})")
        if meth == "spectrain":
            need(t.optimizer == "sgd" and t.sgd_momentum > 0,
                 f"--pipeline-method spectrain predicts from the momentum buffer: it needs --optimizer sgd with "
                 f"--sgd-momentum > 0 (got --optimizer {t.optimizer})")
        if meth == "pipedream-2bw":
            need(k >= pp, f"--pipeline-method pipedream-2bw accumulates m >= D micro-batches per update: "
                          f"--async-update-interval ({k}) must be >= --pipeline-model-parallel-size ({pp})")
        if meth != "pipeoptim":
            for flag, given in [("--weight-predictor", p.weight_predictor != "linear"),
                                ("--prediction-horizon", p.prediction_horizon != "full"),
                                ("--rollout-gradient", p.rollout_gradient != "first-moment")]:
                need(not given, f"{flag} applies to --pipeline-method pipeoptim, not {meth}")
        need(p.rollout_gradient == "first-moment" or p.weight_predictor == "rollout",
             "--rollout-gradient applies to --weight-predictor rollout")
        need(p.weight_predictor != "rollout" or t.optimizer in ("adam", "adamw", "sgd"),
             f"--weight-predictor rollout knows the recurrences of adam, adamw and sgd, not --optimizer {t.optimizer}")
        need(p.weight_predictor != "rollout" or t.optimizer != "sgd" or p.pipeoptim_sgd_direction == "buffer",
             "--weight-predictor rollout with --optimizer sgd rolls the momentum buffer: use "
             "--pipeoptim-sgd-direction buffer")
        dc = p.delay_compensation_lambda
        need(dc >= 0, f"--delay-compensation-lambda must be >= 0 (got {dc})")
        if dc > 0:
            need(meth in ("pipedream", "pipeoptim"),
                 f"--delay-compensation-lambda needs the weights each forward ran on: pipedream (its stash) or "
                 f"pipeoptim (keeps the predicted weights), not {meth}")
            need(k == 1, f"--delay-compensation-lambda corrects each micro-batch's gradient on its own: it needs "
                         f"--async-update-interval 1 (got {k})")
            need(not pr.use_distributed_optimizer,
                 "--delay-compensation-lambda edits the gradients after the backward, which the distributed "
                 "optimizer has already reduce-scattered: drop --use-distributed-optimizer")
        need(not p.delay_compensation_adaptive or dc > 0, "--delay-compensation-adaptive needs --delay-compensation-lambda > 0")
    elif p.async_drain_interval is not None:
        raise ConfigError(f"--async-drain-interval applies to asynchronous methods, not --pipeline-method "
                          f"{p.pipeline_method} (synchronous methods flush every iteration)")
    elif p.async_update_interval != 1:
        raise ConfigError(f"--async-update-interval applies to asynchronous methods, not --pipeline-method "
                          f"{p.pipeline_method} (synchronous methods step once per global batch)")
    if p.pipeline_method not in ASYNC_METHODS:
        for flag, given in [("--weight-predictor", p.weight_predictor != "linear"),
                            ("--prediction-horizon", p.prediction_horizon != "full"),
                            ("--rollout-gradient", p.rollout_gradient != "first-moment"),
                            ("--delay-compensation-lambda", p.delay_compensation_lambda != 0),
                            ("--delay-compensation-adaptive", p.delay_compensation_adaptive),
                            ("--staleness-lr-scaling", p.staleness_lr_scaling != "none")]:
            need(not given, f"{flag} applies to asynchronous pipeline methods, not --pipeline-method "
                            f"{p.pipeline_method}")
    if cfg.checkpoint.save_interval is not None:
        need(cfg.checkpoint.save is not None, "--save-interval needs --save")
        need(cfg.checkpoint.save_interval >= 1, "--save-interval must be >= 1")
    ck = cfg.checkpoint
    if ck.keep_last is not None:
        need(ck.save is not None, "--keep-last needs --save")
        need(ck.keep_last >= 1, f"--keep-last must be >= 1 (got {ck.keep_last})")
    for flag, given in [("--ckpt-step", ck.ckpt_step is not None), ("--finetune", ck.finetune),
                        ("--no-load-optim", ck.no_load_optim), ("--no-load-rng", ck.no_load_rng)]:
        need(not given or ck.load is not None, f"{flag} needs --load")
    if ck.ckpt_step is not None:
        need(ck.ckpt_step >= 0, f"--ckpt-step must be >= 0 (got {ck.ckpt_step})")
    validate_transformer_engine(cfg, workload)
    if workload == "nmt":
        validate_nmt(cfg)


def validate_transformer_engine(cfg: Config, workload: str) -> None:
    """--transformer-impl and --fp8-*: flag rules, FP8's shape rules, and whether TE can be imported
    (one line on every rank before any process group exists, instead of a failure inside model build)."""
    m, p = cfg.model, cfg.parallel

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    if m.fp8_format is not None:
        need(m.transformer_impl == "transformer_engine",
             f"--fp8-format {m.fp8_format} needs --transformer-impl transformer_engine (FP8 GEMMs are Transformer "
             f"Engine's)")
        need(m.fp8_amax_history_len >= 1, f"--fp8-amax-history-len must be >= 1 (got {m.fp8_amax_history_len})")
        need(m.fp8_margin >= 0, f"--fp8-margin must be >= 0 (got {m.fp8_margin})")
        tp, f = p.tensor_model_parallel_size, ffn_hidden_size(m)
        # TE's FP8 GEMMs need the last dim of every operand divisible by 16 and the others' product by 8.
        need(m.hidden_size % 16 == 0 and (m.hidden_size // tp) % 16 == 0 and (f // tp) % 16 == 0,
             f"--fp8-format needs --hidden-size ({m.hidden_size}) and the hidden and MLP sizes per TP rank "
             f"({m.hidden_size // tp}, {f // tp}) divisible by 16")
        seq = m.seq_length // tp if p.sequence_parallel else m.seq_length
        tokens = seq * cfg.training.micro_batch_size
        need(tokens % 8 == 0, f"--fp8-format needs the tokens of a micro-batch per rank ({tokens}: sequence "
                              f"{seq} x --micro-batch-size {cfg.training.micro_batch_size}) divisible by 8")
    if m.transformer_impl == "transformer_engine":
        need(workload == "gpt", "--transformer-impl transformer_engine is wired for GPT (pretrain_gpt.py) only "
                                "so far; the NMT model runs with --transformer-impl local")
        from megatron_po.models.te_transformer import import_te
        import_te()


def normalize_nmt(cfg: Config) -> Config:
    """pretrain_nmt.py's reading of the layer flags: the encoder and decoder depths default to --num-layers
    (Megatron's T5 convention), and `model.num_layers` becomes their sum, the stacked layer count that the
    pipeline splits (encoder layers 0..Le-1, then decoder layers). Idempotent: both depths are explicit
    afterwards, so a saved config normalizes to itself."""
    n = cfg.nmt
    if n.encoder_num_layers is None:
        n.encoder_num_layers = cfg.model.num_layers
    if n.decoder_num_layers is None:
        n.decoder_num_layers = cfg.model.num_layers
    cfg.model.num_layers = n.encoder_num_layers + n.decoder_num_layers
    if n.decoder_seq_length is None:
        n.decoder_seq_length = cfg.model.seq_length
    return cfg


def validate_nmt(cfg: Config) -> None:
    """The rules of the encoder-decoder workload (on a config `normalize_nmt` has seen)."""
    m, n, d = cfg.model, cfg.nmt, cfg.data

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    need(n.encoder_num_layers is not None and n.encoder_num_layers >= 1 and n.decoder_num_layers >= 1,
         f"--encoder-num-layers ({n.encoder_num_layers}) and --decoder-num-layers ({n.decoder_num_layers}) "
         f"must be >= 1")
    need(n.decoder_seq_length >= 2, f"--decoder-seq-length must be >= 2 (got {n.decoder_seq_length})")
    if m.position_embedding_type == "learned_absolute":
        max_pos = m.max_position_embeddings or max(m.seq_length, n.decoder_seq_length)
        need(n.decoder_seq_length <= max_pos,
             f"--decoder-seq-length ({n.decoder_seq_length}) exceeds --max-position-embeddings ({max_pos})")
    need(not cfg.parallel.sequence_parallel,
         "--sequence-parallel is not supported by pretrain_nmt.py (sentence lengths vary per batch)")
    need(not d.mock_data, "pretrain_nmt.py needs a parallel corpus: --data-path PREFIX from "
                          "tools/preprocess_nmt.py (--mock-data is GPT only)")
    need(len(d.data_path) == 1, f"pretrain_nmt.py takes one --data-path PREFIX (tools/preprocess_nmt.py's "
                                f"--output-prefix), got {len(d.data_path)} values")
    need(d.split == DataConfig().split, f"--split ({d.split}) does not apply to pretrain_nmt.py: "
                                        f"tools/preprocess_nmt.py splits the corpus by documents")
    need(d.tokenizer_type == "SentencePieceTokenizer",
         "pretrain_nmt.py needs --tokenizer-type SentencePieceTokenizer (it uses its <s>, </s> and <pad> ids)")
    need(n.src_lang != n.tgt_lang, f"--src-lang and --tgt-lang are both {n.src_lang!r}")
    separate = n.tgt_tokenizer_model is not None and n.tgt_tokenizer_model != d.tokenizer_model
    need(not separate or n.untie_encoder_decoder_embeddings,
         "--tgt-tokenizer-model gives the target its own vocabulary: add --untie-encoder-decoder-embeddings")
    need(0.0 <= n.label_smoothing < 1.0, f"--label-smoothing must be in [0, 1) (got {n.label_smoothing})")
    if n.max_tokens is not None:
        longest = max(m.seq_length, n.decoder_seq_length)
        need(n.max_tokens >= longest,
             f"--max-tokens ({n.max_tokens}) must hold one sentence of the longest allowed length "
             f"(max(--seq-length, --decoder-seq-length) = {longest})")
    if n.eval_bleu_sentences is not None:
        need(n.eval_bleu_sentences >= 0, f"--eval-bleu-sentences must be >= 0 (got {n.eval_bleu_sentences})")
