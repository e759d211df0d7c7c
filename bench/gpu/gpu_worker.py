"""bench/gpu/gpu.py's measurements that run in a process of their own, so that each one's memory, warm-up and
compilation are its own (a method's peak memory is then measured in isolation):

    python bench/gpu/gpu_worker.py peak --size full                        # bf16 matmul peak
    python bench/gpu/gpu_worker.py plain --size full [--compile]           # the plain PyTorch GPT (bench/step/overhead.py)
    python bench/gpu/gpu_worker.py stream --size full --method pipeoptim --optimizer adamw --k 1 [--compile] [--separate]
    python bench/gpu/gpu_worker.py newton_schulz --size full      # one layer's Newton-Schulz per precision (Muon)
    python bench/gpu/gpu_worker.py fused_step --size full         # one stage's step + prediction, eager and compiled
    python bench/gpu/gpu_worker.py gpipe --size full              # ours --torch-compile in GPipe's order: peak memory
    python bench/gpu/gpu_worker.py plain --size full --compile --gpipe   # the plain GPT compiled in the same order
    python bench/gpu/gpu_worker.py profile --size small           # one compiled iteration, ours vs the plain GPT

Progress lines go to stdout as they come; `FIGURE <json>` lines are figures as they are measured (gpu_run.Run
keeps them, so a worker killed half-way leaves them in the results); the last line is `RESULT <json>`. `SIZES` are the model and run
sizes bench/gpu/gpu.py passes by name: "full" (GPT-1.3B) and "quick" (a tiny GPT that runs on a CPU).

The asynchronous stream (`stream`): the single-process emulator (`AsyncEmulator`) of the D = 4 pipeline, bf16,
one method. ms per micro-batch in the steady state = (T(long) - T(short)) / (long - short) for two segments
of `short` and `long` micro-batches (the fill and drain of each cancel), after a warm-up segment; then
one more segment with the device synchronised around every op and every policy hook gives each stage's
forward, backward and step times and the part of them spent in the weight policy's hooks (PipeOptim's
prediction and restore around a forward, 2BW's version swaps, ...). Memory: on a GPU
`torch.cuda.max_memory_allocated()` over the whole process (and `memory_allocated()` once the emulator
is built: weights and optimizer state before any step); on a CPU the growth of the peak resident set over
the process's after its imports. `--compile` runs the stream with --torch-compile (compiled layers, and the
optimizer step with PipeOptim's prediction fused into it compiled); `--separate` predicts right before each
forward instead of in the step (the code before issue 30).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

import torch  # noqa: E402
from bench_common import log  # noqa: E402
from convergence_measure import OpTimer  # noqa: E402

D = 4  # pipeline stages of the asynchronous stream


@dataclass(frozen=True)
class Size:
    """Model, batch and run lengths of one bench size (micro-batch counts of the stream: multiples of
    the largest update interval, 2BW's k = D)."""
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int
    iterations: int  # pretrain_gpt.py and the plain loop; the first `warmup` are not timed
    warmup: int
    matmul_n: int
    matmul_reps: int
    stream_warmup: int
    stream_short: int
    stream_long: int
    stream_ops: int
    fp16_iterations: int
    compile_backend: str  # torch.compile's backend for the plain model ("eager": tracing only, no codegen)

    def gpt_flags(self, lr_warmup_iters: int = 2) -> list[str]:
        """pretrain_gpt.py's flags for this model on mock data (dropout 0, as the plain model has none)."""
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden), "--num-attention-heads",
                str(self.heads), "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
                "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch),
                "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab),
                "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4", "--min-lr", "1e-5",
                "--lr-warmup-iters", str(lr_warmup_iters)]


SIZES = {
    # GPT-1.3B as issue 29 measured it: 24 layers, hidden 2048, 16 heads, seq 2048, micro-batch 4, global 16.
    "full": Size(layers=24, hidden=2048, heads=16, seq=2048, micro_batch=4, global_batch=16, vocab=50257,
                 iterations=12, warmup=3, matmul_n=8192, matmul_reps=20, stream_warmup=4, stream_short=8,
                 stream_long=24, stream_ops=8, fp16_iterations=16, compile_backend="inductor"),
    # GPT-1.3B's shape scaled down for a CPU profile with inductor (worker `profile`): what the compiled iteration
    # runs (graphs, kernels, host syncs, copies), not how fast.
    "small": Size(layers=2, hidden=128, heads=4, seq=128, micro_batch=2, global_batch=8, vocab=2048,
                  iterations=5, warmup=3, matmul_n=256, matmul_reps=3, stream_warmup=4, stream_short=4,
                  stream_long=8, stream_ops=4, fp16_iterations=4, compile_backend="inductor"),
    # A tiny GPT: every code path runs on a CPU in seconds; its figures measure nothing.
    "quick": Size(layers=4, hidden=32, heads=2, seq=32, micro_batch=2, global_batch=4, vocab=256,
                  iterations=3, warmup=1, matmul_n=256, matmul_reps=3, stream_warmup=4, stream_short=4,
                  stream_long=8, stream_ops=4, fp16_iterations=4, compile_backend="eager"),
}


