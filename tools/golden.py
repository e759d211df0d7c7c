"""Golden loss curves: the loss and grad norm at every iteration of short runs, pinned across commits.

Each configuration below has its curve in tests/golden/<name>.json (with the command that made it, the
machine: torch version and CPU, the commit and a history of intended changes). tests/test_golden.py
reruns every configuration and compares with its curve; this tool does the same outside pytest and
regenerates curves on purpose:

    python tools/golden.py list                                  # names, what each covers, its command
    python tools/golden.py check [NAME ...]                      # rerun and compare (all when no name)
    python tools/golden.py check --as-command [NAME ...]         # the same, launched as the commands say
    python tools/golden.py update --reason "why" NAME [NAME ...] # regenerate, appending to the history
    python tools/golden.py update --reason "why" --all           # regenerate every curve
    python tools/golden.py data DIR                              # the corpora the $DATA commands read

On the machine a curve was made on (same torch version, CPU and ATen kernel set: the JSON's "machine")
runs are compared bitwise, float equality of every recorded value: on one CPU thread per rank, fp32,
bf16 and fp16 alike, every configuration gives the same bits run after run (update checks it: it runs
each configuration twice and refuses to write a curve that moved in between). Elsewhere the same
computation rounds differently (other SIMD kernels, another torch), so the check allows a relative
tolerance there, `rtol_elsewhere`, whose reason is ELSEWHERE below.

Command-line configurations run `training.run_main` (what pretrain_gpt.py / pretrain_nmt.py call) on
forked gloo ranks (tests/dist_harness.py), one thread each, which computes what
`OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node N pretrain_gpt.py FLAGS` does; emulator
configurations drive `AsyncEmulator` (every pipeline rank in one process) through its Python API.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tests' forked-rank harness, flag helper and corpus slice
sys.path.insert(0, ROOT)

from cli_args import flags_to_argv  # noqa: E402
from conftest import write_chapters  # noqa: E402  (also sets the offline environment of the tests)
from dist_harness import run_distributed  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The configurations
# --------------------------------------------------------------------------------------------------

# A tiny GPT on mock data (random tokens): 20 iterations of 4 micro-batches of 2 x 32 tokens; dropout on,
# so the RNG streams (TP, recomputation, resume) are part of what is pinned; warm-up then cosine decay.
GPT = {"--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 32,
       "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 20, "--lr": 2e-3, "--min-lr": 2e-4,
       "--lr-warmup-iters": 2, "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": 100,
       "--make-vocab-size-divisible-by": 64, "--hidden-dropout": 0.1, "--attention-dropout": 0.1,
       "--log-interval": 1, "--eval-iters": 0, "--seed": 5, "--metrics-file": "$OUT/metrics.jsonl"}
PP2 = {"--pipeline-model-parallel-size": 2, "--num-layers": 4}
ASYNC = dict(PP2, **{"--untie-embeddings-and-output-weights": True})  # async methods need untied embeddings
# A mixture of experts in every layer: 4 experts of 32, top-2, the aux loss and the z-loss, grouped GEMM.
MOE_PIPEOPTIM = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 32, "--moe-aux-loss-coeff": 0.01,
                 "--moe-z-loss-coeff": 0.001, "--moe-grouped-gemm": True}

# The bundled World English Bible, first 300 chapters, through tools/train_tokenizer.py and
# tools/preprocess_data.py (the tests' `corpus` fixture recipe); a validation split evaluated twice.
REAL = dict(GPT, **{"--mock-data": None, "--tokenizer-type": "SentencePieceTokenizer", "--vocab-size": None,
                    "--tokenizer-model": "$DATA/tok.model", "--data-path": "$DATA/bible_text_document",
                    "--data-cache-path": "$OUT/cache", "--split": "95,5,0", "--seq-length": 64,
                    "--make-vocab-size-divisible-by": 16, "--eval-interval": 10, "--eval-iters": 2})

# The encoder-decoder model on the bundled English-French Bible: Genesis 1-15 for training, Ruth for
# validation, Jonah for test, a 992-piece joint vocabulary (tests/test_nmt_pretrain.py's slice).
NMT = {"--encoder-num-layers": 1, "--decoder-num-layers": 1, "--hidden-size": 32, "--num-attention-heads": 4,
       "--seq-length": 64, "--decoder-seq-length": 40, "--micro-batch-size": 8, "--global-batch-size": 16,
       "--train-iters": 12, "--lr": 5e-3, "--lr-warmup-iters": 2, "--hidden-dropout": 0.1,
       "--attention-dropout": 0.1, "--label-smoothing": 0.1, "--make-vocab-size-divisible-by": 16,
       "--data-path": "$DATA/nmt/bible", "--tokenizer-model": "$DATA/nmt/bible.model", "--src-lang": "en",
       "--tgt-lang": "fr", "--log-interval": 1, "--eval-iters": 1, "--eval-bleu-sentences": 8, "--seed": 5,
       "--metrics-file": "$OUT/metrics.jsonl"}


# Mixture of experts (issue 48): 4 experts of 32 (2 on each EP rank), top-2, dropless, EP = 2 over the two
# data-parallel ranks. `ep2_moe_aux`: softmax scores, the load-balancing loss and the z-loss large enough to move
# the gradients, tokens through the alltoall dispatcher; `ep2_moe_expert_bias`: DeepSeek-V3's aux-loss-free
# balancing (sigmoid scores, the expert bias moved by 1e-2 per step, enough to change the routing within 20
# steps), a dense first layer (Megatron's list form), shared experts, the allgather dispatcher.
MOE = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 32, "--expert-model-parallel-size": 2}

# The DeepSeek-V3 family (issue 54), shrunk from its Megatron recipes (tests/test_moe_recipes.py has them flag for
# flag). `ep2_deepseek_v3`: multi-latent attention (query and key/value latents, latent norms, YaRN factor 40),
# one multi-token-prediction depth (its loss pinned as a series of its own), 8 experts top-4 in 2 of 4 groups
# (group-limited routing), sigmoid scores with the expert bias moved by 1e-2 per step and the top-k scaling factor,
# a shared expert, a dense first layer, the sequence aux loss, alltoall, at EP = 2. `pp2_glm_4_5_pipeoptim`:
# GLM-4.5's attention (GQA, a bias on the QKV projection, q/k norms, RoPE on half of each head) and routing
# (sigmoid, the expert bias, pre-softmax, a dense first layer, a shared expert) under PipeOptim at PP = 2.
RECIPE_COMMON = {"--position-embedding-type": "rope", "--normalization": "RMSNorm", "--swiglu": True,
                 "--disable-bias-linear": True, "--moe-router-score-function": "sigmoid",
                 "--moe-router-enable-expert-bias": True, "--moe-router-bias-update-rate": 1e-2,
                 "--moe-router-topk-scaling-factor": 2.5,
                 "--moe-shared-expert-intermediate-size": 32, "--moe-router-dtype": "fp32"}
DEEPSEEK_V3 = dict(RECIPE_COMMON, **{
    "--multi-latent-attention": True, "--q-lora-rank": 16, "--kv-lora-rank": 16, "--qk-head-dim": 8,
    "--qk-pos-emb-head-dim": 8, "--v-head-dim": 8, "--qk-layernorm": True, "--rotary-scaling-factor": 40,
    "--mscale": 1.0, "--mscale-all-dim": 1.0, "--num-experts": 8, "--moe-router-topk": 4,
    "--moe-router-num-groups": 4, "--moe-router-group-topk": 2, "--moe-ffn-hidden-size": 16,
    "--moe-layer-freq": "[0,1]", "--moe-router-load-balancing-type": "seq_aux_loss", "--moe-aux-loss-coeff": 1e-3,
    "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": True, "--mtp-num-layers": 1,
    "--mtp-loss-scaling-factor": 0.1, "--expert-model-parallel-size": 2,
    "--untie-embeddings-and-output-weights": True})
GLM_4_5 = dict(RECIPE_COMMON, **{
    "--group-query-attention": True, "--num-query-groups": 2, "--add-qkv-bias": True, "--qk-layernorm": True,
    "--rotary-percent": 0.5, "--rotary-base": 1000000, "--num-experts": 4, "--moe-router-topk": 2,
    "--moe-ffn-hidden-size": 32, "--moe-router-pre-softmax": True, "--moe-layer-freq": "[0]*1+[1]*3",
    "--moe-router-load-balancing-type": "seq_aux_loss", "--moe-aux-loss-coeff": 0,
    "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": True})


@dataclass(frozen=True)
class Golden:
    """One pinned configuration. Exactly one of `flags` (a pretrain_gpt.py / pretrain_nmt.py run on `world`
    ranks) and `emulate` (AsyncEmulator settings, see `emulate`) is set. `resume_at`: the check runs the
    command with --exit-interval resume_at and a save, then resumes from that checkpoint: both halves
    together must give the uninterrupted run's curve. `rtol_elsewhere`: the tolerance on another machine."""
    name: str
    covers: tuple[str, ...]
    flags: dict | None = None
    world: int = 1
    script: str = "pretrain_gpt.py"
    emulate: dict | None = None
    resume_at: int | None = None
    needs_data: bool = False
    rtol_elsewhere: float = 2e-4


