"""Today's open MoE models train here from their own Megatron recipes (issue 54).

Each constant below is one public recipe's MODEL_ARGS, kept flag for flag in the recipe's order, copied from

- DeepSeek-V3: THUDM/slime scripts/models/deepseek-v3.sh @ 624b824a898a, plus multi-token prediction as
  NVIDIA's Megatron-MoE-ModelZoo model_configs/benchmarking/DeepSeek-V3.yaml @ e8650517d60d writes it
  (`--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1`; slime passes MTP in its run scripts, not in MODEL_ARGS);
- Kimi K2: THUDM/slime scripts/models/kimi-k2.sh @ 624b824a898a;
- Moonlight: THUDM/slime scripts/models/moonlight.sh @ 624b824a898a;
- GLM-4.5: THUDM/slime scripts/models/glm4.5-355B-A32B.sh @ 624b824a898a;
- Qwen3-30B-A3B: THUDM/slime scripts/models/qwen3-30B-A3B.sh @ 624b824a898a

(every flag's meaning here: docs/moe.md, "DeepSeek-V3 family").
Only the sizes are shrunk, by one substitution for all five: layers 4 (the recipes' dense first layers:
DeepSeek-V3's 3 -> 1, Kimi K2's, Moonlight's and GLM-4.5's 1 kept, Qwen3's 0 kept), hidden 64, dense FFN 128,
attention heads 4 (GQA: 2 query groups), --kv-channels 16; MLA's q-lora-rank 32, kv-lora-rank 32, qk-head-dim 16,
qk-pos-emb-head-dim 8, v-head-dim 16; experts 16 of FFN 16 (shared experts 16, Moonlight's 2 x 16 as its script
computes), vocabulary 128. Everything else keeps the recipe's value: top-k (8, Moonlight 6), the groups (DeepSeek-V3
8 groups of which 4: 16 experts in groups of 2; Kimi K2 and Moonlight 1 and 1), scaling factors, score functions,
rotary base and percent, YaRN factor and mscales, norm epsilon, the switches.

Left out: nothing. slime's MODEL_ARGS hold model flags only; the launcher-owned ones (data, tokenizer, batch,
optimizer, checkpointing, logging, parallel sizes: slime's run scripts, and the non-model half of ModelZoo's yaml)
are not part of them and are replaced here by LAUNCH: mock data through NullTokenizer (the recipes' --vocab-size
is its vocabulary), sequence 32, micro-batch 2, global batch 8, the lr, iterations, logging,
no dropout (ModelZoo's yamls pass --attention-dropout 0.0 --hidden-dropout 0.0), the parallel layout.

- Every recipe's full command line passes the start-up rules at EP 2 on 2 ranks (config_rules.validate: no process).
- Each model trains on 2 forked gloo ranks at EP 2 (the synchronous schedule) and at PP 2 under PipeOptim (EP 1:
  2 ranks hold the two stages; DeepSeek-V3 and Kimi K2 split unevenly there, PP2_SPLIT), its LM loss falling over
  8 iterations; the start-up lines say what runs (the routing, MLA, MTP, the uneven split, the switches accepted
  without effect). One launch per layout runs the five models in sequence.
- At EP 2 DeepSeek-V3 also takes the launcher, logging and checkpoint flags of the public recipes (ZOO_LAUNCH:
  ModelZoo's DeepSeek-V3.yaml, Megatron-LM's Kimi-K2-Instruct.sh conf; config_recipe.py): its TensorBoard event
  file holds the timers' throughput, the memory and the validation perplexity they ask for.
"""

import json
import os
import re

import pytest
from cli_args import flags_to_argv
from dist_harness import run_distributed, run_mains

from tools.golden import warm_imports

MOE_LAYER_FREQ_1_DENSE = "[0,1,1,1]"  # slime's `printf -v MOE_LAYER_FREQ "[%s]"` over its arr, 4 layers

