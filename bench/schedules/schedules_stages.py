"""bench/schedules/schedules.py's workloads: synthetic stages that sleep t_f in forward and t_b in backward (our
StageRunner's interface and torch.pipelining's), the drivers that run one of our or torch's schedules on
them, and the tiny GPT's adapters (torch.pipelining stage, loss, config)."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from megatron_po import parallel_state as ps
from megatron_po.config import Config
from megatron_po.models.gpt import masked_mean_loss
from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
from megatron_po.pipeline.executor import P2PTransport, StageRunner, run_rank
from megatron_po.pipeline.partition import ActivationSpecs
from megatron_po.pipeline.schedules import build_schedule, placement_of, virtual_stage
from megatron_po.tensor_parallel import vocab_parallel_cross_entropy
from megatron_po.tensor_parallel.layers import ColumnParallelLinear

WIDTH = 16  # synthetic activations are [mbs, WIDTH]


def synthetic_specs(mbs: int) -> ActivationSpecs:
    """The agreed shape of every synthetic message (activations and their gradients): [mbs, WIDTH] fp32.
    ActivationSpecs is shape-agnostic (one tensor of a fixed shape per message), frozen and hashable."""
    return ActivationSpecs((mbs, WIDTH))


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

    def forward(self, input_ids=None, hidden_states=None, labels=None, loss_mask=None):
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


TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}


def torch_schedule(kind, chunks, M, mbs, placement="interleaved"):
    """torch's `kind` schedule (TORCH_SCHEDULES; "zb" at one chunk is ZB-H1) on this rank's `chunks` (modules of one
    positional tensor) at the virtual stages `placement` gives them; returns a function running one iteration."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    stages = [PipelineStage(chunk, virtual_stage(r, c, D, placement), D * len(chunks), torch.device("cpu"), group=group)
              for c, chunk in enumerate(chunks)]
    loss_fn = lambda out, target: out.mean()  # noqa: E731
    schedule = TORCH_SCHEDULES[kind](stages[0] if kind in ("gpipe", "1f1b") else stages, M, loss_fn=loss_fn)
    x = torch.randn(M * mbs, WIDTH)
    target = torch.zeros(M * mbs, WIDTH)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def run():
        schedule.step(*((x,) if first else ()), target=target if last else None,
                      losses=[] if last else None, return_outputs=False)

    return run


def run_rank_on(method, chunks, mbs, specs, instrument=lambda runner: runner, **runner_kwargs):
    """n -> one run of `method`'s schedule of n micro-batches through run_rank + StageRunner + P2PTransport (the real
    driver) on this rank's `chunks` (sleeping stages; Step ops do nothing unless `step_fn` is among `runner_kwargs`);
    `instrument(runner)` may wrap each runner (bench/schedules/simulator_check.py times its ops). The transport:
    `run.transport`."""
    D, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    get_batch = synthetic_batches(mbs)
    transport = P2PTransport(D, len(chunks), specs)
    schedules = {}

    def run(n, on_loss=None):
        if n not in schedules:
            schedules[n] = build_schedule(method, D, len(chunks), n)
        runner = StageRunner(rank=r, num_stages=D, chunks=chunks, transport=transport, get_batch=get_batch,
                             loss_scale=1.0 / n, on_loss=on_loss, placement=placement_of(method), **runner_kwargs)
        run_rank(schedules[n], instrument(runner))

    run.transport = transport
    return run


ASYNC_LR = 1e-4  # the sleeping stages' Adam: its steps and PipeOptim's predictions run for real, on [WIDTH] weights


def sleeping_pipeoptim(build, mbs: int, k: int = 1, agreed_shapes: bool = True):
    """AsyncPipelineRank with PipeOptim and Adam stepping every k micro-batches, whose chunk builder is swapped for
    `build(rank, num_stages, num_chunks)` (sleeping stages); messages of agreed shapes (else the header protocol)."""
    cfg = Config()
    cfg.model.untie_embeddings_and_output_weights = True
    return AsyncPipelineRank(cfg, 0, "pipeoptim", num_chunks=1, update_interval=k, optimizer_name="adam",
                             optimizer_kwargs={"lr": ASYNC_LR}, message_specs=synthetic_specs(mbs) if agreed_shapes
                             else None, build_chunks=lambda cfg, vocab, rank, num_stages, num_chunks, device=None:
                             build(rank, num_stages, num_chunks))


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
