"""Tracking through pretrain_gpt.py's entry: TensorBoard event files and the W&B offline run read back.

A PP=2 PipeOptim run with --tensorboard-dir, --wandb-project (WANDB_MODE=offline), --log-throughput,
--peak-tflops, --timing-log-level 2 and Megatron's --log-timers-to-tensorboard, --log-memory-to-tensorboard,
--log-validation-ppl-to-tensorboard writes the same scalars to the metrics file, TensorBoard and W&B:
loss, lr, grad norm, tokens/s, TFLOP/s per GPU, MFU, memory, the level-2 timers and each stage's
staleness (1 and 0 for D = 2), and the evaluation; the method goes to W&B's summary and TensorBoard's
text. A synchronous run at level 1 logs the coarse timers only, and without those three flags TensorBoard leaves
out the timers, throughput, memory and perplexity (Megatron's defaults) that the metrics file holds. An MoE run (EP = 2, a capacity) logs each MoE
layer's aux loss, z-loss, tokens per expert and dropped tokens to all three. A multi-token prediction run (PP = 2,
PipeOptim) logs the MTP losses apart from the LM loss to all three and the console.
"""

import math

from dist_harness import run_distributed
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_pretrain_gpt import base_args, read_metrics, run_pretrain
from wandb_records import read_offline_run


LEVEL2 = {"time/forward-compute", "time/backward-compute", "time/p2p", "time/prediction", "time/optimizer"}
LOGGED = {"lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "memory_gb", "max_memory_gb",
          "staleness/stage0", "staleness/stage1"} | LEVEL2


