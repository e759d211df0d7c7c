"""What checkpoint checksums cost: save and load time of one GPT checkpoint with and without them.

    python bench/micro/checkpoint_checksums.py [--hidden-size 1024 --num-layers 8 --reps 3]

One process (a 1-rank gloo group), the product code path: `save_checkpoint` (DCP write into `.partial`,
then every file hashed into checksums.json, then published) against the same save with the hashing
switched off (the save before checksums existed: the baseline), and `load_checkpoint` with
`verify=True` (the default) against `verify=False` (--no-verify-checkpoint). Weights only (fp32; an
optimizer's state multiplies the bytes, hashing and DCP alike). Variants alternate, `--reps` times
each, median reported, in the same process so machine load hits them alike. Files are read back from
the page cache (they were just written): on a cold parallel filesystem, verification reads every byte
once more from storage, so there the load can cost up to about twice the I/O. Writes
bench/results/checkpoint_checksums.md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path


def main(argv=None) -> None:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                                      "checkpoint_checksums.md"))
    args = parser.parse_args(argv)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import torch

    from megatron_po import parallel_state as ps
    from megatron_po.config import parse_args
    from megatron_po.distributed import checkpoint_save  # its checksum_checkpoint is swapped below
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    from megatron_po.tensor_parallel import pad_vocab_size
    from megatron_po.gpt_workload import build_model_chunks
    torch.set_num_threads(1)
    started, head = time.perf_counter(), bench_common.header(__file__, argv, "Checkpoint checksums: save and load time")
    ps.init_distributed(10.0)
    ps.initialize_model_parallel(1, 1)
    cfg = parse_args(["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                      "--num-attention-heads", "16", "--seq-length", "64", "--micro-batch-size", "1",
                      "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size)])
    chunks = build_model_chunks(cfg, pad_vocab_size(args.vocab_size, 128, 1))
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    hashing = checkpoint_save.checksum_checkpoint
    root = tempfile.mkdtemp(prefix="ckpt-checksums-")
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+checksums", "load", "load+verify",
                                                     "hashing in save")}

    def timed_hashing(*a, **k):  # the checksum step inside the save, timed on its own
        t0 = time.perf_counter()
        hashing(*a, **k)
        times["hashing in save"].append(time.perf_counter() - t0)
    try:
        save_checkpoint(os.path.join(root, "warm-up"), 1, chunks, None, {"train_state": {}})  # imports, allocator
        load_checkpoint(os.path.join(root, "warm-up"), chunks, None, load_rng=False)
        shutil.rmtree(os.path.join(root, "warm-up"))
        for rep in range(args.reps):
            for with_sums in ((False, True) if rep % 2 == 0 else (True, False)):  # neither always goes first
                d = os.path.join(root, f"{rep}-{int(with_sums)}")
                checkpoint_save.checksum_checkpoint = timed_hashing if with_sums else (lambda *a, **k: None)
                t0 = time.perf_counter()
                save_checkpoint(d, 1, chunks, None, {"train_state": {}})
                times["save+checksums" if with_sums else "save"].append(time.perf_counter() - t0)
            checkpoint_save.checksum_checkpoint = hashing
            d = os.path.join(root, f"{rep}-1")
            for verify in ((False, True) if rep % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                load_checkpoint(d, chunks, None, load_rng=False, verify=verify)
                times["load+verify" if verify else "load"].append(time.perf_counter() - t0)
            files = os.listdir(os.path.join(d, "iter_0000001"))
            size, n_files = sum(os.path.getsize(os.path.join(d, "iter_0000001", f)) for f in files), len(files)
            for r in os.listdir(root):
                if not r.startswith(f"{rep}-"):
                    shutil.rmtree(os.path.join(root, r), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = size / 1e6
    rows = [("save", med["save"], med["save+checksums"]), ("load", med["load"], med["load+verify"])]
    lines = [*head, f"Settings: GPT {args.num_layers} layers, hidden {args.hidden_size}, vocabulary {args.vocab_size}: "
             f"{n_params / 1e6:.1f} M parameters, weights only (fp32), one checkpoint of {mb:.0f} MB in "
             f"{n_files} files; 1 process, gloo; median of {args.reps} after a warm-up save and load, variants "
             "alternating.", "",
             "| step | baseline s | with checksums s | ratio | difference s | hashing alone s (MB/s) |",
             "|---|---|---|---|---|---|"]
    for name, base, sums in rows:
        alone = f"{med['hashing in save']:.3f} ({mb / med['hashing in save']:.0f})" if name == "save" else "-"
        lines.append(f"| {name} | {base:.3f} | {sums:.3f} | {sums / base:.2f} | {sums - base:.3f} | {alone} |")
    lines += ["", "baseline: save without checksums.json (as before), load with --no-verify-checkpoint. "
              "Files are read from the page cache (just written).", "",
              bench_common.load_at_end(started)]
    bench_common.publish(lines, args.out)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
