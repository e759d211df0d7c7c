"""Tokenize text files into Megatron `.bin/.idx` indexed datasets (Megatron's tools/preprocess_data.py CLI).

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx`: one document (one sequence) per input row, in input order,
one dataset per `--json-keys` key. Inputs are jsonl/json/txt/parquet (optionally .gz/.bz2/.xz/.zst)
read through Hugging Face `datasets` from local files only; a .txt file gives one document per line.

Megatron's options: every --tokenizer-type of megatron_po/data/tokenizer.py (GPT2BPETokenizer with --vocab-file
and --merge-file, HuggingFaceTokenizer, ...); --split-sentences writes `<prefix>_<key>_sentence.bin/.idx`,
one sequence per sentence (nltk's Punkt splitter; --keep-newlines keeps the whitespace after each sentence);
--partitions N tokenizes N contiguous slices of the input in parallel, each with --workers / N processes,
and concatenates them (the output is byte-identical to one partition).
"""

import os
import sys

# Local files only: never let `datasets` or the hub reach the network (must precede importing datasets).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

if not __package__:  # run as `python tools/preprocess_data.py`: make the repo root importable, as Megatron does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import io
import itertools
import json
import multiprocessing
import time

import numpy as np
from tqdm import tqdm

from megatron_po.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_po.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megatron_po.errors import ConfigError, DataError, UserError, run_cli

# File extension -> Hugging Face `datasets` builder; compression suffixes are stripped first.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")

# Documents sent to a worker per task: large enough to amortise the inter-process round trip.
CHUNK_SIZE = 32


def _open_text(path: str):
    """The file as text, decompressed by its suffix (None for a compression this environment cannot read)."""
    import bz2
    import gzip
    import lzma
    openers = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    suffix = os.path.splitext(path.lower())[1]
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            return None
        return io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8", errors="replace")
    return openers.get(suffix, open)(path, "rt", encoding="utf-8", errors="replace")


def _is_empty(path: str) -> bool:
    """No characters but white space (after decompression)."""
    f = _open_text(path)
    if f is None:
        return False
    with f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _first_bad_json_line(path: str) -> str | None:
    """Where a JSON/JSON-lines file stops parsing, as "line N: invalid JSON: <reason>" (None if it parses:
    the builder failed on something else). A file that parses whole (a JSON array) counts as valid."""
    f = _open_text(path)
    if f is None:
        return None
    with f:
        text = f.read()
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):  # one JSON document: its own error has the line
            return f"line {whole.lineno}: invalid JSON: {whole.msg} (column {whole.colno})"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {number}: invalid JSON: {e.msg} (column {e.colno})"
    return None


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
    if builder != "parquet" and _is_empty(path):
        raise DataError(f"empty input file {path!r}")  # datasets would say "StopIteration"
    try:
        dataset = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train")
    except Exception as e:  # whatever the builder trips on, the cause is the user's file
        where = _first_bad_json_line(path) if builder == "json" else None
        if where is not None:  # the builder's message names no line
            raise DataError(f"input file {path!r}, {where}") from e
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


def build_splitter(lang: str, keep_newlines: bool):
    """text -> its sentences, with nltk's Punkt (Megatron's splitter). Its trained `lang` parameters are used
    when nltk's punkt data is installed locally (nothing is downloaded); else Punkt's untrained defaults,
    which split at . ! ? but know no abbreviations."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError:
        raise ConfigError("--split-sentences needs the nltk package (pip install -r requirements.txt)") from None
    try:
        splitter = nltk.tokenize.PunktTokenizer(lang)  # reads punkt_tab/<lang> from local nltk data only
    except (LookupError, OSError, ValueError):
        splitter = PunktSentenceTokenizer()

    def split(text: str) -> list[str]:
        spans = list(splitter.span_tokenize(text))
        if not keep_newlines:
            return [text[a:b] for a, b in spans]
        # Each sentence keeps the whitespace (newlines included) up to the next sentence.
        ends = [a for a, _ in spans[1:]] + [len(text)]
        return [text[a:e] for (a, _), e in zip(spans, ends)]

    return split


# Each worker process builds its own tokenizer once (sentencepiece objects do not pickle).
_tokenizer = None
_append_eod = False
_dtype = None
_split = None


def _init_worker(tokenizer_args, append_eod, dtype, split_args):
    global _tokenizer, _append_eod, _dtype, _split
    _tokenizer = build_tokenizer(**tokenizer_args)
    _append_eod = append_eod
    _dtype = dtype
    _split = build_splitter(*split_args) if split_args else None


def _encode(job):
    """(where, texts) -> ([list of sequence arrays per key], number of text bytes).

    Without sentence splitting a document is one sequence (empty or not); split into sentences, the empty
    ones are dropped as in Megatron. The EOD token ends the document's last sequence."""
    where, texts = job
    documents = []
    for text in texts:
        try:
            sequences = ([_tokenizer.tokenize(sentence) for sentence in _split(text)] if _split
                         else [_tokenizer.tokenize(text)])
        except DataError as e:
            raise DataError(f"input file {where}: {e}") from None
        if _split:
            sequences = [ids for ids in sequences if ids]
        if _append_eod and sequences:
            sequences[-1] = list(sequences[-1]) + [_tokenizer.eod]
        documents.append([np.asarray(ids, dtype=_dtype) for ids in sequences])  # compact to send back
    return documents, sum(len(text.encode("utf-8")) for text in texts)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="input file(s): jsonl, json, txt, parquet (+ .gz etc.)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) to tokenize, one dataset each")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                   help="Megatron's tokenizer names (docs/data.md)")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model, or a Hugging Face tokenizer directory / tokenizer.json")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size without EOD (NullTokenizer)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (nltk Punkt); writes <prefix>_<key>_sentence.bin/.idx")
    p.add_argument("--keep-newlines", action="store_true",
                   help="--split-sentences: keep the newlines (and spaces) after each sentence")
    p.add_argument("--lang", default="english", help="--split-sentences: the Punkt language (local nltk data)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (over all partitions)")
    p.add_argument("--partitions", type=int, default=1,
                   help="tokenize this many contiguous slices of the input in parallel, then concatenate them")
    p.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted for Megatron's scripts: the input order is always kept, partitions or not")
    p.add_argument("--log-interval", type=int, default=1000, help="print throughput every N documents")
    return p


