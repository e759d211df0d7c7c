"""bench/convergence/convergence.py's workloads: the tiny GPT on the bundled Bible and the tiny encoder-decoder on the
English-French Bible. Each prepares its data once (tokenizer, preprocessed corpus, dataset indices under
`<cache>/data/`) and hands the jobs configs, chunk builders, training and validation batches."""

from __future__ import annotations

import functools
import hashlib
import json
import os

from bench_common import REPO
from convergence_settings import WORKLOAD_NAMES, Settings


def _run_tool(main, argv: list[str], what: str) -> None:
    rc = main(argv)
    if rc:
        raise RuntimeError(f"{what} failed (exit code {rc}): {' '.join(argv)}")


class GPTWorkload:
    """The tiny GPT on a sentencepiece-tokenized corpus. Interface used by the jobs: `prepare()` (once,
    in the main process), `config(seed)`, `padded_vocab`, `train_batch(seed)` -> (mb -> batch),
    `valid_batches()`, `tokens_per_microbatch`, `describe()`."""

    name = "gpt"

    def __init__(self, s: Settings):
        self.s = s
        key = hashlib.md5(f"{os.path.abspath(s.corpus)}|{os.path.getsize(s.corpus)}|{s.vocab_size}".encode())
        self.data_dir = os.path.join(s.cache(), "data", key.hexdigest()[:12])
        self.tokenizer_model = os.path.join(self.data_dir, "tok.model")
        self.prefix = os.path.join(self.data_dir, "corpus_text_document")
        self.index_cache = os.path.join(self.data_dir, "index")
        self.tokens_per_microbatch = s.micro_batch * s.seq_length

    def prepare(self) -> None:
        """Tokenizer and .bin/.idx corpus (reusing tools/), then the dataset indices of every seed."""
        from tools import preprocess_data, train_tokenizer
        os.makedirs(self.data_dir, exist_ok=True)
        if not os.path.isfile(self.tokenizer_model):
            _run_tool(train_tokenizer.main, ["--input", self.s.corpus, "--json-keys", "text", "--vocab-size",
                                             str(self.s.vocab_size), "--model-type", "bpe", "--output-prefix",
                                             self.tokenizer_model[:-len(".model")]], "tools/train_tokenizer.py")
        if not os.path.isfile(self.prefix + ".idx"):
            _run_tool(preprocess_data.main, ["--input", self.s.corpus, "--json-keys", "text",
                                             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                             self.tokenizer_model, "--output-prefix",
                                             self.prefix[:-len("_text_document")],
                                             "--append-eod", "--workers", "1", "--log-interval", "100000"],
                      "tools/preprocess_data.py")
        for seed in range(1, self.s.seeds + 1):
            self._train_dataset(seed)
        self._valid_dataset()

    @property
    def tokenizer_vocab(self) -> int:
        from megatron_po.data.tokenizer import build_tokenizer
        return build_tokenizer("SentencePieceTokenizer", self.tokenizer_model).vocab_size

    @property
    def padded_vocab(self) -> int:
        from megatron_po.tensor_parallel import pad_vocab_size
        return pad_vocab_size(self.tokenizer_vocab, 128, 1)

    def config(self, seed: int):
        from megatron_po.config import Config, ModelConfig
        s = self.s
        cfg = Config()
        # No dropout: every method sees exactly the same function of the weights (dropout masks would
        # be drawn in each method's own op order).
        cfg.model = ModelConfig(num_layers=s.num_layers, hidden_size=s.hidden_size,
                                num_attention_heads=s.num_attention_heads, seq_length=s.seq_length,
                                hidden_dropout=0.0, attention_dropout=0.0,
                                untie_embeddings_and_output_weights=True)
        cfg.training.seed = seed
        cfg.training.micro_batch_size = s.micro_batch
        return cfg

    def _datasets(self, seed: int, num_samples):
        from megatron_po.data.gpt_dataset import build_gpt_datasets
        return build_gpt_datasets([self.prefix], self.s.split, self.s.seq_length, seed, num_samples,
                                  cache_dir=self.index_cache, vocab_size=self.tokenizer_vocab)

    def _train_dataset(self, seed: int):
        # The seed shuffles the training samples (and initialises the model): same order for every method.
        return self._datasets(seed, (self.s.steps * self.s.micro_batch, 0, 0))[0]

    def _valid_dataset(self):
        # A fixed validation set (seed 1234) for every run: the last chapters of the Bible (--split).
        return self._datasets(1234, (0, self.s.eval_batches * self.s.micro_batch, 0))[1]

    @staticmethod
    def _stack(items):
        import torch
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    def train_batch(self, seed: int):
        ds, B = self._train_dataset(seed), self.s.micro_batch
        # Modulo the length, as gpt_workload.microbatches does (the calibration may stream past `steps`).
        return lambda mb: self._stack([ds[i % len(ds)] for i in range(mb * B, (mb + 1) * B)])

    def valid_batches(self):
        ds, B = self._valid_dataset(), self.s.micro_batch
        return [self._stack([ds[i] for i in range(j * B, (j + 1) * B)]) for j in range(self.s.eval_batches)]

    def unigram_baseline(self) -> float:
        """Validation loss of the training split's add-one-smoothed token frequencies (no context)."""
        import numpy as np
        from megatron_po.data.gpt_dataset import document_token_starts, get_split_indices, parse_split
        from megatron_po.data.indexed_dataset import IndexedDataset
        ds = IndexedDataset(self.prefix)
        starts = document_token_starts(ds)
        begin, end = get_split_indices(parse_split(self.s.split), ds.num_documents)[0]
        counts = np.bincount(np.asarray(ds.tokens[starts[begin]:starts[end]], dtype=np.int64),
                             minlength=self.tokenizer_vocab).astype(np.float64) + 1.0
        labels = np.concatenate([b["labels"].reshape(-1).numpy() for b in self.valid_batches()])
        return float(-np.log(counts[labels] / counts.sum()).mean())

    @staticmethod
    def build_chunks(*args, **kwargs):
        from megatron_po.pipeline.partition import build_chunks_for_rank
        return build_chunks_for_rank(*args, **kwargs)

    def describe_model(self, n_params: int | None) -> str:
        s = self.s
        return f"GPT, {s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads, sequence {s.seq_length}"

    def describe_sample(self) -> str:
        return f"{self.s.micro_batch} sequences x {self.s.seq_length} tokens"

    def describe(self) -> str:
        from megatron_po.data.indexed_dataset import IndexedDataset
        ds = IndexedDataset(self.prefix)
        return (f"corpus `{os.path.relpath(self.s.corpus, REPO)}`: {ds.num_documents} documents (chapters), "
                f"{len(ds.tokens):,} tokens with a sentencepiece BPE tokenizer of {self.tokenizer_vocab} pieces "
                f"(tools/train_tokenizer.py, tools/preprocess_data.py --append-eod); split `{self.s.split}` by "
                f"documents in canonical order, so validation is the last chapters (Megatron --split)")


