"""FSDP2's memory per rank, measured, against the arithmetic, and its time per iteration against DDP (issue 55):
bench/memory/memory.py --fsdp runs this.

A GPT of 4 layers, hidden 128, 4 heads, sequence 32, vocabulary 512 (untied), in PP 2 stages of 2 layers, at
DP 1, 2 and 4 (2, 4 and 8 forked gloo ranks, one thread each), fp32, Adam, micro-batches of 2 sequences, for
1F1B (synchronous: iterations of 4 micro-batches per DP rank), PipeOptim and PipeDream (asynchronous: segments
of 8 micro-batches), each under DDP and under FSDP2 (--use-torch-fsdp2). On rank 0 (pipeline stage 0, the
embedding and 2 layers; the stage that stashes: s = 1), the bytes of the storages of:
  - params: the weights (FSDP2: the padded shards it gathers from);
  - grads: the gradients right before an optimizer step (DDP: its flat buffer; FSDP2: the sharded grads);
  - optimizer state: Adam's exp_avg and exp_avg_sq (and the step counters);
  - stash: the extra weight versions a policy holds at its peak (PipeDream's stashed versions, PipeOptim's cache
    of the live weights while a forward runs on the prediction), polled after every policy hook;
  - gathered: the most bytes of gathered (unsharded) parameters alive at once, polled at every gather FSDP2
    issues and completes (the units gathered, an issued prefetch's buffer and the buffer FSDP2 keeps in the
    forward).
Arithmetic (FSDP2): params, grads, optimizer state and stash = DDP's / DP (FSDP2 pads each parameter's rows to a
multiple of DP: every dim here divides, so exactly 1/DP); gathered = the chunk's root unit (PP stage 0's root
holds no parameter) + in the forward the running unit twice (its parameters, and its gather buffer, which FSDP2
keeps until the next unit's copy-out to overlap the two) + the next unit's buffer (the prefetch), whole; at DP 1
nothing is gathered (a unit's shard is copied into its unsharded parameters): root + the running unit.
Time: per iteration (1F1B) or per 4 micro-batches (asynchronous), median over the timed repetitions after a
warm-up: wall on rank 0, and the CPU seconds summed over all ranks (the total work; on a shared machine the
wall follows the load, the CPU seconds much less).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import bench_common
from dist_harness import run_distributed
from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig
from megatron_po.distributed.fsdp import local_shard
from megatron_po.tensor_parallel import model_parallel_seed

FSDP_GPT = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=True)
FSDP_VOCAB, FSDP_BATCH, FSDP_STAGES = 512, 2, 2
FSDP_METHODS = ("1f1b", "pipeoptim", "pipedream")
FSDP_DP = (1, 2, 4)


def _bytes(tensors) -> int:
    """Storage bytes of `tensors`, each storage once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class _Gathered:
    """The most bytes of unsharded parameters alive at once (FSDP2's gathered units and pending prefetches),
    polled after every unshard and wait: the patched FSDPParamGroup methods call `poll`."""

    def __init__(self, chunks):
        self.groups = [m._get_fsdp_state()._fsdp_param_group for c in chunks for m in c.modules()
                       if isinstance(m, FSDPModule)]
        self.groups = [g for g in self.groups if g is not None]
        self.peak = 0
        self._patched = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "wait_for_unshard")}
        for name, real in self._patched.items():
            setattr(FSDPParamGroup, name, self._polling(real))

    def _polling(self, real):
        def method(group, *args, **kwargs):
            out = real(group, *args, **kwargs)
            self.poll()
            return out
        return method

    def poll(self) -> None:
        held = []
        for g in self.groups:
            held += [p._unsharded_param for p in g.fsdp_params if hasattr(p, "_unsharded_param")]
            pending = g._all_gather_result  # issued (a prefetch), not yet copied out
            deferred = g.comm_ctx.all_gather_state  # the last copied-out unit's buffer, kept in the forward
            held += [r.all_gather_output for r in (pending, deferred and deferred.all_gather_result) if r is not None]
        self.peak = max(self.peak, _bytes(held))

    def close(self) -> None:
        for name, real in self._patched.items():
            setattr(FSDPParamGroup, name, real)


