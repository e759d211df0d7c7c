"""Framework overhead and model FLOP utilisation, single process.

Prints, measured in the same run:
  1. the step time of megatron_po's training step (GPTModel, DDP grad buffer, predictive AdamW, global
     grad-norm clipping) over the step time of a plain PyTorch loop on the same architecture
     (nn.Linear / nn.LayerNorm / F.scaled_dot_product_attention / torch.optim.AdamW(foreach)),
     target <= 1.05x;
  2. the model FLOP/s of our step (Megatron's FLOPs formula, see flops.gpt_flops_per_token) over
     this machine's measured fp32 matmul peak, target >= 50% at hidden 512, seq 512.

    python bench/overhead.py [--hidden 512 --seq 512 --layers 4 --batch 4 --steps 6]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.distributed.ddp import DistributedDataParallel  # noqa: E402
from megatron_po.flops import gpt_flops_per_token  # noqa: E402
from megatron_po.models.gpt import GPTModel  # noqa: E402
from megatron_po.optim import build_optimizer, param_groups  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed  # noqa: E402
from megatron_po.training_step import train_step  # noqa: E402


# ---- the plain PyTorch baseline (nanoGPT-style, same math) ------------------------------------------

class PlainBlock(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.nh = nh
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # [s, b, h]
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, self.nh, 3 * (h // self.nh)).split(h // self.nh, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab, h, nh, layers, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, nh) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, idx, labels):
        x = (self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))[None]).transpose(0, 1)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied, like ours
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


def matmul_peak(n=2048, reps=10, device="cpu", dtype=torch.float32, warmup=1) -> float:
    """FLOP/s of an n x n x n product of random matrices: the mean over `reps` products after `warmup`
    (bench/gpu.py: bf16 on the GPU, synchronised around the timed products)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        a @ b
    synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.manual_seed(0)
    os.environ.setdefault("MASTER_PORT", "29517")
    ps.init_distributed()
    ps.initialize_model_parallel(1, 1)
    model_parallel_seed(0)

    cfg = Config()
    cfg.model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.training.clip_grad = 1.0
    ours = GPTModel(cfg.model, args.vocab, 0)
    ddp = DistributedDataParallel([ours], ps.get_data_parallel_group())
    opt = build_optimizer("adamw", param_groups([ours], 0.1), lr=1e-4, weight_decay=0.1)
    plain = PlainGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(args.batch, args.seq)}

    def our_step():
        train_step(cfg, [ours], ddp, opt, [batch], 1e-4)

    def plain_step():
        plain_opt.zero_grad(set_to_none=False)
        loss = plain(batch["tokens"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, foreach=True)
        plain_opt.step()

    for f in (our_step, plain_step):  # warm-up
        f()
    times = {"ours": [], "plain": []}
    for _ in range(args.steps):  # interleave so machine noise hits both alike
        for name, f in (("ours", our_step), ("plain", plain_step)):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    peak = matmul_peak()
    flops = gpt_flops_per_token(cfg, args.vocab) * args.batch * args.seq
    print(f"model: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}; threads {torch.get_num_threads()}")
    print(f"step time  ours {med['ours'] * 1e3:8.1f} ms | plain PyTorch {med['plain'] * 1e3:8.1f} ms | "
          f"ratio {med['ours'] / med['plain']:.3f}x (target <= 1.05x)")
    print(f"model FLOP/s {flops / med['ours'] / 1e9:7.1f} G | matmul peak {peak / 1e9:7.1f} G | "
          f"MFU {flops / med['ours'] / peak * 100:.1f}% (target >= 50%)")
    assert math.isfinite(med["ours"])


if __name__ == "__main__":
    main()
