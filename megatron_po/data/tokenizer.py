"""Tokenizers with Megatron's interface: `.vocab_size`, `.tokenize`, `.detokenize` and special-token ids.

Chosen by Megatron's `--tokenizer-type` names; each gives the ids Megatron-LM's tokenizer of that name gives:
- GPT2BPETokenizer: byte-level BPE from `--vocab-file` (vocab.json) and `--merge-file` (merges.txt), OpenAI's
  GPT-2 algorithm; `<|endoftext|>` is the end-of-document (EOD) token. Text is encoded as plain text (a literal
  "<|endoftext|>" in it is not turned into the special id), as Megatron's own GPT-2 tokenizer does.
- HuggingFaceTokenizer: `--tokenizer-model` = a local directory (AutoTokenizer) or a tokenizer.json file,
  never downloaded (the Python code a directory ships runs only with --trust-remote-code). `tokenize` adds the
  tokenizer's own special tokens (e.g. Llama-3's BOS) as Megatron does; EOD is the tokenizer's eos token.
- GPTSentencePieceTokenizer: a sentencepiece `.model`; plain `encode`, EOD = the model's eos.
- Llama2Tokenizer: a sentencepiece `.model`; every text starts with BOS (no EOS; `--append-eod` adds it).
- SentencePieceTokenizer: this project's name for GPTSentencePieceTokenizer's behaviour (EOD = `</s>`).
  Megatron's tokenizer of that name (BERT/T5) adds <CLS>/<SEP>/<EOD>/<MASK> ids past the model; ours does not.
- NullTokenizer: no model; text is whitespace-separated integer ids below `vocab_size`, and the EOD id is
  `vocab_size` itself, so the effective vocabulary is vocab_size + 1 (as in Megatron).
Special ids a tokenizer does not have are -1.
"""

from __future__ import annotations

import json
import os

from megatron_po.errors import ConfigError, DataError

TOKENIZER_TYPES = ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "NullTokenizer"]
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")

# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, each with one optional leading space.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


def _reason(e: Exception) -> str:
    """The last line of an exception's message: what a library's error says went wrong."""
    return (str(e).strip().splitlines() or [type(e).__name__])[-1]


def _need_file(path: str, flag: str, hint: str = "") -> None:
    if os.path.isdir(path):  # "does not exist" would send the user looking for a file that is there
        raise DataError(f"{flag} {path!r} is a directory, not a file{hint}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path!r} does not exist")


