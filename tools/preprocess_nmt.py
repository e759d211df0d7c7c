"""Preprocess a parallel corpus for translation into Megatron `.bin/.idx` datasets (pretrain_nmt.py's input).

    python tools/preprocess_nmt.py --input examples/data/bible_web_lsg1910.en-fr.jsonl.gz \
        --src-lang en --tgt-lang fr --doc-key ref --doc-regex '^(.+?) [0-9]+:[0-9]+$' \
        --valid-docs Ruth Philippians James --test-docs Jonah Colossians 1John \
        --vocab-size 8000 --output-prefix data/bible_en_fr --workers 2

Input: one file `datasets` reads (jsonl/json/parquet/csv, optionally compressed) with a source and a target
column (`--src-key`/`--tgt-key`, default the language codes), or two line-aligned text files (source
first; a line empty in both files ends a document, a pair with one empty side is dropped).

Steps, each reported with its counts:
  1. normalise every sentence (Unicode NFKC, whitespace folded to single spaces);
  2. split by whole documents, never by sentences: `--valid-docs/--test-docs` name them (a document is
     the `--doc-key` value, or the first group of `--doc-regex` on it, e.g. the book of a Bible verse
     reference; without a key every row -- for text files every block between blank lines -- is one),
     or `--split` takes consecutive documents in input order by sentence count (Megatron's rule);
  3. take `--tokenizer-model` (joint, or source side with `--tgt-tokenizer-model`) or train a
     sentencepiece model on the training split: joint by default, one per language with
     `--separate-vocabs` (byte fallback and no extra normalisation, so decoding the ids gives back the
     normalised text exactly);
  4. tokenize (`--workers` processes); drop pairs with a side longer than `--max-length` tokens (all
     splits), and training pairs whose longer side exceeds `--max-length-ratio` times the shorter;
  5. deduplicate training pairs, and drop training pairs whose source or target sentence occurs in the
     validation or test split (no held-out sentence leaks into training);
  6. write `<prefix>_<split>_<lang>.bin/.idx` (one sentence per document, ids without BOS/EOS, pairs
     aligned by index), the normalised validation/test text `<prefix>_<split>.<lang>` (references for
     tools/translate.py) and `<prefix>.json` (settings, counts, documents per split).
"""

import os
import sys

# Local files only: never let `datasets` or the hub reach the network (must precede importing datasets).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

if not __package__:  # run as `python tools/preprocess_nmt.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import gzip
import json
import multiprocessing
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from megatron_po.data.gpt_dataset import get_split_indices, parse_split
from megatron_po.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_po.data.nmt_dataset import SPLITS, load_tokenizer, split_prefix
from megatron_po.data.tokenizer import SentencePieceTokenizer
from megatron_po.errors import ConfigError, DataError, run_cli
from tools.preprocess_data import COMPRESSION_SUFFIXES, iter_documents, load_input
from tools.train_tokenizer import SPECIAL_TOKENS

CHUNK_SIZE = 256  # pairs per worker task


