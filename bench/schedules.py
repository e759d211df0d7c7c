"""Pipeline schedule throughput: our executor vs its simulated bound vs torch.distributed.pipelining.

    python bench/schedules.py [--tf 0.02 --Ms 4 8 16 --reps 5 --skip-gpt --skip-synthetic]

Every rank is a forked process in a gloo group (tests/dist_harness.py, one torch thread per rank).
Three tables, measured in the same run, printed and written to bench/results/schedules.md:

0. p2p cost per message on gloo (2 ranks, one [mbs, 16] fp32 tensor): one-way latency with the receiver
   already waiting (the simulator's t_p2p), the cost of a recv whose message was sent earlier (gloo only
   moves the data once the receiver has posted its recv: a rendezvous round trip), and the send call;
   raw gloo isend/recv next to our P2PTransport (a header message, then the payload).
1. Synthetic stages, D=4: each virtual stage is an autograd Function that sleeps t_f in forward and
   t_b = 2 t_f in backward on a [mbs, 16] tensor (sleep releases the GIL and the CPU, so 4 ranks run in
   parallel on 2 cores). Throughput (micro-batches/s) over the ideal 1/(t_f+t_b) of one stage for our
   gpipe, 1f1b, interleaved 1f1b (v=2, each chunk at half the cost) and the async no-flush stream,
   next to the simulator's bound (nominal costs without and with the measured p2p cost; and with the
   stage costs as measured in one process) and to torch's ScheduleGPipe / Schedule1F1B /
   ScheduleInterleaved1F1B on identical stages. "ours" is the real code path:
   `run_rank(build_schedule(...), StageRunner(..., P2PTransport))`. Two extra columns run bench-local
   prototypes of a transport fix (`OneTripTransport`, `prepost_run_rank`; NOT product code) to show
   what closes the gap. Async: steady-state throughput = (N2 - N1) / (T(N2) - T(N1)) for streams of
   N1 = 2M and N2 = 4M micro-batches (fill and drain cancel), the bound is the same difference simulated.
2. The real tiny GPT at PP=2: tokens/s of one forward+backward iteration (no optimizer), ours
   (`synchronous_forward_backward`) vs torch's Schedule1F1B / ScheduleGPipe on the same chunks.

Times are medians of `--reps` repetitions after `--warmup` discarded ones. All variants of one table
row run alternately in the same processes, so machine noise (this box is shared) hits them alike. A
repetition's makespan is max(end) - min(start) over ranks (perf_counter is CLOCK_MONOTONIC, shared by
the processes).
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
from megatron_po.pipeline.executor import (_HEADER, P2PTransport, StageRunner,  # noqa: E402
                                           backwards_before_step, run_rank, synchronous_forward_backward)
from megatron_po.pipeline.partition import build_chunks_for_rank  # noqa: E402
from megatron_po.pipeline.schedules import build_schedule, comm_of  # noqa: E402
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
    """Ranks 0 (sender) and 1 (receiver); one [mbs, WIDTH] fp32 tensor per message. Per sample, in seconds:

    - "waiting": the receiver is blocked in recv before the sender sends (what the simulator's t_p2p
      models): latency = receiver's return time - sender's send time (perf_counter is system-wide);
    - "late": the message was sent 5 ms before the receiver calls recv: the time recv takes (gloo moves
      the data only after the receiver posts its recv, a rendezvous round trip through the sender's
      gloo thread);
    - "send call": how long the send call blocks the sender;
    - raw gloo with the irecv posted before the send: the wait after the data arrived.
    """
    r = dist.get_rank()
    group = ps.get_pipeline_model_parallel_group()
    x, buf = torch.randn(mbs, WIDTH), torch.empty(mbs, WIDTH)
    transport = P2PTransport(2, 1)
    pending = []

    def raw_send(i):
        pending.append(dist.isend(x, 1, group=group, tag=i))

    def raw_recv(i):
        dist.recv(buf, 0, group=group, tag=i)

    def ours_send(i):
        transport.send(1, ("act", i, 1), [x])

    def ours_recv(i):
        transport.recv(1, 0, ("act", i, 1))

    out: dict[str, list] = {}
    i = 0
    for name, send, recv in (("raw gloo isend / recv", raw_send, raw_recv),
                             ("ours P2PTransport.send / recv", ours_send, ours_recv)):
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
    pre = []
    for k in range(n):
        i += 1
        work = dist.irecv(buf, 0, group=group, tag=i) if r == 1 else None
        dist.barrier()
        if r == 0:
            raw_send(i)
            time.sleep(0.008)
        else:
            time.sleep(0.005)
            t = time.perf_counter()
            work.wait()
            pre.append(time.perf_counter() - t)
    out["raw gloo irecv posted before the send: wait after the data arrived"] = pre
    for w in pending:
        w.wait()
    transport.flush()
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


# ---- bench-local prototypes of a transport fix (NOT the product code path; see the report) ----------


class OneTripTransport(P2PTransport):
    """Prototype. Remembers the shapes of the last message per (peer, kind, destination virtual stage) and
    then posts the header's and the payload's irecv together, so a message costs one gloo rendezvous round
    trip instead of two (header, then payload). `prepost` posts them before the op that needs them, so
    gloo can push the data the moment the sender sends it (no round trip left on the critical path).
    Shapes are checked against the header; the bench's shapes are static."""

    def __init__(self, num_stages, num_chunks):
        super().__init__(num_stages, num_chunks)
        self.shapes: dict = {}
        self.posted: dict = {}

    def prepost(self, me, peer, key):
        cache_key = (peer, key[0], key[2])
        if key in self.posted or cache_key not in self.shapes:
            return
        dtype, shapes = self.shapes[cache_key]
        tag, src = self._tag(key), self.ranks[peer]
        head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        sizes = [int(torch.Size(sh).numel()) for sh in shapes]
        payload = torch.empty(sum(sizes), dtype=dtype, device=self.device)
        self.posted[key] = (dist.irecv(head, src, group=self.group, tag=tag),
                            dist.irecv(payload, src, group=self.group, tag=tag + 1), head, payload, shapes, sizes)

    def recv(self, me, peer, key):
        self.prepost(me, peer, key)
        if key not in self.posted:  # first message of this kind: the header path
            out = super().recv(me, peer, key)
            self.shapes[(peer, key[0], key[2])] = (out[0].dtype, [tuple(t.shape) for t in out])
            return out
        head_work, payload_work, head, payload, shapes, sizes = self.posted.pop(key)
        head_work.wait()
        payload_work.wait()
        h = head.tolist()
        assert h[0] == len(shapes) and h[2] == len(shapes[0]) and tuple(h[3:3 + h[2]]) == shapes[0], \
            "message shape changed: the prototype only handles static shapes"
        return [t.view(sh) for t, sh in zip(payload.split(sizes), shapes)]


