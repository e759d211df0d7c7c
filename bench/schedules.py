"""Pipeline schedule throughput: our executor vs its simulated bound vs torch.distributed.pipelining.

    python bench/schedules.py [--tf 0.02 --Ms 4 8 16 --reps 5]

Every rank is a forked process in a gloo group (tests/dist_harness.py). Three tables, all measured in
the same run and written to bench/results/schedules.md:

0. p2p cost per message on gloo: one-way latency of a raw isend/recv ping-pong, of our P2PTransport
   (header + payload), and the cost of a recv posted after the message was sent (gloo only moves the
   data once the receiver has posted its recv: a rendezvous round trip).
1. Synthetic stages, D=4: each (virtual) stage is an autograd Function that sleeps t_f in forward and
   t_b = 2 t_f in backward on a [mbs, 16] tensor (sleep releases the GIL and the CPU, so 4 stages run in
   parallel on 2 cores). Throughput in micro-batches/s over the ideal 1/(t_f+t_b) of one stage, for our
   gpipe, 1f1b, interleaved 1f1b (v=2, per-chunk costs halved) and the async no-flush stream, each next
   to the simulator's bound (`simulate`, with t_p2p = 0 and with the measured p2p cost) and to torch's
   ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B on the same sleeping stages. Ours runs through
   the real code path: `run_rank(build_schedule(...), StageRunner(..., P2PTransport))`.
   Async: steady-state throughput = (N2 - N1) / (T(N2) - T(N1)) for streams of N1 = 2M and N2 = 4M
   micro-batches (the fill and drain cancel); its bound is the same difference in the simulator.
2. The real tiny GPT at PP=2: tokens/s of one forward+backward iteration (no optimizer), ours
   (`synchronous_forward_backward`) vs torch's schedule on the same chunks; ours and torch's
   repetitions alternate inside one pair of processes so machine noise hits both alike.

Times are the median of `--reps` repetitions after `--warmup` discarded ones; a repetition's makespan
is max(end) - min(start) over ranks (perf_counter is CLOCK_MONOTONIC, shared by the processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
# Imported once in the parent: the forked ranks inherit it.
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                                          ScheduleInterleaved1F1B)

from dist_harness import run_distributed  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.models.gpt import masked_mean_loss  # noqa: E402
from megatron_po.pipeline.executor import (P2PTransport, StageRunner, run_rank,  # noqa: E402
                                           synchronous_forward_backward)
from megatron_po.pipeline.partition import build_chunks_for_rank  # noqa: E402
from megatron_po.pipeline.schedules import build_schedule  # noqa: E402
from megatron_po.pipeline.simulator import simulate  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed, vocab_parallel_cross_entropy  # noqa: E402

WIDTH = 16  # synthetic activations are [mbs, WIDTH]
TIMEOUT = 900.0


# --------------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------------


def timed(fn):
    """Barrier, then run fn; return this rank's (start, end)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return start, time.perf_counter()


def makespans(per_rank: list[list[tuple[float, float]]], warmup: int) -> list[float]:
    """Per repetition: max end - min start over ranks; warm-up repetitions dropped."""
    reps = len(per_rank[0])
    spans = [max(r[i][1] for r in per_rank) - min(r[i][0] for r in per_rank) for i in range(reps)]
    return spans[warmup:]


def median(xs):
    return statistics.median(xs)


# --------------------------------------------------------------------------------------------------
# 0. p2p cost on gloo
# --------------------------------------------------------------------------------------------------


