"""Set-up of a training run, in the order `pretrain` calls it: the flags checked and the process groups
built (`initialize`), this rank's model and optimizer (`build_model`: DDP-wrapped chunks, or this rank of
an asynchronous pipeline), the datasets (`build_datasets`) and the resume from a checkpoint (`resume`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po import rank_watchdog
from megatron_po.async_training import build_async_engine
from megatron_po.config import (Config, fsdp2_reshard_after_forward, is_async, num_microbatches, uses_fsdp2,
                                virtual_pipeline_size)
from megatron_po.config_recipe_rules import recipe_notes
from megatron_po.config_rules import validate
from megatron_po.distributed.checkpoint_format import find_checkpoint
from megatron_po.distributed.checkpoint_load import load_checkpoint
from megatron_po.distributed.ddp import DistributedDataParallel
from megatron_po.distributed.fsdp import FullyShardedDataParallel, fsdp_precision, local_shard, shard_chunks
from megatron_po.errors import ConfigError, UserError
from megatron_po.layer_split import split_summary
from megatron_po.models.fp8 import fp8_summary
from megatron_po.models.mla import mla_summary
from megatron_po.models.moe.rules import moe_summary, no_op_switches_line
from megatron_po.optim import build_optimizer
from megatron_po.optim.build import precision_aware_kwargs
from megatron_po.optim.clip_grads import expert_norm_group
from megatron_po.optim.distributed_optimizer import DistributedOptimizer
from megatron_po.optim.fsdp_optimizer import FSDPOptimizer
from megatron_po.optim.mixed_precision import (MixedPrecisionOptimizer, build_grad_scaler, grad_buffer_dtype,
                                               model_dtype)
from megatron_po.optim.muon import muon_kwargs, optimizer_param_groups
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.output_paths import prepare_outputs
from megatron_po.run_rules import check_resume_iteration, load_plan, no_validation_warning
from megatron_po.tensor_parallel import model_parallel_seed
from megatron_po.training_log import print_rank0
from megatron_po.training_step import Trainable, TrainState


# Run settings, not architecture: --use-checkpoint-args leaves these as given (Megatron copies neither).
NOT_CHECKPOINT_ARGS = ("hidden_dropout", "attention_dropout", "transformer_impl", "fp8_format", "fp8_recipe",
                       "fp8_backend", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "torch_compile")


def apply_checkpoint_args(cfg: Config) -> Config:
    """--use-checkpoint-args: a copy of `cfg` whose model-architecture flags are the ones saved in the checkpoint
    --load names (read in this process alone, before any process group); without a checkpoint there the
    given flags stay, as in Megatron."""
    import copy
    import dataclasses as dc

    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    ck = cfg.checkpoint
    if not os.path.isdir(ck.load) or find_checkpoint(ck.load, ck.ckpt_step) is None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"> --use-checkpoint-args: no checkpoint in {ck.load}; using the given flags", flush=True)
        return cfg
    _, extra, _ = read_full_checkpoint(ck.load, ck.ckpt_step, prefix="\0", progress=False)  # extra only
    saved = extra.get("config", {}).get("model", {})
    cfg = copy.deepcopy(cfg)
    names = {f.name for f in dc.fields(cfg.model)}
    for k, v in saved.items():
        if k in names and k not in NOT_CHECKPOINT_ARGS:
            setattr(cfg.model, k, v)
    return cfg


def with_train_iters(cfg: Config, train_iters: int) -> Config:
    """A copy of `cfg` whose --train-iters is the run's iteration count (from --train-samples, as Megatron
    sets args.train_iters), so the loop, intervals and logs read one number."""
    if train_iters == cfg.training.train_iters:
        return cfg
    import copy
    cfg = copy.deepcopy(cfg)
    cfg.training.train_iters = train_iters
    return cfg


def set_logging_level(cfg: Config) -> int | None:
    """--logging-level, else the MEGATRON_LOGGING_LEVEL environment variable (Megatron's order), on Python's root
    logger; the level set, or None (left as it is)."""
    import logging
    level = cfg.logging.logging_level
    env = os.environ.get("MEGATRON_LOGGING_LEVEL")
    if level is None and env is not None:
        try:
            level = int(env)
        except ValueError:
            raise ConfigError(f"MEGATRON_LOGGING_LEVEL={env!r} is not an integer logging level (e.g. 40 = ERROR); "
                            f"--logging-level overrides it") from None
    if level is not None:
        logging.getLogger().setLevel(level)
    return level


def initialize(cfg: Config, workload) -> tuple[Config, SampleSchedule]:
    """The flags checked (before the process group: every rank says the same line; then against the real
    world size), the process groups and the watchdog, the output paths, the seeds. Returns the run's config
    (--use-checkpoint-args applied, --train-iters from --train-samples; `workload.cfg` is set to it) and its
    sample schedule (batch, consumed samples and lr of every iteration)."""
    if cfg.checkpoint.use_checkpoint_args:
        cfg = apply_checkpoint_args(cfg)
        workload.cfg = cfg
    env_world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    validate(cfg, env_world, workload.name)
    set_logging_level(cfg)
    if cfg.training.deterministic:
        ps.set_deterministic()
    ps.init_distributed(cfg.parallel.distributed_timeout_minutes, backend=cfg.parallel.distributed_backend)
    world = dist.get_world_size()
    validate(cfg, world, workload.name)
    schedule = SampleSchedule(cfg, world)  # batch, consumed samples and lr of every iteration
    cfg = with_train_iters(cfg, schedule.train_iters)  # --train-samples -> iterations, as Megatron does
    workload.cfg = cfg
    p = cfg.parallel
    ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 virtual_pipeline_size(cfg) if p.num_layers_per_virtual_pipeline_stage
                                 or virtual_pipeline_size(cfg) > 1 else None,
                                 context_parallel_size=p.context_parallel_size)
    if cfg.model.num_experts is not None:  # MoE: the expert groups, carved from the DP x CP ranks
        ps.initialize_expert_parallel(p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    rank_watchdog.start_watchdog()  # a dead rank stops every rank within the timeout, named (stopped in run_main)
    prepare_outputs(cfg, log=print_rank0)  # writable output paths, the --save lock: before any model or resume
    torch.manual_seed(cfg.training.seed)
    model_parallel_seed(cfg.training.seed)
    return cfg, schedule


def split_decoupled(groups: list[dict], chunks) -> list[dict]:
    """--decoupled-lr: the input word embedding and output layer weights (Megatron's
    is_embedding_or_output_parameter; the last stage's copy of a tied embedding too, and the MTP block's, which
    must step as the embedding it copies) in groups of their own, marked "decoupled", each keeping its weight
    decay."""
    ids = set()
    for c in chunks:
        for embedding in (getattr(c, "embedding", None), getattr(getattr(c, "mtp", None), "embedding", None)):
            if embedding is not None:
                ids.add(id(embedding.word_embeddings.weight))
        if getattr(c, "output_layer", None) is not None:
            ids.add(id(c.output_layer.weight))
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in ids]
        mine = [p for p in g["params"] if id(p) in ids]
        out += [{**g, "params": rest}] if rest else []
        out += [{**g, "params": mine, "decoupled": True}] if mine else []
    return out


def build_optimizer_for(cfg: Config, chunks, ddp):
    """The plain predictive optimizer (fp32), or the wrapper holding fp32 main params: mixed precision,
    and/or the distributed optimizer that shards them over data-parallel ranks."""
    t, pr = cfg.training, cfg.precision

    def inner(groups):
        return build_optimizer(t.optimizer, groups, lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                               adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, sgd_momentum=t.sgd_momentum,
                               **muon_kwargs(t), nadam_momentum_decay=t.nadam_momentum_decay,
                               compile_step=cfg.model.torch_compile, **precision_aware_kwargs(t))

    groups = optimizer_param_groups(t.optimizer, chunks, t.weight_decay)
    if t.decoupled_lr is not None:
        groups = split_decoupled(groups, chunks)
    scaler = build_grad_scaler(pr.fp16, pr.loss_scale, pr.initial_loss_scale, pr.min_loss_scale,
                               pr.loss_scale_window, pr.hysteresis)
    if uses_fsdp2(cfg):  # the fp32 shards are the main params (optim/fsdp_optimizer.py)
        experts = cfg.model.num_experts is not None
        return FSDPOptimizer(inner, groups, scaler, t.clip_grad, ps.get_data_parallel_group(with_context_parallel=True),
                             ps.get_model_parallel_group(), expert_group=expert_norm_group(cfg),
                             expert_shard_group=ps.get_expert_data_parallel_group() if experts else None,
                             model_order=ddp.params)
    if pr.use_distributed_optimizer:
        return DistributedOptimizer(inner, groups, ddp, scaler, t.clip_grad, ps.get_model_parallel_group(),
                                    expert_group=expert_norm_group(cfg))
    if pr.bf16 or pr.fp16:
        return MixedPrecisionOptimizer(inner, groups, scaler, t.clip_grad, ps.get_model_parallel_group(),
                                       expert_group=expert_norm_group(cfg))
    return inner(groups)



def data_parallel(cfg: Config, chunks: list) -> tuple[list, object]:
    """This rank's model chunks and their data-parallel wrapper (synchronous methods): FSDP2 (fp32 shards over
    DP x CP, gathered in the model dtype: distributed/fsdp.py), else DDP's gradient buffers (the chunks in the
    model dtype; the distributed optimizer's sharded ones with --use-distributed-optimizer)."""
    pr, p = cfg.precision, cfg.parallel
    if uses_fsdp2(cfg):
        chunks = shard_chunks(chunks, fsdp2_reshard_after_forward(cfg), fsdp_precision(pr))
        return chunks, FullyShardedDataParallel(chunks)
    chunks = [c.to(model_dtype(pr.bf16, pr.fp16)) for c in chunks]
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)  # gradients averaged over DP x CP
    ddp = DistributedDataParallel(chunks, dp_cp_group, p.ddp_bucket_size,
                                  grad_dtype=grad_buffer_dtype(pr.bf16, pr.fp16, pr.accumulate_allreduce_grads_in_fp32),
                                  use_distributed_optimizer=pr.use_distributed_optimizer,
                                  overlap_param_gather=pr.overlap_param_gather)
    return chunks, ddp