def prepost_run_rank(schedule, runner, lookahead):
    """run_rank, but before each op the recvs of the next `lookahead` ops are posted (prototype)."""
    ops = schedule.ops[runner.rank]
    sync_at = backwards_before_step(ops)
    recvs = [comm_of(op, runner.rank, schedule.num_stages, schedule.num_chunks)[0] for op in ops]
    for i, op in enumerate(ops):
        for j in range(i + 1, min(len(ops), i + 1 + lookahead)):
            if recvs[j] is not None:
                runner.transport.prepost(runner.rank, *recvs[j])
        runner.run(op, sync_grads=i in sync_at)
    runner.transport.flush()


LOOKAHEAD = 4
VARIANTS = ("ours", "ours_1trip", "ours_prepost")  # real path, prototype one-trip, prototype one-trip + prepost


def ours_runners(method, num_chunks, t_f, t_b, mbs):
    """{variant: n -> run one iteration of n micro-batches} on one set of sleeping chunks per variant."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    get_batch = synthetic_batches(mbs)
    out = {}
    for variant in VARIANTS:
        chunks = sleep_chunks(num_chunks, t_f, t_b)
        transport = P2PTransport(D, num_chunks) if variant == "ours" else OneTripTransport(D, num_chunks)

        def run(n, chunks=chunks, transport=transport, variant=variant):
            schedule = build_schedule(method, D, num_chunks, n)
            runner = StageRunner(rank=r, num_stages=D, chunks=chunks, transport=transport, get_batch=get_batch,
                                 loss_scale=1.0 / n)
            if variant == "ours_prepost":
                prepost_run_rank(schedule, runner, LOOKAHEAD)
            else:
                run_rank(schedule, runner)  # the real driver

        out[variant] = run
    return out


def synthetic_stream(lengths, t_f, t_b, mbs, warmup, reps):
    """Async no-flush stream: every variant and every length, `warmup + reps` times, all alternating so
    machine noise hits them alike. Returns {(variant, length): [(start, end)]}."""
    runs = ours_runners("async", 1, t_f, t_b, mbs)
    out = {(variant, n): [] for variant in VARIANTS for n in lengths}
    for _ in range(warmup + reps):
        for variant in VARIANTS:
            for n in lengths:
                out[(variant, n)].append(timed(lambda: runs[variant](n)))
    return out


def synthetic_pair(method, kind, num_chunks, M, t_f, t_b, mbs, warmup, reps):
    """Ours (and the prototypes) and torch's `kind` schedule on identical sleeping stages, repetitions
    alternating. Returns {variant or "torch": [(start, end)]}."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    runs = ours_runners(method, num_chunks, t_f, t_b, mbs)
    torch_chunks = sleep_chunks(num_chunks, t_f, t_b, TorchSleepStage)
    group = ps.get_pipeline_model_parallel_group()
    stages = [PipelineStage(chunk, c * D + r, D * num_chunks, torch.device("cpu"), group=group)
              for c, chunk in enumerate(torch_chunks)]
    loss_fn = lambda out, target: out.mean()  # noqa: E731
    if kind == "interleaved":
        torch_schedule = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    else:
        torch_schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], M, loss_fn=loss_fn)
    x = torch.randn(M * mbs, WIDTH)
    target = torch.zeros(M * mbs, WIDTH)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def run_torch():
        torch_schedule.step(*((x,) if first else ()), target=target if last else None,
                            losses=[] if last else None, return_outputs=False)

    out = {name: [] for name in VARIANTS + ("torch",)}
    for _ in range(warmup + reps):
        for variant in VARIANTS:
            out[variant].append(timed(lambda: runs[variant](M)))
        out["torch"].append(timed(run_torch))
    return out


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