def read_tensorboard(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    texts = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    return scalars, texts


def test_pipeoptim_run_logs_the_same_scalars_to_tensorboard_and_wandb(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    out.mkdir()
    argv = base_args(corpus, out, **{
        "--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
        "--untie-embeddings-and-output-weights": True, "--train-iters": 6, "--log-interval": 2,
        "--eval-interval": 6, "--log-throughput": True, "--peak-tflops": 0.5, "--timing-log-level": 2,
        "--log-timers-to-tensorboard": True, "--log-memory-to-tensorboard": True,
        "--log-validation-ppl-to-tensorboard": True, "--tensorboard-dir": str(out / "tb"), "--wandb-project": "mpo-test", "--wandb-save-dir": str(out)})
    assert run_distributed(run_pretrain, 2, args=(argv,), timeout=300) == [0, 0]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [2, 4, 6]
    for r in records:
        assert LOGGED <= r.keys(), LOGGED - r.keys()
        assert (r["staleness/stage0"], r["staleness/stage1"]) == (1, 0)  # D - r - 1
        assert math.isclose(r["mfu"], r["tflops_per_gpu"] / 0.5)
        assert 0 < r["memory_gb"] <= r["max_memory_gb"]
        ms_per_iter = 1000 * 16 * 64 / r["tokens_per_sec"]  # global batch 16 x seq 64 tokens per iteration
        assert 0 < sum(r[k] for k in LEVEL2) <= 1.02 * ms_per_iter  # disjoint timers within the wall time
    assert "val_loss" in records[-1]

    scalars, texts = read_tensorboard(out / "tb")
    assert LOGGED | {"val_loss", "val_ppl"} <= scalars.keys(), (LOGGED | {"val_loss"}) - scalars.keys()
    for r in records:
        for key in LOGGED:
            assert math.isclose(scalars[key][r["iteration"]], r[key], rel_tol=1e-6, abs_tol=1e-6), key  # float32
    assert scalars["val_loss"] == {6: scalars["val_loss"][6]} and math.isclose(scalars["val_loss"][6],
                                                                                 records[-1]["val_loss"], rel_tol=1e-6)
    assert texts["pipeline_method/text_summary"] == "pipeoptim"
    assert '"pipeline_method": "pipeoptim"' in texts["config/text_summary"]

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    config, history, summary = read_offline_run(str(run_dir))
    assert {"model", "parallel", "training", "logging"} <= config
    assert [int(h["_step"]) for h in history] == [2, 4, 6]
    for h in history:
        assert LOGGED <= h.keys(), LOGGED - h.keys()
    assert {"val_loss", "pipeline_method"} | LOGGED <= summary


def test_synchronous_run_at_timing_level_1_logs_the_coarse_timers(corpus, tmp_path):
    out = tmp_path / "sync"
    out.mkdir()
    argv = base_args(corpus, out, **{"--train-iters": 4, "--log-interval": 2, "--eval-interval": 4,
                                     "--timing-log-level": 1, "--tensorboard-dir": str(out / "tb")})
    assert run_distributed(run_pretrain, 1, args=(argv,), timeout=300) == [0]
    records = read_metrics(out / "metrics.jsonl")
    timers = {k for r in records for k in r if k.startswith("time/")}
    assert timers == {"time/forward-backward", "time/grad-sync", "time/optimizer"}
    assert not any(k.startswith(("staleness/", "tflops", "mfu")) for r in records for k in r)  # no PP, no flag
    scalars, texts = read_tensorboard(out / "tb")
    assert "pipeline_method/text_summary" not in texts
    assert {"lm_loss", "lr", "grad_norm", "val_loss"} <= scalars.keys()
    asked_for = timers | {"tokens_per_sec", "memory_gb", "max_memory_gb", "val_ppl"}  # the metrics file has them
    assert asked_for <= {k for r in records for k in r}
    assert not asked_for & scalars.keys()  # without --log-timers/-memory/-validation-ppl-to-tensorboard



def test_moe_run_logs_the_routers_per_layer_to_tensorboard_and_wandb(corpus, tmp_path, monkeypatch, capfd):
    """EP = 2 with a capacity (factor 1, tokens dropped): per MoE layer the aux loss, z-loss, tokens per expert
    (max, mean) and dropped tokens, in the metrics file, TensorBoard and W&B alike, and on the console. Closed
    forms per layer and window of 2 iterations: kept + dropped token-expert pairs = 2 x 16 x 64 x top-2; no expert
    takes more than its capacity ceil(1.0 x 256 x 2 / 8) = 64 of each of the window's 8 micro-batches."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "moe"
    out.mkdir()
    argv = base_args(corpus, out, **{
        "--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64, "--expert-model-parallel-size": 2,
        "--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001, "--moe-expert-capacity-factor": 1.0,
        "--moe-layer-freq": "([0]*1+[1]*1)", "--train-iters": 4, "--log-interval": 2, "--eval-interval": 4,
        "--tensorboard-dir": str(out / "tb"), "--wandb-project": "mpo-test", "--wandb-save-dir": str(out)})
    assert run_distributed(run_pretrain, 2, args=(argv,), timeout=300) == [0, 0]
    console = capfd.readouterr().out
    assert console.count(" MoE layers 1 | aux loss ") == 2 and "| dropped tokens " in console
    records = [r for r in read_metrics(out / "metrics.jsonl") if "lm_loss" in r]
    layer = {"moe/aux_loss/layer1", "moe/z_loss/layer1", "moe/tokens_per_expert_max/layer1",
             "moe/tokens_per_expert_mean/layer1", "moe/dropped_tokens/layer1"}
    summary = {"moe/aux_loss", "moe/z_loss", "moe/tokens_per_expert_max_over_mean", "moe/dropped_tokens"}
    for r in records:
        assert {k for k in r if k.startswith("moe/")} == layer | summary  # layer 0 is dense
        kept = 8 * r["moe/tokens_per_expert_mean/layer1"]
        assert r["moe/dropped_tokens/layer1"] > 0 and kept + r["moe/dropped_tokens/layer1"] == 2 * 16 * 64 * 2
        assert r["moe/tokens_per_expert_max/layer1"] <= 8 * 64
        assert r["moe/aux_loss/layer1"] > 0 and r["moe/z_loss/layer1"] > 0
    scalars, _ = read_tensorboard(out / "tb")
    for r in records:
        for key in layer | summary:
            assert math.isclose(scalars[key][r["iteration"]], r[key], rel_tol=1e-6), key
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    _, history, _ = read_offline_run(str(run_dir))
    for h, r in zip(history, records):
        assert all(math.isclose(float(h[key]), r[key], rel_tol=1e-9) for key in layer | summary), h


def test_mtp_run_logs_its_losses_apart_to_tensorboard_and_wandb(corpus, tmp_path, monkeypatch, capfd):
    """--mtp-num-layers 2 under PipeOptim at PP = 2 (the block on the loss stage, its losses read there at every
    logged iteration, like the LM loss): `mtp_loss` (the mean over the depths) and `mtp_loss/depth1`, `/depth2`
    in the metrics file, TensorBoard and W&B alike, and after the lm loss on the console line."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "mtp"
    out.mkdir()
    argv = base_args(corpus, out, **{
        "--mtp-num-layers": 2, "--position-embedding-type": "rope", "--pipeline-model-parallel-size": 2,
        "--pipeline-method": "pipeoptim", "--untie-embeddings-and-output-weights": True, "--train-iters": 4,
        "--log-interval": 2, "--eval-interval": 4, "--tensorboard-dir": str(out / "tb"), "--wandb-project": "mpo-test",
        "--wandb-save-dir": str(out)})
    assert run_distributed(run_pretrain, 2, args=(argv,), timeout=300) == [0, 0]
    console = capfd.readouterr().out
    assert console.count(" | mtp loss ") == 2 and " (depths " in console
    records = [r for r in read_metrics(out / "metrics.jsonl") if "lm_loss" in r]
    keys = {"mtp_loss", "mtp_loss/depth1", "mtp_loss/depth2"}
    assert len(records) == 2 and all({k for k in r if k.startswith("mtp")} == keys for r in records)
    assert all(math.isclose(r["mtp_loss"], (r["mtp_loss/depth1"] + r["mtp_loss/depth2"]) / 2) for r in records)
    scalars, _ = read_tensorboard(out / "tb")
    for r in records:
        for key in keys:
            assert math.isclose(scalars[key][r["iteration"]], r[key], rel_tol=1e-6), key
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    _, history, _ = read_offline_run(str(run_dir))
    for h, r in zip(history, records):
        assert all(math.isclose(float(h[key]), r[key], rel_tol=1e-9) for key in keys), h