DEEPSEEK_V3 = [
    "--disable-bias-linear",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--ffn-hidden-size", "128",
    "--num-attention-heads", "4",
    "--kv-channels", "16",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--vocab-size", "128",

    "--multi-latent-attention",
    "--q-lora-rank", "32",
    "--kv-lora-rank", "32",
    "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "16",
    "--qk-layernorm",
    "--rotary-scaling-factor", "40",
    "--rotary-base", "10000",
    "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--attention-softmax-in-fp32",
    "--no-rope-fusion",

    # moe
    "--num-experts", "16",
    "--moe-layer-freq", MOE_LAYER_FREQ_1_DENSE,
    "--moe-ffn-hidden-size", "16",
    "--moe-router-topk", "8",
    "--moe-shared-expert-intermediate-size", "16",
    "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0",
    "--moe-router-bias-update-rate", "0",
    "--moe-router-group-topk", "4",
    "--moe-router-num-groups", "8",
    "--moe-grouped-gemm",
    "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",

    # multi-token prediction (ModelZoo's DeepSeek-V3.yaml)
    "--mtp-num-layers", "1",
    "--mtp-loss-scaling-factor", "0.1",
]

KIMI_K2 = [
    "--disable-bias-linear",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--ffn-hidden-size", "128",
    "--num-attention-heads", "4",
    "--kv-channels", "16",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--vocab-size", "128",

    "--multi-latent-attention",
    "--q-lora-rank", "32",
    "--kv-lora-rank", "32",
    "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "16",
    "--qk-layernorm",
    "--rotary-scaling-factor", "32.0",
    "--rotary-base", "50000",
    "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--attention-softmax-in-fp32",
    "--no-rope-fusion",

    # moe
    "--num-experts", "16",
    "--moe-layer-freq", MOE_LAYER_FREQ_1_DENSE,
    "--moe-ffn-hidden-size", "16",
    "--moe-router-topk", "8",
    "--moe-shared-expert-intermediate-size", "16",
    "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0",
    "--moe-router-bias-update-rate", "0",
    "--moe-router-group-topk", "1",
    "--moe-router-num-groups", "1",
    "--moe-grouped-gemm",
    "--moe-router-topk-scaling-factor", "2.827",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",
]

MOONLIGHT = [  # MOE_FFN_HIDDEN=16, MOE_SHARED_EXPERTS=2, MOE_ROUTER_TOPK_SCALING_FACTOR=2.446 (the script's variables)
    "--disable-bias-linear",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--ffn-hidden-size", "128",
    "--num-attention-heads", "4",
    "--kv-channels", "16",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-5",
    "--rotary-percent", "1.0",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--no-masked-softmax-fusion",
    "--vocab-size", "128",

    "--multi-latent-attention",
    "--kv-lora-rank", "32",
    "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "16",
    "--qk-layernorm",
    "--rotary-scaling-factor", "1",
    "--rotary-base", "50000",
    "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--attention-softmax-in-fp32",
    "--no-rope-fusion",

    # moe
    "--num-experts", "16",
    "--moe-layer-freq", MOE_LAYER_FREQ_1_DENSE,
    "--moe-ffn-hidden-size", "16",
    "--moe-router-topk", "6",
    "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0",
    "--moe-router-bias-update-rate", "0",
    "--moe-router-group-topk", "1",
    "--moe-router-num-groups", "1",
    "--moe-grouped-gemm",
    "--moe-router-topk-scaling-factor", "2.446",
    "--moe-token-drop-policy", "probs",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",
]

GLM_4_5 = [  # N_DENSE_LAYERS=1, N_MOE_LAYERS=3
    "--disable-bias-linear",
    "--qk-layernorm",
    "--group-query-attention",
    "--num-attention-heads", "4",
    "--num-query-groups", "2",
    "--kv-channels", "16",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--ffn-hidden-size", "128",

    "--add-qkv-bias",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--rotary-percent", "0.5",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--vocab-size", "128",

    "--rotary-base", "1000000",

    # moe
    "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "16",
    "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "8",
    "--moe-router-topk-scaling-factor", "2.5",
    "--moe-layer-freq", "[0]*1+[1]*3",
    "--num-experts", "16",
    "--moe-grouped-gemm",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]

