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

from megatron_po.errors import ConfigError


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
    pipeoptim_s_offset: int = _f(0, "PipeOptim: added to the schedule's staleness s (0 = paper, 1 = reference code)")
    pipeoptim_sgd_direction: str = _f("buffer", "PipeOptim with SGD momentum: the direction extrapolated",
                                      choices=["buffer", "lookahead"])
    pipeoptim_extrapolate_weight_decay: bool = _f(False, "PipeOptim: also extrapolate decoupled weight decay")
    ddp_bucket_size: int = _f(40_000_000, "DDP gradient bucket size in elements")
    distributed_timeout_minutes: float = _f(10.0, "timeout of collective and p2p operations")


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
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

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


def validate(cfg: Config, world_size: int) -> None:
    """Every cross-flag rule, checked before any process group exists."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    for name, value in [("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--micro-batch-size", t.micro_batch_size), ("--train-iters", t.train_iters),
                        ("--log-interval", cfg.logging.log_interval), ("--eval-interval", t.eval_interval)]:
        need(value >= 1, f"{name} must be >= 1 (got {value})")
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
             f"--num-layers ({m.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
             f"--num-layers-per-virtual-pipeline-stage ({lpv})")
    else:
        need(m.num_layers % pp == 0,
             f"--num-layers ({m.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
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
        need(not (pr.fp16 or pr.use_distributed_optimizer),
             f"--pipeline-method {meth} supports fp32 and --bf16; --fp16 (a loss scale that may change between a "
             f"micro-batch's forward and backward) and --use-distributed-optimizer are supported with the "
             f"synchronous methods (gpipe, 1f1b) for now")
        need(k >= 1, f"--async-update-interval must be >= 1 (got {k})")
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
    elif p.async_update_interval != 1:
        raise ConfigError(f"--async-update-interval applies to asynchronous methods, not --pipeline-method "
                          f"{p.pipeline_method} (synchronous methods step once per global batch)")
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
    need(not (cfg.precision.use_distributed_optimizer and (ck.save or ck.load)),
         "--save/--load with --use-distributed-optimizer are not supported yet (its optimizer state is sharded "
         "over data-parallel ranks in flat ranges, not by parameter)")