def build_model(cfg: Config, workload, schedule: SampleSchedule) -> Trainable:
    """This rank's model chunks and optimizer: wrapped in DDP (synchronous methods), or inside this rank of
    an asynchronous pipeline, which builds its own chunks and one optimizer per chunk."""
    workload.setup()
    world, p = dist.get_world_size(), cfg.parallel
    if is_async(cfg):
        engine = build_async_engine(cfg, workload.padded_vocab, num_microbatches(cfg, world), workload, schedule)
        model = Trainable(engine.chunks, engine.stage.optimizers, engine=engine)
    else:
        chunks, ddp = data_parallel(cfg, workload.model_chunks())
        model = Trainable(chunks, build_optimizer_for(cfg, chunks, ddp), ddp)
        if cfg.model.transformer_impl == "transformer_engine":  # weights change only at steps, after a flush
            from megatron_po.models.te_transformer import enable_fp8_weight_cache
            enable_fp8_weight_cache(chunks)
    if fp8_summary(cfg.model):
        print_rank0(fp8_summary(cfg.model))  # which FP8 backend and recipe run, emulated or not
    n_params = sum(p.numel() for c in model.chunks for p in c.parameters())
    held = sum(local_shard(p).numel() for c in model.chunks for p in c.parameters())  # FSDP2: its shards
    whole = f" (FSDP2 shards of {n_params / 1e6:.2f} M)" if uses_fsdp2(cfg) else ""
    cp = f" x CP {p.context_parallel_size}" if p.context_parallel_size > 1 else ""
    print_rank0(f"> rank 0 holds {held / 1e6:.2f} M parameters{whole}; world {world} = TP {p.tensor_model_parallel_size}"
                f"{cp} x DP {ps.get_data_parallel_world_size()} x PP {p.pipeline_model_parallel_size}; "
                f"pipeline method {p.pipeline_method}; device {ps.get_device()}")
    if split_summary(cfg, virtual_pipeline_size(cfg)):
        print_rank0(split_summary(cfg, virtual_pipeline_size(cfg)))
    if cfg.model.num_experts is not None:
        print_rank0(moe_summary(cfg))
    if cfg.model.multi_latent_attention:
        print_rank0(mla_summary(cfg.model, p.tensor_model_parallel_size))
    if no_op_switches_line(cfg.model):
        print_rank0(no_op_switches_line(cfg.model))
    for line in recipe_notes(cfg):
        print_rank0(line)
    return model


