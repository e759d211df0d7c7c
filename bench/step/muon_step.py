"""Muon's step per micro-batch as ratios to AdamW's step measured in the same run.

    python bench/step/muon_step.py [--hidden 256 --heads 4 --layers 2 --ffn 1024 --reps 5 --tokens 8192] [--quick]
    python bench/step/muon_step.py --newton-schulz-variants [--hidden 2048 --bf16-hidden 512] --out FILE

A GPT (GELU MLP, multi-head attention: per layer a fused QKV [3h, h], the projection [h, h], the MLP's
[ffn, h] and [h, ffn]) gets random gradients and one optimizer step, k = 1, so a step's time is its time per
micro-batch. Variants, alternating round by round in the same processes (this box is shared: read ratios):

- AdamW: `--optimizer adamw`, the baseline of every ratio;
- Muon fp32: fp32, batched by shape, Q, K and V split;
- Muon bf16: the new default (bf16, batched, split). On a CPU without native bf16 matmuls (AVX2 only, like
  this box) bf16 runs emulated and is SLOWER than fp32: the bf16 speed-up is a GPU figure (bench/gpu/gpu.py);
- DP = 2 (two forked gloo processes, one thread each): fp32 and bf16 Muon and AdamW with the plain
  optimizer (replicated state, one packed all-gather of O) and the distributed optimizer (two all-to-alls);
  the per-rank step time (slowest rank per round) and each rank's collectives and bytes.

(Muon before issue 31, one fp32 call per matrix and the fused QKV as one, was a row until commit 65b26b1:
bench/results/muon_step.md.) Also printed: Newton-Schulz GFLOPs per step (whole model; the largest per-rank share at DP = 2) and their
ratio to the forward+backward FLOPs of the same matrices on `--tokens` tokens (6·params·tokens).

`--newton-schulz-variants` (issue 44): faster orthogonalisations, all opt-in, against the default (5 "simple" steps,
the standard iteration) on one GPT-1.3B layer's matrices (Q, K, V and the projection [h, h], the MLP's [4h, h] and
[h, 4h]) whose singular values fall from 1 to 1e-3 (a momentum's spectrum), fp32: ms on this CPU, GFLOPs, the
distance to the default's output (the "same result" check), the singular-value band (orthogonality) and the
distance to the exact polar factor U·Vᵀ (SVD); the same in bf16 at `--bf16-hidden` (bf16 matmuls are emulated and
slow on this CPU). Variants: the Gram iteration (`--muon-gram-newton-schulz`), fewer steps (4), and the other
coefficient sets. `newton_schulz_variants` is what bench/gpu/gpu.py can time on a GPU.

For bench/gpu/gpu.py (GPU timings; the device is where the given tensors live):
- `layer_newton_schulz_ms(hidden, ffn, device, ...)`: Newton-Schulz of one (or `layers`) layer's four matrices
  at fp32 / TF32 / bf16, one call per matrix and batched as the optimizer runs it, median ms.
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

from bench_common import Lines, header, load_at_end, markdown_table  # noqa: E402

MUON_VARIANTS = {"Muon fp32": dict(muon_fp32_matmul_prec="highest"),  # name -> build_optimizer kwargs
                 "Muon bf16": dict(muon_fp32_matmul_prec="medium")}
VARIANTS = ("AdamW", *MUON_VARIANTS)
LR, WD = 1e-3, 0.01


# --------------------------------------------------------------------------------------------------
# GPU entry points (also used below on the CPU)
# --------------------------------------------------------------------------------------------------


def _synchronize(device) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def _median_ms(fn, device, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def layer_newton_schulz_ms(hidden: int = 2048, ffn: int = 8192, device="cpu", layers: int = 1, steps: int = 5,
                           precisions=("highest", "high", "medium"), reps: int = 10,
                           coefficient_type: str = "simple") -> dict:
    """Median ms of `steps` Newton-Schulz iterations on `layers` layers' four matrices (QKV [3h, h], projection
    [h, h], MLP [ffn, h] and [h, ffn]), per precision ("highest" fp32, "high" TF32, "medium" bf16): one call
    per matrix ("unbatched", the code before issue 31) and the matrices of one oriented shape stacked in one
    call ("batched", what the optimizer runs). {(precision, "unbatched" | "batched"): ms}."""
    from megatron_po.optim.newton_schulz import newton_schulz
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers
    mats = [torch.randn(s, generator=gen, device=device) for s in shapes]
    batches: dict = {}
    for m in mats:  # tall matrices iterate transposed: they batch with the wide ones of that shape
        batches.setdefault(tuple(sorted(m.shape)), []).append(m.mT if m.shape[0] > m.shape[1] else m)
    stacks = [torch.stack(b) for b in batches.values()]
    out = {}
    for precision in precisions:
        out[(precision, "unbatched")] = _median_ms(
            lambda: [newton_schulz(m, steps, coefficient_type, precision) for m in mats], device, reps)
        out[(precision, "batched")] = _median_ms(
            lambda: [newton_schulz(s, steps, coefficient_type, precision) for s in stacks], device, reps)
    return out


# (name, steps, coefficient type, gram): the default first, every other one opt-in
NS_VARIANTS = [("default: simple, 5 steps", 5, "simple", False), ("Gram, simple, 5 steps", 5, "simple", True),
               ("simple, 4 steps", 4, "simple", False), ("Gram, simple, 4 steps", 4, "simple", True),
               ("quintic, 5 steps", 5, "quintic", False), ("Gram, quintic, 5 steps", 5, "quintic", True),
               ("polar_express, 8 steps", 8, "polar_express", False)]


def momentum_like(rows: int, cols: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """A rows x cols matrix with random singular vectors and singular values from 1 down to 1e-3 (log-spaced)."""
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(rows, k, generator=gen, device=device)).Q
    v = torch.linalg.qr(torch.randn(cols, k, generator=gen, device=device)).Q
    return (u * torch.logspace(0, -3, k, device=device)) @ v.mT


def newton_schulz_variants(hidden: int, precision: str = "highest", reps: int = 1, device="cpu",
                           variants=NS_VARIANTS, outputs: bool = False) -> list[dict] | list[torch.Tensor]:
    """Each variant on one layer's six matrices at `hidden` (module docstring): [{"variant", "ms", "gflops",
    "vs_default" (relative Frobenius distance of the outputs), "band" (min, max singular value), "polar" (relative
    distance to U·Vᵀ)}], the worst matrix for each distance. `outputs`: the first variant's outputs instead."""
    from megatron_po.optim.newton_schulz import gram_newton_schulz_flops, newton_schulz, newton_schulz_flops
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(hidden, hidden)] * 4 + [(4 * hidden, hidden), (hidden, 4 * hidden)]
    mats = [momentum_like(r, c, gen, device) for r, c in shapes]
    if outputs:  # the first variant's outputs alone
        _, steps, kind, gram = variants[0]
        return [newton_schulz(m, steps, kind, precision, gram=gram).float() for m in mats]
    polars = []
    for m in mats:
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        polars.append(u @ vh)
    rows, default = [], None
    for name, steps, kind, gram in variants:
        def run(steps=steps, kind=kind, gram=gram):
            return [newton_schulz(m, steps, kind, precision, gram=gram).float() for m in mats]
        ms = _median_ms(run, device, reps, warmup=0)
        outs = run()
        default = default or outs
        bands = [torch.linalg.svdvals(o) for o in outs]
        flops = sum((gram_newton_schulz_flops(r, c, steps, precision == "medium")
                     if gram and max(r, c) >= 2 * min(r, c) else newton_schulz_flops(r, c, steps)) for r, c in shapes)
        rows.append({"variant": name, "steps": steps, "coefficients": kind, "gram": gram, "ms": ms,
                     "gflops": flops / 1e9,
                     "vs_default": max(((o - d).norm() / d.norm()).item() for o, d in zip(outs, default)),
                     "band": (min(b.min().item() for b in bands), max(b.max().item() for b in bands)),
                     "polar": max(((o - p).norm() / p.norm()).item() for o, p in zip(outs, polars))})
    return rows


