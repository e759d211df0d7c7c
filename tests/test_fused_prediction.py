"""PipeOptim's prediction fused into the optimizer step (optim/fused_prediction.py, pipeline/fused_steps.py).

Claims and tolerances:
- One optimizer step that also writes Ŵ (a `PredictionRequest`) = the same step followed by the separate
  prediction (`predicted`, `predict_into`), for every optimizer of `build_optimizer`, the mixed-precision
  wrapper and the distributed optimizer (DP=2, gloo): fp32 bitwise; Ŵ in bf16 bitwise too (both compute
  Ŵ in fp32 with the same ops and round it once), and within one bf16 rounding (1 ulp) of the closed
  form W − s·lr·ΔW (ΔW = `update_direction()`, Ŵ in fp32 within 1e-6 relative of it).
- Whole runs: PipeOptim / SpecTrain training with the fused path = the same run with
  `fuse_prediction = False` (the separate prediction before the forward), bitwise, in the emulator (fp32
  and bf16, straight and interleaved streams, a weight predictor) and distributed (PP=2 x DP=2 with the
  distributed optimizer, fp32 and bf16). The fused path must really run (counted) and drop the kept ΔW.
- Compiled (torch.compile of the same per-group function, as on CUDA): equal to eager within float
  rounding (fp32 rtol 1e-5; bf16 Ŵ within 1 ulp), no graph break, no recompilation after the second
  compiled step while the lr and the weights change every step ("aot_eager": no code generation, so the
  check is quick; one inductor run for AdamW).
"""

import os

import pytest
import torch
from dist_harness import run_distributed
from test_async_pipeline import train_distributed
from test_async_policies import LR, VOCAB, get_batch, lr_fn_for, make_cfg

import megatron_po.optim.fused_prediction as fused_prediction
from megatron_po import parallel_state as ps
from megatron_po.optim import OPTIMIZER_NAMES, build_optimizer
from megatron_po.optim.fused_prediction import PredictionRequest
from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer, predict_into
from megatron_po.pipeline.async_pipeline import AsyncEmulator
from megatron_po.tensor_parallel import model_parallel_seed

SHAPES = [(6, 4), (4,), (5, 3)]
STEPS = (2.0, 3.0, 1.5, 2.0)  # s of the prediction after each step


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES]


def make_optimizer(name, params):
    """Two param groups with their own lr; Muon's matrices in a use_muon group."""
    if name == "muon":
        groups = [{"params": [params[0], params[2]], "use_muon": True},
                  {"params": [params[1]], "use_muon": False, "lr": 0.003}]
    else:
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]
    return build_optimizer(name, groups, lr=0.01, weight_decay=0.1)


def set_grads(param_sets, seed, skip=()):
    gen = torch.Generator().manual_seed(100 + seed)
    grads = [torch.randn(p.shape, generator=gen) for p in param_sets[0]]
    for params in param_sets:
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in skip else g.clone()


def bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(exponent - 7)


def assert_within_one_bf16_rounding(w_bf16, exact):
    assert torch.all((w_bf16.float() - exact).abs() <= bf16_ulp(exact)), (w_bf16.float() - exact).abs().max()