QWEN3_30B_A3B = [  # FIRST_K_DENSE_REPLACE=0: every layer MoE
    "--disable-bias-linear",
    "--qk-layernorm",
    "--group-query-attention",
    "--num-attention-heads", "4",
    "--num-query-groups", "2",
    "--kv-channels", "16",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--ffn-hidden-size", "128",

    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6",
    "--rotary-percent", "1.0",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--vocab-size", "128",

    "--rotary-base", "1000000",

    # moe
    "--moe-ffn-hidden-size", "16",
    "--moe-router-score-function", "softmax",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "8",
    "--moe-layer-freq", "[1,1,1,1]",
    "--num-experts", "16",
    "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]

RECIPES = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2, "moonlight": MOONLIGHT, "glm_4_5": GLM_4_5,
           "qwen3_30b_a3b": QWEN3_30B_A3B}

# What a launcher adds around MODEL_ARGS (none of it a model flag): data, batch, schedule, logging, the layout.
LAUNCH = {"--mock-data": True, "--tokenizer-type": "NullTokenizer", "--seq-length": 32,
          "--max-position-embeddings": 32, "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 8,
          "--lr": 3e-3, "--min-lr": 3e-4, "--lr-warmup-iters": 1, "--attention-dropout": 0.0, "--hidden-dropout": 0.0,
          "--log-interval": 2, "--eval-iters": 0, "--seed": 5}
EP2 = {"--expert-model-parallel-size": 2}

# The launcher, logging and checkpoint flags around MODEL_ARGS in NVIDIA's Megatron-MoE-ModelZoo
# model_configs/benchmarking/DeepSeek-V3.yaml @ e8650517d60d (in its order; those that set the run's layout, precision,
# kernels or sizes left to LAUNCH: --lr-warmup-init scaled with LAUNCH's lr as the yaml's is with its own), then
# Megatron-LM's examples/post_training/modelopt/conf/moonshotai/Kimi-K2-Instruct.sh @ d98e8a64ddf3 (its padded
# vocabulary, 163840, shrunk to the 256 rows the other runs pad 129 ids to: the loss criterion compares alike),
# ModelZoo's Mixtral-8x7B.yaml (--no-ckpt-fully-parallel-save) and the other Megatron launcher flags
# config_recipe.py adds. Each stopped at start-up as unknown before.
ZOO_LAUNCH = [
    "--use-mcore-models", "--use-flash-attn", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native",
    "--manual-gc", "--manual-gc-interval", "10", "--no-create-attention-mask-in-dataloader",
    "--lr-warmup-init", "3e-4",
    "--no-load-optim", "--no-load-rng", "--auto-detect-ckpt-format", "--dist-ckpt-strictness", "log_all",
    "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-throughput", "--logging-level", "40", "--enable-experimental",
    "--padded-vocab-size", "256", "--trust-remote-code",
    "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--moe-per-layer-logging",
    "--tensorboard-queue-size", "100",
]
PP2_PIPEOPTIM = {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim"}
# At PP 2 two recipes split their 4 layers unevenly, as their Megatron launchers do at scale: DeepSeek-V3 by the
# model zoo's --pipeline-model-parallel-layout "Et|(tt|)*30mL" shrunk to two stages (the embedding and every layer,
# then a last stage of the MTP depth and the loss alone, no transformer layer of the model's, as the zoo's), Kimi K2
# by --decoder-first-pipeline-num-layers (1 | 3).
PP2_SPLIT = {"deepseek_v3": {"--pipeline-model-parallel-layout": "Etttt|mL"},
             "kimi_k2": {"--decoder-first-pipeline-num-layers": 1}}

# The engine flags slime's run scripts pass around these MODEL_ARGS (THUDM/slime @ 624b824a898a): OPTIMIZER_ARGS'
# CPU offload with the precision-aware optimizer (run-deepseek-r1.sh, run-kimi-k2-Instruct.sh,
# run-moonlight-16B-A3B.sh, run-glm4.7-355B-A32B.sh, which sources glm4.5-355B-A32B.sh's MODEL_ARGS, and
# run-qwen3-30B-A3B.sh), and DeepEP's flex dispatcher (the same scripts but Qwen3's). Accepted here with start-up
# lines (a CPU run: the optimizer is on the CPU; flex runs the alltoall dispatcher); each stopped as unknown before.
SLIME_OFFLOAD = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]
SLIME_DEEPEP = ["--moe-enable-deepep", "--moe-token-dispatcher-type", "flex"]
SLIME_RUN = {"deepseek_v3": SLIME_OFFLOAD + SLIME_DEEPEP, "kimi_k2": SLIME_OFFLOAD + SLIME_DEEPEP,
             "moonlight": SLIME_OFFLOAD + SLIME_DEEPEP, "glm_4_5": SLIME_OFFLOAD + SLIME_DEEPEP[1:] + SLIME_DEEPEP[:1],
             "qwen3_30b_a3b": SLIME_OFFLOAD}