def async_bound(D, n1, n2, t_f, t_b, t_p2p):
    """Simulated steady-state micro-batches/s of the async stream: the makespan difference of two lengths."""
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
    p.add_argument("--gpt-reps", type=int, default=9)
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--skip-synthetic", action="store_true")
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
    p2p = merge_p2p(res)
    emit(f"## 0. p2p cost per message on gloo: one [{args.mbs}, {WIDTH}] fp32 tensor, 2 ranks, "
         f"{args.p2p_samples} samples each")
    emit()
    rows = []
    for k, v in p2p.items():
        q = statistics.quantiles([x * 1e6 for x in v], n=10)
        rows.append([k, f"{median(v) * 1e6:.0f}", f"{q[0]:.0f}", f"{q[-1]:.0f}"])
    emit(table(["what", "median us", "p10 us", "p90 us"], rows))
    t_p2p = median(p2p["ours P2PTransport.send / recv: one-way latency, receiver waiting"])
    emit()
    emit(f"Simulator p2p cost used below: t_p2p = {t_p2p * 1e3:.3f} ms (ours, one-way, receiver waiting).")
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
             f"after a sleep) and t_p2p = {t_p2p * 1e3:.2f} ms (table 0).")
        emit("- `ours`: run_rank + StageRunner + P2PTransport, the real code path. `torch`: ScheduleGPipe / "
             "Schedule1F1B / ScheduleInterleaved1F1B (2 PipelineStages per rank) on the same stages.")
        emit(f"- `proto 1-trip`, `proto prepost`: bench-local prototypes of a transport fix, not product code: "
             f"header and payload irecv posted together from a shape cache (one gloo rendezvous per message "
             f"instead of two); plus those irecvs posted {LOOKAHEAD} ops ahead of the op that needs them.")
        emit(f"- async: steady-state throughput of the no-flush stream, (N2-N1) / (T(N2)-T(N1)), N1=2M, N2=4M "
             f"(fill and drain cancel); no torch counterpart.")
        emit()
        rows = []
        for M in args.Ms:
            for name, method, v, kind in [("gpipe", "gpipe", 1, "gpipe"), ("1f1b", "1f1b", 1, "1f1b"),
                                          ("interleaved 1f1b v=2", "1f1b", 2, "interleaved"),
                                          ("async 1f1b", "async", 1, None)]:
                tf_cal, tb_cal = cal[v]
                if method == "async":
                    n1, n2 = 2 * M, 4 * M
                    per_rank = run_distributed(synthetic_stream, D, pp=D, timeout=TIMEOUT,
                                               args=([n1, n2], t_f, t_b, args.mbs, args.warmup, args.reps))
                    got = {}
                    for variant in VARIANTS:
                        s1 = makespans([r[(variant, n1)] for r in per_rank], args.warmup)
                        s2 = makespans([r[(variant, n2)] for r in per_rank], args.warmup)
                        got[variant] = (n2 - n1) / (median(s2) - median(s1))
                    b0 = async_bound(D, n1, n2, t_f, t_b, 0.0)
                    bp = async_bound(D, n1, n2, t_f, t_b, t_p2p)
                    bc = async_bound(D, n1, n2, tf_cal, tb_cal, t_p2p)
                    label = f"{name} (N={n1}->{n2})"
                else:
                    per_rank = run_distributed(synthetic_pair, D, pp=D, timeout=TIMEOUT,
                                               args=(method, kind, v, M, t_f, t_b, args.mbs, args.warmup, args.reps))
                    got = {k: M / median(makespans([r[k] for r in per_rank], args.warmup))
                           for k in VARIANTS + ("torch",)}
                    b0 = bound(method, D, v, M, t_f / v, t_b / v, 0.0)
                    bp = bound(method, D, v, M, t_f / v, t_b / v, t_p2p)
                    bc = bound(method, D, v, M, tf_cal, tb_cal, t_p2p)
                    label = name
                theirs = got.get("torch")
                ours, theirs = got["ours"], got.get("torch")
                row = [M, label, f"{b0 / ideal:.3f}", f"{bp / ideal:.3f}", f"{bc / ideal:.3f}", f"{ours / ideal:.3f}",
                       f"{ours / bp:.3f}", f"{ours / bc:.3f}", "-" if theirs is None else f"{theirs / ideal:.3f}",
                       "-" if theirs is None else f"{ours / theirs:.3f}x",
                       f"{got['ours_1trip'] / ideal:.3f}", f"{got['ours_prepost'] / ideal:.3f}"]
                rows.append(row)
                print("  ", row, flush=True)
        emit(table(["M", "schedule", "bound", "bound p2p", "bound cal", "ours", "ours/bound p2p", "ours/bound cal",
                    "torch", "ours/torch", "proto 1-trip", "proto prepost"], rows))
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
             f"no optimizer; 1 thread per rank; median of {args.gpt_reps} after 2 warm-up, ours and torch "
             f"alternating in the same 2 processes")
        emit()
        rows = []
        tokens = M * mbs * mc.seq_length
        for method in ["1f1b", "gpipe"]:
            ours = makespans([r[method][0] for r in res], 2)
            theirs = makespans([r[method][1] for r in res], 2)
            to, tt = tokens / median(ours), tokens / median(theirs)
            rows.append([method, f"{to:,.0f}", f"{tt:,.0f}", f"{to / tt:.3f}x",
                         f"{median(ours) * 1e3:.0f} / {median(theirs) * 1e3:.0f}"])
        emit(table(["schedule", "ours tokens/s", "torch.pipelining tokens/s", "ours/torch",
                    "iteration ms ours / torch"], rows))
        emit()
    emit(f"load average at end {os.getloadavg()[0]:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
