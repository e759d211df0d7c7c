"""GPT2BPETokenizer (ours, plain Python) against transformers' GPT2Tokenizer (Rust) on the same files.

    python bench/micro/tokenizer_speed.py [--chapters 1000] [--vocab-size 8000] [--reps 3] [--out FILE.md]

Trains a byte-level BPE on the bundled corpus's first chapters (tools/train_tokenizer.py --model-type
byte-bpe), then tokenizes the same chapters with both, one call per document, alternating `--reps` times
(the best rep of each counts; the machine is shared). Checks the ids are identical and prints MB/s and the
ratio ours / transformers. The load average is recorded at the start and the end.
"""

import gzip
import itertools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from megatron_po.data.tokenizer import build_tokenizer  # noqa: E402
from tools.train_tokenizer import train_byte_bpe  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "data",
                      "bible_web.en.jsonl.gz")


def main():
    p = bench_common.parser(__doc__)
    p.add_argument("--chapters", type=int, default=1000)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import transformers

    started, head = time.perf_counter(), bench_common.header(__file__, sys.argv[1:], "GPT2BPETokenizer vs "
                                                             "transformers.GPT2Tokenizer")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, args.chapters)]
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as d:
        train_byte_bpe(texts, args.vocab_size, d)
        vocab, merges = os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")
        ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
        reference = transformers.GPT2Tokenizer(vocab, merges)
        runs = {"ours": lambda: [ours.tokenize(t) for t in texts],
                "transformers": lambda: [reference(t, add_special_tokens=False).input_ids for t in texts]}
        best, ids = {}, {}
        for _ in range(args.reps):
            for name, run in runs.items():
                if name == "ours":
                    ours.cache.clear()  # every rep starts cold
                start = time.perf_counter()
                ids[name] = run()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    equal = ids["ours"] == ids["transformers"]
    tokens = sum(len(x) for x in ids["ours"])
    lines = [
        *head,
        f"{args.chapters} chapters, {megabytes:.2f} MB, {tokens} tokens (vocabulary {args.vocab_size}); "
        f"ids identical: **{equal}**. Best of {args.reps} alternating reps, one process, one call per document.",
        "",
        "| tokenizer | seconds | MB/s |",
        "|---|---|---|",
        *[f"| {name} | {best[name]:.2f} | {megabytes / best[name]:.2f} |" for name in runs],
        "",
        f"Ratio ours / transformers (throughput): **{best['transformers'] / best['ours']:.2f}**",
        "",
        bench_common.load_at_end(started),
    ]
    bench_common.publish(lines, args.out)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
