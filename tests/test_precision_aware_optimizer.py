"""--use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype (Megatron's, Transformer Engine's
FusedAdam): Adam's moments stored in bf16 or fp16, computed in fp32.

- Closed form: each step equals torch.optim's fp32 Adam / AdamW whose moments are rounded to the stored dtype
  before the step (the kernel loads the stored moments, updates them in fp32, steps the weight with the unrounded
  values and stores them rounded), bit for bit over several steps; the stored moments are the reference's rounded;
  and the run differs from plain fp32 state (the rounding is real).
- Memory: the moments take 2 + 2 bytes per parameter instead of 4 + 4.
- Checkpoint: a load keeps the stored dtype.
- Through the launcher on 2 ranks (the distributed optimizer at DP 2, bf16, the gradient buffer in bf16 by
  --main-grads-dtype bf16): its losses leave the fp32-moment run's after the first step and stay near them, it
  says so at start-up, saves and resumes; PipeDream and PipeOptim at PP 2 and FSDP2 at DP 2 run with it.
- PipeOptim's prediction reads the state the optimizer holds, the stored moments upcast to fp32: Ŵ equals an
  explicit fp32 closed form on the stored bf16 moments bit for bit (and not the one on the step's unrounded
  moments) on every path: the separate prediction (new tensors, into bf16 targets), the one the step writes
  (fp32, bf16, into chunked targets), the kept ΔW (keep_direction), the mixed-precision optimizer's bf16 model
  weights; compiled ("aot_eager") within float rounding (the displacement Ŵ − W at rtol 1e-4; the bias
  corrections are fp32 there), the unrounded moments' Ŵ over 20 times further off.
- Whole runs with bf16 moments: PipeOptim's distributed run at PP 2 equals the emulator bit for bit (straight,
  interleaved AdamW with the decay extrapolated, whose later forwards use the kept ΔW, and k = 2 with error
  feedback, which predicts before each forward from the state); at PP 2 x DP 2 the distributed optimizer and
  FSDP2 equal the plain optimizer, and under --bf16 the distributed optimizer the mixed-precision one, bit for
  bit (tests/test_async_pipeline.py's rule); the launcher runs PipeOptim at PP 2.
The one-line refusals (fp8 state, fp16 main params, other optimizers) are rows of tests/test_config_rules.py.
"""

import json
import math

import pytest
import torch
from dist_harness import run_distributed, run_mains
from test_async_pipeline import merge, train_distributed, train_emulator

import megatron_po.optim.fused_prediction as fused_prediction
from megatron_po.optim import build_optimizer
from megatron_po.optim.fused_prediction import PredictionRequest
from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (11,), (3, 4, 2)]]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10 ** (step % 3 - 1) for p in params]


@pytest.mark.parametrize("name,torch_cls,weight_decay", [("adam", torch.optim.Adam, 0.1),
                                                         ("adamw", torch.optim.AdamW, 0.1)])