def main(argv=None):
    return run_cli(preprocess, build_parser().parse_args(argv))


def remove_dataset(prefix: str) -> None:
    for path in (prefix + ".bin", prefix + ".idx"):
        if os.path.exists(path):
            os.remove(path)


def tokenize_into(prefixes: dict, documents, total: int, args, dtype, workers: int, desc: str) -> None:
    """Tokenize `documents` ((where, texts) per row) into one .bin/.idx per key; no output is left on error."""
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype) for key, prefix in prefixes.items()}
    init_args = (tokenizer_args(args), args.append_eod, dtype,
                 (args.lang, args.keep_newlines) if args.split_sentences else None)
    progress = tqdm(total=total, desc=desc, unit="doc", mininterval=1.0)
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=init_args)
            encoded = pool.imap(_encode, documents, CHUNK_SIZE)  # imap keeps the input order
        else:
            _init_worker(*init_args)
            encoded = map(_encode, documents)
        start, total_bytes = time.time(), 0
        for i, (per_key, num_bytes) in enumerate(encoded, start=1):
            for key, sequences in zip(args.json_keys, per_key):
                for array in sequences:
                    builders[key].add_item(array)
                builders[key].end_document()
            total_bytes += num_bytes
            progress.update()
            if i % args.log_interval == 0:
                elapsed = time.time() - start
                tqdm.write(f"{desc}: processed {i} documents ({i / elapsed:.1f} docs/s, "
                           f"{total_bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr)
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx")
    except BaseException:
        # Leave no half-written dataset behind.
        for key, prefix in prefixes.items():
            builders[key].bin_file.close()
            remove_dataset(prefix)
        raise
    finally:
        progress.close()  # before the error, if any, is printed
        if pool is not None:
            pool.terminate()
            pool.join()


def tokenizer_args(args) -> dict:
    return dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file)


def _run_partition(errors, prefixes, documents, total, args, dtype, workers, desc):
    """A partition's process: tokenize, and report a user error as its one line."""
    try:
        tokenize_into(prefixes, documents, total, args, dtype, workers, desc)
    except UserError as e:
        errors.put(str(e))
        sys.exit(1)


def preprocess(args):
    for flag, value in [("--workers", args.workers), ("--log-interval", args.log_interval),
                        ("--partitions", args.partitions)]:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.keep_newlines and not args.split_sentences:
        raise ConfigError("--keep-newlines applies to --split-sentences (without it, text is tokenized whole, "
                          "newlines included)")
    # Build the tokenizer (and splitter) here first: a bad model fails once, clearly, instead of in every worker.
    tokenizer = build_tokenizer(**tokenizer_args(args))
    if args.split_sentences:
        build_splitter(args.lang, args.keep_newlines)
    if args.append_eod and tokenizer.eod < 0:
        raise DataError(f"--append-eod: the {args.tokenizer_type} ({args.tokenizer_model or args.vocab_file}) has "
                        f"no end-of-document token")
    # Open (and validate) every input before writing anything.
    inputs = [(path, load_input(path, args.json_keys)) for path in args.input]

    dtype = best_dtype(tokenizer.vocab_size)
    output_dir = os.path.dirname(args.output_prefix)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
    level = "sentence" if args.split_sentences else "document"
    prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    total = sum(len(dataset) for _, dataset in inputs)
    if args.partitions == 1:
        tokenize_into(prefixes, iter_documents(inputs, args.json_keys), total, args, dtype, args.workers,
                      "tokenizing")
    else:
        merge_partitions(prefixes, inputs, total, args, dtype)
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin/.idx", file=sys.stderr)


def merge_partitions(prefixes: dict, inputs, total: int, args, dtype) -> None:
    """Tokenize --partitions contiguous row ranges in parallel processes, then concatenate them in order."""
    n = args.partitions
    bounds = [total * p // n for p in range(n + 1)]
    parts = [{key: f"{prefix}_partition{p}" for key, prefix in prefixes.items()} for p in range(n)]
    context = multiprocessing.get_context("fork")  # the children share the opened inputs
    errors = context.Queue()
    processes = []
    try:
        for p in range(n):
            rows = itertools.islice(iter_documents(inputs, args.json_keys), bounds[p], bounds[p + 1])
            process = context.Process(target=_run_partition, args=(errors, parts[p], rows, bounds[p + 1] - bounds[p],
                                                                   args, dtype, max(1, args.workers // n),
                                                                   f"partition {p}"))
            process.start()
            processes.append(process)
        for process in processes:
            process.join()
        failed = [p for p, process in enumerate(processes) if process.exitcode != 0]
        if failed:
            message = errors.get(timeout=5) if not errors.empty() else None
            raise DataError(message or f"--partitions: partition {failed[0]} stopped (exit code "
                                       f"{processes[failed[0]].exitcode})")
        for key, prefix in prefixes.items():
            builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
            for part in parts:
                builder.add_index(part[key])
            builder.finalize(prefix + ".idx")
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
        for part in parts:
            for part_prefix in part.values():
                remove_dataset(part_prefix)


if __name__ == "__main__":
    sys.exit(main())
