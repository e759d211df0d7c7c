"""Every asynchronous method on a Mixture-of-Experts GPT (issue 48 item 3).

- The formulas (tests/test_async_policies.py's recorder and independent replay, with MoE chunks: 16 experts,
  top-2, shared experts, aux and z losses): the weights every forward and backward ran on, each micro-batch's
  gradient and every step equal the method's closed form with torch.optim (fp32, rtol 1e-4 / atol 1e-5, the
  replay's tolerance). The MoE chunks run PipeOptim's and SpecTrain's predictions by pointer swaps (their
  experts' backward reads the stacked parameter itself, experts.py), so a backward reading the forward's
  predicted storage would fail the gradient check. Experts that got no token from a step's micro-batch occur
  (asserted): their gradient slice is exactly zero, they still move by the optimizer's momentum (torch.optim
  moves a parameter whose gradient is a zero tensor; the stacked parameter always has one), and the
  prediction extrapolates them W − s·lr·ΔW like every other weight (the replay checks every predicted forward).
- The closed form for such an expert, by hand: Adam, SGD with momentum and Muon move (and PipeOptim predicts)
  a zero-gradient expert slice by the momentum alone; Muon orthogonalises each expert's matrix on its own.
- The emulator equals the distributed run bit for bit with MoE (PP only: PipeOptim, PipeDream interleaved,
  2BW, SpecTrain, PipeNAG; k = 2, error feedback, grouped GEMM, the expert bias; PipeOptim and PipeDream in
  bf16 with fp32 main params), and PP 2 x EP 2 (the experts split over the two data-parallel ranks of each
  stage) equals the emulator on the concatenated micro-batches (rtol 1e-5 / atol 1e-6, reduction orders; the
  sequence-level aux loss and the z-loss are means over sequences and tokens, so the halves' mean is the
  whole's).
- The expert bias (aux-loss-free balancing) moves once per optimizer step of its stage, by the tokens its
  router counted in the training forwards since the last update: every forward counted once (never the
  recomputation, never an evaluation), the recomputation routes with the bias its forward saw (bitwise the
  run without recomputation; without that replay it is not).
"""

from __future__ import annotations

import copy
import dataclasses
import types
from functools import partial

import pytest
import torch
import test_async_policies
from dist_harness import run_distributed
from test_async_policies import LR, get_batch, lr_fn_for, record, replay

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.models.moe.experts import GroupedExperts
from megatron_po.models.moe.router import TopKRouter
from megatron_po.pipeline.async_pipeline import AsyncEmulator, AsyncPipelineRank, segment_schedule
from megatron_po.pipeline.async_policy import spectrain_staleness
from megatron_po.tensor_parallel import model_parallel_seed

VOCAB, SEED = 64, 5

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, hidden_dropout=0.0,
                  attention_dropout=0.0, make_vocab_size_divisible_by=8, untie_embeddings_and_output_weights=True,
                  add_bias_linear=False, swiglu=True, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=16,
                  moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
BIAS = {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
        "moe_router_bias_update_rate": 0.05}


def moe_cfg(num_layers: int, **model) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(MOE, num_layers=num_layers, **model)
    cfg.training.seed = SEED
    return cfg


def optimizer_kwargs(optimizer: str) -> dict:
    kwargs = {"lr": LR[optimizer], "weight_decay": 0.01, "sgd_momentum": 0.9}
    if optimizer == "muon":  # fp32 Newton-Schulz: the replay's rounding must not flip bf16 roundings
        kwargs["muon_fp32_matmul_prec"] = "highest"
    return kwargs


def moe_emulator(method, optimizer, D, v, k, model=None, weight_decay=0.01, clip_grad=0.0, precision=None,
                 **options):
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    kwargs = {**optimizer_kwargs(optimizer), "weight_decay": weight_decay}
    cfg = moe_cfg(D * v, **(model or {}))
    for key, value in (precision or {}).items():
        setattr(cfg.precision, key, value)
    return AsyncEmulator(cfg, VOCAB, method, D, v, k, optimizer, kwargs, lr_fn_for(optimizer), clip_grad, **options)