@pytest.mark.parametrize("exp_avg,exp_avg_sq", [("bf16", "bf16"), ("fp16", "bf16"), ("bf16", None)])
def test_step_is_fp32_adam_on_moments_rounded_to_the_stored_dtype(name, torch_cls, weight_decay, exp_avg, exp_avg_sq):
    stored = {"exp_avg": DTYPES[exp_avg], "exp_avg_sq": DTYPES.get(exp_avg_sq)}
    mine, ref, plain = _params(), _params(), _params()
    kw = dict(lr=1e-2, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    opt = build_optimizer(name, mine, exp_avg_dtype=stored["exp_avg"], exp_avg_sq_dtype=stored["exp_avg_sq"], **kw)
    fp32 = build_optimizer(name, plain, **kw)
    reference = torch_cls(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=True)
    for step in range(6):
        for p, q, r, g in zip(mine, plain, ref, _grads(step, mine)):
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        for r in ref:  # the kernel reads the stored (rounded) moments
            for key, dtype in stored.items():
                if dtype is not None and reference.state[r]:
                    reference.state[r][key].copy_(reference.state[r][key].to(dtype).float())
        opt.step()
        fp32.step()
        reference.step()
        for p, r in zip(mine, ref):
            assert torch.equal(p, r), step
            for key, dtype in stored.items():
                held = opt.state[p][key]
                assert held.dtype == (dtype or torch.float32)
                assert torch.equal(held, reference.state[r][key].to(held.dtype)), (step, key)
    assert not all(torch.equal(p, q) for p, q in zip(mine, plain))  # the rounding changes the run


def test_moments_take_half_the_memory_and_a_load_keeps_their_dtype():
    def state_bytes(opt):
        return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")

    params = _params()
    n = sum(p.numel() for p in params)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    low = build_optimizer("adamw", params, lr=1e-3, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    low.step()
    wide = build_optimizer("adamw", params, lr=1e-3)
    wide.step()
    assert (state_bytes(low), state_bytes(wide)) == (4 * n, 8 * n)
    fresh = build_optimizer("adamw", _params(), lr=1e-3, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16)
    fresh.load_state_dict(wide.state_dict())  # an fp32 checkpoint into bf16 state: rounded, still bf16
    for s, w in zip(fresh.state.values(), wide.state.values()):
        assert s["exp_avg"].dtype == torch.bfloat16 and torch.equal(s["exp_avg"], w["exp_avg"].bfloat16())


def test_state_dtypes_are_adams_only_and_reach_both_optimizer_builders():
    from megatron_po.config import parse_args
    from megatron_po.errors import ConfigError
    from megatron_po.optim.build import precision_aware_kwargs
    from megatron_po.pipeline.async_pipeline import optimizer_kwargs_from_config
    mock = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    t = parse_args(mock + ["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp16"]).training
    assert precision_aware_kwargs(t) == dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=None)
    assert optimizer_kwargs_from_config(t)["exp_avg_dtype"] == torch.float16  # the asynchronous stages'
    assert precision_aware_kwargs(parse_args(mock).training) == {}
    with pytest.raises(ConfigError, match="apply to --optimizer adam or adamw, not lion"):
        build_optimizer("lion", _params(), lr=1e-3, exp_avg_dtype=torch.bfloat16)


# ---- PipeOptim's prediction from the stored moments ------------------------------------------------------

BF16_MOMENTS = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
HYPER = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def _closed_form(w, m, v, t, steps, decay=0.0, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8):
    """Ŵ = W(1 − s·lr·λ) − s·lr·m̂/(√v̂ + ε), written out in fp32 from the moments m, v (upcast here) after t
    steps; λ: the decoupled decay when it is extrapolated."""
    m, v = m.float(), v.float()
    denominator = v.sqrt() / math.sqrt(1 - beta2**t) + eps
    start = w * (1 - steps * lr * decay) if decay else w
    return start + (-steps * lr / (1 - beta1**t)) * m / denominator


def _round_moments(state):
    """torch's Adam state as the step reads ours: its moments rounded to bf16 (kept in fp32)."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key].copy_(state[key].bfloat16().float())


def _stored_closed_form(opt, params, steps, decay=0.0):
    return [_closed_form(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"].item(),
                         steps, decay) for p in params]


@pytest.mark.parametrize("name,include_weight_decay", [("adam", False), ("adamw", True)])
def test_prediction_is_the_closed_form_on_the_stored_moments_on_every_path(name, include_weight_decay):
    """Separate (new tensors; into bf16 targets), written by the step (fp32, bf16, into targets a few tensors at a
    time) and from the kept ΔW: each Ŵ the fp32 closed form on the stored bf16 moments, bit for bit (bf16: that
    rounded once), never the one on the unrounded moments the step used (torch's Adam fed the rounded moments
    holds them after its step)."""
    torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    separate, fused, kept, ref = _params(), _params(), _params(), _params()
    opts = [build_optimizer(name, params, **HYPER, **BF16_MOMENTS) for params in (separate, fused, kept)]
    sep_opt, fused_opt, kept_opt = opts
    kept_opt.keep_direction = True
    reference = torch_cls(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    decay = 0.1 if include_weight_decay else 0.0
    for step, s in enumerate((2.0, 3.0, 1.5, 1.0)):
        grads = _grads(step, separate)
        for params in (separate, fused, kept, ref):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        for r in ref:  # the step reads the stored (rounded) moments
            _round_moments(reference.state[r])
        new32 = PredictionRequest(s, include_weight_decay)
        new16 = PredictionRequest(s, include_weight_decay, dtype=torch.bfloat16)
        targets = [[torch.zeros_like(p, dtype=torch.bfloat16) for p in separate]]
        into16 = PredictionRequest(s, include_weight_decay, targets=targets, chunk_numel=20)  # several chunks
        fused_opt.plan_prediction(new32, new16, into16)
        for opt in (*opts, reference):
            opt.step()
        assert all(torch.equal(p, q) for params in (fused, kept, ref) for p, q in zip(separate, params))
        assert {sep_opt.state[p][key].dtype for p in separate for key in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
        closed = _stored_closed_form(sep_opt, separate, s, decay)
        unrounded = [_closed_form(r.detach(), reference.state[r]["exp_avg"], reference.state[r]["exp_avg_sq"], step + 1,
                                  s, decay) for r in ref]
        assert not any(torch.equal(c, u) for c, u in zip(closed, unrounded))  # the moments' rounding shows in Ŵ
        out16 = [[torch.zeros_like(p, dtype=torch.bfloat16) for p in separate]]
        sep_opt.predict(s, include_weight_decay, out=out16)
        paths = {"separate": [w for _, w in sep_opt.predicted(s, include_weight_decay)],
                 "written by the step": [w for _, w in new32.predicted],
                 "kept": [w for _, w in kept_opt.predicted(s, include_weight_decay)],
                 "kept, again": [w for _, w in kept_opt.predicted(s, include_weight_decay)],
                 "separate into bf16": out16[0], "written by the step in bf16": [w for _, w in new16.predicted],
                 "written by the step into bf16 targets": targets[0]}
        for path, predicted in paths.items():
            assert len(predicted) == len(closed), path
            assert all(torch.equal(w, c.to(w.dtype)) for w, c in zip(predicted, closed)), (path, step)
        assert not fused_opt._kept_direction and len(kept_opt._kept_direction) == len(kept)
        for p, d in zip(separate, sep_opt.update_direction()[0]):  # ΔW itself: fp32, from the upcast moments
            state, t = sep_opt.state[p], step + 1
            denominator = state["exp_avg_sq"].float().sqrt() / math.sqrt(1 - 0.95**t) + 1e-8
            assert d.dtype == torch.float32 and torch.equal(d, state["exp_avg"].float() / denominator / (1 - 0.9**t))


def test_mixed_precision_bf16_weights_are_predicted_from_the_stored_moments():
    """--bf16: the fp32 main params step, the bf16 model weights get Ŵ (written by the step for a pointer swap,
    or predicted into them): the closed form on the main params and the stored moments, rounded once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(lambda groups: build_optimizer("adamw", groups, **HYPER, **BF16_MOMENTS),
                                  list(model.parameters()))
    for step, s in enumerate((2.0, 3.0, 1.5)):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        request = PredictionRequest(s)
        opt.plan_prediction(request)
        assert not opt.step().skipped
        closed = [c.bfloat16() for c in _stored_closed_form(opt.optimizer, opt.main_params, s)]
        assert [p for p, _ in request.predicted] == list(model.parameters())
        assert all(torch.equal(w, c) for (_, w), c in zip(request.predicted, closed))
        live = [p.detach().clone() for p in model.parameters()]
        opt.predict_model_params(s)
        assert all(torch.equal(p, c) for p, c in zip(model.parameters(), closed))
        opt.restore_model_params()
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), live))


