"""Multi-token prediction's cost per token on the CPU (issue 54 item 10): our training step (bench/step/overhead.py's
`build_ours`: GPTModel, DDP buffer, AdamW, clipping) with --mtp-num-layers 0, 1 and 2, against the arithmetic.

    python bench/step/mtp_cost.py                    # bench/results/mtp_cost.md (and .json)
    python bench/step/mtp_cost.py --quick --out x.md # tiny sizes (tests/test_mtp.py)

The variants alternate step by step (machine noise hits them alike) after two warm-up steps; each step's CPU time
(time.process_time, one thread: the waits for a core on a shared machine left out) and wall time. Their ratios to
the step without MTP, the ratio of the medians, against the ratio of the model FLOPs per token that
`flops.gpt_flops_per_token` counts (each depth one layer, the 2h -> h projection and the output layer once more;
models/mtp.py). What the FLOPs leave out shows as the difference: the depths' norms, the embedding lookup of the
shifted tokens, the roll, the second cross entropy's softmax and the optimizer step over the depths' parameters.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402
from overhead import build_ours  # noqa: E402

from bench_common import Lines, load_at_end, markdown_table  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.flops import gpt_flops_per_token  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed  # noqa: E402
from megatron_po.training_step import train_step  # noqa: E402

SIZES = {"full": dict(hidden=512, heads=8, layers=4, seq=512, batch=4, vocab=8192, steps=7),
         "quick": dict(hidden=32, heads=2, layers=2, seq=16, batch=2, vocab=64, steps=1)}
DEPTHS = (0, 1, 2)


def config(size: dict, depths: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(num_layers=size["layers"], hidden_size=size["hidden"], num_attention_heads=size["heads"],
                            seq_length=size["seq"], hidden_dropout=0.0, attention_dropout=0.0,
                            position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                            add_bias_linear=False, untie_embeddings_and_output_weights=True,
                            mtp_num_layers=depths or None)
    cfg.training.clip_grad = 1.0
    return cfg


def measure(size: dict) -> dict:
    """Per variant: the CPU and wall seconds of every timed step, and the model FLOPs of one step."""
    torch.set_num_threads(1)
    batch = bench_common.gpt_batches(1, size["batch"], size["seq"], size["vocab"])[0]
    steps, flops = {}, {}
    for depths in DEPTHS:
        torch.manual_seed(0)
        model_parallel_seed(0)
        cfg = config(size, depths)
        model, ddp, opt = build_ours(cfg, size["vocab"], False)
        steps[depths] = (lambda cfg=cfg, model=model, ddp=ddp, opt=opt:
                         train_step(cfg, [model], ddp, opt, [batch], 1e-4))
        flops[depths] = gpt_flops_per_token(cfg, size["vocab"]) * size["batch"] * size["seq"]
    for step in steps.values():  # warm-up
        step()
        step()
    cpu, wall = {d: [] for d in DEPTHS}, {d: [] for d in DEPTHS}
    for _ in range(size["steps"]):
        for depths, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[depths].append(time.perf_counter() - start)
            cpu[depths].append(time.process_time() - start_cpu)
    return {"cpu": cpu, "wall": wall, "flops": flops}


def report(size_name: str, out: Lines) -> dict:
    size = SIZES[size_name]
    r = measure(size)
    tokens = size["batch"] * size["seq"]
    out.emit(f"Our training step (forward, backward, gradient clipping, AdamW; bench/step/overhead.py's `build_ours`) of "
             f"a {size['layers']}-layer GPT (hidden {size['hidden']}, {size['heads']} heads, SwiGLU, RMSNorm, RoPE, "
             f"untied output layer, vocab {size['vocab']}), {tokens} tokens ({size['seq']} x {size['batch']}) per step, "
             f"fp32, {torch.get_num_threads()} thread(s); {size['steps']} alternating steps per variant after two "
             f"warm-up steps.")
    out.emit()
    rows, figures = [], {}
    base_cpu, base_wall = statistics.median(r["cpu"][0]), statistics.median(r["wall"][0])
    for depths in DEPTHS:
        cpu, wall = statistics.median(r["cpu"][depths]), statistics.median(r["wall"][depths])
        flops_ratio = r["flops"][depths] / r["flops"][0]
        paired = sorted(a / b for a, b in zip(r["cpu"][depths], r["cpu"][0]))
        figures[depths] = {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "cpu_ratio": cpu / base_cpu,
                           "wall_ratio": wall / base_wall, "flops_ratio": flops_ratio,
                           "gflop_per_step": r["flops"][depths] / 1e9}
        rows.append([str(depths), f"{r['flops'][depths] / tokens / 1e6:.2f}", f"{flops_ratio:.3f}",
                     f"{cpu * 1e3:.0f}", f"{cpu / base_cpu:.3f}", f"{paired[0]:.3f} - {paired[-1]:.3f}",
                     f"{1e6 * cpu / tokens:.1f}", f"{wall * 1e3:.0f}", f"{wall / base_wall:.3f}"])
    out.emit(markdown_table(["MTP depths", "MFLOP / token", "FLOPs / no MTP", "CPU ms / step", "CPU / no MTP",
                             "per step", "CPU µs / token", "wall ms / step", "wall / no MTP"], rows))
    out.emit()
    out.emit("MFLOP / token: `flops.gpt_flops_per_token` (forward + backward, Megatron's convention); FLOPs / no MTP: "
             "its ratio to the model without MTP (the arithmetic); CPU ms / step: the median CPU time of one step; "
             "CPU / no MTP: the ratio of those medians (the measurement to read against the arithmetic); per step: "
             "the smallest and largest ratio of one round's CPU times; wall: the same from the wall clock.")
    out.emit()
    return figures


def main():
    ap = bench_common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one timed step")
    ap.add_argument("--out", default="bench/results/mtp_cost.md")
    args = ap.parse_args()
    started = time.perf_counter()
    out = Lines(bench_common.header(__file__, sys.argv[1:], "Multi-token prediction's cost per token on the CPU"))
    os.environ.setdefault("MASTER_PORT", "29518")
    ps.init_distributed()
    ps.initialize_model_parallel(1, 1)
    size = "quick" if args.quick else "full"
    figures = report(size, out)
    out.emit(load_at_end(started))
    out.write(args.out)
    bench_common.write_json_atomic(os.path.splitext(args.out)[0] + ".json",
                                   {"command": out.lines[2], "sizes": SIZES[size], "figures": figures})
    return figures


if __name__ == "__main__":
    main()