def variants_table(rows: list[dict], default_ms: bool = True) -> str:
    first = rows[0]
    return markdown_table(
        ["variant", "GFLOP", "ms (this CPU)", "vs default ms", "distance to the default's output",
         "singular values", "distance to U·Vᵀ"],
        [[r["variant"], f"{r['gflops']:.1f}", f"{r['ms']:.0f}", f"{r['ms'] / first['ms']:.2f}x",
          f"{r['vs_default']:.1e}", f"[{r['band'][0]:.3f}, {r['band'][1]:.3f}]", f"{r['polar']:.3f}"] for r in rows])


def variants_main(a, argv) -> int:
    started = time.perf_counter()
    lines = Lines(header(__file__, argv, "Newton-Schulz variants for Muon, at GPT-1.3B's shapes (CPU)"))
    h = a.hidden
    lines.emit(f"One layer's matrices at hidden {h}: four [{h}, {h}] (Q, K, V split, and the projection), the MLP's "
               f"[{4 * h}, {h}] and [{h}, {4 * h}]; each with singular values log-spaced from 1 to 1e-3 and random "
               "singular vectors. Distances are relative Frobenius norms, the largest over the six matrices; "
               f"singular values: the smallest and largest over them. ms: median of {a.reps}, one call per matrix; "
               f"torch threads {torch.get_num_threads()}.")
    lines.emit("")
    lines.emit(f"## fp32 (`--muon-fp32-matmul-prec highest`), hidden {h}")
    lines.emit("")
    fp32 = newton_schulz_variants(h, "highest", a.reps)
    lines.emit(variants_table(fp32))
    lines.emit("")
    hb = a.bf16_hidden
    lines.emit(f"## bf16 (`medium`, the default precision), hidden {hb} (bf16 matmuls are emulated on this CPU: "
               "its ms say nothing of a GPU's)")
    lines.emit("")
    bf16 = newton_schulz_variants(hb, "medium", 1)
    mats_fp32 = newton_schulz_variants(hb, "highest", 1, variants=NS_VARIANTS[:1], outputs=True)
    mats_bf16 = newton_schulz_variants(hb, "medium", 1, variants=NS_VARIANTS[:1], outputs=True)
    bf16_moves = max(((b - f).norm() / f.norm()).item() for b, f in zip(mats_bf16, mats_fp32))
    lines.emit(variants_table(bf16))
    lines.emit("")
    gram = {r["variant"]: r for r in bf16}["Gram, simple, 5 steps"]
    fp32_gram = {r["variant"]: r for r in fp32}["Gram, simple, 5 steps"]
    lines.emit(f"Same result, to a stated tolerance: the Gram iteration is the default's iteration in exact arithmetic. "
               f"In fp32 its output is {fp32_gram['vs_default']:.1e} of the default's away (tolerance: 1e-3, "
               f"fp32 rounding accumulated in the product Q); in bf16 {gram['vs_default']:.1e}, where bf16 itself "
               f"moves the default {bf16_moves:.1e} away from the fp32 default (tolerance: no more than that); "
               "its singular-value band and distance to U·Vᵀ are in the tables beside the default's.")
    lines.emit("")
    lines.emit(load_at_end(started))
    lines.write(a.out)
    return 0


