"""Framework overhead and model FLOP utilisation, single process.

Prints, measured in the same run (the variants interleaved step by step, so machine noise hits them alike):
  1. the step time of megatron_po's training step (GPTModel, DDP grad buffer, predictive AdamW, global
     grad-norm clipping) over the step time of a plain PyTorch loop on the same architecture
     (nn.Linear / nn.LayerNorm / F.scaled_dot_product_attention / torch.optim.AdamW(foreach)),
     target <= 1.05x;
  2. the same compiled (skip with --no-compile): ours with --torch-compile (every transformer layer
     compiled, models/compiled_layers.py) over the plain model under `torch.compile(model)`, as a user
     compiles nanoGPT; target >= 1.0x the plain model's speed, i.e. a step-time ratio <= 1.0x (on a GPU:
     bench/gpu/gpu.py imports `PlainGPT` from here);
  3. the model FLOP/s of our step (Megatron's FLOPs formula, see flops.gpt_flops_per_token) over
     this machine's measured fp32 matmul peak, target >= 50% at hidden 512, seq 512.

    python bench/step/overhead.py [--hidden 512 --seq 512 --layers 4 --batch 4 --steps 6] [--results FILE]
    python bench/step/overhead.py --quick        # a tiny model, 2 steps (tests/test_compiled_layers.py runs it)

Compilation happens in the warm-up steps and is not timed (printed separately).
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.distributed.ddp import DistributedDataParallel  # noqa: E402
from megatron_po.flops import gpt_flops_per_token  # noqa: E402
from megatron_po.models.compiled_layers import compile_layers, compile_stats  # noqa: E402
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
    (bench/gpu/gpu.py: bf16 on the GPU, synchronised around the timed products)."""
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


QUICK = dict(hidden=64, heads=2, layers=2, seq=32, batch=2, vocab=256, steps=2)


def build_ours(cfg, vocab, compiled: bool):
    """Our model, DDP buffer and predictive AdamW; `compiled`: --torch-compile's layers."""
    model = GPTModel(cfg.model, vocab, 0)
    if compiled:
        compile_layers([model])
    ddp = DistributedDataParallel([model], ps.get_data_parallel_group())
    return model, ddp, build_optimizer("adamw", param_groups([model], 0.1), lr=1e-4, weight_decay=0.1)


def build_plain(args, compiled: bool):
    plain = PlainGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    return (torch.compile(plain) if compiled else plain), opt


def main():
    ap = bench_common.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-compile", action="store_true", help="the eager variants only")
    ap.add_argument("--quick", action="store_true", help=f"a tiny model: {QUICK}")
    ap.add_argument("--results", default=None, help="also write the table, command and load to this markdown file")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    started = time.perf_counter()
    head = bench_common.header(__file__, sys.argv[1:], "Framework overhead (bench/step/overhead.py)")  # (its load: now)
    torch.manual_seed(0)
    os.environ.setdefault("MASTER_PORT", "29517")
    ps.init_distributed()
    ps.initialize_model_parallel(1, 1)
    model_parallel_seed(0)

    cfg = Config()
    cfg.model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.training.clip_grad = 1.0
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(args.batch, args.seq)}

    def our_step(model, ddp, opt):
        return lambda: train_step(cfg, [model], ddp, opt, [batch], 1e-4)

    def plain_step(plain, opt):
        def step():
            opt.zero_grad(set_to_none=False)
            loss = plain(batch["tokens"], batch["labels"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, foreach=True)
            opt.step()
        return step

    variants = {"ours": our_step(*build_ours(cfg, args.vocab, False)), "plain": plain_step(*build_plain(args, False))}
    if not args.no_compile:
        variants["ours compiled"] = our_step(*build_ours(cfg, args.vocab, True))
        variants["plain compiled"] = plain_step(*build_plain(args, True))
    compile_seconds = {}
    for name, f in variants.items():  # warm-up: the compiled variants compile here (forward, then backward)
        t = time.perf_counter()
        f()
        f()
        compile_seconds[name] = time.perf_counter() - t
    times = {name: [] for name in variants}
    for _ in range(args.steps):  # interleave so machine noise hits every variant alike
        for name, f in variants.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    peak = matmul_peak()
    flops = gpt_flops_per_token(cfg, args.vocab) * args.batch * args.seq
    lines = [f"model: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
             f"batch {args.batch}, vocab {args.vocab}; fp32, {ps.get_device()}, threads {torch.get_num_threads()}, "
             f"torch {torch.__version__}; median of {args.steps} steps",
             f"step time  ours {med['ours'] * 1e3:8.1f} ms | plain PyTorch {med['plain'] * 1e3:8.1f} ms | "
             f"ratio {med['ours'] / med['plain']:.3f}x (target <= 1.05x)"]
    if not args.no_compile:
        ours_c, plain_c = med["ours compiled"], med["plain compiled"]
        lines += [f"compiled   ours {ours_c * 1e3:8.1f} ms | plain PyTorch {plain_c * 1e3:8.1f} ms | "
                  f"ratio {ours_c / plain_c:.3f}x (target <= 1.0x)",
                  f"speed-up from compiling: ours {med['ours'] / med['ours compiled']:.3f}x | plain "
                  f"{med['plain'] / med['plain compiled']:.3f}x",
                  f"warm-up (2 steps, compilation included): ours {compile_seconds['ours compiled']:.1f} s | plain "
                  f"{compile_seconds['plain compiled']:.1f} s; TorchDynamo: {compile_stats()}"]
    lines.append(f"model FLOP/s {flops / med['ours'] / 1e9:7.1f} G | matmul peak {peak / 1e9:7.1f} G | "
                 f"MFU {flops / med['ours'] / peak * 100:.1f}% (target >= 50%)")
    print("\n".join(lines))
    if args.results:  # the header's load is the start's
        bench_common.write_text(args.results, "\n".join(head + ["```", *lines, "```", "",
                                                                bench_common.load_at_end(started)]) + "\n")
    assert all(math.isfinite(t) for t in med.values())


if __name__ == "__main__":
    main()