def figure(**figures) -> None:
    """Figures measured so far, for the results as they come (bench/gpu/gpu_run.py reads `FIGURE` lines)."""
    print("FIGURE " + json.dumps(figures), flush=True)


def device() -> torch.device:
    from megatron_po import parallel_state as ps
    return ps.get_device()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def padded_vocab(size: Size) -> int:
    from megatron_po.tensor_parallel import pad_vocab_size
    return pad_vocab_size(size.vocab, 128, 1)  # --make-vocab-size-divisible-by 128 (Megatron's default), TP 1


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --------------------------------------------------------------------------------------------------
# bf16 matmul peak
# --------------------------------------------------------------------------------------------------


def peak(size: Size, args) -> dict:
    from overhead import matmul_peak
    n, reps = size.matmul_n, size.matmul_reps
    log(f"  bf16 matmul {n}^3, {reps} timed after 3 warm-up, on {device()}")
    flops = matmul_peak(n, reps, device(), torch.bfloat16, warmup=3)
    return {"tflops": flops / 1e12, "n": n, "reps": reps, "warmup": 3, "dtype": "bfloat16"}


# --------------------------------------------------------------------------------------------------
# The plain PyTorch GPT (bench/step/overhead.py's baseline), eager or compiled
# --------------------------------------------------------------------------------------------------


