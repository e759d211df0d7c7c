"""bench/convergence/convergence.py's settings: the methods, optimizers and their labels, `Settings` (every knob of a
run, one dataclass, so a run's cache key is its fields), the `--quick` and `--workload nmt` presets and
the start-up check of a combination."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from bench_common import REPO

SYNC_METHODS = ("gpipe", "1f1b")
ASYNC_METHODS = ("async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim")
# Beyond the paper (docs/predictors.md): asynchronous variants, each a base
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
# What every Muon run before issue 31 ran (the Newton-Schulz steps and coefficients: before issue 36's cheaper Muon).
MUON_LEGACY = {"muon_fp32_matmul_prec": "highest", "muon_split_qkv": False, "muon_num_ns_steps": 5,
               "muon_coefficient_type": "simple"}
NS_PRECISION_LABELS = {"medium": "bf16", "high": "TF32", "highest": "fp32", "low": "fp32"}


def muon_ns_note(s) -> str:
    """The Newton-Schulz settings of a run, for the report's Muon line."""
    return (f" Newton-Schulz in {NS_PRECISION_LABELS[s.muon_fp32_matmul_prec]} (--muon-fp32-matmul-prec "
            f"{s.muon_fp32_matmul_prec}), fused QKV weight {'split into Q, K, V' if s.muon_split_qkv else 'whole'}.")


OPT_LABELS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD-momentum", "muon": "Muon"}
CORPUS = os.path.join(REPO, "examples", "data", "bible_web.en.jsonl.gz")

# The workloads of convergence_workloads.WORKLOADS (named here so the settings check needs no model code).
WORKLOAD_NAMES = ("gpt", "nmt")


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
    # Muon's Newton-Schulz (--muon-fp32-matmul-prec, --muon-split-qkv). The study's setting, not the product's
    # defaults (bf16, split since issue 31): on a CPU without bf16 matmuls bf16 is emulated and would inflate
    # the step costs the simulated clock measures. At these values `_job_key` leaves them out of the key, so
    # every cached Muon run stays reachable; bench/results/muon/ns_precision.md is the bf16 vs fp32 A/B.
    muon_fp32_matmul_prec: str = "highest"
    muon_split_qkv: bool = False
    muon_num_ns_steps: int = 5  # --muon-num-ns-steps
    muon_coefficient_type: str = "simple"  # --muon-coefficient-type
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
    if s.workload not in WORKLOAD_NAMES:
        raise SystemExit(f"error: unknown workload {s.workload!r}; valid: {', '.join(WORKLOAD_NAMES)}")
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