# Another machine, emulated here by holding ATen, oneDNN and MKL to AVX2, then to no SIMD at all, against
# curves made with AVX512 (tests/golden/README.md): fp32 configurations moved by at most 2.4e-5 relative
# (the emulator's error feedback at lr 1e-2; the command-line ones 5.8e-7), bf16, fp16 and Muon (bf16
# Newton-Schulz) by at most 8.7e-4 (the bf16 grad norm). The tolerances are 8x and 11x those.
ELSEWHERE = ("another machine (torch version, CPU or its kernel set) rounds differently, and 20 optimizer "
             "steps amplify it; tests/golden/README.md has the measurement")
LOW_PRECISION_RTOL = 1e-2


def gpt(name, covers, world=1, base=GPT, **flags):
    flags = dict(base, **flags)
    low = flags.get("--bf16") or flags.get("--fp16") or flags.get("--optimizer") == "muon"
    return Golden(name, covers, flags, world, needs_data=base is not GPT,
                  rtol_elsewhere=LOW_PRECISION_RTOL if low else Golden.rtol_elsewhere)


def emu(name, covers, method, optimizer, **settings):
    return Golden(name, covers, emulate=dict(method=method, optimizer=optimizer, **settings))


CONFIGS = [
    gpt("tp2_sp_bf16", ("TP=2 with sequence parallelism", "bf16"), 2,
        **{"--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--bf16": True}),
    gpt("pp2_1f1b_full_recompute", ("PP=2 1F1B", "full recomputation"), 2, **PP2,
        **{"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": 1}),
    gpt("pp2_interleaved", ("PP=2 interleaved 1F1B",), 2, **PP2, **{"--num-layers-per-virtual-pipeline-stage": 1}),
    gpt("pp2_zbh1_selective_recompute", ("PP=2 ZB-H1", "selective recomputation"), 2, **PP2,
        **{"--pipeline-method": "zb-h1", "--recompute-activations": True}),
    gpt("dp2_distributed_optimizer", ("DP=2 with the distributed optimizer", "AdamW"), 2,
        **{"--use-distributed-optimizer": True}),
    # 2^20 overflows fp16 gradients: with hysteresis 1 each overflow halves the scale and skips the step
    # (grad norm null in the curve) until the scale fits (after two skips); the curve holds the scale too.
    gpt("fp16_loss_scaling", ("fp16 with loss scaling and skipped steps",),
        **{"--fp16": True, "--initial-loss-scale": 2.0**20, "--hysteresis": 1}),
    gpt("muon", ("Muon",), **{"--optimizer": "muon"}),
    gpt("pp2_async_naive", ("async-naive, distributed",), 2, **ASYNC, **{"--pipeline-method": "async-naive"}),
    gpt("pp2_pipedream", ("PipeDream, distributed",), 2, **ASYNC, **{"--pipeline-method": "pipedream"}),
    gpt("pp2_pipedream_2bw", ("2BW, distributed", "--async-update-interval"), 2, **ASYNC,
        **{"--pipeline-method": "pipedream-2bw", "--async-update-interval": 2}),
    gpt("pp2_pipeoptim", ("PipeOptim, distributed",), 2, **ASYNC, **{"--pipeline-method": "pipeoptim"}),
    gpt("pp2_pipeoptim_interval2", ("--async-update-interval",), 2, **ASYNC,
        **{"--pipeline-method": "pipeoptim", "--async-update-interval": 2}),
    gpt("pp2_pipenag", ("PipeNAG, distributed",), 2, **ASYNC,
        **{"--pipeline-method": "pipenag", "--optimizer": "nag", "--lr": 0.5, "--min-lr": 0.05}),
    gpt("pp2_error_feedback", ("error feedback, distributed",), 2, **ASYNC,
        **{"--pipeline-method": "pipeoptim", "--optimizer": "nadamw", "--async-error-feedback": True}),
    gpt("ep2_moe_aux", ("MoE at EP = 2 with the load-balancing loss and the z-loss", "the alltoall dispatcher"), 2,
        **MOE, **{"--moe-token-dispatcher-type": "alltoall", "--moe-aux-loss-coeff": 1e-2, "--moe-z-loss-coeff": 1e-3}),
    gpt("ep2_moe_expert_bias", ("MoE at EP = 2 with the expert bias (aux-loss-free, sigmoid)", "shared experts",
                                "a dense first layer", "the allgather dispatcher"), 2,
        **MOE, **{"--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": True,
                  "--moe-router-bias-update-rate": 1e-2, "--moe-router-load-balancing-type": "none",
                  "--moe-shared-expert-intermediate-size": 32, "--moe-layer-freq": "([0]*1+[1]*1)",
                  "--moe-token-dispatcher-type": "allgather"}),
    # Context parallelism: attention without dropout (a CP rule); hidden dropout stays on (its RNG is pinned)
    gpt("cp2", ("CP = 2 (ring attention)",), 2, **{"--context-parallel-size": 2, "--attention-dropout": 0.0}),
    gpt("pp2_cp2_pipeoptim", ("CP = 2 with PipeOptim at PP = 2",), 4, **ASYNC,
        **{"--pipeline-method": "pipeoptim", "--context-parallel-size": 2, "--attention-dropout": 0.0,
           "--position-embedding-type": "rope", "--no-position-embedding": True, "--group-query-attention": True,
           "--num-query-groups": 2}),
    gpt("pp2_moe_pipeoptim", ("PipeOptim with MoE at PP = 2",), 2, **ASYNC, **MOE_PIPEOPTIM,
        **{"--pipeline-method": "pipeoptim"}),
    gpt("ep2_deepseek_v3", ("DeepSeek-V3 at EP = 2: MLA, MTP, group-limited routing, sigmoid with the expert "
                            "bias, a shared expert",), 2, **DEEPSEEK_V3),
    gpt("pp2_glm_4_5_pipeoptim", ("GLM-4.5 under PipeOptim at PP = 2: GQA, QKV bias, partial rotary, sigmoid with "
                                  "the expert bias, a dense first layer",), 2, **ASYNC, **GLM_4_5,
        **{"--pipeline-method": "pipeoptim"}),
    # FSDP2 (issue 55): parameters, gradients and optimizer state sharded over the DP ranks of each stage
    gpt("dp2_fsdp2", ("FSDP2 at DP = 2 (--use-torch-fsdp2)",), 2, **{"--use-torch-fsdp2": True}),
    gpt("pp2_fsdp2_pipeoptim", ("PipeOptim at PP = 2 x FSDP2 DP = 2 (predicted shards gathered)",), 4, **ASYNC,
        **{"--pipeline-method": "pipeoptim", "--use-torch-fsdp2": True}),
    emu("emu_async_naive", ("async-naive, emulator",), "async-naive", "adam"),
    emu("emu_pipedream", ("PipeDream, emulator",), "pipedream", "adam"),
    emu("emu_pipedream_2bw", ("2BW, emulator", "--async-update-interval"), "pipedream-2bw", "adam",
        num_stages=2, update_interval=2),  # 2BW accumulates over m >= D micro-batches
    emu("emu_pipeoptim", ("PipeOptim, emulator", "AdamW"), "pipeoptim", "adamw"),
    emu("emu_pipenag", ("PipeNAG, emulator",), "pipenag", "nag", lr=0.5),
    emu("emu_error_feedback", ("error feedback, emulator",), "pipeoptim", "nadamw", error_feedback=True),
    Golden("nmt", ("the NMT model (pretrain_nmt.py)",), NMT, script="pretrain_nmt.py", needs_data=True),
    Golden("resume_midway", ("a resume in the middle of a run",), dict(GPT), resume_at=10),
    gpt("real_data", ("the real-data path (train_tokenizer.py, preprocess_data.py)", "AdamW"), base=REAL),
]
BY_NAME = {g.name: g for g in CONFIGS}