def p2p_costs(mbs: int, n: int):
    """Rank 0 and 1: one-way latencies (us) of several ways to move one [mbs, WIDTH] fp32 tensor."""
    r = dist.get_rank()
    peer = 1 - r
    group = ps.get_pipeline_model_parallel_group()
    x, buf = torch.randn(mbs, WIDTH), torch.empty(mbs, WIDTH)
    transport = P2PTransport(2, 1)
    pending = []

    def pingpong(send, recv):
        samples = []
        for i in range(n + 10):
            dist.barrier()
            t = time.perf_counter()
            if r == 0:
                send(i)
                recv(i)
            else:
                recv(i)
                send(i)
            samples.append((time.perf_counter() - t) / 2)
        return samples[10:]

    out = {}
    out["raw gloo isend + recv, ping-pong (one way)"] = pingpong(
        lambda i: pending.append(dist.isend(x, peer, group=group, tag=1)),
        lambda i: dist.recv(buf, peer, group=group, tag=1))
    out["ours P2PTransport send + recv, ping-pong (one way)"] = pingpong(
        lambda i: transport.send(peer, ("act" if r == 0 else "grad", i, 1 if r == 0 else 0), [x]),
        lambda i: transport.recv(r, peer, ("grad" if r == 0 else "act", i, 0 if r == 0 else 1)))
    for w in pending:
        w.wait()
    transport.flush()

    # A recv posted 5 ms after the matching isend: what the receiving rank pays when the message is
    # already there (sender idle, sleeping, as a stage between ops would be).
    late = {"raw gloo recv, message sent 5 ms earlier": [], "ours P2PTransport.recv, message sent 5 ms earlier": [],
            "raw gloo irecv posted before the send, wait after it arrived": []}
    for i in range(n):
        dist.barrier()
        if r == 0:
            w = dist.isend(x, 1, group=group, tag=7)
            transport.send(1, ("act", i, 1), [x])
            time.sleep(0.012)
            w.wait()
            transport.flush()
            w = dist.isend(x, 1, group=group, tag=8)
            time.sleep(0.012)
            w.wait()
        else:
            time.sleep(0.005)
            t = time.perf_counter()
            dist.recv(buf, 0, group=group, tag=7)
            late["raw gloo recv, message sent 5 ms earlier"].append(time.perf_counter() - t)
            t = time.perf_counter()
            transport.recv(1, 0, ("act", i, 1))
            late["ours P2PTransport.recv, message sent 5 ms earlier"].append(time.perf_counter() - t)
            work = dist.irecv(buf, 0, group=group, tag=8)  # posted before rank 0 sends
            time.sleep(0.008)
            t = time.perf_counter()
            work.wait()
            late["raw gloo irecv posted before the send, wait after it arrived"].append(time.perf_counter() - t)
    if r == 1:
        out.update(late)
    dist.barrier()
    return out


# --------------------------------------------------------------------------------------------------
# 1. Synthetic sleeping stages
# --------------------------------------------------------------------------------------------------


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        time.sleep(t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """Satisfies StageRunner: `pre_process`/`post_process` and forward(input_ids, hidden_states, labels);
    the last stage returns a per-token "loss" [b, s] = [mbs, WIDTH] when given labels."""

    def __init__(self, t_f: float, t_b: float, pre_process: bool, post_process: bool):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.pre_process, self.post_process = pre_process, post_process
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, input_ids=None, hidden_states=None, labels=None):
        x = input_ids if self.pre_process else hidden_states
        return Sleep.apply(x * self.weight, self.t_f, self.t_b)


class TorchSleepStage(SleepStage):
    """torch.pipelining passes one positional tensor."""

    def forward(self, x):
        return Sleep.apply(x * self.weight, self.t_f, self.t_b)


def sleep_chunks(num_chunks, t_f, t_b, cls=SleepStage):
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    last = D * num_chunks - 1
    return [cls(t_f / num_chunks, t_b / num_chunks, c * D + r == 0, c * D + r == last)
            for c in range(num_chunks)]


def synthetic_batches(mbs):
    x = torch.randn(mbs, WIDTH)
    batch = {"tokens": x, "labels": torch.zeros(mbs, WIDTH, dtype=torch.long), "loss_mask": torch.ones(mbs, WIDTH)}
    return lambda mb: batch