# --------------------------------------------------------------------------------------------------
# The CPU benchmark
# --------------------------------------------------------------------------------------------------


def model_config(a):
    from megatron_po.config import ModelConfig
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=64,
                       ffn_hidden_size=a.ffn, hidden_dropout=0.0, attention_dropout=0.0,
                       untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8)


def build_model(a):
    from megatron_po.models.gpt import GPTModel
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(1)
    return GPTModel(model_config(a), a.vocab, 1)


def newton_schulz_gflops(a, world: int = 1) -> float:
    """Newton-Schulz GFLOPs of one step: the whole model (world 1) or the largest DP rank's share."""
    from megatron_po.optim.muon import Muon, optimizer_param_groups
    from megatron_po.optim.muon_dp import assign_owners
    from megatron_po.optim.newton_schulz import newton_schulz_flops
    model = build_model(a)
    groups = optimizer_param_groups("muon", [model], WD)
    opt = Muon(groups, lr=LR)
    matrices = [p for g in groups if g["use_muon"] for p in g["params"]]
    costs = [sum(newton_schulz_flops(r, c, 5) for r, c in opt._orthogonalised_shapes(m)) for m in matrices]
    owners = assign_owners(costs, world)
    return max(sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)) / 1e9


def _random_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def dp1_times(a) -> dict:
    """Median ms per variant (AdamW and the Muon variants), alternating round by round, in one forked
    process with one thread (as each DP = 2 rank)."""
    from dist_harness import run_distributed
    return run_distributed(_dp1_rank, 1, args=(a,), timeout=3600.0)[0]


