"""Optimizers that can predict their own next steps (PipeOptim), mixed precision, grad clipping."""

from megatron_po.optim.build import OPTIMIZER_NAMES, build_optimizer
from megatron_po.optim.optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Lion,
    PredictiveOptimizer,
    RMSprop,
    param_groups,
)
from megatron_po.optim.muon import Muon, optimizer_param_groups
from megatron_po.optim.nadamw import NAdamW
from megatron_po.optim.nag import NAG

__all__ = [
    "OPTIMIZER_NAMES",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lion",
    "Muon",
    "NAdamW",
    "NAG",
    "PredictiveOptimizer",
    "RMSprop",
    "build_optimizer", "param_groups", "optimizer_param_groups",
]
