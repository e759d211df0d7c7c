"""Megatron's sample-counted training schedule: the global batch of every iteration (--rampup-batch-size),
how many iterations make the run (--train-iters or --train-samples), and the learning rate of every step
(warm-up and decay spans in samples: --lr-*-iters x global batch, --lr-*-samples, --lr-warmup-fraction).

Megatron's ramp rule: with `--rampup-batch-size START INCR SAMPLES` and global batch G, the batch of the
iteration that starts after `c` consumed samples is G once c > SAMPLES, else
`START + floor(c / (SAMPLES / ((G - START) / INCR))) * INCR`. With --train-samples N the run has as many
ramp iterations as start at c <= min(SAMPLES, N), then (N - c) // G more (a partial last batch is dropped).

The lr counts samples like Megatron's scheduler. Our one convention: during warm-up a step already uses the lr
of the samples it completes, init + (lr - init) x (c + b) / W (init: --lr-warmup-init, Megatron's start of the
warm-up, default 0), so the first step does not run at the start value itself; decay reads c. The
single-process studies under bench/ run the same rule on the micro-batch clock (`microbatch_lr`: one sample
per micro-batch, step i of a chunk that steps every k micro-batches at the lr of micro-batch i x k).
As in Megatron, c counts only the samples of iterations whose step was applied (its scheduler steps only on
`update_successful`): an fp16 step skipped for inf/NaN gradients leaves the lr as it was, while the batch
ramp follows every consumed sample (training_step.TrainState.updated_samples). Without skipped steps the
lr is a pure function of the iteration, which also tells a predictor the future lrs.
"""

from __future__ import annotations

import math

from megatron_po.config import Config, data_parallel_size, global_batch_size, rampup_batch_size


class SampleSchedule:
    """Batch sizes, consumed samples and lrs of every iteration of a run (`world`: its world size)."""

    def __init__(self, cfg: Config, world: int):
        t = cfg.training
        self.t = t
        self.gbs = global_batch_size(cfg, world)
        self.mbs_times_dp = t.micro_batch_size * data_parallel_size(cfg, world)
        self.ramp = rampup_batch_size(cfg)
        self._ramp_consumed = self._ramp_prefix()  # consumed samples before each ramp iteration, and after
        self.train_iters = self._train_iters()
        self._spans()

    # --- batches ---------------------------------------------------------------------------------

    def batch_at_consumed(self, consumed: int) -> int:
        """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update: the global batch after `consumed`."""
        if self.ramp is None:
            return self.gbs
        start, incr, samples = self.ramp
        increments = (self.gbs - start) // incr
        if consumed > samples or increments == 0:
            return self.gbs
        per_increment = samples / increments
        return start + int(consumed / per_increment) * incr

    def _ramp_prefix(self) -> list[int]:
        out = [0]
        if self.ramp is None:
            return out
        while out[-1] <= self.ramp[2] and self.batch_at_consumed(out[-1]) < self.gbs:
            out.append(out[-1] + self.batch_at_consumed(out[-1]))
        return out

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by iterations 0..iteration-1."""
        ramp = self._ramp_consumed
        if iteration < len(ramp):
            return ramp[iteration]
        return ramp[-1] + (iteration - (len(ramp) - 1)) * self.gbs

    def batch(self, iteration: int) -> int:
        """Global batch (samples) of iteration `iteration` (0-based)."""
        return self.batch_at_consumed(self.consumed_before(iteration))

    def num_microbatches(self, iteration: int) -> int:
        return self.batch(iteration) // self.mbs_times_dp

    def _train_iters(self) -> int:
        t = self.t
        if t.train_samples is None:
            return t.train_iters
        if self.ramp is None:
            return t.train_samples // self.gbs
        # Megatron's update_train_iters: ramp iterations while consumed <= min(ramp samples, train samples).
        iterations = consumed = 0
        while consumed <= self.ramp[2] and consumed <= t.train_samples:
            consumed += self.batch_at_consumed(consumed)
            iterations += 1
        if t.train_samples > consumed:
            iterations += (t.train_samples - consumed) // self.gbs
        return iterations

    @property
    def total_samples(self) -> int:
        return self.consumed_before(self.train_iters)

    # --- learning rate -------------------------------------------------------------------------------

    def _spans(self) -> None:
        """Warm-up, decay and WSD-decay spans in samples; `unit` is the sample count of one schedule step
        (the global batch when the flags count iterations): the decay never divides by less."""
        t, g = self.t, self.gbs
        if t.train_samples is None:
            self.unit = g
            self.decay = (t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters) * g
            warmup = t.lr_warmup_iters * g
            wsd = t.lr_wsd_decay_iters * g if t.lr_wsd_decay_iters is not None else None
        else:
            self.unit = 1
            self.decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
            warmup = t.lr_warmup_samples
            wsd = t.lr_wsd_decay_samples
        self.warmup = t.lr_warmup_fraction * self.decay if t.lr_warmup_fraction is not None else warmup
        if wsd is None:  # 10% of the decay span, whole steps
            wsd = self.unit * max(1, int(self.decay - self.warmup) // (10 * self.unit))
        self.wsd = wsd

    def lr_at(self, iteration: int, peak: float | None = None, low: float | None = None,
              updated: int | None = None) -> float:
        """lr of the step that completes iteration `iteration` (0-based); `peak`/`low` replace --lr and
        --min-lr (--decoupled-lr and --decoupled-min-lr follow the same shape). `updated`: the samples of
        the earlier iterations whose step was applied (Megatron's scheduler counts only those: skipped fp16
        steps do not advance the lr); default all of them. The batch is still the iteration's own."""
        done = self.consumed_before(iteration) if updated is None else updated
        return sample_lr(done, self.batch(iteration), self.t.lr_decay_style,
                         self.t.lr if peak is None else peak, self.t.min_lr if low is None else low,
                         self.warmup, self.decay, self.wsd, self.unit, self.t.lr_warmup_init)

    def decoupled_lr_at(self, iteration: int, updated: int | None = None) -> float | None:
        """--decoupled-lr's schedule for the input embedding and output layer (None without it)."""
        t = self.t
        if t.decoupled_lr is None:
            return None
        return self.lr_at(iteration, t.decoupled_lr, t.decoupled_min_lr if t.decoupled_min_lr is not None else 0.0,
                          updated)