def _units_arithmetic(chunks, dp: int) -> int:
    """Bytes of gathered parameters at most alive at once: the root unit (gathered through the chunk's pass) and,
    in the forward, the running unit twice (its parameters and its gather buffer, which FSDP2 keeps until the
    next unit's copy-out to overlap the two) plus the next unit's buffer (the prefetch). In the backward the
    buffer is freed at once (running + prefetched units: less). At DP 1 nothing is gathered: a unit's shard is
    copied into its unsharded parameters when it runs (root + the running unit)."""
    total = 0
    for chunk in chunks:
        units = [m for m in chunk.modules() if isinstance(m, FSDPModule) and m is not chunk]
        sizes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
        root = sum(p.numel() * p.element_size() for p in chunk.parameters()) - sum(sizes)
        if dp == 1:
            total = max(total, root + max(sizes, default=0))
            continue
        following = sizes[1:] + [0]
        total = max(total, 2 * root + (sizes[0] if sizes else 0),
                    root + max((2 * a + b for a, b in zip(sizes, following)), default=0))
    return total


def _config(fsdp: bool) -> Config:
    cfg = Config()
    cfg.model = FSDP_GPT
    cfg.training.seed = 1
    cfg.parallel.pipeline_model_parallel_size = FSDP_STAGES
    cfg.parallel.use_torch_fsdp2 = fsdp
    cfg.training.micro_batch_size = FSDP_BATCH
    return cfg


def _batch(mb: int) -> dict:
    """This DP rank's micro-batch `mb` (a seed per micro-batch and DP rank)."""
    return bench_common.gpt_batches(1, FSDP_BATCH, FSDP_GPT.seq_length, FSDP_VOCAB,
                                    seed=1000 * ps.get_data_parallel_rank() + mb)[0]


def _breakdown(params, grads, optimizers) -> dict:
    state = [v for opt in optimizers for st in getattr(opt, "optimizer", opt).state.values() for v in st.values()]
    return {"params": _bytes(params), "grads": _bytes(grads), "state": _bytes(state)}


def _sync_rank(fsdp: bool, reps: int) -> dict:
    from megatron_po.pipeline.partition import build_pipeline_chunks
    from megatron_po.training_setup import build_optimizer_for, data_parallel
    from megatron_po.training_step import train_step
    cfg = _config(fsdp)
    model_parallel_seed(1)
    chunks, ddp = data_parallel(cfg, build_pipeline_chunks(cfg, FSDP_VOCAB))
    optimizer = build_optimizer_for(cfg, chunks, ddp)
    gathered = _Gathered(chunks) if fsdp else None
    params = [local_shard(p) for c in chunks for p in c.parameters()]
    seen = {}
    step = optimizer.step

    def measured_step(*args, **kwargs):  # the gradients as the step finds them
        grads = [ddp.grad_buffer] if not fsdp else [local_shard(p.grad) for p in ddp.params if p.grad is not None]
        seen["grads"] = max(seen.get("grads", 0), _bytes(grads))
        return step(*args, **kwargs)
    optimizer.step = measured_step
    times, cpu = [], []
    for it in range(reps + 1):  # the first is a warm-up
        batches = [_batch(4 * it + m) for m in range(4)]
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(cfg, chunks, ddp, optimizer, batches, lr=1e-4)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out = _breakdown(params, [], [optimizer])
    out.update(grads=seen["grads"], stash=0, gathered=gathered.peak if fsdp else 0,
               gathered_arithmetic=_units_arithmetic(chunks, ps.get_data_parallel_world_size()) if fsdp else 0,
               full=sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()),
               seconds=statistics.median(times[1:]), cpu=statistics.median(cpu[1:]))
    if gathered is not None:
        gathered.close()
    return out


