"""Multi-latent attention under every parallel layout, pipeline method, optimizer and checkpoint (issue 54 items
1, 4, 5, 7 for MLA).

The model: tests/moe_harness.py's 4-layer GPT (hidden 32, 4 heads; MoE in layers 1-3, or dense) with MLA: query
latent 16, key/value latent 16, query/key head 8 + 8 rotary, value head 12 (so the value head dimension differs
from the query/key's), latent RMSNorms, YaRN (factor 4 over an original context of 8, mscale_all_dim 0.8: the
frequencies, the cos/sin factor and the softmax scale all differ from plain RoPE's).

- Equal to the one-process model at the same global batch (moe_harness.check_equal: the mean loss, every gradient
  gathered whole, the gradient and parameter norms; fp32, rtol 1e-5 / atol 1e-6, reduction orders only): TP 2
  without sequence parallelism (no query compression, dense), TP 2 with it (DeepSeek-shaped: MoE), CP 2 ring (p2p)
  and TP 2 x CP 2 all-gather with EP 2, CP 2 with document masks (--reset-attention-mask), PP 2 interleaved 1F1B
  and ZB-V.
  With multi-token prediction (an MTP depth whose layer has MLA): TP 2 with sequence parallelism (MoE), CP 2.
  The down-projections are whole on every TP rank: their gradients match the one-process ones only if the shared
  rotary key's gradient is summed over TP (without sequence parallelism) and the partial sums over the TP ranks'
  tokens are (with it).
- The distributed optimizer (ZeRO-1) with Muon at TP 2 (sequence parallel) x DP 2: two clipped steps equal the
  one-process run (each MLA factor its own matrix; the column-parallel up-projections gathered whole, --muon-tp-mode
  duplicated; the replicated down-projections' gradients summed over the TP ranks' tokens);
  losses rtol 1e-5 / atol 1e-6, weights atol 1e-5, as tests/test_moe_optimizers.py.
- FSDP2 (--use-torch-fsdp2) at TP 2 with sequence parallelism x DP 2 equals DDP (1e-6, tests/test_fsdp.py's run).
- Asynchronous pipelines: PipeOptim (Adam; Muon with the distributed optimizer) and interleaved PipeDream at PP 2
  equal the single-process emulator bit for bit (the MLA weights are parameters like any: stashed, predicted); the
  rest of the family (async-naive, PipeDream-2BW, SpecTrain, PipeNAG) trains MLA in the emulator (finite losses,
  every MLA weight stepped).
- FP8 (torchao, emulated) at TP 2 with sequence parallelism follows TP 1 within 2e-3 (pretrain_gpt.py's entry).
- Checkpoints through pretrain_gpt.py's entry: resume bit for bit at TP 2 with sequence parallelism; a TP 2
  checkpoint holds every MLA tensor at its global shape and its next iteration at TP 1 gives the TP 2 run's loss
  within 1e-5 and its weights within 5e-6.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)
import moe_harness
from dist_harness import run_distributed
from moe_harness import M, check_equal, distributed_run, reference

MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
           v_head_dim=12, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
           rotary_scaling_factor=4.0, mscale_all_dim=0.8, yarn_original_max_position_embeddings=8)
DENSE = {**MLA, "num_experts": None}


# ---- equal to one process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world,tp,cp,ep,model,sequence_parallel", [
    (2, 2, 1, 1, {**DENSE, "q_lora_rank": None}, False),
    (2, 2, 1, 1, MLA, True),
    (2, 1, 2, 1, DENSE, False),
    (4, 2, 2, 2, {**MLA, "cp_comm_type": "allgather"}, True),
], ids=["tp2-no-q-lora", "tp2-sp-moe", "cp2-p2p", "tp2-sp-cp2-allgather-ep2"])
def test_tensor_and_context_parallel_match_one_process(world, tp, cp, ep, model, sequence_parallel):
    ref = reference(M * world // (tp * cp), **model)
    check_equal(run_distributed(distributed_run, world, tp=tp, cp=cp,
                                args=(model, ep, None, "1f1b", 1, sequence_parallel)), ref)


@pytest.mark.parametrize("method", ["1f1b", "zb-v"])
def test_pipeline_schedules_match_one_process(method):
    """Interleaved 1F1B, and ZB-V, whose backward defers the weight gradients (the replicated down-projections'
    too) to its W ops."""
    check_equal(run_distributed(distributed_run, 2, pp=2, args=(MLA, 1, None, method, 2)), reference(M, **MLA))


def with_documents(batches: list[dict]) -> list[dict]:
    """Each sequence cut into documents at other places (--reset-attention-mask's document ids, kept whole)."""
    for i, b in enumerate(batches):
        ids = torch.zeros_like(b["tokens"])
        for row in range(ids.shape[0]):
            ids[row, 3 + (i + 5 * row) % 9:] += 1
            ids[row, 13:] += 1
        b["document_ids"] = ids
    return batches


def reference_with_documents(n: int, **model):
    """moe_harness.reference, the model reading the micro-batch dict (its document mask)."""
    from megatron_po.models.gpt import GPTModel, masked_mean_loss
    from megatron_po.models.moe.aux_losses import aux_loss_scale
    from megatron_po.tensor_parallel import model_parallel_seed
    torch.set_num_threads(1)
    model_parallel_seed(moe_harness.SEED)
    net = GPTModel(moe_harness.make_cfg(**model).model, moe_harness.VOCAB, moe_harness.SEED)
    losses = []
    for b in with_documents(moe_harness.microbatches(n)):
        loss = masked_mean_loss(net(b), b["loss_mask"])
        with aux_loss_scale(1.0 / n):
            (loss / n).backward()
        losses.append(loss.detach())
    return moe_harness.reference_results(net, torch.stack(losses).mean().item())


def test_context_parallel_with_document_masks_matches_one_process(monkeypatch):
    """The forked ranks inherit the harness reading documents: every chunk gets the micro-batch dict."""
    build = moe_harness.build_chunks_for_rank

    def reading_documents(*args, **kwargs):
        chunks = build(*args, **kwargs)
        for c in chunks:
            c.reads_batch = True
        return chunks
    microbatches = moe_harness.microbatches
    monkeypatch.setattr(moe_harness, "microbatches", lambda n: with_documents(microbatches(n)))
    monkeypatch.setattr(moe_harness, "build_chunks_for_rank", reading_documents)
    ref = reference_with_documents(M, **DENSE)
    plain = reference(M, **DENSE)
    assert abs(ref[0] - plain[0]) > 1e-4  # the documents mattered (the check's tolerance: 5e-5)
    check_equal(run_distributed(distributed_run, 2, cp=2, args=(DENSE, 1)), ref)


@pytest.mark.parametrize("world,tp,cp,model,layout", [
    (2, 2, 1, {**MLA, "mtp_num_layers": 1}, (1, None, "1f1b", 1, True)),
    (2, 1, 2, {**DENSE, "mtp_num_layers": 1}, (1,)),
], ids=["tp2-sp-moe-mtp", "cp2-mtp"])
def test_with_multi_token_prediction_matches_one_process(world, tp, cp, model, layout):
    """DeepSeek-V3's pair: an MTP depth whose layer has MLA (and MoE), its losses included (tests/test_mtp.py's
    run and check)."""
    from test_mtp import mtp_distributed_run

    from megatron_po.models.mla import MultiLatentAttention
    from megatron_po.models.mtp import mtp_metrics
    net, loss = moe_harness.reference_model(M, **model)
    ref, ref_mtp = moe_harness.reference_results(net, loss), mtp_metrics(moe_harness.make_cfg(**model), [net])
    assert isinstance(net.mtp.layers[0].transformer_layer.attention, MultiLatentAttention)
    results = run_distributed(mtp_distributed_run, world, tp=tp, cp=cp, args=(model, *layout), timeout=240)
    check_equal([r[:4] for r in results], ref)
    for mtp in (r[4] for r in results if r[4] is not None):
        assert all(abs(mtp[k] - ref_mtp[k]) < 1e-5 * ref_mtp[k] for k in ref_mtp), (mtp, ref_mtp)


# ---- ZeRO-1 and Muon -------------------------------------------------------------------------------------------


def test_distributed_optimizer_with_muon_at_tp2_sp_dp2_equals_one_process(monkeypatch):
    import test_moe_optimizers as opt_tests
    monkeypatch.setattr(opt_tests, "MODEL", DENSE)  # inherited by the forked ranks
    ref_losses, ref_norms, ref_weights = opt_tests.reference("muon", 2)
    results = run_distributed(opt_tests.sharded_run, 4, tp=2, args=("muon", 1, False), timeout=240)
    for losses, norms, weights, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for norm, ref in zip(norms, ref_norms):
            assert ref > opt_tests.CLIP and abs(norm - ref) <= 1e-5 * ref, (norms, ref_norms)
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            torch.testing.assert_close(w, ref_weights[k], rtol=1e-5, atol=opt_tests.ATOL, msg=k)
    moved = ref_weights["model.layers.0.attention.kv_up.weight"]
    assert moved.shape == (4 * (8 + 12), 16)


MLA_ARGV = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--rotary-scaling-factor", "4", "--mscale-all-dim", "0.8",
            "--yarn-original-max-position-embeddings", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _ddp_and_fsdp2():
    from test_fsdp import _sync_run
    return _sync_run(MLA_ARGV, 2, fsdp=False), _sync_run(MLA_ARGV, 2, fsdp=True)


def test_fsdp2_at_tp2_sp_dp2_equals_ddp():
    """--use-torch-fsdp2 (weights, gradients and optimizer state sharded over DP 2) against DDP at TP 2 with sequence
    parallelism: the losses, gradient norms and weights of two steps within 1e-6 (tests/test_fsdp.py's run)."""
    for ddp, fsdp in run_distributed(_ddp_and_fsdp2, 4, timeout=240):
        assert (ddp[0][0] is None) == (fsdp[0][0] is None)
        if ddp[0][0] is not None:
            torch.testing.assert_close(torch.tensor(fsdp[0]), torch.tensor(ddp[0]), rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(fsdp[1]), torch.tensor(ddp[1]), rtol=0, atol=1e-6)
        assert fsdp[2].keys() == ddp[2].keys() and any(".kv_down." in k for k in ddp[2])
        for key in ddp[2]:
            torch.testing.assert_close(fsdp[2][key], ddp[2][key], rtol=0, atol=1e-6, msg=key)


# ---- asynchronous pipelines: emulator = distributed, bit for bit ---------------------------------------------

# test_moe_async's model: 2 layers per stage, 2 heads, sequences of 8 (YaRN's original context 4)
ASYNC_MLA = {**MLA, "yarn_original_max_position_embeddings": 4}


@pytest.mark.parametrize("method,optimizer,v,segments,precision", [
    ("pipeoptim", "adam", 1, (4, 4), None),
    ("pipeoptim", "muon", 1, (4, 4), {"use_distributed_optimizer": True}),
    ("pipedream", "adam", 2, (4, 6), None),
], ids=["pipeoptim-adam", "pipeoptim-muon-distributed-optimizer", "pipedream-interleaved-adam"])
def test_asynchronous_pipelines_equal_the_emulator_bitwise(method, optimizer, v, segments, precision):
    from test_moe_async import train_distributed, train_emulator
    args = (method, optimizer, 2, v, 1, segments, ASYNC_MLA, {})
    emu_losses, emu_weights, _ = run_distributed(partial(train_emulator, precision=precision), 1, args=args)[0]
    results = run_distributed(partial(train_distributed, precision=precision), 2, pp=2,
                              args=(method, optimizer, v, 1, segments, ASYNC_MLA, {}), timeout=240)
    assert results[1][0] == emu_losses  # bit for bit
    weights = {name: w for r in results for name, w in r[1].items()}
    assert weights.keys() == emu_weights.keys()
    assert any(".attention.kv_up." in name for name in weights)
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name


@pytest.mark.parametrize("method,optimizer,k", [("async-naive", "adam", 1), ("pipedream-2bw", "adam", 2),
                                                ("spectrain", "sgd", 1), ("pipenag", "nag", 1)])
def test_the_other_asynchronous_methods_train_mla_in_the_emulator(method, optimizer, k):
    """The rest of the asynchronous family on the same model (PP 2, the single-process emulator): finite losses, and
    every MLA weight stepped."""
    from test_moe_async import moe_emulator, train_emulator
    initial = moe_emulator(method, optimizer, 2, 1, k, ASYNC_MLA).full_state_dict()  # the same seed
    losses, weights, _ = train_emulator(method, optimizer, 2, 1, k, (4, 4), ASYNC_MLA, {})
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    mla = [name for name in weights if ".attention." in name]
    assert len(mla) == 2 * 7  # a layer per stage x (q_down, q_norm, q_up, kv_down, kv_norm, kv_up, proj)
    assert all(not torch.equal(weights[name], initial[name]) for name in mla)


# ---- checkpoints ---------------------------------------------------------------------------------------------

FLAGS = {"--multi-latent-attention": True, "--q-lora-rank": 16, "--kv-lora-rank": 16, "--qk-head-dim": 8,
         "--qk-pos-emb-head-dim": 8, "--v-head-dim": 12, "--qk-layernorm": True, "--normalization": "RMSNorm",
         "--position-embedding-type": "rope", "--rotary-scaling-factor": 4, "--mscale-all-dim": 0.8,
         "--yarn-original-max-position-embeddings": 16, "--disable-bias-linear": True}
TP2 = {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}


def test_resume_is_bit_exact_at_tp2(tmp_path):
    from test_checkpoint import losses, train
    flags = {**FLAGS, **TP2, "--train-iters": 6, "--save-interval": 3, "--global-batch-size": 4}
    ckpt = str(tmp_path / "ckpt")
    straight = losses(train(str(tmp_path / "straight"), 2, **flags, **{"--save": ckpt}))
    resumed = losses(train(str(tmp_path / "resumed"), 2, **flags, **{"--load": ckpt, "--ckpt-step": 3,
                                                                      "--save": str(tmp_path / "ckpt2")}))
    assert len(straight) == 6 and resumed == straight[3:]  # bit for bit


def test_tp2_checkpoint_continues_at_tp1(tmp_path):
    from test_checkpoint import assert_close, losses, model_weights, read_all, train
    quiet = {**FLAGS, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--lr-decay-iters": 4,
             "--global-batch-size": 4, "--train-iters": 3}
    ref = losses(train(str(tmp_path / "ref"), 2, **quiet, **TP2, **{"--save-interval": 1,
                                                                      "--save": str(tmp_path / "ck_ref")}))
    saved = read_all(str(tmp_path / "ck_ref"), 2)
    assert saved["model.layers.0.attention.kv_up.weight"].shape == (4 * (8 + 12), 16)  # whole, not a TP shard
    assert saved["model.layers.0.attention.q_up.weight"].shape == (4 * 16, 16)
    assert saved["model.layers.0.attention.kv_down.weight"].shape == (16 + 8, 32)  # replicated, saved once
    assert saved["optimizer.layers.0.attention.kv_down.weight.exp_avg"].shape == (16 + 8, 32)
    got = losses(train(str(tmp_path / "tp1"), 1, **quiet, **{"--load": str(tmp_path / "ck_ref"), "--ckpt-step": 2,
                                                              "--save": str(tmp_path / "ck_tp1")}))
    assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (got, ref)
    assert_close(model_weights(str(tmp_path / "ck_tp1"), 3), model_weights(str(tmp_path / "ck_ref"), 3), 5e-6)


def test_fp8_at_tp2_with_sequence_parallelism_follows_tp1(tmp_path):
    """FP8 (torchao, emulated) in every MLA projection, the down-projections multiplying each TP rank's tokens: TP 2
    follows TP 1 within 2e-3 over 4 iterations (measured 3.8e-4: other FP8 roundings per rank, as tests/test_fp8.py
    holds TP 2; that FP8 changes the numbers: tests/test_mla.py). The MLA sizes are multiples of 16, as FP8's GEMMs
    take them."""
    from test_checkpoint import losses, train
    fp8 = {**FLAGS, "--kv-lora-rank": 16, "--qk-head-dim": 8, "--qk-pos-emb-head-dim": 16, "--v-head-dim": 8,
           "--train-iters": 4, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--global-batch-size": 4,
           "--fp8-format": "hybrid"}
    tp1 = losses(train(str(tmp_path / "tp1"), 1, **fp8))
    tp2 = losses(train(str(tmp_path / "tp2"), 2, **fp8, **TP2))
    assert len(tp1) == 4 and max(abs(a - b) for a, b in zip(tp2, tp1)) <= 2e-3, (tp1, tp2)
