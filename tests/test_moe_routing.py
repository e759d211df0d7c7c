"""The routing flags of Megatron-core that DeepSeek-V3, Kimi K2, Moonlight, GLM-4.5 and Qwen3 recipes pass (issue 54
item 3): group-limited routing, --moe-router-dtype, the global auxiliary loss and --add-qkv-bias.

- Group-limited routing (--moe-router-num-groups G, --moe-router-group-topk g) equals a closed form written
  token by token (each group's score the sum of its top k // g scores, the g best groups, the top-k inside
  them) for every score function, with and without the expert bias, and 1 group is the plain top-k; the router
  equals transformers' DeepseekV3TopkRouter and Glm4MoeTopkRouter (sigmoid, expert bias, group selection,
  normalized and scaled weights) on the same weights, where k // g = 2 (their top-2 sum): the same experts, the
  weights to rtol 1e-6.
- --moe-router-dtype: fp64 computes the gating GEMM, the scores and the weights in fp64 (equal to the formula
  in fp64), fp32 in an fp32 model changes no bit of the layer (output and gradients); in a bf16 model fp32 runs
  the GEMM in fp32 where the default runs it in bf16, and the layer's output stays bf16.
- global_aux_loss (Megatron's): each training forward's loss equals E / (k T^2) sum_i P_i A_i with A the step's
  running mean of the loads, an optimizer step starts the mean again, a recomputation neither counts its
  micro-batch twice nor changes a bit; at DP 2 x EP 2 the loss, and every gradient, equal the one-process run of
  the concatenated micro-batch with aux_loss at coefficient / DP (fp32, rtol 1e-5 / atol 1e-6): the loads summed
  over DP and the 1/DP of Megatron's per-rank normalization; the logged loss is the DP sum (Megatron's).
- --add-qkv-bias: a bias on the QKV projection only, with GQA, MoE and TP 2 (sequence parallel) equal to the one
  process (loss, every gradient, the bias's TP shards gathered like the weight's rows).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from moe_harness import M, check_equal, distributed_run, full_grad, reference

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig
from megatron_po.distributed.checkpoint_format import named_parameters_global
from megatron_po.distributed.ddp import DistributedDataParallel, allreduce_sequence_parallel_grads
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.models.moe.layer import MoELayer, MoERecord, take_records
from megatron_po.models.moe.router import TopKRouter, after_optimizer_step, topk_routing
from megatron_po.pipeline.executor import synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.tensor_parallel import model_parallel_seed

E, K, H = 16, 4, 32


def router_cfg(**kw) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_experts=E, moe_router_topk=K,
                       moe_ffn_hidden_size=16, swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                       attention_dropout=0.0, **kw)


def closed_form_groups(scores: torch.Tensor, topk: int, groups: int, group_topk: int) -> list[set[int]]:
    """Each token's experts, one token at a time in plain Python."""
    out = []
    size = scores.shape[1] // groups
    for row in scores.tolist():
        group_score = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:topk // group_topk])
                       for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:topk]))
    return out


@pytest.mark.parametrize("score_function,pre_softmax,bias", [("softmax", False, False), ("softmax", True, False),
                                                             ("sigmoid", False, False), ("sigmoid", False, True)])