class SentencePieceTokenizer:
    """sentencepiece `.model`: plain encode, EOD = eos (Megatron's GPTSentencePieceTokenizer)."""

    def __init__(self, model_path: str):
        import sentencepiece as spm

        _need_file(model_path, "tokenizer model", " (SentencePieceTokenizer reads a .model file; a Hugging Face "
                                                    "tokenizer directory needs --tokenizer-type HuggingFaceTokenizer)")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(model_path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer model {model_path!r} is not a readable sentencepiece model: "
                            f"{_reason(e)}") from e
        self.vocab_size = self.sp.get_piece_size()
        self.pad = self.sp.pad_id()
        self.bos = self.sp.bos_id()
        self.eos = self.sp.eos_id()
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's name for what SentencePieceTokenizer does here."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """sentencepiece with BOS in front of every text (Megatron's Llama2Tokenizer: text completion, no EOS)."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        if self.bos < 0:
            raise DataError(f"Llama2Tokenizer: tokenizer model {model_path!r} has no BOS token (<s>)")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + super().tokenize(text)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable bytes map to themselves, the other 68
    bytes to characters from U+0100 on, so every byte string is a string BPE can merge without spaces."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class GPT2BPETokenizer:
    """Byte-level BPE from GPT-2's vocab.json and merges.txt (OpenAI's algorithm, in plain Python)."""

    def __init__(self, vocab_file: str, merge_file: str):
        import regex

        _need_file(vocab_file, "--vocab-file")
        _need_file(merge_file, "--merge-file")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"--vocab-file {vocab_file!r} is not a JSON vocabulary: {_reason(e)}") from e
        if not isinstance(self.encoder, dict):
            raise DataError(f"--vocab-file {vocab_file!r} is not a JSON object of token -> id")
        self.decoder = {i: token for token, i in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = [tuple(line.split(" ")) for line in lines if line]
        bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
        if bad is not None:
            raise DataError(f"--merge-file {merge_file!r}: merge {bad + 1} is {' '.join(merges[bad])!r}, "
                            f"not two tokens separated by a space")
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        if GPT2_EOD not in self.encoder:
            raise DataError(f"--vocab-file {vocab_file!r} has no {GPT2_EOD} token (GPT-2's end of document)")
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.cache: dict[str, list[int]] = {}
        self.vocab_size = len(self.encoder)
        self.eod = self.eos = self.encoder[GPT2_EOD]
        self.bos = self.pad = -1

    def _bpe(self, word: str) -> list[int]:
        """Merge the pair of lowest rank, everywhere in the word, until no ranked pair is left."""
        ids = self.cache.get(word)
        if ids is not None:
            return ids
        parts = list(word)
        while len(parts) > 1:
            rank, first, second = min((self.ranks.get(pair, float("inf")), *pair) for pair in zip(parts, parts[1:]))
            if rank == float("inf"):
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        try:
            ids = [self.encoder[part] for part in parts]
        except KeyError as e:
            raise DataError(f"GPT2BPETokenizer: {e.args[0]!r} is not in the vocabulary (vocab.json lacks one of "
                            f"the 256 byte tokens, or merges.txt is from another vocabulary)") from None
        if len(self.cache) < 1_000_000:  # words repeat; bound the memory a long run spends on them
            self.cache[word] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in self.pattern.findall(text):
            ids.extend(self._bpe("".join(self.byte_encoder[b] for b in word.encode("utf-8"))))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer from a local directory (AutoTokenizer) or one tokenizer.json file."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        import transformers

        if not (os.path.isdir(path) or os.path.isfile(path)):
            raise DataError(f"--tokenizer-model {path!r} is neither a directory nor a tokenizer.json file "
                            f"(HuggingFaceTokenizer loads local files only)")
        try:
            if os.path.isdir(path):
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                                            trust_remote_code=trust_remote_code)
            else:
                self.tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as e:  # tokenizers raises bare Exceptions; whatever it is, the cause is the user's file
            if not trust_remote_code and "trust_remote_code" in str(e):
                raise DataError(f"--tokenizer-model {path!r} ships its own Python code (auto_map in its "
                                f"tokenizer_config.json): add --trust-remote-code to run it") from e
            raise DataError(f"--tokenizer-model {path!r} is not a loadable Hugging Face tokenizer: "
                            f"{_reason(e)}") from e
        self.vocab_size = len(self.tokenizer)

        def special(token_id):
            return -1 if token_id is None else int(token_id)

        self.eod = self.eos = special(self.tokenizer.eos_token_id)
        self.bos = special(self.tokenizer.bos_token_id)
        self.pad = special(self.tokenizer.pad_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


class NullTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size_without_eod = int(vocab_size)
        self.vocab_size = self.vocab_size_without_eod + 1
        self.eod = self.vocab_size_without_eod
        self.pad = self.bos = self.eos = -1

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise DataError(f"NullTokenizer: {word[:40]!r} is not an integer token id "
                                f"(its text is whitespace-separated ids)") from None
            if not 0 <= token < self.vocab_size:
                raise DataError(f"NullTokenizer: token id {token} is outside [0, {self.vocab_size}) "
                                f"(--vocab-size {self.vocab_size_without_eod} plus the EOD id)")
            ids.append(token)
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def tokenizer_flag_error(tokenizer_type: str, tokenizer_model=None, vocab_size=None, vocab_file=None,
                         merge_file=None) -> str | None:
    """What the flags lack for this tokenizer type (one line), or None. Shared by the config validator and
    build_tokenizer, so the rule is written once."""
    if tokenizer_type not in TOKENIZER_TYPES:
        return f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}"
    if tokenizer_type == "GPT2BPETokenizer" and (vocab_file is None or merge_file is None):
        return "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)"
    if tokenizer_type in SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer",) and tokenizer_model is None:
        what = "a directory or tokenizer.json" if tokenizer_type == "HuggingFaceTokenizer" else "a sentencepiece .model"
        return f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH ({what})"
    if tokenizer_type == "NullTokenizer" and (vocab_size is None or vocab_size < 1):
        return f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {vocab_size})"
    return None


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None, trust_remote_code: bool = False):
    """`trust_remote_code`: HuggingFaceTokenizer may run the code its directory ships (--trust-remote-code)."""
    error = tokenizer_flag_error(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    if error:
        raise ConfigError(error)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, trust_remote_code)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    return NullTokenizer(vocab_size)


def build_tokenizer_from(d):
    """The tokenizer the data flags (config.DataConfig `d`) name."""
    return build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_size, d.vocab_file, d.merge_file,
                           d.trust_remote_code)
