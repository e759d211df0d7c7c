"""The training loop: set-up, iterations, evaluation, checkpoints and logging.

One iteration consumes one global batch (`micro_batch x num_microbatches x DP` samples): each DP rank
runs forward/backward over its `num_microbatches` micro-batches (gradients accumulated locally, the
DP all-reduce overlapping the last backward), then the gradients are clipped by their global norm and
the optimizer steps with the lr of the schedule.

Data order follows Megatron's pretraining sampler: global batch `g` holds samples
`[g*G, (g+1)*G)`; micro-batch `m` of DP rank `d` holds `mbs` samples starting at
`g*G + m*mbs*DP + d*mbs`. So a DP=2 run sees, in total, the same samples per step as one process.
Every TP rank reads the same samples itself (deterministic indexing) instead of receiving a broadcast.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, global_batch_size, is_async, num_microbatches, update_interval, validate
from megatron_po.data.document_masks import add_document_inputs
from megatron_po.distributed import launcher_death, save_lock
from megatron_po.distributed.checkpoint_format import find_checkpoint
from megatron_po.distributed.checkpoint_load import load_checkpoint
from megatron_po.distributed.checkpoint_save import save_checkpoint
from megatron_po.distributed.ddp import (DistributedDataParallel, allreduce_embedding_grads,
                                         allreduce_sequence_parallel_grads)
from megatron_po.errors import ConfigError, DataError, SaveError, UserError
from megatron_po.monitor import device_peak_tflops, memory_gb, timers
from megatron_po.models.gpt import GPTModel
from megatron_po.optim import build_optimizer
from megatron_po.optim.muon import muon_kwargs, optimizer_param_groups
from megatron_po.optim.clip_grads import clip_grad_norm_
from megatron_po.optim.distributed_optimizer import DistributedOptimizer
from megatron_po.optim.mixed_precision import (MainParamsOptimizer, MixedPrecisionOptimizer, build_grad_scaler,
                                               grad_buffer_dtype, model_dtype)
from megatron_po.optim.lr_scheduler import set_lr
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.output_paths import prepare_outputs
from megatron_po.run_controls import RunControls, replica_sums
from megatron_po.run_rules import (SkipGuard, any_rank, check_resume_iteration, launcher_rank, load_plan,
                                   loss_is_nonfinite, no_validation_warning)
from megatron_po.tensor_parallel import model_parallel_seed, pad_vocab_size

# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------


def gpt_flops_per_token(cfg: Config, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron's dense convention.

    Per layer and token the forward does 2 FLOPs per multiply-add of: QKV (3h^2), attention output
    (h^2), MLP (2 h f, or 3 h f with SwiGLU), and attention scores + weighted values (2 s h, counting
    the full s x s square as Megatron does, although causal masking needs only half). Plus the output
    layer (h V). With f = 4h and no SwiGLU this is Megatron's 72 L h^2 (1 + s/(6h) + V/(12 L h)) per
    token.
    """
    from megatron_po.config import ffn_hidden_size, kv_channels, num_query_groups
    m = cfg.model
    h, s, L, f = m.hidden_size, m.seq_length, m.num_layers, ffn_hidden_size(m)
    mlp = (3 if m.swiglu else 2) * h * f
    # Attention with a = heads x head dim (h by default) and g = key/value groups x head dim (GQA): QKV h (a + 2g),
    # output a h, scores + weighted values 2 s a; 4h^2 + 2 s h without GQA and --kv-channels.
    a, g = m.num_attention_heads * kv_channels(m), num_query_groups(m) * kv_channels(m)
    per_layer = 2 * (h * (a + 2 * g) + a * h + mlp + 2 * s * a)
    return 3.0 * (L * per_layer + 2 * h * vocab_size)


def nmt_flops_per_sample(hidden_size: int, ffn_hidden_size: int, encoder_num_layers: int, decoder_num_layers: int,
                         src_length: int, tgt_length: int, vocab_size: int, swiglu: bool = False) -> float:
    """Training FLOPs of one (source, target) pair of an encoder-decoder transformer, the same dense
    convention as `gpt_flops_per_token` (2 FLOPs per multiply-add, x 3 for forward + backward).

    Encoder layer, per source token: QKV + output (4 h^2), MLP (2 h f or 3 h f), self-attention scores
    + weighted values (2 S h, bidirectional: the full square is the real work).
    Decoder layer, per target token: self-attention like the GPT layer (4 h^2 + 2 T h, full T x T square
    although causal), cross-attention query + output (2 h^2) and scores + weighted values over the
    source (2 S h), MLP; plus, per source token, the cross-attention key/value projection of the
    encoder output (2 h^2). Output layer: h V per target token. With S = T, no encoder and no
    cross-attention this is `gpt_flops_per_token` x T.
    """
    h, f, S, T = hidden_size, ffn_hidden_size, src_length, tgt_length
    mlp = (3 if swiglu else 2) * h * f
    encoder = encoder_num_layers * S * (4 * h * h + mlp + 2 * S * h)
    decoder = decoder_num_layers * (T * (4 * h * h + 2 * T * h + 2 * h * h + 2 * S * h + mlp) + S * 2 * h * h)
    return 3.0 * 2 * (encoder + decoder + T * h * vocab_size)


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------


# Run settings, not architecture: --use-checkpoint-args leaves these as given (Megatron copies neither).
NOT_CHECKPOINT_ARGS = ("hidden_dropout", "attention_dropout", "transformer_impl", "fp8_format", "fp8_margin",
                       "fp8_amax_history_len", "fp8_amax_compute_algo")


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


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


def build_model_chunks(cfg: Config, padded_vocab: int) -> list:
    """This rank's model chunks (one without pipeline parallelism)."""
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1 or cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        from megatron_po.pipeline.partition import build_pipeline_chunks
        return build_pipeline_chunks(cfg, padded_vocab)
    model = GPTModel(cfg.model, padded_vocab, cfg.training.seed,
                     sequence_parallel=cfg.parallel.sequence_parallel).to(ps.get_device())
    return [model]