def build_datasets(cfg: Config, workload) -> tuple:
    """(train, valid) loaders. Real data is checked against the tokenizer's vocabulary (a token id >= vocab
    size is an error)."""
    train_ds, valid_ds, _ = workload.data()
    warning = no_validation_warning(cfg, valid_ds)  # e.g. --split 100,0,0: evaluation would silently not run
    if warning:
        print_rank0(warning)
    return train_ds, valid_ds


def resume(cfg: Config, model: Trainable) -> TrainState:
    """Where training starts. Auto-resume: relaunching the same command continues from the last checkpoint in
    --save (a --finetune run too: --finetune applies only while --save holds none of this run's checkpoints);
    --finetune loads the weights only and starts over at iteration 0 with a fresh optimizer."""
    state = TrainState()
    ck, t = cfg.checkpoint, cfg.training
    load_dir, finetune, ckpt_step = load_plan(ck, find_checkpoint)
    found = find_checkpoint(load_dir, ckpt_step) if load_dir and os.path.isdir(load_dir) else None
    if found is not None:
        # --finetune: the weights only; the run starts over at iteration 0 with a fresh optimizer.
        extra = load_checkpoint(load_dir, model.chunks, model.optimizer, step=found,
                                load_optim=not (ck.no_load_optim or finetune),
                                load_rng=not (ck.no_load_rng or finetune),
                                policy=model.policy if not finetune else None,
                                verify=not ck.no_verify_checkpoint,
                                strictness=ck.dist_ckpt_strictness or "raise_all")
        if not finetune:
            state = TrainState(**extra["train_state"])
            done = check_resume_iteration(state.iteration, t.train_iters, load_dir)  # past it: one line, exit 2
            if done:
                print_rank0(done)
            if model.engine is not None:
                model.engine.restore_progress(state.iteration * num_microbatches(cfg, dist.get_world_size()))
        print_rank0(f"> {'finetuning from' if finetune else 'resumed from'} {load_dir} iteration {found}; "
                    f"continuing at iteration {state.iteration}")
    elif ck.load:
        if not os.path.isdir(ck.load) and ck.load != ck.save:
            raise UserError(f"--load {ck.load}: no such directory")
        if finetune or ckpt_step is not None:
            raise UserError(f"--{'finetune' if finetune else 'ckpt-step'}: no checkpoint in {ck.load} to load")
        print_rank0(f"> no checkpoint in {ck.load} yet: starting from scratch")
    return state

