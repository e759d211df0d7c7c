"""Train a tokenizer (sentencepiece BPE or unigram, or GPT-2 style byte-level BPE) on local text files.

    python tools/train_tokenizer.py --input corpus.jsonl.gz --vocab-size 8000 --output-prefix tok/bible

writes `tok/bible.model` and `tok/bible.vocab`. Ids 0-3 are fixed: <pad> 0, <unk> 1, <s> 2 (bos), </s> 3
(eos, which doubles as the end-of-document token that tools/preprocess_data.py --append-eod appends).

With `--model-type byte-bpe` (the `tokenizers` package) the output prefix is a directory that serves both
Megatron's GPT2BPETokenizer (`--vocab-file DIR/vocab.json --merge-file DIR/merges.txt`) and its
HuggingFaceTokenizer (`--tokenizer-model DIR`, or DIR/tokenizer.json): <|endoftext|> 0 (GPT-2's end of
document, the HF eos), <|begin_of_text|> 1 (the HF bos, put in front of every text as Llama-3's tokenizer does).
Inputs are read like tools/preprocess_data.py reads them (jsonl/json/txt/parquet through `datasets`,
local files only) and streamed to sentencepiece through its iterator API, no temporary text file.
"""

import os
import sys

# Local files only: never let `datasets` or the hub reach the network (must precede importing datasets).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

if not __package__:  # run as `python tools/train_tokenizer.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

from tqdm import tqdm

from megatron_po.errors import ConfigError, DataError, UserError, run_cli
from tools.preprocess_data import iter_documents, load_input


# The fixed special ids (tools/preprocess_nmt.py trains its models with the same ones).
SPECIAL_TOKENS = dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                      pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>")


def split_long_line(line: str, max_bytes: int):
    """Cut a line into pieces of at most max_bytes UTF-8 bytes at spaces.

    sentencepiece silently skips sentences longer than --max-sentence-length, and a whole document on one
    line (a Bible chapter is ~4-10 kB) usually is. Cutting at spaces loses nothing: pieces never span a
    space anyway. A single word longer than max_bytes is passed on whole (sentencepiece will skip it).
    """
    if len(line.encode("utf-8")) <= max_bytes:
        yield line
        return
    piece, piece_bytes = [], 0
    for word in line.split(" "):
        word_bytes = len(word.encode("utf-8")) + 1
        if piece and piece_bytes + word_bytes > max_bytes:
            yield " ".join(piece)
            piece, piece_bytes = [], 0
        piece.append(word)
        piece_bytes += word_bytes
    if piece:
        yield " ".join(piece)


# byte-bpe special tokens, in id order: GPT-2's end of document, then a Llama-3 style begin-of-text.
BYTE_BPE_EOD, BYTE_BPE_BOS = "<|endoftext|>", "<|begin_of_text|>"


def train_byte_bpe(texts, vocab_size: int, directory: str) -> None:
    """Byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) saved as GPT-2 files and as a HF tokenizer."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer, processors

    if vocab_size < 258:
        raise ConfigError(f"--vocab-size must exceed the 256 byte tokens + 2 special tokens for byte-bpe "
                          f"(got {vocab_size})")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=[BYTE_BPE_EOD, BYTE_BPE_BOS],
                                show_progress=False)
    os.makedirs(directory, exist_ok=True)
    trainer.save_model(directory)  # vocab.json and merges.txt, GPT-2's format
    tokenizer = trainer._tokenizer
    bos = tokenizer.token_to_id(BYTE_BPE_BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BYTE_BPE_BOS} $A", pair=f"{BYTE_BPE_BOS} $A $B", special_tokens=[(BYTE_BPE_BOS, bos)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BYTE_BPE_BOS,
                                         eos_token=BYTE_BPE_EOD).save_pretrained(directory)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="input file(s): jsonl, json, txt, parquet (+ .gz etc.)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) holding the text")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram", "byte-bpe"], default="bpe",
                   help="sentencepiece bpe/unigram, or GPT-2 style byte-level BPE (vocab.json, merges.txt, HF files)")
    p.add_argument("--output-prefix", required=True,
                   help="writes <prefix>.model and <prefix>.vocab (byte-bpe: the directory <prefix>/)")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="fraction of characters the vocabulary covers (1.0: all; ~0.9995 for CJK)")
    p.add_argument("--max-sentence-length", type=int, default=4192,
                   help="max bytes per training sentence; longer lines are cut at spaces")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of at most this many sentences (0: all)")
    p.add_argument("--user-defined-symbols", nargs="*", default=[],
                   help="extra tokens kept whole, e.g. <|im_start|>")
    return p


def main(argv=None):
    return run_cli(train, build_parser().parse_args(argv))


def train(args):
    import sentencepiece as spm

    if args.vocab_size < 5:
        raise ConfigError(f"--vocab-size must exceed the 4 fixed special tokens (got {args.vocab_size})")
    if args.max_sentence_length < 1:
        raise ConfigError(f"--max-sentence-length must be >= 1 (got {args.max_sentence_length})")
    if not 0 < args.character_coverage <= 1:
        raise ConfigError(f"--character-coverage must be in (0, 1] (got {args.character_coverage})")
    inputs = [(path, load_input(path, args.json_keys)) for path in args.input]
    output_dir = os.path.dirname(args.output_prefix)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)

    # sentencepiece turns an exception raised inside the iterator into a bare RuntimeError; keep ours aside
    # and re-raise it after training stops.
    input_errors = []

    def sentences():
        total = sum(len(dataset) for _, dataset in inputs)
        try:
            for _, texts in tqdm(iter_documents(inputs, args.json_keys), total=total, desc="reading", unit="doc"):
                for text in texts:
                    for line in text.splitlines():
                        line = line.strip()
                        if line:
                            yield from split_long_line(line, args.max_sentence_length)
        except UserError as e:
            input_errors.append(e)

    if args.model_type == "byte-bpe":
        train_byte_bpe(sentences(), args.vocab_size, args.output_prefix)
        if input_errors:
            raise input_errors[0]
        print(f"wrote {args.output_prefix}/ (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json)",
              file=sys.stderr)
        return
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_prefix=args.output_prefix,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            character_coverage=args.character_coverage,
            max_sentence_length=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True,
            **SPECIAL_TOKENS,
            user_defined_symbols=args.user_defined_symbols,
            num_threads=os.cpu_count() or 1,
            minloglevel=1,  # warnings and errors only; tqdm shows the reading progress
        )
    except RuntimeError as e:
        if input_errors:
            raise input_errors[0] from None
        # e.g. "Vocabulary size too high (8000). Please set it to a value <= 5321."
        lines = [line for line in str(e).splitlines() if line.strip()]
        reason = lines[0].split("] ")[-1] if lines else type(e).__name__
        raise DataError(f"sentencepiece training on {', '.join(args.input)} failed: {reason}") from e
    if input_errors:
        raise input_errors[0]
    print(f"wrote {args.output_prefix}.model and {args.output_prefix}.vocab", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