def build_data(cfg: Config, tokenizer_vocab_size: int):
    from megatron_po.data.gpt_dataset import build_gpt_datasets
    t = cfg.training
    world = dist.get_world_size()
    gbs = global_batch_size(cfg, world)
    # Validation restarts from its first sample at every evaluation, so numbers compare across evals.
    num_samples = (SampleSchedule(cfg, world).total_samples, t.eval_iters * gbs, t.eval_iters * gbs)
    train, valid, test = build_gpt_datasets(
        cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed, num_samples,
        cache_dir=cfg.data.data_cache_path, mock=cfg.data.mock_data, vocab_size=tokenizer_vocab_size,
        mmap_bin_files=cfg.data.mmap_bin_files)
    from megatron_po.data.data_loader import MicroBatchLoader
    return tuple(None if ds is None else MicroBatchLoader(
        ds, t.micro_batch_size, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
        cfg.data.num_workers, cfg.data.dataloader_type, t.seed) for ds in (train, valid, test))


def microbatches(dataset, consumed_samples: int, num_mb: int, mbs: int):
    """This DP rank's micro-batches of the global batch that starts at `consumed_samples` (`dataset`: a
    data_loader.MicroBatchLoader, or a plain dataset read in order)."""
    from megatron_po.data.data_loader import MicroBatchLoader
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    loader = dataset if isinstance(dataset, MicroBatchLoader) else MicroBatchLoader(dataset, mbs, d, dp)
    device = ps.get_device()
    return [{k: v.to(device) for k, v in loader.microbatch(consumed_samples + m * mbs * dp).items()}
            for m in range(num_mb)]


def reading_documents(cfg: Config, chunks: list) -> list:
    """--reset-position-ids / --reset-attention-mask: every stage needs the micro-batch's document positions
    (RoPE, the mask), so the executor hands each chunk the batch (`reads_batch`, as for NMT)."""
    if cfg.data.reset_position_ids or cfg.data.reset_attention_mask:
        for c in chunks:
            c.reads_batch = True
    return chunks


class GPTWorkload:
    """What the loop needs to know about the model and data it trains; `pretrain` talks to GPT through
    this, and to the encoder-decoder translation model through `nmt_workload.NMTWorkload` (same methods).
    Built before the process groups (`name` picks the config rules); `setup()` runs after them."""

    name = "gpt"
    eval_in_stream = True  # asynchronous pipelines evaluate between training ops (no evaluate_extra to run)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        """Tokenizer and padded vocabulary (TP-dependent padding)."""
        from megatron_po.data.tokenizer import build_tokenizer
        d = self.cfg.data
        self.tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_size, d.vocab_file, d.merge_file)
        self.padded_vocab = pad_vocab_size(self.tokenizer.vocab_size, self.cfg.model.make_vocab_size_divisible_by,
                                           self.cfg.parallel.tensor_model_parallel_size)

    def model_chunks(self) -> list:
        return reading_documents(self.cfg, build_model_chunks(self.cfg, self.padded_vocab))

    @staticmethod
    def chunks_for_rank(cfg: Config, padded_vocab, rank: int, num_stages: int, num_chunks: int, device=None):
        """Any pipeline rank's chunks (the asynchronous engine builds its own)."""
        from megatron_po.pipeline.partition import build_chunks_for_rank
        return reading_documents(cfg, build_chunks_for_rank(cfg, padded_vocab, rank, num_stages, num_chunks, device))

    def data(self):
        """(train, valid, test); real data is checked against the tokenizer's vocabulary."""
        return build_data(self.cfg, self.tokenizer.vocab_size)

    def microbatches(self, dataset, consumed_samples: int, num_mb: int, mbs: int) -> list[dict]:
        batches = microbatches(dataset, consumed_samples, num_mb, mbs)
        d = self.cfg.data
        for b in batches:
            if d.eod_mask_loss:  # Megatron: no loss where the input token is EOD
                b["loss_mask"] = b["loss_mask"].masked_fill(b["tokens"] == self.tokenizer.eod, 0.0)
            add_document_inputs(b, self.tokenizer.eod, d.reset_position_ids, d.reset_attention_mask)
        return batches

    def message_specs(self, micro_batch_size: int):
        """Shapes both ends of a pipeline message agree on (None: sent in a header)."""
        from megatron_po.pipeline.partition import gpt_message_specs
        return gpt_message_specs(self.cfg, micro_batch_size)

    def eval_iters(self, valid) -> int:
        """Global batches of validation data per evaluation."""
        return self.cfg.training.eval_iters

    def tokens_per_iteration(self, gbs: int) -> float:
        return gbs * self.cfg.model.seq_length

    def flops_per_iteration(self, gbs: int) -> float:
        return gpt_flops_per_token(self.cfg, self.padded_vocab) * gbs * self.cfg.model.seq_length

    def evaluate_extra(self, chunks, iteration: int) -> dict:
        """Metrics beyond the validation loss, on the logging rank ({} elsewhere)."""
        return {}

    def checkpoint_extra(self) -> dict:
        return {"vocab_size": self.tokenizer.vocab_size, "padded_vocab_size": self.padded_vocab}


# --------------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------------


def forward_backward(cfg, chunks, ddp, batches, forward_only: bool = False,
                     grad_scale: float = 1.0, workload=None) -> torch.Tensor | None:
    """Loss averaged over this rank's micro-batches; gradients accumulated into the DDP buffer.

    Every layout runs through the pipeline executor: without pipelining it runs the "none" schedule
    (F0 B0 F1 B1 ..., plain gradient accumulation with the DP sync on the last backward).
    Returns the mean loss on the rank that holds it (None elsewhere). `workload` defaults to GPT.
    """
    from megatron_po.pipeline.executor import synchronous_forward_backward
    workload = workload or GPTWorkload(cfg)
    specs = workload.message_specs(next(iter(batches[0].values())).shape[0])  # dim 0 of any batch tensor
    return synchronous_forward_backward(cfg.parallel.pipeline_method, chunks, ddp, batches, forward_only, specs,
                                        grad_scale)


