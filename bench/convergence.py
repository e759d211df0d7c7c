"""Convergence of the pipeline methods at equal hyperparameters: loss, spread over seeds, throughput, memory.

    python bench/convergence.py                       # the full default run (~35 min on 2 shared cores)
    python bench/convergence.py --quick               # smoke run: tiny model, few steps, one seed
    python bench/convergence.py --depths 4 --optimizers adam --methods 1f1b pipedream pipeoptim --seeds 2

Trains the tiny GPT on the bundled World English Bible (examples/data/bible_web.en.jsonl.gz) with every
method of docs/ASYNC_PIPELINES.md -- GPipe, 1F1B, async-naive, PipeDream, PipeDream-2BW, SpecTrain (SGD
with momentum only) and PipeOptim -- at D = 4 and D = 8 pipeline stages, with Adam, AdamW and SGD with
momentum, several seeds each, and writes `<out>/convergence.md` (command, settings, tables, verdicts)
and `<out>/convergence.png` (loss curves, mean over seeds with a +-1 std band, one panel per (D, optimizer)).

How each method runs (single process, exact semantics; see the "fairness" section of the report):
- Asynchronous methods: `AsyncEmulator` (all D stages in one process, the op lists and per-op code of
  the distributed run), k = 1 (one update per micro-batch of B samples, as published), except
  PipeDream-2BW, which needs k >= D and runs with k = D: its updates average D micro-batches.
- GPipe and 1F1B: both apply W <- W - lr*U(mean gradient over one batch of B samples at W), the update
  of the unpipelined model, so one unpipelined run per (optimizer, seed) gives the convergence of both
  at every D (the same emulator code with D = 1, where no method has staleness). A start-up check runs
  the real GPipe and 1F1B op lists (`emulate` + `StageRunner`, M = D micro-batches of B/D samples, one
  flush and one step per batch, the semantics of `synchronous_forward_backward`) for a few updates and
  reports their loss difference to that reference.
- Throughput: the emulator runs stages one after another, so tokens/s is *simulated*. One calibration
  process per (D, optimizer) trains every method in turn (interleaved, so load from other processes hits
  them alike) and times each op and the weight-policy hooks inside it; a stage's op cost = a base shared
  by all methods (10th percentile of op time minus hook time) + the method's hook time (median). These
  costs go to `megatron_po.pipeline.simulator.simulate` with each method's schedule (async: the steady
  state of the no-flush stream; sync: one flush of M = D micro-batches plus the step), free communication.

Beyond the paper: the methods also include PREDICTOR_VARIANTS, PipeOptim with other weight predictors
(megatron_po/optim/predictors.py) and PipeOptim / PipeDream with gradient-side corrections (delay
compensation, staleness-aware lr scaling), each a column of its own; they get their own table (gap to
1F1B, fraction of PipeOptim's gap closed, throughput vs PipeOptim), the D = 4 "moonshot" verdict and
`<out>/predictors.png`.

Runs are independent jobs spread over `--jobs` worker processes (one torch thread each); each run's
result is kept in `<out>/.cache/runs/` so `--resume` continues an interrupted benchmark. The tokenizer,
the preprocessed corpus and the dataset indices are built once into `<out>/.cache/data/`.

`--workload nmt` runs the same comparison on the encoder-decoder translation model (pretrain_nmt.py's
model) and the bundled English-French Bible, by default with Adam at D = 4, and adds the greedy-decoding
validation BLEU of every run to the table (`NMTWorkload`):

    python bench/convergence.py --workload nmt --out bench/results/nmt
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SYNC_METHODS = ("gpipe", "1f1b")
ASYNC_METHODS = ("async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim")
# Beyond the paper (README "Beyond the paper: weight predictors"): asynchronous variants, each a base
# method run with weight-policy options (megatron_po/optim/predictors.py, pipeline/policies.py). Settings
# are fixed by stated rules, never tuned per run: DC's λ = "tokens" = the tokens of one micro-batch (for a
# mean loss over N tokens whose per-token gradients are noise-dominated, the Fisher diagonal, i.e. the
# curvature DC-ASGD approximates by g⊙g, is about N·E[g⊙g] of the micro-batch gradient g).
PREDICTOR_VARIANTS = {
    "po-lr-schedule": ("pipeoptim", {"weight_predictor": "lr-schedule"}),
    "po-rollout": ("pipeoptim", {"weight_predictor": "rollout", "include_weight_decay": True}),
    "po-rollout-zero-mean": ("pipeoptim", {"weight_predictor": "rollout", "rollout_gradient": "zero-mean"}),
    "po-sqrt-horizon": ("pipeoptim", {"prediction_horizon": "sqrt"}),
    "po-dc": ("pipeoptim", {"delay_compensation": "tokens"}),
    "po-stale-lr": ("pipeoptim", {"staleness_lr_scaling": "inverse"}),
    "pipedream-dc": ("pipedream", {"delay_compensation": "tokens"}),
    "pipedream-stale-lr": ("pipedream", {"staleness_lr_scaling": "inverse"}),
}
ALL_METHODS = SYNC_METHODS + ASYNC_METHODS + tuple(PREDICTOR_VARIANTS)
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "async-naive": "async-naive", "pipedream": "PipeDream",
          "pipedream-2bw": "PipeDream-2BW", "spectrain": "SpecTrain", "pipeoptim": "PipeOptim", "sync": "GPipe/1F1B"}
LABELS.update({"po-lr-schedule": "PO lr-schedule", "po-rollout": "PO rollout (first moment, +decay)",
               "po-rollout-zero-mean": "PO rollout (zero-mean)", "po-sqrt-horizon": "PO sqrt horizon",
               "po-dc": "PO + delay comp.", "po-stale-lr": "PO + lr/(1+s)", "pipedream-dc": "PipeDream + delay comp.",
               "pipedream-stale-lr": "PipeDream + lr/(1+s)"})
COLORS = {"sync": "black", "async-naive": "tab:gray", "pipedream": "tab:blue", "pipedream-2bw": "tab:green",
          "spectrain": "tab:purple", "pipeoptim": "tab:red"}
VARIANT_COLORS = {"po-lr-schedule": "tab:orange", "po-rollout": "tab:brown", "po-rollout-zero-mean": "tab:pink",
                  "po-sqrt-horizon": "tab:olive", "po-dc": "tab:cyan", "po-stale-lr": "gold",
                  "pipedream-dc": "navy", "pipedream-stale-lr": "tab:green"}
OPTIMIZERS = ("adam", "adamw", "sgd", "muon")
MUON_NOTE = ("\n- Muon (optim/muon.py): hidden weight matrices by momentum 0.95 (Nesterov) + 5 Newton-Schulz steps, "
             "update scale 0.2·sqrt(max(rows, cols)) (AdamW's lr and decoupled weight decay carry over); embeddings, "
             "output layer, norms and biases by AdamW.")
OPT_LABELS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD-momentum", "muon": "Muon"}
CORPUS = os.path.join(REPO, "examples", "data", "bible_web.en.jsonl.gz")

# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    depths: list = field(default_factory=lambda: [4, 8])
    optimizers: list = field(default_factory=lambda: ["adam", "adamw", "sgd"])
    methods: list = field(default_factory=lambda: list(ALL_METHODS))
    seeds: int = 3
    steps: int = 256  # micro-batches of B samples streamed per run (= updates at k = 1)
    out: str = os.path.join(REPO, "bench", "results")
    workload: str = "gpt"
    jobs: int = 2
    resume: bool = False
    # model and data
    num_layers: int = 8
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    micro_batch: int = 8  # B
    vocab_size: int = 1024  # sentencepiece BPE trained on the corpus
    corpus: str = CORPUS
    split: str = "969,30,1"
    cache_dir: str | None = None  # default <out>/.cache
    # optimisation, identical for every method
    lr: dict = field(default_factory=lambda: {"adam": 1e-3, "adamw": 1e-3, "sgd": 0.1, "muon": 1e-3})
    min_lr_ratio: float = 0.1
    warmup: int = 16  # micro-batches
    weight_decay: float = 0.01
    sgd_momentum: float = 0.9
    clip_grad: float = 0.0
    # measurement
    eval_interval: int = 64  # micro-batches between evaluations (the async pipeline drains there)
    eval_batches: int = 12  # validation micro-batches of B samples (fixed set, same for every run)
    tail: int = 32  # final train loss = mean over the last `tail` micro-batch losses
    check_updates: int = 8  # synchronous pipelined GPipe/1F1B updates run by the start-up check
    timing_rounds: int = 2  # interleaved rounds of 2D micro-batches per method for the op costs
    command: str = ""

    def cache(self) -> str:
        return self.cache_dir or os.path.join(self.out, ".cache")


NMT_CORPUS = os.path.join(REPO, "examples", "data", "bible_web_lsg1910.en-fr.jsonl.gz")


def nmt_settings(s: Settings) -> Settings:
    """`--workload nmt` defaults: the paper's methods with Adam at D = 4 on the translation model and the
    English-French pairs; B pairs per micro-batch, validation loss and BLEU on 288 held-out verses."""
    return dataclasses.replace(s, workload="nmt", corpus=NMT_CORPUS, depths=[4], optimizers=["adam"],
                               methods=list(SYNC_METHODS + ASYNC_METHODS), num_layers=8,
                               hidden_size=64, num_attention_heads=4, seq_length=128, micro_batch=16,
                               vocab_size=2000, steps=2048, warmup=64, eval_interval=512, eval_batches=18, tail=128)


def quick_settings(s: Settings) -> Settings:
    """Tiny settings for a smoke run (a minute or two)."""
    return dataclasses.replace(s, hidden_size=32, num_attention_heads=2, seq_length=32, micro_batch=8, steps=32,
                               warmup=4, eval_interval=16, eval_batches=2, tail=8, check_updates=2,
                               vocab_size=512)


def validate(s: Settings) -> None:
    bad = [m for m in s.methods if m not in ALL_METHODS]
    if bad:
        raise SystemExit(f"error: unknown method(s) {bad}; valid: {', '.join(ALL_METHODS)}")
    bad = [o for o in s.optimizers if o not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"error: unknown optimizer(s) {bad}; valid: {', '.join(OPTIMIZERS)}")
    if s.workload not in WORKLOADS:
        raise SystemExit(f"error: unknown workload {s.workload!r}; valid: {', '.join(WORKLOADS)}")
    lcm = math.lcm(*s.depths)
    if any(d < 2 for d in s.depths) or s.num_layers % lcm:
        raise SystemExit(f"error: depths {s.depths} must be >= 2 and divide --num-layers {s.num_layers}")
    # 2BW steps every D micro-batches and segments end at evaluations: both must split into whole steps.
    if s.eval_interval % lcm or s.steps % s.eval_interval:
        raise SystemExit(f"error: --eval-interval {s.eval_interval} must be a multiple of every depth {s.depths} "
                         f"and divide --steps {s.steps}")
    if any(s.micro_batch % d for d in s.depths):
        raise SystemExit(f"error: the micro-batch B={s.micro_batch} must split into D micro-batches for GPipe/1F1B "
                         f"at every depth {s.depths}")
    if s.seeds < 1 or s.tail < 1 or s.tail > s.steps:
        raise SystemExit("error: need --seeds >= 1 and 1 <= tail <= steps")


# --------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------


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
        # Modulo the length, as training.microbatches does (the calibration may stream past `steps`).
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


def build_workload(s: Settings):
    return WORKLOADS[s.workload](s)


# --------------------------------------------------------------------------------------------------
# Jobs (run in worker processes)
# --------------------------------------------------------------------------------------------------


def _training_config(s: Settings, optimizer: str):
    from megatron_po.config import TrainingConfig
    lr = s.lr[optimizer]
    return TrainingConfig(lr=lr, min_lr=lr * s.min_lr_ratio, lr_decay_style="cosine", lr_warmup_iters=s.warmup,
                          train_iters=s.steps, weight_decay=s.weight_decay, sgd_momentum=s.sgd_momentum)


def _optimizer_kwargs(s: Settings, optimizer: str) -> dict:
    return {"lr": s.lr[optimizer], "weight_decay": s.weight_decay, "sgd_momentum": s.sgd_momentum}


def method_spec(method: str, wl) -> tuple[str, dict]:
    """(base asynchronous method, weight-policy options) of a method or predictor variant."""
    base, options = PREDICTOR_VARIANTS.get(method, (method, {}))
    return base, {k: (wl.tokens_per_microbatch if v == "tokens" else v) for k, v in options.items()}


def _op_costs(times: dict) -> dict:
    """{(rank, kind): [seconds]} -> {"rank": {kind: seconds}} (string keys, as after a JSON round trip).

    The cost of an op is the 10th percentile of its measured times: the machine is shared, and the
    least-disturbed executions estimate the op's own cost far more stably than the median does."""
    out: dict = defaultdict(dict)
    for (rank, kind), values in times.items():
        out[str(rank)][kind] = _percentile10(values)
    return {r: out[r] for r in sorted(out, key=int)}


HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward", "before_step", "after_step")


def _time_runners(emulator, times: dict) -> None:
    """Record, per (rank, op kind), the wall time of every training op and (kind + "Hooks") the part of
    it spent in the weight policy's hooks (prediction, stashing, swaps, 2BW's version copy)."""
    for stage in emulator.stages:
        in_hooks = [0.0]
        for name in HOOKS:
            setattr(stage.policy, name, _timed_hook(getattr(stage.policy, name), in_hooks))
        make_runner = stage.runner

        def runner(*args, _make=make_runner, _rank=stage.rank, _hooks=in_hooks, **kwargs):
            r = _make(*args, **kwargs)
            r.run = _timed(r.run, _rank, times, _hooks)
            return r
        stage.runner = runner


def _timed_hook(hook, in_hooks: list):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = hook(*args, **kwargs)
        in_hooks[0] += time.perf_counter() - t0
        return out
    return timed


def _timed(run, rank: int, times: dict, in_hooks: list | None = None):
    def timed(op, *args, **kwargs):
        if in_hooks is not None:
            in_hooks[0] = 0.0
        t0 = time.perf_counter()
        run(op, *args, **kwargs)
        kind = type(op).__name__
        times[(rank, kind)].append(time.perf_counter() - t0)
        if in_hooks is not None:
            times[(rank, kind + "Hooks")].append(in_hooks[0])
    return timed


def _async_op_costs(times: dict[str, dict], D: int) -> dict[str, dict]:
    """Per asynchronous method: {"rank": {kind: cost}} = the shared base cost of the op (10th percentile
    of op time minus hook time, pooled over every method: the same model code runs in all of them) plus
    the method's own hook cost (median: the typical policy work per op). Noise in the base then cannot
    separate the methods; only their weight-policy work and their schedules do."""
    base = {}
    for r in range(D):
        for kind in ("Forward", "Backward", "Step"):
            pooled = [total - hooks for m in times for total, hooks in
                      zip(times[m][(r, kind)], times[m][(r, kind + "Hooks")])]
            base[(r, kind)] = _percentile10(pooled)
    return {m: {str(r): {kind: base[(r, kind)] + _median(times[m][(r, kind + "Hooks")])
                         for kind in ("Forward", "Backward", "Step")} for r in range(D)} for m in times}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _percentile10(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.1 * (len(values) - 1))] if values else 0.0