# ---- one optimizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("include_weight_decay", [False, True])
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_fused_step_equals_step_then_prediction(name, include_weight_decay):
    torch.manual_seed(0)
    fused_params, ref_params = make_params(), make_params()
    fused, ref = make_optimizer(name, fused_params), make_optimizer(name, ref_params)
    skip = {2: (1,)}  # a step that leaves a parameter with state behind: Ŵ from the state for that group
    for t, s in enumerate(STEPS):
        lr = 0.01 * (1 + 0.25 * t)  # changes every step: Ŵ uses the lr of the step that wrote it
        for opt in (fused, ref):
            opt.param_groups[0]["lr"] = lr
        set_grads([fused_params, ref_params], t, skip.get(t, ()))
        new32 = PredictionRequest(s, include_weight_decay)
        new16 = PredictionRequest(s, include_weight_decay, dtype=torch.bfloat16)
        targets = [[torch.zeros_like(p, dtype=torch.bfloat16) for p in g["params"]] for g in fused.param_groups]
        into16 = PredictionRequest(s, include_weight_decay, targets=targets, chunk_numel=20)  # several chunks
        fused.plan_prediction(new32, new16, into16)
        fused.step()
        ref.step()
        assert all(r.done for r in (new32, new16, into16))
        assert all(torch.equal(a, b) for a, b in zip(fused_params, ref_params))  # the step is the same
        expected = ref.predicted(s, include_weight_decay=include_weight_decay)
        ref_targets = [[torch.zeros_like(p, dtype=torch.bfloat16) for p in g["params"]] for g in ref.param_groups]
        predict_into(ref, s, ref_targets, include_weight_decay, chunk_numel=20)
        where_f, where_r = ({id(p): i for i, p in enumerate(ps)} for ps in (fused_params, ref_params))
        assert [where_f[id(p)] for p, _ in new32.predicted] == [where_r[id(p)] for p, _ in expected]
        assert all(torch.equal(w, e) for (_, w), (_, e) in zip(new32.predicted, expected))
        by_param = {id(p): w for p, w in new16.predicted}
        for g, group in enumerate(ref.param_groups):
            for i, p in enumerate(group["params"]):
                assert torch.equal(targets[g][i], ref_targets[g][i])
                if id(fused.param_groups[g]["params"][i]) in by_param:
                    assert torch.equal(by_param[id(fused.param_groups[g]["params"][i])], ref_targets[g][i])
        # closed form: Ŵ = W - s·lr·ΔW (+ the decay, extrapolated), with ΔW from update_direction()
        directions = fused.update_direction(include_weight_decay)
        for (p, w32), (_, w16) in zip(new32.predicted, new16.predicted):
            g, i = next((g, i) for g, grp in enumerate(fused.param_groups) for i, q in enumerate(grp["params"]) if q is p)
            exact = p.detach() - s * fused.param_groups[g]["lr"] * directions[g][i]
            torch.testing.assert_close(w32, exact, rtol=1e-6, atol=1e-6)
            assert_within_one_bf16_rounding(w16, w32)
        assert not fused._kept_direction  # nothing kept between the step and the prediction
        assert new32.predicted and not all(torch.equal(w, p) for p, w in new32.predicted)


def test_requests_are_consumed_once_and_zero_steps_is_the_copy():
    params = make_params()
    opt = make_optimizer("adam", params)
    set_grads([params], 0)
    opt.step()
    live = PredictionRequest(0.0, targets=[[torch.empty_like(p) for p in g["params"]] for g in opt.param_groups])
    none = PredictionRequest(0.0)
    opt.plan_prediction(live, none)
    set_grads([params], 1)
    opt.step()
    assert all(torch.equal(t, p.detach()) for row, g in zip(live.targets, opt.param_groups)
               for t, p in zip(row, g["params"]))
    assert none.done and none.predicted == []
    later = PredictionRequest(1.0)
    set_grads([params], 2)
    opt.step()  # nothing planned any more
    assert not later.done


