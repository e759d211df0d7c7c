"""The MoE layer on the CPU (issue 48 item 9), every figure from one run: its speed against a dense MLP of the same
active FLOPs, the bytes its alltoall dispatcher moves per token, and the expert bytes each rank holds per EP size.

    python bench/step/moe_layer.py                    # bench/results/moe_layer.md
    python bench/step/moe_layer.py --quick --out x.md # tiny sizes, every part (tests/test_moe_bench.py)

1. Speed. One MoE layer (megatron_po/models/moe/layer.py: 8 experts of f_e, top-2, dropless, softmax router, no
   auxiliary loss) forward + backward against the dense MLP (models/transformer.py's MLP) of hidden k x f_e: the
   same expert FLOPs per token, the MoE's router adding h x E (E / (k g f_e) of them). The experts as one
   torch._grouped_mm per projection (--moe-grouped-gemm; where it cannot run here, experts.grouped_mm_error, the
   row says why) and as the loop over the experts, fp32 and bf16 (the loop as experts.py wrote it before this
   benchmark, `weight[e]` per expert, was a row until commit 4c2b6b0: bench/results/moe_layer.md). The variants
   alternate repetition by repetition; the ratio of the median CPU times (time.process_time, one thread: the waits
   for a core on a shared machine left out) to the dense MLP's, and of the wall times. Target (issue 48): <= 1.5x.
2. Dispatcher bytes. A real EP = 2 run on gloo (two forked ranks, tests/dist_harness.py): a GPT of 2 MoE layers
   with --moe-token-dispatcher-type alltoall, one micro-batch forward then backward, with every
   `dist.all_to_all_single` counted (the dispatcher's only collective at expert TP 1): the token rows' bytes
   over both ranks and MoE layers, per token, against the arithmetic h x k x 2 directions (dispatch, combine) x
   bytes per element, in the forward and again in the backward; the rows that leave their rank; the per-expert
   count exchange apart (E integers per rank, layer and micro-batch).
3. Expert bytes per rank. The same kind of GPT at EP = 1, 2, 4 (EP ranks = DP ranks, each size in processes of its
   own, forked fresh), DDP's buffer and the plain Adam, one training step: rank 0's bytes of expert parameters,
   their gradients (their slice of the buffer) and their optimizer state, against 1/EP of EP = 1's; the dense
   parameters' bytes beside them (unchanged by EP).
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
import torch.distributed as dist  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

from bench_common import Lines, load_at_end, markdown_table  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import ModelConfig  # noqa: E402
from megatron_po.models.moe.experts import grouped_mm_error  # noqa: E402
from megatron_po.models.moe.layer import MoELayer  # noqa: E402
from megatron_po.models.transformer import MLP  # noqa: E402

TARGET = 1.5  # MoE layer / dense MLP of the same active FLOPs, forward + backward (issue 48)
EXPERTS, TOPK = 8, 2
# (hidden, expert ffn, sequence, micro-batch, repetitions) of part 1; (hidden, expert ffn, sequence) of parts 2, 3
SIZES = {"full": {"layer": (512, 512, 512, 4, 15), "gpt": (64, 128, 64)},
         "quick": {"layer": (64, 64, 32, 2, 2), "gpt": (32, 32, 16)}}


def moe_cfg(hidden: int, ffn: int, seq: int, **kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, seq_length=seq, num_experts=EXPERTS,
                       moe_router_topk=TOPK, moe_ffn_hidden_size=ffn, hidden_dropout=0.0, attention_dropout=0.0, **kw)


# --------------------------------------------------------------------------------------------------
# 1. The layer's speed against the dense MLP
# --------------------------------------------------------------------------------------------------


def time_layers(hidden: int, ffn: int, seq: int, batch: int, reps: int, dtype: torch.dtype) -> dict:
    """Median seconds of forward + backward per variant (alternating), and the variants' output difference."""
    cfg = moe_cfg(hidden, ffn, seq)
    layers = {}
    for name, grouped in (("looped", False), ("grouped", True)):
        why = grouped_mm_error("cpu", dtype, (hidden, ffn)) if grouped else None
        if why is not None:
            layers[name] = why
            continue
        torch.manual_seed(0)  # the same weights for all
        layers[name] = MoELayer(dataclasses.replace(cfg, moe_grouped_gemm=grouped), False, 0).to(dtype)
    layers["dense"] = MLP(cfg, False, TOPK * ffn).to(dtype)
    runnable = {n: m for n, m in layers.items() if not isinstance(m, str)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seq, batch, hidden, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(seq, batch, hidden, generator=gen).to(dtype)
    outs = {}

    def step(module):
        for p in module.parameters():
            p.grad = None
        x.grad = None
        out = module(x)
        out.backward(grad)
        return out.detach()

    for name, module in runnable.items():  # warm-up, and the outputs to compare
        outs[name] = step(module)
    times, cpu = {n: [] for n in runnable}, {n: [] for n in runnable}
    for _ in range(reps):
        for name, module in runnable.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step(module)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    diff = (outs["grouped"] - outs["looped"]).abs().max().item() if "grouped" in outs else None
    return {"seconds": {n: statistics.median(t) for n, t in times.items()}, "times": times, "cpu_times": cpu,
            "not_run": {n: m for n, m in layers.items() if isinstance(m, str)}, "grouped_vs_looped_max_diff": diff}


def part_layer(size: str, out: Lines) -> dict:
    hidden, ffn, seq, batch, reps = SIZES[size]["layer"]
    tokens = seq * batch
    expert_flops = 3 * 2 * TOPK * 2 * hidden * ffn  # per token, forward + backward: k experts, two projections
    router_flops = 3 * 2 * hidden * EXPERTS
    out.emit("## 1. The MoE layer against the dense MLP of the same active FLOPs, forward + backward")
    out.emit()
    out.emit(f"{EXPERTS} experts of {ffn}, top-{TOPK}, dropless, hidden {hidden}, {tokens} tokens ({seq} x {batch}); "
             f"the dense MLP of hidden {TOPK * ffn} (GELU): {expert_flops * tokens / 1e9:.3f} GFLOP each, the MoE's "
             f"router {router_flops * tokens / 1e9:.4f} more ({100 * router_flops / expert_flops:.2f} %). "
             f"{torch.get_num_threads()} thread(s); {reps} alternating repetitions after one warm-up.")
    out.emit()
    rows, figures = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        r = time_layers(hidden, ffn, seq, batch, reps, dtype)
        dense = r["seconds"]["dense"]
        figures[name] = r
        cpu = {n: statistics.median(t) for n, t in r["cpu_times"].items()}
        rows.append([name, "dense MLP", f"{cpu['dense'] * 1e3:.1f}", "1.00", "", f"{r['seconds']['dense'] * 1e3:.1f}",
                     "1.00", ""])
        for variant in ("looped", "grouped"):
            if variant in r["not_run"]:
                rows.append([name, f"MoE, {variant}", "not run", "", "", "", "", r["not_run"][variant]])
                continue
            paired = sorted(a / b for a, b in zip(r["cpu_times"][variant], r["cpu_times"]["dense"]))
            ratio = cpu[variant] / cpu["dense"]
            r[f"{variant}_over_dense"], r[f"{variant}_over_dense_wall"] = ratio, r["seconds"][variant] / dense
            rows.append([name, f"MoE, {variant}", f"{cpu[variant] * 1e3:.1f}", f"{ratio:.2f}",
                         f"{paired[0]:.2f} - {paired[-1]:.2f}", f"{r['seconds'][variant] * 1e3:.1f}",
                         f"{r[f'{variant}_over_dense_wall']:.2f}", "met" if ratio <= TARGET else "NOT MET"])
    out.emit(markdown_table(["dtype", "", "CPU ms", "/ dense", "per repetition", "wall ms", "/ dense, wall",
                             f"target <= {TARGET}x"], rows))
    out.emit()
    out.emit("CPU ms: the median over the repetitions of the CPU time the process spent on one forward + backward "
             "(time.process_time: one thread, so time spent waiting for a core on a shared machine is left out); "
             "/ dense: the ratio of those medians, where the target is read; per repetition: the smallest and "
             "largest ratio of one repetition's CPU times. Wall ms and its ratio: the same from the wall clock.")
    out.emit()
    diffs = {n: f["grouped_vs_looped_max_diff"] for n, f in figures.items()}
    out.emit("Grouped against looped, the same weights and input: largest |difference| of the outputs "
             + ", ".join(f"{n} {d:.3g}" if d is not None else f"{n} n/a" for n, d in diffs.items()) + ".")
    out.emit()
    return figures


# --------------------------------------------------------------------------------------------------
# 2. The bytes the alltoall dispatcher moves, counted on EP = 2
# --------------------------------------------------------------------------------------------------


def _all_to_all_seen(calls: list, phase: list):
    """A `see` of dist.all_to_all_single (bench_common.watching; the dispatcher looks it up at call time): every call's
    phase, dtype, bytes sent and bytes sent to this rank itself, into `calls`."""
    def see(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        me = dist.get_rank(group)
        to_self = (input_split_sizes[me] if input_split_sizes else input.shape[0] // dist.get_world_size(group)) * row
        calls.append({"phase": phase[0], "floating": input.is_floating_point(), "dtype": str(input.dtype),
                      "bytes": input.numel() * input.element_size(), "to_self": to_self})
    return see


def dispatch_rank(hidden: int, ffn: int, seq: int, dtype_name: str) -> dict:
    from megatron_po.models.gpt import GPTModel
    from megatron_po.tensor_parallel import model_parallel_seed
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(2, None)
    model_parallel_seed(3)
    vocab, batch = 128, 2
    cfg = moe_cfg(hidden, ffn, seq, moe_token_dispatcher_type="alltoall", make_vocab_size_divisible_by=8)
    model = GPTModel(cfg, vocab, 3).to(getattr(torch, dtype_name))
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    calls, phase = [], ["forward"]
    with bench_common.watching(dist, "all_to_all_single", _all_to_all_seen(calls, phase)):
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        phase[0] = "backward"
        loss.backward()
    return {"calls": calls, "tokens": batch * seq}


def dispatch_bytes(hidden: int, ffn: int, seq: int, dtype_name: str) -> dict:
    """Per token, over both ranks and the 2 MoE layers: the token rows' bytes in the forward and in the backward,
    the part that left its rank, and the per-expert count exchange's bytes per rank, layer and micro-batch."""
    ranks = run_distributed(dispatch_rank, 2, args=(hidden, ffn, seq, dtype_name), timeout=300)
    tokens, layers = sum(r["tokens"] for r in ranks), 2
    element = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    out = {"arithmetic": hidden * TOPK * 2 * element, "tokens": tokens, "element_size": element}
    for phase in ("forward", "backward"):
        rows = [c for r in ranks for c in r["calls"] if c["phase"] == phase and c["floating"]]
        out[phase] = sum(c["bytes"] for c in rows) / tokens / layers
        out[f"{phase}_left_rank"] = sum(c["bytes"] - c["to_self"] for c in rows) / tokens / layers
        out[f"{phase}_calls"] = len(rows)
    counts = [c for r in ranks for c in r["calls"] if not c["floating"]]
    out["count_exchange_bytes"] = sum(c["bytes"] for c in counts) / len(ranks) / layers
    return out


def part_dispatch(size: str, out: Lines) -> dict:
    hidden, ffn, seq = SIZES[size]["gpt"]
    out.emit("## 2. Bytes the alltoall dispatcher moves per token, counted on EP = 2 (gloo)")
    out.emit()
    out.emit(f"GPT of 2 MoE layers, hidden {hidden}, {EXPERTS} experts of {ffn}, top-{TOPK}, dropless, "
             f"--moe-token-dispatcher-type alltoall; 2 ranks x 2 x {seq} tokens; every `dist.all_to_all_single` "
             "counted, the token rows per token and MoE layer (dispatch + combine) against hidden x top-k x 2 x bytes.")
    out.emit()
    rows, figures = [], {}
    for dtype_name in ("float32", "bfloat16"):
        r = dispatch_bytes(hidden, ffn, seq, dtype_name)
        figures[dtype_name] = r
        for phase in ("forward", "backward"):
            r[f"{phase}_equal"] = r[phase] == r["arithmetic"]
            rows.append([dtype_name, phase, f"{r[phase]:g}",
                         f"{hidden} x {TOPK} x 2 x {r['element_size']} = {r['arithmetic']}",
                         "equal" if r[f"{phase}_equal"] else "NOT EQUAL", f"{r[f'{phase}_left_rank']:.1f}",
                         r[f"{phase}_calls"]])
    out.emit(markdown_table(["dtype", "pass", "bytes / token / layer", "arithmetic", "", "of which left its rank",
                             "calls (both ranks)"], rows))
    out.emit()
    out.emit(f"Besides the tokens: the per-expert counts, {figures['float32']['count_exchange_bytes']:g} bytes per "
             "rank, layer and micro-batch (int64, forward only). The rows that leave their rank follow the routing "
             "(about (EP - 1) / EP of them when the experts are evenly loaded).")
    out.emit()
    return figures


# --------------------------------------------------------------------------------------------------
# 3. Expert bytes per rank at EP = 1, 2, 4
# --------------------------------------------------------------------------------------------------


def memory_rank(hidden: int, ffn: int, seq: int, ep: int) -> dict:
    from megatron_po.distributed.ddp import DistributedDataParallel, is_expert
    from megatron_po.models.gpt import GPTModel, masked_mean_loss
    from megatron_po.optim import build_optimizer
    from megatron_po.tensor_parallel import model_parallel_seed
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(ep, None)
    model_parallel_seed(3)
    vocab = 128
    model = GPTModel(moe_cfg(hidden, ffn, seq, make_vocab_size_divisible_by=8), vocab, 3)
    ddp = DistributedDataParallel([model], ps.get_data_parallel_group())
    params = list(model.parameters())
    opt = build_optimizer("adam", params, lr=1e-4)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = masked_mean_loss(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(2, seq))
    ddp.zero_grad()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()

    def nbytes(t):
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    out = {}
    for kind, chosen in (("expert", [p for p in params if is_expert(p)]), ("dense", [p for p in params
                                                                                     if not is_expert(p)])):
        out[kind] = {"params": sum(map(nbytes, chosen)), "grads": sum(nbytes(p.main_grad) for p in chosen),
                     "optimizer": sum(nbytes(v) for p in chosen for v in opt.state[p].values() if v.dim() > 0),
                     "count": sum(p.numel() for p in chosen)}
    return out


def part_memory(size: str, out: Lines) -> dict:
    hidden, ffn, seq = SIZES[size]["gpt"]
    out.emit("## 3. Expert bytes per rank at EP = 1, 2, 4")
    out.emit()
    out.emit(f"GPT of 2 MoE layers, hidden {hidden}, {EXPERTS} experts of {ffn}, fp32, DDP, plain Adam, one step; "
             "EP ranks = DP ranks, each EP size in freshly forked processes; rank 0's bytes.")
    out.emit()
    figures, rows = {}, []
    for ep in (1, 2, 4):
        figures[ep] = run_distributed(memory_rank, ep, args=(hidden, ffn, seq, ep), timeout=300)[0]
    base = figures[1]["expert"]
    for ep, f in figures.items():
        e, d = f["expert"], f["dense"]
        f["one_over_ep"] = all(e[k] * ep == base[k] for k in ("params", "grads", "optimizer", "count"))
        rows.append([ep, f"{e['count']:,}", f"{e['params']:,}", f"{e['grads']:,}", f"{e['optimizer']:,}",
                     f"{(e['params'] + e['grads'] + e['optimizer']) / (base['params'] + base['grads'] + base['optimizer']):.4f}",
                     "equal" if f["one_over_ep"] else "NOT EQUAL", f"{d['params'] + d['grads'] + d['optimizer']:,}"])
    out.emit(markdown_table(["EP", "expert parameters", "param bytes", "grad bytes", "Adam state bytes",
                             "/ EP = 1", "= 1/EP of EP = 1", "dense bytes (params + grads + state)"], rows))
    out.emit()
    return figures


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_common.offline_env()
    ap = bench_common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: every part in seconds (the CPU test)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of part 1 (default 1: a shared machine)")
    ap.add_argument("--out", default=os.path.join(bench_common.RESULTS, "moe_layer.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    started = time.perf_counter()
    out = Lines(bench_common.header(__file__, argv, "The MoE layer on the CPU: speed, dispatcher bytes, expert bytes"))
    if args.quick:
        out.emit("> **Quick size: tiny shapes; the speed ratios measure nothing, the byte counts are exact.**")
        out.emit()
    figures = {"layer": part_layer(size, out), "dispatch": part_dispatch(size, out), "memory": part_memory(size, out)}
    out.emit(load_at_end(started))
    out.write(args.out)
    bench_common.write_text(os.path.splitext(args.out)[0] + ".json", json.dumps(  # the figures: tests/test_moe_bench.py
        {"command": bench_common.command_line(bench_common.script(__file__), argv), "size": size,
         "machine": bench_common.machine(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