def _dp1_rank(a) -> dict:
    from megatron_po.optim import build_optimizer
    from megatron_po.optim.muon import optimizer_param_groups
    runs = {}
    for name in VARIANTS:
        model = build_model(a)
        opt_name, kwargs = ("adamw", {}) if name == "AdamW" else ("muon", MUON_VARIANTS[name])
        opt = build_optimizer(opt_name, optimizer_param_groups(opt_name, [model], WD), LR, weight_decay=WD, **kwargs)
        params = list(model.parameters())
        _random_grads(params, 0)
        opt.step()  # creates the state
        runs[name] = (opt, params)
    times = {name: [] for name in runs}
    for rep in range(a.reps):
        for name, (opt, params) in runs.items():
            _random_grads(params, rep + 1)
            start = time.perf_counter()
            opt.step()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def _dp2_rank(a) -> dict:
    """One DP=2 rank: AdamW and Muon fp32/bf16 with the plain and the distributed optimizer; per round every
    variant steps once after a barrier. Returns {(variant, optimizer kind): [ms per round]} and the Muon
    collectives of one step {(variant, kind): [(name, bytes this rank sends to others)]}."""
    import torch.distributed as dist

    import megatron_po.optim.muon as muon
    import megatron_po.optim.muon_dp as muon_dp
    from megatron_po import parallel_state as ps
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.optim import build_optimizer
    from megatron_po.optim.distributed_optimizer import DistributedOptimizer
    from megatron_po.optim.muon import optimizer_param_groups
    runs = {}
    for kind in ("plain", "distopt"):
        for name in VARIANTS:
            model = build_model(a)
            opt_name, kwargs = ("adamw", {}) if name == "AdamW" else ("muon", MUON_VARIANTS[name])
            groups = optimizer_param_groups(opt_name, [model], WD)

            def factory(g, opt_name=opt_name, kwargs=kwargs):
                return build_optimizer(opt_name, g, LR, weight_decay=WD, **kwargs)
            ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), bucket_size=a.bucket,
                                          grad_dtype=torch.float32, use_distributed_optimizer=kind == "distopt")
            opt = DistributedOptimizer(factory, groups, ddp) if kind == "distopt" else factory(groups)
            runs[(name, kind)] = (opt, ddp)

    def fill(ddp, seed):  # the DP-mean gradient, the same on both ranks (as after the reduction)
        ddp.grad_buffer.copy_(torch.randn(ddp.grad_buffer.shape, generator=torch.Generator().manual_seed(seed)))

    collectives = {}
    for key, (opt, ddp) in runs.items():
        fill(ddp, 0)
        opt.step()  # state
        log: list = []
        saved = dist.all_to_all_single, muon_dp.all_gather_single, muon.all_gather_single

        def logged(name, fn, sent):
            def call(*args, **kwargs):
                log.append((name, sent(*args) * args[1].element_size()))
                return fn(*args, **kwargs)
            return call
        dist.all_to_all_single = logged("all-to-all", saved[0], lambda out, inp, o, i, **k: inp.numel() -
                                        i[ps.get_data_parallel_rank()])
        muon_dp.all_gather_single = logged("all-gather", saved[1], lambda out, inp, *r: inp.numel())
        muon.all_gather_single = logged("all-gather TP", saved[2], lambda out, inp, *r: inp.numel())
        try:
            fill(ddp, 1)
            opt.step()
        finally:
            dist.all_to_all_single, muon_dp.all_gather_single, muon.all_gather_single = saved
        collectives[key] = log
    times = {key: [] for key in runs}
    for rep in range(a.reps):
        for key, (opt, ddp) in runs.items():
            fill(ddp, rep + 2)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if key[1] == "distopt":
                opt.finish_param_sync()
            times[key].append(1e3 * (time.perf_counter() - start))
    return {"times": times, "collectives": collectives}


def dp2_results(a) -> dict:
    from dist_harness import run_distributed
    ranks = run_distributed(_dp2_rank, 2, args=(a,), timeout=3600.0)
    times = {key: statistics.median(max(r["times"][key][i] for r in ranks) for i in range(a.reps))
             for key in ranks[0]["times"]}
    return {"times": times, "collectives": [r["collectives"] for r in ranks]}


