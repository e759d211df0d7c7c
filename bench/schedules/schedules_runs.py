"""bench/schedules/schedules.py's runs: the functions each forked rank executes (tests/dist_harness.py) and what
they return: p2p costs on gloo, our schedules and torch's on the sleeping stages (synchronous and the
asynchronous no-flush stream), the tiny GPT synchronous and asynchronous, and a sleeping stage's real duration
measured in one process."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from bench_common import gpt_batches, median
from megatron_po import parallel_state as ps
from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
from megatron_po.pipeline.executor import P2PTransport, synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank, gpt_message_specs
from megatron_po.tensor_parallel import model_parallel_seed
from schedules_measure import POLICY_HOOKS, accumulate, instrument, steady_window, timed
from schedules_stages import (WIDTH, GPTStageAdapter, SleepStage, TorchSleepStage, gpt_config, gpt_loss_fn,
                              measure_sleeps, run_rank_on, sleep_chunks, sleeping_pipeoptim, synthetic_batches,
                              synthetic_specs, torch_schedule)

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


SYNC_VARIANTS = ("ours", "header", "torch")


def synthetic_sync(method, kind, num_chunks, M, t_f, t_b, mbs, warmup, reps):
    """Ours with agreed shapes, ours with the header protocol and torch's `kind` schedule on identical
    sleeping stages, repetitions alternating. Returns {variant: [(start, end)]}."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    runs = {"ours": run_rank_on(method, sleep_chunks(r, D, num_chunks, t_f, t_b), mbs, synthetic_specs(mbs)),
            "header": run_rank_on(method, sleep_chunks(r, D, num_chunks, t_f, t_b), mbs, None)}
    run_torch = torch_schedule(kind, sleep_chunks(r, D, num_chunks, t_f, t_b, TorchSleepStage), M, mbs)
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


ASYNC_VARIANTS = ("pipeoptim", "pipeoptim_header", "schedule")


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
    get_batch = synthetic_batches(mbs)
    ranks = {name: sleeping_pipeoptim(lambda r, D, v: sleep_chunks(r, D, v, t_f, t_b), mbs,
                                      agreed_shapes=name == "pipeoptim") for name in ("pipeoptim", "pipeoptim_header")}
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
    r = ps.get_pipeline_model_parallel_rank()
    runs["schedule"] = run_rank_on("async", sleep_chunks(r, D, 1, t_f, t_b), mbs, synthetic_specs(mbs))
    run_torch = torch_schedule("1f1b", sleep_chunks(r, D, 1, t_f, t_b, TorchSleepStage), M, mbs)
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


def gpt_async_bench(model_cfg, vocab, mbs, n, methods, warmup, reps):
    """Segments of n micro-batches through AsyncPipelineRank.train_segment (k=1, the training defaults:
    AdamW, clip 1.0, agreed shapes) for each method, one AsyncPipelineRank per method built from the same
    seed, repetitions alternating (ABC CBA ...). Returns per method: [(start, end)], per-segment policy
    and step time of this rank, and copies_per_chunk()."""
    cfg = gpt_config(model_cfg)
    specs = gpt_message_specs(cfg, mbs)
    pool = gpt_batches(8, mbs, model_cfg.seq_length, vocab)
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
