"""Bytes per parameter per rank: measured from the real tensors, next to Megatron's published table.

For DP in {1, 2, 4} (forked gloo ranks on this machine), builds a small GPT, the DDP gradient buffer and
the optimizer (Adam), takes one training step so the optimizer state exists, then adds up the storage
sizes of the weights, gradients, fp32 main params and optimizer state on rank 0
(megatron_po/optim/memory.py), divided by the number of model parameters. Rows:

  bf16 params, fp32 grads   --bf16 --accumulate-allreduce-grads-in-fp32     Megatron: 18 | 6 + 12/DP
  fp16 params, fp16 grads   --fp16                                          Megatron: 20 | 4 + 16/DP
  fp32 params, fp32 grads   (default)                                       Megatron: 16 | 8 + 8/DP

Where we differ from Megatron, by design: with fp16/bf16 grads in the model dtype our fp32 main grads are
a per-step temporary, not a persistent buffer (so 16 | 4 + 12/DP persistent, plus 4 bytes/param for the
duration of the step, 4/DP sharded); with fp32 params the distributed optimizer still keeps an fp32 main
shard apart from the weights (8 + 12/DP), which is what lets PipeOptim predict without a weight copy.

    python bench/memory/memory.py [--hidden 128 --layers 4 --vocab 512]

With --recompute: activation memory and step time of activation recomputation (--recompute-*) on the
tiny GPT of examples/gpt_tiny.sh (4 layers, hidden 128, 4 heads, seq 128, micro-batch 8, vocab 4000), one
process, fp32, for none / selective / full (uniform 1, uniform 2, block 2), at dropout 0 (the example's) and
0.1 (Megatron's default). Activation memory is MEASURED: every tensor an op creates during the forward is
tracked (TorchDispatchMode + weak references) and the storages still alive when the forward returns,
i.e. what the autograd graph keeps for the backward (checkpointed inputs included), are added up; the
peak is the most bytes alive at once over forward + backward (the recomputation's working set and the
parameter gradients included). Step time: forward + backward, one thread, the modes interleaved
repetition by repetition, median. Ratios are against `none` in the same run.

    python bench/memory/memory.py --recompute [--reps 7 --out bench/results/recompute.md]

With --async: the memory guard of the asynchronous methods (issue 30). Whole-run peak of the bytes alive
in storages created during training (gradients, optimizer state, activations in flight, messages,
PipeOptim's Ŵ and kept ΔW, PipeDream's stashed versions; the weights and fp32 main params made before
training are the same for every method and not counted), single-process emulator, D = 4 stages of one
layer, AdamW, one segment; each method's peak minus async-naive's, per model parameter, fp32 and bf16.
PipeOptim twice: with the prediction fused into the step (the default) and with it predicted separately
before each forward (`fuse_prediction = False`, the path before issue 30). Ŵ's fp32 temporaries are
bounded as at scale (GUARD_CHUNK). Deterministic (same ops, same
allocation order; no timing involved); --quick: a shorter segment (what tests/test_fused_prediction.py
runs and bounds).

    python bench/memory/memory.py --async [--quick]

With --context-parallel: context parallelism's activation memory per rank at 8,192 tokens for CP = 1, 2, 4 (the
tracker above, on forked gloo ranks), the ring's bytes against the arithmetic and the time per iteration
(`context_parallel_main` below); --quick: 1,024 tokens.

    python bench/memory/memory.py --context-parallel [--out bench/results/context_parallel.md]

With --fsdp: FSDP2's parameter, gradient, optimizer-state, stash and gathered bytes per rank at DP 1, 2, 4 for 1F1B,
PipeOptim and PipeDream at PP 2, against DDP / DP and the gathered units' arithmetic, and the time per iteration
against DDP at equal work (bench/memory/fsdp.py says what is measured); --quick: DP 1 and 2, one timed repetition.

    python bench/memory/memory.py --fsdp [--reps 5 --out bench/results/fsdp.md]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megatron_po import parallel_state as ps  # noqa: E402
from megatron_po.config import ASYNC_METHODS, Config, ModelConfig  # noqa: E402
from megatron_po.data.context_split import split_for_this_rank  # noqa: E402
from megatron_po.distributed.ddp import DistributedDataParallel  # noqa: E402
from megatron_po.models import context_parallel_attention  # noqa: E402
from megatron_po.models.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megatron_po.optim import build_optimizer  # noqa: E402
from megatron_po.optim.distributed_optimizer import DistributedOptimizer  # noqa: E402
from megatron_po.optim.memory import MEGATRON_BYTES_PER_PARAM, measure_training_memory  # noqa: E402
from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer  # noqa: E402
from megatron_po.pipeline.async_pipeline import AsyncEmulator  # noqa: E402
from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate  # noqa: E402
from megatron_po.pipeline.partition import build_chunks_for_rank  # noqa: E402
from megatron_po.pipeline.schedules import Step, build_schedule  # noqa: E402
from megatron_po.tensor_parallel import model_parallel_seed  # noqa: E402

SETTINGS = {  # name: (model dtype, grad buffer dtype)
    "bf16 params, fp32 grads": (torch.bfloat16, torch.float32),
    "fp16 params, fp16 grads": (torch.float16, torch.float16),
    "fp32 params, fp32 grads": (torch.float32, torch.float32),
}


def measure(cfg: ModelConfig, vocab: int, setting: str, distributed: bool) -> dict:
    dtype, grad_dtype = SETTINGS[setting]
    torch.manual_seed(0)
    model = GPTModel(cfg, vocab, seed=1).to(dtype)
    ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), grad_dtype=grad_dtype,
                                  use_distributed_optimizer=distributed)
    params = list(model.parameters())

    def adam(groups):
        return build_optimizer("adam", groups, lr=1e-4)

    if distributed:
        opt = DistributedOptimizer(adam, params, ddp)
    elif dtype != torch.float32:
        opt = MixedPrecisionOptimizer(adam, params)
    else:
        opt = adam(params)
    tokens = torch.randint(0, vocab, (2, cfg.seq_length + 1))
    loss = masked_mean_loss(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(2, cfg.seq_length))
    ddp.zero_grad()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return measure_training_memory(params, ddp, opt).per_param()


# --------------------------------------------------------------------------------------------------
# Activation recomputation: measured activation memory and step time
# --------------------------------------------------------------------------------------------------

RECOMPUTE_MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full uniform 2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full block 2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}
TINY_GPT = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128)  # examples/gpt_tiny.sh
TINY_BATCH, TINY_VOCAB = 8, 4096  # --micro-batch-size 8; the example's 4000-token BPE padded to 128


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages created by ops inside the mode that are still alive (views counted once),
    and the most alive at once. Tensors made before the mode (parameters, the batch) are not counted."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [tensors alive, nbytes]
        self.refs: dict = {}  # id -> weak reference whose callback releases its storage's count
        self.live = self.peak = 0

    def _release(self, ref, ptr: int) -> None:
        del self.refs[id(ref)]
        entry = self.storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.storages:
                    self.storages[ptr] = [0, t.untyped_storage().nbytes()]
                    self.live += self.storages[ptr][1]
                self.storages[ptr][0] += 1
                ref = weakref.ref(t, lambda ref, ptr=ptr: self._release(ref, ptr))
                self.refs[id(ref)] = ref
        self.peak = max(self.peak, self.live)
        return out


def recompute_step(model, tokens, measure: bool) -> tuple[float, int, int]:
    """(seconds, bytes kept by the graph after the forward, peak bytes over forward + backward)."""
    tracker = LiveTensors() if measure else None
    start = time.perf_counter()
    with tracker if measure else contextlib.nullcontext():
        loss = masked_mean_loss(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]),
                                torch.ones(tokens.shape[0], tokens.shape[1] - 1))
        kept = tracker.live if measure else 0
        loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, kept, tracker.peak if measure else 0


def recompute_table(dropout: float, reps: int) -> list[dict]:
    models, tokens = {}, torch.randint(0, TINY_VOCAB, (TINY_BATCH, TINY_GPT.seq_length + 1),
                                       generator=torch.Generator().manual_seed(0))
    for name, flags in RECOMPUTE_MODES.items():
        model_parallel_seed(1)
        cfg = dataclasses.replace(TINY_GPT, hidden_dropout=dropout, attention_dropout=dropout, **flags)
        models[name] = GPTModel(cfg, TINY_VOCAB, seed=1)
    rows = {name: {"mode": name, "times": []} for name in models}
    for name, model in models.items():  # memory: one measured step each (deterministic)
        _, rows[name]["kept"], rows[name]["peak"] = recompute_step(model, tokens, measure=True)
    for name, model in models.items():
        recompute_step(model, tokens, measure=False)  # warm-up
    for _ in range(reps):  # time: the modes interleaved, so load changes hit them alike
        for name, model in models.items():
            rows[name]["times"].append(recompute_step(model, tokens, measure=False)[0])
    for row in rows.values():
        row["time"] = statistics.median(row["times"])
    return list(rows.values())


PIPELINE_METHODS = ("1f1b", "pipedream", "pipeoptim")
PIPELINE_MODES = ("none", "selective", "full uniform 1")


def pipeline_rank_peaks(method: str, flags: dict, D: int = 4, M: int = 8) -> tuple[list[int], dict]:
    """Peak bytes alive per pipeline rank of what that rank's forward and backward ops create (activations
    of the micro-batches in flight, messages, gradients, PipeOptim's Ŵ, weights kept for recomputation),
    single-process emulator, D stages of one layer each, M micro-batches, dropout 0.1; and the weight
    copies per chunk (asynchronous methods). Optimizer steps are not tracked (their state is not
    activation memory)."""
    model_parallel_seed(1)
    cfg = Config()
    cfg.model = dataclasses.replace(TINY_GPT, num_layers=D, untie_embeddings_and_output_weights=True, **flags)
    cfg.training.seed = 1
    get_batch = bench_common.gpt_batches(M, TINY_BATCH, cfg.model.seq_length, TINY_VOCAB)
    trackers = [LiveTensors() for _ in range(D)]

    def tracked(runner):
        run = runner.run

        def run_tracked(op, sync_grads=False):
            if isinstance(op, Step):
                return run(op, sync_grads)
            with trackers[runner.rank]:
                return run(op, sync_grads)
        runner.run = run_tracked
        return runner

    copies = {}
    if method in ASYNC_METHODS:
        emu = AsyncEmulator(cfg, TINY_VOCAB, method, D, 1, 1, "adam", {"lr": 1e-4}, None, 0.0)
        for stage in emu.stages:
            make = stage.runner
            stage.runner = lambda *a, make=make, **k: tracked(make(*a, **k))
        emu.train_segment(get_batch)
        copies = emu.copies_per_chunk()
        for stage in emu.stages:  # the instrumented runner holds its stage: no cycle outlives this method's run
            del stage.runner
    else:
        mailbox = Mailbox()
        runners = {r: tracked(StageRunner(rank=r, num_stages=D, transport=mailbox, get_batch=get_batch.__getitem__,
                                          chunks=build_chunks_for_rank(cfg, TINY_VOCAB, r, D, 1), loss_scale=1 / M))
                   for r in range(D)}
        emulate(build_schedule(method, D, 1, M), runners)
    return [t.peak for t in trackers], copies


def pipeline_table() -> list[str]:
    lines = ["## Per pipeline rank: activations in flight vs weights kept for recomputation", "",
             f"D = 4 stages of one layer (the tiny GPT's layers), M = 8 micro-batches, dropout 0.1, emulator; "
             "peak MiB per rank of what its forward/backward ops create (activations in flight, messages, "
             "gradients, PipeOptim's prediction, weights kept for recomputation); weight copies per chunk "
             "(live included) for the asynchronous methods.", "",
             "| method | recompute | peak MiB, ranks 0..3 | vs none | weight copies, ranks 0..3 |",
             "|---|---|---|---|---|"]
    for method in PIPELINE_METHODS:
        base = None
        for mode in PIPELINE_MODES:
            peaks, copies = pipeline_rank_peaks(method, dict(RECOMPUTE_MODES[mode], hidden_dropout=0.1,
                                                             attention_dropout=0.1))
            base = base or peaks
            mib = " / ".join(f"{p / 2**20:.1f}" for p in peaks)
            ratio = " / ".join(f"{p / b:.2f}" for p, b in zip(peaks, base))
            held = " / ".join(str(copies[(r, 0)]) for r in range(4)) if copies else "1 (synchronous)"
            lines.append(f"| {method} | {mode} | {mib} | {ratio} | {held} |")
    return lines + [""]


def recompute_main(args) -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = [*bench_common.header(__file__, ["--recompute", "--reps", str(args.reps)],
                                  "Activation recomputation on the tiny GPT (bench/memory/memory.py --recompute)"),
             f"GPT {TINY_GPT.num_layers} layers, hidden {TINY_GPT.hidden_size}, {TINY_GPT.num_attention_heads} heads, "
             f"seq {TINY_GPT.seq_length}, micro-batch {TINY_BATCH}, vocab {TINY_VOCAB}, fp32, CPU, 1 thread.", "",
             "Activation memory = bytes the autograd graph keeps when the forward returns (measured, see the "
             "docstring); peak = most bytes alive over forward + backward (parameter gradients included). "
             "Step = forward + backward, median of the interleaved repetitions. The memory figures are "
             "deterministic; the step times come from a shared machine under the load shown, so read their "
             "ratios as indicative (one extra forward per recomputed layer is the expected cost: about "
             "+1/3 of a step for full).", ""]
    for dropout in (0.0, 0.1):
        rows = recompute_table(dropout, args.reps)
        base = rows[0]
        lines += [f"## dropout {dropout}", "",
                  "| mode | activations (MiB) | vs none | peak (MiB) | vs none | step (ms) | vs none |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['mode']} | {r['kept'] / 2**20:.2f} | {r['kept'] / base['kept']:.2f} | "
                         f"{r['peak'] / 2**20:.2f} | {r['peak'] / base['peak']:.2f} | {1e3 * r['time']:.1f} | "
                         f"{r['time'] / base['time']:.2f} |")
        lines.append("")
    lines += pipeline_table()
    lines.append(bench_common.load_at_end(started))
    bench_common.publish(lines, args.out)


# --------------------------------------------------------------------------------------------------
# Asynchronous methods: peak bytes over async-naive (the memory guard)
# --------------------------------------------------------------------------------------------------

GUARD_GPT = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                        attention_dropout=0.0, untie_embeddings_and_output_weights=True)
GUARD_VOCAB, GUARD_BATCH, GUARD_D = 512, 2, 4
# Mixed precision computes Ŵ in fp32 this many elements at a time (`predict_chunk_numel`). Training uses
# 2**20 against 10**8 parameters per stage (temporaries of 1 % of a stage at most); this model has 0.23 M
# per stage, so the guard bounds them at the same small share instead of letting one chunk be a stage.
GUARD_CHUNK = 4096
GUARD_VARIANTS = {"async-naive": ("async-naive", True), "pipeoptim": ("pipeoptim", True),
                  "pipeoptim (separate prediction)": ("pipeoptim", False), "pipedream": ("pipedream", True)}


def async_peak_bytes(method: str, bf16: bool, fuse: bool = True, microbatches: int = 16) -> tuple[int, int]:
    """(peak bytes alive of storages created while training one segment, model parameters)."""
    from megatron_po.optim.memory import track_new_tensor_bytes
    model_parallel_seed(1)
    cfg = Config()
    cfg.model = GUARD_GPT
    cfg.training.seed = 1
    cfg.precision.bf16 = bf16
    batches = bench_common.gpt_batches(microbatches, GUARD_BATCH, GUARD_GPT.seq_length, GUARD_VOCAB)
    emu = AsyncEmulator(cfg, GUARD_VOCAB, method, GUARD_D, 1, 1, "adamw", {"lr": 1e-3, "weight_decay": 0.01},
                        None, 0.0)
    for stage in emu.stages:
        stage.policy.fuse_prediction = fuse
        for opt in stage.optimizers:
            opt.predict_chunk_numel = GUARD_CHUNK  # (mixed precision) see GUARD_CHUNK
    with track_new_tensor_bytes() as tracked:
        emu.train_segment(batches)
    return tracked.peak, sum(p.numel() for c in emu.chunks for p in c.parameters())


def async_peaks_over_naive(quick: bool = False, variants=tuple(GUARD_VARIANTS)) -> dict[str, dict[str, float]]:
    """{"fp32"/"bf16": {variant: (peak - async-naive's peak) / parameters}} (GUARD_VARIANTS)."""
    torch.set_num_threads(1)
    out = {}
    for bf16 in (False, True):
        peaks = {name: async_peak_bytes(*GUARD_VARIANTS[name][:1], bf16, GUARD_VARIANTS[name][1], 8 if quick else 16)
                 for name in dict.fromkeys(("async-naive", *variants))}
        base, n = peaks["async-naive"]
        out["bf16" if bf16 else "fp32"] = {name: (peak - base) / n for name, (peak, _) in peaks.items()}
    return out


def async_main(args) -> None:
    table = async_peaks_over_naive(args.quick)
    print(f"Peak bytes over async-naive per parameter, whole run (emulator, D = {GUARD_D}, GPT "
          f"{GUARD_GPT.num_layers} x {GUARD_GPT.hidden_size}, vocab {GUARD_VOCAB}, micro-batch {GUARD_BATCH}, "
          f"seq {GUARD_GPT.seq_length}, AdamW, {8 if args.quick else 16} micro-batches), CPU, deterministic")
    print(f"{'variant':<34} {'fp32':>7} {'bf16':>7}")
    for name in GUARD_VARIANTS:
        print(f"{name:<34} {table['fp32'][name]:>+7.2f} {table['bf16'][name]:>+7.2f}")


# --------------------------------------------------------------------------------------------------
# Context parallelism (issue 49): activation memory per rank, the ring's bytes, time per iteration
# --------------------------------------------------------------------------------------------------
#
# A Llama-style GPT (2 layers, hidden 256, 4 heads in 2 key/value groups of dimension 64, RoPE, RMSNorm, SwiGLU,
# vocab 512, fp32, dropout 0) on one sequence of --seq tokens (8,192), at CP = 1, 2 and 4 (forked gloo ranks, one
# thread each, --cp-comm-type p2p), one forward + backward of the micro-batch split as training splits it:
# - activation memory per rank, MEASURED with the tracker above (`LiveTensors`): `kept` = the bytes the autograd
#   graph holds when the forward returns (what a rank keeps for its backward); `peak` = the most bytes alive over
#   forward + backward, the parameter gradients excluded (made before, the backward accumulating into them; the same
#   at every CP). Target: at CP = N at most 1/N of CP = 1's plus the ring's buffers (`buffers`): with a K/V block
#   of b x groups x s/N x head dim x 2 (K and V) x 4 bytes, per layer two blocks in flight in the forward, in the
#   backward two blocks, two fp32 gradient accumulators and the fp32 dq;
# - the ring's bytes per rank, COUNTED at its isend calls, against the arithmetic: per layer, N - 1 K/V blocks in
#   the forward, N - 1 K/V blocks and N fp32 gradient accumulators (a block's size) in the backward;
# - time per iteration (forward + backward, median of --reps after a warm-up): wall (rank 0) and each process's CPU
#   seconds. CP = N splits the same total work over N processes; on a shared 2-core machine the wall figure follows
#   the load printed with it (CP = 4 runs 4 processes on 2 cores), the CPU figures do not.

CP_MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                position_embedding_type="rope", add_position_embedding=False, normalization="RMSNorm", swiglu=True,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                cp_comm_type="p2p")
CP_VOCAB, CP_BATCH, CP_BYTES = 512, 1, 4  # fp32
CP_SIZES = (1, 2, 4)


def cp_ring_bytes(cfg: ModelConfig, cp: int, batch: int = CP_BATCH) -> dict:
    """The arithmetic of one forward + backward per rank (see above), and the buffers it states."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block = batch * cfg.num_query_groups * (cfg.seq_length // cp) * head_dim * 2 * CP_BYTES  # K and V
    sent = cfg.num_layers * ((cp - 1) * block + (cp - 1) * block + cp * block) if cp > 1 else 0
    q_bytes = batch * cfg.num_attention_heads * (cfg.seq_length // cp) * head_dim * 4
    buffers = 0 if cp == 1 else max(2 * block, 2 * block + 2 * block + q_bytes)  # the backward's is the larger
    return {"block": block, "sent": sent, "buffers": buffers}


def cp_measure_rank(seq: int, reps: int) -> dict:
    """This rank's figures at the harness's CP size."""
    torch.set_num_threads(1)
    model_parallel_seed(1)
    cfg = ModelConfig(seq_length=seq, **CP_MODEL)
    model = GPTModel(cfg, CP_VOCAB, seed=1)
    b = split_for_this_rank(bench_common.gpt_batches(1, CP_BATCH, seq, CP_VOCAB)[0])
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    for p in model.parameters():  # made before the tracker: the backward accumulates into them (not counted)
        p.grad = torch.zeros_like(p)

    def loss():  # the micro-batch's mean loss, as training normalises it over the CP ranks
        return ((model(input_ids=b["tokens"], labels=b["labels"], loss_mask=b["loss_mask"]) * b["loss_mask"]).sum()
                / b.get("loss_normalizer", b["loss_mask"].sum()))

    sent, tracker = [], LiveTensors()  # the bytes of every isend the ring posts
    with bench_common.watching(context_parallel_attention.dist, "isend",
                               lambda tensor, *a, **k: sent.append(tensor.numel() * tensor.element_size())), tracker:
        forward = loss()
        kept = tracker.live
        forward.backward()
    model.zero_grad(set_to_none=True)
    times, cpu = [], []
    for i in range(reps + 1):  # the first is a warm-up
        start, start_cpu = time.perf_counter(), time.process_time()
        loss().backward()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        model.zero_grad(set_to_none=True)
    return {"cp": ps.get_context_parallel_world_size(), "rank": ps.get_context_parallel_rank(), "kept": kept,
            "peak": tracker.peak, "grads": grads, "sent": sum(sent), "seconds": statistics.median(times[1:]),
            "cpu_seconds": statistics.median(cpu[1:]),
            "arithmetic": cp_ring_bytes(cfg, ps.get_context_parallel_world_size())}


def cp_measure(seq: int, reps: int, cp_sizes=CP_SIZES) -> dict[int, list[dict]]:
    """{CP: every rank's figures}."""
    return {cp: run_distributed(cp_measure_rank, cp, cp=cp, args=(seq, reps), timeout=1800) for cp in cp_sizes}


def cp_report(results: dict[int, list[dict]], seq: int, header: list[str], started: float) -> str:
    mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    base = results[1][0]
    rows, ring, timing = [], [], []
    for cp, ranks in results.items():
        kept, peak = max(r["kept"] for r in ranks), max(r["peak"] for r in ranks)
        buffers = ranks[0]["arithmetic"]["buffers"]
        bound_kept, bound_peak = base["kept"] / cp + buffers, base["peak"] / cp + buffers
        rows.append([cp, mib(kept), f"{kept / base['kept']:.3f}", mib(peak), f"{peak / base['peak']:.3f}",
                     mib(buffers), "met" if kept <= bound_kept and peak <= bound_peak else "NOT MET"])
        sent = {r["sent"] for r in ranks}
        ring.append([cp, " / ".join(f"{s:,}" for s in sorted(sent)), f"{ranks[0]['arithmetic']['sent']:,}",
                     "equal" if sent == {ranks[0]["arithmetic"]["sent"]} else "DIFFER"])
        total_cpu = sum(r["cpu_seconds"] for r in ranks)
        timing.append([cp, f"{1e3 * ranks[0]['seconds']:.0f}", f"{ranks[0]['seconds'] / base['seconds']:.3f}",
                       f"{1e3 * max(r['cpu_seconds'] for r in ranks):.0f}", f"{1e3 * total_cpu:.0f}",
                       f"{total_cpu / base['cpu_seconds']:.3f}"])
    cfg = ModelConfig(seq_length=seq, **CP_MODEL)
    lines = header + [
        f"GPT {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads in "
        f"{cfg.num_query_groups} key/value groups (head dim {cfg.hidden_size // cfg.num_attention_heads}), RoPE, "
        f"RMSNorm, SwiGLU, vocab {CP_VOCAB}; one sequence of {seq:,} tokens, fp32, CPU, one thread per rank, "
        "--cp-comm-type p2p; one forward + backward (bench/memory/memory.py, its context-parallel section, says what "
        "is measured).",
        "", "## Activation memory per rank (MEASURED)", "",
        "kept: bytes the autograd graph holds when the forward returns; peak: most bytes alive over forward + backward, "
        f"the parameter gradients excluded ({mib(base['grads'])} MiB, allocated before, the same at every CP); the "
        "largest rank's. Target: "
        "at most 1/CP of CP = 1's plus the ring's buffers (per layer at most: two K/V blocks, two fp32 gradient "
        "accumulators and the fp32 dq, held in the backward).", "",
        bench_common.markdown_table(["CP", "kept MiB", "kept / CP=1", "peak MiB", "peak / CP=1", "buffers MiB", "target"], rows),
        "", "## The ring's bytes per rank (COUNTED at its isend calls, against the arithmetic)", "",
        "Per layer: CP - 1 K/V blocks in the forward; CP - 1 K/V blocks and CP fp32 gradient accumulators in the "
        "backward; a block = batch x groups x tokens/CP x head dim x 2 x 4 bytes.", "",
        bench_common.markdown_table(["CP", "bytes sent, per rank", "arithmetic", ""], ring),
        "", "## Time per iteration at equal total work (MEASURED)", "",
        "The same micro-batch (forward + backward): CP = 1 in one process, CP = N split over N processes of one "
        "thread each, on this shared 2-core machine (CP = 4: 4 processes on 2 cores). Wall: rank 0's median; CPU: "
        "the process's CPU seconds per iteration (median), the largest rank's and the sum over the ranks (the total "
        "work: the sum over CP = 1's is the split's overhead). Under the machine's load the wall figures follow the "
        "share of a core each process gets; the CPU figures do not.", "",
        bench_common.markdown_table(["CP", "wall ms / iteration", "vs CP = 1", "CPU ms, largest rank", "CPU ms, all ranks",
                        "all ranks vs CP = 1"], timing), "", bench_common.load_at_end(started) + ".", ""]
    return "\n".join(lines)


def context_parallel_main(args) -> dict[int, list[dict]]:
    """--context-parallel: cp_measure, print the cp_report (and write it to --out); returns the figures."""
    started = time.perf_counter()
    seq = 1024 if args.quick else args.seq
    argv = ["--context-parallel"] + (["--quick"] if args.quick else ["--seq", str(seq), "--reps", str(args.reps)]) \
        + (["--out", args.out] if args.out else [])
    header = bench_common.header(__file__, argv,
                                 title="Context parallelism on the CPU: memory, ring bytes, time (issue 49)")
    results = cp_measure(seq, 1 if args.quick else args.reps)
    text = cp_report(results, seq, header, started)
    print(text)
    if args.out:
        bench_common.write_text(args.out, text)
    return results

def main() -> None:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--recompute", action="store_true", help="activation recomputation table instead")
    parser.add_argument("--async", dest="async_methods", action="store_true",
                        help="the asynchronous methods' peak bytes over async-naive (memory guard) instead")
    parser.add_argument("--context-parallel", action="store_true",
                        help="context parallelism's memory per rank, ring bytes and time at CP = 1, 2, 4 instead")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2's bytes per rank against the arithmetic and its time against DDP, DP 1, 2, 4 "
                             "(bench/memory/fsdp.py) instead")
    parser.add_argument("--seq", type=int, default=8192, help="--context-parallel: tokens per sequence")
    parser.add_argument("--quick", action="store_true", help="--async: a shorter segment; --context-parallel: 1,024 "
                                                             "tokens")
    parser.add_argument("--reps", type=int, default=7, help="--recompute, --fsdp: timed repetitions")
    parser.add_argument("--out", help="--recompute, --context-parallel, --fsdp: also write the table to this markdown "
                                      "file")
    args = parser.parse_args()
    if args.fsdp:
        from fsdp import fsdp_main  # bench/memory/fsdp.py
        fsdp_main(args)
        return
    if args.context_parallel:
        context_parallel_main(args)
        return
    if args.async_methods:
        async_main(args)
        return
    if args.recompute:
        recompute_main(args)
        return
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, seq_length=32,
                      hidden_dropout=0.0, attention_dropout=0.0)
    n = sum(p.numel() for p in GPTModel(cfg, args.vocab, seed=1).parameters())
    build_optimizer("adam", [torch.zeros(1, requires_grad=True)], lr=1.0)  # lazy imports once, before forking
    print(f"GPT {args.layers} x {args.hidden}, vocab {args.vocab}: {n / 1e6:.2f} M parameters; Adam; bytes per "
          "parameter on rank 0, measured (storage sizes) vs Megatron's table")
    header = f"{'setting':<26} {'DP':>2} {'optimizer':<12} {'params':>7} {'grads':>7} {'main':>7} {'state':>7} " \
             f"{'total':>7} {'Megatron':>9}"
    print(header)
    print("-" * len(header))
    for setting, (plain_ref, sharded_ref) in MEGATRON_BYTES_PER_PARAM.items():
        for dp in (1, 2, 4):
            for distributed in (False, True):
                row = run_distributed(measure, dp, args=(cfg, args.vocab, setting, distributed))[0]
                ref = sharded_ref(dp) if distributed else plain_ref
                name = "distributed" if distributed else "plain"
                print(f"{setting:<26} {dp:>2} {name:<12} {row['params']:>7.2f} {row['grads']:>7.2f} "
                      f"{row['main_params']:>7.2f} {row['optimizer_state']:>7.2f} {row['total']:>7.2f} {ref:>9.2f}")
        print()


if __name__ == "__main__":
    main()