def plain(size: Size, args, on_iteration=None) -> dict:
    """bench/step/overhead.py's PlainGPT as a user would train it: fp32 weights, bf16 autocast, SDPA, fused
    AdamW (foreach on a CPU), gradient accumulation over the global batch's micro-batches, clip 1.0."""
    from overhead import PlainGPT
    baseline_rss = peak_rss_bytes()
    where = device()
    vocab = padded_vocab(size)  # the same output layer as ours
    torch.manual_seed(0)
    with torch.device(where):
        model = PlainGPT(vocab, size.hidden, size.heads, size.layers, size.seq)
    params = sum(p.numel() for p in model.parameters())
    fused = where.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused, foreach=not fused)
    forward = torch.compile(model, backend=size.compile_backend) if args.compile else model
    micro = size.global_batch // size.micro_batch
    tokens = [torch.randint(0, size.vocab, (size.micro_batch, size.seq + 1), device=where) for _ in range(micro)]

    def step():
        if args.gpipe:  # GPipe's order: every micro-batch's forward (its activations held), then the backwards
            losses = []
            for t in tokens:
                with torch.autocast(where.type, dtype=torch.bfloat16):
                    losses.append(forward(t[:, :-1], t[:, 1:]))
            for loss in losses:
                (loss / micro).backward()
        for t in ([] if args.gpipe else tokens):
            with torch.autocast(where.type, dtype=torch.bfloat16):
                loss = forward(t[:, :-1], t[:, 1:])
            (loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(size.iterations):
        synchronize()
        t0 = time.perf_counter()
        step() if on_iteration is None else on_iteration(i, step)
        synchronize()
        times.append(time.perf_counter() - t0)
        log(f"  plain{' compiled' if args.compile else ''} iteration {i + 1}/{size.iterations}: "
            f"{times[-1] * 1e3:.1f} ms")
        figure(iteration_ms=[t * 1e3 for t in times])
    ms = statistics.median(times[size.warmup:]) * 1e3
    out = {"ms_per_iteration": ms, "tokens_per_s": size.global_batch * size.seq / ms * 1e3, "parameters": params,
           "first_iteration_ms": times[0] * 1e3, "compiled": bool(args.compile),
           "compile_backend": size.compile_backend if args.compile else None, "order": "gpipe" if args.gpipe else
           "one micro-batch's forward and backward after another"}
    out["max_memory_bytes"] = torch.cuda.max_memory_allocated() if where.type == "cuda" else \
        peak_rss_bytes() - baseline_rss
    return out


# --------------------------------------------------------------------------------------------------
# The asynchronous stream in the emulator, one method
# --------------------------------------------------------------------------------------------------

def per_stage(timer) -> list[dict]:
    """Per stage: the median ms of each op kind (forward, backward, step) and of its hooks (forward_hooks, ...) of an
    OpTimer (bench/convergence/convergence_measure.py)."""
    return [{kind.replace("Hooks", "_hooks").lower(): statistics.median(v) * 1e3
             for (r, kind), v in sorted(timer.times.items()) if r == rank} for rank in range(D)]


def use_compile_backend(size: Size) -> None:
    """torch.compile's backend for --torch-compile's layers and optimizer steps at this size (the quick size
    traces without code generation, as its plain model does)."""
    from megatron_po.models import compiled_layers
    from megatron_po.optim import fused_prediction
    compiled_layers.BACKEND = fused_prediction.COMPILE_BACKEND = size.compile_backend


def stream(size: Size, args) -> dict:
    from megatron_po.config import parse_args
    from megatron_po.pipeline.async_pipeline import AsyncEmulator, optimizer_kwargs_from_config
    from megatron_po.tensor_parallel import model_parallel_seed
    where = device()
    baseline_rss = rss_bytes()
    cfg = parse_args(size.gpt_flags() + ["--bf16", "--untie-embeddings-and-output-weights", "--optimizer",
                                          args.optimizer, "--pipeline-method", args.method]
                     + (["--torch-compile"] if args.compile else []))
    model_parallel_seed(cfg.training.seed)
    use_compile_backend(size)
    log(f"  building {args.method} ({args.optimizer}, k = {args.k}), D = {D}, on {where}")
    t0 = time.perf_counter()
    emu = AsyncEmulator(cfg, padded_vocab(size), args.method, D, 1, args.k, args.optimizer,
                        optimizer_kwargs_from_config(cfg.training), None, cfg.training.clip_grad)
    for stage in emu.stages:
        stage.policy.fuse_prediction = not args.separate
    synchronize()
    built = {"seconds": time.perf_counter() - t0,
             "parameters": sum(p.numel() for c in emu.chunks for p in c.parameters())}
    if where.type == "cuda":
        built["memory_allocated_bytes"] = torch.cuda.memory_allocated()
    timer = OpTimer(sync=synchronize).install(emu)  # (switched on for the segment timed op by op)
    timer.active = False
    pool = [torch.randint(0, size.vocab, (size.micro_batch, size.seq + 1), device=where) for _ in range(4)]
    mask = torch.ones(size.micro_batch, size.seq, device=where)

    def get_batch(mb):
        t = pool[mb % len(pool)]
        return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}

    def segment(n: int, what: str) -> float:
        synchronize()
        t0 = time.perf_counter()
        losses = emu.train_segment(get_batch, n)
        synchronize()
        seconds = time.perf_counter() - t0
        log(f"  {what}: {n} micro-batches in {seconds:.2f} s (last loss {losses[-1]:.3f})")
        return seconds

    segment(size.stream_warmup, "warm-up")
    short = segment(size.stream_short, "short segment")
    figure(short_segment_s=short)
    long = segment(size.stream_long, "long segment")
    figure(long_segment_s=long, ms_per_microbatch=(long - short) / (size.stream_long - size.stream_short) * 1e3)
    timer.active = True
    segment(size.stream_ops, "segment timed op by op")
    timer.active = False
    out = {"method": args.method, "optimizer": args.optimizer, "k": args.k, "compiled": bool(args.compile),
           "prediction": "separate" if args.separate else "fused where it applies", "built": built,
           "ms_per_microbatch": (long - short) / (size.stream_long - size.stream_short) * 1e3,
           "segments": {"short": [size.stream_short, short], "long": [size.stream_long, long]},
           "stages": per_stage(timer), "copies_per_chunk": {str(r): n for (r, _), n in emu.copies_per_chunk().items()}}
    if where.type == "cuda":
        out["memory"] = {"measure": "torch.cuda.max_memory_allocated", "peak_bytes": torch.cuda.max_memory_allocated()}
    else:
        out["memory"] = {"measure": "peak RSS growth over the process after its imports",
                         "peak_bytes": peak_rss_bytes() - baseline_rss}
    return out


