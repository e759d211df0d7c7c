"""The MoE layer in one process (models/moe/): the router's rules against their closed forms, the capacity's drop
policies, the auxiliary losses and their way into the gradients, grouped GEMM = loop, the expert bias update,
--moe-layer-freq's parser, recomputation (--moe-layer-recompute too), torch.compile (its recompilations counted)
and FP8.

Tolerances: closed forms and grouped = loop are exact (fp32 and bf16, same ops); the auxiliary-loss gradient
against its explicit sum 1e-6; recomputation bitwise; the compiled layer (aot_eager: no code generation) equals
the eager one to 1e-6.
"""

import dataclasses
import math

import pytest
import torch
from moe_harness import BASE, SEED, VOCAB, microbatches

from megatron_po.config import ModelConfig
from megatron_po.errors import ConfigError
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.moe import aux_losses
from megatron_po.models.moe.experts import GroupedExperts, grouped_mm_error
from megatron_po.models.moe.layer import MoELayer, take_records
from megatron_po.models.moe.layout import parse_layer_freq
from megatron_po.models.moe.router import capacity_mask, expert_capacity, topk_routing, update_expert_bias
from megatron_po.models.transformer import SharedExpertMLP, TransformerLayer
from megatron_po.tensor_parallel import model_parallel_seed


def moe_cfg(**kw) -> ModelConfig:
    return dataclasses.replace(BASE, moe_layer_freq="1", **kw)


# ---- --moe-layer-freq ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,layers,expected", [
    ("1", 4, [1, 1, 1, 1]), ("2", 4, [1, 0, 1, 0]), ("3", 5, [1, 0, 0, 1, 0]),
    ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]), ("[1,0]*2", 4, [1, 0, 1, 0]), ("([0]*2+[1,0]+3*[1])", 7, [0, 0, 1, 0, 1, 1, 1]),
])
def test_layer_freq_forms(text, layers, expected):
    assert parse_layer_freq(text, layers) == [bool(v) for v in expected]


@pytest.mark.parametrize("text,words", [
    ("([0]*1+[1]*2)", "3 entries for --num-layers 4"), ("[0,2,1,1]", "one 0 or 1 per layer"), ("0", "must be >= 1"),
    ("__import__('os').system('true')", "is not an integer N"), ("[1]*4 if True else 0", "is not"),
    ("[1.0]*4", "is not"), ("([1]*10**9)", "is not"),
])
def test_layer_freq_refuses_anything_else_without_evaluating_it(text, words):
    with pytest.raises(ConfigError) as info:
        parse_layer_freq(text, 4)
    assert words in str(info.value) and "\n" not in str(info.value)


# ---- the router ------------------------------------------------------------------------------------------------

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.1, 0.3, 0.2, 0.0], [-2.0, 3.0, 1.0, 2.5]])


def test_softmax_over_the_topk_and_pre_softmax():
    probs, routing_map = topk_routing(LOGITS, 2)
    assert routing_map.tolist() == [[True, True, False, False], [False, True, True, False], [False, True, False, True]]
    e = math.exp(1.0)
    assert probs[0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1), 0, 0])
    pre, _ = topk_routing(LOGITS, 2, pre_softmax=True)
    full = torch.softmax(LOGITS, dim=-1)
    assert torch.equal(pre, full * routing_map)
    scaled, _ = topk_routing(LOGITS, 2, scaling_factor=2.5)
    assert torch.allclose(scaled, 2.5 * probs)


def test_sigmoid_scores_normalized_and_the_bias_only_chooses():
    probs, routing_map = topk_routing(LOGITS, 2, score_function="sigmoid")
    s = torch.sigmoid(LOGITS) * routing_map
    assert torch.allclose(probs, s / s.sum(-1, keepdim=True))
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is chosen by every token, at its unbiased score
    biased, biased_map = topk_routing(LOGITS, 2, score_function="sigmoid", expert_bias=bias)
    assert biased_map[:, 3].all()
    s = torch.sigmoid(LOGITS) * biased_map
    assert torch.allclose(biased, s / s.sum(-1, keepdim=True))


