"""What a run reports: the console line, `--metrics-file` JSON lines, W&B and TensorBoard (`Logger`),
fed by the per-iteration bookkeeping of throughput, timers, memory and staleness (`Progress`), from the
rank that holds the loss (`logging_rank`)."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from typing import Callable

import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, global_batch_size, is_async, num_microbatches, update_interval, uses_fsdp2
from megatron_po.errors import RankError
from megatron_po.models.compiled_layers import compile_summary
from megatron_po.models.moe.report import moe_line
from megatron_po.models.mtp import mtp_text
from megatron_po.monitor import device_peak_tflops, memory_gb, timers
from megatron_po.optim.clip_grads import expert_norm_group
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.run_controls import replica_sums


def logging_rank(cfg: Config) -> int:
    from megatron_po.pipeline.schedules import loss_rank
    return ps.rank_of(0, 0, loss_rank(cfg.parallel.pipeline_method, ps.get_pipeline_model_parallel_world_size()),
                      ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                      cp=ps.get_context_parallel_world_size())


def start_logging(cfg: Config, workload, schedule: SampleSchedule, iteration: int) -> Progress:
    """The run's `Progress` (and its `Logger`), on every rank; a resumed run (at `iteration`) first drops
    what a killed run logged past its checkpoint from the metrics file."""
    world = dist.get_world_size()
    gbs = global_batch_size(cfg, world)
    flops_per_iter = workload.flops_per_iteration(gbs)
    if dist.get_rank() == logging_rank(cfg) and cfg.logging.metrics_file:
        truncate_metrics(cfg.logging.metrics_file, iteration)  # what a killed run logged past its checkpoint
    logger = Logger(cfg, dist.get_rank() == logging_rank(cfg))
    return Progress(cfg, logger, gbs, flops_per_iter, world, workload.tokens_per_iteration(gbs), schedule)


def replica_metrics(cfg: Config, params) -> dict:
    """--log-params-norm / --log-num-zeros-in-grad of one model replica (collective over the model-parallel
    group; {} when neither is asked for)."""
    lc = cfg.logging
    if not (lc.log_params_norm or lc.log_num_zeros_in_grad):
        return {}
    shards = None
    if uses_fsdp2(cfg):  # each rank holds its shards: summed over the ranks they are sharded over first
        shards = (ps.get_data_parallel_group(with_context_parallel=True),
                  ps.get_expert_data_parallel_group() if cfg.model.num_experts is not None else None)
    sums = replica_sums(params, ps.get_model_parallel_group(), expert_norm_group(cfg), shards)
    return {k: v for k, v in sums.items() if getattr(lc, "log_" + k)}


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


def tensorboard_keeps(lc) -> Callable[[str], bool]:
    """Which numbers of a record TensorBoard gets (LoggingConfig `lc`): all but those Megatron writes there only
    when asked: the timers and throughput (--log-timers-to-tensorboard), the memory (--log-memory-to-tensorboard),
    the validation perplexity (--log-validation-ppl-to-tensorboard)."""
    def keeps(key: str) -> bool:
        if key.startswith("time/") or key in ("tokens_per_sec", "tflops_per_gpu", "mfu"):
            return lc.log_timers_to_tensorboard
        if key in ("memory_gb", "max_memory_gb"):
            return lc.log_memory_to_tensorboard
        if key == "val_ppl":
            return lc.log_validation_ppl_to_tensorboard
        return True
    return keeps


class Logger:
    """Console line, `--metrics-file` JSON lines, W&B and TensorBoard, from the rank that holds the loss.
    Every sink gets the same record, TensorBoard its numbers that `tensorboard_keeps` (keys such as
    `time/optimizer` and `staleness/stage0` group into sections there and in W&B)."""

    def __init__(self, cfg: Config, active: bool):
        self.active = active
        self.scalars_interval = cfg.logging.tensorboard_log_interval  # W&B / TensorBoard: every N-th iteration
        self.metrics_file = None
        self.wandb = None
        self.tensorboard = None
        self.tensorboard_keeps = tensorboard_keeps(cfg.logging)
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
            self.tensorboard = SummaryWriter(lc.tensorboard_dir, max_queue=lc.tensorboard_queue_size)
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
                if k != "iteration" and isinstance(v, (int, float)) and self.tensorboard_keeps(k):
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


class Progress:
    """Per-iteration bookkeeping on every rank; console, metrics file, W&B and TensorBoard on the logging
    rank (tensor rank 0, data rank 0, last pipeline stage: the rank that holds the loss).

    Each logged record holds the loss, lr, grad norm, loss scale (fp16), tokens/s, this process's memory
    (`memory_gb`, `max_memory_gb`), with `--log-throughput` the model TFLOP/s per GPU (`tflops_per_gpu`,
    FLOPs per iteration / time / world size) and, given a peak, `mfu`; with `--timing-log-level` the
    logging rank's timers (`time/<name>`, ms per iteration); with pipelining the largest staleness of
    each stage (`staleness/stage<r>`); with MoE each MoE layer's auxiliary losses, tokens per expert and dropped
    tokens (`moe/...`, models/moe/report.py); with multi-token prediction its losses (`mtp_loss`, the mean over
    the depths, and `mtp_loss/depth<d>`, models/mtp.py). Evaluation and checkpoints (`excluded()`) are not timed. The
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
        self.compile_reported = not cfg.model.torch_compile  # --torch-compile: its line, once

    def logs(self, iteration: int) -> bool:
        """Whether iteration `iteration` (1-based) is logged."""
        return iteration % self.cfg.logging.log_interval == 0 or iteration == self.cfg.training.train_iters

    def boundary(self, iteration: int) -> bool:
        """Whether an evaluation or checkpoint follows iteration `iteration` (--manual-gc collects there)."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        return iteration % t.eval_interval == 0 or iteration == t.train_iters or bool(
            ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def iteration_done(self, iteration: int, loss: float | None, lr: float, grad_norm: float | None,
                       loss_scale: float | None = None, metrics: dict | None = None, moe: dict | None = None,
                       mtp: dict | None = None) -> None:
        """`metrics`: further numbers of a logged iteration (--log-params-norm, --log-num-zeros-in-grad), shown
        on its console line; `moe`: the MoE routers' per-layer numbers (models/moe/report.py), shown on a line
        of their own; `mtp`: the multi-token prediction losses since the last logged iteration (models/mtp.py
        `mtp_metrics`), shown after the lm loss. `grad_norm` None: the step was skipped (inf/NaN gradients under
        fp16/bf16)."""
        t, lc = self.cfg.training, self.cfg.logging
        if not self.compile_reported and self._backward_ran(iteration):  # the first ones compiled the layers
            self.compile_reported = True
            self.logger.log(None, compile_summary())
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
        self.record.update(mtp or {})
        self.record.update(moe or {})
        self.record.update(memory_gb())
        self.record.update(self.staleness)
        times = {f"time/{name}": 1000 * sec / self.window_iters for name, sec in sorted(timers.pop().items())}
        self.record.update(times)
        self.pending = self.record
        norm = "skipped" if grad_norm is None else f"{grad_norm:.3f}"
        self.logger.log(None, f" iteration {iteration:6d}/{t.train_iters} | consumed samples {consumed} |"
                              f" lm loss {self.record['lm_loss']:.4f}{mtp_text(mtp or {})} | lr {lr:.3e} |"
                              f" grad norm {norm} |"
                              f" {sec_per_iter * 1000:.1f} ms/iter | tokens/s {tokens_per_sec:.0f}{extra}")
        if moe:
            self.logger.log(None, moe_line(moe))
        if times:
            self.logger.log(None, " time (ms/iter, this rank) | " + " | ".join(
                f"{k[len('time/'):]} {v:.1f}" for k, v in times.items()))
        self.window_start, self.window_iters, self.loss_sum, self.loss_n = time.perf_counter(), 0, 0.0, 0
        self.window_batches = 0.0
        self.skipped = 0

    def _backward_ran(self, iteration: int) -> bool:
        """Whether this rank has run a backward by `iteration_done(iteration)`: at the end of a synchronous
        iteration; in the asynchronous stream on the loss stage (its backward follows each forward) once a
        second micro-batch's loss is in."""
        return not is_async(self.cfg) or iteration * num_microbatches(self.cfg, self.world) >= 2

    @contextmanager
    def excluded(self):
        """Evaluation and checkpoints inside are left out of the throughput and the timers."""
        start = time.perf_counter()
        with timers.paused():
            yield
        self.window_start += time.perf_counter() - start

    def log_moe(self, iteration: int, moe: dict) -> None:
        """The MoE routers' numbers in an asynchronous pipeline since the last call, logged at a point every rank
        reaches (an evaluation's cut in the stream, or the drain ending a segment) after iteration `iteration`,
        beside that iteration's record. The stages are at different micro-batches there, so each layer's numbers
        cover its own stage's forwards since the last call: over the run every forward is counted once."""
        if not any(v for k, v in moe.items() if k.startswith("moe/tokens_per_expert_mean/")):
            return  # no training forward since the last call (a drain right after an evaluation's cut)
        self.logger.log(None, moe_line(moe) + f" (asynchronous: since the last evaluation or drain, to iteration "
                                              f"{iteration})")
        self._join_record(iteration, moe)

    def log_validation(self, iteration: int, val: float, extra: dict | None = None) -> None:
        """`extra`: further validation metrics (NMT: `val_bleu`), logged beside the loss."""
        rec = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **(extra or {})}
        shown = "".join(f" | {k.removeprefix('val_').replace('_', ' ')} {v:.2f}" for k, v in (extra or {}).items())
        self.logger.log(None, f" validation at iteration {iteration} | val loss {val:.4f} | val ppl {rec['val_ppl']:.2f}"
                              f"{shown}")
        self._join_record(iteration, rec)

    def _join_record(self, iteration: int, rec: dict) -> None:
        """`rec` into iteration `iteration`'s JSON record (written once nothing more can join it)."""
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
        from megatron_po.pipeline.async_stage import _probe_schedule  # long enough for the steady state
        schedule = _probe_schedule(D, v, update_interval(cfg))
    else:
        schedule = build_schedule(p.pipeline_method, D, v, num_microbatches(cfg, world))
    s = staleness(schedule)
    return {f"staleness/stage{r}": max(max(s[(r, c)].values(), default=0) for c in range(v)) for r in range(D)}