def _policy_bytes(policy) -> int:
    """The extra weight versions a policy holds now: PipeDream's stash; the predicting policies' cache of the live
    weights (FSDP2: the prediction is written into the shards), or the live weights set aside while the
    parameters point at Ŵ and the Ŵ a step wrote ahead of its forward (DDP's pointer swaps)."""
    tensors = [t for chunk in getattr(policy, "stash", []) for version in chunk.values() for t in version]
    tensors += [t for cache in getattr(policy, "cache", []) if cache is not None for t in cache]
    tensors += [w for pairs in getattr(policy, "live", []) if pairs is not None for _, w in pairs]
    ready = getattr(policy, "_fused_ready", {})
    tensors += [w for pairs in ready.values() for _, w in pairs]
    return _bytes(tensors)


def _async_rank(method: str, fsdp: bool, reps: int) -> dict:
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
    cfg = _config(fsdp)
    model_parallel_seed(1)
    rank = AsyncPipelineRank(cfg, FSDP_VOCAB, method, 1, 1, "adam", {"lr": 1e-4}, None, 0.0)
    stage, policy = rank.stage, rank.stage.policy
    gathered = _Gathered(rank.chunks) if fsdp else None
    seen = {"stash": 0, "grads": 0}
    for hook in ("before_forward", "after_forward", "before_backward", "after_backward", "before_step",
                 "after_step"):
        real = getattr(policy, hook)

        def polled(*args, real=real, hook=hook):
            out = real(*args)
            seen["stash"] = max(seen["stash"], _policy_bytes(policy))
            if hook == "before_step":  # the gradients as the step finds them
                grads = [d.grad_buffer for d in stage.ddps] if stage.ddps else \
                    [local_shard(p.grad) for c in rank.chunks for p in c.parameters() if p.grad is not None]
                seen["grads"] = max(seen["grads"], _bytes(grads))
            return out
        setattr(policy, hook, polled)
    times, cpu = [], []
    for i in range(reps + 1):  # the first segment is a warm-up
        start, start_cpu = time.perf_counter(), time.process_time()
        rank.train_segment(lambda mb: _batch(mb), 8)
        times.append((time.perf_counter() - start) / 2)  # per 4 micro-batches, a 1F1B iteration's work
        cpu.append((time.process_time() - start_cpu) / 2)
    params = [p for ps_ in stage.params for p in ps_]
    out = _breakdown(params, [], stage.optimizers)
    out.update(grads=seen["grads"], stash=seen["stash"], gathered=gathered.peak if fsdp else 0,
               gathered_arithmetic=_units_arithmetic(rank.chunks, ps.get_data_parallel_world_size()) if fsdp else 0,
               full=sum(p.numel() * p.element_size() for c in rank.chunks for p in c.parameters()),
               seconds=statistics.median(times[1:]), cpu=statistics.median(cpu[1:]))
    if gathered is not None:
        gathered.close()
    return out