def test_capacity_keeps_the_highest_weights_or_the_first_tokens():
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.2, 0.8]])
    routing_map = probs > 0.25
    assert expert_capacity(4, 2, 1, 1.0) == 2
    keep = capacity_mask(probs, routing_map, 2, "probs")
    assert (routing_map & keep)[:, 0].tolist() == [False, True, True, False]  # 0.9 and 0.7 of 0.6, 0.7, 0.9
    keep = capacity_mask(probs, routing_map, 2, "position")
    assert (routing_map & keep)[:, 0].tolist() == [True, True, False, False]  # the first two routed
    # Padding (--moe-pad-expert-input-to-capacity keeps `keep` itself): exactly the capacity, routed tokens first,
    # then the first unrouted ones (weight 0).
    one_routed = torch.tensor([[False, True], [False, False], [True, False], [False, False]])
    for policy in ("position", "probs"):
        keep = capacity_mask(probs * one_routed, one_routed, 2, policy)
        assert keep.sum(0).tolist() == [2, 2]
        assert keep[:, 0].tolist() == [True, False, True, False] and keep[:, 1].tolist() == [True, True, False, False]
    assert capacity_mask(probs, routing_map, 4, "probs").all()


def test_aux_losses_closed_forms():
    uniform = torch.full((8, 4), 0.25)
    topk_map = torch.zeros(8, 4, dtype=torch.bool)
    topk_map[torch.arange(8), torch.arange(8) % 4] = True
    assert aux_losses.load_balancing_loss(uniform, topk_map, 1).item() == pytest.approx(1.0)  # balanced: 1
    skewed = torch.zeros(8, 4, dtype=torch.bool)
    skewed[:, 0] = True
    assert aux_losses.load_balancing_loss(uniform, skewed, 1).item() == pytest.approx(1.0)
    peaked = torch.tensor([[1.0, 0, 0, 0]] * 8)
    assert aux_losses.load_balancing_loss(peaked, skewed, 1).item() == pytest.approx(4.0)  # all on one: E
    assert aux_losses.sequence_load_balancing_loss(peaked, skewed, 1, 4, 2).item() == pytest.approx(4.0)
    logits = torch.randn(5, 4)
    assert aux_losses.z_loss(logits).item() == pytest.approx(torch.logsumexp(logits, -1).square().mean().item())


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_aux_losses_reach_the_gradient_at_the_executors_scale(balancing):
    """The layer with coefficients c_aux, c_z gives the router the gradient of out.w + scale (c_aux aux + c_z z)."""
    cfg = moe_cfg(moe_router_load_balancing_type=balancing, moe_shared_expert_intermediate_size=None)
    x = torch.randn(8, 2, 32)
    w = torch.randn(8, 2, 32)
    torch.manual_seed(0)
    layer = MoELayer(cfg, False, 1)
    with aux_losses.aux_loss_scale(0.25):
        (layer(x) * w).sum().backward()
    recorded = layer.record.take()
    plain = MoELayer(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), False, 1)
    plain.load_state_dict(layer.state_dict())
    logits = torch.nn.functional.linear(x, plain.router.weight).reshape(-1, 8)
    scores, topk_map = torch.softmax(logits, -1), None
    top = scores.topk(2, -1).indices
    topk_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    aux = (aux_losses.load_balancing_loss(scores, topk_map, 2) if balancing == "aux_loss"
           else aux_losses.sequence_load_balancing_loss(scores, topk_map, 2, 8, 2))
    z = aux_losses.z_loss(logits)
    ((plain(x) * w).sum() + 0.25 * (cfg.moe_aux_loss_coeff * aux + cfg.moe_z_loss_coeff * z)).backward()
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad, rtol=1e-6, atol=1e-7)
    assert recorded["aux_loss"] == pytest.approx(aux.item()) and recorded["z_loss"] == pytest.approx(z.item())
    no_aux = MoELayer(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), False, 1)
    no_aux.load_state_dict(layer.state_dict())
    (no_aux(x) * w).sum().backward()
    assert not torch.allclose(no_aux.router.weight.grad, layer.router.weight.grad)  # the losses do matter here