def per_token_normalizer(batches: list[dict]) -> None:
    """--calculate-per-token-loss: each micro-batch's loss becomes its summed token losses / (T / (M x DP)),
    T the loss tokens of the whole global batch (all micro-batches, all DP ranks), so the mean over the M
    micro-batches and DP replicas that the executor and DDP take is Megatron's sum / T."""
    local = torch.stack([b["loss_mask"].sum() for b in batches]).sum().to(torch.float64)
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    normalizer = (local / (len(batches) * ps.get_data_parallel_world_size())).clamp(min=1e-12).float()
    for b in batches:
        b["loss_normalizer"] = normalizer


def holds_loss(cfg: Config) -> bool:
    """This rank computes the loss: the last pipeline rank (ZB-V: rank 0, schedules.loss_rank)."""
    from megatron_po.pipeline.schedules import loss_rank
    D = ps.get_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank() == loss_rank(cfg.parallel.pipeline_method, D)


def logging_rank(cfg: Config) -> int:
    from megatron_po.pipeline.schedules import loss_rank
    return ps.rank_of(0, 0, loss_rank(cfg.parallel.pipeline_method, ps.get_pipeline_model_parallel_world_size()),
                      ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())


def average_over_dp(x: torch.Tensor | None) -> float | None:
    """Mean over data-parallel replicas of a loss held by the last pipeline stage."""
    if x is None:
        return None
    x = x.detach().clone().to(torch.float64)
    dist.all_reduce(x, group=ps.get_data_parallel_group())
    return float(x) / ps.get_data_parallel_world_size()


def train_step(cfg, chunks, ddp, optimizer, batches, lr: float, workload=None, decoupled_lr: float | None = None):
    """One synchronous iteration. Returns (loss on the last stage or None, grad norm or None when the
    step was skipped for inf/NaN gradients). `decoupled_lr`: the lr of the "decoupled" groups
    (--decoupled-lr: input embedding and output layer)."""
    wrapped = isinstance(optimizer, MainParamsOptimizer)
    ddp.zero_grad()
    with timers("forward-backward", 1):
        loss = forward_backward(cfg, chunks, ddp, batches, grad_scale=optimizer.get_loss_scale() if wrapped else 1.0,
                                workload=workload)
    with timers("grad-sync", 1):  # what the last backwards' DP reduce did not overlap, + SP/embedding grads
        ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(ddp.params)
        allreduce_embedding_grads(ddp.params)
    with timers("optimizer", 1):
        set_lr(optimizer, lr)
        if decoupled_lr is not None:
            for group in optimizer.param_groups:
                if group.get("decoupled"):
                    group["lr"] = decoupled_lr
        if wrapped:  # fp32 main params: unscale, skip on inf/NaN, clip and step inside (sharded or not)
            return loss, optimizer.step().grad_norm
        grad_norm = clip_grad_norm_(ddp.params, cfg.training.clip_grad, ps.get_model_parallel_group())
        if math.isfinite(grad_norm) or not cfg.training.check_for_nan_in_loss_and_grad:
            optimizer.step()  # else the run stops (check_finite) with the weights of the last good step
    return loss, grad_norm


class RankError(UserError):
    """A stop that only this rank sees (the others are stopped through the watchdog): printed here, not
    only on rank 0 as errors every rank raises alike are."""


def last_checkpoint(save_dir: str | None) -> str:
    """What a stop leaves behind, for its message (nothing is saved after a NaN/inf)."""
    found = find_checkpoint(save_dir) if save_dir else None
    return (f"nothing saved; the last good checkpoint is iteration {found} in {save_dir}" if found is not None
            else "nothing saved")


def check_finite(cfg, iteration: int, loss, grad_norm: float | None, ddp, save_dir: str | None) -> None:
    """--check-for-nan-in-loss-and-grad (bf16/fp32; fp16's loss scaler skips such steps instead): a NaN/inf
    gradient norm -- the same on every rank, agreed over the model-parallel group and equal across the
    data-parallel replicas -- stops the run before the step (train_step held it back), so every rank
    arrives here together and says which ranks and stages hold the non-finite loss or gradients."""
    if not cfg.training.check_for_nan_in_loss_and_grad or cfg.precision.fp16:
        return
    if grad_norm is not None and math.isfinite(grad_norm):
        return
    mine = []
    if loss is not None and not torch.isfinite(loss).all():
        mine.append(f"lm loss {float(loss)}")
    if not torch.isfinite(ddp.grad_buffer).all():
        mine.append("non-finite gradients")
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    where = "; ".join(f"{ps.describe_rank(r)}: {', '.join(what)}" for r, what in enumerate(found) if what)
    raise UserError(f"NaN/inf at iteration {iteration} (grad norm {grad_norm if grad_norm is not None else 'nan'}): "
                    f"{where or 'no rank holds a non-finite value after the reduction'}; stopped before the "
                    f"optimizer step, {last_checkpoint(save_dir)}")


def split_decoupled(groups: list[dict], chunks) -> list[dict]:
    """--decoupled-lr: the input word embedding and output layer weights (Megatron's
    is_embedding_or_output_parameter; the last stage's copy of a tied embedding too) in groups of their own,
    marked "decoupled", each keeping its weight decay."""
    ids = set()
    for c in chunks:
        if getattr(c, "embedding", None) is not None:
            ids.add(id(c.embedding.word_embeddings.weight))
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
                               **muon_kwargs(t), nadam_momentum_decay=t.nadam_momentum_decay)

    groups = optimizer_param_groups(t.optimizer, chunks, t.weight_decay)
    if t.decoupled_lr is not None:
        groups = split_decoupled(groups, chunks)
    scaler = build_grad_scaler(pr.fp16, pr.loss_scale, pr.initial_loss_scale, pr.min_loss_scale,
                               pr.loss_scale_window, pr.hysteresis)
    if pr.use_distributed_optimizer:
        return DistributedOptimizer(inner, groups, ddp, scaler, t.clip_grad, ps.get_model_parallel_group())
    if pr.bf16 or pr.fp16:
        return MixedPrecisionOptimizer(inner, groups, scaler, t.clip_grad, ps.get_model_parallel_group())
    return inner(groups)


