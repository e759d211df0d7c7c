"""Pipeline schedule throughput: our executor vs its simulated bound vs torch.distributed.pipelining,
and the cost of PipeOptim's weight prediction in the asynchronous pipeline.

    python bench/schedules.py [--tf 0.02 --Ms 4 8 16 --reps 5 --skip-p2p --skip-synthetic --skip-gpt
                               --skip-gpt-async --gpt-async-pp 2 --gpt-async-layers 4 8 --copies-pp 4 --skip-zb]

Unless `--skip-zb`, it ends with bench/zero_bubble.py's table (zero-bubble schedules next to 1F1B,
interleaved, async PipeOptim and torch's ScheduleInterleavedZeroBubble; bench/results/zero_bubble.md).

Every rank is a forked process in a gloo group (tests/dist_harness.py, one torch thread per rank).
Four tables, measured in the same run, printed and written to bench/results/schedules.md:

0. p2p cost per message on gloo (2 ranks, one [mbs, 16] fp32 tensor): one-way latency with the receiver
   already waiting (the simulator's t_p2p), the cost of a recv whose message was sent earlier (gloo only
   moves the data once the receiver has posted its recv: a rendezvous round trip), the send call, and
   the wait of a receive posted before the send; raw gloo isend/recv next to our P2PTransport with
   agreed shapes (`message_specs`: one payload, no header, receives posted ahead) and with the header
   protocol (no specs: a shape header, then the payload).
1. Synthetic stages, D=4: each virtual stage is a tiny linear layer (an optimizer-visible parameter)
   followed by an autograd Function that sleeps t_f in forward and t_b = 2 t_f in backward on a
   [mbs, 16] tensor (sleep releases the GIL and the CPU, so 4 ranks run in parallel on 2 cores).
   Throughput (micro-batches/s) over the ideal 1/(t_f+t_b) of one stage for our gpipe, 1f1b,
   interleaved 1f1b (v=2, each chunk at half the cost) and the asynchronous no-flush stream, next to
   the simulator's bound (nominal costs without and with the measured p2p cost; and with the stage
   costs as measured in one process) and to torch's ScheduleGPipe / Schedule1F1B /
   ScheduleInterleaved1F1B on identical stages. "ours" is the real code path with agreed shapes:
   `run_rank(build_schedule(...), StageRunner(..., P2PTransport(D, v, ActivationSpecs((mbs, 16)))))`;
   "ours, header protocol" is the same without specs. Async: `AsyncPipelineRank(cfg, ..., "pipeoptim",
   update_interval=1, message_specs=...)` whose chunk builder is swapped for the sleeping stages
   (Adam steps and PipeOptim's predict / restore run for real), and the bare schedule (`run_rank` of
   the async op list, no optimizer); steady-state throughput from the times at which the last stage
   computes the losses of micro-batches M and 3M of a segment of 4M: (3M - M) / (t(3M) - t(M)), the
   middle half, away from fill and drain (the bound times the simulated segment the same way). Next
   to it: torch's Schedule1F1B at the same M, measured side by side.
2. The real tiny GPT at PP=2: tokens/s of one forward+backward iteration (no optimizer), ours
   (`synchronous_forward_backward` with `gpt_message_specs`, and with the header protocol) vs torch's
   Schedule1F1B / ScheduleGPipe on the same chunks.
3. The real tiny GPT, asynchronous (PP=2 by default, untied, 4 and 8 layers): tokens/s of segments of
   `AsyncPipelineRank.train_segment` for async-naive, pipeoptim and pipedream (same schedule; they
   differ in the weight policy), repetitions alternating, over the whole segment and in its steady
   state; the time each rank spends in the weight policy's hooks (for PipeOptim: cache copy + predict
   + restore) as a share of the time per micro-batch; the same costs measured in one process without
   competition (the intrinsic prediction overhead per rank); and the weight copies per chunk from
   `copies_per_chunk()` at PP=4.

Times are medians of `--reps` repetitions after `--warmup` discarded ones. All variants of one table
row run alternately in the same processes, so machine noise (this box is shared) hits them alike. A
repetition's makespan is max(end) - min(start) over ranks (perf_counter is CLOCK_MONOTONIC, shared by
the processes).
"""

from __future__ import annotations

import argparse
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
import torch._dynamo  # noqa: E402,F401  (model init imports it lazily, ~1 s; once here, not in every rank)
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                                          ScheduleInterleaved1F1B)

from dist_harness import run_distributed  # noqa: E402
from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import Config, ModelConfig  # noqa: E402
from megatron_po.models.gpt import masked_mean_loss  # noqa: E402
from megatron_po.pipeline.async_pipeline import AsyncPipelineRank  # noqa: E402
from megatron_po.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402
from megatron_po.pipeline.executor import (PREPOST_WINDOW, P2PTransport, StageRunner, run_rank,  # noqa: E402
                                           synchronous_forward_backward)
from megatron_po.pipeline.partition import ActivationSpecs, build_chunks_for_rank, gpt_message_specs  # noqa: E402
from megatron_po.pipeline.schedules import Forward, build_schedule  # noqa: E402
from megatron_po.pipeline.simulator import simulate  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed, vocab_parallel_cross_entropy  # noqa: E402

WIDTH = 16  # synthetic activations are [mbs, WIDTH]
TIMEOUT = 1800.0


def synthetic_specs(mbs: int) -> ActivationSpecs:
    """The agreed shape of every synthetic message (activations and their gradients): [mbs, WIDTH] fp32.
    ActivationSpecs is shape-agnostic (one tensor of a fixed shape per message), frozen and hashable."""
    return ActivationSpecs((mbs, WIDTH))


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