def sample_lr(consumed: int, batch: int, style: str, lr: float, min_lr: float, warmup: float, decay: float,
              wsd: float, unit: int = 1, init: float = 0.0) -> float:
    """The lr of a step of `batch` samples that starts after `consumed` samples (see the module notes);
    `init`: where the warm-up starts (--lr-warmup-init)."""
    if warmup > 0 and consumed < warmup:
        done = consumed + batch  # ((lr - init) x done / W in this order: the studies' cached runs were made with
        # it at init 0, where init + (lr - init) x done / W is lr x done / W to the bit)
        return init + (lr - init) * done / warmup if done <= warmup else lr
    if style == "constant":
        return lr
    if consumed >= decay:
        return min_lr
    if style == "wsd":
        stable_end = decay - wsd
        if consumed < stable_end:
            return lr
        return lr - (lr - min_lr) * (consumed - stable_end) / wsd
    frac = (consumed - warmup) / max(unit, decay - warmup)
    if style == "linear":
        coeff = 1.0 - frac
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style}")
    return min_lr + coeff * (lr - min_lr)


def microbatch_lr(step: int, every: int, t) -> float:
    """The lr of step `step` of a chunk that steps every `every` micro-batches, on the micro-batch clock of the
    single-process studies (bench/): the lr of micro-batch step x every, the TrainingConfig `t`'s iteration
    flags counting micro-batches (warm-up --lr-warmup-iters, decay to --min-lr over --lr-decay-iters or
    --train-iters), so warm-up and decay span the same samples for every method and update interval."""
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    wsd = t.lr_wsd_decay_iters if t.lr_wsd_decay_iters is not None else max(1, (decay - t.lr_warmup_iters) // 10)
    return sample_lr(step * every, 1, t.lr_decay_style, t.lr, t.min_lr, t.lr_warmup_iters, decay, wsd,
                     init=t.lr_warmup_init)


def set_lr(optimizer, lr: float) -> None:
    """Every param group's lr: `lr` times the group's `lr_mult` where it has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
