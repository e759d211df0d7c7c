"""The output layer + cross entropy on a CPU (issue 34): the chunked computation (--chunked-output-loss, the
default; tensor_parallel/output_cross_entropy.py) eagerly and under torch.compile (--torch-compile), against the
unfused path (the [tokens x V] logits, their fp32 copy, then the vocab-parallel cross entropy), forward +
backward: peak memory and time, as ratios to the unfused path's in the same run. `chunked` computes the gradients
in the forward (the backward gets the mean loss's gradient, a multiple of the equal loss weights); the variant
`chunked-recompute` is told, as the asynchronous methods whose weights change between the passes tell it, that
the backward's weights differ, and recomputes the logits in the backward (one more GEMM; the weight copied once).

Each variant runs in a process of its own (`--variant`), alternating: a warm-up pass (it compiles the compiled
variant), then one measured pass whose peak is the process's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs after the freed heap was handed back with malloc_trim) above its resident set before it,
then `--reps` timed passes. Peak covers everything the pass allocates: logits, softmax, the weight's and the
input's gradients (not the weight and input themselves, allocated before). Linux only.

    python bench/step/output_loss.py              # 4096 tokens x 512 hidden, vocab 50,257 (padded to 50,304)
    python bench/step/output_loss.py --quick      # small, no compiled variant: the test's run
"""

import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

VARIANTS = ("unfused", "chunked", "chunked-compiled", "chunked-recompute")
TARGETED = ("chunked", "chunked-compiled")  # issue 34's target; chunked-recompute is reported beside them
# chunks, chunk_logits: output_cross_entropy's CHUNKS and CHUNK_LOGITS (None: the module's)
FULL = dict(tokens=4096, hidden=512, vocab=50257, chunks=None, chunk_logits=None)
QUICK = dict(tokens=256, hidden=64, vocab=4000, chunks=1, chunk_logits=2 ** 16)  # 16 chunks


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(variant: str, tokens: int, hidden: int, vocab: int, chunks: int, chunk_logits: int, reps: int) -> dict:
    """In this process: peak bytes and seconds per forward + backward of `variant`."""
    import contextlib

    import torch

    from megatron_po.tensor_parallel import ColumnParallelLinear, output_cross_entropy, pad_vocab_size, \
        vocab_parallel_cross_entropy
    output_cross_entropy.CHUNKS, output_cross_entropy.CHUNK_LOGITS = chunks, chunk_logits
    if variant == "chunked-recompute":  # a provider of the forward's weights: the backward recomputes on them
        output_cross_entropy.weights_kept_for_recompute = lambda params: contextlib.nullcontext
    torch.manual_seed(0)
    padded = pad_vocab_size(vocab, 128, 1)
    layer = ColumnParallelLinear(hidden, padded, bias=False)
    seq, batch = tokens // 4, 4
    x = torch.randn(seq, batch, hidden).requires_grad_()
    target = torch.randint(0, vocab, (seq, batch))
    backend = "inductor" if variant == "chunked-compiled" else None

    def step():
        if variant == "unfused":
            loss = vocab_parallel_cross_entropy(layer(x)[0].float(), target)
        else:
            loss = output_cross_entropy.output_layer_cross_entropy(layer, x, target, backend=backend)
        loss.mean().backward()
        out = loss.detach().sum().item()
        x.grad = layer.weight.grad = None
        return out

    step()  # warm-up (compiles the compiled variant)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the resident set now
    loss = step()
    peak = (_status_kib("VmHWM") - before) * 1024
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    rows = [r.stop - r.start for r in output_cross_entropy._chunks(tokens, padded)]
    return {"variant": variant, "peak": peak, "seconds": times, "loss": loss, "padded_vocab": padded,
            "threads": torch.get_num_threads(), "chunk_rows": [min(rows), max(rows), len(rows)]}