def train_job(s: Settings, D: int, optimizer: str, method: str, seed: int) -> dict:
    """One training run. method "sync" = the unpipelined reference (GPipe and 1F1B updates), D ignored."""
    import torch
    from megatron_po.optim.lr_scheduler import lr_at
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    wl = build_workload(s)
    get_batch, valid = wl.train_batch(seed), wl.valid_batches()
    t = _training_config(s, optimizer)
    sync = method == "sync"
    stages = 1 if sync else D
    base, options = method_spec(method, wl)
    k = D if base == "pipedream-2bw" else 1
    # The LR schedule runs on the micro-batch clock: step i of a chunk that steps every k micro-batches
    # uses the lr of micro-batch i*k, so warm-up and decay span the same samples for every method.
    lr_fn = lambda step: lr_at(step * k, t)  # noqa: E731
    model_parallel_seed(seed)
    emu = AsyncEmulator(wl.config(seed), wl.padded_vocab, "async-naive" if sync else base, stages, 1, k, optimizer,
                        _optimizer_kwargs(s, optimizer), lr_fn, s.clip_grad, build_chunks=wl.build_chunks, **options)
    losses, val = [], []
    for end in range(s.eval_interval, s.steps + 1, s.eval_interval):
        losses += emu.train_segment(get_batch, end - emu.microbatches_consumed)
        val.append((end, emu.evaluate(valid)))
        if not all(math.isfinite(x) for x in losses[-s.eval_interval:]) or not math.isfinite(val[-1][1]):
            break  # diverged: keep what we have, the report shows it
    copies = emu.copies_per_chunk()
    bleu = wl.bleu(emu.chunks) if hasattr(wl, "bleu") else None  # NMT: greedy BLEU after the last update
    return {"kind": "train", "D": D, "optimizer": optimizer, "method": method, "seed": seed, "losses": losses,
            "val": val, "copies": [copies[(r, 0)] for r in range(stages)],
            "steps_taken": [emu.steps_taken()[(r, 0)] for r in range(stages)], "update_interval": k,
            "seconds": time.perf_counter() - t_start, "bleu": bleu}


class SyncPipeline:
    """GPipe or 1F1B through its real op list: each update runs M = D micro-batches of B/D samples
    (`emulate` + `StageRunner`, gradients accumulated over the flush), clips by the global norm and steps
    every stage: the semantics of `synchronous_forward_backward` + `training.train_step`."""

    def __init__(self, s: Settings, wl, name: str, D: int, optimizer: str, seed: int, lr_fn, times: dict):
        from megatron_po.optim import build_optimizer
        from megatron_po.optim.muon import optimizer_param_groups
        from megatron_po.pipeline.schedules import build_schedule
        from megatron_po.tensor_parallel import model_parallel_seed
        model_parallel_seed(seed)
        cfg = wl.config(seed)
        self.s, self.D, self.M, self.lr_fn, self.times = s, D, D, lr_fn, times
        self.chunks = [wl.build_chunks(cfg, wl.padded_vocab, r, D, 1)[0] for r in range(D)]
        kw = _optimizer_kwargs(s, optimizer)
        kw.pop("lr")
        wd = kw.pop("weight_decay")
        self.opts = [build_optimizer(optimizer, optimizer_param_groups(optimizer, [c], wd), lr_fn(0), weight_decay=wd, **kw)
                     for c in self.chunks]
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.schedule = build_schedule(name, D, 1, self.M)
        self.updates = 0

    def step(self, batch: dict) -> float:
        import torch
        from megatron_po.optim.clip_grads import clip_grad_norm_
        from megatron_po.optim.lr_scheduler import set_lr
        from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate
        D, M = self.D, self.M
        micro = [{key: v.chunk(M)[i] for key, v in batch.items()} for i in range(M)]
        mailbox = Mailbox()
        runners = {r: StageRunner(rank=r, num_stages=D, chunks=[self.chunks[r]], transport=mailbox,
                                  get_batch=micro.__getitem__, loss_scale=1.0 / M) for r in range(D)}
        for r, runner in runners.items():
            runner.run = _timed(runner.run, r, self.times)
        emulate(self.schedule, runners)
        loss = torch.stack([runners[D - 1].losses[i] for i in range(M)]).mean().item()
        clip_grad_norm_(self.params, self.s.clip_grad)  # the global norm (no-op with clip_grad 0)
        for r, (c, opt) in enumerate(zip(self.chunks, self.opts)):
            t0 = time.perf_counter()
            set_lr(opt, self.lr_fn(self.updates))
            opt.step()
            for p in c.parameters():
                p.grad = None
            self.times[(r, "Step")].append(time.perf_counter() - t0)
        self.updates += 1
        return loss