def accumulate(fn, acc: dict, key: str):
    """fn, adding its wall time to acc[key] (and its CPU time to acc[key + "_cpu"]) at every call."""
    def timed_fn(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        acc[key + "_cpu"] = acc.get(key + "_cpu", 0.0) + time.thread_time() - c
        return out
    return timed_fn


# --------------------------------------------------------------------------------------------------
# 0. p2p cost on gloo
# --------------------------------------------------------------------------------------------------

RAW, HEADER, AGREED = "raw gloo isend / recv", "ours, header protocol", "ours, agreed shapes"


def p2p_costs(mbs: int, n: int):
    """Ranks 0 (sender) and 1 (receiver); one [mbs, WIDTH] fp32 tensor per message. Per sample, in seconds:

    - "waiting": the receiver is blocked in recv before the sender sends (what the simulator's t_p2p
      models): latency = receiver's return time - sender's send time (perf_counter is system-wide);
    - "late": the message was sent 5 ms before the receiver calls recv: the time recv takes (gloo moves
      the data only after the receiver posts its recv, a rendezvous round trip through the sender's
      gloo thread);
    - "send call": how long the send call blocks the sender;
    - "posted ahead": the receive was posted before the send (raw irecv; ours `prepost`, as run_rank
      does PREPOST_WINDOW ops ahead), the data arrived 5 ms ago: the wait.
    """
    r = dist.get_rank()
    group = ps.get_pipeline_model_parallel_group()
    x, buf = torch.randn(mbs, WIDTH), torch.empty(mbs, WIDTH)
    transports = {HEADER: P2PTransport(2, 1), AGREED: P2PTransport(2, 1, synthetic_specs(mbs))}
    pending = []

    def raw_send(i):
        pending.append(dist.isend(x, 1, group=group, tag=i))

    def raw_recv(i):
        dist.recv(buf, 0, group=group, tag=i)

    def ours(name):
        t = transports[name]
        return (lambda i: t.send(1, ("act", i, 1), [x])), (lambda i: t.recv(1, 0, ("act", i, 1)))

    out: dict[str, list] = {}
    i = 0
    for name, (send, recv) in ((RAW, (raw_send, raw_recv)), (AGREED, ours(AGREED)), (HEADER, ours(HEADER))):
        waiting, late, send_call = [], [], []
        for k in range(n + 5):
            i += 1
            dist.barrier()
            if r == 0:  # receiver waiting
                time.sleep(0.005)
                t = time.perf_counter()
                send(i)
                send_call.append(time.perf_counter() - t)
                waiting.append(-t)
            else:
                recv(i)
                waiting.append(time.perf_counter())
            i += 1
            dist.barrier()
            if r == 0:  # message already there
                send(i)
                time.sleep(0.010)
            else:
                time.sleep(0.005)
                t = time.perf_counter()
                recv(i)
                late.append(time.perf_counter() - t)
        out[f"{name}: one-way latency, receiver waiting"] = waiting[5:]
        out[f"{name}: recv of a message sent 5 ms earlier"] = late[5:]
        out[f"{name}: send call"] = send_call[5:]
    agreed = transports[AGREED]
    for name in (RAW, AGREED):
        pre = []
        for k in range(n):
            i += 1
            work = None
            if r == 1:
                if name == RAW:
                    work = dist.irecv(buf, 0, group=group, tag=i)
                else:
                    agreed.prepost(0, ("act", i, 1))
            dist.barrier()
            if r == 0:
                if name == RAW:
                    raw_send(i)
                else:
                    agreed.send(1, ("act", i, 1), [x])
                time.sleep(0.008)
            else:
                time.sleep(0.005)
                t = time.perf_counter()
                if name == RAW:
                    work.wait()
                else:
                    agreed.recv(1, 0, ("act", i, 1))
                pre.append(time.perf_counter() - t)
        out[f"{name}: receive posted before the send, wait after the data arrived"] = pre
    for w in pending:
        w.wait()
    for t in transports.values():
        t.flush()
    dist.barrier()
    return out


def merge_p2p(res) -> dict[str, list]:
    """Per-rank samples -> {what: samples}; one-way latencies = receiver's end - sender's start."""
    out = {}
    for k in res[0]:
        if "receiver waiting" in k:
            out[k] = [end + neg_start for neg_start, end in zip(res[0][k], res[1][k])]
        elif "send call" in k:
            out[k] = res[0][k]
        else:
            out[k] = res[1][k]
    return out


# --------------------------------------------------------------------------------------------------
# 1. Synthetic sleeping stages
# --------------------------------------------------------------------------------------------------


SLEPT = {"f": [], "b": []}  # how long each sleep of this process really took (s): the stage cost in the run


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        t = time.perf_counter()
        time.sleep(t_f)
        SLEPT["f"].append(time.perf_counter() - t)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t = time.perf_counter()
        time.sleep(ctx.t_b)
        SLEPT["b"].append(time.perf_counter() - t)
        return grad.clone(), None, None


def measure_sleeps(fn):
    """Run fn; return (sum, count) of its forward and backward sleeps on this rank."""
    for v in SLEPT.values():
        v.clear()
    fn()
    return {k: (sum(v), len(v)) for k, v in SLEPT.items()}


def mean_sleeps(per_rank_samples) -> tuple[float, float]:
    """Mean forward and backward stage cost over all ranks and repetitions."""
    out = []
    for k in ("f", "b"):
        total = sum(t for samples in per_rank_samples for t, _ in (s[k] for s in samples))
        count = sum(c for samples in per_rank_samples for _, c in (s[k] for s in samples))
        out.append(total / count)
    return out[0], out[1]


class SleepStage(nn.Module):
    """Satisfies StageRunner: `pre_process`/`post_process` and forward(input_ids, hidden_states, labels);
    the last stage returns a per-token "loss" [b, s] = [mbs, WIDTH] when given labels. The linear layer
    (the models' own ColumnParallelLinear, TP = 1) gives the asynchronous pipeline's optimizer and weight
    policy something to step and predict, the way they do it for the GPT."""

    def __init__(self, t_f: float, t_b: float, pre_process: bool, post_process: bool):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.pre_process, self.post_process = pre_process, post_process
        self.proj = ColumnParallelLinear(WIDTH, WIDTH)

    def forward(self, input_ids=None, hidden_states=None, labels=None):
        x = input_ids if self.pre_process else hidden_states
        return Sleep.apply(self.proj(x)[0], self.t_f, self.t_b)


class TorchSleepStage(SleepStage):
    """torch.pipelining passes one positional tensor."""

    def forward(self, x):
        return Sleep.apply(self.proj(x)[0], self.t_f, self.t_b)


def sleep_chunks(rank, num_stages, num_chunks, t_f, t_b, cls=SleepStage):
    """The chunks of one rank; t_f, t_b are a whole stage's costs, split over its chunks."""
    last = num_stages * num_chunks - 1
    return [cls(t_f / num_chunks, t_b / num_chunks, c * num_stages + rank == 0, c * num_stages + rank == last)
            for c in range(num_chunks)]


def synthetic_batches(mbs):
    x = torch.randn(mbs, WIDTH)
    batch = {"tokens": x, "labels": torch.zeros(mbs, WIDTH, dtype=torch.long), "loss_mask": torch.ones(mbs, WIDTH)}
    return lambda mb: batch


def torch_schedule_on_sleep_stages(kind, num_chunks, M, t_f, t_b, mbs):
    """torch's `kind` schedule on this rank's sleeping chunks; returns a function running one iteration."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    chunks = sleep_chunks(r, D, num_chunks, t_f, t_b, TorchSleepStage)
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

    def run():
        schedule.step(*((x,) if first else ()), target=target if last else None,
                      losses=[] if last else None, return_outputs=False)

    return run


def run_rank_on_sleep_stages(method, num_chunks, t_f, t_b, mbs, specs):
    """n -> one run of `method`'s schedule of n micro-batches through run_rank + StageRunner + P2PTransport
    (the real driver) on this rank's sleeping chunks; no optimizer (Step ops are no-ops)."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    get_batch = synthetic_batches(mbs)
    chunks = sleep_chunks(r, D, num_chunks, t_f, t_b)
    transport = P2PTransport(D, num_chunks, specs)
    schedules = {}

    def run(n, on_loss=None):
        if n not in schedules:
            schedules[n] = build_schedule(method, D, num_chunks, n)
        runner = StageRunner(rank=r, num_stages=D, chunks=chunks, transport=transport, get_batch=get_batch,
                             loss_scale=1.0 / n, on_loss=on_loss)
        run_rank(schedules[n], runner)

    return run


SYNC_VARIANTS = ("ours", "header", "torch")


def synthetic_sync(method, kind, num_chunks, M, t_f, t_b, mbs, warmup, reps):
    """Ours with agreed shapes, ours with the header protocol and torch's `kind` schedule on identical
    sleeping stages, repetitions alternating. Returns {variant: [(start, end)]}."""
    runs = {"ours": run_rank_on_sleep_stages(method, num_chunks, t_f, t_b, mbs, synthetic_specs(mbs)),
            "header": run_rank_on_sleep_stages(method, num_chunks, t_f, t_b, mbs, None)}
    run_torch = torch_schedule_on_sleep_stages(kind, num_chunks, M, t_f, t_b, mbs)
    out = {name: [] for name in SYNC_VARIANTS}
    out["slept"] = []  # stage costs as they happened in the `ours` runs
    for i in range(warmup + reps):
        for variant in ("ours", "header"):
            sleeps = {}
            out[variant].append(timed(lambda: sleeps.update(measure_sleeps(lambda: runs[variant](M)))))
            if variant == "ours" and i >= warmup:
                out["slept"].append(sleeps)
        out["torch"].append(timed(run_torch))
    return out


def sleeping_chunk_builder(t_f, t_b):
    """A `build_chunks` for AsyncPipelineRank that makes the sleeping stages instead of GPT chunks."""
    def build(cfg, padded_vocab, rank, num_stages, num_chunks, device=None):
        return sleep_chunks(rank, num_stages, num_chunks, t_f, t_b)
    return build


ASYNC_VARIANTS = ("pipeoptim", "pipeoptim_header", "schedule")
ASYNC_LR = 1e-4


def steady_window(M: int) -> tuple[int, int, int]:
    """Segment length N and the window [a, b) of micro-batches whose losses time the steady state."""
    return 4 * M, M, 3 * M


def synthetic_async(M, t_f, t_b, mbs, warmup, reps):
    """The no-flush stream on the sleeping stages, the variants alternating, and torch's Schedule1F1B at
    M side by side:
    - pipeoptim: AsyncPipelineRank(method="pipeoptim", k=1, Adam, agreed shapes) .train_segment(N);
    - pipeoptim_header: the same without message specs (header protocol);
    - schedule: run_rank of the async op list, no optimizer, no policy (agreed shapes).
    Each segment has N = 4M micro-batches; the last stage records when each micro-batch's loss is
    computed (the `on_loss` hook), and the steady-state rate is (b - a) / (t(b) - t(a)) over the middle
    half, a = M, b = 3M, away from fill and drain. Returns ({variant: [rate]} on the last stage (empty
    lists elsewhere), {variant or "torch": [(start, end)]}, pipeoptim copies_per_chunk())."""
    D = ps.get_pipeline_model_parallel_world_size()
    cfg = Config()
    cfg.model.untie_embeddings_and_output_weights = True
    get_batch = synthetic_batches(mbs)
    ranks = {name: AsyncPipelineRank(cfg, 0, "pipeoptim", num_chunks=1, update_interval=1, optimizer_name="adam",
                                     optimizer_kwargs={"lr": ASYNC_LR},
                                     message_specs=synthetic_specs(mbs) if name == "pipeoptim" else None,
                                     build_chunks=sleeping_chunk_builder(t_f, t_b))
             for name in ("pipeoptim", "pipeoptim_header")}
    assert all(isinstance(c, SleepStage) for c in ranks["pipeoptim"].chunks)
    acc: dict = {}  # where the pipeoptim variant's time goes on this rank
    po = ranks["pipeoptim"]
    for obj, names, key in ((po.transport, ("send",), "send"), (po.transport, ("prepost",), "prepost"),
                            (po.transport, ("recv",), "recv"), (po.stage, ("step",), "step"),
                            (po.stage.policy, POLICY_HOOKS, "policy")):
        for name in names:
            setattr(obj, name, accumulate(getattr(obj, name), acc, key))
    runs = {name: (lambda n, on_loss, rank=rank: rank.train_segment(get_batch, n, on_loss=on_loss))
            for name, rank in ranks.items()}
    runs["schedule"] = run_rank_on_sleep_stages("async", 1, t_f, t_b, mbs, synthetic_specs(mbs))
    run_torch = torch_schedule_on_sleep_stages("1f1b", 1, M, t_f, t_b, mbs)
    N, a, b = steady_window(M)
    rates = {variant: [] for variant in ASYNC_VARIANTS}
    spans = {variant: [] for variant in ASYNC_VARIANTS + ("torch",)}
    slept = []  # stage costs as they happened in the pipeoptim runs
    breakdown = []  # per pipeoptim segment: seconds in each instrumented part, and the segment
    for i in range(warmup + reps):
        for variant in ASYNC_VARIANTS:
            acc.clear()
            loss_times, sleeps = [], {}
            on_loss = lambda mb, loss: loss_times.append(time.perf_counter())  # noqa: E731
            spans[variant].append(timed(lambda: sleeps.update(measure_sleeps(lambda: runs[variant](N, on_loss)))))
            if i >= warmup:
                if variant == "pipeoptim":
                    slept.append(sleeps)
                    start, end = spans[variant][-1]
                    breakdown.append(dict(acc, segment=end - start, sleep=sleeps["f"][0] + sleeps["b"][0],
                                          sleeps=sleeps["f"][1] + sleeps["b"][1]))
                if loss_times:
                    assert len(loss_times) == N
                    rates[variant].append((b - a) / (loss_times[b] - loss_times[a]))
        spans["torch"].append(timed(run_torch))
    assert D == 1 or ranks["pipeoptim"].stage.steps[0] > 0
    return rates, spans, ranks["pipeoptim"].copies_per_chunk(), slept, breakdown


def calibrate_stage_costs(t_f, t_b, mbs, n):
    """Measured duration of one sleeping stage's forward and backward (sleep overshoot, the autograd
    call, and the cold caches after a sleep included), one process, no p2p."""
    stage = SleepStage(t_f, t_b, True, False)
    x = torch.randn(mbs, WIDTH)
    fwd, bwd = [], []
    for _ in range(n + 2):
        t = time.perf_counter()
        y = stage(input_ids=x)
        t1 = time.perf_counter()
        torch.autograd.backward([y], [torch.ones_like(y)])
        t2 = time.perf_counter()
        fwd.append(t1 - t)
        bwd.append(t2 - t1)
    return median(fwd[2:]), median(bwd[2:])


def bound(method, D, v, M, t_f_chunk, t_b_chunk, t_p2p):
    """Simulated micro-batches/s of an iteration of M micro-batches; costs are per virtual stage."""
    return M / simulate(build_schedule(method, D, v, M), t_f_chunk, t_b_chunk, t_p2p).makespan


def async_bound(D, M, t_f, t_b, t_p2p):
    """Simulated steady-state micro-batches/s of the async stream, timed as the benchmark does: the end of
    the last stage's forwards a and b (where the loss is computed) in a segment of N = 4M."""
    N, a, b = steady_window(M)
    timeline = simulate(build_schedule("async", D, 1, N), t_f, t_b, t_p2p)
    end = {e.op.microbatch: e.end for e in timeline.events if e.rank == D - 1 and isinstance(e.op, Forward)}
    return (b - a) / (end[b] - end[a])


# --------------------------------------------------------------------------------------------------
# 2. Real tiny GPT at PP=2, synchronous
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


def gpt_config(model_cfg) -> Config:
    cfg = Config()
    cfg.model = model_cfg
    return cfg


def gpt_bench(model_cfg, vocab, mbs, M, methods, warmup, reps):
    model_parallel_seed(1234)
    cfg = gpt_config(model_cfg)
    specs = gpt_message_specs(cfg, mbs)
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
        got = {"ours": [], "header": [], "torch": []}
        sched = torch_schedules[method]

        def run_theirs():
            sched.step(*((full["tokens"],) if r == 0 else ()), target=target if r == D - 1 else None,
                       losses=[] if r == D - 1 else None, return_outputs=False)

        for _ in range(warmup + reps):
            zero()
            got["ours"].append(timed(lambda: synchronous_forward_backward(method, chunks, None, batches,
                                                                          message_specs=specs)))
            zero()
            got["header"].append(timed(lambda: synchronous_forward_backward(method, chunks, None, batches)))
            zero()
            got["torch"].append(timed(run_theirs))
        out[method] = got
    return out


# --------------------------------------------------------------------------------------------------
# 3. Real tiny GPT, asynchronous: PipeOptim's prediction overhead and weight copies
# --------------------------------------------------------------------------------------------------

POLICY_HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward", "before_step", "after_step")


def instrument(rank: AsyncPipelineRank, acc: dict) -> None:
    """Accumulate the wall and CPU time spent in the weight policy's hooks (acc["policy"], acc["policy_cpu"])
    and in the optimizer step function (acc["step"], ...) of this rank. Wraps the instance's bound methods;
    the library is untouched (StageRunner calls `policy.<hook>`, AsyncStage passes `self.step` as step_fn)."""
    policy = rank.stage.policy
    for hook in POLICY_HOOKS:
        setattr(policy, hook, accumulate(getattr(policy, hook), acc, "policy"))
    rank.stage.step = accumulate(rank.stage.step, acc, "step")


def gpt_async_bench(model_cfg, vocab, mbs, n, methods, warmup, reps):
    """Segments of n micro-batches through AsyncPipelineRank.train_segment (k=1, the training defaults:
    AdamW, clip 1.0, agreed shapes) for each method, one AsyncPipelineRank per method built from the same
    seed, repetitions alternating (ABC CBA ...). Returns per method: [(start, end)], per-segment policy
    and step time of this rank, and copies_per_chunk()."""
    cfg = gpt_config(model_cfg)
    specs = gpt_message_specs(cfg, mbs)
    g = torch.Generator().manual_seed(0)
    pool = []
    for _ in range(8):
        tokens = torch.randint(0, vocab, (mbs, model_cfg.seq_length + 1), generator=g)
        pool.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                     "loss_mask": torch.ones(mbs, model_cfg.seq_length)})
    get_batch = lambda mb: pool[mb % len(pool)]  # noqa: E731
    ranks, acc = {}, {}
    for m in methods:
        model_parallel_seed(1234)
        ranks[m] = AsyncPipelineRank(cfg, vocab, m, update_interval=1, message_specs=specs)
        acc[m] = {}
        instrument(ranks[m], acc[m])
    spans = {m: [] for m in methods}
    times = {m: [] for m in methods}  # per segment: this rank's policy / step wall and CPU time, segment CPU
    steady = {m: [] for m in methods}  # last stage: micro-batches/s between the losses of n/4 and 3n/4
    a, b = n // 4, 3 * n // 4
    for i in range(warmup + reps):
        for m in (methods if i % 2 == 0 else methods[::-1]):
            acc[m].update(policy=0.0, policy_cpu=0.0, step=0.0, step_cpu=0.0)
            loss_times = []
            on_loss = lambda mb, loss: loss_times.append(time.perf_counter())  # noqa: E731
            cpu = time.thread_time()
            spans[m].append(timed(lambda: ranks[m].train_segment(get_batch, n, on_loss=on_loss)))
            times[m].append(dict(acc[m], cpu=time.thread_time() - cpu))
            if loss_times:
                steady[m].append((b - a) / (loss_times[b] - loss_times[a]))
    copies = {m: ranks[m].copies_per_chunk() for m in methods}
    return spans, times, copies, steady