@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_mixed_precision_fused_step_writes_the_live_weights_and_the_prediction(name):
    """bf16 model weights, fp32 main params: the step writes the live weights (the main -> model copy)
    and Ŵ (new bf16 tensors, for a pointer swap) in its pass; the separate path writes Ŵ into the model
    weights and copies the live ones back. Both bitwise equal; Ŵ within one rounding of the fp32 form."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)).to(torch.bfloat16)
        opt = MixedPrecisionOptimizer(lambda groups: build_optimizer(name, groups, lr=0.01, weight_decay=0.1),
                                      list(model.parameters()))
        models.append((model, opt))
    (model_f, opt_f), (model_r, opt_r) = models
    for t, s in enumerate(STEPS):
        gen = torch.Generator().manual_seed(t)
        for p_f, p_r in zip(model_f.parameters(), model_r.parameters()):
            p_f.grad = torch.randn(p_f.shape, generator=gen).to(torch.bfloat16)
            p_r.grad = p_f.grad.clone()
        request = PredictionRequest(s)
        opt_f.plan_prediction(request)
        assert not opt_f.step().skipped and not opt_r.step().skipped
        live = [p.detach().clone() for p in model_r.parameters()]
        opt_r.predict_model_params(s)
        predicted = [p.detach().clone() for p in model_r.parameters()]
        opt_r.restore_model_params()
        assert all(torch.equal(a, b) for a, b in zip(model_f.parameters(), live))
        assert [id(p) for p, _ in request.predicted] == [id(p) for p in model_f.parameters()]
        direction = opt_f.update_direction()[0]
        for (p, w), ref, main, d in zip(request.predicted, predicted, opt_f.main_params, direction):
            assert w.dtype == torch.bfloat16 and torch.equal(w, ref)
            assert_within_one_bf16_rounding(w, main - s * opt_f.param_groups[0]["lr"] * d)


def _sharded_fused_vs_separate(name, include_weight_decay):
    """DP=2: the distributed optimizer's predicted shard written by the step = `predict_shard` after it
    (the owned ranges, then the gathered full buffer)."""
    from test_distributed_optimizer import build, train_step
    runs = {}
    for fused in (True, False):
        model, ddp, opt = build(name, sharded=True)
        opt.defer_param_gather = True  # as the asynchronous pipeline sets it: one packed gather
        out = []
        for t, s in enumerate(STEPS[:3]):
            request = opt.plan_shard_prediction("F", s, include_weight_decay) if fused else None
            train_step(model, ddp, opt, t)
            if fused:
                assert request.done
            else:
                opt.predict_shard("F", s, include_weight_decay)
            opt.start_gathers(async_op=False)
            out.append((ddp.param_buffer.clone(), opt.predicted_buffers["F"].clone()))
        runs[fused] = out
    return runs


@pytest.mark.parametrize("name,include_weight_decay", [("adam", False), ("adamw", True), ("sgd", False)])
def test_distributed_optimizer_fused_step_equals_predict_shard_dp2(name, include_weight_decay):
    for runs in run_distributed(_sharded_fused_vs_separate, 2, args=(name, include_weight_decay)):
        for (live_f, pred_f), (live_r, pred_r) in zip(runs[True], runs[False]):
            assert torch.equal(live_f, live_r) and torch.equal(pred_f, pred_r)
            assert not torch.equal(pred_f, live_f)


# ---- whole runs: fused = separate ----------------------------------------------------------------------


def count_fused(policy, fuse, written):
    """Set the policy's `fuse_prediction`; append every prediction a step wrote to `written`."""
    policy.fuse_prediction = fuse
    take = policy._take_fused

    def counted(chunk):
        requests = take(chunk)
        written.extend(r for r in requests.values() if r.done)
        return requests
    policy._take_fused = counted


def _emulated(method, optimizer, D, v, fuse, bf16=False, **options):
    model_parallel_seed(1)
    torch.manual_seed(0)
    cfg = make_cfg(D * v)
    cfg.precision.bf16 = bf16
    kwargs = {"lr": LR[optimizer], "weight_decay": 0.1, "sgd_momentum": 0.9}
    emu = AsyncEmulator(cfg, VOCAB, method, D, v, 1, optimizer, kwargs, lr_fn_for(optimizer), 0.0, **options)
    written = []
    for st in emu.stages:
        count_fused(st.policy, fuse, written)
    losses = emu.train_segment(get_batch, 4 * D) + emu.train_segment(get_batch, 2 * D * v)
    kept = any(getattr(opt, "optimizer", opt)._kept_direction for st in emu.stages for opt in st.optimizers)
    return losses, emu.full_state_dict(), len(written), kept


RUNS = [  # method, optimizer, D, v, bf16, options
    ("pipeoptim", "adam", 4, 1, False, {}),
    ("pipeoptim", "adamw", 3, 2, False, {"include_weight_decay": True}),
    ("pipeoptim", "adamw", 4, 1, True, {}),
    ("pipeoptim", "muon", 3, 1, True, {}),
    ("pipeoptim", "adam", 3, 1, False, {"weight_predictor": "lr-schedule", "s_offset": 1}),
    ("pipeoptim", "sgd", 3, 1, False, {"delay_compensation": 0.5}),  # edits gradients before the step: fusable
    ("spectrain", "sgd", 4, 1, False, {}),
    ("spectrain", "sgd", 2, 2, True, {}),
]


@pytest.mark.parametrize("method,optimizer,D,v,bf16,options", RUNS,
                         ids=[f"{r[0]}-{r[1]}-D{r[2]}v{r[3]}{'-bf16' if r[4] else ''}{'-' + str(r[5]) if r[5] else ''}"
                              for r in RUNS])
