"""Multi-latent attention on the CPU (issue 54 item 10): one attention layer, forward + backward, against multi-head
attention of the same FLOPs; its time and the activation memory it keeps for the backward.

    python bench/step/mla_layer.py                    # bench/results/mla_layer.md
    python bench/step/mla_layer.py --quick --out x.md # tiny sizes (tests/test_mla_bench.py)

MLA (models/mla.py) at DeepSeek-V3's proportions, shrunk: hidden h, n heads, query/key heads of d_n + d_r (the
rotary part's key shared by the heads), value heads of d_v, a query latent r_q and a key/value latent r_kv, YaRN.
MHA (models/transformer.py's SelfAttention, RoPE) with the same h and n and the (even) head dimension d whose forward
FLOPs per token come closest to MLA's: 4 h n d (QKV and output projections) + 2 s n d (scores and weighted values),
twice that in FLOPs, against flops.mla_multiply_adds_per_token (Megatron's MLA count), both over the full s x s
square, the convention of flops.py. The printed FLOPs are those two counts.

Time: the median over repetitions of the CPU time one forward + backward takes (time.process_time, one thread:
the waits for a core on a shared machine left out), the variants alternating repetition by repetition; the ratio
of those medians to MHA's, and of the wall times. Memory (deterministic; bench/memory/memory.py's tracker): the
bytes of the tensors the forward made that are still alive when it returns, i.e. what autograd keeps for the
backward, and the most bytes alive at once over forward + backward. fp32 and bf16; the core through PyTorch's
fused kernel (--attention-backend auto; MLA's values padded to the query/key head dimension on a CPU) and, for MLA,
through the math kernel (--attention-backend local), which keeps the [b, n, s, s] probabilities.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402
from memory import LiveTensors  # noqa: E402

from bench_common import Lines, load_at_end, markdown_table  # noqa: E402
from megatron_po.config import ModelConfig  # noqa: E402
from megatron_po.flops import mla_multiply_adds_per_token  # noqa: E402
from megatron_po.models.mla import MultiLatentAttention, mla_rotary  # noqa: E402
from megatron_po.models.transformer import RotaryEmbedding, SelfAttention  # noqa: E402

# hidden, heads, d_n, d_r, d_v, r_q, r_kv, sequence, micro-batch, repetitions. The full size keeps DeepSeek-V3's
# ratios where the CPU allows: d_n = d_v = 2 d_r, r_kv = 4 d_n, r_q = 3 r_kv (7168, 128, 128, 64, 128, 1536, 512).
SIZES = {"full": (1024, 16, 64, 32, 64, 768, 256, 1024, 1, 7), "quick": (64, 4, 16, 8, 16, 48, 32, 64, 1, 2)}


def configs(size: str) -> tuple[ModelConfig, ModelConfig]:
    """(MLA, MHA of the closest FLOPs)."""
    h, n, d_n, d_r, d_v, r_q, r_kv, seq, *_ = SIZES[size]
    common = dict(num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=seq, hidden_dropout=0.0,
                  attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope")
    mla = ModelConfig(**common, multi_latent_attention=True, q_lora_rank=r_q, kv_lora_rank=r_kv, qk_head_dim=d_n,
                      qk_pos_emb_head_dim=d_r, v_head_dim=d_v, qk_layernorm=True, rotary_scaling_factor=40.0,
                      mscale_all_dim=1.0)
    head_dim = 2 * round(mla_multiply_adds_per_token(mla) / (n * (4 * h + 2 * seq)) / 2)  # even: RoPE
    return mla, ModelConfig(**common, kv_channels=head_dim)


def mha_multiply_adds_per_token(m: ModelConfig) -> float:
    a = m.num_attention_heads * m.kv_channels
    return 4 * m.hidden_size * a + 2 * m.seq_length * a


def build(cfg: ModelConfig, dtype: torch.dtype):
    """The attention layer and its rotary cos/sin."""
    torch.manual_seed(0)
    if cfg.multi_latent_attention:
        layer, rotary = MultiLatentAttention(cfg, False), mla_rotary(cfg)
    else:
        layer, rotary = SelfAttention(cfg, False), RotaryEmbedding(cfg.kv_channels, cfg.rotary_base)
    cos, sin = rotary(cfg.seq_length, torch.device("cpu"))
    return layer.to(dtype), (cos.to(dtype), sin.to(dtype))


def step(layer, rotary, x, grad, tracker=None) -> tuple[int, int]:
    """One forward + backward: (bytes kept after the forward, peak bytes) under `tracker`, else (0, 0)."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    if tracker is None:
        layer(x, rotary).backward(grad)
        return 0, 0
    with tracker:
        out = layer(x, rotary)
        kept = tracker.live
        out.backward(grad)
    return kept, tracker.peak