def main(argv=None) -> int:
    p = bench_common.parser(__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch for the FLOP ratio")
    p.add_argument("--bucket", type=int, default=200_000, help="DDP bucket size (elements) at DP = 2")
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 rounds (the CPU test)")
    p.add_argument("--out", default=None, help="default bench/results/muon_step.md (--newton-schulz-variants: "
                                               "bench/results/muon_newton_schulz_variants.md)")
    p.add_argument("--newton-schulz-variants", action="store_true",
                   help="the faster Newton-Schulz variants against the default, at --hidden (default 2048) in fp32 "
                        "and --bf16-hidden in bf16")
    p.add_argument("--bf16-hidden", type=int, default=512)
    a = p.parse_args(argv)
    if a.newton_schulz_variants:
        a.hidden = 2048 if "--hidden" not in (argv or sys.argv) else a.hidden
        a.reps = 1 if "--reps" not in (argv or sys.argv) else a.reps
        a.out = a.out or os.path.join(bench_common.RESULTS, "muon_newton_schulz_variants.md")
        return variants_main(a, argv if argv is not None else sys.argv[1:])
    a.out = a.out or os.path.join(bench_common.RESULTS, "muon_step.md")
    if a.quick:
        a.hidden, a.heads, a.layers, a.ffn, a.vocab, a.reps, a.bucket = 64, 4, 1, 256, 128, 2, 10_000
    started = time.perf_counter()
    lines = Lines(header(__file__, argv, "Muon step per micro-batch vs AdamW (CPU)"))
    lines.emit(f"Model: GPT, {a.layers} layers, hidden {a.hidden}, {a.heads} heads (multi-head), MLP {a.ffn} (GELU); "
               f"one step per micro-batch (k = 1); median of {a.reps} alternating rounds, one torch thread per "
               f"process; DP = 2: two forked gloo processes, DDP bucket {a.bucket:,} elements.")
    lines.emit("")
    matrix_params = sum(p.numel() for n, p in build_model(a).named_parameters()
                        if p.ndim == 2 and "embedding" not in n and "output_layer" not in n)
    fwd_bwd = 6 * matrix_params * a.tokens / 1e9
    ns = {1: newton_schulz_gflops(a), 2: newton_schulz_gflops(a, 2)}
    dp1 = dp1_times(a)
    dp2 = dp2_results(a)
    rows = []
    adamw = dp1["AdamW"]
    for name in VARIANTS:
        g = None if name == "AdamW" else ns[1]
        rows.append([name, "1", "-" if g is None else f"{g:.2f}", "-" if g is None else f"{g / fwd_bwd:.2f}",
                     f"{dp1[name]:.1f}", f"{dp1[name] / adamw:.2f}x"])
    for kind in ("plain", "distopt"):
        base = dp2["times"][("AdamW", kind)]
        for name in VARIANTS:
            g = None if name == "AdamW" else ns[2]
            rows.append([f"{name} ({'plain optimizer' if kind == 'plain' else 'distributed optimizer'})", "2",
                         "-" if g is None else f"{g:.2f}", "-" if g is None else f"{g / fwd_bwd:.2f}",
                         f"{dp2['times'][(name, kind)]:.1f}", f"{dp2['times'][(name, kind)] / base:.2f}x"])
    lines.emit(markdown_table(["variant", "DP", "Newton-Schulz GFLOP per rank", f"/ fwd+bwd of the matrices "
                               f"({a.tokens} tokens)", "step ms per rank", "vs AdamW (same DP, same optimizer)"], rows))
    lines.emit("")
    rows = []
    for kind in ("plain", "distopt"):
        for name in ("Muon fp32", "Muon bf16"):
            per_rank = [c[(name, kind)] for c in dp2["collectives"]]
            names = ", ".join(n for n, _ in per_rank[0])
            sent = " / ".join(f"{sum(b for _, b in c):,}" for c in per_rank)
            rows.append(["plain optimizer" if kind == "plain" else "distributed optimizer", name, names, sent])
    lines.emit("Muon's collectives per step at DP = 2 (bytes each rank sends to the other rank; rank 0 / rank 1):")
    lines.emit("")
    lines.emit(markdown_table(["optimizer", "variant", "collectives", "bytes sent"], rows))
    lines.emit("")
    lines.emit("Reading the bytes: under the distributed optimizer a rank receives only the U pieces of the matrices "
               "it owns (~1/DP of them) and the O pieces (bf16 by default) of the matrices it holds pieces of, and "
               "a matrix inside one rank's range moves nothing; under the plain optimizer each rank orthogonalises "
               "its share of the matrices and all-gathers their O.")
    lines.emit("")
    lines.emit(load_at_end(started))
    lines.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
