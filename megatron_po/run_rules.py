"""Run-level rules that keep a run from misleading its operator (issue 22, points 5-9):

- The seed range below (every rank seeds NumPy with seed + 100 * pipeline rank, which must stay in
  [0, 2**32)); config_rules.py holds the config rules on `--seed`, `--max-skipped-steps` and `--finetune`
  with `--save` equal to `--load`.
- `SkipGuard`: fp16 steps skipped for inf/NaN gradients are bounded. A NaN/inf loss while the loss scale
  is at its floor (`--min-loss-scale`, or the constant `--loss-scale`) stops the run: a lower scale cannot
  help a loss that is already non-finite; so does a run of `--max-skipped-steps` consecutive skipped steps
  (0: no bound). Both stop with one line and exit code 2.
- `load_plan`: `--finetune` applies only while `--save` holds no checkpoint; a relaunch of the same command
  resumes from `--save` like any other run.
- `check_resume_iteration`: a checkpoint already past `--train-iters` is an error, not a silent exit 0.
- `no_validation_warning`: `--split` with an empty validation part while evaluation is asked for.

The config rules raise ConfigError (printed once by rank 0, exit code 2); this module's checks raise UserError.
"""

from __future__ import annotations

import os

from megatron_po.errors import UserError

SEED_LIMIT = 2**32  # NumPy's seed range; torch's is wider
SEED_STRIDE_PER_STAGE = 100  # tensor_parallel.random.model_parallel_seed: seed + 100 * pipeline rank


def launcher_rank() -> int:
    """This process's rank as its launcher numbered it (torchrun's RANK, Slurm's SLURM_PROCID; 0 alone),
    readable before any process group exists."""
    for name in ("RANK", "SLURM_PROCID"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


# --------------------------------------------------------------------------------------------------
# fp16: bounded skipping
# --------------------------------------------------------------------------------------------------


class SkipGuard:
    """Counts consecutive skipped steps and stops a hopeless run (see the module docstring).

    Synchronous methods (`after_step`): called on every rank after every step with values every rank
    agrees on (`skipped`: found-inf is agreed by all-reduce; `scale`: the loss scale the step ran with,
    equal everywhere since every scaler saw the same found-inf history). Only when a step was skipped at the
    floor do the ranks agree, in one extra all-reduce, whether any of them holds a non-finite loss; so every
    rank raises at the same point and rank 0 prints the line.

    Asynchronous methods (`after_iteration`): steps are stage-local, so the loss stage checks its own
    (a non-finite loss makes every stage's gradients non-finite) and raises `error_cls` (training's
    RankError: printed there, the other ranks stopped by the watchdog)."""

    def __init__(self, cfg):
        pr = cfg.precision
        self.max_skipped = pr.max_skipped_steps
        self.check_loss = cfg.training.check_for_nan_in_loss_and_grad and pr.fp16
        self.floor = pr.loss_scale if pr.loss_scale is not None else pr.min_loss_scale
        self.consecutive = 0

    def _check(self, iteration: int, scale: float | None, loss_bad, where, error_cls, suffix: str = "") -> None:
        """`loss_bad()`: whether the loss is non-finite (agreed where needed); called only at the floor."""
        if self.check_loss and scale is not None and scale <= self.floor and loss_bad():
            raise error_cls(f"fp16: the loss is NaN/inf at iteration {iteration}{suffix} with the loss scale at its "
                            f"floor ({scale:g}): a lower scale cannot help a non-finite loss; stopped, {where()}")
        if self.max_skipped and self.consecutive >= self.max_skipped:
            raise error_cls(f"{self.consecutive} consecutive steps skipped for inf/NaN gradients up to iteration "
                            f"{iteration}{suffix} (--max-skipped-steps {self.max_skipped}; loss scale "
                            f"{f'{scale:g}' if scale is not None else 'none'}): stopped, {where()}")

    def after_step(self, iteration: int, skipped: bool, scale: float | None, loss_nonfinite: bool, where,
                   agree=None) -> None:
        """`loss_nonfinite`: this rank's loss is NaN/inf (False where no loss is held); `agree(flag) ->
        bool`: the any-rank reduction (None: this rank's flag alone); `where()`: the last checkpoint, for
        the message."""
        self.consecutive = self.consecutive + 1 if skipped else 0
        if skipped:
            self._check(iteration, scale, lambda: agree(loss_nonfinite) if agree else bool(loss_nonfinite), where,
                        UserError)

    def after_iteration(self, iteration: int, consecutive: int, skipped: bool, scale: float | None,
                        loss_nonfinite: bool, where, error_cls, stage: str) -> None:
        """The loss stage of an asynchronous run, once per iteration: `consecutive` (its optimizer's count
        of skipped steps in a row), `skipped` (any step skipped since the last call)."""
        self.consecutive = consecutive
        if skipped:
            self._check(iteration, scale, lambda: loss_nonfinite, where, error_cls, f" on {stage}")


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any (one all-reduce over the world)."""
    import torch
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    t = torch.tensor([1.0 if flag else 0.0], device=ps.get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def loss_is_nonfinite(loss) -> bool:
    import torch
    return loss is not None and not bool(torch.isfinite(loss).all())


# --------------------------------------------------------------------------------------------------
# Where a run starts
# --------------------------------------------------------------------------------------------------


def load_plan(ck, find_checkpoint) -> tuple[str | None, bool, int | None]:
    """(directory to load from, finetune?, --ckpt-step) for the checkpoint flags.

    A run resumes from `--save` when `--save` already holds a checkpoint and `--load` is not given (relaunch
    of the same command), or when it is a `--finetune` run (the checkpoint in `--save` is this run's own:
    finetuning from `--load` again would throw its progress away, truncate its metrics and overwrite its
    newer checkpoints). `--save` equal to `--load` with `--finetune` is refused by config_rules (finetune-save-is-load)."""
    saved = ck.save is not None and os.path.isdir(ck.save) and find_checkpoint(ck.save) is not None
    if ck.finetune and saved:
        return ck.save, False, None
    if ck.load is None and saved:
        return ck.save, False, None
    return ck.load, ck.finetune, ck.ckpt_step


def check_resume_iteration(iteration: int, train_iters: int, load_dir: str) -> str | None:
    """A resumed run at `iteration`: UserError past `--train-iters` (the command cannot be what was meant),
    a line to print when exactly there (a finished run relaunched: nothing to do, exit 0, as Megatron)."""
    if iteration > train_iters:
        raise UserError(f"the checkpoint in {load_dir} is at iteration {iteration}, past --train-iters "
                        f"({train_iters}): nothing to train; raise --train-iters (or --train-samples) to continue, "
                        f"or point --load elsewhere")
    if iteration == train_iters:
        return f"> the checkpoint in {load_dir} is at --train-iters ({train_iters}): training is already done"
    return None


def no_validation_warning(cfg, valid_ds) -> str | None:
    """A warning line when evaluation is asked for (--eval-iters > 0) but there is no validation data."""
    t = cfg.training
    if valid_ds is not None or t.eval_iters == 0 or cfg.data.mock_data:
        return None
    return (f"warning: --split {cfg.data.split} leaves no validation documents: evaluation (--eval-iters "
            f"{t.eval_iters}, --eval-interval {t.eval_interval}) is skipped; pass --eval-iters 0 to silence this")