def measure(size: str, dtype: torch.dtype) -> dict:
    mla, mha = configs(size)
    *_, seq, batch, reps = SIZES[size]
    variants = {"MHA": build(mha, dtype), "MLA": build(mla, dtype),
                "MLA, math kernel": build(dataclasses.replace(mla, attention_backend="local"), dtype)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seq, batch, mla.hidden_size, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(seq, batch, mla.hidden_size, generator=gen).to(dtype)
    rows = {}
    for name, (layer, rotary) in variants.items():  # memory (one tracked step each), and a warm-up
        kept, peak = step(layer, rotary, x, grad, LiveTensors())
        rows[name] = {"kept_bytes": kept, "peak_bytes": peak, "cpu": [], "wall": []}
    for _ in range(reps):
        for name, (layer, rotary) in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step(layer, rotary, x, grad)
            rows[name]["wall"].append(time.perf_counter() - start)
            rows[name]["cpu"].append(time.process_time() - start_cpu)
    for row in rows.values():
        row["cpu_median"], row["wall_median"] = statistics.median(row["cpu"]), statistics.median(row["wall"])
        row["params"] = 0
    for name, (layer, _) in variants.items():
        rows[name]["params"] = sum(p.numel() for p in layer.parameters())
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_common.offline_env()
    ap = bench_common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes in seconds (the CPU test)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    ap.add_argument("--out", default=os.path.join(bench_common.RESULTS, "mla_layer.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    started = time.perf_counter()
    out = Lines(bench_common.header(__file__, argv, "Multi-latent attention against multi-head attention of the same "
                                                    "FLOPs, on the CPU"))
    if args.quick:
        out.emit("> **Quick size: tiny shapes; the ratios measure nothing, the FLOP counts and bytes are exact.**")
        out.emit()
    mla, mha = configs(size)
    h, n, d_n, d_r, d_v, r_q, r_kv, seq, batch, reps = SIZES[size]
    flops = {"MLA": 2 * mla_multiply_adds_per_token(mla), "MHA": 2 * mha_multiply_adds_per_token(mha)}
    out.emit(f"Hidden {h}, {n} heads, {seq} x {batch} tokens. MLA: query/key heads {d_n} + {d_r} (rotary, the key's "
             f"shared), value heads {d_v}, latents q {r_q} and kv {r_kv}, YaRN (factor 40); MHA: heads of "
             f"{mha.kv_channels}. Forward FLOPs per token: MLA {flops['MLA'] / 1e6:.3f} M, MHA "
             f"{flops['MHA'] / 1e6:.3f} M ({flops['MHA'] / flops['MLA']:.3f} of MLA's). {torch.get_num_threads()} "
             f"thread(s); {reps} alternating repetitions after one tracked warm-up.")
    out.emit()
    figures = {"sizes": SIZES[size], "mha_head_dim": mha.kv_channels, "flops_per_token": flops, "dtypes": {}}
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        rows = measure(size, dtype)
        figures["dtypes"][name] = rows
        base = rows["MHA"]
        for variant, r in rows.items():
            table.append([name, variant, f"{r['params'] / 1e6:.3f}", f"{r['cpu_median'] * 1e3:.1f}",
                          f"{r['cpu_median'] / base['cpu_median']:.2f}", f"{r['wall_median'] * 1e3:.1f}",
                          f"{r['wall_median'] / base['wall_median']:.2f}", f"{r['kept_bytes'] / 2**20:.2f}",
                          f"{r['kept_bytes'] / base['kept_bytes']:.2f}", f"{r['peak_bytes'] / 2**20:.2f}"])
    out.emit(markdown_table(["dtype", "attention", "params (M)", "CPU ms", "/ MHA", "wall ms", "/ MHA, wall",
                             "kept for backward (MiB)", "/ MHA", "peak (MiB)"], table))
    out.emit()
    out.emit("CPU ms: median CPU time of one forward + backward; / MHA: the ratio of the medians. Kept for backward: "
             "bytes of the tensors the forward made that are alive when it returns (the input, the weights and the "
             "gradients are not counted); peak: most bytes alive at once over forward + backward.")
    out.emit()
    out.emit(load_at_end(started))
    out.write(args.out)
    bench_common.write_text(os.path.splitext(args.out)[0] + ".json", json.dumps(  # tests/test_mla_bench.py reads it
        {"command": bench_common.command_line(bench_common.script(__file__), argv), "size": size,
         "machine": bench_common.machine(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