def synthetic_ours(method, num_chunks, lengths, t_f, t_b, mbs, warmup, reps):
    """Our executor: for each stream length, `warmup + reps` runs of run_rank. Returns {length: [(s, e)]}."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    chunks = sleep_chunks(num_chunks, t_f, t_b)
    transport = P2PTransport(D, num_chunks)
    get_batch = synthetic_batches(mbs)
    out = {n: [] for n in lengths}
    for _ in range(warmup + reps):
        for n in lengths:  # alternate lengths so noise hits both alike
            schedule = build_schedule(method, D, num_chunks, n)
            runner = StageRunner(rank=r, num_stages=D, chunks=chunks, transport=transport, get_batch=get_batch,
                                 loss_scale=1.0 / n)
            out[n].append(timed(lambda: run_rank(schedule, runner)))
    return out


def synthetic_torch(kind, num_chunks, M, t_f, t_b, mbs, warmup, reps):
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    chunks = sleep_chunks(num_chunks, t_f, t_b, TorchSleepStage)
    group = ps.get_pipeline_model_parallel_group()
    stages = [PipelineStage(chunk, c * D + r, D * num_chunks, torch.device("cpu"), group=group)
              for c, chunk in enumerate(chunks)]
    loss_fn = lambda out, target: out.mean()  # noqa: E731
    if kind == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], M, loss_fn=loss_fn)
    x = torch.randn(M * mbs, WIDTH)
    target = torch.zeros(M * mbs, WIDTH)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step():
        schedule.step(*((x,) if first else ()), target=target if last else None,
                      losses=[] if last else None, return_outputs=False)

    return [timed(step) for _ in range(warmup + reps)]


def bound(method, D, v, M, t_f, t_b, t_p2p):
    """Simulated micro-batches/s for an iteration of M micro-batches."""
    return M / simulate(build_schedule(method, D, v, M), t_f / v, t_b / v, t_p2p).makespan


def async_bound(D, n1, n2, t_f, t_b, t_p2p):
    spans = [simulate(build_schedule("async", D, 1, n), t_f, t_b, t_p2p).makespan for n in (n1, n2)]
    return (n2 - n1) / (spans[1] - spans[0])


# --------------------------------------------------------------------------------------------------
# 2. Real tiny GPT at PP=2
# --------------------------------------------------------------------------------------------------


class GPTStageAdapter(nn.Module):
    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(input_ids=x) if self.chunk.pre_process else self.chunk(hidden_states=x)


def gpt_loss_fn(logits, target):
    """target packs labels and loss mask as [b, s, 2] int64 (torch splits one target tensor)."""
    per_token = vocab_parallel_cross_entropy(logits.float(), target[..., 0].t().contiguous()).t()
    return masked_mean_loss(per_token, target[..., 1])


def gpt_bench(model_cfg, vocab, mbs, M, methods, warmup, reps):
    model_parallel_seed(1234)
    cfg = Config()
    cfg.model = model_cfg
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    chunks = build_chunks_for_rank(cfg, vocab, r, D, 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (M * mbs, model_cfg.seq_length + 1), generator=g)
    full = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(M * mbs, model_cfg.seq_length)}
    batches = [{k: t[i * mbs:(i + 1) * mbs] for k, t in full.items()} for i in range(M)]
    target = torch.stack([full["labels"], full["loss_mask"].long()], dim=-1)
    stage = PipelineStage(GPTStageAdapter(chunks[0]), r, D, torch.device("cpu"),
                          group=ps.get_pipeline_model_parallel_group())
    torch_schedules = {"1f1b": Schedule1F1B(stage, M, loss_fn=gpt_loss_fn),
                       "gpipe": ScheduleGPipe(stage, M, loss_fn=gpt_loss_fn)}

    def zero():
        for c in chunks:
            c.zero_grad(set_to_none=True)

    out = {}
    for method in methods:
        ours, theirs = [], []
        sched = torch_schedules[method]

        def run_theirs():
            sched.step(*((full["tokens"],) if r == 0 else ()), target=target if r == D - 1 else None,
                       losses=[] if r == D - 1 else None, return_outputs=False)

        for _ in range(warmup + reps):
            zero()
            ours.append(timed(lambda: synchronous_forward_backward(method, chunks, None, batches)))
            zero()
            theirs.append(timed(run_theirs))
        out[method] = (ours, theirs)
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tf", type=float, default=0.02, help="synthetic forward time per stage (s); t_b = 2 t_f")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--Ms", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--mbs", type=int, default=4, help="synthetic micro-batch rows")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--p2p-samples", type=int, default=200)
    p.add_argument("--gpt-reps", type=int, default=5)
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "schedules.md"))
    args = p.parse_args()
    assert args.reps >= 3, "median of at least 3 repetitions"
    D, t_f = args.stages, args.tf
    t_b = 2 * t_f
    ideal = 1.0 / (t_f + t_b)
    lines: list[str] = []

    def emit(text=""):
        print(text, flush=True)
        lines.append(text)

    emit(f"Command: `{' '.join(['python', 'bench/schedules.py'] + sys.argv[1:])}`")
    emit()
    emit(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.platform()}, "
         f"load average at start {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    emit()
    # ---- 0. p2p
    res = run_distributed(p2p_costs, 2, pp=2, args=(args.mbs, args.p2p_samples), timeout=TIMEOUT)
    merged = {**res[0], **{k: v for k, v in res[1].items() if k not in res[0]}}
    emit(f"## 0. p2p cost per message on gloo, one [{args.mbs}, {WIDTH}] fp32 tensor, 2 ranks "
         f"({args.p2p_samples} samples)")
    emit()
    rows = []
    for k, v in merged.items():
        q = statistics.quantiles([x * 1e6 for x in v], n=10)
        rows.append([k, f"{median(v) * 1e6:.0f}", f"{q[0]:.0f}", f"{q[-1]:.0f}"])
    emit(table(["what", "median us", "p10 us", "p90 us"], rows))
    t_p2p = median(merged["ours P2PTransport send + recv, ping-pong (one way)"])
    emit()
    emit(f"Simulator p2p cost below: t_p2p = {t_p2p * 1e3:.3f} ms (median one-way of our transport).")
    emit()

    # ---- 1. synthetic
    emit(f"## 1. Synthetic sleeping stages: D={D}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms per stage "
         f"(interleaved: v=2 chunks at half the cost), [{args.mbs}, {WIDTH}] activations")
    emit()
    emit(f"Throughput / ideal, ideal = 1/(t_f+t_b) = {ideal:.2f} micro-batches/s. `bound` = simulator "
         f"(t_p2p=0 | t_p2p={t_p2p * 1e3:.2f} ms); `ours/bound` uses the p2p-inclusive bound. "
         f"Median of {args.reps} after {args.warmup} warm-up.")
    emit()
    rows = []
    for M in args.Ms:
        for name, method, v, kind in [("gpipe", "gpipe", 1, "gpipe"), ("1f1b", "1f1b", 1, "1f1b"),
                                      ("interleaved 1f1b v=2", "1f1b", 2, "interleaved"),
                                      ("async 1f1b (steady state)", "async", 1, None)]:
            if method == "async":
                n1, n2 = 2 * M, 4 * M
                per_rank = run_distributed(synthetic_ours, D, pp=D, timeout=TIMEOUT,
                                           args=("async", 1, [n1, n2], t_f, t_b, args.mbs, args.warmup, args.reps))
                s1 = makespans([r[n1] for r in per_rank], args.warmup)
                s2 = makespans([r[n2] for r in per_rank], args.warmup)
                ours = (n2 - n1) / (median(s2) - median(s1))
                b0, bp = async_bound(D, n1, n2, t_f, t_b, 0.0), async_bound(D, n1, n2, t_f, t_b, t_p2p)
                theirs = None
                label = f"{name}, N={n1}->{n2}"
            else:
                per_rank = run_distributed(synthetic_ours, D, pp=D, timeout=TIMEOUT,
                                           args=(method, v, [M], t_f, t_b, args.mbs, args.warmup, args.reps))
                ours = M / median(makespans([r[M] for r in per_rank], args.warmup))
                b0, bp = bound(method, D, v, M, t_f, t_b, 0.0), bound(method, D, v, M, t_f, t_b, t_p2p)
                per_rank = run_distributed(synthetic_torch, D, pp=D, timeout=TIMEOUT,
                                           args=(kind, v, M, t_f, t_b, args.mbs, args.warmup, args.reps))
                theirs = M / median(makespans(per_rank, args.warmup))
                label = name
            row = [M, label, f"{ours / ideal:.3f}", f"{b0 / ideal:.3f} / {bp / ideal:.3f}", f"{ours / bp:.3f}",
                   "-" if theirs is None else f"{theirs / ideal:.3f}",
                   "-" if theirs is None else f"{ours / theirs:.3f}x"]
            rows.append(row)
            print("  ", row, flush=True)
    emit(table(["M", "schedule", "ours", "bound (0 / p2p)", "ours/bound", "torch.pipelining", "ours/torch"],
               rows))
    emit()
    emit("torch.pipelining counterparts: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved -> "
         "ScheduleInterleaved1F1B (2 PipelineStages per rank); async has no torch counterpart.")
    emit()

    # ---- 2. GPT
    if not args.skip_gpt:
        mc = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                         hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                         make_vocab_size_divisible_by=128)
        vocab, mbs, M = 1024, 4, 8
        res = run_distributed(gpt_bench, 2, pp=2, timeout=TIMEOUT,
                              args=(mc, vocab, mbs, M, ["1f1b", "gpipe"], 2, args.gpt_reps))
        emit(f"## 2. Tiny GPT, PP=2: {mc.num_layers} layers, hidden {mc.hidden_size}, {mc.num_attention_heads} "
             f"heads, seq {mc.seq_length}, vocab {vocab} (untied), micro-batch {mbs}, M={M}; forward+backward, "
             f"no optimizer; 1 thread per rank")
        emit()
        rows = []
        tokens = M * mbs * mc.seq_length
        for method in ["1f1b", "gpipe"]:
            ours = makespans([r[method][0] for r in res], 2)
            theirs = makespans([r[method][1] for r in res], 2)
            to, tt = tokens / median(ours), tokens / median(theirs)
            rows.append([method, f"{to:,.0f}", f"{tt:,.0f}", f"{to / tt:.3f}x",
                         f"{median(ours) * 1e3:.0f} / {median(theirs) * 1e3:.0f}"])
        emit(table(["schedule", "ours tokens/s", "torch.pipelining tokens/s", "ours/torch", "iteration ms ours / torch"],
                   rows))
        emit()
    emit(f"load average at end {os.getloadavg()[0]:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