# ---- the experts -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu,bias", [(True, False), (False, True)])
def test_grouped_gemm_equals_the_loop(dtype, swiglu, bias):
    assert grouped_mm_error("cpu", dtype, (32, 32)) is None
    cfg = moe_cfg(swiglu=swiglu, add_bias_linear=bias)
    torch.manual_seed(0)
    loop = GroupedExperts(cfg, range(2, 6), 1, 0, grouped_gemm=False).to(dtype)
    grouped = GroupedExperts(cfg, range(2, 6), 1, 0, grouped_gemm=True).to(dtype)
    grouped.load_state_dict(loop.state_dict())
    if bias:
        with torch.no_grad():
            for p in list(loop.parameters()):
                if p.dim() == 2:
                    p.normal_()
        grouped.load_state_dict(loop.state_dict())
    counts = torch.tensor([5, 0, 3, 8])  # an expert without tokens
    x = torch.randn(16, 32, dtype=dtype)
    g = torch.randn(16, 32, dtype=dtype)
    outs = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        y.backward(g)
        outs.append([y, xi.grad] + [p.grad for p in experts.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][-1 if not bias else 2].abs().sum() > 0


def test_grouped_gemm_gives_an_expert_without_tokens_an_exactly_zero_weight_gradient(monkeypatch):
    """torch._grouped_mm may leave an empty group's block of the weight gradient unwritten or wrong (pytorch#172439:
    non-zero gradients for experts without tokens on B200 GPUs); the CPU kernel writes zeros, so here it is
    replaced by one that leaves NaN in those blocks, as such a GPU may: the gradient of an expert that got no
    token is still exactly zero, the others' untouched."""
    real = torch._grouped_mm

    def leaves_empty_groups_unwritten(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        if out.dim() == 3:  # [groups, out, in]: the weight gradient
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out
    torch.manual_seed(0)
    experts = GroupedExperts(moe_cfg(), range(4), 1, 0, grouped_gemm=True)
    reference = GroupedExperts(moe_cfg(), range(4), 1, 0, grouped_gemm=False)
    reference.load_state_dict(experts.state_dict())
    counts, x = torch.tensor([5, 0, 3, 0]), torch.randn(8, 32)
    monkeypatch.setattr(torch, "_grouped_mm", leaves_empty_groups_unwritten)
    for module in (experts, reference):
        module(x, counts).square().sum().backward()
    for p, ref in zip(experts.parameters(), reference.parameters()):
        assert not p.grad[counts == 0].isnan().any() and not p.grad[counts == 0].any()
        assert torch.equal(p.grad, ref.grad) and p.grad[0].abs().sum() > 0


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatch_hands_restore_a_named_context(kind):
    """One process: the dispatch groups the pairs by expert and hands `restore` a dataclass (not a tuple); restore
    gives every token the weighted sum of its experts' outputs."""
    from megatron_po.models.moe.dispatcher import DISPATCHERS, AllGatherContext, AllToAllContext
    g = torch.Generator().manual_seed(0)
    tokens, logits = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    probs, routing_map = topk_routing(logits, 2)
    dispatcher = DISPATCHERS[kind](4)
    x, counts, context = dispatcher.dispatch(tokens, probs, routing_map)
    assert isinstance(context, {"alltoall": AllToAllContext, "allgather": AllGatherContext}[kind])
    assert dataclasses.is_dataclass(context) and counts.tolist() == routing_map.sum(0).tolist()
    scale = torch.arange(1.0, 5.0).repeat_interleave(counts)[:, None]  # expert e multiplies its tokens by e + 1
    expected = tokens * (probs * torch.arange(1.0, 5.0)).sum(-1, keepdim=True)
    torch.testing.assert_close(dispatcher.restore(x * scale, context), expected, rtol=1e-6, atol=1e-6)


def test_experts_hold_their_slice_of_the_one_process_weights():
    cfg = moe_cfg()
    torch.manual_seed(0)
    whole = GroupedExperts(cfg, range(0, 8), 1, 0)
    torch.manual_seed(0)
    part = GroupedExperts(cfg, range(4, 8), 2, 1)  # EP rank 1 of 2, expert-TP rank 1 of 2
    assert torch.equal(part.fc1, whole.fc1[4:8, 16:])
    assert torch.equal(part.fc1_gate, whole.fc1_gate[4:8, 16:])
    assert torch.equal(part.fc2, whole.fc2[4:8, :, 16:])
    assert all(p.expert_parallel and not p.allreduce for p in part.parameters())


# ---- the expert bias -------------------------------------------------------------------------------------------

def bias_model(**kw):
    model_parallel_seed(SEED)
    cfg = dataclasses.replace(BASE, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                              moe_router_bias_update_rate=0.01, **kw)
    return GPTModel(cfg, VOCAB, SEED)


def test_expert_bias_update_closed_form_and_what_is_counted():
    net = bias_model()
    routers = [layer.mlp.router for layer in net.layers if hasattr(layer.mlp, "router")]
    b = microbatches(2)
    with torch.no_grad():  # evaluation does not count
        net.eval()(input_ids=b[0]["tokens"], labels=b[0]["labels"])
    net.train()
    assert all(r.tokens_per_expert.sum() == 0 for r in routers)
    for mb in b:
        masked_mean_loss(net(input_ids=mb["tokens"], labels=mb["labels"]), mb["loss_mask"]).backward()
    counts = [r.tokens_per_expert.clone() for r in routers]
    assert all(c.sum() == 2 * 2 * 16 * 2 for c in counts)  # every token's top-2, two micro-batches
    update_expert_bias([net])
    for r, c in zip(routers, counts):
        assert torch.equal(r.expert_bias, 0.01 * torch.sign(c.mean() - c))
        assert r.tokens_per_expert.sum() == 0 and r.expert_bias.dtype == torch.float32


def test_expert_bias_stays_fp32_in_a_bf16_model():
    net = bias_model().to(torch.bfloat16)
    router = net.layers[1].mlp.router
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.tokens_per_expert.dtype == torch.float32
    assert "layers.1.mlp.router.expert_bias" in net.state_dict()  # a buffer: saved, not stepped


# ---- recomputation, compile, FP8 -------------------------------------------------------------------------------

def run_model(**kw):
    net = bias_model(**kw)
    for mb in microbatches(2):
        masked_mean_loss(net(input_ids=mb["tokens"], labels=mb["labels"]), mb["loss_mask"]).backward()
    counts = [layer.mlp.router.tokens_per_expert.clone() for layer in net.layers if hasattr(layer.mlp, "router")]
    return [p.grad for p in net.parameters()], counts, take_records([net])


def test_full_recomputation_is_bitwise_and_counts_once():
    plain = run_model()
    recomputed = run_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for a, b in zip(plain[0], recomputed[0]):
        assert torch.equal(a, b)
    for a, b in zip(plain[1], recomputed[1]):
        assert torch.equal(a, b)
    assert plain[2] == recomputed[2]


def test_moe_layer_recomputation_is_bitwise_counts_once_and_keeps_only_its_input():
    """--moe-layer-recompute (the recipes of DeepSeek-R1, Kimi K2 and Qwen3-235B pass it): the same gradients,
    expert loads and records as without, the expert bias replayed; the layer's forward saves no activation of its
    own for the backward, only its input."""
    plain, recomputed = run_model(), run_model(moe_layer_recompute=True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], recomputed[0]))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], recomputed[1]))
    assert plain[2] == recomputed[2]
    kept, recomputed_kept = moe_layer_saved_bytes(), moe_layer_saved_bytes(moe_layer_recompute=True)
    input_bytes = 16 * 2 * BASE.hidden_size * 4
    assert recomputed_kept == input_bytes and kept > 10 * input_bytes, (kept, recomputed_kept)


