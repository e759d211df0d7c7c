"""How a config rule is written (config_rules.py holds the table of them) and what it reads.

A `Rule(name, holds, message, when)` is broken when `when` (None: always) and not `holds`; `message` is its
one error line, naming the flags and the rule (a string, or a function of the context for the values). A
`Check(name, find)` is a rule that needs code to find its error line (a parser, an import); `find` returns
the line or None. Both read a `Ctx`: the config's sections, the world size, the workload and the derived
sizes. `at_least` and `each` write one rule per flag of a list (its name carries the flag).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from megatron_po.config import (ASYNC_METHODS, Config, data_parallel_size, global_batch_size, num_microbatches,
                                rampup_batch_size, update_interval)
from megatron_po.errors import UserError


class Ctx:
    """What the rules read: the config's sections, the world size, the workload ("gpt" or "nmt"), and the
    derived sizes, each computed on first use (after the rules that make it well defined)."""

    def __init__(self, cfg: Config, world_size: int, workload: str):
        self.cfg, self.world, self.workload = cfg, world_size, workload
        self.m, self.p, self.d, self.t = cfg.model, cfg.parallel, cfg.data, cfg.training
        self.pr, self.lg, self.ck, self.n = cfg.precision, cfg.logging, cfg.checkpoint, cfg.nmt
        self.tp, self.pp = self.p.tensor_model_parallel_size, self.p.pipeline_model_parallel_size
        self.cp = self.p.context_parallel_size
        self.meth = self.p.pipeline_method
        self.is_async = self.meth in ASYNC_METHODS
        # NMT stacks the encoder and decoder layers (normalize_nmt); the pipeline splits their sum.
        self.layers_flag = "--encoder-num-layers + --decoder-num-layers" if workload == "nmt" else "--num-layers"

    @cached_property
    def dp(self) -> int:
        return data_parallel_size(self.cfg, self.world)

    @cached_property
    def gbs(self) -> int:
        return global_batch_size(self.cfg, self.world)

    @cached_property
    def mbs_dp(self) -> int:
        return self.t.micro_batch_size * self.dp

    @cached_property
    def num_mb(self) -> int:
        return num_microbatches(self.cfg, self.world)

    @cached_property
    def k(self) -> int:
        return update_interval(self.cfg)

    @cached_property
    def ramp(self) -> tuple[int, int, int] | None:
        return rampup_batch_size(self.cfg)


@dataclass(frozen=True)
class Rule:
    name: str  # its row in tests/test_config_rules.py
    holds: Callable[[Ctx], bool]  # True on a good config
    message: str | Callable[[Ctx], str]  # the error line where it does not hold
    when: Callable[[Ctx], bool] | None = None  # the rule applies only where this is True (None: always)

    def error(self, c: Ctx) -> str | None:
        if (self.when is None or self.when(c)) and not self.holds(c):
            return self.message(c) if callable(self.message) else self.message
        return None


@dataclass(frozen=True)
class Check:
    name: str  # its row in tests/test_config_rules.py
    find: Callable[[Ctx], str | None]  # the error line, or None
    when: Callable[[Ctx], bool] | None = None

    def error(self, c: Ctx) -> str | None:
        return self.find(c) if self.when is None or self.when(c) else None


def cuda_device() -> bool:
    """Whether this run's device is a GPU (for the rules whose answer depends on it)."""
    from megatron_po.parallel_state import get_device  # the one place that picks the device
    return get_device().type == "cuda"


def raised(fn) -> str | None:
    """The line of the ConfigError (or the data module's DataError, here a flag's) that `fn()` raises."""
    try:
        fn()
    except UserError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------------
# One rule per flag of a list
# --------------------------------------------------------------------------------------------------


def at_least(low: int, flags: list[tuple[str, Callable[[Ctx], object]]], optional: bool = False) -> list[Rule]:
    """`{flag} must be >= {low} (got {value})` for each (flag, value); `optional`: None is allowed."""
    def rule(flag, value):
        return Rule(f"{flag[2:]}>={low}", lambda c: (optional and value(c) is None) or value(c) >= low,
                    lambda c: f"{_flag_name(c, flag)} must be >= {low} (got {value(c)})")
    return [rule(flag, value) for flag, value in flags]


def _flag_name(c: Ctx, flag: str) -> str:
    """The flag as the workload reads it (NMT's layer count is the encoder's plus the decoder's)."""
    return c.layers_flag if flag == "--num-layers" else flag


def each(name: str, flags: list[tuple[str, Callable[[Ctx], bool]]], message: Callable[[Ctx, str], str],
         when=None) -> list[Rule]:
    """For each (flag, given): the rule `name` (with {flag} as the flag without --) that `given` is False."""
    def rule(flag, given):
        return Rule(name.format(flag=flag[2:]), lambda c: not given(c), lambda c: message(c, flag), when)
    return [rule(flag, given) for flag, given in flags]