def normalize(text: str) -> str:
    """The normalised form every sentence is stored and scored in: NFKC, whitespace folded."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


@dataclass
class Pair:
    doc: str
    src: str
    tgt: str


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _open_text(path: str):
    if not os.path.isfile(path):
        raise DataError(f"input file {path!r} does not exist")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.lower().endswith(COMPRESSION_SUFFIXES):
        raise DataError(f"input file {path!r}: line-aligned text inputs may be plain or .gz")
    return open(path, encoding="utf-8")


def count_lines(path: str) -> int:
    with _open_text(path) as f:
        return sum(1 for _ in f)


def read_aligned_text(src_path: str, tgt_path: str, counts: dict) -> list[Pair]:
    """Two line-aligned files; a line empty in both ends a document; one empty side drops the pair."""
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    for path, n in ((src_path, n_src), (tgt_path, n_tgt)):
        if n == 0:
            raise DataError(f"empty input file {path!r}")
    if n_src != n_tgt:
        raise DataError(f"misaligned parallel files: {src_path} has {n_src} lines but {tgt_path} has {n_tgt} "
                        f"lines (line i of one must translate line i of the other)")
    pairs, doc = [], 0
    with _open_text(src_path) as fs, _open_text(tgt_path) as ft:
        for src, tgt in tqdm(zip(fs, ft), total=n_src, desc="reading", unit="line", mininterval=1.0):
            src, tgt = normalize(src), normalize(tgt)
            if not src and not tgt:
                doc += 1
                continue
            if not src or not tgt:
                counts["empty side"] += 1
                continue
            pairs.append(Pair(str(doc), src, tgt))
    return pairs


def read_columns(path: str, src_key: str, tgt_key: str, doc_key: str | None, counts: dict) -> list[Pair]:
    keys = [src_key, tgt_key] + ([doc_key] if doc_key else [])
    dataset = load_input(path, keys)
    pairs = []
    rows = iter_documents([(path, dataset)], keys)
    for row, (_, texts) in enumerate(tqdm(rows, total=len(dataset), desc="reading", unit="pair", mininterval=1.0)):
        src, tgt = normalize(texts[0]), normalize(texts[1])
        if not src or not tgt:
            counts["empty side"] += 1
            continue
        pairs.append(Pair(texts[2] if doc_key else str(row), src, tgt))
    return pairs


def document_of(doc_regex: str | None):
    if doc_regex is None:
        return lambda doc: doc
    try:
        pattern = re.compile(doc_regex)
    except re.error as e:
        raise ConfigError(f"--doc-regex {doc_regex!r} is not a regular expression: {e}") from None

    def doc(value: str) -> str:
        m = pattern.match(value)
        return (m.group(1) if m.groups() else m.group(0)) if m else value
    return doc


# --------------------------------------------------------------------------------------------------
# Splitting by documents
# --------------------------------------------------------------------------------------------------


def assign_splits(pairs: list[Pair], valid_docs, test_docs, split: str) -> tuple[list[str], dict[str, list[str]]]:
    """Split name per pair and the documents of each split (in input order)."""
    documents = list(dict.fromkeys(p.doc for p in pairs))
    if valid_docs or test_docs:
        known = set(documents)
        for flag, names in (("--valid-docs", valid_docs), ("--test-docs", test_docs)):
            for name in names:
                if name not in known:
                    raise ConfigError(f"{flag}: no document {name!r} in the input (documents look like "
                                      f"{', '.join(repr(d) for d in documents[:4])}, ...)")
        both = set(valid_docs) & set(test_docs)
        if both:
            raise ConfigError(f"documents {sorted(both)} are in both --valid-docs and --test-docs")
        of_doc = {d: "valid" for d in valid_docs} | {d: "test" for d in test_docs}
    else:
        # Consecutive documents; the boundaries fall where the sentence counts say (Megatron's --split
        # rule applied to sentences, rounded to whole documents).
        sizes = np.array([0] * len(documents))
        index = {d: i for i, d in enumerate(documents)}
        for p in pairs:
            sizes[index[p.doc]] += 1
        bounds = [end for _, end in get_split_indices(parse_split(split), len(pairs))]
        ends = np.cumsum(sizes)
        of_doc = {}
        for d, end in zip(documents, ends):
            middle = end - 0.5 * sizes[index[d]]
            of_doc[d] = SPLITS[min(int(np.searchsorted(bounds, middle, side="right")), 2)]
    names = [of_doc.get(p.doc, "train") for p in pairs]
    per_split = {s: [d for d in documents if of_doc.get(d, "train") == s] for s in SPLITS}
    return names, per_split


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def train_sentencepiece(sentences: list[str], prefix: str, vocab_size: int, model_type: str,
                        character_coverage: float) -> str:
    import sentencepiece as spm
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(tqdm(sentences, desc=f"training {os.path.basename(prefix)}.model", unit="sent",
                                        mininterval=1.0)),
            model_prefix=prefix, model_type=model_type, vocab_size=vocab_size,
            character_coverage=character_coverage, shuffle_input_sentence=True,
            # Text is normalised here already; byte fallback keeps unseen characters: decode(encode(x)) == x.
            normalization_rule_name="identity", byte_fallback=True,
            max_sentence_length=1 << 16, num_threads=os.cpu_count() or 1, minloglevel=1, **SPECIAL_TOKENS)
    except RuntimeError as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise DataError(f"sentencepiece training for {prefix}.model failed: "
                        f"{lines[0].split('] ')[-1] if lines else type(e).__name__}") from e
    return prefix + ".model"


_tokenizers = None


def _init_worker(src_model: str, tgt_model: str):
    global _tokenizers
    _tokenizers = (SentencePieceTokenizer(src_model), SentencePieceTokenizer(tgt_model))


def _encode(job):
    """[(src, tgt)] -> [(src ids, tgt ids, round trip exact)]."""
    src_tok, tgt_tok = _tokenizers
    out = []
    for src, tgt in job:
        a, b = src_tok.tokenize(src), tgt_tok.tokenize(tgt)
        exact = src_tok.detokenize(a) == src and tgt_tok.detokenize(b) == tgt
        out.append((np.asarray(a, dtype=np.int32), np.asarray(b, dtype=np.int32), exact))
    return out


def tokenize_all(pairs: list[Pair], src_model: str, tgt_model: str, workers: int) -> list:
    jobs = [[(p.src, p.tgt) for p in pairs[i:i + CHUNK_SIZE]] for i in range(0, len(pairs), CHUNK_SIZE)]
    out = []
    with tqdm(total=len(pairs), desc="tokenizing", unit="pair", mininterval=1.0) as bar:
        if workers > 1:
            with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(src_model, tgt_model)) as pool:
                for chunk in pool.imap(_encode, jobs):  # imap keeps the input order
                    out += chunk
                    bar.update(len(chunk))
        else:
            _init_worker(src_model, tgt_model)
            for job in jobs:
                out += _encode(job)
                bar.update(len(job))
    return out


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="one file with source/target columns, or two line-aligned text files (source first)")
    p.add_argument("--src-lang", required=True, help="source language code (output names, default column)")
    p.add_argument("--tgt-lang", required=True, help="target language code")
    p.add_argument("--src-key", default=None, help="source column (default --src-lang)")
    p.add_argument("--tgt-key", default=None, help="target column (default --tgt-lang)")
    p.add_argument("--doc-key", default=None, help="column naming each pair's document (default: row = document)")
    p.add_argument("--doc-regex", default=None,
                   help="document = first group of this regex matched on --doc-key (e.g. the book of a verse)")
    p.add_argument("--valid-docs", nargs="*", default=[], help="documents held out for validation")
    p.add_argument("--test-docs", nargs="*", default=[], help="documents held out for test")
    p.add_argument("--split", default="98,1,1",
                   help="train,valid,test proportions of sentences, cut at document boundaries in input order "
                        "(when no --valid-docs/--test-docs)")
    p.add_argument("--tokenizer-model", default=None, help="existing sentencepiece model (joint, or the source's)")
    p.add_argument("--tgt-tokenizer-model", default=None, help="existing target-side sentencepiece model")
    p.add_argument("--vocab-size", type=int, default=8000, help="vocabulary of the model(s) trained here")
    p.add_argument("--separate-vocabs", action="store_true", help="train one model per language instead of a joint one")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=250, help="drop pairs with a side longer than this many tokens")
    p.add_argument("--max-length-ratio", type=float, default=3.0,
                   help="drop training pairs whose longer side has more than this times the shorter's tokens")
    p.add_argument("--no-dedup", action="store_true", help="keep duplicate and held-out-overlapping training pairs")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return p


def main(argv=None):
    return run_cli(preprocess, build_parser().parse_args(argv))


def preprocess(args):
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    if args.max_length < 1 or args.max_length_ratio < 1:
        raise ConfigError("need --max-length >= 1 and --max-length-ratio >= 1")
    if len(args.input) > 2:
        raise ConfigError(f"--input takes one file with source/target columns or two line-aligned files, "
                          f"got {len(args.input)}")
    if args.tgt_tokenizer_model and not args.tokenizer_model:
        raise ConfigError("--tgt-tokenizer-model needs --tokenizer-model (the source side's)")
    if args.src_lang == args.tgt_lang:
        raise ConfigError(f"--src-lang and --tgt-lang are both {args.src_lang!r}")
    counts = {"read": 0, "empty side": 0, "too long": 0, "length ratio": 0, "duplicate": 0,
              "overlaps valid/test": 0, "round trip not exact": 0}

    # 1. Read and normalise.
    if len(args.input) == 2:
        if args.doc_key:
            raise ConfigError("--doc-key applies to a file with columns; with two text files a line empty in "
                              "both ends a document")
        pairs = read_aligned_text(*args.input, counts)
    else:
        pairs = read_columns(args.input[0], args.src_key or args.src_lang, args.tgt_key or args.tgt_lang,
                             args.doc_key, counts)
    doc = document_of(args.doc_regex)
    for p in pairs:
        p.doc = doc(str(p.doc))
    counts["read"] = len(pairs) + counts["empty side"]
    if not pairs:
        raise DataError(f"{' and '.join(args.input)}: no sentence pair with text on both sides")

    # 2. Split by documents.
    split_of, docs = assign_splits(pairs, args.valid_docs, args.test_docs, args.split)

    # 3. Tokenizers.
    out_dir = os.path.dirname(args.output_prefix)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    if args.tokenizer_model:
        src_model = args.tokenizer_model
        tgt_model = args.tgt_tokenizer_model or args.tokenizer_model
    else:
        train_pairs = [p for p, s in zip(pairs, split_of) if s == "train"]
        if args.separate_vocabs:
            src_model = train_sentencepiece([p.src for p in train_pairs], f"{args.output_prefix}.{args.src_lang}",
                                            args.vocab_size, args.model_type, args.character_coverage)
            tgt_model = train_sentencepiece([p.tgt for p in train_pairs], f"{args.output_prefix}.{args.tgt_lang}",
                                            args.vocab_size, args.model_type, args.character_coverage)
        else:
            src_model = tgt_model = train_sentencepiece([t for p in train_pairs for t in (p.src, p.tgt)],
                                                        args.output_prefix, args.vocab_size, args.model_type,
                                                        args.character_coverage)
    src_tok, tgt_tok = load_tokenizer(src_model), load_tokenizer(tgt_model)  # with <pad>, <s>, </s>

    # 4. Tokenize and filter by length.
    encoded = tokenize_all(pairs, src_model, tgt_model, args.workers)
    held_out = {t for p, s in zip(pairs, split_of) if s != "train" for t in (("src", p.src), ("tgt", p.tgt))}
    kept = {s: [] for s in SPLITS}
    seen = set()
    for p, s, (a, b, exact) in zip(pairs, split_of, encoded):
        counts["round trip not exact"] += not exact
        if max(len(a), len(b)) > args.max_length or min(len(a), len(b)) == 0:
            counts["too long"] += 1
            continue
        if s == "train":
            if max(len(a), len(b)) > args.max_length_ratio * min(len(a), len(b)):
                counts["length ratio"] += 1
                continue
            # 5. Deduplicate; no held-out sentence in training.
            if not args.no_dedup:
                if ("src", p.src) in held_out or ("tgt", p.tgt) in held_out:
                    counts["overlaps valid/test"] += 1
                    continue
                if (p.src, p.tgt) in seen:
                    counts["duplicate"] += 1
                    continue
                seen.add((p.src, p.tgt))
        kept[s].append((p, a, b))

    if not kept["train"]:
        raise DataError("no training pair left after splitting and filtering (see the counts above)")

    # 6. Write.
    written = []
    for s in SPLITS:
        for lang, tok, side in ((args.src_lang, src_tok, 1), (args.tgt_lang, tgt_tok, 2)):
            prefix = split_prefix(args.output_prefix, s, lang)
            builder = IndexedDatasetBuilder(prefix + ".bin", best_dtype(tok.vocab_size))
            for row in kept[s]:
                builder.add_item(row[side])
                builder.end_document()
            builder.finalize(prefix + ".idx")
            written.append(prefix)
            if s != "train":
                with open(f"{args.output_prefix}_{s}.{lang}", "w", encoding="utf-8") as f:
                    for p, _, _ in kept[s]:
                        f.write((p.src if side == 1 else p.tgt) + "\n")
    meta = {"input": args.input, "src_lang": args.src_lang, "tgt_lang": args.tgt_lang,
            "src_tokenizer_model": src_model, "tgt_tokenizer_model": tgt_model,
            "pairs": {s: len(kept[s]) for s in SPLITS}, "dropped": counts, "documents": docs,
            "settings": {k: v for k, v in vars(args).items() if k != "input"}}
    with open(args.output_prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"pairs read {counts['read']}; dropped: " + ", ".join(f"{k} {v}" for k, v in counts.items()
                                                                if k not in ("read", "round trip not exact")),
          file=sys.stderr)
    for s in SPLITS:
        names = docs[s]
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} documents)" if len(names) > 6 else "")
        print(f"{s}: {len(kept[s])} pairs from {shown or 'no documents'}", file=sys.stderr)
    if counts["round trip not exact"]:
        print(f"note: for {counts['round trip not exact']} pairs decoding the ids does not give back the normalised "
              f"text (the given tokenizer normalises further or lacks byte fallback)", file=sys.stderr)
    print(f"wrote {args.output_prefix}_{{{','.join(SPLITS)}}}_{{{args.src_lang},{args.tgt_lang}}}.bin/.idx, "
          f"{args.output_prefix}.json; tokenizer {src_model}"
          + (f" / {tgt_model}" if tgt_model != src_model else ""), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
