"""Bytes per parameter per rank: measured from the real tensors, next to Megatron's published table.

For DP in {1, 2, 4} (forked gloo ranks on this machine), builds a small GPT, the DDP gradient buffer and
the optimizer (Adam), takes one training step so the optimizer state exists, then adds up the storage
sizes of the weights, gradients, fp32 main params and optimizer state on rank 0
(megatron_po/optim/memory.py), divided by the number of model parameters. Rows:

  bf16 params, fp32 grads   --bf16 --accumulate-allreduce-grads-in-fp32     Megatron: 18 | 6 + 12/DP
  fp16 params, fp16 grads   --fp16                                          Megatron: 20 | 4 + 16/DP
  fp32 params, fp32 grads   (default)                                       Megatron: 16 | 8 + 8/DP

Where we differ from Megatron, by design: with fp16/bf16 grads in the model dtype our fp32 main grads are
a per-step temporary, not a persistent buffer (so 16 | 4 + 12/DP persistent, plus 4 bytes/param for the
duration of the step, 4/DP sharded); with fp32 params the distributed optimizer still keeps an fp32 main
shard apart from the weights (8 + 12/DP), which is what lets PipeOptim predict without a weight copy.

    python bench/memory.py [--hidden 128 --layers 4 --vocab 512]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the fork + gloo launcher the tests use

import torch  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import ModelConfig  # noqa: E402
from megatron_po.distributed.ddp import DistributedDataParallel  # noqa: E402
from megatron_po.models.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megatron_po.optim import build_optimizer  # noqa: E402
from megatron_po.optim.distributed_optimizer import DistributedOptimizer  # noqa: E402
from megatron_po.optim.memory import MEGATRON_BYTES_PER_PARAM, measure_training_memory  # noqa: E402
from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer  # noqa: E402

SETTINGS = {  # name: (model dtype, grad buffer dtype)
    "bf16 params, fp32 grads": (torch.bfloat16, torch.float32),
    "fp16 params, fp16 grads": (torch.float16, torch.float16),
    "fp32 params, fp32 grads": (torch.float32, torch.float32),
}


def measure(cfg: ModelConfig, vocab: int, setting: str, distributed: bool) -> dict:
    dtype, grad_dtype = SETTINGS[setting]
    torch.manual_seed(0)
    model = GPTModel(cfg, vocab, seed=1).to(dtype)
    ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), grad_dtype=grad_dtype,
                                  use_distributed_optimizer=distributed)
    params = list(model.parameters())

    def adam(groups):
        return build_optimizer("adam", groups, lr=1e-4)

    if distributed:
        opt = DistributedOptimizer(adam, params, ddp)
    elif dtype != torch.float32:
        opt = MixedPrecisionOptimizer(adam, params)
    else:
        opt = adam(params)
    tokens = torch.randint(0, vocab, (2, cfg.seq_length + 1))
    loss = masked_mean_loss(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(2, cfg.seq_length))
    ddp.zero_grad()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return measure_training_memory(params, ddp, opt).per_param()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, seq_length=32,
                      hidden_dropout=0.0, attention_dropout=0.0)
    n = sum(p.numel() for p in GPTModel(cfg, args.vocab, seed=1).parameters())
    build_optimizer("adam", [torch.zeros(1, requires_grad=True)], lr=1.0)  # lazy imports once, before forking
    print(f"GPT {args.layers} x {args.hidden}, vocab {args.vocab}: {n / 1e6:.2f} M parameters; Adam; bytes per "
          "parameter on rank 0, measured (storage sizes) vs Megatron's table")
    header = f"{'setting':<26} {'DP':>2} {'optimizer':<12} {'params':>7} {'grads':>7} {'main':>7} {'state':>7} " \
             f"{'total':>7} {'Megatron':>9}"
    print(header)
    print("-" * len(header))
    for setting, (plain_ref, sharded_ref) in MEGATRON_BYTES_PER_PARAM.items():
        for dp in (1, 2, 4):
            for distributed in (False, True):
                row = run_distributed(measure, dp, args=(cfg, args.vocab, setting, distributed))[0]
                ref = sharded_ref(dp) if distributed else plain_ref
                name = "distributed" if distributed else "plain"
                print(f"{setting:<26} {dp:>2} {name:<12} {row['params']:>7.2f} {row['grads']:>7.2f} "
                      f"{row['main_params']:>7.2f} {row['optimizer_state']:>7.2f} {row['total']:>7.2f} {ref:>9.2f}")
        print()


if __name__ == "__main__":
    main()