def test_compiled_step_predicts_from_the_stored_moments(monkeypatch):
    """--torch-compile's fused step ("aot_eager": the same graph, no code generation) writes Ŵ from the stored
    moments it has just rounded: its displacement Ŵ − W is the closed form's within float rounding (the bias
    corrections in fp32), far from the unrounded moments' one; no graph break."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(fused_prediction, "COMPILE_BACKEND", "aot_eager")
    params, ref = _params(), _params()
    opt = build_optimizer("adamw", params, **HYPER, **BF16_MOMENTS)
    opt.compile_fused_step = True
    reference = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    for step, s in enumerate((2.0, 3.0, 1.5)):
        for p, r, g in zip(params, ref, _grads(step, params)):
            p.grad, r.grad = g.clone(), g.clone()
            _round_moments(reference.state[r])
        request = PredictionRequest(s, include_weight_decay=True)
        opt.plan_prediction(request)
        opt.step()
        reference.step()
        closed = _stored_closed_form(opt, params, s, decay=0.1)
        for (p, w), c, r in zip(request.predicted, closed, ref):
            unrounded = _closed_form(r.detach(), reference.state[r]["exp_avg"], reference.state[r]["exp_avg_sq"],
                                     step + 1, s, decay=0.1)
            torch.testing.assert_close(w - p, c - p, rtol=1e-4, atol=1e-7)
            assert (unrounded - c).abs().max() > 20 * (w - c).abs().max()
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])


MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _tiny(out, iters, *extra):
    return MOCK + ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-2",
                   "--log-interval", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4", "--bf16",
                   "--metrics-file", str(out / "metrics.jsonl"), *extra]


PRECISION_AWARE = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
                   "--main-grads-dtype", "bf16"]
DISTOPT = ["--use-distributed-optimizer"]


def test_recipe_run_with_bf16_moments_trains_saves_and_resumes(tmp_path, capfd):
    """The launcher hands the dtypes to the distributed optimizer's Adam: the losses leave those of the same run
    with fp32 moments after the first step (and stay near them); a checkpoint of bf16 moments resumes."""
    pp2 = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
    argvs = [_tiny(tmp_path / "a", 4, *DISTOPT, *PRECISION_AWARE, "--save", str(tmp_path / "ck")),
             _tiny(tmp_path / "b", 5, *DISTOPT, *PRECISION_AWARE, "--load", str(tmp_path / "ck")),
             _tiny(tmp_path / "c", 4, *DISTOPT),
             # an asynchronous stage's optimizer; PipeOptim's prediction from the stored moments
             _tiny(tmp_path / "d", 2, *DISTOPT, *PRECISION_AWARE, *pp2, "--pipeline-method", "pipedream"),
             _tiny(tmp_path / "e", 2, *PRECISION_AWARE, "--use-torch-fsdp2", "--grad-reduce-in-bf16"),  # FSDP2's
             _tiny(tmp_path / "f", 2, *PRECISION_AWARE, *pp2, "--pipeline-method", "pipeoptim")]
    assert run_distributed(run_mains, 2, args=(argvs,), timeout=300) == [[0] * 6] * 2
    out = capfd.readouterr().out
    assert out.count("> --use-precision-aware-optimizer: Adam's exp_avg stored in bf16, exp_avg_sq in bf16, both "
                     "computed in fp32; main params fp32; gradient buffer bf16") == 5

    def losses(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r}
    low, resumed, wide = losses("a"), losses("b"), losses("c")
    assert list(low) == list(wide) == [1, 2, 3, 4] and list(resumed) == [5]
    assert low[1] == wide[1]  # before any step
    assert all(low[i] != wide[i] and abs(low[i] - wide[i]) < 0.05 for i in (3, 4)), (low, wide)


# ---- whole PipeOptim runs with bf16 moments --------------------------------------------------------------

PP2_CASES = [  # method, optimizer, D, v, k, segments, options
    ("pipeoptim", "adam", 2, 1, 1, (4, 4), {}),
    # interleaved: a chunk's later forwards after its step predict from the kept ΔW (the upcast moments)
    ("pipeoptim", "adamw", 2, 2, 1, (4, 6), {"include_weight_decay": True}),
    # two micro-batches per step and error feedback: every prediction before its forward, ΔW from the state
    ("pipeoptim", "adam", 2, 1, 2, (4, 4), {"error_feedback": True}),
]


def _stored_dtypes(rank) -> set:
    return {t.dtype for opt in rank.stage.optimizers for state in getattr(opt, "optimizer", opt).state.values()
            for key, t in state.items() if key in ("exp_avg", "exp_avg_sq")}


def _emulated_pp2_cases():
    return [train_emulator(m, o, D, v, k, seg, optimizer_options=BF16_MOMENTS, **opts)
            for m, o, D, v, k, seg, opts in PP2_CASES]


def _distributed_pp2_cases():
    from test_fused_prediction import count_fused
    out = []
    for m, o, _, v, k, seg, opts in PP2_CASES:
        ranks, written = [], []

        def instrument(rank, ranks=ranks, written=written):
            ranks.append(rank)
            count_fused(rank.stage.policy, True, written)
        result = train_distributed(m, o, v, k, seg, optimizer_options=BF16_MOMENTS, on_rank=instrument, **opts)
        out.append((*result, _stored_dtypes(ranks[0]), len(written)))
    return out


def test_pipeoptim_with_bf16_moments_distributed_equals_emulator_bitwise():
    """PP 2, fp32 weights, Adam's moments stored in bf16: every micro-batch's loss, the evaluation, the final
    weights and the weight copies of the distributed run are the emulator's bit for bit; stage 0 predicts, some
    of it written by the step (the fused path ran) except under error feedback."""
    emulated = run_distributed(_emulated_pp2_cases, 1)[0]
    first, last = run_distributed(_distributed_pp2_cases, 2, pp=2)
    for case, emu, a, b in zip(PP2_CASES, emulated, first, last):
        assert a[0] is None and b[0] == emu[0] and b[1] == emu[1], case
        weights, copies = merge([a, b])
        assert weights.keys() == emu[2].keys() and all(torch.equal(weights[n], emu[2][n]) for n in weights), case
        assert copies == emu[3], case
        assert a[5] == b[5] == {torch.bfloat16}, case
        if "error_feedback" not in case[6]:  # it moves the weights after the step: no prediction written by it
            assert a[6] > 0 and (b[6] == 0) == (case[3] == 1), case  # straight: the last stage's s is 0
        else:
            assert a[6] == b[6] == 0, case


DP2_RUNS = {  # name: (PrecisionConfig fields, ParallelConfig fields)
    "plain": ({}, {}),
    "distributed optimizer": ({"use_distributed_optimizer": True}, {}),
    "FSDP2": ({}, {"use_torch_fsdp2": True}),
    "bf16": ({"bf16": True}, {}),
    "bf16, distributed optimizer": ({"bf16": True, "use_distributed_optimizer": True}, {}),
}


def _dp2_runs():
    out = {}
    for name, (precision, parallel) in DP2_RUNS.items():
        ranks = []
        result = train_distributed("pipeoptim", "adam", 1, 1, (4, 4), mbs=4, masked=False, precision=precision,
                                   parallel=parallel, optimizer_options=BF16_MOMENTS, on_rank=ranks.append)
        out[name] = (*result, _stored_dtypes(ranks[0]))
    return out


def test_pp2_dp2_distributed_optimizer_and_fsdp2_predict_from_their_shards_of_the_stored_moments():
    """PipeOptim at PP 2 x DP 2, bf16 moments: each DP rank predicts its shard from its shard of the stored
    moments; the distributed optimizer and FSDP2 equal the plain optimizer (replicated state) bit for bit, and under
    --bf16 the distributed optimizer equals the mixed-precision optimizer, as with fp32 state
    (tests/test_async_pipeline.py: the reduce-scatter and the all-reduce over two ranks both add a/2 + b/2, the
    step and the prediction are per element)."""
    for runs in run_distributed(_dp2_runs, 4, pp=2, timeout=300):
        assert all(run[5] == {torch.bfloat16} for run in runs.values())
        for name, plain in (("distributed optimizer", runs["plain"]), ("FSDP2", runs["plain"]),
                            ("bf16, distributed optimizer", runs["bf16"])):
            other = runs[name]
            assert other[0] == plain[0] and other[1] == plain[1], name
            assert other[2].keys() == plain[2].keys(), name
            assert all(torch.equal(other[2][n], plain[2][n]) for n in plain[2]), name