@pytest.mark.parametrize("topk,groups,group_topk", [(6, 4, 2), (4, 8, 2)], ids=["top3-sums", "pair-sums"])
def test_group_limited_routing_equals_closed_form(score_function, pre_softmax, bias, topk, groups, group_topk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, E, generator=g)
    expert_bias = torch.randn(E, generator=g) * 0.3 if bias else None
    probs, routing_map = topk_routing(logits, topk, score_function, pre_softmax, 2.5, expert_bias, groups, group_topk)
    # what the groups are chosen on: logits (softmax after the top-k), the softmax, sigmoid (+ bias)
    chosen_on = (torch.softmax(logits, -1) if pre_softmax else logits) if score_function == "softmax" else (
        torch.sigmoid(logits) + (expert_bias if bias else 0))
    expected = closed_form_groups(chosen_on, topk, groups, group_topk)
    assert [set(r.nonzero().flatten().tolist()) for r in routing_map] == expected
    plain_probs, plain_map = topk_routing(logits, topk, score_function, pre_softmax, 2.5, expert_bias)
    assert not torch.equal(routing_map, plain_map)  # the groups change the choice of some tokens
    if score_function == "sigmoid":  # weights: the unbiased scores of the chosen experts, normalized, scaled
        chosen = torch.sigmoid(logits) * routing_map
        torch.testing.assert_close(probs, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    one_group = topk_routing(logits, topk, score_function, pre_softmax, 2.5, expert_bias, 1, 1)
    assert torch.equal(one_group[0], plain_probs) and torch.equal(one_group[1], plain_map)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_router_equals_transformers_group_router(family):
    """bf16 hidden states and weights, --moe-router-dtype fp32 (HF computes its router in fp32)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    config_cls, router_cls = {"deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter),
                              "glm4_moe": (Glm4MoeConfig, Glm4MoeTopkRouter)}[family]
    hf_cfg = config_cls(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True)
    ours = TopKRouter(router_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                 moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
                                 moe_router_dtype="fp32", moe_aux_loss_coeff=0.0), sequence_parallel=False)
    hf = router_cls(hf_cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(E, H, generator=g) * 0.2)
        hf.weight.copy_(ours.weight)
        ours.expert_bias.copy_(torch.randn(E, generator=g) * 0.05)
        hf.e_score_correction_bias.copy_(ours.expert_bias)
    ours = ours.to(torch.bfloat16).eval()
    hf.weight.data = hf.weight.data.to(torch.bfloat16)
    x = torch.randn(16, 4, H, generator=g).to(torch.bfloat16)
    probs, routing_map = ours(x)
    _, weights, indices = hf(x)
    assert probs.dtype == torch.float32
    hf_map = torch.zeros_like(routing_map).scatter(1, indices, True)
    assert torch.equal(routing_map, hf_map)
    torch.testing.assert_close(probs, torch.zeros_like(probs).scatter(1, indices, weights), rtol=1e-6, atol=0)
    plain = TopKRouter(dataclasses.replace(ours.cfg, moe_router_num_groups=None, moe_router_group_topk=None),
                       sequence_parallel=False).to(torch.bfloat16).eval()
    plain.load_state_dict(ours.state_dict())
    assert not torch.equal(plain(x)[1], routing_map)  # the group selection matters on these tokens


def _layer_run(model_dtype: torch.dtype, **kw):
    """One MoE layer (allgather, EP 1) forward and backward: (output, router weights, {name: grad})."""
    torch.manual_seed(0)
    layer = MoELayer(router_cfg(moe_aux_loss_coeff=0.01, **kw), sequence_parallel=False, layer_number=1)
    layer = layer.to(model_dtype).train()
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(2)).to(model_dtype).requires_grad_()
    out = layer(x)
    with aux_loss_scale(1.0):
        out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), layer.router(x.detach())[0].detach(), grads, x.grad.clone(), layer, x.detach()


def test_router_dtype():
    default = _layer_run(torch.float32)
    fp32 = _layer_run(torch.float32, moe_router_dtype="fp32")
    assert torch.equal(default[0], fp32[0]) and torch.equal(default[3], fp32[3])  # fp32 run: not a bit changes
    assert all(torch.equal(default[2][n], fp32[2][n]) for n in default[2])
    fp64 = _layer_run(torch.float32, moe_router_dtype="fp64")
    out, probs, grads, _, layer, x = fp64
    assert out.dtype == torch.float32 and probs.dtype == torch.float64
    assert grads["router.weight"].dtype == torch.float32 and grads["router.weight"].abs().sum() > 0
    logits = x.reshape(-1, H).double() @ layer.router.weight.detach().double().t()  # the formula, in fp64
    torch.testing.assert_close(probs, topk_routing(logits, K)[0], rtol=1e-12, atol=0)
    # bf16 model: the default GEMM is bf16 (then fp32 scores), fp32 is the fp32 GEMM of the bf16 values
    bf16 = _layer_run(torch.bfloat16)
    bf16_fp32 = _layer_run(torch.bfloat16, moe_router_dtype="fp32")
    assert bf16[0].dtype == bf16_fp32[0].dtype == torch.bfloat16
    assert bf16[1].dtype == torch.bfloat16 and bf16_fp32[1].dtype == torch.float32
    layer, x = bf16_fp32[4], bf16_fp32[5]
    exact = x.reshape(-1, H).float() @ layer.router.weight.detach().float().t()
    torch.testing.assert_close(bf16_fp32[1], topk_routing(exact, K)[0], rtol=1e-6, atol=0)
    rounded = (x.reshape(-1, H) @ layer.router.weight.detach().t()).float()  # bf16 GEMM: differs
    assert not torch.equal(topk_routing(rounded, K)[0], bf16_fp32[1])


# --------------------------------------------------------------------------------------------------
# global_aux_loss
# --------------------------------------------------------------------------------------------------


def _switch(scores, loads, total):
    return float((scores.sum(0) * loads).sum() * (E / (K * total * total)))


def test_global_aux_loss_is_megatrons_running_mean_and_restarts_after_a_step():
    cfg = router_cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    holder = torch.nn.Module()
    holder.router = router = TopKRouter(cfg, sequence_parallel=False)
    record = router.record = MoERecord(E)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 2, H, generator=g) for _ in range(3)]
    loads = torch.zeros(E)
    for step in range(2):
        for m, x in enumerate(xs[:3 - step]):
            router(x)
            logits = x.reshape(-1, H) @ router.weight.detach().t()
            scores = torch.softmax(logits, -1)
            loads += torch.zeros(16, E).scatter(1, scores.topk(K, -1).indices, 1.0).sum(0)
            expected = _switch(scores, loads / (m + 1), 16)
            assert abs(record.take()["aux_loss"] - expected) < 1e-6 * expected
        after_optimizer_step([holder])
        assert router.global_forwards == 0 and not router.global_tokens_per_expert.any()
        loads.zero_()


def test_recomputation_counts_the_global_loads_once():
    def run(recompute):
        torch.manual_seed(0)
        model_parallel_seed(5)
        extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
            if recompute else {}
        cfg = dataclasses.replace(router_cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1),
                                  num_layers=2, seq_length=8, **extra)
        net = GPTModel(cfg, 64, 5)
        g = torch.Generator().manual_seed(4)
        for _ in range(2):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            loss = masked_mean_loss(net(input_ids=tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(2, 8))
            with aux_loss_scale(0.5):
                (loss / 2).backward()
        routers = [m for m in net.modules() if isinstance(m, TopKRouter)]
        return ([p.grad.clone() for p in net.parameters()], [r.global_tokens_per_expert.clone() for r in routers],
                [int(r.global_forwards) for r in routers])
    plain, recomputed = run(False), run(True)
    assert plain[2] == recomputed[2] == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], recomputed[1]))
    assert all(torch.equal(a, b) for a, b in zip(plain[0], recomputed[0]))


GLOBAL = {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": None}


def _batches(n, mbs, seq=16, vocab=128):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (n * mbs, seq + 1), generator=g)
    return [{"tokens": tokens[i * mbs:(i + 1) * mbs, :-1], "labels": tokens[i * mbs:(i + 1) * mbs, 1:],
             "loss_mask": torch.ones(mbs, seq)} for i in range(n)]


def _global_aux_distributed():
    """DP 2 x EP 2, one micro-batch of 2 sequences per DP rank: (loss averaged over DP, {name: full grad})."""
    from moe_harness import make_cfg
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(2)
    model_parallel_seed(7)
    cfg = make_cfg(**GLOBAL)
    chunks = build_chunks_for_rank(cfg, 128, 0, 1, 1)
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), bucket_size=20000)
    ddp.zero_grad()
    loss = synchronous_forward_backward("1f1b", chunks, ddp, [_batches(2, 2)[ps.get_data_parallel_rank()]])
    ddp.finish_grad_sync()
    dist.all_reduce(loss)
    return (loss.item() / 2, {f"model.{n}": full_grad(p) for n, p in named_parameters_global(chunks)},
            take_records(chunks))


def test_global_aux_loss_over_data_parallel_equals_one_process():
    results = run_distributed(_global_aux_distributed, 2)
    from moe_harness import make_cfg
    torch.set_num_threads(1)
    model_parallel_seed(7)
    net = GPTModel(make_cfg(**{**GLOBAL, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.05})
                   .model, 128, 7)
    whole = _batches(1, 4)[0]
    loss = masked_mean_loss(net(input_ids=whole["tokens"], labels=whole["labels"]), whole["loss_mask"])
    with aux_loss_scale(1.0):
        loss.backward()
    logged = take_records([net])  # each rank logs its loss x DP: their mean is the DP sum, Megatron's reading
    for layer, record in logged.items():
        mean = sum(r[2][layer]["aux_loss"] for r in results) / 2
        assert abs(mean - record["aux_loss"]) < 1e-5 * record["aux_loss"], (layer, mean, record)
    for dist_loss, grads, _ in results:
        assert abs(dist_loss - loss.item()) < 1e-5 * loss.item()
        for name, p in net.named_parameters():
            torch.testing.assert_close(grads[f"model.{name}"], p.grad, rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------------
# --add-qkv-bias
# --------------------------------------------------------------------------------------------------

QKV_BIAS = {"add_qkv_bias": True, "group_query_attention": True, "num_query_groups": 2}


def test_qkv_bias_only_on_the_qkv_projection():
    net = GPTModel(dataclasses.replace(router_cfg(**QKV_BIAS), num_layers=2, num_attention_heads=4), 64, 1)
    biases = sorted(n for n, _ in net.named_parameters() if n.endswith("bias") and "norm" not in n)
    assert biases == ["layers.0.attention.qkv.bias", "layers.1.attention.qkv.bias"]
    assert net.layers[0].attention.qkv.bias.shape == ((4 + 2 * 2) * (H // 4),)


def test_qkv_bias_with_gqa_and_experts_under_tensor_parallelism_equals_one_process():
    """TP 2 (sequence parallel) x DP 2, EP 2 with expert TP 1: the bias is split over TP like the QKV rows."""
    ref = reference(M * 2, **QKV_BIAS)
    assert ref[1]["model.layers.0.attention.qkv.bias"].abs().sum() > 0
    check_equal(run_distributed(distributed_run, 4, tp=2, args=(QKV_BIAS, 2, 1, "1f1b", 1, True)), ref)


# --------------------------------------------------------------------------------------------------
# Megatron's switches that change no number here
# --------------------------------------------------------------------------------------------------


def test_switches_that_change_no_number_are_accepted_with_one_start_up_line():
    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    from megatron_po.models.moe.rules import no_op_switches_line
    mock = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-experts", "8"]
    switches = ["--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap"]
    cfg = parse_args(mock + switches + ["--moe-router-dtype", "fp32", "--moe-router-num-groups", "1",
                                        "--moe-router-group-topk", "1", "--moe-layer-recompute"])
    validate(cfg, 1)  # Moonlight's 1 group of 1 is no grouping; all of it runs
    line = no_op_switches_line(cfg.model)
    assert "\n" not in line and all(flag in line for flag in switches) and "no effect here" in line
    assert no_op_switches_line(parse_args(mock).model) is None
