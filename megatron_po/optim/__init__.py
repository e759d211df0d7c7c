"""Optimizers that can predict their own next steps (PipeOptim), mixed precision, grad clipping."""

# torch.optim imports torch._dynamo lazily, on the first call of a `_disable_dynamo` function (the first
# optimizer's add_param_group). That import leaves a reference cycle of frames (torch.fx.wrap keeps its own
# frame) whose f_back chain reaches the caller's frames: the first model and optimizer built in a process
# would stay alive after `del`, every byte of them, until a gc collection. Imported here, at module level,
# the chain ends at import statements. (~1 s, which the first optimizer would pay anyway.)
import torch._dynamo  # noqa: F401

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