def moe_layer_saved_bytes(**kw) -> int:
    """Bytes one MoE layer's forward saves for its backward (16 x 2 tokens)."""
    model_parallel_seed(SEED)
    cfg = moe_cfg(**kw)
    layer = MoELayer(cfg, sequence_parallel=False, layer_number=0,
                     shared_experts=lambda: SharedExpertMLP(cfg, False, cfg.moe_shared_expert_intermediate_size))
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(16, 2, BASE.hidden_size, requires_grad=True))
    return total[0]


def test_recompute_modules_moe_is_the_moe_layer_recompute():
    """Megatron-core's --recompute-granularity selective --recompute-modules moe (its --moe-layer-recompute's
    current spelling): the same gradients as without, the layer keeps only its input; with core_attn alone the MoE
    layer keeps its activations; shared_experts recomputes the shared experts only."""
    selective = dict(recompute_granularity="selective")
    plain, recomputed = run_model(), run_model(**selective, recompute_modules=["moe"])
    assert all(torch.equal(a, b) for a, b in zip(plain[0], recomputed[0]))
    assert plain[2] == recomputed[2]
    assert moe_layer_saved_bytes(**selective, recompute_modules=["moe"]) == 16 * 2 * BASE.hidden_size * 4
    assert moe_layer_saved_bytes(**selective, recompute_modules=["core_attn"]) == moe_layer_saved_bytes()
    # shared_experts: the shared experts alone recomputed, the same gradients, less kept
    shared = dict(selective, recompute_modules=["shared_experts"])
    assert all(torch.equal(a, b) for a, b in zip(plain[0], run_model(**shared)[0]))
    assert moe_layer_saved_bytes(**shared) < moe_layer_saved_bytes()