# Emulator runs: a GPT of one layer per stage on 3 stages, random micro-batches of 2 x 16 tokens, 20
# micro-batches streamed without a drain; the lr decays 5 % per step of a chunk (predictions must follow it).
# A configuration may add `model`: ModelConfig fields over that GPT (e.g. {"mtp_num_layers": 1,
# "position_embedding_type": "rope"} for multi-token prediction, whose loss the curve then pins per micro-batch;
# experts, multi-latent attention, num_layers a multiple of the stages).
EMULATOR = {"num_stages": 3, "microbatches": 20, "update_interval": 1, "lr": 1e-2, "weight_decay": 0.01,
            "clip_grad": 1.0, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 16, "vocab": 64,
            "micro_batch_size": 2, "seed": 5}


def emulator_settings(g: Golden) -> dict:
    return dict(EMULATOR, **g.emulate)


def command(g: Golden) -> str:
    """What made the curve: the launch command (paths under $OUT and $DATA), or the emulator call."""
    if g.emulate is not None:
        s = emulator_settings(g)
        return ("AsyncEmulator(" + ", ".join(f"{k}={v!r}" for k, v in s.items()) + ")"
                " (tools/golden.py: emulate)")
    launch = (f"torchrun --standalone --nproc-per-node {g.world}" if g.world > 1 else "python")
    args = " ".join(a if a.startswith("$") else shlex.quote(a) for a in flags_to_argv(g.flags))  # $OUT, $DATA
    return f"OMP_NUM_THREADS=1 {launch} {g.script} {args}"