def deepcopy_keeping_marks(obj):
    """copy.deepcopy, the copied module's parameters keeping their attributes (torch's Parameter.__deepcopy__
    drops them)."""
    out = copy.deepcopy(obj)
    for copied, original in zip(out.parameters(), obj.parameters()):
        copied.__dict__.update(original.__dict__)
    return out


def expert_indices(chunk) -> list[int]:
    return [i for i, p in enumerate(chunk.parameters()) if getattr(p, "expert_parallel", False)]


def zero_token_moves(events, indices) -> int:
    """Experts whose gradient from a step's micro-batches is exactly zero (they got no token) and whose
    weights that step still moved."""
    moved, grads, before = 0, None, None
    for ev in events:
        if ev["kind"] == "B":
            grads = ev["grad"] if grads is None else [a + b for a, b in zip(grads, ev["grad"])]
        elif ev["kind"] == "S":
            if before is not None:
                for i in indices:
                    for e in range(grads[i].shape[0]):
                        if not grads[i][e].any() and not torch.equal(before[i][e], ev["weights"][i][e]):
                            moved += 1
            before, grads = ev["weights"], None
        elif ev["kind"] == "F" and before is None:
            before = ev["weights"]
    return moved


# --------------------------------------------------------------------------------------------------
# The experts' backward reads the parameter, not the forward's storage
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_expert_projection_backward_reads_the_live_parameter(grouped):
    """`ExpertProjection` computes what autograd computes for the plain ops (per-expert matmuls of views, or
    torch._grouped_mm of the transposed stack), bitwise on a CPU, an expert without tokens included. A forward
    run with the parameter pointed at other storage (a prediction) and pointed back before the backward gives
    the input gradient of the live weights, as PipeOptim's pointer swaps need; the plain ops would give that of
    the prediction (their saved views keep its storage)."""
    from megatron_po.models.moe.experts import ExpertProjection
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    x, w = torch.randn(16, 32), torch.nn.Parameter(torch.randn(4, 48, 32))
    g = torch.randn(16, 48)

    def plain(inp, weight):
        if grouped:
            return torch._grouped_mm(inp, weight.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
        return torch.cat([piece @ weight[e].t() for e, piece in enumerate(inp.split(counts.tolist()))])

    runs = []
    for fn in (plain, lambda inp, weight: ExpertProjection.apply(inp, weight, counts, grouped)):
        xi, wi = x.clone().requires_grad_(), torch.nn.Parameter(w.detach().clone())
        y = fn(xi, wi)
        y.backward(g)
        runs.append((y, xi.grad, wi.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert not runs[1][2][1].any() and runs[1][2][0].any()  # expert 1 got no token: a zero slice
    live = w.detach().clone()
    predicted = live - 0.1
    for fn, reads_live in ((plain, False), (lambda inp, weight: ExpertProjection.apply(inp, weight, counts, grouped),
                                            True)):
        xi, wi = x.clone().requires_grad_(), torch.nn.Parameter(live.clone())
        kept = wi.data
        wi.data = predicted.clone()  # the forward on the prediction
        y = fn(xi, wi)
        wi.data = kept  # back to the live weights before the backward
        y.backward(g)
        want = torch.cat([ge @ (live if reads_live else predicted)[e] for e, ge in enumerate(g.split(counts.tolist()))])
        torch.testing.assert_close(xi.grad, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# The methods' formulas with MoE chunks
# --------------------------------------------------------------------------------------------------

FORMULA_CASES = [
    # method, optimizer, D, v, k, segments, model, options
    ("pipeoptim", "adam", 3, 1, 1, (6, 6), {}, {}),
    ("pipeoptim", "sgd", 2, 1, 1, (6, 6), {"moe_grouped_gemm": True}, {"s_offset": 1}),
    ("pipeoptim", "muon", 2, 1, 1, (6, 6), {}, {}),
    ("pipeoptim", "adamw", 2, 2, 2, (8, 4), {}, {"include_weight_decay": True}),
    ("spectrain", "sgd", 3, 1, 1, (6, 6), {}, {}),
    ("pipedream", "adam", 3, 1, 1, (6, 6), {}, {}),
    ("pipedream-2bw", "adam", 2, 1, 2, (8, 4), {}, {}),
    ("async-naive", "adam", 2, 2, 1, (4, 4), {}, {}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,model,options", FORMULA_CASES,
                         ids=[f"{c[0]}-{c[1]}-D{c[2]}v{c[3]}k{c[4]}" for c in FORMULA_CASES])
def test_updates_follow_the_method_formula_with_experts(method, optimizer, D, v, k, segments, model, options,
                                                        monkeypatch):
    weight_decay = 0.1 if optimizer in ("adamw", "muon") else 0.01
    emu = moe_emulator(method, optimizer, D, v, k, model, weight_decay, **options)
    if method in ("pipeoptim", "spectrain"):  # the predictions swap pointers over the MoE chunks
        assert all(all(s.policy.swaps) for s in emu.stages)
    # The recorder's and the replay's model copies keep the parameters' marks (`expert_parallel`: Muon's groups)
    monkeypatch.setattr(test_async_policies, "copy", types.SimpleNamespace(deepcopy=deepcopy_keeping_marks))
    recorders, initial = record(emu)
    spectrain = {}
    for m in segments:
        if method == "spectrain":
            for key, per_mb in spectrain_staleness(segment_schedule(D, v, m, k, emu.microbatches_consumed)).items():
                spectrain.setdefault(key, {}).update(per_mb)
        emu.train_segment(get_batch, m)
    predicted = moved = 0
    with aux_loss_scale(1.0 / k):  # what the executor gives the replay's backwards: the losses' 1/k
        for r in range(D):
            for c in range(v):
                events = recorders[r].events[c]
                predicted += replay(method, optimizer, weight_decay, r, c, events, initial[(r, c)],
                                    spectrain.get((r, c)), options.get("s_offset", 0),
                                    options.get("include_weight_decay", False))
                moved += zero_token_moves(events, expert_indices(emu.stages[r].chunks[c]))
    assert moved > 0, "no expert without tokens moved by its momentum: the case proved nothing about them"
    if method in ("pipeoptim", "spectrain"):
        assert predicted > 0


def _stacked_step(optimizer: str, counts_per_step, s: int = 2):
    """A stacked expert weight [4, 8, 6] stepped by `optimizer` on the gradients of `counts_per_step` (tokens per
    expert of each step's micro-batch), then predicted s steps ahead. Returns (weights before each step, the
    gradients, the optimizer, the prediction)."""
    from megatron_po.optim import build_optimizer
    from megatron_po.optim.muon import optimizer_param_groups
    torch.manual_seed(0)
    cfg = dataclasses.replace(MOE, hidden_size=6, moe_ffn_hidden_size=8, num_experts=4, swiglu=False)
    experts = GroupedExperts(cfg, range(4), 1, 0)
    experts.fc2.requires_grad_(False)
    groups = [g for g in optimizer_param_groups(optimizer, [experts], 0.0) if g["params"]]
    opt = build_optimizer(optimizer, groups, 0.1, sgd_momentum=0.9, muon_fp32_matmul_prec="highest")
    history, grads = [], []
    for counts in counts_per_step:
        counts = torch.tensor(counts)
        x = torch.randn(int(counts.sum()), 6)
        experts.fc1.grad = None
        experts(x, counts).square().sum().backward()
        history.append(experts.fc1.detach().clone())
        grads.append(experts.fc1.grad.clone())
        opt.step()
    return history, grads, opt, dict(opt.predicted(s))[experts.fc1], experts.fc1.detach()


def test_an_expert_without_tokens_moves_and_is_predicted_by_its_momentum():
    """Expert 1 gets tokens in the first step and none in the second: its gradient slice is exactly zero (the
    stacked parameter's gradient is a zero tensor there, not None), and Adam still moves it by
    m̂/(√v̂ + ε) with m = β1·m₁, v = β2·v₁; SGD with momentum by μ·v₁; PipeOptim predicts it W − s·lr·ΔW."""
    counts = [[3, 2, 4, 1], [5, 0, 3, 2]]
    s, lr = 2, 0.1
    history, grads, _, predicted, w = _stacked_step("adam", counts, s)
    assert not grads[1][1].any() and grads[1][0].any()
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = (1 - b1) * grads[0][1] * b1  # m₂ = β1·m₁ + (1-β1)·0
    v = (1 - b2) * grads[0][1].square() * b2
    direction = (m / (1 - b1 ** 2)) / ((v / (1 - b2 ** 2)).sqrt() + eps)
    torch.testing.assert_close(w[1], history[1][1] - lr * direction, rtol=1e-6, atol=1e-7)
    assert not torch.equal(w[1], history[1][1])
    torch.testing.assert_close(predicted[1], w[1] - s * lr * direction, rtol=1e-6, atol=1e-7)
    history, grads, _, predicted, w = _stacked_step("sgd", counts, s)
    buffer = 0.9 * grads[0][1]  # v₂ = μ·v₁ + 0
    torch.testing.assert_close(w[1], history[1][1] - lr * buffer, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(predicted[1], w[1] - s * lr * buffer, rtol=1e-6, atol=1e-7)


def test_muon_orthogonalises_each_expert_on_its_own():
    """Muon steps the stacked [experts, out, in] weight as that many matrices: each expert's update equals Muon's
    on that expert's matrix alone (a 2-D parameter with the same gradients), the expert without tokens included
    (Nesterov U = μ·B: it moves by its momentum, orthogonalised)."""
    from megatron_po.optim import build_optimizer
    counts = [[3, 2, 4, 1], [5, 0, 3, 2]]
    history, grads, opt, predicted, w = _stacked_step("muon", counts)
    for e in range(4):
        alone = torch.nn.Parameter(history[0][e].clone())
        single = build_optimizer("muon", [{"params": [alone], "use_muon": True, "weight_decay": 0.0}], 0.1,
                                 muon_fp32_matmul_prec="highest")
        for g in grads:
            alone.grad = g[e].clone()
            single.step()
        torch.testing.assert_close(w[e], alone.detach(), rtol=1e-6, atol=1e-7, msg=f"expert {e}")
    assert not torch.equal(w[1], history[1][1])  # no tokens, yet moved
    update = opt.state[opt.param_groups[0]["params"][0]]["muon_update"]
    torch.testing.assert_close(predicted, w - 2 * 0.1 * update)


# --------------------------------------------------------------------------------------------------
# The emulator equals the distributed run
# --------------------------------------------------------------------------------------------------


def train_emulator(method, optimizer, D, v, k, segments, model, options, mbs=2, masked=True, clip_grad=0.0,
                   precision=None):
    emu = moe_emulator(method, optimizer, D, v, k, model, clip_grad=clip_grad, precision=precision, **options)
    losses = []
    for m in segments:
        losses += emu.train_segment(lambda mb: get_batch(mb, mbs=mbs, masked=masked), m)
    return losses, emu.full_state_dict(), expert_biases(emu.chunks)


def train_distributed(method, optimizer, v, k, segments, model, options, ep=1, mbs=2, masked=True, clip_grad=0.0,
                      precision=None, on_rank=None, etp=None):
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(ep, etp)
    model_parallel_seed(SEED)
    D = ps.get_pipeline_model_parallel_world_size()
    cfg = moe_cfg(D * v, **model)
    cfg.parallel.sequence_parallel = ps.get_tensor_model_parallel_world_size() > 1  # MoE with TP needs it
    cfg.parallel.ddp_bucket_size = 3000  # several buckets, shards cutting through parameters
    for key, value in (precision or {}).items():
        setattr(cfg.precision, key, value)
    rank = AsyncPipelineRank(cfg, VOCAB, method, v, k, optimizer, optimizer_kwargs(optimizer), lr_fn_for(optimizer),
                             clip_grad, **options)
    if on_rank is not None:
        on_rank(rank)
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = mbs // dp

    def batch(mb):  # this DP rank's rows of the micro-batch the emulator sees whole
        return {key: t[d * share:(d + 1) * share] for key, t in get_batch(mb, mbs=mbs, masked=masked).items()}

    losses = []
    for m in segments:
        out = rank.train_segment(batch, m)
        losses = None if out is None else losses + out
    weights = {name: full_expert_weight(name, w) for name, w in rank.full_state_dict().items()}
    return losses, weights, expert_biases(rank.chunks)


def full_expert_weight(name: str, w: torch.Tensor) -> torch.Tensor:
    """The whole stacked expert weight from the EP ranks' slices (every rank calls it for the same names)."""
    if ".experts." not in name or ps.get_expert_model_parallel_world_size() == 1:
        return w
    out = [torch.empty_like(w) for _ in range(ps.get_expert_model_parallel_world_size())]
    torch.distributed.all_gather(out, w.contiguous(), group=ps.get_expert_model_parallel_group())
    return torch.cat(out)


def expert_biases(chunks) -> list[torch.Tensor]:
    return [m.expert_bias.clone() for c in chunks for m in c.modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


BITWISE_CASES = [
    # method, optimizer, D, v, k, segments, model, options
    ("pipeoptim", "adam", 3, 1, 1, (6, 6), BIAS, {}),
    ("pipeoptim", "nadamw", 2, 1, 2, (4, 4), {"moe_grouped_gemm": True}, {"error_feedback": True}),
    ("pipedream", "adam", 2, 2, 1, (4, 6), BIAS, {}),
    ("pipedream-2bw", "adam", 2, 1, 2, (4, 4), {}, {"error_feedback": True}),
    ("spectrain", "sgd", 2, 1, 1, (4, 4), {}, {}),
    ("pipenag", "nag", 2, 1, 1, (4, 4), BIAS, {}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,model,options", BITWISE_CASES,
                         ids=[f"{c[0]}-{c[1]}-D{c[2]}v{c[3]}k{c[4]}{'-ef' if c[7] else ''}" for c in BITWISE_CASES])
def test_distributed_equals_emulator_bitwise_with_experts(method, optimizer, D, v, k, segments, model, options):
    args = (method, optimizer, D, v, k, segments, model, options)
    emu_losses, emu_weights, emu_biases = run_distributed(train_emulator, 1, args=args)[0]
    results = run_distributed(train_distributed, D, pp=D, args=(method, optimizer, v, k, segments, model, options),
                              timeout=240)
    assert results[D - 1][0] == emu_losses  # bit for bit
    weights = {name: w for r in results for name, w in r[1].items()}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name
    biases = [b for r in results for b in r[2]]
    assert len(biases) == len(emu_biases) == (D * v if model.get("moe_router_enable_expert_bias") else 0)
    if biases:
        assert all(torch.equal(a, b) for a, b in zip(biases, emu_biases_in_rank_order(emu_biases, D, v)))
        assert any(b.any() for b in biases)  # the bias moved


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_distributed_equals_emulator_bitwise_with_experts_in_bf16(method):
    """bf16 weights, fp32 main params and gradient accumulation: the experts' bf16 copies, predicted (PipeOptim)
    or stashed (PipeDream), and the expert bias, bit for bit the emulator's."""
    precision = {"bf16": True, "accumulate_allreduce_grads_in_fp32": True}
    args = (method, "adam", 2, 1, 1, (4, 4), BIAS, {})
    emu_losses, emu_weights, emu_biases = run_distributed(train_emulator, 1,
                                                          args=args + (2, True, 0.0, precision))[0]
    results = run_distributed(train_distributed, 2, pp=2,
                              args=(method, "adam", 1, 1, (4, 4), BIAS, {}, 1, 2, True, 0.0, precision), timeout=240)
    assert results[1][0] == emu_losses
    weights = {name: w for r in results for name, w in r[1].items()}
    assert weights.keys() == emu_weights.keys()
    assert any(".experts." in name and w.dtype == torch.bfloat16 for name, w in weights.items())
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name
    biases = [b for r in results for b in r[2]]
    assert len(biases) == len(emu_biases) == 2 and any(b.any() for b in biases)  # the bias moved
    assert all(torch.equal(a, b) for a, b in zip(biases, emu_biases_in_rank_order(emu_biases, 2, 1)))


def emu_biases_in_rank_order(biases, D, v):
    """The emulator lists its chunks in virtual-stage order (chunk c of every rank, c = 0, 1, ...); the
    distributed results come rank by rank: the same biases, reordered."""
    order = [c * D + r for r in range(D) for c in range(v)]
    return [biases[i] for i in order]


SEQ_AUX = {"moe_router_load_balancing_type": "seq_aux_loss", **BIAS}


@pytest.mark.parametrize("method,optimizer,options", [("pipeoptim", "sgd", {}), ("pipedream", "sgd", {}),
                                                      ("pipeoptim", "sgd", {"delay_compensation": 0.5})],
                         ids=["pipeoptim", "pipedream", "pipeoptim-delay-compensation"])
def test_pp2_ep2_equals_emulator_on_concatenated_microbatches(method, optimizer, options):
    """PP 2 x DP 2 with the experts split over the two data-parallel ranks of each stage (EP 2, alltoall): the
    dense gradients are averaged over DP, the experts' gradients arrive through the dispatch's backward; the
    gradient norm (clipping always active) counts every expert once over the stage's EP ranks; the expert bias
    moves by the tokens of both ranks. Delay compensation averages the gradients at the step without the DDP
    buffer (the experts over their expert-data-parallel group)."""
    args = (method, optimizer, 2, 1, 1, (4, 4), SEQ_AUX, options)
    extra = dict(mbs=4, masked=False, clip_grad=0.05)
    emu_losses, emu_weights, emu_biases = run_distributed(partial(train_emulator, **extra), 1, args=args)[0]
    results = run_distributed(partial(train_distributed, ep=2, **extra), 4, pp=2,
                              args=(method, optimizer, 1, 1, (4, 4), SEQ_AUX, options), timeout=240)
    dp_mean = [(a + b) / 2 for a, b in zip(results[2][0], results[3][0])]  # ranks: pp-major, then dp
    torch.testing.assert_close(torch.tensor(dp_mean), torch.tensor(emu_losses), rtol=1e-5, atol=1e-6)
    weights = {**results[0][1], **results[2][1]}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], emu_weights[name], rtol=1e-5, atol=1e-6, msg=name)
    for r in (0, 2):  # the EP ranks of a stage agree on the (gathered) experts and the dense weights
        assert all(torch.equal(results[r][1][n], results[r + 1][1][n]) for n in results[r][1])
    biases = results[0][2] + results[2][2]
    assert len(biases) == 2 and all(torch.equal(a, b) for a, b in zip(biases, emu_biases))
    assert all(b.any() for b in biases)


# --------------------------------------------------------------------------------------------------
# The expert bias in the stream
# --------------------------------------------------------------------------------------------------


def test_expert_bias_moves_once_per_step_by_the_tokens_counted_since_the_last():
    """PipeOptim D = 2 with full recomputation: at every step of a stage, each router's bias moves by
    rate·sign(mean − count) of the tokens its training forwards routed since the stage's last step (read right
    before the step), and the counts of all steps add up to every token's top-k of every micro-batch exactly
    once: the recomputations and the forward on the prediction are not counted twice, an evaluation not at all."""
    emu = moe_emulator("pipeoptim", "adam", 2, 1, 1, {**BIAS, "recompute_granularity": "full",
                                                       "recompute_method": "uniform", "recompute_num_layers": 1})
    log = []
    for stage in emu.stages:
        routers = [m for m in stage.chunks[0].modules() if isinstance(m, TopKRouter)]
        step = stage.step

        def logged(c, step=step, routers=routers):
            before = [(r.tokens_per_expert.clone(), r.expert_bias.clone()) for r in routers]
            step(c)
            log.extend((counts, bias, r.expert_bias.clone()) for r, (counts, bias) in zip(routers, before))
        stage.step = logged
    n = 8
    emu.train_segment(get_batch, n)
    emu.evaluate([get_batch(0, salt=3)])
    assert len(log) == 2 * n  # one router per stage, one update per step
    total = torch.zeros(16)
    for counts, before, after in log:
        torch.testing.assert_close(after, before + 0.05 * torch.sign(counts.mean() - counts), rtol=0, atol=0)
        total += counts
    assert total.sum() == 2 * n * (2 * 8) * 2  # two routers, n micro-batches of 16 tokens, top-2 each
    for stage in emu.stages:
        assert all(r.tokens_per_expert.sum() == 0 for r in stage.chunks[0].modules() if isinstance(r, TopKRouter))


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream", "spectrain"])
def test_recomputation_routes_with_the_bias_its_forward_saw(method, monkeypatch):
    """The bias moves at every step, between a micro-batch's forward and its backward when s(j) > 0: the
    recomputation in the backward puts the forward's bias back for its routing, so the run equals the one
    without recomputation bit for bit. Replaying only the weights (the bias as it is at the backward) routes
    other tokens, so the runs differ."""
    optimizer = "sgd" if method == "spectrain" else "adam"
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}

    def run(model):
        emu = moe_emulator(method, optimizer, 3, 1, 1, {**BIAS, "moe_router_bias_update_rate": 0.5, **model})
        return emu.train_segment(get_batch, 9), emu.full_state_dict()

    plain, recomputed = run({}), run(recompute)
    assert plain[0] == recomputed[0]
    assert all(torch.equal(plain[1][n], recomputed[1][n]) for n in plain[1])
    monkeypatch.setattr(TopKRouter, "recompute_state", lambda self: [])
    stale = run(recompute)
    assert stale[0] != plain[0]


def test_auxiliary_losses_get_their_chunks_fp16_loss_scale(monkeypatch):
    """fp16 asynchronous stages scale each chunk's gradients by the chunk's own loss scale (the gradients cross
    stages unscaled): every chunk's auxiliary losses get 1/k times that scale in its backward, on the stages
    without the loss too, where the unscaling at the step would otherwise shrink them by the scale."""
    from megatron_po.pipeline import executor
    seen = []
    original = executor.aux_loss_scale

    def spy(scale):
        seen.append(scale)
        return original(scale)
    monkeypatch.setattr(executor, "aux_loss_scale", spy)
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    cfg = moe_cfg(2)
    cfg.precision.fp16, cfg.precision.loss_scale = True, 2.0**8
    emu = AsyncEmulator(cfg, VOCAB, "pipeoptim", 2, 1, 2, "adam", optimizer_kwargs("adam"), lr_fn_for("adam"))
    losses = emu.train_segment(get_batch, 4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert len(seen) == 2 * 4 and all(s == 2.0**8 / 2 for s in seen), seen
