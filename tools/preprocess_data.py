"""Tokenize text files into Megatron `.bin/.idx` indexed datasets (Megatron's tools/preprocess_data.py CLI).

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx`: one document (one sequence) per input row, in input order,
one dataset per `--json-keys` key. Inputs are jsonl/json/txt/parquet (optionally .gz/.bz2/.xz/.zst)
read through Hugging Face `datasets` from local files only; a .txt file gives one document per line.
"""

import os
import sys

# Local files only: never let `datasets` or the hub reach the network (must precede importing datasets).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

if not __package__:  # run as `python tools/preprocess_data.py`: make the repo root importable, as Megatron does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import multiprocessing
import time

import numpy as np
from tqdm import tqdm

from megatron_po.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_po.data.tokenizer import build_tokenizer
from megatron_po.errors import ConfigError, DataError, run_cli

# File extension -> Hugging Face `datasets` builder; compression suffixes are stripped first.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")

# Documents sent to a worker per task: large enough to amortise the inter-process round trip.
CHUNK_SIZE = 32


def load_input(path: str, keys: list[str]):
    """Open one input file as a `datasets.Dataset` and check it has every key in `keys`."""
    import datasets

    if not os.path.isfile(path):
        raise DataError(f"input file {path!r} does not exist")
    name = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    builder = BUILDERS.get(os.path.splitext(name)[1])
    if builder is None:
        raise DataError(f"input file {path!r}: unsupported extension; expected one of "
                        f"{', '.join(BUILDERS)} (optionally compressed with {', '.join(COMPRESSION_SUFFIXES)})")
    try:
        dataset = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train")
    except Exception as e:  # whatever the builder trips on, the cause is the user's file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"input file {path!r} cannot be read as {builder}: {reason}") from e
    for key in keys:
        if key not in dataset.column_names:
            raise DataError(f"input file {path!r} has no key {key!r} (--json-keys); "
                            f"its keys are {dataset.column_names}")
    return dataset


def iter_documents(inputs, keys: list[str]):
    """Yield (where, texts) per row over all inputs in order; `where` names file and row for errors."""
    for path, dataset in inputs:
        row = 0
        for batch in dataset.select_columns(keys).iter(batch_size=1024):
            for texts in zip(*(batch[key] for key in keys)):
                for key, text in zip(keys, texts):
                    if not isinstance(text, str):
                        raise DataError(f"input file {path!r}, row {row}: key {key!r} holds "
                                        f"{type(text).__name__}, not text")
                yield f"{path!r}, row {row}", texts
                row += 1


# Each worker process builds its own tokenizer once (sentencepiece objects do not pickle).
_tokenizer = None
_append_eod = False
_dtype = None


def _init_worker(tokenizer_type, tokenizer_model, vocab_size, append_eod, dtype):
    global _tokenizer, _append_eod, _dtype
    _tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    _append_eod = append_eod
    _dtype = dtype


def _encode(job):
    """(where, texts) -> ([token array per key], number of text bytes)."""
    where, texts = job
    arrays = []
    for text in texts:
        try:
            ids = _tokenizer.tokenize(text)
        except DataError as e:
            raise DataError(f"input file {where}: {e}") from None
        if _append_eod:
            ids.append(_tokenizer.eod)
        arrays.append(np.asarray(ids, dtype=_dtype))  # compact to send back from a worker
    return arrays, sum(len(text.encode("utf-8")) for text in texts)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="input file(s): jsonl, json, txt, parquet (+ .gz etc.)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) to tokenize, one dataset each")
    p.add_argument("--tokenizer-type", required=True, choices=["SentencePieceTokenizer", "NullTokenizer"])
    p.add_argument("--tokenizer-model", default=None, help="sentencepiece .model (SentencePieceTokenizer)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size without EOD (NullTokenizer)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--log-interval", type=int, default=1000, help="print throughput every N documents")
    return p


def main(argv=None):
    return run_cli(preprocess, build_parser().parse_args(argv))


def preprocess(args):
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    if args.log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1 (got {args.log_interval})")
    # Build the tokenizer here first: a bad model fails once, clearly, instead of in every worker.
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    if args.append_eod and tokenizer.eod < 0:
        raise DataError(f"--append-eod: tokenizer model {args.tokenizer_model!r} has no end-of-document (</s>) token")
    # Open (and validate) every input before writing anything.
    inputs = [(path, load_input(path, args.json_keys)) for path in args.input]

    dtype = best_dtype(tokenizer.vocab_size)
    output_dir = os.path.dirname(args.output_prefix)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype) for key, prefix in prefixes.items()}

    init_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.append_eod, dtype)
    documents = iter_documents(inputs, args.json_keys)
    progress = tqdm(total=sum(len(dataset) for _, dataset in inputs), desc="tokenizing", unit="doc", mininterval=1.0)
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init_args)
            encoded = pool.imap(_encode, documents, CHUNK_SIZE)  # imap keeps the input order
        else:
            _init_worker(*init_args)
            encoded = map(_encode, documents)
        start, total_bytes = time.time(), 0
        for i, (arrays, num_bytes) in enumerate(encoded, start=1):
            for key, array in zip(args.json_keys, arrays):
                builders[key].add_item(array)
                builders[key].end_document()
            total_bytes += num_bytes
            progress.update()
            if i % args.log_interval == 0:
                elapsed = time.time() - start
                tqdm.write(f"processed {i} documents ({i / elapsed:.1f} docs/s, "
                           f"{total_bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr)
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx")
    except BaseException:
        # Leave no half-written dataset behind.
        for key, prefix in prefixes.items():
            builders[key].bin_file.close()
            for path in (prefix + ".bin", prefix + ".idx"):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        progress.close()  # before the error, if any, is printed
        if pool is not None:
            pool.terminate()
            pool.join()
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin/.idx", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