# --------------------------------------------------------------------------------------------------
# Running a configuration
# --------------------------------------------------------------------------------------------------


def prepare_data(directory: str) -> str:
    """The corpora the $DATA commands read, built once per directory: the bundled English Bible's first
    300 chapters through tools/train_tokenizer.py (vocabulary 500) and tools/preprocess_data.py, and the
    English-French slice through tools/preprocess_nmt.py."""
    from tools import preprocess_data, preprocess_nmt, train_tokenizer
    os.makedirs(directory, exist_ok=True)
    done = os.path.join(directory, "done")
    if os.path.exists(done):
        return directory
    quiet = open(os.path.join(directory, "prepare.log"), "w")
    with quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        src = write_chapters(os.path.join(directory, "bible300.jsonl"), 300)
        assert train_tokenizer.main(["--input", src, "--json-keys", "text", "--vocab-size", "500",
                                     "--output-prefix", os.path.join(directory, "tok")]) == 0
        assert preprocess_data.main(["--input", src, "--json-keys", "text",
                                     "--tokenizer-type", "SentencePieceTokenizer",
                                     "--tokenizer-model", os.path.join(directory, "tok.model"),
                                     "--output-prefix", os.path.join(directory, "bible"), "--append-eod",
                                     "--workers", "1"]) == 0
        pairs = os.path.join(directory, "nmt_slice.jsonl")
        with gzip.open(os.path.join(ROOT, "examples", "data", "bible_web_lsg1910.en-fr.jsonl.gz"), "rt") as f, \
                open(pairs, "w") as out:
            for line in f:
                book, chapter = json.loads(line)["ref"].rsplit(" ", 1)
                if (book == "Genesis" and int(chapter.split(":")[0]) <= 15) or book in ("Ruth", "Jonah"):
                    out.write(line)
        os.makedirs(os.path.join(directory, "nmt"), exist_ok=True)
        assert preprocess_nmt.main(["--input", pairs, "--src-lang", "en", "--tgt-lang", "fr", "--doc-key", "ref",
                                    "--doc-regex", r"^(.+?) [0-9]+:[0-9]+$", "--valid-docs", "Ruth",
                                    "--test-docs", "Jonah", "--vocab-size", "992", "--max-length", "100",
                                    "--output-prefix", os.path.join(directory, "nmt", "bible")]) == 0
    open(done, "w").close()
    return directory


