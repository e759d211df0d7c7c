"""The periodic work between iterations (synchronous methods) or at a drain (asynchronous ones): evaluation,
checkpoints and the stops (--exit-interval, --exit-duration-in-mins), as the intervals say. None of it is
training time (`Progress.excluded`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po.config import Config, global_batch_size, num_microbatches
from megatron_po.distributed.checkpoint_save import save_checkpoint
from megatron_po.run_controls import RunControls
from megatron_po.training_log import Progress, print_rank0
from megatron_po.training_step import Trainable, TrainState, average_over_dp, evaluate, holds_loss


class PeriodicWork:
    def __init__(self, cfg: Config, workload, model: Trainable, state: TrainState, progress: Progress,
                 controls: RunControls, valid_ds):
        self.cfg, self.workload, self.model, self.state = cfg, workload, model, state
        self.progress, self.controls, self.valid_ds = progress, controls, valid_ds
        world = dist.get_world_size()
        self.gbs, self.num_mb = global_batch_size(cfg, world), num_microbatches(cfg, world)

    def eval_due(self, it: int) -> bool:
        t = self.cfg.training
        return it % t.eval_interval == 0 or it == t.train_iters

    def evaluate(self) -> float | None:
        """The validation loss (on the loss rank; None elsewhere and without validation data)."""
        cfg, model, workload, valid_ds = self.cfg, self.model, self.workload, self.valid_ds
        if valid_ds is None or workload.eval_iters(valid_ds) == 0:  # --eval-iters 0: no validation
            return None
        if model.engine is None:
            return evaluate(cfg, model.chunks, model.ddp, valid_ds, self.num_mb, workload)
        losses = []
        for k in range(workload.eval_iters(valid_ds)):
            val = model.engine.evaluate(workload.microbatches(valid_ds, k * self.gbs, self.num_mb,
                                                              cfg.training.micro_batch_size))
            losses.append(average_over_dp(torch.tensor(val)) if holds_loss(cfg) else None)
        return sum(losses) / len(losses) if holds_loss(cfg) else None

    def save(self) -> None:
        cfg, ck, state, model = self.cfg, self.cfg.checkpoint, self.state, self.model
        self.progress.flush()  # records up to the checkpoint are on disk before it is (a resume rewrites the rest)
        save_checkpoint(ck.save, state.iteration, model.chunks, model.optimizer,
                        {"train_state": vars(state).copy(), "config": cfg.to_dict(), **self.workload.checkpoint_extra()},
                        policy=model.policy, keep_last=ck.keep_last,
                        save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng)
        print_rank0(f"> saved checkpoint at iteration {state.iteration} to {ck.save}")

    def at_boundary(self, evaluated: bool = False) -> bool:
        """Evaluate / save / exit after the iteration just finished, as the intervals say (`evaluated`:
        the asynchronous stream has evaluated it already). Returns True when training must stop here
        (--exit-interval)."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        it = self.state.iteration
        if self.eval_due(it) and not evaluated:
            val = self.evaluate()
            extra = self.workload.evaluate_extra(self.model.chunks, it)  # e.g. BLEU (every rank takes part)
            if val is not None:
                self.progress.log_validation(it, val, extra)
        saved = False
        if ck.save and ((ck.save_interval and it % ck.save_interval == 0) or it == t.train_iters):
            self.save()
            saved = True
        if t.exit_interval and it % t.exit_interval == 0 and it < t.train_iters:
            if ck.save and not saved:
                self.save()
            print_rank0(f"> exiting at iteration {it} (--exit-interval {t.exit_interval})")
            return True
        if it < t.train_iters and self.controls.time_is_up():
            if ck.save and not saved:
                self.save()
            print_rank0(f"> exiting at iteration {it} (--exit-duration-in-mins {t.exit_duration_in_mins})")
            return True
        return False

    def __call__(self, collect: bool, evaluated: bool = False) -> bool:
        """After an iteration (or a drain): the work due, outside the timed training; `collect`: --manual-gc and
        --empty-unused-memory-level act around it. True when training must stop here."""
        with self.progress.excluded():  # evaluation and checkpoints are not training time
            if collect:
                self.controls.around_boundary()
            stop = self.at_boundary(evaluated)
        self.progress.flush()
        return stop
