"""`--optimizer NAME` -> the optimizer: the one place that knows every optimizer class.

It sits above optimizers.py and the optimizers built on it (muon.py, nadamw.py, nag.py), so none of
them has to import another back (tests/test_structure.py: no import circle).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_po.errors import ConfigError
from megatron_po.optim.muon import Muon
from megatron_po.optim.nadamw import NAdamW
from megatron_po.optim.nag import NAG
from megatron_po.optim.optimizers import SGD, Adagrad, Adam, AdamW, Lion, PredictiveOptimizer, RMSprop

OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "nesterov", "rmsprop", "adagrad", "lion", "muon", "nadamw", "nag")

# --exp-avg-dtype / --exp-avg-sq-dtype values this code stores (fp8 is refused at start-up); fp32: the main params'
STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_aware_kwargs(training_config) -> dict:
    """`build_optimizer` keyword arguments of --use-precision-aware-optimizer's Adam state dtypes (TrainingConfig
    fields of the same names); none without the flag."""
    t = training_config
    if not t.use_precision_aware_optimizer:
        return {}
    return dict(exp_avg_dtype=STATE_DTYPES[t.exp_avg_dtype], exp_avg_sq_dtype=STATE_DTYPES[t.exp_avg_sq_dtype])


def build_optimizer(
    name: str,
    params: Iterable,
    lr: float,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    sgd_momentum: float = 0.9,
    sgd_direction: str = "buffer",
    lion_beta1: float = 0.9,
    lion_beta2: float = 0.99,
    muon_momentum: float = 0.95,
    muon_use_nesterov: bool = True,
    muon_num_ns_steps: int = 5,
    muon_scale_mode: str = "spectral",
    muon_extra_scale_factor: float = 0.2,
    muon_fp32_matmul_prec: str = "medium",
    muon_coefficient_type: str = "simple",
    muon_split_qkv: bool = True,
    muon_tp_mode: str = "duplicated",
    muon_gram_newton_schulz: bool = False,
    nadam_momentum_decay: float = 4e-3,
    compile_step: bool = False,
    exp_avg_dtype: torch.dtype | None = None,
    exp_avg_sq_dtype: torch.dtype | None = None,
) -> PredictiveOptimizer:
    """The optimizer named by `--optimizer`, from Megatron-style flag values.

    "adam" is Adam with L2 weight decay in the gradient and "adamw" decoupled decay, as in torch and the
    PipeOptim paper (Megatron-LM's own "adam" applies decoupled decay, i.e. is "adamw" here).
    "sgd" uses momentum `sgd_momentum` (Megatron's default 0.9; 0 gives plain SGD), "nesterov" the same
    with Nesterov momentum. RMSprop and Adagrad use torch's defaults for their other settings.
    "muon" (optim/muon.py) needs groups from `muon.optimizer_param_groups` (the use_muon split); its AdamW
    part uses the adam_* values.
    `compile_step` (--torch-compile): the per-group step, with PipeOptim's prediction fused into it, runs
    under torch.compile (optim/fused_prediction.py); otherwise eagerly, as foreach ops.
    `exp_avg_dtype`, `exp_avg_sq_dtype` (--use-precision-aware-optimizer): Adam's stored moments, adam and adamw only.
    Bad values raise ConfigError.
    """
    state_dtypes = dict(exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
    if name not in ("adam", "adamw") and any(d is not None for d in state_dtypes.values()):
        raise ConfigError(f"--exp-avg-dtype / --exp-avg-sq-dtype apply to --optimizer adam or adamw, not {name}")
    try:
        if name == "adam":
            optimizer = Adam(params, lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, weight_decay=weight_decay,
                             **state_dtypes)
        elif name == "adamw":
            optimizer = AdamW(params, lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, weight_decay=weight_decay,
                              **state_dtypes)
        elif name == "sgd":
            optimizer = SGD(params, lr, weight_decay=weight_decay, momentum=sgd_momentum,
                            direction=sgd_direction)
        elif name == "nesterov":
            optimizer = SGD(params, lr, weight_decay=weight_decay, momentum=sgd_momentum, nesterov=True)
        elif name == "rmsprop":
            optimizer = RMSprop(params, lr, weight_decay=weight_decay)
        elif name == "adagrad":
            optimizer = Adagrad(params, lr, weight_decay=weight_decay)
        elif name == "lion":
            optimizer = Lion(params, lr, betas=(lion_beta1, lion_beta2), weight_decay=weight_decay)
        elif name == "muon":
            optimizer = Muon(params, lr, momentum=muon_momentum, nesterov=muon_use_nesterov,
                             num_ns_steps=muon_num_ns_steps, scale_mode=muon_scale_mode,
                             extra_scale_factor=muon_extra_scale_factor, betas=(adam_beta1, adam_beta2),
                             eps=adam_eps, weight_decay=weight_decay, fp32_matmul_prec=muon_fp32_matmul_prec,
                             coefficient_type=muon_coefficient_type, split_qkv=muon_split_qkv, tp_mode=muon_tp_mode,
                             gram_newton_schulz=muon_gram_newton_schulz)
        elif name == "nadamw":  # optim/nadamw.py
            optimizer = NAdamW(params, lr, betas=(adam_beta1, adam_beta2), eps=adam_eps,
                               weight_decay=weight_decay, momentum_decay=nadam_momentum_decay)
        elif name == "nag":  # optim/nag.py: PipeNAG's dampened Nesterov step, momentum --sgd-momentum
            optimizer = NAG(params, lr, momentum=sgd_momentum, weight_decay=weight_decay)
        else:
            raise ConfigError(f"--optimizer {name!r} is unknown; choose one of: {', '.join(OPTIMIZER_NAMES)}")
    except ValueError as e:
        raise ConfigError(f"--optimizer {name}: {e}") from e
    optimizer.compile_fused_step = compile_step
    return optimizer
