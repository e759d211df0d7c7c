"""The parallel-layout space the layout sweep draws from (tools/layout_sweep.py runs what it draws), and what the
start-up rules say of each layout.

A `Layout` is one point of the product of every parallel flag and every flag that changes how gradients and
weights move: the world size (2, 4 or 8 processes), the model (`MODELS`: a tiny dense GPT, a tiny MoE GPT, a tiny
GPT with multi-latent attention and multi-token prediction, a tiny MoE with DeepSeek-V3's routing), TP with or
without sequence parallelism, CP and `--cp-comm-type`, PP with every pipeline method (synchronous schedules and
asynchronous methods), `--num-layers-per-virtual-pipeline-stage` and the split of the layers over the stages (`SPLITS`:
even, Megatron's uneven first stage or a layout string), the update interval of the asynchronous
methods, the micro-batch size, tied or untied embeddings, the optimizer, how data parallelism holds the
optimizer (`SHARDING`: DDP, the distributed optimizer with or without its overlapped gather, FSDP2 with or without
the reshard after forward, each also by its --data-parallel-sharding-strategy name) and its bucket size, EP,
expert TP, the MoE dispatcher, capacity, grouped GEMM, load balancing and expert bias, and activation recomputation
(MoE-layer recomputation included). `Layout.flags()` is its command line (pretrain_gpt.py's flags);
`verdict(layout)` asks the real start-up rules (config_rules.validate, no process group) whether a run of it
starts, and returns the refusal's line if not.

`draw(rng)` draws one layout: the sizes mostly fit the world (TP x CP x PP dividing it, EP x expert TP dividing
the ranks of a stage), and one draw in ten takes sizes freely, so that the size rules' refusals are drawn too. The
split of a pipelined layout is drawn from a generator of its own, seeded by the rest of the layout, so the other
axes draw as they did before the split joined the space.
`sample(seed, count)` draws (fixed seed) until `count` distinct layouts are accepted; it returns them and the
refused ones met on the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import sys
import zlib
from dataclasses import dataclass
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tests' flag helper (and, for the sweep, forked-rank harness)
sys.path.insert(0, ROOT)

from cli_args import flags_to_argv  # noqa: E402

WORLDS = (2, 4, 8)
SIZES = (1, 2, 4)
SYNC_METHODS = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v")
ASYNC_METHODS = ("async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim", "pipenag")
GLOBAL_BATCH, ITERATIONS = 8, 3

# What a run of every layout shares: 3 iterations of a global batch of 8 sequences of 16 random tokens (mock
# data), fp32, no dropout (the comparison is of numbers, not of random streams), Megatron's default clipping at
# 1.0 (active: the grad norms are ~1.3), cosine decay. Vocabulary 127 + EOD = 128 rows at every TP size.
COMMON = {"--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 16, "--global-batch-size": GLOBAL_BATCH,
          "--train-iters": ITERATIONS, "--lr": 1e-3, "--min-lr": 1e-4, "--hidden-dropout": 0.0,
          "--attention-dropout": 0.0, "--mock-data": True, "--vocab-size": 127, "--tokenizer-type": "NullTokenizer",
          "--make-vocab-size-divisible-by": 32, "--log-interval": 1, "--eval-iters": 0, "--seed": 3}

# The models: a dense GPT of 8 layers (interleaving up to 2 chunks on 4 stages); an MoE GPT of 4 layers, the
# first dense (Megatron's list form), 8 experts top-2 with SwiGLU and a shared expert, both auxiliary losses; a GPT
# of 4 layers with multi-latent attention (a query latent, RMSNorm'd latents, YaRN RoPE) and one multi-token
# prediction depth (docs/mla.md, docs/mtp.md); and an MoE of DeepSeek-V3's routing: sigmoid scores, group-limited
# (2 of 4 groups of 2 experts), a gated shared expert, the router in fp64, a bias on QKV alone (Qwen2's), the
# expert bias an axis of its own (`Layout.expert_bias`) as for the first MoE.
MODELS = {
    "dense": {"--num-layers": 8},
    "moe": {"--num-layers": 4, "--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 32,
            "--moe-shared-expert-intermediate-size": 32, "--moe-layer-freq": "([0]*1+[1]*3)", "--swiglu": True,
            "--disable-bias-linear": True, "--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001},
    "mla-mtp": {"--num-layers": 4, "--multi-latent-attention": True, "--q-lora-rank": 16, "--kv-lora-rank": 16,
                "--qk-head-dim": 8, "--qk-pos-emb-head-dim": 4, "--v-head-dim": 8, "--qk-layernorm": True,
                "--normalization": "RMSNorm", "--position-embedding-type": "rope", "--mtp-num-layers": 1},
    "moe-grouped": {"--num-layers": 4, "--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 32,
                    "--moe-router-score-function": "sigmoid", "--moe-router-num-groups": 4,
                    "--moe-router-group-topk": 2, "--moe-shared-expert-intermediate-size": 32,
                    "--moe-shared-expert-gate": True, "--moe-router-dtype": "fp64",
                    "--moe-layer-freq": "([0]*1+[1]*3)", "--swiglu": True, "--disable-bias-linear": True,
                    "--add-qkv-bias": True, "--moe-aux-loss-coeff": 0.01},
}
MOE_MODELS = ("moe", "moe-grouped")

# How data parallelism holds gradients, optimizer state and weights: a family (DDP, the distributed optimizer,
# FSDP2), drawn uniformly, then one of its spellings and options, drawn uniformly: the distributed optimizer by
# its flag, with its overlapped gather, or by Megatron-FSDP's strategy name; FSDP2 (docs/fsdp.md) by its flag,
# without the reshard after forward, or by the strategies that mean FSDP2 (optim_grads: no reshard after forward).
SHARDING = {"ddp": {}, "distributed-optimizer": {"--use-distributed-optimizer": True},
            "distributed-optimizer+overlap-gather": {"--use-distributed-optimizer": True,
                                                     "--overlap-param-gather": True},
            "distributed-optimizer:optim": {"--data-parallel-sharding-strategy": "optim"},
            "fsdp2": {"--use-torch-fsdp2": True},
            "fsdp2+no-reshard": {"--use-torch-fsdp2": True, "--no-torch-fsdp2-reshard-after-forward": True},
            "fsdp2:optim_grads": {"--data-parallel-sharding-strategy": "optim_grads"},
            "fsdp2:optim_grads_params": {"--data-parallel-sharding-strategy": "optim_grads_params"}}


def sharding_family(sharding: str) -> str:
    """ddp, distributed-optimizer or fsdp2."""
    return sharding.split("+")[0].split(":")[0]


SMALL_BUCKETS = 2000  # elements: many DDP buckets, their shards cutting through parameters

# Muon orthogonalises in fp32 here (its default is bf16, whose rounding the equivalences would measure instead).
OPTIMIZERS = {"adam": {}, "sgd": {"--optimizer": "sgd"}, "nag": {"--optimizer": "nag"},
              "muon": {"--optimizer": "muon", "--muon-fp32-matmul-prec": "highest"}}
METHOD_OPTIMIZERS = {"spectrain": ("sgd",), "pipenag": ("nag",)}  # the optimizer the method is defined with
ANY_OPTIMIZER = ("adam", "sgd", "muon")

RECOMPUTE = {"none": {}, "selective": {"--recompute-granularity": "selective"},
             "full-uniform": {"--recompute-granularity": "full", "--recompute-method": "uniform",
                              "--recompute-num-layers": 1},
             "full-block": {"--recompute-granularity": "full", "--recompute-method": "block",
                            "--recompute-num-layers": 1},
             "moe-layer": {"--moe-layer-recompute": True}}  # MoE models only
# How the layers split over the pipeline's virtual stages (docs/pipelines.md, "Uneven splits"): evenly; the first
# stage one layer short of its even share (--decoder-first-pipeline-num-layers, the rest even over the other stages:
# refused where it does not divide, or with --num-layers-per-virtual-pipeline-stage, as Megatron); or a
# --pipeline-model-parallel-layout moving one layer from the first virtual stage to the last (the MTP depth and the
# loss there; the layout names the chunks, so it replaces --num-layers-per-virtual-pipeline-stage).
SPLITS = ("even", "first", "layout")
CAPACITY = {"dropless": {}, "probs": {"--moe-expert-capacity-factor": 1.0},
            "position": {"--moe-expert-capacity-factor": 1.0, "--moe-token-drop-policy": "position"},
            "padded": {"--moe-expert-capacity-factor": 1.0, "--moe-pad-expert-input-to-capacity": True}}


@dataclass(frozen=True)
class Layout:
    world: int
    model: str = "dense"
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_comm: str = "p2p"
    pp: int = 1
    method: str = "1f1b"
    layers_per_virtual_stage: int | None = None
    update_interval: int | None = None  # asynchronous methods' --async-update-interval (None: the method's default)
    micro_batch: int = 1
    untied: bool = True
    optimizer: str = "adam"
    sharding: str = "ddp"
    small_buckets: bool = False
    recompute: str = "none"
    split: str = "even"  # SPLITS; pipelined layouts only
    # MoE only
    ep: int = 1
    etp: int | None = None  # None: Megatron's default, the TP size
    dispatcher: str = "alltoall"
    capacity: str = "dropless"
    grouped_gemm: bool = False
    load_balancing: str = "aux_loss"
    expert_bias: bool = False

    @property
    def is_async(self) -> bool:
        return self.method in ASYNC_METHODS

    @property
    def is_moe(self) -> bool:
        return self.model in MOE_MODELS

    @property
    def dp(self) -> int:
        """The data-parallel size (0 where TP x CP x PP does not divide the world)."""
        n = self.tp * self.cp * self.pp
        return self.world // n if self.world % n == 0 else 0

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size (0 where EP x expert TP does not divide the ranks of a stage)."""
        n = self.ep * (self.etp or self.tp)
        stage = self.tp * self.cp * self.dp
        return stage // n if stage and stage % n == 0 else 0

    def flags(self) -> dict:
        """pretrain_gpt.py's flags of this layout (tests/cli_args.flags_to_argv makes the argv)."""
        f = {**COMMON, **MODELS[self.model], "--tensor-model-parallel-size": self.tp,
             "--sequence-parallel": self.sequence_parallel, "--context-parallel-size": self.cp,
             "--pipeline-model-parallel-size": self.pp, "--pipeline-method": self.method,
             "--num-layers-per-virtual-pipeline-stage": self.layers_per_virtual_stage,
             "--async-update-interval": self.update_interval, "--micro-batch-size": self.micro_batch,
             "--untie-embeddings-and-output-weights": self.untied, **OPTIMIZERS[self.optimizer],
             **SHARDING[self.sharding], "--ddp-bucket-size": SMALL_BUCKETS if self.small_buckets else None,
             **RECOMPUTE[self.recompute]}
        if self.cp > 1:
            f["--cp-comm-type"] = self.cp_comm
        f.update(self._split_flags())
        if self.is_moe:
            f.update({"--expert-model-parallel-size": self.ep, "--expert-tensor-parallel-size": self.etp,
                      "--moe-token-dispatcher-type": self.dispatcher, **CAPACITY[self.capacity],
                      "--moe-grouped-gemm": self.grouped_gemm, "--moe-router-load-balancing-type": self.load_balancing})
            if self.expert_bias:
                f.update({"--moe-router-enable-expert-bias": True, "--moe-router-score-function": "sigmoid"})
        return f

    def _split_flags(self) -> dict:
        """The flags of `split` (nothing for the even split)."""
        layers = MODELS[self.model]["--num-layers"]
        if self.split == "first":
            return {"--decoder-first-pipeline-num-layers": max(0, layers // self.pp - 1)}
        if self.split != "layout":
            return {}
        per_chunk = self.layers_per_virtual_stage or layers // self.pp
        if layers % (self.pp * per_chunk):  # refused as the even split is (the layer-count rules)
            return {}
        stages = layers // per_chunk
        counts = [per_chunk] * stages
        counts[0], counts[-1] = counts[0] - 1, counts[-1] + 1
        tail = "m" * (MODELS[self.model].get("--mtp-num-layers") or 0) + "L"
        text = "|".join(("E" if vs == 0 else "") + "t" * n + (tail if vs == stages - 1 else "")
                        for vs, n in enumerate(counts))
        return {"--pipeline-model-parallel-layout": text, "--num-layers-per-virtual-pipeline-stage": None}

    def argv(self) -> list[str]:
        return flags_to_argv(self.flags())

    def name(self) -> str:
        """A short name for the table: the world, then what differs from a plain one-process run."""
        parts = [f"w{self.world}", self.model]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}:{self.cp_comm}")
        if self.pp > 1 or self.method != "1f1b":
            parts.append(f"pp{self.pp}:{self.method}")
        if self.layers_per_virtual_stage is not None:
            parts.append(f"lpv{self.layers_per_virtual_stage}")
        if self.update_interval is not None:
            parts.append(f"k{self.update_interval}")
        parts += [f"mbs{self.micro_batch}", self.optimizer]
        parts += [] if self.untied else ["tied"]
        parts += [] if self.sharding == "ddp" else [self.sharding]
        parts += [f"buckets:{SMALL_BUCKETS}"] if self.small_buckets else []
        parts += [] if self.recompute == "none" else [f"recompute:{self.recompute}"]
        parts += [] if self.split == "even" else [f"split:{self.split}"]
        if self.is_moe:
            parts.append(f"ep{self.ep}" + (f"/etp{self.etp}" if self.etp is not None else ""))
            parts.append(self.dispatcher)
            parts += [] if self.capacity == "dropless" else [f"capacity:{self.capacity}"]
            parts += ["grouped-gemm"] if self.grouped_gemm else []
            parts += [] if self.load_balancing == "aux_loss" else [self.load_balancing]
            parts += ["expert-bias"] if self.expert_bias else []
        return " ".join(parts)

    def reference(self) -> Layout:
        """The one-process run this layout must train like (synchronous methods; the asynchronous ones compare
        with their emulator, tools/layout_sweep.py): the same model, batch and optimizer on one process. The flags
        that change only where numbers are computed (dispatcher, grouped GEMM, recomputation, the distributed
        optimizer) are left at their defaults, so layouts share references."""
        return Layout(world=1, model=self.model, micro_batch=self.micro_batch, untied=self.untied,
                      optimizer=self.optimizer, capacity=self.capacity, load_balancing=self.load_balancing,
                      expert_bias=self.expert_bias)


# --------------------------------------------------------------------------------------------------
# Drawing layouts
# --------------------------------------------------------------------------------------------------


def _divisors(n: int, cap: int = 4) -> list[int]:
    return [d for d in (1, 2, 4, 8) if d <= cap and n % d == 0]


def draw(rng: random.Random) -> Layout:
    """One layout: sizes that mostly fit the world (one draw in ten free), the rest of the axes uniform."""
    world = rng.choice(WORLDS)
    free = rng.random() < 0.1
    if free:
        tp, cp, pp = rng.choice(SIZES), rng.choice(SIZES), rng.choice(SIZES)
    else:  # PP first: it carries the pipeline methods
        pp = rng.choice(_divisors(world))
        tp = rng.choice(_divisors(world // pp))
        cp = rng.choice(_divisors(world // (pp * tp)))
    model = rng.choice(tuple(MODELS))
    method = rng.choice(SYNC_METHODS + ASYNC_METHODS) if pp > 1 or free else "1f1b"
    is_async = method in ASYNC_METHODS
    family = rng.choice(sorted({sharding_family(s) for s in SHARDING}))
    recompute = [r for r in RECOMPUTE if r != "moe-layer" or model in MOE_MODELS]
    layout = Layout(
        world=world, model=model, tp=tp, sequence_parallel=tp > 1 and rng.random() < 0.7, cp=cp,
        cp_comm=rng.choice(("p2p", "allgather")) if cp > 1 else "p2p", pp=pp, method=method,
        layers_per_virtual_stage=rng.choice((None, 1, 2)) if pp > 1 else None,
        update_interval=rng.choice((None, 2, 4)) if is_async else None, micro_batch=rng.choice((1, 2)),
        untied=is_async or rng.random() < 0.5, optimizer=rng.choice(METHOD_OPTIMIZERS.get(method, ANY_OPTIMIZER)),
        sharding=rng.choice([s for s in SHARDING if sharding_family(s) == family]),
        small_buckets=rng.random() < 0.3, recompute=rng.choice(recompute))
    if model in MOE_MODELS:
        stage = world // pp if world % pp == 0 else world
        ep = rng.choice((1, 2, 4, 8)) if free else rng.choice(_divisors(stage, 8))
        etp = rng.choice((None, 1, 2)) if free else rng.choice([None] + _divisors(stage // ep, 2))
        layout = dataclasses.replace(
            layout, ep=ep, etp=etp, dispatcher=rng.choice(("alltoall", "allgather")),
            capacity=rng.choice(tuple(CAPACITY)), grouped_gemm=rng.random() < 0.5,
            load_balancing=rng.choice(("aux_loss", "seq_aux_loss")), expert_bias=rng.random() < 0.5)
        if is_async and layout.dp > 1:
            # The emulator sees each DP rank group's micro-batches as one micro-batch (tools/layout_sweep.py);
            # the routers' losses and capacities are per micro-batch, so only per-sequence ones compare.
            layout = dataclasses.replace(layout, capacity="dropless", load_balancing="seq_aux_loss")
    if layout.pp > 1:  # its own generator: the draws above stay those of the space without this axis
        split_rng = random.Random(zlib.crc32(layout.name().encode()))
        first = ("first",) if layout.layers_per_virtual_stage is None else ()  # Megatron: not with interleaving
        layout = dataclasses.replace(layout, split=split_rng.choice(("even", "even", "layout") + first))
    return layout


def sample(seed: int, count: int, where=None,
           max_draws: int = 100_000) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Draw (random.Random(seed)) until `count` distinct layouts are accepted: (accepted, [(refused, its line)]),
    each in the order first drawn. `where(layout)`: keep only the draws for which it is True."""
    rng = random.Random(seed)
    accepted, refused, seen = [], [], set()
    for _ in range(max_draws):
        if len(accepted) == count:
            break
        layout = draw(rng)
        if layout in seen or (where is not None and not where(layout)):
            continue
        seen.add(layout)
        line = verdict(layout)
        if line is None:
            accepted.append(layout)
        else:
            refused.append((layout, line))
    return accepted, refused


# --------------------------------------------------------------------------------------------------
# What the start-up rules say
# --------------------------------------------------------------------------------------------------


def verdict(layout: Layout) -> str | None:
    """None when the start-up rules accept the layout, else the refusal's line (the rules themselves:
    config.parse_args and config_rules.validate at the layout's world size; no process group is made)."""
    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    from megatron_po.errors import ConfigError
    try:
        validate(parse_args(layout.argv()), layout.world, "gpt")
    except ConfigError as e:
        return str(e)
    return None


class ProcessGroupMade(Exception):
    """A refused layout got as far as making a process group."""


def refusal_at_startup(layout: Layout) -> tuple[int, str]:
    """(exit code, stderr) of pretrain_gpt.py's entry (`training.run_main`) on the layout, as rank 0 of its world,
    in this process, with torch.distributed.init_process_group replaced by one that raises ProcessGroupMade: a
    refusal made before any process group exits 2 with its line; a later one raises ProcessGroupMade."""
    import torch.distributed as dist

    from megatron_po.training import run_main

    def no_process_group(*args, **kwargs):
        raise ProcessGroupMade(layout.name())

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(layout.world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    err = io.StringIO()
    assert not dist.is_initialized(), "refusal_at_startup runs in a process without a process group"
    with mock.patch.dict(os.environ, env), mock.patch.object(dist, "init_process_group", no_process_group), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_main(layout.argv())
    return code, err.getvalue()


def refusal_problem(layout: Layout, line: str) -> str | None:
    """What is wrong with the refusal of a refused layout (None: one `error:` line naming a flag, the rules' own
    line, made before any process group)."""
    try:
        code, err = refusal_at_startup(layout)
    except ProcessGroupMade:
        return "refused only after a process group was made"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code != 2 or len(lines) != 1:
        return f"exit code {code} and {len(lines)} lines on stderr: {err[-300:]!r}"
    if lines[0] != f"error: {line}":
        return f"the entry says {lines[0]!r}, the rules {line!r}"
    if "--" not in line:
        return f"the line names no flag: {line!r}"
    return None
