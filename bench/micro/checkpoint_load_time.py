import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

__doc__ = """What reading checkpoints without running their code costs: load time of the tiny GPT checkpoint
through the previous path and the trusted reader (issue #35), alternating in one process.

    python bench/micro/checkpoint_load_time.py [--reps 30] [--quick] [--out FILE]

The tiny GPT of tests/test_checkpoint.py (4 layers, hidden 32, vocabulary 128, AdamW state after one
step, fp32), one process (a 1-rank gloo group), `load_checkpoint` -- the code --load runs -- timed whole:

- previous: the checkpoint as the previous format wrote it (our metadata pickle.dumps'd, DCP torch.save
  around it), read as the previous code read it: `.metadata` with torch's FileSystemReader (plain
  pickle.load), each metadata entry with DCP's `torch.load(weights_only=False)` then `pickle.loads`.
  The three functions where the two paths differ (checkpoint_dcp's metadata reader, DCP reader and
  entry reader; checkpoint_save's entry writer) are swapped for those, nothing else.
- trusted: this format (JSON entries) through checkpoint_trust (allow-list `.metadata` unpickler).
- trusted, previous format: the previous format's checkpoint through the trusted reader (its pickles
  through the allow-list), what loading an old checkpoint costs now.

The variants alternate (order rotated every repetition), after one warm-up load each; medians and the
ratio trusted / previous. Files come from the page cache. Writes bench/results/checkpoint_load_time.md.
"""

import argparse  # noqa: E402
import io  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "2e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--make-vocab-size-divisible-by", "64"]
RESULTS = os.path.join(bench_common.RESULTS, "checkpoint_load_time.md")
VARIANTS = ("previous", "trusted", "trusted, previous format")


class PreviousFormat:
    """Swaps checkpoint_dcp's and checkpoint_save's trust points for the previous code's, while active."""

    def __init__(self, write: bool, read: bool):
        self.write, self.read = write, read

    def __enter__(self):
        from torch import load as torch_load
        from torch.distributed.checkpoint import FileSystemReader

        from megatron_po.distributed import checkpoint_dcp, checkpoint_save

        def plain_metadata(meta_file):
            with open(meta_file, "rb") as f:
                return pickle.load(f)

        def plain_entry(data, file, entry):  # DCP's load_bytes, then checkpoint_load's pickle.loads
            value = torch_load(io.BytesIO(data), weights_only=False)
            return pickle.loads(value) if isinstance(value, bytes) else value

        self.saved = [(checkpoint_save, "JsonEntry", checkpoint_save.JsonEntry),
                      (checkpoint_dcp, "load_metadata", checkpoint_dcp.load_metadata),
                      (checkpoint_dcp, "trusted_reader", checkpoint_dcp.trusted_reader),
                      (checkpoint_dcp, "read_byte_entry", checkpoint_dcp.read_byte_entry)]
        if self.write:
            checkpoint_save.JsonEntry = pickle.dumps
        if self.read:
            checkpoint_dcp.load_metadata = plain_metadata
            checkpoint_dcp.trusted_reader = lambda path, metadata=None: FileSystemReader(path)  # reads it again
            checkpoint_dcp.read_byte_entry = plain_entry
        return self

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)


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
        with PreviousFormat(write=True, read=False):
            save_checkpoint(os.path.join(root, "previous"), 1, chunks, optimizer, extra)
        save_checkpoint(os.path.join(root, "trusted"), 1, chunks, optimizer, extra)
        sizes = {d: sum(os.path.getsize(os.path.join(root, d, "iter_0000001", f))
                        for f in os.listdir(os.path.join(root, d, "iter_0000001"))) for d in ("previous", "trusted")}

        def load(variant: str) -> float:
            source = "trusted" if variant == "trusted" else "previous"
            with PreviousFormat(write=False, read=variant == "previous"):
                t0 = time.perf_counter()
                load_checkpoint(os.path.join(root, source), chunks, optimizer)
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
    rows = [[v, f"{med[v] * 1e3:.2f}", f"{low[v] * 1e3:.2f}", f"{med[v] / med['previous']:.3f}",
             f"{low[v] / low['previous']:.3f}"] for v in VARIANTS]
    ratio = med["trusted"] / med["previous"]
    out = bench_common.Lines(bench_common.card(
        __file__, argv, "Checkpoint load time: previous reader vs trusted reader (issue #35)",
        "CPU, 1 process (gloo), 1 torch thread", f"tiny GPT (4 layers, hidden 32, vocabulary 128; {n_params} "
        f"parameters, AdamW state), checkpoint {sizes['previous'] / 1e3:.0f} KB (previous format) / "
        f"{sizes['trusted'] / 1e3:.0f} KB (this format); `load_checkpoint` timed whole, {reps} loads per variant after "
        "a warm-up, variants alternating (order rotated), files in the page cache", start_line))
    header = ["variant", "median ms", "min ms", "median / previous", "min / previous"]
    out.emit(bench_common.markdown_table(header, rows))
    out.emit()
    out.emit(f"ratio trusted / previous: {ratio:.3f} (medians; target <= 1.1); of the minima "
             f"{low['trusted'] / low['previous']:.3f}")
    out.emit()
    out.emit("previous: the previous format, read with plain pickle (`.metadata`, entries) and DCP's "
             "torch.load(weights_only=False); trusted: JSON entries, `.metadata` through the allow-list; "
             "trusted, previous format: an old checkpoint through the allow-list.")
    out.emit()
    out.emit(bench_common.load_at_end(started))
    out.write(args.out)


if __name__ == "__main__":
    main()
