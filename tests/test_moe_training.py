"""MoE end to end through pretrain_gpt.py's entry (`training.run_main`) on the bundled corpus, and its bad input.

- `--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2` on 2 processes (alltoall, grouped GEMM,
  aux loss, z-loss, DeepSeek-V3's expert bias) trains like the one-process run (loop over the experts) at the
  same global batch: |delta loss| <= 2e-3 at every logged iteration (fp32, reduction orders, over 12 AdamW
  steps with clipping: the grad norm counts every expert once, the expert bias moves by the tokens of both
  ranks) and its loss falls. The start-up says where the experts are.
  The log shows, per MoE layer and log window, the aux loss and z-loss, tokens per expert (max / mean) and dropped
  tokens, summed over the ranks: equal to the one-process run's (losses within 1e-4 relative, the busiest expert's
  tokens within 5 of 512; measured: 1e-7 and equal), the mean the closed form 2 x 16 x 64 x 2 / 8 exactly.
- PipeOptim at PP 2 x EP 2 with the distributed optimizer trains, and logs the routers' numbers at each evaluation's
  cut in its stream and at its drains: over the run, the mean tokens per expert its closed form exactly.
- `--help` lists the issue's MoE flags (test_megatron_flags checks that it lists every flag of the table).
- Impossible settings stop at start-up with exit code 2 and one `error:` line naming the flags.
"""

import io
import contextlib

import pytest
from dist_harness import run_distributed
from test_pretrain_gpt import base_args, read_metrics, run_pretrain

MOE = {"--num-experts": 8, "--moe-router-topk": 2, "--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001,
       "--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": True,
       "--moe-router-bias-update-rate": 0.01, "--moe-ffn-hidden-size": 64, "--train-iters": 12, "--log-interval": 2,
       "--eval-interval": 6}


def run(corpus, tmp_path, name, world, **flags):
    out = tmp_path / name
    out.mkdir()
    codes = run_distributed(run_pretrain, world, args=(base_args(corpus, out, **{**MOE, **flags}),), timeout=300)
    assert codes == [0] * world
    return read_metrics(out / "metrics.jsonl")


def test_expert_parallel_training_tracks_the_one_process_run(corpus, tmp_path, capfd):
    single = run(corpus, tmp_path, "single", 1)
    parallel = run(corpus, tmp_path, "ep2", 2, **{"--expert-model-parallel-size": 2,
                                                 "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": True})
    out = capfd.readouterr().out
    assert "> MoE: 8 experts, top-2 (sigmoid), in layers [0, 1]; EP 2 x expert TP 1 per stage; alltoall" in out
    la, lb = ([r["lm_loss"] for r in m if "lm_loss" in r] for m in (single, parallel))
    assert len(la) == len(lb) == 6 and la[-1] < la[0] - 0.3, la
    for x, y in zip(la, lb):
        assert abs(x - y) <= 2e-3, (la, lb)
    ga, gb = ([r["grad_norm"] for r in m if "grad_norm" in r] for m in (single, parallel))
    for x, y in zip(ga, gb):
        assert abs(x - y) <= 1e-3 * x, (ga, gb)
    va, vb = ([r["val_loss"] for r in m if "val_loss" in r] for m in (single, parallel))
    assert len(va) == 2 and all(abs(x - y) <= 2e-3 for x, y in zip(va, vb)), (va, vb)

    # What the routers did, per layer and log window, summed over the ranks: the same as one process.
    assert out.count(" MoE layers 0, 1 | aux loss ") == 2 * 6 and "| tokens per expert max/mean " in out
    for a, b in zip(*([r for r in m if "lm_loss" in r] for m in (single, parallel))):
        for layer in (0, 1):
            key = f"/layer{layer}"
            # Dropless: every token of the window (2 iterations x 16 x 64) goes to 2 of the 8 experts.
            assert a["moe/tokens_per_expert_mean" + key] == b["moe/tokens_per_expert_mean" + key] == 2 * 16 * 64 * 2 / 8
            assert a["moe/dropped_tokens" + key] == b["moe/dropped_tokens" + key] == 0
            assert abs(a["moe/tokens_per_expert_max" + key] - b["moe/tokens_per_expert_max" + key]) <= 5, (a, b)
            for loss in ("aux_loss", "z_loss"):
                assert a[f"moe/{loss}{key}"] > 0 and abs(a[f"moe/{loss}{key}"] / b[f"moe/{loss}{key}"] - 1) <= 1e-4
        assert a["moe/aux_loss"] == pytest.approx((a["moe/aux_loss/layer0"] + a["moe/aux_loss/layer1"]) / 2)


