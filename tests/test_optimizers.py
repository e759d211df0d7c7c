"""Predictive optimizers: torch.optim numerics, ΔW = last displacement / lr, prediction, state round trip."""

import copy
import io

import pytest
import torch

from megatron_po.errors import ConfigError
from megatron_po.optim import SGD, Adagrad, Adam, AdamW, Lion, RMSprop, build_optimizer

SHAPES = [(5, 3), (4,), (2, 3, 2)]


def make_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for shape in SHAPES]


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def set_random_grads(param_sets, seed, skip=()):
    """Give every copy of the parameters the same random gradient; params at positions in `skip` get None."""
    gen = torch.Generator().manual_seed(1000 + seed)
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in param_sets[0]]
    for params in param_sets:
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in skip else g.clone()


def snapshot(params):
    return [p.detach().clone() for p in params]


class ReferenceLion(torch.optim.Optimizer):
    """Lion exactly as written in the paper, one tensor at a time."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = beta1 * m + (1 - beta1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * torch.sign(c))
                m.mul_(beta2).add_((1 - beta2) * p.grad)


# (id, our optimizer, its reference) -- every configuration the tests sweep. Weight decay is on wherever
# the optimizer has it, so the displacement tests cover both the L2 and the decoupled form.
CASES = {
    "sgd": (lambda p: SGD(p, lr=0.1), lambda p, fe: torch.optim.SGD(p, lr=0.1, foreach=fe)),
    "sgd_wd": (
        lambda p: SGD(p, lr=0.1, weight_decay=0.05),
        lambda p, fe: torch.optim.SGD(p, lr=0.1, weight_decay=0.05, foreach=fe),
    ),
    "sgd_momentum": (
        lambda p: SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05),
        lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05, foreach=fe),
    ),
    "sgd_momentum_lookahead": (
        lambda p: SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05, direction="lookahead"),
        lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05, foreach=fe),
    ),
    "nesterov": (
        lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05, foreach=fe),
    ),
    "adam": (
        lambda p: Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
        lambda p, fe: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, foreach=fe),
    ),
    "adamw": (
        lambda p: AdamW(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        lambda p, fe: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=fe),
    ),
    "rmsprop": (
        lambda p: RMSprop(p, lr=0.01, weight_decay=0.05),
        lambda p, fe: torch.optim.RMSprop(p, lr=0.01, weight_decay=0.05, foreach=fe),
    ),
    "rmsprop_momentum": (
        lambda p: RMSprop(p, lr=0.01, alpha=0.9, momentum=0.8, weight_decay=0.05),
        lambda p, fe: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, momentum=0.8, weight_decay=0.05, foreach=fe),
    ),
    "rmsprop_centered": (
        lambda p: RMSprop(p, lr=0.01, centered=True, weight_decay=0.05),
        lambda p, fe: torch.optim.RMSprop(p, lr=0.01, centered=True, weight_decay=0.05, foreach=fe),
    ),
    "rmsprop_centered_momentum": (
        lambda p: RMSprop(p, lr=0.01, centered=True, momentum=0.8, weight_decay=0.05),
        lambda p, fe: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.8, weight_decay=0.05, foreach=fe),
    ),
    "adagrad": (
        lambda p: Adagrad(p, lr=0.1, lr_decay=0.3, weight_decay=0.05, initial_accumulator_value=0.1, eps=1e-8),
        lambda p, fe: torch.optim.Adagrad(
            p, lr=0.1, lr_decay=0.3, weight_decay=0.05, initial_accumulator_value=0.1, eps=1e-8, foreach=fe
        ),
    ),
    "lion": (
        lambda p: Lion(p, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
        lambda p, fe: ReferenceLion(p, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
    ),
}
DECOUPLED = {"adamw", "lion"}


def run_steps(opt, params, first_seed, n, skip_schedule=None):
    for k in range(n):
        seed = first_seed + k
        set_random_grads([params], seed, skip=(skip_schedule or {}).get(seed, ()))
        opt.step()


# --- numerics: same trajectory as torch.optim ---------------------------------------------------------


@pytest.mark.parametrize("foreach", [True, False], ids=["torch_foreach", "torch_for_loop"])
@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_reference(case, foreach):
    ours_factory, reference_factory = CASES[case]
    ours_params = make_params()
    reference_params = clone_params(ours_params)
    # Two param groups with different lr, so per-group hyperparameters are exercised too.
    ours = ours_factory([{"params": ours_params[:2]}, {"params": ours_params[2:], "lr": 0.003}])
    reference_groups = [{"params": reference_params[:2]}, {"params": reference_params[2:], "lr": 0.003}]
    reference = reference_factory(reference_groups, foreach)
    # Param 1 has no gradient on steps 0 and 2: it starts late and skips one step (own step count).
    skip = {0: (1,), 2: (1,)}
    for seed in range(6):
        set_random_grads([ours_params, reference_params], seed, skip=skip.get(seed, ()))
        ours.step()
        reference.step()
        for a, b in zip(ours_params, reference_params):
            torch.testing.assert_close(a, b)
    # The trajectory really moved (a test that compares two frozen tensors would pass too).
    assert not torch.allclose(ours_params[0], make_params()[0])


def test_grad_none_is_skipped_and_gets_no_state():
    params = make_params()
    opt = Adam(params, lr=0.01)
    before = snapshot(params)
    set_random_grads([params], 0, skip=(1,))
    opt.step()
    assert torch.equal(params[1], before[1])
    assert not torch.equal(params[0], before[0])
    assert len(opt.state.get(params[1], {})) == 0
    direction = opt.update_direction()[0]
    assert direction[1] is None and direction[0] is not None and direction[2] is not None


# --- ΔW: the last step's displacement over lr ---------------------------------------------------------


# Lookahead is by design the NEXT step's direction; test_lookahead_direction_formula covers it.
@pytest.mark.parametrize("case", [c for c in CASES if c != "sgd_momentum_lookahead"])
def test_update_direction_is_last_displacement(case):
    params = make_params(dtype=torch.float64)  # float64: W_before - W_after carries no rounding to speak of
    opt = CASES[case][0](params)
    group = opt.param_groups[0]
    lr, weight_decay = group["lr"], group["weight_decay"]
    assert weight_decay > 0 or case == "sgd"  # the plain case; sgd_wd has decay
    for seed in range(4):
        set_random_grads([params], seed)
        before = snapshot(params)
        opt.step()
        after = snapshot(params)
        opt.zero_grad()  # ΔW must come from the optimizer state, not from .grad
        excluded = opt.update_direction(include_weight_decay=False)[0]
        included = opt.update_direction(include_weight_decay=True)[0]
        for w_before, w_after, d_excl, d_incl in zip(before, after, excluded, included):
            displacement = (w_before - w_after) / lr
            if case in DECOUPLED:
                torch.testing.assert_close(displacement, d_excl + weight_decay * w_before)
                torch.testing.assert_close(d_incl, d_excl + weight_decay * w_after)
            else:
                torch.testing.assert_close(displacement, d_excl)
                torch.testing.assert_close(d_incl, d_excl)
            assert d_excl.dtype == w_after.dtype


def test_lookahead_direction_formula():
    params = make_params(dtype=torch.float64)
    opt = SGD(params, lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.05, direction="lookahead")
    for seed in range(3):
        set_random_grads([params], seed)
        last_grad = [p.grad + 0.05 * p.detach() for p in params]  # incl. the L2 term at the pre-step W
        opt.step()
    for d, p, g in zip(opt.update_direction()[0], params, last_grad):
        torch.testing.assert_close(d, 0.9 * opt.state[p]["momentum_buffer"] + 0.75 * g)


def test_nesterov_direction_formula():
    params = make_params(dtype=torch.float64)
    opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    run_steps(opt, params, 0, 3)
    for d, p in zip(opt.update_direction()[0], params):
        torch.testing.assert_close(d, p.grad + 0.9 * opt.state[p]["momentum_buffer"])


def test_adam_direction_is_bias_corrected_moment_ratio():
    params = make_params(dtype=torch.float64)
    opt = Adam(params, lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    run_steps(opt, params, 0, 3)
    for d, p in zip(opt.update_direction()[0], params):
        m_hat = opt.state[p]["exp_avg"] / (1 - 0.8**3)
        v_hat = opt.state[p]["exp_avg_sq"] / (1 - 0.95**3)
        torch.testing.assert_close(d, m_hat / (v_hat.sqrt() + 1e-6))


def test_adagrad_direction_carries_lr_decay():
    params = make_params(dtype=torch.float64)
    opt = Adagrad(params, lr=0.1, lr_decay=0.5)
    run_steps(opt, params, 0, 3)  # t = 3: effective lr = 0.1 / (1 + 2·0.5) = lr / 2
    for d, p in zip(opt.update_direction()[0], params):
        torch.testing.assert_close(d, p.grad / (opt.state[p]["sum"].sqrt() + 1e-10) / 2)


def test_lion_direction_is_sign_and_stored_in_int8():
    params = make_params()
    opt = Lion(params, lr=0.01)
    run_steps(opt, params, 0, 2)
    for d, p in zip(opt.update_direction()[0], params):
        assert opt.state[p]["update_sign"].dtype == torch.int8
        assert set(d.unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert d.dtype == p.dtype


# --- prediction --------------------------------------------------------------------------------------


@pytest.mark.parametrize("include_weight_decay", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_predict_is_w_minus_s_lr_direction(case, include_weight_decay):
    params = make_params()
    opt = CASES[case][0]([{"params": params[:2]}, {"params": params[2:], "lr": 0.003}])
    run_steps(opt, params, 0, 3)
    directions = opt.update_direction(include_weight_decay)
    live = snapshot(params)
    for steps in (0.0, 1.0, 2.5):
        expected = [
            [w - steps * group["lr"] * d for w, d in zip(live[:2] if g == 0 else live[2:], directions[g])]
            for g, group in enumerate(opt.param_groups)
        ]
        # Into other tensors of the same dtype: the parameters stay put.
        out = [[torch.empty_like(p) for p in group["params"]] for group in opt.param_groups]
        opt.predict(steps, include_weight_decay=include_weight_decay, out=out)
        for got_row, expected_row in zip(out, expected):
            for got, want in zip(got_row, expected_row):
                torch.testing.assert_close(got, want)
        assert all(torch.equal(p, w) for p, w in zip(params, live))

        # Into bf16 tensors (model weights while the optimizer holds fp32 main weights).
        out_bf16 = [[torch.empty_like(p, dtype=torch.bfloat16) for p in group["params"]] for group in opt.param_groups]
        opt.predict(steps, include_weight_decay=include_weight_decay, out=out_bf16)
        for got_row, expected_row in zip(out_bf16, expected):
            for got, want in zip(got_row, expected_row):
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got, want.to(torch.bfloat16))

        # In place, then restore.
        opt.predict(steps, include_weight_decay=include_weight_decay)
        for p, want in zip(params, expected[0] + expected[1]):
            torch.testing.assert_close(p.detach(), want)
        with torch.no_grad():
            for p, w in zip(params, live):
                p.copy_(w)
        if steps > 0:  # the prediction really moved the weights
            assert not torch.allclose(expected[0][0], live[0])


@pytest.mark.parametrize("predictor", ["linear", "lr-schedule", "rollout"])
@pytest.mark.parametrize("include_weight_decay", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_predicted_out_of_place_is_bitwise_the_in_place_prediction(case, include_weight_decay, predictor):
    """`predicted()` (the pointer-swapping weight policies' path) returns exactly what `predict()` writes
    in place, for the stepped parameters only, and leaves the weights alone."""
    from megatron_po.optim.predictors import build_predictor
    params = make_params()
    opt = CASES[case][0]([{"params": params[:2]}, {"params": params[2:], "lr": 0.003}])
    if predictor != "linear":
        if predictor == "rollout":
            from megatron_po.optim.predictors import check_rollout_supported
            try:
                check_rollout_supported(opt)
            except ConfigError:
                return  # the rollout predictor serves Adam, AdamW and SGD (buffer direction) only
        opt.predictor = build_predictor(predictor, optimizer=opt)
        opt.predictor.plan(lambda i: 0.01 / (1 + i), 3)
    set_random_grads([params], 0, skip=(1,))  # parameter 1 gets no state
    opt.step()
    run_steps(opt, params, 1, 2, skip_schedule={1: (1,), 2: (1,)})
    live = snapshot(params)
    pairs = opt.predicted(2.5, include_weight_decay=include_weight_decay)
    assert all(torch.equal(p, w) for p, w in zip(params, live))
    assert [id(p) for p, _ in pairs] == [id(p) for i, p in enumerate(params) if i != 1]
    opt.predict(2.5, include_weight_decay=include_weight_decay)
    for p, w in pairs:
        assert torch.equal(w, p.detach()) and w.data_ptr() != p.data_ptr()
    assert opt.predicted(0.0) == []


def test_predict_steps_per_group():
    params = make_params()
    opt = AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.01)
    run_steps(opt, params, 0, 2)
    live = snapshot(params)
    direction = opt.update_direction()
    opt.predict([0.0, 3.0])
    assert torch.equal(params[0], live[0]) and torch.equal(params[1], live[1])
    torch.testing.assert_close(params[2].detach(), live[2] - 3.0 * 0.01 * direction[1][0])
    with pytest.raises(ValueError, match="param groups"):
        opt.predict([1.0])


def test_predict_skips_params_without_state():
    params = make_params()
    opt = Adam(params, lr=0.01)
    set_random_grads([params], 0, skip=(1,))
    opt.step()
    live = snapshot(params)
    out = [[torch.full_like(p, float("nan")) for p in params]]
    opt.predict(2.0, out=out)
    assert torch.equal(out[0][1], live[1])  # never stepped: Ŵ = W
    assert not torch.equal(out[0][0], live[0])


@pytest.mark.parametrize("case", list(CASES))
def test_prediction_is_a_no_op_before_first_step(case):
    params = make_params()
    opt = CASES[case][0](params)
    assert not opt.has_state()
    live = snapshot(params)
    opt.predict(3.0, include_weight_decay=True)
    assert all(torch.equal(p, w) for p, w in zip(params, live))
    out = [[torch.zeros_like(p) for p in params]]
    opt.predict(3.0, out=out)
    assert all(torch.equal(o, w) for o, w in zip(out[0], live))
    assert opt.update_direction() == [[None, None, None]]
    set_random_grads([params], 0)
    opt.step()
    assert opt.has_state()


@pytest.mark.parametrize("momentum, dampening", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.3)])
def test_sgd_prediction_equals_next_step_for_unchanged_gradient(momentum, dampening):
    # Plain SGD (ΔW = g) and momentum with the lookahead direction (ΔW = u·v_t + (1-τ)·g_t) predict the
    # next step exactly when the gradient does not change. No weight decay: its L2 term would change the
    # gradient as W moves.
    params = make_params()
    opt = SGD(params, lr=0.1, momentum=momentum, dampening=dampening, direction="lookahead")
    run_steps(opt, params, 0, 3)  # leaves the last gradient in .grad
    predicted = [[torch.empty_like(p) for p in params]]
    opt.predict(1.0, out=predicted)
    opt.step()  # same gradient again
    for p, want in zip(params, predicted[0]):
        torch.testing.assert_close(p.detach(), want)


def test_sgd_momentum_buffer_prediction_lags_next_step_by_u_to_the_t():
    # With the "buffer" direction (the paper's), s=1 prediction under a constant gradient g falls short of
    # the real next step by exactly lr·u^t·g after t steps: v_t = g(1-u^t)/(1-u) vs v_{t+1}. The gap
    # shrinks geometrically: the buffer only predicts the next step once it has converged.
    lr, u = 0.1, 0.9
    params = make_params(dtype=torch.float64)
    opt = SGD(params, lr=lr, momentum=u)
    gen = torch.Generator().manual_seed(7)
    constant = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    gaps = []
    for t in range(1, 6):
        for p, g in zip(params, constant):
            p.grad = g.clone()
        opt.step()
        predicted = [[torch.empty_like(p) for p in params]]
        opt.predict(1.0, out=predicted)
        # Take the real next step on a copy so the loop keeps its own trajectory.
        shadow = clone_params(params)
        shadow_opt = SGD(shadow, lr=lr, momentum=u)
        shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict shares tensors
        for p, g in zip(shadow, constant):
            p.grad = g.clone()
        shadow_opt.step()
        for g, pred, real in zip(constant, predicted[0], shadow):
            torch.testing.assert_close(pred - real.detach(), lr * u**t * g)
        gaps.append((predicted[0][0] - shadow[0].detach()).abs().max().item())
    assert gaps[-1] < gaps[0] * u**3


# --- state_dict and autograd safety ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip_continues_identically(case):
    factory = CASES[case][0]
    params = make_params()
    opt = factory(params)
    run_steps(opt, params, 0, 3)

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = clone_params(params)
    resumed = factory(resumed_params)
    resumed.load_state_dict(torch.load(buffer))

    for a, b in zip(opt.update_direction(True)[0], resumed.update_direction(True)[0]):
        assert torch.equal(a, b)
    for seed in range(3, 6):
        set_random_grads([params, resumed_params], seed)
        opt.step()
        resumed.step()
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)
    for a, b in zip(opt.update_direction()[0], resumed.update_direction()[0]):
        assert torch.equal(a, b)
    if case == "lion":
        assert all(s["update_sign"].dtype == torch.int8 for s in resumed.state.values())


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw", "lion"])
def test_step_and_predict_do_not_trip_autograd_version_counters(case):
    # In an async pipeline a weight saved by an in-flight micro-batch's forward is stepped and swapped
    # before that micro-batch's backward; the backward must still run.
    params = make_params()
    opt = CASES[case][0](params)
    run_steps(opt, params, 0, 1)
    opt.zero_grad()
    loss = sum((p * p).sum() for p in params)  # saves every p for the backward
    versions = [p._version for p in params]
    opt.predict(2.0, include_weight_decay=True)
    set_random_grads([params], 1)
    opt.step()
    assert [p._version for p in params] == versions
    opt.zero_grad()
    loss.backward()  # would raise "modified by an inplace operation" had the version counters moved
    assert all(p.grad is not None for p in params)


# --- factory and validation --------------------------------------------------------------------------


def test_build_optimizer_names():
    def build(name, **kw):
        return build_optimizer(name, make_params(), lr=0.1, weight_decay=0.01, **kw)

    sgd = build("sgd")
    assert type(sgd) is SGD and sgd.defaults["momentum"] == 0.9 and not sgd.defaults["nesterov"]
    assert build("sgd", sgd_momentum=0.0).defaults["momentum"] == 0.0
    assert build("sgd", sgd_direction="lookahead").defaults["direction"] == "lookahead"
    nesterov = build("nesterov")
    assert type(nesterov) is SGD and nesterov.defaults["nesterov"] and nesterov.defaults["momentum"] == 0.9
    adam = build("adam", adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    assert type(adam) is Adam and adam.defaults["betas"] == (0.8, 0.95) and adam.defaults["eps"] == 1e-6
    adamw = build("adamw")
    assert type(adamw) is AdamW and adamw.defaults["weight_decay"] == 0.01
    assert type(build("rmsprop")) is RMSprop
    assert type(build("adagrad")) is Adagrad
    lion = build("lion", lion_beta1=0.95, lion_beta2=0.98)
    assert type(lion) is Lion and lion.defaults["betas"] == (0.95, 0.98)


def test_build_optimizer_rejects_unknown_name_and_bad_values():
    with pytest.raises(ConfigError, match="--optimizer 'adamax'.*adam, adamw, sgd"):
        build_optimizer("adamax", make_params(), lr=0.1)
    with pytest.raises(ConfigError, match="lr"):
        build_optimizer("adam", make_params(), lr=-1.0)
    with pytest.raises(ConfigError, match="direction"):
        build_optimizer("sgd", make_params(), lr=0.1, sgd_direction="sideways")


def test_constructor_validation():
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(make_params(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta1"):
        Adam(make_params(), lr=0.1, betas=(1.0, 0.999))


# --- keeping the step's direction for the predictions until the next step ------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_kept_direction_predicts_bitwise_like_rebuilt_direction(case):
    """`keep_direction` only reuses what the step computed: every prediction (in place, into another
    dtype, several per step, after steps that skip some parameters, after a state reload) and every step
    is bitwise identical to an optimizer rebuilding ΔW from its state each time."""
    fresh_params, kept_params = make_params(), make_params()
    make = CASES[case][0]
    fresh = make([{"params": fresh_params[:2]}, {"params": fresh_params[2:], "lr": 0.003}])
    kept = make([{"params": kept_params[:2]}, {"params": kept_params[2:], "lr": 0.003}])
    kept.keep_direction = True
    skip = {2: (1,), 3: (0, 2)}  # some steps leave parameters without a gradient
    for seed in range(6):
        set_random_grads([fresh_params, kept_params], seed, skip=skip.get(seed, ()))
        fresh.step()
        kept.step()
        assert all(torch.equal(a, b) for a, b in zip(fresh_params, kept_params))
        for steps in (1.0, 2.5):  # two predictions between steps (k > 1, or interleaved chunks)
            outs = []
            for opt, params in ((fresh, fresh_params), (kept, kept_params)):
                out = [[torch.empty_like(p, dtype=torch.bfloat16) for p in g["params"]] for g in opt.param_groups]
                opt.predict(steps, out=out)
                live = snapshot(params)
                opt.predict(steps)
                outs.append((out, snapshot(params)))
                with torch.no_grad():
                    for p, w in zip(params, live):
                        p.copy_(w)
            (out_f, inplace_f), (out_k, inplace_k) = outs
            assert all(torch.equal(a, b) for ra, rb in zip(out_f, out_k) for a, b in zip(ra, rb))
            assert all(torch.equal(a, b) for a, b in zip(inplace_f, inplace_k))
        if seed == 3:  # a reload replaces the state: the kept directions must not outlive it
            buf = io.BytesIO()
            torch.save(fresh.state_dict(), buf)
            buf.seek(0)
            kept.load_state_dict(torch.load(buf))
    assert kept._kept_direction, "the kept optimizer never kept anything"


def test_kept_direction_is_dropped_by_forget_and_by_the_next_step():
    params = make_params()
    opt = Adam(params, lr=0.01)
    opt.keep_direction = True
    run_steps(opt, params, 0, 1)
    first = dict(opt._kept_direction)
    assert len(first) == len(params)
    run_steps(opt, params, 1, 1)
    assert all(opt._kept_direction[k][1] is not first[k][1] for k in first)  # new denominators
    with torch.no_grad():  # a state change other than a step (e.g. an in-place checkpoint load)...
        for state in opt.state.values():
            state["exp_avg_sq"].mul_(4.0)
    opt.forget_kept_direction()  # ...must be followed by this, after which ΔW is rebuilt from the state
    live = snapshot(params)
    direction = opt.update_direction()
    opt.predict(1.0)
    for p, w, d in zip(params, live, direction[0]):
        torch.testing.assert_close(p.detach(), w - 0.01 * d, rtol=0, atol=1e-7)