def gpt_stage_costs(model_cfg, vocab, mbs, num_stages, reps):
    """One process, no p2p: per pipeline rank r of a PP=num_stages split, the median cost of one
    micro-batch's forward+backward of its chunk, of one AsyncStage.step (AdamW, clip 1.0) and of
    PipeOptim's policy work around one forward with s = D-r-1: `predict` (the policy's `_predict`: Ŵ out
    of place and the parameters pointed at it) and `restore` (pointed back), and the same with the
    copy-based fallback the policy uses for modules it does not know (`copy:` cache copy + predict in
    place, restore = copy back). Returns {r: {what: seconds}}."""
    from megatron_po.pipeline.async_pipeline import AsyncStage, optimizer_kwargs_from_config
    cfg = gpt_config(model_cfg)
    model_parallel_seed(1234)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (mbs, model_cfg.seq_length + 1), generator=g)
    out = {}
    for r in range(num_stages):
        chunks = build_chunks_for_rank(cfg, vocab, r, num_stages, 1)
        t = cfg.training
        stage = AsyncStage(r, num_stages, chunks, "pipeoptim", 1, t.optimizer, optimizer_kwargs_from_config(t),
                           None, t.clip_grad)
        chunk, policy = chunks[0], stage.policy
        assert policy.swaps == [True]
        hidden = torch.randn(model_cfg.seq_length, mbs, model_cfg.hidden_size)
        s = num_stages - r - 1

        def forward_backward():
            x = None if chunk.pre_process else hidden.clone().requires_grad_(True)
            y = chunk(input_ids=tokens[:, :-1] if chunk.pre_process else None, hidden_states=x,
                      labels=tokens[:, 1:] if chunk.post_process else None)
            if chunk.post_process:
                y.mean().backward()
            else:
                y.backward(torch.ones_like(y))

        def mode(swaps):
            def set_mode():
                policy.swaps = [swaps]
            return set_mode

        # The order of one micro-batch: step, then the next forward's prediction (and its restore).
        parts = {"forward+backward": forward_backward, "step": lambda: stage.step(0),
                 "swap mode": mode(True), "predict": lambda: policy._predict(0, s),
                 "restore": lambda: policy._restore(0),
                 "copy mode": mode(False), "copy: predict": lambda: policy._predict(0, s),
                 "copy: restore": lambda: policy._restore(0)}
        times = {name: [] for name in parts}
        for i in range(reps + 2):
            for name, fn in parts.items():
                if s == 0 and name not in ("forward+backward", "step"):
                    continue  # the last stage predicts nothing (s = 0)
                c = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - c)
        res = {name: median(ts[2:]) if ts else 0.0 for name, ts in times.items() if "mode" not in name}
        res["policy"] = res["predict"] + res["restore"]
        res["copy: policy"] = res["copy: predict"] + res["copy: restore"]
        res["params"] = sum(p.numel() for p in chunk.parameters())
        out[r] = res
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
    p.add_argument("--gpt-reps", type=int, default=9)
    p.add_argument("--gpt-async-pp", type=int, default=2, help="PP of the timed asynchronous GPT runs")
    p.add_argument("--gpt-async-layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--copies-pp", type=int, default=4, help="PP of the weight-copy count")
    p.add_argument("--intrinsic-mbs", type=int, nargs="+", default=[8, 4],
                   help="micro-batch sizes of the intrinsic prediction-cost table (8 = examples/gpt_tiny.sh)")
    p.add_argument("--gpt-async-n", type=int, default=16, help="micro-batches per segment")
    p.add_argument("--gpt-async-reps", type=int, default=11)
    p.add_argument("--skip-p2p", action="store_true", help="(the simulator then uses --t-p2p)")
    p.add_argument("--t-p2p", type=float, default=0.0005, help="t_p2p (s) for the bounds when --skip-p2p")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--skip-gpt-async", action="store_true")
    p.add_argument("--skip-zb", action="store_true",
                   help="skip bench/zero_bubble.py (zero-bubble schedules, written to bench/results/zero_bubble.md)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "schedules.md"))
    args = p.parse_args()
    assert args.reps >= 3, "median of at least 3 repetitions"
    D, t_f = args.stages, args.tf
    t_b = 2 * t_f
    ideal = 1.0 / (t_f + t_b)
    lines: list[str] = []
    started = time.perf_counter()
    summary: dict = {"async": {}, "intrinsic": [], "cpu_share": {}, "e2e": {}, "copies": None}

    def emit(text=""):
        print(text, flush=True)
        lines.append(text)

    emit(f"Command: `{' '.join(['python', 'bench/schedules.py'] + sys.argv[1:])}`")
    emit()
    emit(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.platform()}, "
         f"load average at start {os.getloadavg()[0]:.2f} (1 min) / {os.getloadavg()[1]:.2f} (5 min), "
         f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    emit()
    # ---- 0. p2p
    t_p2p, t_p2p_header = args.t_p2p, None
    if not args.skip_p2p:
        res = run_distributed(p2p_costs, 2, pp=2, args=(args.mbs, args.p2p_samples), timeout=TIMEOUT)
        p2p = merge_p2p(res)
        emit(f"## 0. p2p cost per message on gloo: one [{args.mbs}, {WIDTH}] fp32 tensor, 2 ranks, "
             f"{args.p2p_samples} samples each")
        emit()
        emit(f"`{AGREED}`: P2PTransport with `message_specs` (one payload, no header; `recv` posts the irecv "
             f"itself unless `prepost` did, as run_rank does {PREPOST_WINDOW} ops ahead). `{HEADER}`: "
             f"P2PTransport without specs (a 64-int64 shape header, then the payload).")
        emit()
        rows = []
        for k, v in p2p.items():
            q = statistics.quantiles([x * 1e6 for x in v], n=10)
            rows.append([k, f"{median(v) * 1e6:.0f}", f"{q[0]:.0f}", f"{q[-1]:.0f}"])
        emit(table(["what", "median us", "p10 us", "p90 us"], rows))
        t_p2p = median(p2p[f"{AGREED}: one-way latency, receiver waiting"])
        t_p2p_header = median(p2p[f"{HEADER}: one-way latency, receiver waiting"])
        emit()
        emit(f"Simulator p2p cost used below: t_p2p = {t_p2p * 1e3:.3f} ms (ours with agreed shapes, one-way, "
             f"receiver waiting; the header protocol's is {t_p2p_header * 1e3:.3f} ms).")
        emit()

    # ---- 1. synthetic
    if not args.skip_synthetic:
        cal = {v: run_distributed(calibrate_stage_costs, 1, args=(t_f / v, t_b / v, args.mbs, 20))[0] for v in (1, 2)}
        emit(f"## 1. Synthetic sleeping stages: D={D}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms per stage "
             f"(interleaved: v=2 chunks per rank at half the cost), [{args.mbs}, {WIDTH}] activations")
        emit()
        emit(f"Throughput as a fraction of ideal = 1/(t_f+t_b) = {ideal:.2f} micro-batches/s; median of {args.reps} "
             f"after {args.warmup} warm-up, all columns of a row measured alternately in the same processes.")
        emit(f"- `bound`: simulator, nominal costs, t_p2p = 0. `bound p2p`: nominal costs, t_p2p = "
             f"{t_p2p * 1e3:.2f} ms. `bound cal`: simulator with the measured stage "
             f"costs (one process, no p2p: forward {cal[1][0] * 1e3:.2f} / backward {cal[1][1] * 1e3:.2f} ms, "
             f"v=2 chunk {cal[2][0] * 1e3:.2f} / {cal[2][1] * 1e3:.2f} ms; sleep overshoot and the cold CPU "
             f"after a sleep) and t_p2p = {t_p2p * 1e3:.2f} ms. `bound run`: the same with the stage costs as "
             f"they happened in the `ours` runs of that row (mean duration of every forward and backward sleep on "
             f"all ranks: under CPU contention a sleeping rank wakes late); `overshoot`: those means minus the "
             f"nominal t_f, t_b per stage. No bound charges for optimizer steps.")
        emit(f"- `ours`: run_rank + StageRunner + P2PTransport with agreed shapes "
             f"(`ActivationSpecs(({args.mbs}, {WIDTH}))`: no header, receives posted {PREPOST_WINDOW} ops ahead), "
             f"the real code path. `ours, header`: the same without message specs (header protocol). "
             f"`torch`: ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B (2 PipelineStages per rank) on "
             f"the same stages.")
        emit(f"- async rows: steady-state throughput of the no-flush stream: segments of N=4M micro-batches, "
             f"the last stage notes when each micro-batch's loss is computed (`on_loss`), rate = (b-a) / "
             f"(t(b)-t(a)) for a=M, b=3M (the middle half, away from fill and drain; the bounds time the "
             f"simulated segment the same way). `AsyncPipelineRank pipeoptim`: "
             f"`AsyncPipelineRank(..., \"pipeoptim\", update_interval=1, message_specs=...).train_segment`, its "
             f"chunk builder swapped for the sleeping stages: a Step (Adam, lr {ASYNC_LR:g}, clip 1.0) after every "
             f"backward and PipeOptim's predict / restore around every forward. `run_rank only`: the async op "
             f"list without optimizer or policy. Their `torch` column is torch's Schedule1F1B at the same M "
             f"(it has no no-flush schedule), measured side by side, and `ours/torch` compares the two.")
        emit()
        rows = []
        async_copies = None
        breakdowns = {}
        for M in args.Ms:
            for name, method, v, kind in [("gpipe", "gpipe", 1, "gpipe"), ("1f1b", "1f1b", 1, "1f1b"),
                                          ("interleaved 1f1b v=2", "1f1b", 2, "interleaved"),
                                          ("async", "async", 1, None)]:
                tf_cal, tb_cal = cal[v]
                if method == "async":
                    N, a, b = steady_window(M)
                    per_rank = run_distributed(synthetic_async, D, pp=D, timeout=TIMEOUT,
                                               args=(M, t_f, t_b, args.mbs, args.warmup, args.reps))
                    async_copies = {r: res[2] for r, res in enumerate(per_rank)}
                    breakdowns[M] = [res[4] for res in per_rank]
                    got = {variant: median(per_rank[-1][0][variant]) for variant in ASYNC_VARIANTS}
                    theirs = M / median(makespans([r[1]["torch"] for r in per_rank], args.warmup))
                    b0 = async_bound(D, M, t_f, t_b, 0.0)
                    bp = async_bound(D, M, t_f, t_b, t_p2p)
                    bc = async_bound(D, M, tf_cal, tb_cal, t_p2p)
                    tf_run, tb_run = mean_sleeps([r[3] for r in per_rank])
                    br = async_bound(D, M, tf_run, tb_run, t_p2p)
                    summary["async"][M] = (got["pipeoptim"] / ideal, got["pipeoptim"] / theirs, got["schedule"] / ideal)
                    entries = [(f"async 1f1b, AsyncPipelineRank pipeoptim k=1 (N={N}, mb {a}..{b})",
                                got["pipeoptim"], got["pipeoptim_header"]),
                               (f"async 1f1b, run_rank only (N={N}, mb {a}..{b})", got["schedule"], None)]
                else:
                    per_rank = run_distributed(synthetic_sync, D, pp=D, timeout=TIMEOUT,
                                               args=(method, kind, v, M, t_f, t_b, args.mbs, args.warmup, args.reps))
                    got = {k: M / median(makespans([r[k] for r in per_rank], args.warmup)) for k in SYNC_VARIANTS}
                    theirs = got["torch"]
                    b0 = bound(method, D, v, M, t_f / v, t_b / v, 0.0)
                    bp = bound(method, D, v, M, t_f / v, t_b / v, t_p2p)
                    bc = bound(method, D, v, M, tf_cal, tb_cal, t_p2p)
                    tf_run, tb_run = mean_sleeps([r["slept"] for r in per_rank])
                    br = bound(method, D, v, M, tf_run, tb_run, t_p2p)
                    entries = [(name, got["ours"], got["header"])]
                for label, ours, header in entries:
                    row = [M, label, f"{b0 / ideal:.3f}", f"{bp / ideal:.3f}", f"{bc / ideal:.3f}",
                           f"{br / ideal:.3f}", f"{(tf_run * v - t_f) * 1e3:.2f} / {(tb_run * v - t_b) * 1e3:.2f}",
                           f"{ours / ideal:.3f}", f"{ours / bp:.3f}", f"{ours / br:.3f}",
                           "-" if header is None else f"{header / ideal:.3f}",
                           f"{theirs / ideal:.3f}", f"{ours / theirs:.3f}x"]
                    rows.append(row)
                    print("  ", row, f"[{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}]",
                          flush=True)
        emit(table(["M", "schedule", "bound", "bound p2p", "bound cal", "bound run", "overshoot ms f / b", "ours",
                    "ours/bound p2p", "ours/bound run", "ours, header", "torch", "ours/torch"], rows))
        emit()
        if breakdowns:
            M = max(breakdowns)
            N = steady_window(M)[0]
            emit(f"Where each rank's time goes in the async pipeoptim segments of M={M} (N={N} micro-batches, fill "
                 f"and drain included), ms per micro-batch, median over the repetitions: `sleep` = the stage's "
                 f"forward + backward sleeps (nominal {(t_f + t_b) * 1e3:g}), `recv` = inside P2PTransport.recv "
                 f"(waiting for data, mostly fill and drain), `send`, `prepost` (posting receives ahead), `step` "
                 f"(AsyncStage.step: clip, Adam), `policy` (PipeOptim predict / restore), `other` = the rest "
                 f"(StageRunner, autograd, the Linear, the loss). CPU ms per micro-batch of the non-sleeping "
                 f"parts in brackets.")
            emit()
            rows = []
            parts = ("recv", "send", "prepost", "step", "policy")
            for r, reps in enumerate(breakdowns[M]):
                med = {k: median([x.get(k, 0.0) for x in reps]) / N * 1e3
                       for k in ("segment", "sleep") + parts + tuple(f"{p}_cpu" for p in parts)}
                other = med["segment"] - med["sleep"] - sum(med[p] for p in parts)
                rows.append([r, f"{med['segment']:.2f}", f"{med['sleep']:.2f}"]
                            + [f"{med[p]:.2f} ({med[p + '_cpu']:.2f})" for p in parts] + [f"{other:.2f}"])
            emit(table(["rank", "segment", "sleep", "recv", "send", "prepost", "step", "policy", "other"], rows))
            emit()
        if async_copies is not None:
            emit("Weight copies per chunk of the synthetic pipeoptim run (`copies_per_chunk()`, rank: copies): "
                 + ", ".join(f"{r}: {c[0]}" for r, c in sorted(async_copies.items())))
            emit()

    # ---- 2. GPT, synchronous
    if not args.skip_gpt:
        mc = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                         hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                         make_vocab_size_divisible_by=128)
        vocab, mbs, M = 1024, 4, 8
        res = run_distributed(gpt_bench, 2, pp=2, timeout=TIMEOUT,
                              args=(mc, vocab, mbs, M, ["1f1b", "gpipe"], 2, args.gpt_reps))
        emit(f"## 2. Tiny GPT, PP=2, synchronous: {mc.num_layers} layers, hidden {mc.hidden_size}, "
             f"{mc.num_attention_heads} heads, seq {mc.seq_length}, vocab {vocab} (untied), micro-batch {mbs}, "
             f"M={M}; forward+backward, no optimizer; 1 thread per rank; median of {args.gpt_reps} after 2 "
             f"warm-up, the three variants alternating in the same 2 processes")
        emit()
        emit("`ours`: synchronous_forward_backward with `gpt_message_specs` (as training.forward_backward "
             "calls it); `ours, header`: without specs.")
        emit()
        rows = []
        tokens = M * mbs * mc.seq_length
        for method in ["1f1b", "gpipe"]:
            ms = {k: median(makespans([r[method][k] for r in res], 2)) for k in ("ours", "header", "torch")}
            rows.append([method, f"{tokens / ms['ours']:,.0f}", f"{tokens / ms['header']:,.0f}",
                         f"{tokens / ms['torch']:,.0f}", f"{ms['torch'] / ms['ours']:.3f}x",
                         f"{ms['ours'] * 1e3:.0f} / {ms['header'] * 1e3:.0f} / {ms['torch'] * 1e3:.0f}"])
            print("  ", rows[-1], flush=True)
        emit(table(["schedule", "ours tokens/s", "ours, header tokens/s", "torch.pipelining tokens/s", "ours/torch",
                    "iteration ms ours / header / torch"], rows))
        emit()

    # ---- 3. GPT, asynchronous
    if not args.skip_gpt_async:
        P, n = args.gpt_async_pp, args.gpt_async_n
        vocab, mbs = 1024, 4
        methods = ["async-naive", "pipeoptim", "pipedream"]

        def model(layers):
            return ModelConfig(num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=128,
                               hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                               make_vocab_size_divisible_by=128)

        emit("## 3. Tiny GPT, asynchronous (k=1): PipeOptim's prediction overhead and weight copies")
        emit()
        emit(f"Hidden 128, 4 heads, seq 128, vocab {vocab} (untied), micro-batch {mbs}, no dropout; AdamW "
             f"(lr 3e-4, wd 0.01), clip 1.0, agreed shapes (the training defaults); k=1, so every stage steps "
             f"after every backward. Segments of {n} micro-batches through `AsyncPipelineRank.train_segment` "
             f"(fill and drain included), one AsyncPipelineRank per method in the same processes (same "
             f"initial weights), methods alternating ABC CBA ...; PP={P}: {P} processes with 1 thread each on "
             f"{os.cpu_count()} cores{' (oversubscribed)' if P > (os.cpu_count() or 1) else ''}; median of "
             f"{args.gpt_async_reps} after 1 warm-up segment each.")
        emit("- `policy ms/mb`: wall time per micro-batch spent in the weight policy's hooks, per rank "
             "(pipeoptim: copy the live weights to the cache + predict before each forward, restore after it; "
             "pipedream: stash copies and swaps around the backward). `policy share`: that over the segment "
             "time per micro-batch, on the rank where it is largest (wall / the same with CPU time: hook CPU "
             "time over the rank's CPU time in the segment). `step ms/mb`: the AdamW step (clip, lr, step) "
             "per micro-batch, rank 0. `tokens/s`: segment = n micro-batches over the whole segment (fill "
             "and drain included); steady = between the losses of micro-batches n/4 and 3n/4 on the last "
             "stage. `vs naive`: the extra time per micro-batch over async-naive, median over the paired "
             "repetitions (each pair run back to back) [quartiles], for the segment / steady rates. `CPU vs "
             "naive`: the same for each rank's CPU time in the segment (main thread), which other processes "
             "on the machine disturb much less than the wall clock.")
        emit()
        header = ["PP", "layers", "method", "tokens/s segment / steady", "vs naive segment / steady",
                  "CPU vs naive (rank 0 / 1 / ...)",
                  "policy ms/mb (rank 0 / 1 / ...)", "policy share wall / CPU", "step ms/mb",
                  "copies per chunk (rank 0 / 1 / ...)"]
        rows = []

        def paired(xs, ys):
            """Median and quartiles of x/y - 1 over the pairs, as text."""
            ratios = [x / y - 1 for x, y in zip(xs, ys)]
            q = statistics.quantiles(ratios, n=4)
            return f"{median(ratios) * 100:+.1f}% [{q[0] * 100:+.1f}, {q[2] * 100:+.1f}]"

        for layers in args.gpt_async_layers:
            mc = model(layers)
            res = run_distributed(gpt_async_bench, P, pp=P, timeout=TIMEOUT,
                                  args=(mc, vocab, mbs, n, methods, 1, args.gpt_async_reps))
            warm = 1
            tokens_per_mb = mbs * mc.seq_length
            spans = {m: makespans([r[0][m] for r in res], warm) for m in methods}
            steady = {m: res[-1][3][m][warm:] for m in methods}  # micro-batches/s, last stage
            for m in methods:
                per_mb = median(spans[m]) / n
                pol = [median([t["policy"] for t in r[1][m][warm:]]) / n for r in res]
                cpu_share = [median([t["policy_cpu"] / t["cpu"] for t in r[1][m][warm:]]) for r in res]
                step0 = median([t["step"] for t in res[0][1][m][warm:]]) / n
                vs = "-" if m == "async-naive" else (
                    f"{paired(spans[m], spans['async-naive'])} / "
                    f"{paired(steady['async-naive'], steady[m])}")  # time ratios: naive rate / method rate
                cpu_vs = "-"
                if m != "async-naive":
                    extra = [median([x["cpu"] / y["cpu"] - 1
                                     for x, y in zip(r[1][m][warm:], r[1]["async-naive"][warm:])]) for r in res]
                    cpu_vs = " / ".join(f"{x * 100:+.1f}%" for x in extra)
                if m == "pipeoptim":
                    summary["cpu_share"][layers] = max(cpu_share)
                    summary["e2e"][layers] = vs
                rows.append([P, layers, m, f"{n * tokens_per_mb / median(spans[m]):,.0f} / "
                             f"{median(steady[m]) * tokens_per_mb:,.0f}", vs, cpu_vs,
                             " / ".join(f"{x * 1e3:.2f}" for x in pol),
                             f"{max(pol) / per_mb * 100:.1f}% / {max(cpu_share) * 100:.1f}%", f"{step0 * 1e3:.2f}",
                             " / ".join(str(r[2][m][0]) for r in res)])
                print("  ", rows[-1], f"[{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}]",
                      flush=True)
        emit(table(header, rows))
        emit()
        emit(f"Intrinsic costs, one process, no p2p, no other rank competing (median of 20): per rank of the "
             f"PP={P} split, one micro-batch's forward+backward of its chunk, one AsyncStage.step (AdamW, clip), and "
             f"PipeOptim's work around one forward with s = D-r-1: `predict` = the policy computing "
             f"Ŵ = W - s·lr·m̂/(√v̂+ε) out of place in one foreach pass and pointing the parameters at it, "
             f"`restore` = pointing them back (our layers save the parameters themselves for the backward, so "
             f"the backward reads the live weights); `copy fallback` = the policy's path for modules it does not "
             f"know (cache copy + predict in place / copy back). `share` = policy / (forward+backward + step + "
             f"policy): the prediction overhead as a fraction of the rank's time per step (k=1: one step per "
             f"micro-batch). Micro-batch 8 is `examples/gpt_tiny.sh`'s (the tiny GPT: 4 layers, hidden 128, "
             f"seq 128); 4 is the timed runs' above.")
        emit()
        rows = []
        for layers in args.gpt_async_layers:
            for intrinsic_mbs in args.intrinsic_mbs:
                costs = run_distributed(gpt_stage_costs, 1, timeout=TIMEOUT,
                                        args=(model(layers), vocab, intrinsic_mbs, P, 20))[0]
                for r, c in sorted(costs.items()):
                    total = c["forward+backward"] + c["step"] + c["policy"]
                    fallback = c["copy: policy"] / (c["forward+backward"] + c["step"] + c["copy: policy"])
                    summary["intrinsic"].append((layers, intrinsic_mbs, r, c["policy"] / total, fallback))
                    rows.append([layers, intrinsic_mbs, r, f"{c['params']:,}", f"{c['forward+backward'] * 1e3:.1f}",
                                 f"{c['step'] * 1e3:.2f}", f"{c['predict'] * 1e3:.2f} / {c['restore'] * 1e3:.3f}",
                                 f"{c['policy'] * 1e3:.2f}", f"{c['policy'] / total * 100:.1f}%",
                                 f"{c['copy: predict'] * 1e3:.2f} / {c['copy: restore'] * 1e3:.2f}",
                                 f"{fallback * 100:.1f}%"])
                    print("  ", rows[-1], flush=True)
        emit(table(["layers", "micro-batch", "rank", "params", "fwd+bwd ms", "step ms", "predict / restore ms",
                    "policy ms", "share", "copy fallback: predict / restore ms", "fallback share"], rows))
        emit()
        # Weight copies at a deeper pipeline: a count, not a timing, so oversubscribing the cores is harmless.
        C = args.copies_pp
        mc = model(2 * C)
        res = run_distributed(gpt_async_bench, C, pp=C, timeout=TIMEOUT, args=(mc, vocab, mbs, 4 * C, methods, 1, 0))
        emit(f"Weight copies per chunk at PP={C} ({2 * C} layers, one segment of {4 * C} micro-batches per method, "
             f"`AsyncPipelineRank.copies_per_chunk()`: the most full copies held at once, live weights included):")
        emit()
        emit(table(["rank r"] + methods + ["D - r"],
                   [[r] + [res[r][2][m][0] for m in methods] + [C - r] for r in range(C)]))
        emit()
        summary["copies"] = {m: [res[r][2][m][0] for r in range(C)] for m in methods}

    # ---- targets
    rows = []
    if summary["async"]:
        fr = summary["async"]
        rows.append([f"async no-flush stream through AsyncPipelineRank pipeoptim, D={D}: fraction of ideal >= 0.95",
                     ", ".join(f"M={M}: {v[0]:.3f}" for M, v in sorted(fr.items()))
                     + " (bare schedule: " + ", ".join(f"{v[2]:.3f}" for M, v in sorted(fr.items())) + ")",
                     "yes" if all(v[0] >= 0.95 for v in fr.values()) else "no"])
        if 8 in fr:
            rows.append(["async / torch Schedule1F1B at M=8 >= 1.3x", f"{fr[8][1]:.3f}x",
                         "yes" if fr[8][1] >= 1.3 else "no"])
    if summary["intrinsic"]:
        tiny = [x for x in summary["intrinsic"] if x[0] == 4 and x[1] == 8 and x[3] > 0]  # gpt_tiny.sh's model
        judged = tiny or [x for x in summary["intrinsic"] if x[3] > 0]
        rows.append(["PipeOptim prediction overhead <= 3% of the step time (k=1: per micro-batch)",
                     "intrinsic, predicting rank (layers / micro-batch): "
                     + ", ".join(f"{la} / {mb} r{r}: {x * 100:.1f}%" for la, mb, r, x, _ in summary["intrinsic"]
                                 if x > 0)
                     + "; in-run CPU share (micro-batch 4): " + ", ".join(f"{la} layers {x * 100:.1f}%"
                                                                          for la, x in summary["cpu_share"].items())
                     + "; end to end vs async-naive (micro-batch 4, segment / steady): "
                     + ", ".join(f"{la} layers {x}" for la, x in summary["e2e"].items()),
                     ("yes" if max(x[3] for x in judged) <= 0.03 else "no")
                     + (" (tiny GPT: 4 layers, micro-batch 8)" if tiny else "")])
    if summary["copies"]:
        c = summary["copies"]
        depth = [len(c["pipedream"]) - r for r in range(len(c["pipedream"]))]
        rows.append(["weight copies: PipeOptim <= 2, PipeDream D-r",
                     f"pipeoptim {' / '.join(map(str, c['pipeoptim']))}, pipedream "
                     f"{' / '.join(map(str, c['pipedream']))} (D-r {' / '.join(map(str, depth))})",
                     "yes" if max(c["pipeoptim"]) <= 2 and c["pipedream"] == depth else "no"])
    if rows:
        emit("## Targets")
        emit()
        emit(table(["target", "measured", "met"], rows))
        emit()
    emit(f"load average at end {os.getloadavg()[0]:.2f} (1 min) / {os.getloadavg()[1]:.2f} (5 min); "
         f"{(time.perf_counter() - started) / 60:.1f} minutes")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")
    if not args.skip_zb:  # D=4, M=8, t_f = t_B = t_W = 20 ms: issue 19's setting, its own results file
        from zero_bubble import run_zero_bubble
        run_zero_bubble(reps=args.reps, warmup=args.warmup, mbs=args.mbs,
                        out_path=os.path.join(ROOT, "bench", "results", "zero_bubble.md"),
                        command=f"python bench/schedules.py {' '.join(sys.argv[1:])} (its zero-bubble part)")


if __name__ == "__main__":
    main()