# --------------------------------------------------------------------------------------------------
# Muon's Newton-Schulz, and one stage's optimizer step with PipeOptim's prediction
# --------------------------------------------------------------------------------------------------


def stage_parameters(size: Size) -> int:
    """The transformer weights of one of the D stages (12·h² per layer): 302 M for GPT-1.3B."""
    return size.layers // D * 12 * size.hidden ** 2


def newton_schulz(size: Size, args) -> dict:
    """bench/step/muon_step.py's `layer_newton_schulz_ms`: 5 Newton-Schulz steps on one layer's four matrices, per
    precision (fp32, TF32, bf16), one call per matrix (the code before issue 31) and batched by shape."""
    from muon_step import layer_newton_schulz_ms
    where = device()
    log(f"  Newton-Schulz, one layer of hidden {size.hidden}, on {where}")
    times = layer_newton_schulz_ms(size.hidden, 4 * size.hidden, where, reps=size.matmul_reps)
    return {"hidden": size.hidden, "ffn": 4 * size.hidden, "steps": 5, "layers_per_stage": size.layers // D,
            "ms": {f"{precision},{how}": ms for (precision, how), ms in times.items()}}


def fused_step(size: Size, args) -> dict:
    """bench/step/fused_step.py's `time_step_variants`: one stage's AdamW step + PipeOptim prediction + restore
    (bf16 weights, fp32 main params), naive (no prediction) / separate / fused, eager and compiled."""
    from fused_step import time_step_variants
    where, numel = device(), stage_parameters(size)
    use_compile_backend(size)
    log(f"  one stage of {numel / 1e6:.3g} M parameters: step + prediction, eager and compiled, on {where}")
    rows = []
    for compiled in (False, True):  # eager first: its rows are kept (FIGURE) if the compiles run out of time
        rows += time_step_variants(where, numel=numel, bf16=True, reps=size.matmul_reps, compiled=(compiled,))
        figure(rows=rows)
    return {"parameters": numel, "rows": rows}


def gpipe(size: Size, args) -> dict:
    """Ours --torch-compile through pretrain_gpt.py's own loop (`training.run_main`, bf16, this size), every
    iteration in GPipe's order at one stage: the executor runs the "none" schedule at PP = 1 (F0 B0 F1 B1 ...), so
    that schedule's entry is given GPipe's ops (F0 F1 F2 F3 B0 B1 B2 B3). Peak memory over the process, ms per
    iteration (median after the first two: the compiles)."""
    import tempfile

    from megatron_po.pipeline import executor
    from megatron_po.pipeline.schedules import gpipe as gpipe_schedule
    from megatron_po.training import run_main
    baseline_rss = peak_rss_bytes()
    micro = size.global_batch // size.micro_batch
    executor._SCHEDULE_CACHE[("none", 1, 1, micro)] = gpipe_schedule(1, 1, micro)
    iterations = size.warmup + 3
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        argv = size.gpt_flags() + ["--bf16", "--torch-compile", "--train-iters", str(iterations), "--log-interval",
                                   "1", "--eval-interval", str(10 * iterations), "--eval-iters", "1",
                                   "--metrics-file", metrics, "--data-cache-path", os.path.join(tmp, "cache")]
        use_compile_backend(size)
        if run_main(argv) != 0:
            raise SystemExit("pretrain_gpt.py's loop failed")
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    timed = sorted(size.global_batch * size.seq / r["tokens_per_sec"] * 1e3 for r in records
                   if "tokens_per_sec" in r)[:-2] or [float("nan")]
    out = {"ms_per_iteration": statistics.median(timed), "iterations": iterations, "order": "gpipe",
           "schedule_ops": " ".join(type(op).__name__[0] + str(getattr(op, "microbatch", "")) for op in
                                    executor._SCHEDULE_CACHE[("none", 1, 1, micro)].ops[0])}
    out["max_memory_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else \
        peak_rss_bytes() - baseline_rss
    return out


# What a profile counts per iteration (torch.profiler's CPU ops): the host syncs (a GPU waits idle for the host
# while the host waits for them), the copies, and the compiled graphs' and kernels' calls.
HOST_SYNCS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "cudaStreamSynchronize",
              "cudaDeviceSynchronize")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat")