def test_emulator_run_with_fused_prediction_equals_separate_prediction(method, optimizer, D, v, bf16, options):
    torch.set_num_threads(1)
    losses_f, weights_f, written, kept_f = _emulated(method, optimizer, D, v, True, bf16, **options)
    losses_s, weights_s, none, kept_s = _emulated(method, optimizer, D, v, False, bf16, **options)
    assert written > 0 and none == 0
    assert losses_f == losses_s
    assert all(torch.equal(weights_f[n], weights_s[n]) for n in weights_s)
    if method == "pipeoptim" and v == 1:  # every prediction between two steps is the fused one: ΔW not kept
        assert kept_s and not kept_f
    # (interleaved: a chunk's step is followed by up to D of its forwards, of which the step writes the
    # first; the others are predicted before their pass, from the kept ΔW as before)


DISTRIBUTED_RUNS = [("pipeoptim", "adamw", False), ("pipeoptim", "adamw", True), ("spectrain", "sgd", False)]


def _distributed_fused_and_separate():
    out = {}
    for method, optimizer, bf16 in DISTRIBUTED_RUNS:
        for fuse in (True, False):
            written = []
            precision = {"use_distributed_optimizer": True, "bf16": bf16}
            options = {"include_weight_decay": True} if method == "pipeoptim" else {}
            losses, _, weights, *_ = train_distributed(
                method, optimizer, 1, 1, (6, 4), mbs=4, masked=False, precision=precision,
                on_rank=lambda rank, fuse=fuse, written=written: count_fused(rank.stage.policy, fuse, written),
                **options)
            out[(method, bf16, fuse)] = (losses, weights, len(written))
    return ps.get_pipeline_model_parallel_rank(), out


def test_pp2_dp2_distributed_optimizer_run_with_fused_prediction_equals_separate():
    """PipeOptim (fp32, bf16) and SpecTrain (whose step writes both the forward's and the backward's
    predicted shards) with the distributed optimizer: the predicted shards the step writes into its
    packed all-gather = those predicted after it, bitwise."""
    for pp_rank, out in run_distributed(_distributed_fused_and_separate, 4, pp=2, timeout=300):
        for method, _, bf16 in DISTRIBUTED_RUNS:
            (losses_f, weights_f, written), (losses_s, weights_s, none) = (out[(method, bf16, True)],
                                                                           out[(method, bf16, False)])
            # stage 1 predicts nothing: PipeOptim's s = 0, SpecTrain's s_f = ⌊1/2⌋ + 0 = 0 and s_b = 0
            assert none == 0 and (written > 0) == (pp_rank == 0), (method, bf16, pp_rank, written)
            assert losses_f == losses_s
            assert all(torch.equal(weights_f[n], weights_s[n]) for n in weights_s)


# ---- the memory guard ----------------------------------------------------------------------------------

# Peak bytes per parameter over async-naive, whole run, bench/memory/memory.py --async --quick (deterministic).
# Measured at issue 30: fused fp32 +1.05, bf16 +0.97; the separate prediction +3.08 / +2.87.
PIPEOPTIM_PEAK_BOUND = {"fp32": 1.15, "bf16": 1.05}


def test_memory_guard_pipeoptim_peak_over_async_naive():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_common  # noqa: E402
    bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
    from memory import async_peaks_over_naive
    table = async_peaks_over_naive(quick=True, variants=("pipeoptim", "pipeoptim (separate prediction)"))
    for precision, bound in PIPEOPTIM_PEAK_BOUND.items():
        fused, separate = table[precision]["pipeoptim"], table[precision]["pipeoptim (separate prediction)"]
        assert fused <= bound, (precision, fused)
        assert fused < separate - 1.5, (precision, fused, separate)  # dropping the kept ΔW shows


# ---- compiled ------------------------------------------------------------------------------------------