def calibrate_job(s: Settings, D: int, optimizer: str, seed: int = 1) -> dict:
    """Per (D, optimizer), in one process:

    1. check: GPipe and 1F1B through their real op lists (`SyncPipeline`) against the unpipelined
       reference on the same `check_updates` batches (per-update loss difference);
    2. op costs for the throughput simulation: every selected method (the two synchronous pipelines just
       checked and one `AsyncEmulator` per asynchronous method) trains in turn, segment by segment
       (2D micro-batches of B samples each, after an untimed warm-up segment of D), for `timing_rounds`
       rounds, so that load from other processes hits all methods alike. Asynchronous op costs = a base
       shared by all methods + each method's own weight-policy hook time (`_async_op_costs`); GPipe and
       1F1B pool their op times (the same ops in another order).
    """
    import torch
    from megatron_po.optim.lr_scheduler import lr_at
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed

    torch.set_num_threads(1)
    wl = build_workload(s)
    get_batch = wl.train_batch(seed)
    t = _training_config(s, optimizer)
    n = s.check_updates
    model_parallel_seed(seed)
    ref = AsyncEmulator(wl.config(seed), wl.padded_vocab, "async-naive", 1, 1, 1, optimizer,
                        _optimizer_kwargs(s, optimizer), lambda step: lr_at(step, t), s.clip_grad,
                        build_chunks=wl.build_chunks)
    ref_losses = ref.train_segment(get_batch, n)
    out = {"kind": "calibrate", "D": D, "optimizer": optimizer, "seed": seed, "ref_losses": ref_losses,
           "check": {}, "op_times": {}, "update_interval": {}}
    times: dict = {}
    sync_times: dict = defaultdict(list)  # GPipe and 1F1B run the same ops in another order: costs pooled
    sync = {}
    for name in SYNC_METHODS:
        times[name] = sync_times
        sync[name] = SyncPipeline(s, wl, name, D, optimizer, seed, lambda step: lr_at(step, t), sync_times)
        losses = [sync[name].step(get_batch(u)) for u in range(n)]
        out["check"][name] = {"losses": losses, "max_abs_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                              "M": sync[name].M}
    emulators = {}
    for m in ASYNC_METHODS + tuple(PREDICTOR_VARIANTS):
        if m not in s.methods or (m == "spectrain" and optimizer != "sgd"):
            continue
        base, options = method_spec(m, wl)
        k = D if base == "pipedream-2bw" else 1
        model_parallel_seed(seed)
        emulators[m] = AsyncEmulator(wl.config(seed), wl.padded_vocab, base, D, 1, k, optimizer,
                                     _optimizer_kwargs(s, optimizer), lambda step, k=k: lr_at(step * k, t),
                                     s.clip_grad, build_chunks=wl.build_chunks, **options)
        times[m] = defaultdict(list)
        _time_runners(emulators[m], times[m])
        out["update_interval"][m] = k
    timed = [m for m in SYNC_METHODS if m in s.methods] + list(emulators)
    for round_ in range(s.timing_rounds + 1):
        length = D if round_ == 0 else 2 * D  # round 0: warm-up (first-call costs), not kept
        for m in timed:
            if m in sync:
                for _ in range(length):
                    sync[m].step(get_batch(sync[m].updates))
            else:
                emulators[m].train_segment(get_batch, length)
            if round_ == 0:
                times[m].clear()  # (the synchronous pair shares one dict: cleared after each warm-up)
    out["op_times"] = _async_op_costs({m: times[m] for m in emulators}, D)
    for m in SYNC_METHODS:
        if m in timed:
            out["op_times"][m] = _op_costs(sync_times)
    out["hook_ms"] = {m: {str(r): {kind: 1e3 * _median(times[m][(r, kind + "Hooks")])
                                   for kind in ("Forward", "Backward", "Step")} for r in range(D)}
                      for m in emulators}
    return out


def _job_key(s: Settings, job: tuple) -> str:
    relevant = {k: v for k, v in dataclasses.asdict(s).items()
                if k not in ("depths", "optimizers", "methods", "seeds", "out", "jobs", "resume", "command",
                             "cache_dir")}
    # The corpus by its path inside the checkout, so a cache carries over between clones and worktrees.
    if os.path.abspath(relevant["corpus"]).startswith(REPO + os.sep):
        relevant["corpus"] = os.path.relpath(os.path.abspath(relevant["corpus"]), REPO)
    variants = [m for m in s.methods if m in PREDICTOR_VARIANTS]
    if job[0] == "calibrate" and variants:  # it also times the variants: not the same job as without them
        return hashlib.md5(json.dumps([relevant, list(job), variants], sort_keys=True).encode()).hexdigest()[:16]
    return hashlib.md5(json.dumps([relevant, list(job)], sort_keys=True).encode()).hexdigest()[:16]


def _run_job(args) -> dict:
    s, job, path = args
    if job[0] == "calibrate":
        result = calibrate_job(s, *job[1:])
    else:
        result = train_job(s, *job[1:])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    return result


def plan_jobs(s: Settings) -> list[tuple]:
    """("calibrate", D, optimizer) and ("train", D, optimizer, method, seed); the synchronous reference
    is one run per (optimizer, seed) (D = 0), shared by GPipe and 1F1B at every D."""
    sync = any(m in SYNC_METHODS for m in s.methods)
    jobs = [("calibrate", D, o) for D in sorted(s.depths, reverse=True) for o in s.optimizers]
    # Longest first (deep pipelines, many weight copies) so the pool ends evenly.
    order = ["pipedream", "pipedream-dc", "pipedream-stale-lr", "spectrain", "pipeoptim", "po-dc",
             *[m for m in PREDICTOR_VARIANTS if m.startswith("po-") and m != "po-dc"], "pipedream-2bw", "async-naive"]
    for seed in range(1, s.seeds + 1):
        for D in sorted(s.depths, reverse=True):
            for m in order:
                if m not in s.methods:
                    continue
                for o in s.optimizers:
                    if m == "spectrain" and o != "sgd":
                        continue  # SpecTrain predicts from the momentum buffer: SGD-momentum only
                    jobs.append(("train", D, o, m, seed))
        if sync:
            jobs += [("train", 0, o, "sync", seed) for o in s.optimizers]
    return jobs


def _print(*args) -> None:
    print(*args, flush=True)


def run_jobs(s: Settings, jobs: list[tuple], log=_print) -> tuple[list[dict], int]:
    runs_dir = os.path.join(s.cache(), "runs")
    results, todo = [], []
    for job in jobs:
        path = os.path.join(runs_dir, f"{_job_key(s, job)}.json")
        if s.resume and os.path.isfile(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            todo.append((s, job, path))
    reused = len(results)
    if reused:
        log(f"> resumed {reused} finished run(s) from {runs_dir}")
    start = time.perf_counter()
    if s.jobs <= 1:
        iterator = map(_run_job, todo)
        pool = None
    else:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(s.jobs)
        iterator = pool.imap_unordered(_run_job, todo)
    try:
        for i, r in enumerate(iterator, start=1):
            results.append(r)
            elapsed = time.perf_counter() - start
            eta = elapsed / i * (len(todo) - i)
            if r["kind"] == "calibrate":
                what = (f"calibration D={r['D']} {r['optimizer']}: GPipe/1F1B vs unpipelined max |dloss| "
                        f"{r['check']['gpipe']['max_abs_diff']:.1e}/{r['check']['1f1b']['max_abs_diff']:.1e}, "
                        f"op costs of {len(r['op_times'])} methods")
            else:
                depth = "sync" if r["method"] == "sync" else f"D={r['D']}"
                last = r["val"][-1][1] if r["val"] else float("nan")
                what = (f"{depth} {r['optimizer']} {LABELS[r['method']]} seed {r['seed']}: val {last:.4f} "
                        f"({r['seconds']:.0f} s)")
            log(f"[{i}/{len(todo)}] {what} | elapsed {elapsed / 60:.1f} min, eta {eta / 60:.1f} min")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return results, reused


# --------------------------------------------------------------------------------------------------
# Throughput from measured op costs
# --------------------------------------------------------------------------------------------------


def _stage_costs(op_times: dict, D: int, k: int = 1):
    """Per-stage forward and backward cost lists; a stage's step cost is folded into its backwards
    (1/k of it per backward, as the stage steps after every k)."""
    t_f = [op_times[str(r)]["Forward"] for r in range(D)]
    t_b = [op_times[str(r)]["Backward"] + op_times[str(r)].get("Step", 0.0) / k for r in range(D)]
    return t_f, t_b


def async_tokens_per_s(op_times: dict, D: int, k: int, tokens_per_mb: int) -> float:
    """Steady state of the no-flush stream: (N2 - N1) micro-batches over T(N2) - T(N1), fill and drain cancel."""
    from megatron_po.pipeline.schedules import async_one_f_one_b
    from megatron_po.pipeline.simulator import simulate
    t_f, t_b = _stage_costs(op_times, D, k)
    n1, n2 = 4 * D * k, 8 * D * k
    t1 = simulate(async_one_f_one_b(D, 1, n1, k), t_f, t_b).makespan
    t2 = simulate(async_one_f_one_b(D, 1, n2, k), t_f, t_b).makespan
    return (n2 - n1) * tokens_per_mb / (t2 - t1)


def sync_tokens_per_s(method: str, op_times: dict, D: int, M: int, tokens_per_batch: int) -> float:
    """One batch = one flush of M micro-batches, then every stage steps (in parallel)."""
    from megatron_po.pipeline.schedules import build_schedule
    from megatron_po.pipeline.simulator import simulate
    t_f = [op_times[str(r)]["Forward"] for r in range(D)]
    t_b = [op_times[str(r)]["Backward"] for r in range(D)]
    makespan = simulate(build_schedule(method, D, 1, M), t_f, t_b).makespan
    return tokens_per_batch / (makespan + max(op_times[str(r)]["Step"] for r in range(D)))


# --------------------------------------------------------------------------------------------------
# Statistics, tables, plot
# --------------------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(mean: float, std: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "diverged" if mean != mean else f"{mean}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def compare(a: tuple[float, float], b: tuple[float, float], n: int) -> str:
    """Verdict on mean a vs mean b (lower is better): a difference is real only when it exceeds the
    spread, i.e. when the mean ± std intervals do not overlap (|Δ| > std_a + std_b)."""
    (ma, sa), (mb, sb) = a, b
    if not (math.isfinite(ma) and math.isfinite(mb)):
        return "n/a"
    if n < 2:
        return "one seed: no spread"
    if abs(ma - mb) <= sa + sb:
        return "within spread"
    return "better (real)" if ma < mb else "worse (real)"


def _final_train(r: dict, tail: int) -> float | None:
    losses = r["losses"]
    if len(losses) < tail:
        return float("nan")
    return statistics.fmean(losses[-tail:])


def _final_val(r: dict, steps: int) -> float:
    if not r["val"] or r["val"][-1][0] != steps:
        return float("nan")
    return r["val"][-1][1]


def summarize(s: Settings, results: list[dict], tokens_per_mb: int) -> dict:
    """Rows of the main table, keyed (D, optimizer, method), with per-seed values for paired comparisons."""
    train = defaultdict(dict)  # (D, opt, method) -> {seed: result}
    calib = {}
    for r in results:
        if r["kind"] == "calibrate":
            calib[(r["D"], r["optimizer"])] = r
        else:
            train[(r["D"], r["optimizer"], r["method"])][r["seed"]] = r
    rows = {}
    for D in s.depths:
        for o in s.optimizers:
            for m in ALL_METHODS:
                if m not in s.methods or (m == "spectrain" and o != "sgd"):
                    continue
                runs = train.get((0, o, "sync") if m in SYNC_METHODS else (D, o, m), {})
                if not runs:
                    continue
                seeds = sorted(runs)
                row = {"D": D, "optimizer": o, "method": m, "seeds": seeds,
                       "train": {sd: _final_train(runs[sd], s.tail) for sd in seeds},
                       "val": {sd: _final_val(runs[sd], s.steps) for sd in seeds}}
                if m in SYNC_METHODS:
                    row["copies"] = [1] * D
                    row["updates"] = s.steps
                    row["samples_per_update"] = f"{s.micro_batch} ({D}x{s.micro_batch // D})"
                    c = calib.get((D, o))
                    row["tokens_per_s"] = (sync_tokens_per_s(m, c["op_times"][m], D, c["check"][m]["M"],
                                                             tokens_per_mb) if c else float("nan"))
                    row["check_diff"] = c["check"][m]["max_abs_diff"] if c else None
                else:
                    any_run = runs[seeds[0]]
                    k = any_run["update_interval"]
                    row["copies"] = [max(runs[sd]["copies"][r] for sd in seeds) for r in range(D)]
                    row["updates"] = any_run["steps_taken"][0]
                    row["samples_per_update"] = f"{k * s.micro_batch}" + (f" ({k}x{s.micro_batch})" if k > 1 else "")
                    c = calib.get((D, o))
                    row["tokens_per_s"] = (async_tokens_per_s(c["op_times"][m], D, k, tokens_per_mb)
                                           if c and m in c["op_times"] else float("nan"))
                row["train_ms"] = mean_std(list(row["train"].values()))
                row["val_ms"] = mean_std(list(row["val"].values()))
                row["bleu"] = {sd: runs[sd].get("bleu") for sd in seeds}  # NMT only (None for GPT)
                row["bleu_ms"] = mean_std(list(row["bleu"].values()))
                rows[(D, o, m)] = row
    return {"rows": rows, "calibrations": calib, "train": train}


def _copies_str(copies: list[int]) -> str:
    return f"{max(copies)} (" + "/".join(str(c) for c in copies) + ")"


def main_table(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["D", "optimizer", "method", "updates", "samples/update", "final train loss", "final val loss",
              "val gap to 1F1B", "tokens/s (sim.)", "weight copies/stage: max (r0/…/rD-1)", "val vs 1F1B"]
    out, keys = [], []
    for (D, o, m), row in summary["rows"].items():
        if m in PREDICTOR_VARIANTS:
            continue  # their own table: predictor_table
        keys.append((D, o, m))
        ref = summary["rows"].get((D, o, "1f1b")) or summary["rows"].get((D, o, "gpipe"))
        if ref is not None and m not in SYNC_METHODS:
            gap = (row["val_ms"][0] - ref["val_ms"][0]) / ref["val_ms"][0] * 100
            gap_s = f"{gap:+.2f}%"
            verdict = compare(row["val_ms"], ref["val_ms"], len(row["seeds"]))
        else:
            gap_s, verdict = ("0 (reference)" if m in SYNC_METHODS else "–"), "–"
        out.append([str(D), OPT_LABELS[o], LABELS[m], str(row["updates"]), row["samples_per_update"],
                    fmt(*row["train_ms"]), fmt(*row["val_ms"]), gap_s, f"{row['tokens_per_s']:,.0f}",
                    _copies_str(row["copies"]), verdict])
    if s.workload == "nmt":  # translation quality beside the loss
        header = header + ["final val BLEU (greedy)", "BLEU vs 1F1B"]
        for r, key in zip(out, keys):
            row, ref = summary["rows"][key], summary["rows"].get(key[:2] + ("1f1b",))
            versus = "–" if ref is None or key[2] in SYNC_METHODS else compare(
                tuple(-x if i == 0 else x for i, x in enumerate(row["bleu_ms"])),
                tuple(-x if i == 0 else x for i, x in enumerate(ref["bleu_ms"])), len(row["seeds"]))
            r += [fmt(*row["bleu_ms"], digits=2), versus]
    return header, out


def head_to_head(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    """PipeOptim against every other asynchronous method on final validation loss."""
    header = ["D", "optimizer", "PipeOptim vs", "Δ val (PipeOptim − other)", "spread (std PO + std other)",
              "paired: seeds where PipeOptim is lower", "verdict"]
    out = []
    rows = summary["rows"]
    for D in s.depths:
        for o in s.optimizers:
            po = rows.get((D, o, "pipeoptim"))
            if po is None:
                continue
            for m in ("pipedream", "pipedream-2bw", "spectrain", "async-naive"):
                other = rows.get((D, o, m))
                if other is None:
                    continue
                delta = po["val_ms"][0] - other["val_ms"][0]
                spread = po["val_ms"][1] + other["val_ms"][1]
                common = [sd for sd in po["seeds"] if sd in other["seeds"]]
                wins = sum(1 for sd in common if po["val"][sd] < other["val"][sd])
                verdict = compare(po["val_ms"], other["val_ms"], len(common))
                verdict = {"better (real)": "PipeOptim better (real)", "worse (real)": "PipeOptim worse (real)"}.get(
                    verdict, verdict)
                out.append([str(D), OPT_LABELS[o], LABELS[m], f"{delta:+.4f}", f"{spread:.4f}",
                            f"{wins}/{len(common)}", verdict])
    return header, out


def gap_closed(variant: dict, pipeoptim: dict, sync: dict) -> float | None:
    """Fraction of PipeOptim's gap to synchronous training (final val loss, means over seeds) that the
    variant closes: 1 = reaches synchronous, 0 = PipeOptim's loss, < 0 = worse than PipeOptim. None when
    PipeOptim has no real gap to close (its mean ± std overlaps the synchronous one)."""
    if compare(pipeoptim["val_ms"], sync["val_ms"], len(pipeoptim["seeds"])) != "worse (real)":
        return None
    po_gap = pipeoptim["val_ms"][0] - sync["val_ms"][0]
    return (po_gap - (variant["val_ms"][0] - sync["val_ms"][0])) / po_gap


def predictor_table(s: Settings, summary: dict) -> tuple[list[str], list[list[str]]]:
    """PipeOptim and each predictor / gradient-side variant against synchronous 1F1B and PipeOptim."""
    header = ["D", "optimizer", "method", "final val loss", "gap to 1F1B", "fraction of PipeOptim's gap closed",
              "vs PipeOptim", "paired: seeds below PipeOptim", "tokens/s vs PipeOptim (sim.)", "weight copies/stage"]
    rows, out = summary["rows"], []
    for D in s.depths:
        for o in s.optimizers:
            po, sync = rows.get((D, o, "pipeoptim")), rows.get((D, o, "1f1b")) or rows.get((D, o, "gpipe"))
            if po is None or sync is None:
                continue
            for m in ("pipeoptim", "pipedream", *PREDICTOR_VARIANTS):
                row = rows.get((D, o, m))
                if row is None:
                    continue
                gap = (row["val_ms"][0] - sync["val_ms"][0]) / sync["val_ms"][0] * 100
                if m == "pipeoptim":
                    closed, verdict, paired, speed = "0 (reference)", "–", "–", "1.00"
                else:
                    f = gap_closed(row, po, sync)
                    closed = "n/a (no real PipeOptim gap)" if f is None else f"{f:+.0%}"
                    verdict = compare(row["val_ms"], po["val_ms"], min(len(row["seeds"]), len(po["seeds"])))
                    common = [sd for sd in row["seeds"] if sd in po["seeds"]]
                    paired = f"{sum(1 for sd in common if row['val'][sd] < po['val'][sd])}/{len(common)}"
                    speed = f"{row['tokens_per_s'] / po['tokens_per_s']:.2f}"
                out.append([str(D), OPT_LABELS[o], LABELS[m], fmt(*row["val_ms"]), f"{gap:+.2f}%", closed, verdict,
                            paired, speed, _copies_str(row["copies"])])
    return header, out


def moonshot_lines(s: Settings, summary: dict) -> list[str]:
    """The issue's target: close >= half of PipeOptim's gap to synchronous 1F1B at D = 4 at no throughput
    cost (simulated tokens/s within 2 % of PipeOptim's, the calibration's noise level)."""
    rows, lines = summary["rows"], []
    for o in s.optimizers:
        po, sync = rows.get((4, o, "pipeoptim")), rows.get((4, o, "1f1b")) or rows.get((4, o, "gpipe"))
        if po is None or sync is None:
            continue
        found = []
        for m in PREDICTOR_VARIANTS:
            row = rows.get((4, o, m))
            f = None if row is None else gap_closed(row, po, sync)
            if f is not None:
                found.append((f, m, row["tokens_per_s"] / po["tokens_per_s"]))
        if not found:
            lines.append(f"- D=4, {OPT_LABELS[o]}: PipeOptim has no real gap to 1F1B here (or no variant ran): "
                         "nothing to close.")
            continue
        f, m, speed = max(found)
        met = f >= 0.5 and speed >= 0.98
        lines.append(f"- D=4, {OPT_LABELS[o]}: best variant {LABELS[m]} closes {f:+.0%} of PipeOptim's gap "
                     f"(simulated throughput {speed:.2f}x PipeOptim's): target {'MET' if met else 'not met'}.")
    return lines


def fit_ylim(ax, lows: list[float], highs: list[float]) -> None:
    """Y range from the curves' finite lows and highs, padded by 5 % (left to matplotlib when empty)."""
    lows = [v for v in lows if math.isfinite(v)]
    highs = [v for v in highs if math.isfinite(v)]
    if lows and highs and max(highs) > min(lows):
        pad = 0.05 * (max(highs) - min(lows))
        ax.set_ylim(min(lows) - pad, max(highs) + pad)


def plot_predictors(s: Settings, summary: dict, path: str) -> str | None:
    """Validation loss over training per (D, optimizer): synchronous, PipeOptim, PipeDream and the variants
    (mean over seeds, band ±1 std)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = ["sync", "pipeoptim", "pipedream", *[m for m in PREDICTOR_VARIANTS if m in s.methods]]
    train = summary["train"]
    nrows, ncols = len(s.depths), len(s.optimizers)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    handles = {}
    for i, D in enumerate(s.depths):
        for j, o in enumerate(s.optimizers):
            ax = axes[i][j]
            lows, highs = [], []
            for m in methods:
                runs = train.get((0, o, "sync") if m == "sync" else (D, o, m), {})
                nv = min((len(r["val"]) for r in runs.values()), default=0)
                if not nv:
                    continue
                x = np.array([q[0] for q in next(iter(runs.values()))["val"][:nv]])
                vals = np.array([[r["val"][q][1] for q in range(nv)] for r in runs.values()])
                mean = vals.mean(0)
                std = vals.std(0, ddof=1) if len(vals) > 1 else np.zeros(nv)
                color = COLORS.get(m) or VARIANT_COLORS[m]
                style = "-" if m in ("sync", "pipeoptim") or m.startswith("po-") else ":"
                (h,) = ax.plot(x, mean, color=color, lw=1.3, ls=style, marker="o", ms=3, label=LABELS[m])
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.08, lw=0)
                handles[m] = h
                lows.append(float(np.nanmin(mean - std)))
                highs.append(float(np.nanmax(mean[1:] + std[1:])) if nv > 1 else float(mean[0]))
            fit_ylim(ax, lows, highs)  # highs skip the first evaluation: it may be far off
            ax.set_title(f"D={D}, {OPT_LABELS[o]}")
            ax.set_xlabel(f"micro-batches of B={s.micro_batch}")
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
    if not handles:
        plt.close(fig)
        return None
    ncol = 2 * ncols
    legend_rows = math.ceil(len(handles) / ncol)
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=ncol, frameon=False, fontsize="small")
    fig.suptitle(f"{s.workload.upper()}: weight predictors and gradient-side variants vs PipeOptim and synchronous\n"
                 f"(validation loss, mean over {s.seeds} seed(s), band ±1 std)")
    fig.tight_layout(rect=(0, 0.035 * legend_rows * 2 / nrows, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(s: Settings, summary: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    train = summary["train"]
    nrows, ncols = len(s.depths), len(s.optimizers)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(10.4, 5.2 * ncols), 4.0 * nrows), squeeze=False)
    window = max(1, s.eval_interval // 4)
    handles = {}
    for i, D in enumerate(s.depths):
        for j, o in enumerate(s.optimizers):
            ax = axes[i][j]
            lows, highs = [], []
            for m in ("sync",) + ASYNC_METHODS:
                if m == "sync" and not any(x in s.methods for x in SYNC_METHODS):
                    continue
                if m != "sync" and m not in s.methods:
                    continue
                runs = train.get((0, o, "sync") if m == "sync" else (D, o, m), {})
                if not runs:
                    continue
                n = min(len(r["losses"]) for r in runs.values())
                if n == 0:
                    continue
                curves = np.array([_smooth(r["losses"][:n], window) for r in runs.values()])
                x = np.arange(1, n + 1)
                mean, std = curves.mean(0), curves.std(0, ddof=1) if len(curves) > 1 else np.zeros(n)
                color = COLORS[m]
                (h,) = ax.plot(x, mean, color=color, lw=1.2, label=LABELS[m])
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15, lw=0)
                handles[m] = h
                nv = min(len(r["val"]) for r in runs.values())
                if nv:
                    vx = np.array([runs[sd]["val"][q][0] for sd in list(runs)[:1] for q in range(nv)])
                    vals = np.array([[r["val"][q][1] for q in range(nv)] for r in runs.values()])
                    vm = vals.mean(0)
                    vs = vals.std(0, ddof=1) if len(vals) > 1 else np.zeros(nv)
                    ax.plot(vx, vm, color=color, lw=1.2, ls="--", marker="o", ms=3)
                    ax.fill_between(vx, vm - vs, vm + vs, color=color, alpha=0.15, lw=0)
                    lows.append(float(np.nanmin(vm - vs)))
                lows.append(float(np.nanmin(mean - std)))
                highs.append(float(mean[min(n - 1, max(0, n // 5))]))
            fit_ylim(ax, lows, highs)
            ax.set_title(f"D={D}, {OPT_LABELS[o]}")
            ax.set_xlabel(f"micro-batches of B={s.micro_batch} (samples / {s.micro_batch})")
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D
    extra = [Line2D([], [], color="k", lw=1.2, label=f"train (moving mean, {window} micro-batches)"),
             Line2D([], [], color="k", lw=1.2, ls="--", marker="o", ms=3, label="validation")]
    fig.legend(handles=list(handles.values()) + extra, loc="lower center",  # one panel: two legend rows
               ncol=min(8 if ncols > 1 else 4, len(handles) + 2), frameon=False)
    fig.suptitle(f"{s.workload.upper()} convergence: mean over {s.seeds} seed(s), band = ±1 std "
                 f"(GPipe/1F1B = the same synchronous run at every D)")
    fig.tight_layout(rect=(0, 0.05 if ncols > 1 else 0.1, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def verdict_paragraph(s: Settings, summary: dict) -> str:
    rows = summary["rows"]
    lines = []
    for D in s.depths:
        for o in s.optimizers:
            po, parts = rows.get((D, o, "pipeoptim")), []
            if po is None:
                continue
            for m in ("pipedream", "pipedream-2bw", "spectrain", "async-naive"):
                other = rows.get((D, o, m))
                if other is None:
                    continue
                v = compare(po["val_ms"], other["val_ms"], min(len(po["seeds"]), len(other["seeds"])))
                word = {"better (real)": "beats", "worse (real)": "loses to",
                        "one seed: no spread": "cannot be judged (one seed) against"}.get(
                            v, "ties (within spread) with")
                parts.append(f"{word} {LABELS[m]}")
            ref = rows.get((D, o, "1f1b")) or rows.get((D, o, "gpipe"))
            if ref is not None:
                v = compare(po["val_ms"], ref["val_ms"], len(po["seeds"]))
                gap = (po["val_ms"][0] - ref["val_ms"][0]) / ref["val_ms"][0] * 100
                parts.append(f"vs 1F1B: {gap:+.2f}% ({v})")
            lines.append(f"- D={D}, {OPT_LABELS[o]}: PipeOptim " + "; ".join(parts) + ".")
    return "\n".join(lines)


def notes(s: Settings, summary: dict, unigram: float) -> str:
    rows = summary["rows"]
    out = [f"- Unigram baseline: a model that knows only the training split's token frequencies scores "
           f"{unigram:.3f} on the validation set (the loss plateau every run passes through early on)."]
    for o in s.optimizers:
        sync_row = next((rows[(D, o, m)] for D in s.depths for m in SYNC_METHODS if (D, o, m) in rows), None)
        if sync_row is None:
            continue
        val = sync_row["val_ms"][0]
        if math.isfinite(val) and val > unigram - 0.1:
            out.append(f"- {OPT_LABELS[o]}: even the synchronous reference ends at {val:.3f}, not clearly below "
                       f"the unigram baseline ({unigram:.3f}): in this budget the runs learn little beyond token "
                       f"frequencies, so {OPT_LABELS[o]} comparisons between methods say little about pipelining.")
        stuck = [f"D={D} {LABELS[m]}" for D in s.depths for m in ASYNC_METHODS
                 if (D, o, m) in rows and math.isfinite(rows[(D, o, m)]["val_ms"][0])
                 and rows[(D, o, m)]["val_ms"][0] > unigram - 0.1 and not val > unigram - 0.1]
        if stuck:
            out.append(f"- {OPT_LABELS[o]}: not clearly below the unigram baseline at the end (final val loss "
                       f"above {unigram - 0.1:.3f}, while the synchronous reference reaches {val:.3f}): "
                       f"{', '.join(stuck)}.")
    if "pipedream-2bw" in s.methods:
        out.append("- PipeDream-2BW makes D times fewer updates than the others on the same samples (k = D "
                   "micro-batches per update, nothing else scaled): its gap at equal samples is mostly that.")
    out.append("- GPipe and 1F1B rows share one set of runs (identical update semantics; see the check above); "
               "only their simulated throughput differs, and with free communication and equal stages even "
               "that is the same schedule length, up to op-cost measurement noise.")
    return "\n".join(out)


def predictor_section(s: Settings, summary: dict) -> str:
    """The "Beyond the paper" section: empty unless a predictor variant ran."""
    if not any(m in PREDICTOR_VARIANTS for m in s.methods):
        return ""
    header, table = predictor_table(s, summary)
    spec = "\n".join(f"- {LABELS[m]}: `{base}` with {', '.join(f'{k}={v}' for k, v in opts.items())}"
                     for m, (base, opts) in PREDICTOR_VARIANTS.items() if m in s.methods)
    return f"""
## Beyond the paper: weight predictors and gradient-side corrections

Variants (policy options of `megatron_po/pipeline/policies.py`, predictors in `megatron_po/optim/predictors.py`;
delay compensation's λ = "tokens" = the {s.micro_batch * s.seq_length} tokens of a micro-batch, a stated rule):
{spec}

"Fraction of PipeOptim's gap closed" = (gap_PipeOptim − gap_variant) / gap_PipeOptim on the mean final
validation loss (1 = synchronous 1F1B reached, 0 = no better than PipeOptim, negative = worse); n/a where
PipeOptim's own gap is within the seed spread. "vs PipeOptim" uses the verdict rule above (a difference is
real only beyond std_a + std_b). Throughput: simulated tokens/s from the same calibration as PipeOptim's.

{markdown_table(header, table) if table else "(needs PipeOptim, 1F1B and a variant)"}

Moonshot (close at least half of PipeOptim's gap to 1F1B at D = 4 at no throughput cost):
{chr(10).join(moonshot_lines(s, summary)) or "- (D = 4 not run)"}

Curves: `predictors.png`.
"""


def write_report(s: Settings, wl, summary: dict, elapsed: float, load: tuple, png: str, reused: int = 0) -> str:
    import torch
    reused = f" ({reused} run(s) reused from an earlier invocation's cache, --resume)" if reused else ""
    header, table = main_table(s, summary)
    h2h_header, h2h = head_to_head(s, summary)
    B = s.micro_batch
    calib = summary["calibrations"]
    check_lines = [f"- D={D}, {OPT_LABELS[o]} (seed 1, {s.check_updates} updates, M={D} micro-batches of "
                   f"{B // D}): max |loss difference| to the unpipelined reference: GPipe "
                   f"{c['check']['gpipe']['max_abs_diff']:.1e}, 1F1B {c['check']['1f1b']['max_abs_diff']:.1e}"
                   for (D, o), c in sorted(calib.items())]
    unigram = wl.unigram_baseline()
    n_params = None
    try:
        n_params = sum(p.numel() for c in wl.build_chunks(wl.config(1), wl.padded_vocab, 0, 1, 1)
                       for p in c.parameters())
    except Exception:  # noqa: BLE001 (the count is informative only)
        pass
    lr = ", ".join(f"{OPT_LABELS[o]} {s.lr[o]:g}" for o in s.optimizers)
    clipping = ("none (so the synchronous rule, global norm, and the asynchronous one, stage-local norm, "
                "cannot differ)" if s.clip_grad == 0 else
                f"{s.clip_grad} (synchronous: global norm; asynchronous: stage-local norm)")
    text = f"""# Convergence of pipeline methods ({s.workload.upper()}, D = {", ".join(map(str, s.depths))})

Command: `{s.command}`

torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.platform()}; load average at start {load[0]:.2f},
at end {load[1]:.2f}; wall time {elapsed / 60:.1f} min with {s.jobs} worker process(es), one torch thread each{reused};
{time.strftime("%Y-%m-%d %H:%M:%S")}.

## Settings (identical for every method; never tuned per method)
- Data: {wl.describe()}. Training samples shuffled by the seed, the same order for every method; validation
  = a fixed set of {s.eval_batches} x {B} sequences from the validation split, the same for every run.
- Model: {wl.describe_model(n_params)},
  untied input/output embeddings (required by the asynchronous methods), no dropout (every method sees the
  same function of the weights), {f"{n_params:,} parameters" if n_params else ""}; fp32. Layers split evenly
  over the D stages (D=8: one layer per stage; stage 0 also holds the embedding, the last stage the output layer).
- Seeds: {s.seeds} per (method, optimizer, D): the seed sets the weight init and the training-data order.
- Optimizers: {", ".join(OPT_LABELS[o] for o in s.optimizers)}; peak lr {lr} (Adam/AdamW as in
  `examples/gpt_tiny.sh`, SGD-momentum the common 0.1; the same for all methods, not tuned per method);
  cosine decay to {s.min_lr_ratio:g} x peak after a linear warm-up of {s.warmup} micro-batches; weight decay
  {s.weight_decay} (L2 for Adam and SGD, decoupled for AdamW; not on biases and norms); Adam betas (0.9, 0.999), eps 1e-8; SGD momentum {s.sgd_momentum}.{MUON_NOTE if "muon" in s.optimizers else ""}
- Gradient clipping: {clipping}.
- Length: {s.steps} micro-batches of B = {wl.describe_sample()} = {s.steps * wl.tokens_per_microbatch:,.0f} training tokens
  per run (every method sees exactly the same samples); evaluation every {s.eval_interval} micro-batches.

## How the comparison is made fair
- **One optimizer update per B = {B} samples for every method except 2BW.** The asynchronous methods run
  k = 1, the published setting: every stage steps after each of its backwards, one micro-batch of B samples.
  GPipe and 1F1B step once per batch of the same B samples (run as M = D micro-batches of B/D so that they
  pipeline at all), so their update is W <- W - lr*U(mean gradient of the B samples at W). Same
  samples, same number of updates, same lr at every update, same hyperparameters.
- **PipeDream-2BW** needs gradient accumulation over k >= D micro-batches per update; it runs with k = D
  and nothing else scaled (same lr, same schedule on the sample clock): its updates average D micro-batches
  ({", ".join(f"D={D}: {D * B} samples" for D in s.depths)}), so it makes D times fewer updates on the same samples.
- **LR clock:** the schedule is a function of micro-batches consumed; step i of a stage that steps every k
  micro-batches uses the lr of micro-batch i*k, so warm-up and decay cover the same samples for all methods.
- **GPipe and 1F1B have identical update semantics** (the same gradient of the same batch, one flush, one
  step); they differ only in schedule and activation memory. Their convergence columns are therefore one
  run per (optimizer, seed): the unpipelined model trained on batches of B (the same emulator code with
  D = 1, where no method has staleness), valid at every D. The real GPipe / 1F1B op lists were run for a few
  updates as a check (`emulate` + `StageRunner`, `synchronous_forward_backward` semantics, global clipping):
{chr(10).join("  " + line for line in check_lines) if check_lines else "  (no synchronous method selected)"}
- **Asynchronous runs:** `AsyncEmulator` (all D stages in one process; the distributed run's op lists and
  per-op code, tested equal to it). The stream drains at each evaluation (every {s.eval_interval}
  micro-batches), exactly as `pretrain_gpt.py` does; evaluation uses the live weights, no prediction.
  PipeOptim: paper defaults (s = s(j) from the schedule, s_offset 0, momentum-buffer direction for SGD,
  decoupled weight decay not extrapolated). SpecTrain runs with SGD-momentum only (it predicts from the
  momentum buffer).
- **Train loss** is each micro-batch's loss as its forward computed it, i.e. on the weights the method
  used for that forward (stale for naive/PipeDream/2BW, predicted for SpecTrain/PipeOptim); "final" =
  mean over the last {s.tail} micro-batches. **Final val loss** = the fixed validation set after the last
  update, live weights.
- **Verdict rule:** a difference is called real only when it exceeds the spread: the mean ± std (sample
  std over seeds) intervals of the two methods do not overlap, i.e. |Δmean| > std_a + std_b. The paired
  count (seeds where PipeOptim is lower, same seed = same init and data order) is given alongside.
- **tokens/s (sim.)** is *simulated pipeline throughput*, not measured wall time (the emulator runs the
  stages one after another in one process). Per (D, optimizer) one calibration process trains every
  method in turn ({s.timing_rounds} rounds of 2D micro-batches each after an untimed warm-up, so load from
  other processes on this shared machine hits all methods alike) and records, on one thread, each op's
  time and the part of it spent in the weight policy's hooks (prediction, stashing, swaps, 2BW's version
  copy). A stage's forward / backward / step cost for an asynchronous method = the base cost of that op
  (op time minus hook time, pooled over all methods, which run the same model code; 10th percentile, the
  least-disturbed executions) + the method's own hook time (median over its ops). So measurement
  noise in the shared base cannot separate the methods; their policy work and their schedules do. GPipe
  and 1F1B pool their op times (the same ops in another order). These costs go into
  `megatron_po.pipeline.simulator.simulate` with each method's schedule and free communication.
  Async: steady state of the no-flush stream (a stage's step folded into its backwards, 1/k per backward).
  GPipe / 1F1B: one flush of M = D micro-batches of B/D (costs measured at that size) plus the slowest
  stage's step, per batch of B. Absolute values reflect one thread of a loaded 2-core CPU and such a tiny
  model that per-op overheads dominate; compare rows within one (D, optimizer) block.
- **Weight copies per stage** = the most full weight copies of the stage's model chunk alive at once,
  live weights included, measured by `AsyncEmulator.copies_per_chunk()` (max over seeds); GPipe/1F1B: 1.

## Results: final losses (mean ± std over {s.seeds} seeds), throughput, memory

{markdown_table(header, table)}

## PipeOptim against the other asynchronous methods (final validation loss, lower is better)

{markdown_table(h2h_header, h2h) if h2h else "(needs PipeOptim and another asynchronous method)"}

## Verdict

{verdict_paragraph(s, summary) or "(PipeOptim not selected)"}
{predictor_section(s, summary)}
## Notes

{notes(s, summary, unigram)}{wl.report_notes(summary) if hasattr(wl, "report_notes") else ""}

Curves: `{os.path.basename(png)}` (train loss as a moving mean, validation loss dashed; mean over seeds,
band ±1 std; one panel per (D, optimizer)).
"""
    return text


# --------------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------------


def run_benchmark(s: Settings, log=_print) -> dict:
    """Prepare data, run every job, write `<out>/convergence.md` and `<out>/convergence.png`.
    Returns {"md": path, "png": path, "summary": ..., "table": (header, rows)}."""
    validate(s)
    os.makedirs(s.out, exist_ok=True)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    start = time.perf_counter()
    wl = build_workload(s)
    log(f"> preparing data in {os.path.relpath(s.cache(), os.getcwd())}")
    wl.prepare()
    jobs = plan_jobs(s)
    log(f"> {len(jobs)} jobs ({sum(1 for j in jobs if j[0] == 'train')} training runs of {s.steps} micro-batches) "
        f"on {s.jobs} worker(s)")
    results, reused = run_jobs(s, jobs, log)
    summary = summarize(s, results, wl.tokens_per_microbatch)
    png = plot(s, summary, os.path.join(s.out, "convergence.png"))
    if any(m in PREDICTOR_VARIANTS for m in s.methods):
        plot_predictors(s, summary, os.path.join(s.out, "predictors.png"))
    elapsed = time.perf_counter() - start
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = write_report(s, wl, summary, elapsed, (load0, load1), png, reused)
    md = os.path.join(s.out, "convergence.md")
    with open(md, "w") as f:
        f.write(text)
    log(f"> wrote {md} and {png} ({elapsed / 60:.1f} min)")
    return {"md": md, "png": png, "summary": summary, "table": main_table(s, summary)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=None, help="pipeline stages D (default 4 8)")
    p.add_argument("--optimizers", nargs="+", default=None, choices=OPTIMIZERS, help="default: adam adamw sgd")
    p.add_argument("--methods", nargs="+", default=None, choices=ALL_METHODS, help="default: all")
    p.add_argument("--seeds", type=int, default=None, help="seeds per (method, optimizer, D) (default 3; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="micro-batches per run (default 256; --quick 32)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    p.add_argument("--out", default=None, help="output directory (default bench/results)")
    p.add_argument("--workload", default="gpt", choices=sorted(WORKLOADS),
                   help="gpt, or nmt: the encoder-decoder translation model (defaults: Adam, D = 4; BLEU columns)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one torch thread each)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs from <out>/.cache/runs")
    p.add_argument("--eval-interval", type=int, default=None, help="micro-batches between evaluations")
    p.add_argument("--lr", nargs="+", default=None, metavar="OPT=LR", help="peak lr per optimizer, e.g. adam=1e-3")
    p.add_argument("--cache-dir", default=None, help="tokenizer, corpus, indices and run cache (default <out>/.cache)")
    return p


def settings_from_args(argv=None) -> Settings:
    args = build_parser().parse_args(argv)
    s = Settings()
    if args.workload == "nmt":
        s = nmt_settings(s)
    if args.quick:
        s = quick_settings(s)
        s.seeds = 1
    for name in ("depths", "optimizers", "methods", "seeds", "steps", "out", "eval_interval", "cache_dir"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.lr:
        lr = dict(s.lr)
        for item in args.lr:
            o, _, v = item.partition("=")
            if o not in OPTIMIZERS or not v:
                raise SystemExit(f"error: --lr {item!r}: expected OPT=LR with OPT in {OPTIMIZERS}")
            lr[o] = float(v)
        s.lr = lr
    s.workload, s.jobs, s.resume = args.workload, args.jobs, args.resume
    s.out = os.path.abspath(s.out)
    given = sys.argv[1:] if argv is None else list(argv)
    s.command = "python bench/convergence.py" + "".join(" " + shlex.quote(a) for a in given)
    return s


def main(argv=None) -> int:
    s = settings_from_args(argv)
    try:
        run_benchmark(s)
    except NotImplementedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