def warm_imports() -> None:
    """What the ranks import lazily, imported once here before they are forked (~1 s each otherwise)."""
    for module in ("torch._dynamo", "torch.distributed.checkpoint", "megatron_po.data.gpt_dataset",
                   "megatron_po.training", "megatron_po.nmt_workload", "megatron_po.pipeline.async_pipeline"):
        importlib.import_module(module)


def to_log(path: str) -> None:
    """This rank's output (Python's and the C++ side's) into `path`."""
    log = open(path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log


def _rank_main(script: str, argv: list[str], out: str) -> int:
    import torch.distributed as dist
    to_log(os.path.join(out, f"rank{dist.get_rank()}.log"))
    from megatron_po.training import run_main
    if script == "pretrain_nmt.py":
        from megatron_po.nmt_workload import NMTWorkload
        return run_main(argv, workload_cls=NMTWorkload)
    return run_main(argv)


def _launch(g: Golden, argv: list[str], out: str, as_command: bool = False) -> list[dict]:
    """Run `argv` on g.world forked ranks (`as_command`: as the command says, torchrun or python in a
    subprocess); the per-iteration records of its metrics file."""
    os.makedirs(out, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if as_command:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(g.world)] \
            if g.world > 1 else []
        with open(os.path.join(out, "rank0.log"), "w") as log:
            code = subprocess.run([sys.executable, *launcher, g.script, *argv], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
        codes = [code] * g.world
    else:
        codes = run_distributed(_rank_main, g.world, args=(g.script, argv, out), timeout=300)
    if codes != [0] * g.world:
        logs = "".join(open(os.path.join(out, f"rank{r}.log")).read()[-2000:]
                       for r in range(g.world) if os.path.exists(os.path.join(out, f"rank{r}.log")))
        raise RuntimeError(f"{g.name}: exit codes {codes}\n{logs}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r]


# The series a curve pins, each where a run logs it: (curve key, record key, label in messages). The loss and grad
# norm always; fp16's loss scale; multi-token prediction's loss (--mtp-num-layers), apart from the LM loss.
SERIES = (("loss", "lm_loss", "loss"), ("grad_norm", "grad_norm", "grad norm"),
          ("loss_scale", "loss_scale", "loss scale"), ("mtp_loss", "mtp_loss", "mtp loss"))
OPTIONAL = ("loss_scale", "mtp_loss")


def _curve(records: list[dict]) -> dict:
    curve = {"iteration": [r["iteration"] for r in records]}
    for key, logged, _ in SERIES:
        if key not in OPTIONAL or any(logged in r for r in records):
            curve[key] = [r.get(logged) for r in records]
    return curve


def run_command(g: Golden, workdir: str, data: str | None, straight: bool = False, as_command: bool = False) -> dict:
    """The curve of a command-line configuration. A resume configuration runs in two halves (save and exit
    at `resume_at`, then resume from that checkpoint) unless `straight`."""
    def argv(out, **extra):
        text = flags_to_argv(dict(g.flags, **extra))
        return [a.replace("$OUT", out).replace("$DATA", data or "$DATA") for a in text]

    if g.resume_at is None or straight:
        out = os.path.join(workdir, "run")
        return _curve(_launch(g, argv(out), out, as_command))
    first, second = os.path.join(workdir, "first"), os.path.join(workdir, "resumed")
    ckpt = os.path.join(workdir, "ckpt")
    head = _launch(g, argv(first, **{"--save": ckpt, "--exit-interval": g.resume_at}), first, as_command)
    tail = _launch(g, argv(second, **{"--load": ckpt}), second, as_command)
    return _curve(head + tail)


def emulator(s: dict):
    """The AsyncEmulator of emulator settings `s` (EMULATOR updated by a configuration's `emulate`), and the batch
    of each micro-batch: every rank of the asynchronous pipeline in this process, fp32."""
    import dataclasses

    import torch

    from megatron_po.config import Config, ModelConfig
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    cfg = Config()
    cfg.model = dataclasses.replace(
        ModelConfig(num_layers=s["num_stages"], hidden_size=s["hidden_size"],
                    num_attention_heads=s["num_attention_heads"], seq_length=s["seq_length"], hidden_dropout=0.0,
                    attention_dropout=0.0, make_vocab_size_divisible_by=s["vocab"],
                    untie_embeddings_and_output_weights=True), **s.get("model", {}))
    cfg.training.seed = s["seed"]
    model_parallel_seed(s["seed"])
    kwargs = {"lr": s["lr"], "weight_decay": s["weight_decay"], "sgd_momentum": 0.9}
    options = {"error_feedback": True} if s.get("error_feedback") else {}
    emu = AsyncEmulator(cfg, s["vocab"], s["method"], s["num_stages"], 1, s["update_interval"], s["optimizer"],
                        kwargs, lambda i: s["lr"] * 0.95 ** i, s["clip_grad"], **options)

    def batch(mb):
        gen = torch.Generator().manual_seed(1000 * s["seed"] + mb)
        tokens = torch.randint(0, s["vocab"], (s["micro_batch_size"], s["seq_length"] + 1), generator=gen)
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(tokens[:, 1:].shape)}
    return emu, batch


def emulate(s: dict) -> dict:
    """The curve of emulator settings `s`: one segment of s["microbatches"] micro-batches; with multi-token
    prediction also each micro-batch's MTP loss (the mean of its depths' losses, what the log's `mtp_loss`
    averages over an interval's micro-batches)."""
    from megatron_po.models.mtp import mtp_blocks
    emu, batch = emulator(s)
    last = emu.stages[-1]
    norms = []

    def step(c, step=last.step):  # the loss stage's grad norm (before clipping) at each of its steps
        step(c)
        norms.append(last.grad_norms[c])
    last.step = step
    mtp = []
    for block in mtp_blocks(last.chunks):  # its record holds the one forward that just ran: read and reset
        block.register_forward_hook(lambda m, args, out: mtp.append(m.record.take(len(m.layers))[0].mean().item()))

    losses = emu.train_segment(batch, s["microbatches"])
    curve = {"iteration": list(range(1, len(losses) + 1)), "loss": losses, "grad_norm": norms}
    if mtp:
        assert len(mtp) == len(losses), (len(mtp), len(losses))  # one training forward per micro-batch
        curve["mtp_loss"] = mtp
    return curve


def run(g: Golden, workdir: str, data: str | None = None, straight: bool = False, as_command: bool = False) -> dict:
    """The curve of configuration g: {"iteration": [...], "loss": [...], "grad_norm": [...]} (for the
    emulator: the loss of every micro-batch, the loss stage's grad norm at every step). `data`: the
    directory of `prepare_data`, for configurations that read a corpus. `as_command`: launch command-line
    configurations as their command does, in a subprocess (slower; proves the command gives the curve)."""
    warm_imports()
    if g.needs_data and data is None:
        raise ValueError(f"{g.name} reads a corpus: pass the directory of prepare_data()")
    if g.emulate is not None:
        sys.stdout.flush()
        return run_distributed(emulate, 1, args=(emulator_settings(g),), timeout=300)[0]
    return run_command(g, workdir, data, straight, as_command)


# --------------------------------------------------------------------------------------------------
# Curves on disk, and the comparison
# --------------------------------------------------------------------------------------------------


def path_of(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.json")


def load(name: str) -> dict:
    with open(path_of(name)) as f:
        return json.load(f)


def machine() -> dict:
    """What decides the bits of a run besides the code: torch, the CPU and the ATen kernel set."""
    import platform

    import torch
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"torch": torch.__version__, "cpu": cpu, "kernels": torch.backends.cpu.get_cpu_capability()}


def _same(a, b, rtol) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if rtol is None else math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def first_difference(golden: dict, measured: dict, rtol: float | None = None) -> int | None:
    """The first position where the loss, the grad norm, (fp16) the loss scale or (MTP) the MTP loss moved (a curve
    of another length moves where the shorter one ends), or None."""
    keys = [k for k, _, _ in SERIES if k in golden or k in measured]
    for i in range(max(len(c.get(k, [])) for c in (golden, measured) for k in keys)):
        for key in keys:
            g, m = golden.get(key, []), measured.get(key, [])
            if (i < len(g)) != (i < len(m)) or (i < len(g) and not _same(g[i], m[i], rtol)):
                return i
    return None


def largest_deviation(golden: dict, measured: dict) -> float:
    """The largest relative difference between two curves of the same length (every series alike; skipped steps
    left out)."""
    return max((abs(m - g) / abs(g) for key, _, _ in SERIES
                for g, m in zip(golden.get(key, []), measured.get(key, []))
                if g is not None and m is not None and g != 0), default=0.0)


def compare(g: Golden, golden: dict, measured: dict, here: dict | None = None) -> str | None:
    """None when `measured` reproduces `golden`: bitwise on the golden's machine, within g.rtol_elsewhere
    on another (`here`: this machine, `machine()` by default); otherwise what moved, where, and how to
    reproduce it."""
    fix = f"if intended: python tools/golden.py update --reason \"...\" {g.name}"
    if golden["command"] != command(g):
        return (f"{g.name}: the configuration changed since its golden curve was made\n"
                f"  golden:  {golden['command']}\n  now:     {command(g)}\n  {fix}")
    here = here or machine()
    rtol = None if golden["machine"] == here else g.rtol_elsewhere
    i = first_difference(golden, measured, rtol)
    if i is None:
        return None

    def at(curve, key):
        values = curve.get(key, [])
        return repr(values[i]) if i < len(values) else "(none: the run ended)"
    unit = "micro-batch / step" if g.emulate is not None else "iteration"
    rule = "bitwise: the machine the golden was made on" if rtol is None else \
        f"rtol {rtol}: made on {golden['machine']}, this is {here}: {ELSEWHERE}"
    values = "".join(f"  {label + ':':<10} golden {at(golden, key)}  now {at(measured, key)}\n"
                     for key, _, label in SERIES if key not in OPTIONAL or key in golden)
    return (f"{g.name}: moved at {unit} {i + 1} ({rule})\n" + values +
            f"  golden made at commit {golden['commit']}\n"
            f"  reproduce: python tools/golden.py check {g.name}\n"
            f"  command:   {command(g)}\n  {fix}")


def commit() -> str:
    """HEAD, marked +modified when tracked Python files differ from it (the code that makes the numbers)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    changed = [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.endswith(".py")]
    return head + ("+modified" if changed else "")


def write(g: Golden, measured: dict, reason: str) -> dict:
    old = load(g.name) if os.path.exists(path_of(g.name)) else None
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    entry = {"reason": reason, "commit": commit(), "date": now,
             "last_loss": [old["loss"][-1] if old else None, measured["loss"][-1]],
             "last_grad_norm": [old["grad_norm"][-1] if old else None, measured["grad_norm"][-1]]}
    doc = {"name": g.name, "covers": list(g.covers), "command": command(g), "world_size": g.world,
           "comparison": {"on its machine": "bitwise", "elsewhere": {"rtol": g.rtol_elsewhere, "reason": ELSEWHERE}},
           "unit": (f"micro-batch (loss{', mtp loss' if 'mtp_loss' in measured else ''}), step of the loss stage "
                    "(grad norm)") if g.emulate is not None else "iteration",
           **({"resume": f"checked in two halves: the command with --save $OUT/ckpt --exit-interval {g.resume_at}, "
                         "then with --load $OUT/ckpt; together they must give this (uninterrupted) curve"}
              if g.resume_at is not None else {}),
           "machine": machine(), "commit": entry["commit"], "date": now, **measured,
           "history": (old["history"] if old else []) + [entry]}
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    with open(path_of(g.name), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return entry


def check(g: Golden, workdir: str, data: str | None, as_command: bool = False) -> tuple[str | None, str]:
    """(what moved or None, a line saying how close the run came)."""
    if not os.path.exists(path_of(g.name)):
        return f"{g.name}: no golden curve ({os.path.relpath(path_of(g.name), ROOT)}): run tools/golden.py update", ""
    golden, measured = load(g.name), run(g, workdir, data, as_command=as_command)
    problem = compare(g, golden, measured)
    if first_difference(golden, measured) is None:
        return problem, f"{g.name}: matches its golden curve bitwise"
    return problem, (f"{g.name}: within rtol {g.rtol_elsewhere} of its golden curve (made on another machine); "
                     f"largest relative deviation {largest_deviation(golden, measured):.2g}")


def update(g: Golden, workdir: str, data: str | None, reason: str) -> dict:
    """Regenerate g's curve. Runs it twice (a bitwise configuration must repeat itself exactly) and, for a
    resume configuration, the two halves too (they must give the uninterrupted run's curve)."""
    curve = run(g, os.path.join(workdir, "a"), data, straight=True)
    again = run(g, os.path.join(workdir, "b"), data, straight=True)
    i = first_difference(curve, again)
    if i is not None:
        raise RuntimeError(f"{g.name}: two runs differ at position {i + 1}: not deterministic on this machine")
    if g.resume_at is not None:
        i = first_difference(curve, run(g, os.path.join(workdir, "c"), data))
        if i is not None:
            raise RuntimeError(f"{g.name}: the resumed run differs from the uninterrupted one at iteration {i + 1}")
    return write(g, curve, reason)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="every configuration: name, what it covers, its command")
    p_check = sub.add_parser("check", help="rerun configurations and compare with their golden curves")
    p_check.add_argument("names", nargs="*", help="configurations (default: all)")
    p_check.add_argument("--as-command", action="store_true",
                         help="launch command-line configurations with their command (torchrun / python in a "
                              "subprocess) instead of on forked ranks: slower; proves the command gives the curve")
    p_update = sub.add_parser("update", help="regenerate golden curves, recording why in their history")
    p_update.add_argument("names", nargs="*")
    p_update.add_argument("--all", action="store_true", help="every configuration")
    p_update.add_argument("--reason", required=True, help="why the numbers change (goes into the history)")
    p_data = sub.add_parser("data", help="build the corpora the $DATA commands read")
    p_data.add_argument("directory")
    args = parser.parse_args(argv)

    if args.action == "list":
        for g in CONFIGS:
            print(f"{g.name}: {'; '.join(g.covers)}\n    {command(g)}")
        return 0
    if args.action == "data":
        print(prepare_data(args.directory))
        return 0
    names = args.names or ([g.name for g in CONFIGS] if args.action == "check" or args.all else [])
    if not names:
        parser.error("update: name the configurations to regenerate, or --all")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; `list` shows them")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        data = prepare_data(os.path.join(tmp, "data")) if any(BY_NAME[n].needs_data for n in names) else None
        for n in names:
            workdir = os.path.join(tmp, n)
            if args.action == "check":
                problem, closeness = check(BY_NAME[n], workdir, data, args.as_command)
                failed += problem is not None
                print(problem or closeness, flush=True)
            else:
                e = update(BY_NAME[n], workdir, data, args.reason)
                print(f"{n}: loss {e['last_loss'][0]!r} -> {e['last_loss'][1]!r}, grad norm "
                      f"{e['last_grad_norm'][0]!r} -> {e['last_grad_norm'][1]!r}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