def _compiled_vs_eager(name, backend, monkeypatch, steps=4, one_group=False):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", backend)
    eager_params, compiled_params = make_params(), make_params()
    if one_group:
        eager, compiled = (build_optimizer(name, p, lr=0.01, weight_decay=0.1) for p in (eager_params, compiled_params))
    else:
        eager, compiled = make_optimizer(name, eager_params), make_optimizer(name, compiled_params)
    compiled.compile_fused_step = True
    graphs = []
    for t in range(steps):
        for opt in (eager, compiled):
            opt.param_groups[0]["lr"] = 0.01 * (1 + 0.25 * t)
        set_grads([eager_params, compiled_params], t)
        requests = []
        for opt in (eager, compiled):
            requests.append(PredictionRequest(STEPS[t % 2], dtype=torch.bfloat16))
            opt.plan_prediction(requests[-1])
            opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
        for a, b in zip(eager_params, compiled_params):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for (_, a), (_, b) in zip(*(r.predicted for r in requests)):
            assert torch.all((a.float() - b.float()).abs() <= bf16_ulp(a.float()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


# Each kind of scalar the rules pass to foreach ops: Adam's bias corrections (adamw), alpha=-lr (sgd,
# rmsprop), an int8 direction (lion), NAdam's momentum products (nadamw), Muon's eager groups (muon).
COMPILED = ["adamw", "sgd", "rmsprop", "lion", "nadamw", "muon"]


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_fused_step_equals_eager_without_recompiling(name, monkeypatch):
    """First step eager (it creates the state); the second compiles once per param group, the third once
    more (the lr and s, seen to change, become inputs); none after, whatever the lr and s. Muon's matrices
    keep their Newton-Schulz step eager: only its AdamW group compiles."""
    graphs = _compiled_vs_eager(name, "aot_eager", monkeypatch)
    groups = 1 if name == "muon" else 2
    assert graphs[0] == 0 and graphs[2] == 2 * groups and graphs[-1] == graphs[2], graphs


@pytest.mark.parametrize("name", ["adamw", "nadamw"])
def test_compiled_step_keeps_a_direction_the_separate_prediction_can_use(name, monkeypatch):
    """Where the step keeps its ΔW for predictions made later (k > 1, the interleaved stream's later
    forwards), a compiled step's ΔW serves the eager prediction: equal to the all-eager run."""
    torch._dynamo.reset()
    monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", "aot_eager")
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = make_optimizer(name, eager_params), make_optimizer(name, compiled_params)
    compiled.compile_fused_step = True
    for t in range(4):
        set_grads([eager_params, compiled_params], t)
        for opt in (eager, compiled):
            opt.keep_direction = True
            opt.step()
        assert compiled._kept_direction
        for (_, a), (_, b) in zip(eager.predicted(2.0), compiled.predicted(2.0)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_inductor_compiled_adamw_step_with_bf16_prediction(monkeypatch):
    """The same through inductor's code generation (what CUDA runs), AdamW into bf16 (one param group:
    each graph compiles C++ on the CPU). One pass: the step that also writes Ŵ compiles to as many
    kernels as the step alone (the prediction and its bf16 cast fuse into the step's loop)."""
    from torch._inductor import metrics
    graphs = _compiled_vs_eager("adamw", "inductor", monkeypatch, steps=4, one_group=True)
    assert graphs[-1] == graphs[2] == 2, graphs
    kernels = {}
    for fused in (False, True):
        torch._dynamo.reset()
        params = make_params()
        opt = build_optimizer("adamw", params, lr=0.01, weight_decay=0.1)
        opt.compile_fused_step = True
        for t in range(2):  # the first step is eager, the second compiles
            set_grads([params], t)
            if fused:
                opt.plan_prediction(PredictionRequest(2.0, dtype=torch.bfloat16))
            metrics.reset()
            opt.step()
        kernels[fused] = metrics.generated_kernel_count
    assert 0 < kernels[True] == kernels[False], kernels


# A GPT layer's parameters at hidden 6 (Megatron's order: norms, QKV, projection, norms, MLP up and down); the
# model: the word embedding, `layers` of them, the final norm. In Megatron's two groups: matrices (decayed), vectors.
LAYER_SHAPES = [(6,), (6,), (18, 6), (18,), (6, 6), (6,), (6,), (6,), (24, 6), (24,), (6, 24), (6,)]


def make_layers(layers, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(32, 6)] + LAYER_SHAPES * layers + [(6,), (6,)]
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def layered_groups(params):
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


def test_compiled_step_compiles_as_much_for_a_deeper_model(monkeypatch):
    """What the compiled step traces does not grow with the depth: each graph holds one slice of a group
    (`STEP_SLICE` parameters), and the slices of repeating layers share their graph (one graph over a whole
    group grew with its tensor count: GPT-1.3B's step compiled for ~100 s on an H100, 147 s on a 2-core CPU).
    Counted as the graphs TorchDynamo hands the backend and their nodes (no code generation: quick)."""
    traced = {}
    # 8 more layers: 32 and 64 more parameters per group, whole slices (STEP_SLICE 8, or 2, 4, 16, 32), so
    # that both models' groups start and end in the same kinds of slice
    for layers in (4, 12):
        torch._dynamo.reset()
        nodes = []

        def counting(gm, example_inputs):
            nodes.append(len(gm.graph.nodes))
            return gm.forward
        monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", counting)
        params = make_layers(layers)
        opt = build_optimizer("adamw", layered_groups(params), lr=0.01)
        opt.compile_fused_step = True
        for t in range(3):
            set_grads([params], t)
            opt.plan_prediction(PredictionRequest(STEPS[t % 2], dtype=torch.bfloat16))
            opt.step()
        traced[layers] = sorted(nodes)
    shallow, deep = traced.values()
    # per group a first, a repeated and a last kind of slice, each traced twice (the second s is an input)
    assert deep == shallow and len(shallow) <= 2 * 3 * 2, traced


def test_sliced_compiled_step_equals_eager(monkeypatch):
    """A deep model's compiled step, slice by slice, through the mixed-precision wrapper (the live bf16 weights
    and Ŵ written by the step): equal to the eager step as the whole-group one is (fp32 main weights rtol 1e-5,
    bf16 weights and Ŵ within one bf16 rounding), also when a parameter has no gradient for a step (its slice
    steps the others; the prediction then follows the step) and when the step keeps its ΔW for a later
    prediction."""
    torch._dynamo.reset()
    monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", "aot_eager")
    sets = [[p.detach().to(torch.bfloat16).requires_grad_() for p in make_layers(2)] for _ in range(2)]
    eager, compiled = (MixedPrecisionOptimizer(lambda g: build_optimizer("adamw", g, lr=0.01), layered_groups(p))
                       for p in sets)
    compiled.optimizer.compile_fused_step = True
    for t in range(5):
        gen = torch.Generator().manual_seed(100 + t)
        grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in sets[0]]
        for params in sets:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if t == 3 and i == 5 else g.clone()
        requests = []
        for opt in (eager, compiled):
            opt.optimizer.keep_direction = t == 4
            requests.append(PredictionRequest(STEPS[t % 2]))
            opt.plan_prediction(requests[-1])
            opt.step()
        for a, b in zip(eager.main_params, compiled.main_params):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for a, b in zip(*sets):
            assert torch.all((a.float() - b.float()).abs() <= bf16_ulp(a.float()))
        assert len(requests[0].predicted) == len(requests[1].predicted) == len(sets[0])  # all have state
        position = [{id(p): i for i, p in enumerate(params)} for params in sets]
        for (pa, a), (pb, b) in zip(*(r.predicted for r in requests)):
            assert position[0][id(pa)] == position[1][id(pb)]
            assert torch.all((a.float() - b.float()).abs() <= bf16_ulp(a.float()))
    kept = [opt.optimizer.predicted(2.0) for opt in (eager, compiled)]
    for (_, a), (_, b) in zip(*kept):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert len(compiled.optimizer._compiled_updates[1]) > 1  # the vector group did run in several slices


def test_a_step_that_does_not_compile_runs_eagerly_with_a_warning(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no code generation today")
    torch._dynamo.reset()
    monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", broken)
    params, ref_params = make_params(), make_params()
    opt, ref = make_optimizer("adamw", params), make_optimizer("adamw", ref_params)
    opt.compile_fused_step = True
    with pytest.warns(UserWarning, match="did not compile, running it eagerly"):
        for t in range(3):
            set_grads([params, ref_params], t)
            opt.step()
            ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))  # eager after the failure: bitwise
    assert opt._compiled_updates == {0: None, 1: None}


def test_fused_step_bench_quick():
    """bench/step/fused_step.py's measurements run; the counted bytes show what the fused path saves eagerly
    (bf16: the prediction written once, no restore copy) and never costs more than the separate path."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_common  # noqa: E402
    bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
    import fused_step
    counted = fused_step.bytes_per_param(1 << 14)
    for precision, row in counted.items():
        naive, separate, fused = (sum(row[v]) for v in ("naive", "separate", "fused"))
        assert naive < fused <= separate, (precision, row)
    assert sum(counted["bf16"]["fused"]) < sum(counted["bf16"]["separate"]) - 10
    rows = fused_step.time_step_variants("cpu", 1 << 14, bf16=True, reps=1, compiled=(False,))
    assert {r["variant"] for r in rows} == set(fused_step.VARIANTS) and all(r["ms"] > 0 for r in rows)