def run_variant(variant: str, size: dict, reps: int) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--reps", str(reps),
            *(f"--{k.replace('_', '-')}={v}" for k, v in size.items())]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(size: dict, rounds: int, reps: int, variants, argv: list[str]) -> tuple[list[str], dict]:
    started, load_before = time.perf_counter(), bench_common.load_at_start()
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(rounds):  # alternating processes: load drifts hit every variant alike
        for v in variants:
            results[v].append(run_variant(v, size, reps))
    base = results["unfused"]
    base_peak = min(r["peak"] for r in base)
    base_time = min(t for r in base for t in r["seconds"])
    first = base[0]
    lines = bench_common.Lines(bench_common.card(
        __file__, argv, "Output layer + cross entropy: chunked vs unfused (CPU)", f"CPU, {first['threads']} torch "
        f"threads", f"{size['tokens']} tokens ({size['tokens'] // 4} x 4) x hidden {size['hidden']}, vocab "
        f"{size['vocab']} padded to {first['padded_vocab']}, fp32, one TP rank; {first['chunk_rows'][2]} chunks of "
        f"{first['chunk_rows'][0]}-{first['chunk_rows'][1]} tokens (CHUNKS {size['chunks']}, CHUNK_LOGITS "
        f"{size['chunk_logits']}); forward + backward of the mean loss (input and weight gradients); "
        f"{rounds} rounds of one fresh process per variant, alternating; {reps} timed passes each after a warm-up",
        load_before))
    lines.emit("Peak: the process's resident-set high-water mark over one pass above its resident set before it "
               "(smallest over the rounds); time: the fastest pass over the rounds (the least disturbed by other "
               "load on a shared machine; the medians of each round follow the table). Ratios to `unfused` of the "
               "same run.")
    lines.emit()
    rows, ratios = [], {}
    for v in variants:
        peak = min(r["peak"] for r in results[v])
        seconds = min(t for r in results[v] for t in r["seconds"])
        ratios[v] = {"peak": peak / base_peak, "time": seconds / base_time}
        rows.append([v, f"{peak / 2**20:.0f}", f"{peak / base_peak:.3f}", f"{seconds:.3f}",
                     f"{seconds / base_time:.3f}", f"{results[v][0]['loss']:.6f}"])
    lines.emit(bench_common.markdown_table(["variant", "peak MiB", "vs unfused", "fastest pass (s)", "vs unfused",
                                            "sum of losses"], rows))
    lines.emit()
    lines.emit("Median pass per round (s): " + "; ".join(
        f"{v} " + " / ".join(f"{bench_common.median(r['seconds']):.2f}" for r in results[v]) for v in variants))
    lines.emit()
    lines.emit("Target (issue 34): chunked <= 1/4 of the unfused peak in <= 1.1x its time.")
    lines.emit()
    for v in variants[1:]:
        met = ratios[v]["peak"] <= 0.25 and ratios[v]["time"] <= 1.1
        verdict = ("met" if met else "NOT met") if v in TARGETED else "for reference (asynchronous methods)"
        lines.emit(f"- {v}: peak {ratios[v]['peak']:.3f}x, time {ratios[v]['time']:.3f}x: {verdict}")
    lines.emit()
    lines.emit(bench_common.load_at_end(started))
    return lines, ratios


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = bench_common.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round, no compiled variant")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per variant")
    parser.add_argument("--reps", type=int, default=3, help="timed passes per process")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None)
    parser.add_argument("--out", default=os.path.join(bench_common.RESULTS, "output_loss.md"),
                        help="results file (not written with --quick unless given)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measuring process
    for k in FULL:
        parser.add_argument(f"--{k.replace('_', '-')}", type=int, help={
            "chunks": "chunks a pass makes, at least (default: output_cross_entropy.CHUNKS)",
            "chunk_logits": "logits per chunk, at most (default: output_cross_entropy.CHUNK_LOGITS)"}.get(
                k, argparse.SUPPRESS))
    args = parser.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    size.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    from megatron_po.tensor_parallel import output_cross_entropy
    size["chunks"] = output_cross_entropy.CHUNKS if size["chunks"] is None else size["chunks"]
    size["chunk_logits"] = output_cross_entropy.CHUNK_LOGITS if size["chunk_logits"] is None else size["chunk_logits"]
    if args.variant:
        print(json.dumps(measure(args.variant, **size, reps=args.reps)))
        return
    bench_common.offline_env()
    variants = tuple(args.variants or (VARIANTS[:2] if args.quick else VARIANTS))
    if variants[0] != "unfused":
        variants = ("unfused",) + tuple(v for v in variants if v != "unfused")
    rounds, reps = (1, 1) if args.quick else (args.rounds, args.reps)
    lines, _ = report(size, rounds, reps, variants, argv)
    if not args.quick or "--out" in " ".join(argv):
        lines.write(args.out)


if __name__ == "__main__":
    main()
