"""Multi-token prediction (--mtp-num-layers, models/mtp.py; issue 54 item 2).

- The math: a GPT with 2 MTP depths gives the losses and every gradient of DeepSeek-V3's formulation written
  here independently of the code's rolls (depth d computed on the sequence cut to its first s - d positions,
  the embedding of tokens i + d, norms by F.rms_norm, the concatenation [embedding ; hidden], logits by the
  output weight, cross entropy against labels i + d under mask i + d): LM loss + (0.1 / N) x sum_d L_d,
  fp32, rtol 1e-5 / atol 1e-6 (the orders of the reductions differ). Also with a `loss_normalizer` (Megatron's
  per-token form), the unchunked output loss with tied embeddings, MoE depths with full recomputation, document
  masks and positions (--reset-attention-mask / --reset-position-ids: the depths take the main model's).
  Evaluation does not run the depths; the LM loss returned is the LM loss alone.
- Parallel layouts equal the one-process run (moe_harness, rtol 1e-5 / atol 1e-6): TP 2 + SP, DP 2, CP 2, PP 2
  under ZB-H1 (tied), interleaved 1F1B and ZB-V, PP 2 x TP 2 x EP 2 and PP 2 x CP 2 x EP 2 (1F1B) with an MoE depth;
  the MTP losses too.
- Asynchronous methods: the recorder's replay (PipeOptim predicting the MTP block, PipeDream interleaved), and
  the emulator equal to the distributed run bit for bit (PipeOptim, PipeDream interleaved, 2BW, SpecTrain,
  PipeNAG).
- Training runs (pretrain_gpt.py on forked ranks): the MTP losses logged apart, resume bit for bit (1F1B,
  PipeOptim, ZeRO-1 + Muon at PP 2 x DP 2), a PP 2 checkpoint resharded to TP 2 and exported to Hugging Face
  without the depths; the cost benchmark's quick mode.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_po.config import ModelConfig
from megatron_po.data.document_masks import add_document_inputs, document_causal_mask
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.tensor_parallel import model_parallel_seed

sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", d)
                for d in ("step", "")]  # bench/step/mtp_cost.py and bench_common, for the benchmark's test

VOCAB, SEED, SEQ, MBS = 64, 11, 12, 3

DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                    attention_dropout=0.0, make_vocab_size_divisible_by=8, position_embedding_type="rope",
                    normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, mtp_num_layers=2)


def batch(salt: int = 0) -> dict:
    g = torch.Generator().manual_seed(salt)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    mask = torch.ones(MBS, SEQ)
    mask[0, -4:] = 0  # a padded tail, and holes inside
    mask[1, 3] = mask[2, 7] = 0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def deepseek_mtp_loss(net: GPTModel, b: dict, hidden: torch.Tensor, normalizer=None) -> torch.Tensor:
    """(scale / N) x sum_d L_d, DeepSeek-V3's way (module docstring): `hidden` [s, b, h] are the main model's
    final-normed states. With `normalizer` each depth's masked sum is weighted by the micro-batch's loss tokens over
    its own and divided by it (Megatron's --calculate-per-token-loss form)."""
    cfg, tokens, labels, mask = net.cfg, b["tokens"], b["labels"], b["loss_mask"]
    embedding = net.embedding.word_embeddings.weight
    out_w = net.output_layer.weight
    total, depth_losses = 0.0, []
    h = hidden
    for d, depth in enumerate(net.mtp.layers, start=1):
        n = SEQ - d  # the positions whose token i + d exists
        emb = F.embedding(tokens[:, d:], embedding).transpose(0, 1)  # [n, b, h]
        rms = lambda x, w: F.rms_norm(x, (cfg.hidden_size,), w, cfg.norm_epsilon)  # noqa: E731
        x = torch.cat([rms(emb, depth.enorm.weight), rms(h[:n], depth.hnorm.weight)], dim=-1) @ depth.eh_proj.weight.t()
        positions = b["position_ids"][:, :n] if "position_ids" in b else None  # the main model's, not rolled
        extra = (document_causal_mask(b["document_ids"])[..., :n, :n],) if "document_ids" in b else ()
        x = depth.transformer_layer(x, net.rotary(n, x.device, positions), *extra)
        h = rms(x, depth.final_norm.weight)
        ce = F.cross_entropy((h @ out_w.t()).transpose(0, 1).reshape(-1, out_w.shape[0]),
                             labels[:, d:].reshape(-1), reduction="none").view(MBS, n)
        m = mask[:, d:]
        summed = (ce * m).sum()
        depth_losses.append(summed.detach() / m.sum())
        total = total + (summed / m.sum() if normalizer is None else summed * (mask.sum() / m.sum()) / normalizer)
    return total * 0.1 / len(net.mtp.layers), torch.stack(depth_losses)


CASES = {
    "dense": {},
    "per-token-normalizer": {},
    "unchunked-tied": {"chunked_output_loss": False, "untie_embeddings_and_output_weights": False},
    "moe-recompute": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
                      "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "documents": {},  # --reset-position-ids --reset-attention-mask: the depths see the main model's documents
}
EOD = 0


@pytest.mark.parametrize("case", list(CASES))
def test_mtp_equals_deepseek_v3_formulation(case):
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    cfg = dataclasses.replace(DENSE, **CASES[case])
    net = GPTModel(cfg, VOCAB, SEED)
    b = batch()
    if case == "documents":
        b["tokens"][:, 4] = b["tokens"][1, 9] = EOD
        add_document_inputs(b, EOD, reset_position_ids=True, reset_attention_mask=True)
    normalizer = torch.tensor(7.5) if case == "per-token-normalizer" else None

    def lm_loss(per_token):
        if normalizer is None:
            return masked_mean_loss(per_token, b["loss_mask"])
        return (per_token * b["loss_mask"]).sum() / normalizer

    # The code's run, as the executor drives it: the micro-batch dict, the mean (or normalized sum) of the
    # per-token losses, the auxiliary losses' gradient 1.
    lm = lm_loss(net({**b, "loss_normalizer": normalizer} if normalizer is not None else b))
    with aux_loss_scale(1.0):
        lm.backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters()}
    depth_sums, forwards = net.mtp.record.take(2)
    # The reference on the same parameters: the main model in evaluation mode (no depths run; no dropout here)
    # gives the LM loss and the final-normed states, then DeepSeek-V3's depths by hand
    net.zero_grad()
    net.eval()
    seen = {}
    net.final_norm.register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    lm_ref = lm_loss(net(b))
    assert net.mtp.record.take(2)[1] == 0  # evaluation runs no depth
    mtp, depth_losses = deepseek_mtp_loss(net, b, seen["h"], normalizer)
    (lm_ref + mtp).backward()
    assert torch.equal(lm.detach(), lm_ref.detach())  # the LM loss alone: the MTP loss is attached, not added
    assert forwards == 1
    torch.testing.assert_close(depth_sums.float(), depth_losses, rtol=1e-5, atol=1e-6)
    assert set(got) == {n for n, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# Parallel layouts equal the one-process run
# --------------------------------------------------------------------------------------------------

MTP_DENSE = {"num_experts": None, "mtp_num_layers": 2, "position_embedding_type": "rope"}
MTP_MOE = {"mtp_num_layers": 1, "position_embedding_type": "rope"}  # the harness's MoE GPT: its depth an MoE layer

LAYOUTS = [
    # id, world, tp, pp, cp, model, (ep, etp, method, chunks, sequence parallel)
    ("tp2-sp", 2, 2, 1, 1, MTP_DENSE, (1, None, "1f1b", 1, True)),
    ("dp2", 2, 1, 1, 1, MTP_DENSE, (1, None, "1f1b", 1, False)),
    ("cp2", 2, 1, 1, 2, MTP_DENSE, (1, None, "1f1b", 1, False)),
    ("pp2-zb-h1-tied", 2, 1, 2, 1, {**MTP_DENSE, "untie_embeddings_and_output_weights": False},
     (1, None, "zb-h1", 1, False)),
    ("pp2-interleaved", 2, 1, 2, 1, MTP_DENSE, (1, None, "1f1b", 2, False)),
    ("pp2-zb-v", 2, 1, 2, 1, MTP_DENSE, (1, None, "zb-v", 2, False)),
    ("pp2xtp2xep2-moe", 4, 2, 2, 1, MTP_MOE, (2, 1, "1f1b", 1, True)),
    ("pp2xcp2xep2-moe", 4, 1, 2, 2, MTP_MOE, (2, None, "1f1b", 1, False)),
]


def mtp_distributed_run(model, *layout):
    """moe_harness.distributed_run's results, and the MTP losses of the loss stage (None elsewhere)."""
    from moe_harness import distributed_train, full_grad, grad_norms, make_cfg, params_norm
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    from megatron_po.models.moe.layer import take_records
    from megatron_po.models.mtp import mtp_metrics
    loss, chunks, ddp = distributed_train(model, *layout)
    grads = {f"model.{name}": full_grad(p) for name, p in named_parameters_global(chunks)}
    return ((loss.item() if loss is not None else None), grads, take_records(chunks),
            grad_norms(ddp.params) + (params_norm(ddp.params),), mtp_metrics(make_cfg(**model), chunks) or None)


@pytest.mark.parametrize("name,world,tp,pp,cp,model,layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_mtp_parallel_layouts_equal_one_process(name, world, tp, pp, cp, model, layout):
    """TP 2 with sequence parallelism (eh_proj split over TP, gathered, split over the sequence again), DP 2,
    PP 2 under ZB-H1 with tied embeddings (the depths read the output layer's copy of the embedding), interleaved
    1F1B (the MTP block's own copy tied to the first stage's over the embedding group) and ZB-V (the last virtual
    stage on rank 0 beside the embedding: the copies summed there), CP 2 (the tokens, labels and mask rolled over
    the whole sequences, each rank keeping its chunks; the depths' attention split over CP as the main layers'), and
    PP 2 x TP 2 x EP 2 and PP 2 x CP 2 x EP 2 with an MoE depth (1F1B):
    the LM loss, every gradient (the embedding's with the depths' share), the gradient norm, the routers' records
    (the depth's MoE layer numbered after the decoder's) and the MTP losses equal the one-process run's (fp32,
    rtol 1e-5 / atol 1e-6, moe_harness.check_equal)."""
    from dist_harness import run_distributed
    from moe_harness import M, check_equal, make_cfg, reference_model, reference_results
    from megatron_po.models.mtp import mtp_metrics
    dp = world // (tp * pp * cp)
    net, loss = reference_model(M * dp, **model)
    ref, ref_mtp = reference_results(net, loss), mtp_metrics(make_cfg(**model), [net])
    assert ref_mtp["mtp_loss"] > 0
    results = run_distributed(mtp_distributed_run, world, tp=tp, pp=pp, cp=cp, args=(model, *layout), timeout=300)
    check_equal([r[:4] for r in results], ref)
    mtps = [r[4] for r in results if r[4] is not None]
    assert len(mtps) == tp * dp * cp  # every rank of the loss stage
    for mtp in mtps:
        assert mtp.keys() == ref_mtp.keys()
        for k in mtp:
            assert abs(mtp[k] - ref_mtp[k]) < 1e-5 * ref_mtp[k], (k, mtp[k], ref_mtp[k])


# --------------------------------------------------------------------------------------------------
# Asynchronous methods
# --------------------------------------------------------------------------------------------------

ASYNC_MTP = {"mtp_num_layers": 1, "position_embedding_type": "rope"}  # test_moe_async's MoE GPT: an MoE depth

FORMULA_CASES = [
    # method, optimizer, D, v, k, segments, options
    ("pipeoptim", "sgd", 2, 1, 1, (6, 6), {"s_offset": 1}),  # s = 1 on the last stage: the MTP block predicted
    ("pipedream", "adam", 2, 2, 1, (4, 6), {}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,options", FORMULA_CASES,
                         ids=[f"{c[0]}-D{c[2]}v{c[3]}" for c in FORMULA_CASES])
def test_async_updates_follow_the_method_formula_with_mtp(method, optimizer, D, v, k, segments, options,
                                                          monkeypatch):
    """The MTP block is one more part of the last stage: tests/test_async_policies.py's recorder and independent
    replay check that every forward of the last virtual stage ran on the method's weights (PipeOptim: the MTP
    depths and the block's own embedding predicted W - s·lr·ΔW with the rest), every micro-batch's gradient (the
    MTP loss's included, through the replay's run of the chunk) and every step (fp32, rtol 1e-4 / atol 1e-5)."""
    import types

    import test_async_policies
    from test_async_policies import get_batch, record, replay
    from test_moe_async import deepcopy_keeping_marks, moe_emulator
    emu = moe_emulator(method, optimizer, D, v, k, ASYNC_MTP, 0.01, **options)
    last = emu.stages[D - 1].chunks[v - 1]
    assert last.mtp is not None and last.mtp.embedding is not None
    assert not any(getattr(p, "shared_embedding", False) for c in emu.chunks for p in c.parameters())  # stage-local
    monkeypatch.setattr(test_async_policies, "copy", types.SimpleNamespace(deepcopy=deepcopy_keeping_marks))
    recorders, initial = record(emu)
    for m in segments:
        emu.train_segment(get_batch, m)
    predicted = {}
    with aux_loss_scale(1.0 / k):
        for r in range(D):
            for c in range(v):
                predicted[(r, c)] = replay(method, optimizer, 0.01, r, c, recorders[r].events[c], initial[(r, c)],
                                           None, options.get("s_offset", 0))
    if method == "pipeoptim":
        assert predicted[(D - 1, v - 1)] > 0  # the last stage's forwards (MTP block included) ran on predictions
    weights = emu.full_state_dict()
    # The block's embedding started equal to the first stage's and trained on its own (the MTP loss only)
    assert not torch.equal(weights["mtp.embedding.word_embeddings.weight"], weights["embedding.word_embeddings.weight"])
    assert torch.equal(initial[(D - 1, v - 1)].mtp.embedding.word_embeddings.weight,
                       initial[(0, 0)].embedding.word_embeddings.weight)


BITWISE_CASES = [
    # method, optimizer, D, v, k, segments, options
    ("pipeoptim", "adam", 2, 1, 1, (4, 4), {"s_offset": 1}),
    ("pipedream", "adam", 2, 2, 1, (4, 6), {}),
    ("pipedream-2bw", "adam", 2, 1, 2, (4, 4), {}),
    ("spectrain", "sgd", 2, 1, 1, (4, 4), {}),
    ("pipenag", "nag", 2, 1, 1, (4, 4), {}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,options", BITWISE_CASES,
                         ids=[f"{c[0]}-D{c[2]}v{c[3]}k{c[4]}" for c in BITWISE_CASES])
def test_async_distributed_equals_emulator_bitwise_with_mtp(method, optimizer, D, v, k, segments, options):
    """The emulator and the distributed run (one process per stage) train the MTP GPT bit for bit alike: every
    micro-batch's LM loss and every weight at the end, the MTP depths and the last stage's own embedding included."""
    from dist_harness import run_distributed
    from test_moe_async import train_distributed, train_emulator
    args = (method, optimizer, D, v, k, segments, ASYNC_MTP, options)
    emu_losses, emu_weights, _ = run_distributed(train_emulator, 1, args=args)[0]
    results = run_distributed(train_distributed, D, pp=D, args=(method, optimizer, v, k, segments, ASYNC_MTP, options),
                              timeout=240)
    assert results[D - 1][0] == emu_losses
    weights = {name: w for r in results for name, w in r[1].items()}
    assert weights.keys() == emu_weights.keys() and "mtp.layers.0.eh_proj.weight" in weights
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name


# --------------------------------------------------------------------------------------------------
# Training runs: the logs, checkpoints
# --------------------------------------------------------------------------------------------------

RUN = {"--num-layers": 2, "--position-embedding-type": "rope", "--normalization": "RMSNorm", "--swiglu": True,
       "--mtp-num-layers": 2, "--global-batch-size": 4, "--train-iters": 6, "--save-interval": 3,
       "--pipeline-model-parallel-size": 2}
RESUME = {
    "pp2-1f1b": (2, {}),  # the MTP block's embedding copy tied to the first stage's (not saved: it equals the embedding)
    "pp2-pipeoptim": (2, {"--pipeline-method": "pipeoptim", "--untie-embeddings-and-output-weights": True}),  # its own
    # ZB-V: the last virtual stage on rank 0 beside the embedding; its copy loaded from the embedding's entry there
    "pp2-zb-v": (2, {"--pipeline-method": "zb-v", "--num-layers": 4, "--num-layers-per-virtual-pipeline-stage": 1,
                     "--untie-embeddings-and-output-weights": True}),
    # ZeRO-1 and Muon at PP 2 x DP 2: the tied copy in a bucket of its own, the depths' matrices on Muon
    "pp2-dp2-distributed-optimizer-muon": (4, {"--untie-embeddings-and-output-weights": True,
                                               "--use-distributed-optimizer": True, "--optimizer": "muon"}),
}


@pytest.mark.parametrize("case", list(RESUME))
def test_mtp_logged_apart_and_resumed_bit_exact(case, tmp_path):
    """pretrain_gpt.py's loop at PP 2 (1F1B, PipeOptim, ZB-V, and 1F1B with the distributed optimizer and Muon at DP 2): every logged iteration's record holds the LM loss
    and, apart, the MTP losses (the mean over the depths and each depth's; tests/test_tensorboard.py reads them in
    TensorBoard, W&B and the console); 6 iterations (saving every 3) equal, bit for bit, loading iteration 3 and running 3 more, the MTP losses too. The
    checkpoint holds the depths under their global names; under PipeOptim also the last stage's own embedding (an
    asynchronous stage trains its copy apart), under 1F1B not (the tied copy is the first stage's embedding)."""
    from test_checkpoint import losses, read_all, train
    world, flags = RESUME[case]
    flags = {**RUN, **flags, "--global-batch-size": 2 * world}
    ckpt = str(tmp_path / "ckpt")
    straight = train(str(tmp_path / "straight"), world, **flags, **{"--save": ckpt})
    resumed = train(str(tmp_path / "resumed"), world, **flags, **{"--load": ckpt, "--ckpt-step": 3,
                                                                 "--save": str(tmp_path / "ckpt2")})
    assert len(losses(straight)) == 6 and losses(resumed) == losses(straight)[3:]  # bit for bit
    mtp = [[r[k] for k in ("mtp_loss", "mtp_loss/depth1", "mtp_loss/depth2")] for r in straight if "lm_loss" in r]
    assert len(mtp) == 6 and all(abs(m[0] - (m[1] + m[2]) / 2) < 1e-6 for m in mtp)
    assert all(m[0] != lm for m, lm in zip(mtp, losses(straight)))  # another number than the LM loss
    assert [[r["mtp_loss"]] for r in resumed if "lm_loss" in r] == [[m[0]] for m in mtp[3:]]
    saved = read_all(ckpt, 3)
    assert saved["model.mtp.layers.1.eh_proj.weight"].shape == (32, 64)
    assert any(k.startswith("optimizer.mtp.layers.0.transformer_layer.attention.qkv.weight.") for k in saved)
    assert ("model.mtp.embedding.word_embeddings.weight" in saved) == (case == "pp2-pipeoptim")


def test_mtp_checkpoint_reshards_from_pp2_to_tp2(tmp_path):
    """A PP 2 checkpoint (the depths on stage 1) loaded and saved again under TP 2 (one stage, eh_proj and the
    depths' layers split over TP) reproduces every tensor, optimizer state included; the next iteration there gives
    the reference's LM loss within 1e-5 and its updated weights within 5e-6 (fp32, other reduction orders). Its
    Hugging Face export (Llama) loads with no tensor missing or unexpected: the depths are left out, and it says so."""
    import contextlib
    import io

    from dist_harness import run_distributed
    from test_checkpoint import assert_close, load_and_resave, losses, model_weights, read_all, tiny_args, train
    from transformers import AutoModelForCausalLM

    from tools.checkpoint_convert import main as convert

    def out(name):
        return str(tmp_path / name)

    flags = {**RUN, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--lr-decay-iters": 4, "--save-interval": 1,
             "--untie-embeddings-and-output-weights": True}
    flags["--train-iters"] = 3
    ref = losses(train(out("ref"), 2, **flags, **{"--save": out("ck_ref")}))
    tp2 = {**flags, "--pipeline-model-parallel-size": 1, "--tensor-model-parallel-size": 2}
    run_distributed(load_and_resave, 2, args=(tiny_args(out("re_tp2"), **tp2), out("ck_ref"), 2, out("ck_re_tp2")),
                    timeout=120)
    a, b = read_all(out("ck_ref"), 2), read_all(out("ck_re_tp2"), 2)
    assert "optimizer.mtp.layers.1.eh_proj.weight.exp_avg_sq" in a and "model.mtp.embedding.word_embeddings.weight" not in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    export = io.StringIO()
    with contextlib.redirect_stdout(export):
        assert convert(["export-hf", "--load", out("ck_ref"), "--out", out("hf"), "--no-progress"]) == 0
    assert "its 2 multi-token prediction depth(s) (mtp.*) left out" in export.getvalue()
    hf, loading = AutoModelForCausalLM.from_pretrained(out("hf"), output_loading_info=True)
    assert type(hf).__name__ == "LlamaForCausalLM" and not any(loading.values()), loading
    got = losses(train(out("tp2"), 2, **tp2, **{"--load": out("ck_ref"), "--ckpt-step": 2, "--save": out("ck_tp2")}))
    assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (got, ref)
    assert_close(model_weights(out("ck_tp2"), 3), model_weights(out("ck_ref"), 3), 5e-6)


def _quick_cost():
    """bench/step/mtp_cost.py's report at its quick sizes, on this (forked) rank: (figures, the lines it wrote)."""
    from bench_common import Lines
    from mtp_cost import SIZES, report
    out = Lines()
    return report("quick", out), out.lines, SIZES["quick"]


def test_mtp_cost_benchmark_quick():
    """bench/step/mtp_cost.py at its quick sizes: the FLOPs ratios it reports are flops.py's for 1 and 2 depths
    (exact: the arithmetic side of the comparison); its timings are printed, never asserted."""
    from dist_harness import run_distributed
    from mtp_cost import config

    from megatron_po.flops import gpt_flops_per_token
    figures, lines, size = run_distributed(_quick_cost, 1, timeout=300)[0]
    base = gpt_flops_per_token(config(size, 0), size["vocab"])
    for depths in (1, 2):
        want = gpt_flops_per_token(config(size, depths), size["vocab"]) / base
        assert figures[depths]["flops_ratio"] == want and want > 1 and figures[depths]["cpu_ms"] > 0
    assert any(line.startswith("| MTP depths |") for line in lines)


def test_transformer_engine_names_of_a_depths_layer_map_to_local_names():
    """Checkpoints store the local layers' names under either --transformer-impl (models/te_layout.py): an MTP
    depth's layer too, below its `transformer_layer.`."""
    from megatron_po.models.te_layout import local_name, te_name
    for local, te in [("mtp.layers.1.transformer_layer.attention.proj.weight",
                       "mtp.layers.1.transformer_layer.self_attention.proj.weight"),
                      ("layers.3.mlp.fc2.weight", "layers.3.layernorm_mlp.fc2.weight")]:
        assert local_name(te) == local and te_name(local, swiglu=True) == te
    assert local_name("mtp.layers.0.eh_proj.weight") == "mtp.layers.0.eh_proj.weight"


def test_decoupled_lr_steps_the_mtp_embedding_copy_as_the_embedding():
    """--decoupled-lr: the last stage's MTP copy of the word embedding is in the decoupled groups, as the first
    stage's embedding is (Megatron marks it is_embedding_or_output_parameter): tied copies step alike."""
    from megatron_po.optim import param_groups
    from megatron_po.training_setup import split_decoupled
    model_parallel_seed(SEED)
    last = GPTModel(DENSE, VOCAB, SEED, pre_process=False, layer_offset=1, num_layers=1)
    first = GPTModel(DENSE, VOCAB, SEED, post_process=False, num_layers=1)
    copy = last.mtp.embedding.word_embeddings.weight
    assert copy.shared_embedding and copy.embedding_copy and first.embedding.word_embeddings.weight.shared_embedding
    for chunk, weights in ((last, {id(copy), id(last.output_layer.weight)}),
                           (first, {id(first.embedding.word_embeddings.weight)})):
        groups = split_decoupled(param_groups([chunk], 0.1), [chunk])
        assert {id(p) for g in groups if g.get("decoupled") for p in g["params"]} == weights
