import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

__doc__ = """What reading checkpoints without running their code costs: load time of the tiny GPT checkpoint
through the trusted reader (issue #35), this format and the previous one, alternating in one process.

    python bench/micro/checkpoint_load_time.py [--reps 30] [--quick] [--out FILE]

The tiny GPT of tests/test_checkpoint.py (4 layers, hidden 32, vocabulary 128, AdamW state after one
step, fp32), one process (a 1-rank gloo group), `load_checkpoint` -- the code --load runs -- timed whole:

- trusted: this format (JSON entries) through checkpoint_trust (allow-list `.metadata` unpickler).
- trusted, previous format: the checkpoint as the previous format wrote it (our metadata pickle.dumps'd, DCP
  torch.save around it: checkpoint_save's entry writer swapped for pickle.dumps) through the trusted reader
  (its pickles through the allow-list), what loading an old checkpoint costs now.

(The previous reader, plain pickle, was a row until commit a0cad6d: bench/results/checkpoint_load_time.md.)
The variants alternate (order rotated every repetition), after one warm-up load each; medians and the ratio
previous format / this format. Files come from the page cache. Writes bench/results/checkpoint_load_time.md.
"""

import argparse  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "2e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--make-vocab-size-divisible-by", "64"]
RESULTS = os.path.join(bench_common.RESULTS, "checkpoint_load_time.md")
VARIANTS = ("trusted", "trusted, previous format")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="loads per variant")
    parser.add_argument("--quick", action="store_true", help="3 loads per variant (a smoke test)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    reps = 3 if args.quick else args.reps
    started = time.perf_counter()
    start_line = bench_common.load_at_start()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import torch

    from megatron_po import parallel_state as ps
    from megatron_po.config import parse_args
    from megatron_po.distributed import checkpoint_save
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    from megatron_po.gpt_workload import build_model_chunks
    from megatron_po.tensor_parallel import pad_vocab_size
    from megatron_po.training_setup import build_optimizer_for
    torch.set_num_threads(1)
    ps.init_distributed(10.0)
    ps.initialize_model_parallel(1, 1)
    cfg = parse_args(TINY)
    chunks = build_model_chunks(cfg, pad_vocab_size(100, 64, 1))
    optimizer = build_optimizer_for(cfg, chunks, None)
    for p in (p for c in chunks for p in c.parameters()):
        p.grad = torch.randn_like(p)
    optimizer.step()  # AdamW state exists, as in a real checkpoint
    extra = {"train_state": {"iteration": 1, "consumed_samples": 2}, "config": cfg.to_dict(), "vocab_size": 100}
    root = tempfile.mkdtemp(prefix="ckpt-load-time-")
    times = {v: [] for v in VARIANTS}
    try:
        json_entry, checkpoint_save.JsonEntry = checkpoint_save.JsonEntry, pickle.dumps  # the previous format
        try:
            save_checkpoint(os.path.join(root, "previous"), 1, chunks, optimizer, extra)
        finally:
            checkpoint_save.JsonEntry = json_entry
        save_checkpoint(os.path.join(root, "trusted"), 1, chunks, optimizer, extra)
        sizes = {d: sum(os.path.getsize(os.path.join(root, d, "iter_0000001", f))
                        for f in os.listdir(os.path.join(root, d, "iter_0000001"))) for d in ("previous", "trusted")}

        def load(variant: str) -> float:
            t0 = time.perf_counter()
            load_checkpoint(os.path.join(root, "trusted" if variant == "trusted" else "previous"), chunks, optimizer)
            return time.perf_counter() - t0

        for v in VARIANTS:  # warm-up: imports, allocator, page cache
            load(v)
        for rep in range(reps):
            for i in range(len(VARIANTS)):
                v = VARIANTS[(rep + i) % len(VARIANTS)]  # each variant goes first as often
                times[v].append(load(v))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ps.destroy_model_parallel()
    med = {v: bench_common.median(t) for v, t in times.items()}
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    low = {v: min(t) for v, t in times.items()}  # the least disturbed load: steadier than the median under load
    rows = [[v, f"{med[v] * 1e3:.2f}", f"{low[v] * 1e3:.2f}", f"{med[v] / med['trusted']:.3f}",
             f"{low[v] / low['trusted']:.3f}"] for v in VARIANTS]
    old = "trusted, previous format"
    out = bench_common.Lines(bench_common.card(
        __file__, argv, "Checkpoint load time through the trusted reader (issue #35)",
        "CPU, 1 process (gloo), 1 torch thread", f"tiny GPT (4 layers, hidden 32, vocabulary 128; {n_params} "
        f"parameters, AdamW state), checkpoint {sizes['previous'] / 1e3:.0f} KB (previous format) / "
        f"{sizes['trusted'] / 1e3:.0f} KB (this format); `load_checkpoint` timed whole, {reps} loads per variant after "
        "a warm-up, variants alternating (order rotated), files in the page cache", start_line))
    header = ["variant", "median ms", "min ms", "median / trusted", "min / trusted"]
    out.emit(bench_common.markdown_table(header, rows))
    out.emit()
    out.emit(f"ratio previous format / this format: {med[old] / med['trusted']:.3f} (medians); of the minima "
             f"{low[old] / low['trusted']:.3f}")
    out.emit()
    out.emit("trusted: JSON entries, `.metadata` through the allow-list; trusted, previous format: an old checkpoint "
             "(pickled entries) through the allow-list.")
    out.emit()
    out.emit(bench_common.load_at_end(started))
    out.write(args.out)


if __name__ == "__main__":
    main()