def command_line(recipe: list[str], out: str | None = None, **layout) -> list[str]:
    metrics = {"--metrics-file": os.path.join(out, "metrics.jsonl")} if out else {}
    return recipe + flags_to_argv({**LAUNCH, **layout, **metrics})


# --------------------------------------------------------------------------------------------------
# The recipes as copied
# --------------------------------------------------------------------------------------------------


def test_the_recipes_are_copied_flag_for_flag():
    """The constants hold what the recipes hold: the same flags in the same order (the sizes aside, checked by
    `test_every_recipe_passes_the_start_up_rules`); a flag dropped or added here fails."""
    flags = {name: [a for a in argv if a.startswith("--")] for name, argv in RECIPES.items()}
    mla = ["--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
           "--v-head-dim", "--qk-layernorm", "--rotary-scaling-factor", "--rotary-base", "--mscale",
           "--mscale-all-dim", "--attention-softmax-in-fp32", "--no-rope-fusion"]
    assert flags["kimi_k2"] == [f for f in flags["deepseek_v3"] if not f.startswith("--mtp-")]
    assert flags["moonlight"][flags["moonlight"].index("--multi-latent-attention"):][:12] == \
        [f for f in mla if f != "--q-lora-rank"]  # no query compression, as Moonlight
    counts = {"deepseek_v3": 43 + 2, "kimi_k2": 43, "moonlight": 45, "glm_4_5": 33, "qwen3_30b_a3b": 28}
    assert {name: len(f) for name, f in flags.items()} == counts  # the recipes' flag counts (+ MTP's two)
    for name, argv in RECIPES.items():
        assert len(set(flags[name])) == len(flags[name]), name  # no flag given twice
        assert "--moe-router-dtype" in argv and "--moe-permute-fusion" in argv, name  # the flags main refused


# --------------------------------------------------------------------------------------------------
# Start-up rules (no process)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_passes_the_start_up_rules(name):
    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    cfg = parse_args(command_line(RECIPES[name], **EP2))
    validate(cfg, 2)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_ffn_hidden_size) == (4, 64, 16, 16)
    assert m.moe_router_dtype == "fp32" and m.moe_permute_fusion
    validate(parse_args(command_line(RECIPES[name], **PP2_PIPEOPTIM, **PP2_SPLIT.get(name, {}))), 2)
    for layout in (EP2, PP2_PIPEOPTIM):  # with slime's run-script engine flags
        validate(parse_args(command_line(RECIPES[name] + SLIME_RUN[name], **layout)), 2)