class NMTWorkload:
    """The tiny encoder-decoder translation model on the bundled English-French Bible
    (examples/data/bible_web_lsg1910.en-fr.jsonl.gz): tools/preprocess_nmt.py with a joint sentencepiece
    vocabulary and held-out books, `--num-layers` stacked layers (half encoder, half decoder), no label
    smoothing (the validation loss is the plain cross entropy, comparable with the unigram baseline).

    Every training micro-batch holds B pairs whose targets have one length, so splitting it into the D
    micro-batches of a GPipe/1F1B flush keeps its loss (mean of micro-batch means = mean over its tokens)
    and the start-up check stays exact. Besides the validation loss, a job scores the greedy translations
    of the same validation pairs with sacrebleu's BLEU (`bleu(chunks)`)."""

    name = "nmt"
    # Validation and test: whole books of both testaments (~300 verses each), never random verses.
    VALID_BOOKS = ("Ruth", "Philippians", "James")
    TEST_BOOKS = ("Jonah", "Colossians", "1John")

    def __init__(self, s: Settings):
        self.s = s
        key = hashlib.md5(f"nmt|{os.path.abspath(s.corpus)}|{os.path.getsize(s.corpus)}|{s.vocab_size}|"
                          f"{s.seq_length}".encode())
        self.data_dir = os.path.join(s.cache(), "data", key.hexdigest()[:12])
        self.prefix = os.path.join(self.data_dir, "pairs")
        self.tokenizer_model = self.prefix + ".model"

    @staticmethod
    def build_chunks(*args, **kwargs):
        from megatron_po.pipeline.partition import build_nmt_chunks_for_rank
        return build_nmt_chunks_for_rank(*args, **kwargs)

    def prepare(self) -> None:
        from tools import preprocess_nmt
        if not os.path.isfile(self.prefix + ".json"):
            _run_tool(preprocess_nmt.main, [
                "--input", self.s.corpus, "--src-lang", "en", "--tgt-lang", "fr", "--doc-key", "ref",
                "--doc-regex", r"^(.+?) [0-9]+:[0-9]+$", "--valid-docs", *self.VALID_BOOKS,
                "--test-docs", *self.TEST_BOOKS, "--vocab-size", str(self.s.vocab_size),
                "--max-length", str(self.s.seq_length - 1), "--output-prefix", self.prefix, "--workers", "1"],
                "tools/preprocess_nmt.py")

    @functools.cached_property
    def tokenizer(self):
        from megatron_po.data.nmt_dataset import load_tokenizer
        return load_tokenizer(self.tokenizer_model)

    @property
    def padded_vocab(self) -> tuple[int, int]:
        from megatron_po.tensor_parallel import pad_vocab_size
        padded = pad_vocab_size(self.tokenizer.vocab_size, 128, 1)
        return padded, padded

    def config(self, seed: int):
        from megatron_po.config import Config, ModelConfig, normalize_nmt
        s = self.s
        cfg = Config()
        # Init std 1/sqrt(hidden) (Xavier's scale): Megatron's 0.02 suits hidden sizes in the thousands; on a
        # model this narrow it leaves cross-attention untrained for epochs (the decoder stays a language model).
        cfg.model = ModelConfig(num_layers=s.num_layers, hidden_size=s.hidden_size,
                                num_attention_heads=s.num_attention_heads, seq_length=s.seq_length,
                                hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                                init_method_std=s.hidden_size ** -0.5)
        cfg.nmt.encoder_num_layers, cfg.nmt.decoder_num_layers = s.num_layers // 2, s.num_layers - s.num_layers // 2
        cfg.nmt.decoder_seq_length, cfg.nmt.label_smoothing = s.seq_length, 0.0
        cfg.training.seed = seed
        cfg.training.micro_batch_size = s.micro_batch
        return normalize_nmt(cfg)

    def _corpus(self, split: str):
        from megatron_po.data.nmt_dataset import ParallelCorpus
        v = self.tokenizer.vocab_size
        return ParallelCorpus(self.prefix, split, "en", "fr", v, v)

    def _batches(self, split: str, shuffle: bool):
        from megatron_po.data.nmt_dataset import PairBatches
        t = self.tokenizer
        return PairBatches(self._corpus(split), bos=t.bos, eos=t.eos, pad=t.pad, max_src_length=self.s.seq_length,
                           max_tgt_length=self.s.seq_length, max_sentences=self.s.micro_batch, max_tokens=None,
                           seed=1234, shuffle=shuffle)

    def train_batch(self, seed: int):
        """mb -> micro-batch of B training pairs of one target length, in a seeded order (every method
        sees the same micro-batches in the same order; lengths with fewer than B pairs left over are
        skipped, epochs repeat with fresh orders)."""
        import numpy as np
        batches = self._batches("train", shuffle=True)
        lengths = batches.tgt_lengths
        epochs: list[list] = []

        def epoch(e: int) -> list:
            rng = np.random.RandomState(seed * 7919 + e)
            groups = []
            for length in np.unique(lengths):
                ids = rng.permutation(np.flatnonzero(lengths == length))
                groups += [ids[i:i + self.s.micro_batch] for i in range(0, len(ids) - self.s.micro_batch + 1,
                                                                         self.s.micro_batch)]
            return [groups[j] for j in rng.permutation(len(groups))]

        def get(mb: int) -> dict:
            while sum(map(len, epochs)) <= mb:
                epochs.append(epoch(len(epochs)))
            for e in epochs:
                if mb < len(e):
                    return batches.collate(e[mb])
                mb -= len(e)
        return get

    def valid_batches(self):
        """The first eval_batches x B validation pairs, B at a time (the pairs BLEU scores too)."""
        batches, B = self._batches("valid", shuffle=False), self.s.micro_batch
        n = min(self.s.eval_batches * B, len(batches.corpus)) // B
        return [batches.collate(range(j * B, (j + 1) * B)) for j in range(n)]

    @functools.cached_property
    def tokens_per_microbatch(self) -> float:
        """Real source + target tokens of an average training micro-batch."""
        batches = self._batches("train", shuffle=False)
        return float(batches.src_lengths.mean() + batches.tgt_lengths.mean()) * self.s.micro_batch

    def bleu(self, chunks) -> float:
        """sacrebleu BLEU of the greedy translations of the first `bleu_sentences` validation pairs, through
        every chunk of the emulated pipeline in one process (live weights, eval mode)."""
        from megatron_po.nmt_workload import corpus_scores
        from megatron_po.pipeline.decode import Stepper, translate_ids
        corpus, t = self._corpus("valid"), self.tokenizer
        n = len(self.valid_batches()) * self.s.micro_batch
        for c in chunks:
            c.eval()
        ids = translate_ids(Stepper(chunks), [corpus.src[i] for i in range(n)], bos=t.bos, eos=t.eos, pad=t.pad,
                            vocab_size=t.vocab_size, max_source_length=self.s.seq_length,
                            decoder_seq_length=self.s.seq_length, batch_sentences=32)
        for c in chunks:
            c.train()
        return corpus_scores([t.detokenize(ids[i]) for i in range(n)],
                             [t.detokenize(corpus.tgt[i]) for i in range(n)])["bleu"]

    def copy_source_bleu(self) -> float:
        """BLEU of the untranslated English sources against the same references (the floor)."""
        from megatron_po.nmt_workload import corpus_scores
        corpus, t = self._corpus("valid"), self.tokenizer
        n = len(self.valid_batches()) * self.s.micro_batch
        return corpus_scores([t.detokenize(corpus.src[i]) for i in range(n)],
                             [t.detokenize(corpus.tgt[i]) for i in range(n)])["bleu"]

    def unigram_baseline(self) -> float:
        """Validation loss of the training targets' add-one-smoothed token frequencies (EOS included)."""
        import numpy as np
        train = self._corpus("train")
        counts = np.bincount(np.asarray(train.tgt.tokens, dtype=np.int64), minlength=self.tokenizer.vocab_size)
        counts = counts.astype(np.float64) + 1.0
        counts[self.tokenizer.eos] += len(train)
        labels = np.concatenate([b["labels"][b["loss_mask"] > 0].numpy() for b in self.valid_batches()])
        return float(-np.log(counts[labels] / counts.sum()).mean())

    def describe(self) -> str:
        meta = json.load(open(self.prefix + ".json"))
        p = meta["pairs"]
        return (f"parallel corpus `{os.path.relpath(self.s.corpus, REPO)}` (English -> French): {p['train']:,} training "
                f"pairs, validation = the books {', '.join(self.VALID_BOOKS)} ({p['valid']} pairs), test = "
                f"{', '.join(self.TEST_BOOKS)}; joint sentencepiece BPE of {self.tokenizer.vocab_size} pieces "
                f"(tools/preprocess_nmt.py); B = {self.s.micro_batch} pairs of one target length per micro-batch")

    def describe_sample(self) -> str:
        return (f"{self.s.micro_batch} sentence pairs (on average {self.tokens_per_microbatch:,.0f} source + target "
                f"tokens)")

    def report_notes(self, summary: dict) -> str:
        n = len(self.valid_batches()) * self.s.micro_batch
        return (f"\n- BLEU: sacrebleu corpus BLEU of greedy translations (up to 2 x source + 10 tokens) of the {n} "
                f"validation pairs of the loss, after the last update, live weights. Copy-the-source baseline (the "
                f"untranslated English as the French output): BLEU {self.copy_source_bleu():.2f}. \"BLEU vs 1F1B\" "
                f"uses the verdict rule above (higher is better).")

    def describe_model(self, n_params: int | None) -> str:
        s = self.s
        return (f"encoder-decoder transformer, {s.num_layers // 2} encoder + {s.num_layers - s.num_layers // 2} "
                f"decoder layers (one stack of {s.num_layers} split over the stages), hidden {s.hidden_size}, "
                f"{s.num_attention_heads} heads, sentences up to {s.seq_length} tokens, init std "
                f"1/sqrt(hidden) = {s.hidden_size ** -0.5:.3f}, shared source/target embeddings")


WORKLOADS = {"gpt": GPTWorkload, "nmt": NMTWorkload}
assert tuple(WORKLOADS) == WORKLOAD_NAMES


def build_workload(s: Settings):
    return WORKLOADS[s.workload](s)