def test_forced_load_balancing_routes_evenly_whatever_the_router_learned():
    """--moe-router-force-load-balancing (Megatron's RandomSTE): a router whose weights send every token to
    expert 0 gives each of 8 experts 4096 x 2 / 8 tokens within 10 % (random normal logits; the binomial's
    standard deviation is 30 of 1024); the gradient reaches the router's weight through the logits unchanged; a
    recomputed MoE layer draws the same logits (bitwise the same gradients)."""
    from megatron_po.models.moe.router import RandomLogits, TopKRouter
    model_parallel_seed(SEED)
    cfg = moe_cfg(num_experts=8, moe_router_topk=2)
    x = torch.randn(512, 8, cfg.hidden_size) + 1
    counts = {}
    for forced in (False, True):
        router = TopKRouter(dataclasses.replace(cfg, moe_router_force_load_balancing=forced), sequence_parallel=False)
        with torch.no_grad():
            router.weight.zero_()
            router.weight[0] = 10.0  # every token's highest logit: expert 0
        router.record = None
        router.eval()
        _, routing_map = router(x)
        counts[forced] = routing_map.sum(dim=0)
    assert counts[False][0] == 4096 and counts[False].sum() == 8192
    assert ((counts[True] - 1024).abs() < 103).all(), counts[True]
    logits = torch.randn(6, 8, requires_grad=True)
    upstream = torch.randn(6, 8)
    drawn = RandomLogits.apply(logits)
    assert not torch.equal(drawn, logits)
    drawn.backward(upstream)
    assert torch.equal(logits.grad, upstream)
    forced = dict(moe_router_force_load_balancing=True)
    plain, recomputed = run_model(**forced), run_model(**forced, moe_layer_recompute=True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], recomputed[0]))


def test_compiled_moe_layer_equals_eager_and_never_recompiles():
    """Dropless routing gives each expert a data-dependent token count: the routed part runs eagerly between
    the layer's graphs (layer.py), whose shapes never change. TorchDynamo's counters after the first micro-batch
    (forward and backward) stay the same over micro-batches routed differently."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megatron_po.models.compiled_layers import compile_stats
    from megatron_po.tensor_parallel import graph_breaks
    torch._dynamo.reset()
    graph_breaks.install()
    cfg = moe_cfg()
    torch.manual_seed(0)
    eager, compiled = TransformerLayer(cfg, False, 1), TransformerLayer(cfg, False, 1)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="aot_eager")
    seen, stats = [], []
    for step in range(4):
        x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(step))
        grads = []
        for layer in (eager, compiled):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(torch.ones_like(y))
            grads.append([y, xi.grad])
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
        seen.append(take_records([compiled])[1]["tokens_per_expert"])
        stats.append((compile_stats(), counters["stats"]["unique_graphs"]))
    assert len({tuple(s) for s in seen}) == 4  # every micro-batch routed differently
    assert stats[0][0]["graphs"] > 0 and all(s == stats[0] for s in stats), stats  # no recompilation
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_fp8_moe_model_runs_its_shared_experts_in_fp8(monkeypatch):
    from megatron_po.models import fp8
    monkeypatch.setattr(fp8, "_cuda_capability", lambda: None)  # torchao's CPU emulation
    cfg = dataclasses.replace(BASE, fp8_format="hybrid", hidden_size=32, moe_shared_expert_intermediate_size=32)
    net = GPTModel(cfg, VOCAB, SEED)
    moe = net.layers[1].mlp
    assert moe.shared_experts.fc1.fp8 is not None and net.layers[1].attention.qkv.fp8 is not None
    assert not any(hasattr(m, "fp8") for m in (moe.experts, moe.router))
    mb = microbatches(1)[0]
    masked_mean_loss(net(input_ids=mb["tokens"], labels=mb["labels"]), mb["loss_mask"]).backward()
    assert moe.experts.fc1.grad.abs().sum() > 0
    assert "routed experts' and the router's stay in bf16" in fp8.fp8_summary(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_on_cuda_where_it_runs():
    """torch._grouped_mm's CUDA kernels take bf16 (Hopper and newer): there it gives the loop's numbers to bf16's
    resolution (another GEMM kernel: not bitwise); the probe names the dtypes it cannot run, which the config
    rule refuses."""
    error = grouped_mm_error("cuda", torch.bfloat16, (32, 32))
    if error is not None:
        pytest.skip(f"no bf16 grouped GEMM on this GPU: {error}")
    cfg = moe_cfg()
    torch.manual_seed(0)
    loop = GroupedExperts(cfg, range(8), 1, 0, grouped_gemm=False).to("cuda", torch.bfloat16)
    grouped = GroupedExperts(cfg, range(8), 1, 0, grouped_gemm=True).to("cuda", torch.bfloat16)
    grouped.load_state_dict(loop.state_dict())
    counts = torch.tensor([5, 0, 3, 8, 16, 1, 0, 31], device="cuda")
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    outs = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        y.float().square().sum().backward()
        outs.append([y, xi.grad] + [p.grad for p in experts.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for p in grouped.parameters():  # the experts without tokens: exactly zero (pytorch#172439)
        assert not p.grad[counts == 0].any()
