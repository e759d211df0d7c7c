"""Tokenizers with Megatron's interface: `.vocab_size`, `.tokenize`, `.detokenize` and special-token ids.

Two kinds, chosen by Megatron's `--tokenizer-type` names:
- SentencePieceTokenizer: a sentencepiece `.model` (e.g. from tools/train_tokenizer.py). The end-of-document
  token appended between documents is the model's `</s>` (eos).
- NullTokenizer: no model; text is whitespace-separated integer ids below `vocab_size`, and the EOD id is
  `vocab_size` itself, so the effective vocabulary is vocab_size + 1 (as in Megatron).
Special ids a tokenizer does not have are -1.
"""

from __future__ import annotations

import os

from megatron_po.errors import ConfigError, DataError


class SentencePieceTokenizer:
    def __init__(self, model_path: str):
        import sentencepiece as spm

        if not os.path.isfile(model_path):
            raise DataError(f"tokenizer model {model_path!r} does not exist")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(model_path)
        except (OSError, RuntimeError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise DataError(f"tokenizer model {model_path!r} is not a readable sentencepiece model: {reason}") from e
        self.vocab_size = self.sp.get_piece_size()
        self.pad = self.sp.pad_id()
        self.bos = self.sp.bos_id()
        self.eos = self.sp.eos_id()
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


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


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None):
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model PATH")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ConfigError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {vocab_size})")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not one of SentencePieceTokenizer, NullTokenizer")