@torch.no_grad()
def evaluate(cfg, chunks, ddp, valid, num_mb, workload=None):
    workload = workload or GPTWorkload(cfg)
    for c in chunks:
        c.eval()
    losses = []
    gbs = global_batch_size(cfg, dist.get_world_size())
    for k in range(workload.eval_iters(valid)):
        batches = workload.microbatches(valid, k * gbs, num_mb, cfg.training.micro_batch_size)
        loss = forward_backward(cfg, chunks, ddp, batches, forward_only=True, workload=workload)
        losses.append(average_over_dp(loss) if holds_loss(cfg) else None)
    for c in chunks:
        c.train()
    if not holds_loss(cfg):
        return None
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------


def truncate_metrics(path: str, iteration: int) -> None:
    """Keep a metrics file to the records of iterations <= `iteration`, where a run resumes: a killed run
    logged past its last checkpoint, and the resumed run logs those iterations again. A torn last line
    (killed mid-write) goes too. The file then reads as one uninterrupted run."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and record.get("iteration", 0) <= iteration:
            kept.append(line)
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


class Logger:
    """Console line, `--metrics-file` JSON lines, W&B and TensorBoard, from the rank that holds the loss.
    Every sink gets the same record; TensorBoard takes its numbers (keys such as `time/optimizer` and
    `staleness/stage0` group into sections there and in W&B)."""

    def __init__(self, cfg: Config, active: bool):
        self.active = active
        self.scalars_interval = cfg.logging.tensorboard_log_interval  # W&B / TensorBoard: every N-th iteration
        self.metrics_file = None
        self.wandb = None
        self.tensorboard = None
        if not active:
            return
        lc = cfg.logging
        pipeline = cfg.parallel.pipeline_model_parallel_size > 1  # the method is what the run compares
        if lc.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(lc.metrics_file)), exist_ok=True)
            self.metrics_file = open(lc.metrics_file, "a")
        if lc.wandb_project:
            import wandb
            self.wandb = wandb.init(project=lc.wandb_project, name=lc.wandb_exp_name, entity=lc.wandb_entity,
                                    dir=lc.wandb_save_dir, config=cfg.to_dict())
            if pipeline:
                self.wandb.summary["pipeline_method"] = cfg.parallel.pipeline_method
        if lc.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(lc.tensorboard_dir)
            self.tensorboard.add_text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2) + "\n```")
            if pipeline:
                self.tensorboard.add_text("pipeline_method", cfg.parallel.pipeline_method)

    def log(self, record: dict | None, line: str | None = None):
        if not self.active:
            return
        if line:
            print(line, flush=True)
        if record is None:
            return
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if record["iteration"] % self.scalars_interval != 0:
            return
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if k != "iteration"}, step=record["iteration"])
        if self.tensorboard:
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)):
                    self.tensorboard.add_scalar(k, v, record["iteration"])

    def close(self):
        if self.metrics_file:
            self.metrics_file.close()
        if self.wandb:
            self.wandb.finish()
        if self.tensorboard:
            self.tensorboard.close()


def print_rank0(msg: str):
    if dist.get_rank() == 0:
        print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------------


def pretrain(cfg: Config, workload=None) -> dict:
    """Run training as configured; returns the last logged record (on the logging rank).
    `workload`: what is trained (default `GPTWorkload(cfg)`; pretrain_nmt.py passes an NMTWorkload)."""
    workload = workload or GPTWorkload(cfg)
    start_time = time.time()  # --exit-duration-in-mins counts from here, as Megatron's _TRAIN_START_TIME
    if cfg.checkpoint.use_checkpoint_args:
        cfg = apply_checkpoint_args(cfg)
        workload.cfg = cfg
    env_world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    validate(cfg, env_world, workload.name)
    if cfg.training.deterministic:
        ps.set_deterministic()
    ps.init_distributed(cfg.parallel.distributed_timeout_minutes, backend=cfg.parallel.distributed_backend)
    world = dist.get_world_size()
    validate(cfg, world, workload.name)
    schedule = SampleSchedule(cfg, world)  # batch, consumed samples and lr of every iteration
    cfg = with_train_iters(cfg, schedule.train_iters)  # --train-samples -> iterations, as Megatron does
    workload.cfg = cfg
    p = cfg.parallel
    from megatron_po.config import virtual_pipeline_size
    ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 virtual_pipeline_size(cfg) if p.num_layers_per_virtual_pipeline_stage else None)
    ps.start_watchdog()  # a dead rank stops every rank within the timeout, named (stopped in run_main)
    prepare_outputs(cfg, log=print_rank0)  # writable output paths, the --save lock: before any model or resume
    t = cfg.training
    torch.manual_seed(t.seed)
    model_parallel_seed(t.seed)

    workload.setup()
    padded_vocab = workload.padded_vocab
    engine = ddp = None
    if is_async(cfg):
        engine = build_async_engine(cfg, padded_vocab, num_microbatches(cfg, world), workload, schedule)
        chunks, optimizer = engine.chunks, engine.stage.optimizers
    else:
        pr = cfg.precision
        chunks = [c.to(model_dtype(pr.bf16, pr.fp16)) for c in workload.model_chunks()]
        ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), p.ddp_bucket_size,
                                      grad_dtype=grad_buffer_dtype(pr.bf16, pr.fp16,
                                                                   pr.accumulate_allreduce_grads_in_fp32),
                                      use_distributed_optimizer=pr.use_distributed_optimizer,
                                      overlap_param_gather=pr.overlap_param_gather)
        optimizer = build_optimizer_for(cfg, chunks, ddp)
        if cfg.model.transformer_impl == "transformer_engine":  # weights change only at steps, after a flush
            from megatron_po.models.te_transformer import enable_fp8_weight_cache
            enable_fp8_weight_cache(chunks)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    print_rank0(f"> rank 0 holds {n_params / 1e6:.2f} M parameters; world {world} = TP {p.tensor_model_parallel_size}"
                f" x DP {ps.get_data_parallel_world_size()} x PP {p.pipeline_model_parallel_size}; "
                f"pipeline method {p.pipeline_method}; device {ps.get_device()}")

    # Real data is checked against the tokenizer's vocabulary (a token id >= vocab size is an error).
    train_ds, valid_ds, _ = workload.data()
    warning = no_validation_warning(cfg, valid_ds)  # e.g. --split 100,0,0: evaluation would silently not run
    if warning:
        print_rank0(warning)

    state = TrainState()
    ck = cfg.checkpoint
    # Auto-resume: relaunching the same command continues from the last checkpoint in --save (a --finetune
    # run too: --finetune applies only while --save holds none of this run's checkpoints).
    load_dir, finetune, ckpt_step = load_plan(ck, find_checkpoint)
    found = find_checkpoint(load_dir, ckpt_step) if load_dir and os.path.isdir(load_dir) else None
    if found is not None:
        # --finetune: the weights only; the run starts over at iteration 0 with a fresh optimizer.
        extra = load_checkpoint(load_dir, chunks, optimizer, step=found,
                                load_optim=not (ck.no_load_optim or finetune),
                                load_rng=not (ck.no_load_rng or finetune),
                                policy=engine.stage.policy if engine is not None and not finetune else None,
                                verify=not ck.no_verify_checkpoint)
        if not finetune:
            state = TrainState(**extra["train_state"])
            done = check_resume_iteration(state.iteration, t.train_iters, load_dir)  # past it: one line, exit 2
            if done:
                print_rank0(done)
            if engine is not None:
                engine.restore_progress(state.iteration * num_microbatches(cfg, world))
        print_rank0(f"> {'finetuning from' if finetune else 'resumed from'} {load_dir} iteration {found}; "
                    f"continuing at iteration {state.iteration}")
    elif ck.load:
        if not os.path.isdir(ck.load) and ck.load != ck.save:
            raise UserError(f"--load {ck.load}: no such directory")
        if finetune or ckpt_step is not None:
            raise UserError(f"--{'finetune' if finetune else 'ckpt-step'}: no checkpoint in {ck.load} to load")
        print_rank0(f"> no checkpoint in {ck.load} yet: starting from scratch")

    gbs = global_batch_size(cfg, world)
    num_mb = num_microbatches(cfg, world)
    mbs = t.micro_batch_size
    flops_per_iter = workload.flops_per_iteration(gbs)
    if dist.get_rank() == logging_rank(cfg) and cfg.logging.metrics_file:
        truncate_metrics(cfg.logging.metrics_file, state.iteration)  # what a killed run logged past its checkpoint
    logger = Logger(cfg, dist.get_rank() == logging_rank(cfg))
    progress = Progress(cfg, logger, gbs, flops_per_iter, world, workload.tokens_per_iteration(gbs), schedule)

    def save():
        progress.flush()  # records up to the checkpoint are on disk before it is (a resume rewrites the rest)
        save_checkpoint(ck.save, state.iteration, chunks, optimizer,
                        {"train_state": vars(state).copy(), "config": cfg.to_dict(), **workload.checkpoint_extra()},
                        policy=engine.stage.policy if engine is not None else None, keep_last=ck.keep_last,
                        save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng)
        print_rank0(f"> saved checkpoint at iteration {state.iteration} to {ck.save}")

    def evaluate_now() -> float | None:
        if valid_ds is None:
            return None
        if engine is None:
            return evaluate(cfg, chunks, ddp, valid_ds, num_mb, workload)
        losses = []
        for k in range(workload.eval_iters(valid_ds)):
            val = engine.evaluate(workload.microbatches(valid_ds, k * gbs, num_mb, mbs))
            losses.append(average_over_dp(torch.tensor(val)) if holds_loss(cfg) else None)
        return sum(losses) / len(losses) if holds_loss(cfg) else None

    def eval_due(it: int) -> bool:
        return it % t.eval_interval == 0 or it == t.train_iters

    def at_boundary(evaluated: bool = False) -> bool:
        """Evaluate / save / exit after the iteration just finished, as the intervals say (`evaluated`:
        the asynchronous stream has evaluated it already). Returns True when training must stop here
        (--exit-interval)."""
        it = state.iteration
        if eval_due(it) and not evaluated:
            val = evaluate_now()
            extra = workload.evaluate_extra(chunks, it)  # e.g. BLEU (every rank takes part)
            if val is not None:
                progress.log_validation(it, val, extra)
        saved = False
        if ck.save and ((ck.save_interval and it % ck.save_interval == 0) or it == t.train_iters):
            save()
            saved = True
        if t.exit_interval and it % t.exit_interval == 0 and it < t.train_iters:
            if ck.save and not saved:
                save()
            print_rank0(f"> exiting at iteration {it} (--exit-interval {t.exit_interval})")
            return True
        if it < t.train_iters and controls.time_is_up():
            if ck.save and not saved:
                save()
            print_rank0(f"> exiting at iteration {it} (--exit-duration-in-mins {t.exit_duration_in_mins})")
            return True
        return False

    controls = RunControls(cfg, start_time)  # --profile, --manual-gc, --exit-duration-in-mins, ...
    guard = SkipGuard(cfg)  # --max-skipped-steps; fp16: a NaN loss at the loss scale's floor stops the run
    lc = cfg.logging
    if engine is None:
        # Synchronous: one global batch per iteration, a flush and a step at its end.
        while state.iteration < t.train_iters:
            controls.before_iteration(state.iteration + 1)
            lr = schedule.lr_at(state.iteration)
            # --rampup-batch-size: the iteration's own global batch, whole micro-batches on every DP rank
            batches = workload.microbatches(train_ds, state.consumed_samples, schedule.num_microbatches(state.iteration),
                                            mbs)
            if t.calculate_per_token_loss:
                per_token_normalizer(batches)
            scale = optimizer.get_loss_scale() if cfg.precision.fp16 else None  # the scale this step runs with
            loss, grad_norm = train_step(cfg, chunks, ddp, optimizer, batches, lr, workload,
                                         schedule.decoupled_lr_at(state.iteration))
            check_finite(cfg, state.iteration + 1, loss, grad_norm, ddp, ck.save)
            guard.after_step(state.iteration + 1, grad_norm is None, scale, loss_is_nonfinite(loss),
                             lambda: last_checkpoint(ck.save), any_rank)  # fp16: bounded skipping
            state.consumed_samples += schedule.batch(state.iteration)
            state.iteration += 1
            sums = {}
            if (lc.log_params_norm or lc.log_num_zeros_in_grad) and progress.logs(state.iteration):
                sums = replica_sums(ddp.params, ps.get_model_parallel_group())
                sums = {k: v for k, v in sums.items() if getattr(lc, "log_" + k)}
            progress.iteration_done(state.iteration, average_over_dp(loss) if holds_loss(cfg) else None, lr, grad_norm,
                                    optimizer.get_loss_scale() if cfg.precision.fp16 else None, metrics=sums)
            controls.after_iteration(state.iteration)
            with progress.excluded():  # evaluation and checkpoints are not training time
                if progress.boundary(state.iteration):
                    controls.around_boundary()
                stop = at_boundary()
            progress.flush()
            if stop:
                break
    else:
        # Asynchronous: micro-batches stream without a flush; the pipeline drains only at the next
        # evaluation, checkpoint, exit or the end of training (segment boundaries).
        def batch_of(mb: int) -> dict:
            """Micro-batch `mb` of the stream is micro-batch mb % M of global batch mb // M (same data
            order as synchronous training)."""
            g, m = divmod(mb, num_mb)
            return workload.microbatches(train_ds, g * gbs + m * mbs * ps.get_data_parallel_world_size(), 1, mbs)[0]

        pending: dict[int, list] = {}
        skipped_steps_seen = 0  # the loss stage's skipped steps already reported
        check_nan = t.check_for_nan_in_loss_and_grad and not cfg.precision.fp16  # fp16: the loss scaler skips

        def on_loss(mb: int, loss: torch.Tensor) -> None:
            nonlocal skipped_steps_seen
            g = mb // num_mb
            if check_nan and not torch.isfinite(loss).all():  # before its backward
                raise RankError(f"lm loss is {float(loss)} at iteration {g + 1} (micro-batch {mb}) on "
                                f"{ps.describe_rank(dist.get_rank())}: stopped before its backward; "
                                f"{last_checkpoint(ck.save)}")
            pending.setdefault(g, []).append(loss)
            if len(pending[g]) == num_mb:
                mean = torch.stack(pending.pop(g)).mean()
                stage = engine.stage
                last_norm = next((n for n in reversed(stage.grad_norms) if n is not None), float("nan"))
                # Steps are stage-local here: the iteration counts as skipped when this (the loss) stage
                # skipped a step for inf/NaN gradients since the last one; fp16 logs this stage's scale.
                skipped = sum(stage.skipped_steps)
                skipped_now = skipped > skipped_steps_seen
                if skipped_now:
                    last_norm, skipped_steps_seen = None, skipped
                scale = stage.optimizers[stage.loss_chunk].get_loss_scale() if cfg.precision.fp16 else None
                guard.after_iteration(g + 1, max(stage.consecutive_skipped), skipped_now, scale,
                                      loss_is_nonfinite(mean), lambda: last_checkpoint(ck.save), RankError,
                                      ps.describe_rank(dist.get_rank()))
                progress.iteration_done(g + 1, average_over_dp(mean), schedule.lr_at(g), last_norm, scale)

        in_stream = getattr(workload, "eval_in_stream", False)  # else (NMT BLEU decoding) drain to evaluate

        def evaluate_in_stream(it: int):
            def run():  # on every rank at its cut after iteration `it`: no training op moves
                with progress.excluded():
                    val = evaluate_now()
                    if val is not None:
                        progress.log_validation(it, val)
            return run

        while state.iteration < t.train_iters:
            stop = next_boundary(state.iteration, cfg, eval_drains=not in_stream)
            controls.before_iteration(state.iteration + 1, last=stop)  # --profile: the segment holding its start
            evaluations = {it * num_mb: evaluate_in_stream(it) for it in range(state.iteration + 1, stop + 1)
                           if in_stream and eval_due(it)}
            engine.train_segment(batch_of, (stop - state.iteration) * num_mb, on_loss=on_loss,
                                 evaluations=evaluations)
            state.consumed_samples += (stop - state.iteration) * gbs
            state.iteration = stop
            controls.after_iteration(state.iteration)
            with progress.excluded():  # evaluation and checkpoints are not training time
                controls.around_boundary()  # every segment ends at a drain
                stop = at_boundary(evaluated=in_stream)
            progress.flush()
            if stop:
                break
    controls.close()
    logger.close()
    return progress.record


ASYNC_SEGMENT_ITERATIONS = 1000  # the longest asynchronous segment without --async-drain-interval


def next_boundary(iteration: int, cfg: Config, eval_drains: bool = False) -> int:
    """The next iteration after which an asynchronous pipeline must drain: checkpoint, exit or the end
    of training (and evaluation when `eval_drains`; otherwise it runs inside the stream)."""
    t, ck = cfg.training, cfg.checkpoint
    # --async-drain-interval fixes the drains whether or not a run saves (its saves fall on drains);
    # without it every save drains, and so does every ASYNC_SEGMENT_ITERATIONS-th iteration (a segment's
    # op lists are built whole: this bounds them, independently of --eval-interval).
    drains = [cfg.parallel.async_drain_interval] if cfg.parallel.async_drain_interval else \
        ([ck.save_interval] if ck.save and ck.save_interval else []) + [ASYNC_SEGMENT_ITERATIONS]
    intervals = ([t.eval_interval] if eval_drains else []) + drains \
        + ([t.exit_interval] if t.exit_interval else [])
    return min([t.train_iters] + [(iteration // n + 1) * n for n in intervals])


def build_async_engine(cfg: Config, padded_vocab: int, microbatches_per_iteration: int, workload=None,
                       schedule: SampleSchedule | None = None):
    """This rank of an asynchronous pipeline. The LR schedule is counted in iterations (global
    batches), so warm-up and decay span the same samples as in synchronous training although a stage
    steps `microbatches_per_iteration / k` times per iteration."""
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank, optimizer_kwargs_from_config
    p, t = cfg.parallel, cfg.training
    k = update_interval(cfg)
    schedule = schedule or SampleSchedule(cfg, dist.get_world_size())
    steps_per_iteration = microbatches_per_iteration // k
    kwargs = optimizer_kwargs_from_config(t)
    if t.optimizer == "sgd":
        kwargs["sgd_direction"] = p.pipeoptim_sgd_direction
    options = {}
    if p.pipeline_method == "pipeoptim":
        options = dict(s_offset=p.pipeoptim_s_offset, include_weight_decay=p.pipeoptim_extrapolate_weight_decay,
                       weight_predictor=p.weight_predictor, prediction_horizon=p.prediction_horizon,
                       rollout_gradient=p.rollout_gradient)
    if p.pipeline_method in ("pipedream", "pipeoptim"):
        options.update(delay_compensation=p.delay_compensation_lambda,
                       delay_compensation_adaptive=p.delay_compensation_adaptive)
    options["staleness_lr_scaling"] = p.staleness_lr_scaling
    options["error_feedback"] = p.async_error_feedback
    workload = workload or GPTWorkload(cfg)
    return AsyncPipelineRank(cfg, padded_vocab, p.pipeline_method, update_interval=k, optimizer_kwargs=kwargs,
                             lr_fn=lambda step: schedule.lr_at(step // steps_per_iteration), clip_grad=t.clip_grad,
                             message_specs=workload.message_specs(t.micro_batch_size),
                             build_chunks=workload.chunks_for_rank, **options)


class Progress:
    """Per-iteration bookkeeping on every rank; console, metrics file, W&B and TensorBoard on the logging
    rank (tensor rank 0, data rank 0, last pipeline stage: the rank that holds the loss).

    Each logged record holds the loss, lr, grad norm, loss scale (fp16), tokens/s, this process's memory
    (`memory_gb`, `max_memory_gb`), with `--log-throughput` the model TFLOP/s per GPU (`tflops_per_gpu`,
    FLOPs per iteration / time / world size) and, given a peak, `mfu`; with `--timing-log-level` the
    logging rank's timers (`time/<name>`, ms per iteration); with pipelining the largest staleness of
    each stage (`staleness/stage<r>`). Evaluation and checkpoints (`excluded()`) are not timed. The
    console line is printed when an iteration is logged; its record is written once the iteration's
    evaluation (if any) is known, so `val_loss` joins the same JSON object."""

    def __init__(self, cfg: Config, logger: Logger, gbs: int, flops_per_iter: float, world: int,
                 tokens_per_iter: float | None = None, schedule: SampleSchedule | None = None):
        self.cfg, self.logger, self.gbs, self.flops_per_iter, self.world = cfg, logger, gbs, flops_per_iter, world
        self.schedule = schedule  # --rampup-batch-size: iterations carry less than `gbs` samples
        self.per_rank = ps.get_device().type != "cuda"  # "TFLOP/s per rank" on CPU (no GPU to count)
        self.tokens_per_iter = tokens_per_iter if tokens_per_iter is not None else gbs * cfg.model.seq_length
        self.peak_tflops = device_peak_tflops(cfg.precision.bf16 or cfg.precision.fp16, cfg.logging.peak_tflops)
        self.staleness = pipeline_staleness(cfg, world)
        timers.configure(cfg.logging.timing_log_level)
        self.record: dict = {}  # the last logged record
        self.pending: dict | None = None  # logged, not yet written
        self.window_start, self.window_iters, self.window_batches = time.perf_counter(), 0, 0.0
        self.loss_sum, self.loss_n, self.skipped = 0.0, 0, 0

    def logs(self, iteration: int) -> bool:
        """Whether iteration `iteration` (1-based) is logged."""
        return iteration % self.cfg.logging.log_interval == 0 or iteration == self.cfg.training.train_iters

    def boundary(self, iteration: int) -> bool:
        """Whether an evaluation or checkpoint follows iteration `iteration` (--manual-gc collects there)."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        return iteration % t.eval_interval == 0 or iteration == t.train_iters or bool(
            ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def iteration_done(self, iteration: int, loss: float | None, lr: float, grad_norm: float | None,
                       loss_scale: float | None = None, metrics: dict | None = None) -> None:
        """`metrics`: further numbers of a logged iteration (--log-params-norm, --log-num-zeros-in-grad)."""
        """`grad_norm` None: the step was skipped (inf/NaN gradients under fp16/bf16)."""
        t, lc = self.cfg.training, self.cfg.logging
        self.window_iters += 1
        # global batches' worth of samples (tokens and FLOPs scale with the samples of a ramp iteration)
        self.window_batches += self.schedule.batch(iteration - 1) / self.gbs if self.schedule is not None else 1.0
        self.skipped += grad_norm is None
        if loss is not None:
            self.loss_sum, self.loss_n = self.loss_sum + loss, self.loss_n + 1
            if not math.isfinite(loss) and t.check_for_nan_in_loss_and_grad and not self.cfg.precision.fp16:
                raise RankError(f"lm loss is {loss} at iteration {iteration} on {ps.describe_rank(dist.get_rank())}")
        if not self.logs(iteration):
            return
        self.flush()
        elapsed = time.perf_counter() - self.window_start
        sec_per_iter = elapsed / self.window_iters
        tokens_per_sec = self.tokens_per_iter * self.window_batches / elapsed
        consumed = self.schedule.consumed_before(iteration) if self.schedule is not None else iteration * self.gbs
        self.record = {"iteration": iteration, "lm_loss": self.loss_sum / max(self.loss_n, 1), "lr": lr,
                       "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                       "consumed_samples": consumed, "skipped_iterations": self.skipped}
        extra = ""
        if loss_scale is not None:
            self.record["loss_scale"] = loss_scale
            extra += f" | loss scale {loss_scale:.1f} | skipped {self.skipped}"
        if lc.log_throughput:
            tflops = self.flops_per_iter * self.window_batches / elapsed / self.world / 1e12
            self.record["tflops_per_gpu"] = tflops
            extra += f" | TFLOP/s per {'rank' if self.per_rank else 'GPU'} {tflops:.4f}"
            if self.peak_tflops is not None:
                self.record["mfu"] = tflops / self.peak_tflops
                extra += f" | MFU {100 * self.record['mfu']:.1f}%"
        for k, v in (metrics or {}).items():
            self.record[k] = v
            extra_text = f"{v:.3f}" if isinstance(v, float) else str(v)
            extra += f" | {k.replace('_', ' ')} {extra_text}"
        self.record.update(memory_gb())
        self.record.update(self.staleness)
        times = {f"time/{name}": 1000 * sec / self.window_iters for name, sec in sorted(timers.pop().items())}
        self.record.update(times)
        self.pending = self.record
        norm = "skipped" if grad_norm is None else f"{grad_norm:.3f}"
        self.logger.log(None, f" iteration {iteration:6d}/{t.train_iters} | consumed samples {consumed} |"
                              f" lm loss {self.record['lm_loss']:.4f} | lr {lr:.3e} | grad norm {norm} |"
                              f" {sec_per_iter * 1000:.1f} ms/iter | tokens/s {tokens_per_sec:.0f}{extra}")
        if times:
            self.logger.log(None, " time (ms/iter, this rank) | " + " | ".join(
                f"{k[len('time/'):]} {v:.1f}" for k, v in times.items()))
        self.window_start, self.window_iters, self.loss_sum, self.loss_n = time.perf_counter(), 0, 0.0, 0
        self.window_batches = 0.0
        self.skipped = 0

    @contextmanager
    def excluded(self):
        """Evaluation and checkpoints inside are left out of the throughput and the timers."""
        start = time.perf_counter()
        with timers.paused():
            yield
        self.window_start += time.perf_counter() - start

    def log_validation(self, iteration: int, val: float, extra: dict | None = None) -> None:
        """`extra`: further validation metrics (NMT: `val_bleu`), logged beside the loss."""
        rec = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **(extra or {})}
        shown = "".join(f" | {k.removeprefix('val_').replace('_', ' ')} {v:.2f}" for k, v in (extra or {}).items())
        self.logger.log(None, f" validation at iteration {iteration} | val loss {val:.4f} | val ppl {rec['val_ppl']:.2f}"
                              f"{shown}")
        if self.pending is not None and self.pending["iteration"] == iteration:
            self.pending.update(rec)
        else:
            self.flush()
            self.pending = {"iteration": iteration, **rec}
        self.record.update(rec)

    def flush(self) -> None:
        if self.pending is not None:
            self.logger.log(self.pending)
            self.pending = None