@pytest.mark.parametrize("flags,world,words", [
    ({"--num-experts": 6, "--expert-model-parallel-size": 4}, 4, "--num-experts (6) is not divisible by "
                                                                  "--expert-model-parallel-size (4)"),
    ({"--num-experts": 8, "--moe-router-topk": 10}, 1, "--moe-router-topk (10) must be in [1, --num-experts (8)]"),
    ({"--num-experts": 8, "--expert-model-parallel-size": 4}, 2, "= 4 does not divide the ranks of a pipeline stage"),
    ({"--num-experts": 8, "--moe-pad-expert-input-to-capacity": True}, 1, "needs --moe-expert-capacity-factor"),
    ({"--num-experts": 8, "--moe-router-enable-expert-bias": True}, 1, "needs --moe-router-score-function sigmoid"),
    ({"--num-experts": 8, "--moe-grouped-gemm": True, "--moe-ffn-hidden-size": 30}, 1,
     "--moe-grouped-gemm cannot run the float32 expert GEMMs here: dimensions [30]"),
    ({"--num-experts": 8, "--moe-layer-freq": "[0]*3"}, 1, "3 entries for --num-layers 2"),
    ({"--expert-model-parallel-size": 2}, 2, "--expert-model-parallel-size applies to a mixture of experts"),
    ({"--num-experts": 8, "--moe-input-jitter-eps": 0.01}, 1, "--moe-input-jitter-eps is Megatron's, not implemented"),
    ({"--num-experts": 8, "--moe-router-num-groups": 3, "--moe-router-group-topk": 2}, 1,
     "--num-experts (8) is not divisible by --moe-router-num-groups (3)"),
], ids=["experts-vs-ep", "topk", "ep-vs-dp", "pad", "bias-sigmoid", "grouped-gemm-dims", "layer-freq",
        "ep-needs-experts", "refused", "groups"])
def test_impossible_settings_are_one_line_at_start_up(corpus, tmp_path, flags, world, words, monkeypatch):
    """In-process (a world size from the environment, as torchrun gives it): exit code 2, one error line."""
    from megatron_po.training import run_main
    monkeypatch.setenv("WORLD_SIZE", str(world))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(base_args(corpus, tmp_path, **flags))
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert words in lines[0], lines


ISSUE_FLAGS = ["--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-layer-freq",
               "--moe-shared-expert-intermediate-size", "--moe-router-score-function", "--moe-router-pre-softmax",
               "--moe-router-topk-scaling-factor", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
               "--moe-z-loss-coeff", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
               "--moe-expert-capacity-factor", "--moe-token-drop-policy", "--moe-pad-expert-input-to-capacity",
               "--moe-token-dispatcher-type", "--moe-grouped-gemm", "--expert-model-parallel-size",
               "--expert-tensor-parallel-size"]


def test_help_lists_the_moe_flags():
    from megatron_po.config import build_parser
    from tools import megatron_flags_table
    helped = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    assert all(flag in helped and helped[flag] for flag in ISSUE_FLAGS), [f for f in ISSUE_FLAGS if f not in helped]
    assert set(ISSUE_FLAGS) <= {flag for flag, _ in megatron_flags_table.flag_rows()}  # what --help prints


def test_pipeoptim_with_experts_over_pp_ep_and_the_distributed_optimizer_trains(corpus, tmp_path):
    """`--pipeline-method pipeoptim` on an MoE GPT through run_main at PP 2 x DP 2 with the experts split over
    the two DP ranks of each stage (EP 2), the distributed optimizer (experts sharded over their expert-data-
    parallel group, here of one rank) and the expert bias: it trains (the loss falls) and logs a grad norm at
    every logged iteration."""
    flags = {"--pipeline-model-parallel-size": 2, "--untie-embeddings-and-output-weights": True,
             "--pipeline-method": "pipeoptim", "--expert-model-parallel-size": 2, "--use-distributed-optimizer": True,
             "--num-layers": 4}
    records = run(corpus, tmp_path, "pipeoptim", 4, **flags)
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert all(r["grad_norm"] > 0 for r in records if "lm_loss" in r)
    # The routers' numbers at the evaluation's cut in the stream (iteration 6) and at the final drain (12): each
    # layer's since the last call, so over the run every forward counts once: 12 x 16 x 64 x 2 / 8 per layer.
    moe = {r["iteration"]: r for r in records if "moe/tokens_per_expert_mean" + "/layer0" in r}
    assert sorted(moe) == [6, 12], sorted(moe)
    for layer in range(4):
        assert sum(r[f"moe/tokens_per_expert_mean/layer{layer}"] for r in moe.values()) == 12 * 16 * 64 * 2 / 8
    for r in moe.values():
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and r["moe/dropped_tokens"] == 0