# --------------------------------------------------------------------------------------------------
# Training: each layout one launch, the five models in sequence
# --------------------------------------------------------------------------------------------------


STARTUP = {  # what each model's start-up lines say (rank 0's stdout)
    "deepseek_v3": ["> MoE: 16 experts, top-8 in 4 of 8 groups (sigmoid, router in fp32)"],
    "kimi_k2": ["> MoE: 16 experts, top-8 (sigmoid, router in fp32)"],
    "moonlight": ["> MoE: 16 experts, top-6 (sigmoid, router in fp32)"],
    "glm_4_5": ["> MoE: 16 experts, top-8 (sigmoid, router in fp32)"],
    "qwen3_30b_a3b": ["> MoE: 16 experts, top-8 (softmax, router in fp32)"],
}


@pytest.mark.parametrize("layout", ["ep2", "pp2_pipeoptim"])
def test_every_recipe_trains_with_its_loss_falling(layout, tmp_path, capfd):
    flags = EP2 if layout == "ep2" else PP2_PIPEOPTIM
    split = {} if layout == "ep2" else PP2_SPLIT
    runs = [command_line(argv + SLIME_RUN[name], str(tmp_path / name), **flags, **split.get(name, {}))
            for name, argv in RECIPES.items()]
    if layout == "ep2":  # DeepSeek-V3 with the recipes' launcher flags, validated at iterations 4 and 8
        zoo = tmp_path / "deepseek_v3"  # no --load, as ModelZoo's yaml (--no-load-optim/-rng then act on nothing)
        runs[0] = command_line(DEEPSEEK_V3 + ZOO_LAUNCH, str(zoo), **flags, **{
            "--tensorboard-dir": str(zoo / "tb"), "--eval-iters": 1, "--eval-interval": 4,
            "--save": str(zoo / "ck"), "--save-interval": 500})
    warm_imports()  # once here, not in every forked rank (~20 s on a loaded machine)
    assert run_distributed(run_mains, 2, args=(runs,), timeout=300) == [[0] * len(RECIPES)] * 2
    out = capfd.readouterr().out
    for name in RECIPES:
        with open(tmp_path / name / "metrics.jsonl") as f:
            records = [r for r in map(json.loads, f) if "lm_loss" in r]
        losses = [r["lm_loss"] for r in records]
        assert len(losses) == 4 and losses[-1] < losses[0] - 0.05, (name, losses)
        if name == "deepseek_v3":
            assert all(r["mtp_loss"] > 0 for r in records), records
        for line in STARTUP[name]:
            assert line in out, (name, line)
    assert re.search(r"--moe-permute-fusion.*accepted, no effect here", out), out[-3000:]
    assert out.count("> --optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d: accepted, no effect here") == \
        len(RECIPES) - (layout == "ep2")  # all but ep2's DeepSeek-V3, which carries ModelZoo's launcher flags
    assert len(re.findall(r"--moe-token-dispatcher-type flex, --moe-enable-deepep: accepted, no effect here", out)) \
        == (3 if layout == "ep2" else 4)
    if layout == "ep2":
        from test_tensorboard import read_tensorboard
        scalars, _ = read_tensorboard(zoo / "tb")
        asked = {"tokens_per_sec", "tflops_per_gpu", "memory_gb", "max_memory_gb", "val_ppl"}
        assert asked | {"lm_loss", "mtp_loss", "val_loss"} <= scalars.keys(), sorted(scalars)
        assert sorted(scalars["val_ppl"]) == [4, 8]
        assert os.path.isdir(zoo / "ck" / "iter_0000008")
    else:  # DeepSeek-V3's layout and Kimi K2's first-stage size, as split
        for flag, split in (("--pipeline-model-parallel-layout", "4 | 0"), ("--decoder-first-pipeline-num-layers",
                                                                            "1 | 3")):
            assert f"> pipeline split ({flag}): transformer layers per virtual stage {split}" in out, flag