def pipeline_staleness(cfg: Config, world: int) -> dict[str, int]:
    """`staleness/stage<r>`: the largest s(j) of stage r, the optimizer steps its chunks take between a
    micro-batch's forward and backward, read off the run's op lists (0 for the synchronous methods,
    D-r-1 for straight asynchronous 1F1B with k = 1). Empty without pipelining."""
    from megatron_po.config import virtual_pipeline_size
    from megatron_po.pipeline.schedules import build_schedule, staleness
    p = cfg.parallel
    D, v = p.pipeline_model_parallel_size, virtual_pipeline_size(cfg)
    if D == 1 and v == 1:
        return {}
    if is_async(cfg):
        from megatron_po.pipeline.async_pipeline import _probe_schedule  # long enough for the steady state
        schedule = _probe_schedule(D, v, update_interval(cfg))
    else:
        schedule = build_schedule(p.pipeline_method, D, v, num_microbatches(cfg, world))
    s = staleness(schedule)
    return {f"staleness/stage{r}": max(max(s[(r, c)].values(), default=0) for c in range(v)) for r in range(D)}


def run_main(cfg_or_argv, description: str = "megatron_po", workload_cls=GPTWorkload) -> int:
    """Entry-point wrapper: bad input -> one `error:` line on stderr and exit code 2. `workload_cls`
    (GPTWorkload, nmt_workload.NMTWorkload) is built from the parsed config."""
    import sys

    from megatron_po.config import parse_args
    try:
        launcher_death.arm()  # under torchrun: die with the launcher, never save after it
        cfg = parse_args(cfg_or_argv, description) if not isinstance(cfg_or_argv, Config) else cfg_or_argv
        pretrain(cfg, workload_cls(cfg))
    except SaveError as e:  # every rank raises it alike (a full or read-only disk): one line, exit 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except (UserError, DataError) as e:
        ps.report_fault(f"stopped: {e}")  # should only this rank have raised it, the others stop too
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A config error comes before the process group, alike on every rank: rank 0 (by the launcher's
        # RANK) prints it, so torchrun's output holds it once; every rank exits 2.
        said_by_rank0 = isinstance(e, ConfigError) and launcher_rank() != 0
        if not said_by_rank0 and (rank == 0 or not dist.is_initialized() or isinstance(e, RankError)):
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        message = ps.communication_failure(e)  # a lost peer: one line naming it, not a traceback
        if message is None:
            ps.report_fault(f"failed: {type(e).__name__}: {e}")
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        return ps.FAULT_EXIT_CODE
    finally:
        save_lock.release()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