def _every_method(reps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for method in FSDP_METHODS:
        for fsdp in (False, True):
            out[(method, fsdp)] = _sync_rank(fsdp, reps) if method == "1f1b" else _async_rank(method, fsdp, reps)
    return out


def fsdp_measure(reps: int, dp_sizes=FSDP_DP) -> dict[int, list[dict]]:
    """{DP: every rank's {(method, fsdp): figures}}."""
    return {dp: run_distributed(_every_method, FSDP_STAGES * dp, pp=FSDP_STAGES, args=(reps,), timeout=1800)
            for dp in dp_sizes}


def _within(measured: int, target: float) -> str:
    return f"{measured / target:.3f}" if target else "-"


def fsdp_report(results: dict[int, list[dict]], header: list[str], started: float) -> str:
    kib = lambda x: f"{x / 1024:.1f}"  # noqa: E731
    rows, timing, worst = [], [], 0.0
    for method in FSDP_METHODS:
        for dp, ranks in results.items():
            ddp, fsdp = ranks[0][(method, False)], ranks[0][(method, True)]
            targets = {k: ddp[k] / dp for k in ("params", "grads", "state", "stash")}
            ratios = [fsdp[k] / t for k, t in targets.items() if t] + [fsdp["gathered"] / fsdp["gathered_arithmetic"]]
            worst = max([worst] + [abs(r - 1) for r in ratios])
            for kind, figures in (("DDP", ddp), ("FSDP2", fsdp)):
                row = [method, dp, kind] + [kib(figures[k]) for k in ("params", "grads", "state", "stash", "gathered")]
                if kind == "FSDP2":
                    row += [" / ".join(_within(fsdp[k], targets[k]) for k in ("params", "grads", "state", "stash"))
                            + f" / {_within(fsdp['gathered'], fsdp['gathered_arithmetic'])}"]
                else:
                    row += ["(reference)"]
                rows.append(row)
            cpu_ddp, cpu_fsdp = (sum(r[(method, f)]["cpu"] for r in ranks) for f in (False, True))
            timing.append([method, dp, f"{1e3 * ddp['seconds']:.0f}", f"{1e3 * fsdp['seconds']:.0f}",
                           f"{1e3 * cpu_ddp:.0f}", f"{1e3 * cpu_fsdp:.0f}", f"{cpu_fsdp / cpu_ddp:.2f}"])
    stash = {dp: (results[dp][0][("pipedream", False)]["stash"], results[dp][0][("pipedream", True)]["stash"])
             for dp in results}
    lines = header + [
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        "## Bytes per rank, rank 0 (pipeline stage 0), MEASURED, KiB", "",
        "measured / arithmetic: params, grads, optimizer state, stash against DDP's / DP; gathered against the root "
        "unit + twice the running unit + the prefetched unit (whole, fp32; see above).", "",
        bench_common.markdown_table(["method", "DP", "", "params", "grads", "optimizer state", "stash", "gathered",
                                     "measured / arithmetic"], rows), "",
        f"Largest deviation from the arithmetic: {100 * worst:.1f} %.", "",
        "PipeDream's stash on rank 0: " + "; ".join(
            f"DP {dp}: {kib(f)} KiB under FSDP2 against {kib(d)} KiB under DDP ({f / d:.3f})"
            for dp, (d, f) in stash.items()) + ".", "",
        "## Time per iteration at equal work (MEASURED)", "",
        "The same global batch per DP size under DDP and FSDP2 (1F1B: an iteration of 4 micro-batches per DP rank; "
        "asynchronous: 4 micro-batches of a segment of 8). Wall: rank 0's median, ms; CPU: the CPU seconds of all "
        "ranks summed, ms (FSDP2 adds a gather per unit and pass and a reduce-scatter per unit and micro-batch).", "",
        bench_common.markdown_table(["method", "DP", "wall DDP", "wall FSDP2", "CPU DDP", "CPU FSDP2",
                                     "CPU FSDP2 / DDP"], timing), "",
        bench_common.load_at_end(started) + ".", ""]
    return "\n".join(lines)


def fsdp_main(args) -> dict[int, list[dict]]:
    """--fsdp: fsdp_measure, print the fsdp_report (and write it to --out); returns the figures."""
    started = time.perf_counter()
    reps = 1 if args.quick else args.reps
    argv = ["--fsdp"] + (["--quick"] if args.quick else ["--reps", str(reps)]) + (["--out", args.out] if args.out else [])
    header = bench_common.header(__file__.replace("fsdp.py", "memory.py"), argv,
                                 title="FSDP2 per rank: parameters, gradients, optimizer state, stash; time (issue 55)")
    results = fsdp_measure(reps, (1, 2) if args.quick else FSDP_DP)
    text = fsdp_report(results, header, started)
    print(text)
    if args.out:
        bench_common.write_text(args.out, text)
    return results
