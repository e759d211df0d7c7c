"""Multi-latent attention end to end through pretrain_gpt.py's entry (`training.run_main`) on the bundled corpus, with
a DeepSeek-V3 recipe's MLA flags (sizes shrunk, every other MLA flag kept: YaRN factor 40, mscale 1 / 1,
--qk-layernorm, --kv-channels and --no-rope-fusion as the recipes pass them), bf16 with the softmax in fp32, and
MoE flags this code takes (sigmoid scores, the expert bias, shared experts, a dense first layer, grouped GEMM,
alltoall), and its multi-token prediction (one depth, factor 0.3).

- Under PipeOptim at PP 2 it trains: the loss falls by more than 0.3 over 12 iterations; the log's model TFLOP/s are
  the MLA count (flops.py, more than 5 % off the count of plain attention here) times the tokens per second.
- Bad input stops at start-up: exit code 2 and one `error:` line naming the flags (MLA's sizes without
  --multi-latent-attention, MLA with --group-query-attention); every MLA rule's line is a row of
  tests/test_config_rules.py.
"""

import pytest
from dist_harness import run_distributed
from test_checkpoint import run_capturing
from test_pretrain_gpt import base_args, read_metrics, run_pretrain

DEEPSEEK_V3 = {  # MODEL_ARGS of DeepSeek-V3's Megatron recipe, shrunk: MLA, then MoE
    "--multi-latent-attention": True, "--q-lora-rank": 32, "--kv-lora-rank": 32, "--qk-head-dim": 16,
    "--qk-pos-emb-head-dim": 16, "--v-head-dim": 16, "--qk-layernorm": True, "--rotary-scaling-factor": 40,
    "--mscale": 1.0, "--mscale-all-dim": 1.0, "--rope-type": "yarn", "--rotary-base": 10000,
    "--position-embedding-type": "rope", "--no-rope-fusion": True, "--kv-channels": 16, "--normalization": "RMSNorm",
    "--norm-epsilon": 1e-6, "--swiglu": True, "--untie-embeddings-and-output-weights": True,
    "--disable-bias-linear": True, "--attention-softmax-in-fp32": True, "--bf16": True,
    "--num-experts": 4, "--moe-layer-freq": "([0]*1+[1]*3)", "--moe-ffn-hidden-size": 32,
    "--moe-shared-expert-intermediate-size": 32, "--moe-router-topk": 2, "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": True, "--moe-router-topk-scaling-factor": 2.5,
    "--moe-router-load-balancing-type": "seq_aux_loss", "--moe-aux-loss-coeff": 1e-4,
    "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": True,
    "--mtp-num-layers": 1, "--mtp-loss-scaling-factor": 0.3,
    "--num-layers": 4, "--train-iters": 12, "--log-interval": 2, "--eval-interval": 6, "--log-throughput": True,
    "--global-batch-size": 8,
}


def test_deepseek_v3_shaped_run_trains_under_pipeoptim(corpus, tmp_path):
    world, flags = 2, {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim"}
    import dataclasses

    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    out = tmp_path / "run"
    out.mkdir()
    argv = base_args(corpus, out, **{**DEEPSEEK_V3, **flags})
    codes = run_distributed(run_pretrain, world, args=(argv,), timeout=300)
    assert codes == [0] * world
    records = [r for r in read_metrics(out / "metrics.jsonl") if "lm_loss" in r]
    losses = [r["lm_loss"] for r in records]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    cfg = parse_args(argv)
    mla = gpt_flops_per_token(cfg, 512)  # the corpus's 500 tokens padded to 512
    cfg.model = dataclasses.replace(cfg.model, multi_latent_attention=False)
    plain = gpt_flops_per_token(cfg, 512)
    for r in records:  # the logged TFLOP/s: MLA's count per token x tokens/s over the ranks
        assert r["tflops_per_gpu"] * 1e12 * world / r["tokens_per_sec"] == pytest.approx(mla, rel=1e-9)
    assert abs(plain / mla - 1) > 0.05


@pytest.mark.parametrize("flags,words", [
    ({"--kv-lora-rank": 32}, "--kv-lora-rank applies to multi-latent attention: add --multi-latent-attention"),
    ({"--multi-latent-attention": True, "--group-query-attention": True},
     "--group-query-attention with --multi-latent-attention"),
], ids=["size-without-mla", "mla-with-gqa"])
def test_bad_mla_input_is_one_line_at_start_up(corpus, tmp_path, flags, words, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = run_capturing(base_args(corpus, tmp_path, **flags))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert words in lines[0], lines