def trace_counts(path: str) -> dict:
    """Counts of one profiled iteration's chrome trace: CPU ops in all, host syncs, copies, compiled-graph calls
    (`CompiledFunction`, `Torch-Compiled Region`), device kernels (GPU), eager aten ops outside compiled graphs."""
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    names = [e.get("name", "") for e in events]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    count = {n: names.count(n) for n in (*HOST_SYNCS, *COPIES) if n in names}
    # where they happen: the outermost enclosing op that is not an aten op (an autograd Function, a compiled graph)
    spans = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ops if not e["name"].startswith("aten::")),
                   key=lambda t: (t[0], -t[1]))
    inside: dict = {}
    for e in ops:
        if e["name"] in HOST_SYNCS or e["name"] in COPIES:
            outer = next((n for a, b, n in spans if a <= e["ts"] and e["ts"] + e["dur"] <= b), "top level")
            key = f"{e['name']} in {outer.replace('autograd::engine::evaluate_function: ', '')}"
            inside[key] = inside.get(key, 0) + 1
    return {"cpu_ops": len(ops), "host_syncs": sum(names.count(n) for n in HOST_SYNCS),
            "copies": sum(names.count(n) for n in COPIES), "where": dict(sorted(inside.items(), key=lambda kv: -kv[1])),
            "compiled_graph_calls": sum(1 for n in names if n.startswith(("CompiledFunction", "Torch-Compiled Region",
                                                                          "## Call CompiledFxGraph"))),
            "device_kernels": sum(1 for e in events if e.get("cat") == "kernel"), "by_name": count}


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0}


def profile(size: Size, args) -> dict:
    """One iteration after the warm-up (its compiles), profiled: ours --torch-compile through pretrain_gpt.py's loop
    (--profile), then the plain GPT compiled (bench/step/overhead.py's, in this process after ours), each with the
    TorchDynamo counts its compile added and its trace's counts (`trace_counts`). Same model, batch and backend."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from megatron_po.training import run_main
    use_compile_backend(size)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = dynamo_counts()
        argv = size.gpt_flags() + ["--bf16", "--torch-compile", "--train-iters", str(size.iterations),
                                   "--log-interval", "1", "--eval-interval", str(10 * size.iterations),
                                   "--eval-iters", "1", "--profile", "--profile-step-start", str(size.warmup + 1),
                                   "--profile-step-end", str(size.warmup + 2), "--tensorboard-dir", tmp,
                                   "--data-cache-path", os.path.join(tmp, "cache")]
        if run_main(argv) != 0:
            raise SystemExit("pretrain_gpt.py's loop failed")
        trace = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".pt.trace.json"))
        after = dynamo_counts()
        out["ours"] = {**trace_counts(trace), **{k: after[k] - before[k] for k in after}}
        figure(ours=out["ours"])
        args.compile, args.gpipe = True, False
        before = dynamo_counts()
        iterations, size_warm = size.iterations, size.warmup
        traced = os.path.join(tmp, "plain.json")

        def on_iteration(i, step):  # the plain loop's iteration after the warm-up, profiled
            if i != size_warm:
                return step()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with torch_profile(activities=activities) as prof:
                step()
            prof.export_chrome_trace(traced)
        plain(Size(**{**size.__dict__, "iterations": iterations}), args, on_iteration=on_iteration)
        after = dynamo_counts()
        out["plain_compiled"] = {**trace_counts(traced), **{k: after[k] - before[k] for k in after}}
    out["size"] = {k: getattr(size, k) for k in ("layers", "hidden", "heads", "seq", "micro_batch", "global_batch",
                                                  "vocab", "compile_backend")}
    return out


WORKERS = {"peak": peak, "plain": plain, "stream": stream, "newton_schulz": newton_schulz, "fused_step": fused_step,
           "gpipe": gpipe, "profile": profile}


def main(argv=None) -> None:
    ap = bench_common.parser(__doc__)
    ap.add_argument("worker", choices=list(WORKERS))
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--compile", action="store_true", help="plain: torch.compile the model; stream: --torch-compile")
    ap.add_argument("--separate", action="store_true", help="stream: predict before each forward, not in the step")
    ap.add_argument("--gpipe", action="store_true", help="plain: every forward of an iteration, then the backwards")
    ap.add_argument("--method", default="pipeoptim", help="stream: the asynchronous method")
    ap.add_argument("--optimizer", default="adamw", help="stream: the optimizer")
    ap.add_argument("--k", type=int, default=1, help="stream: the update interval")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = WORKERS[args.worker](SIZES[args.size], args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

