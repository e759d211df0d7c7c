"""Weight predictors (optim/predictors.py) and the gradient-side corrections of the asynchronous policies
(delay compensation, staleness-aware lr scaling).

- Closed forms: on random optimizer states (float64) each predictor's Ŵ equals its closed form, the
  rollout's computed by simulating the optimizer's recurrences element by element under the stated
  gradient assumption (not by the ratio formulas the module uses). rtol 1e-12: the same float64 math
  in another order.
- Constant gradient: the rollout predictor reproduces s real optimizer steps (under an LR warm-up, with
  AdamW's decay compounded) to rtol 1e-12 (float64), where the linear predictor is off by > 1e-4.
- Cost: an in-place prediction with a kept direction allocates no weight-sized temporary.
- Sharded state (ZeRO-1, DP=2): predicted weights equal the unsharded optimizer's bitwise (the predictors'
  coefficients are scalars, so every shard applies the same ones to its own state).
- In the pipeline (emulator, interleaved schedule): the forward's weights are W − Σ lr_fn(t+i)·ΔW with
  the schedule's s(j) and the chunk's own step count t; delay compensation changes each gradient to
  g + λ·g⊙g⊙(W_live − W_used) with W_used the weights its forward ran on (PipeOptim's Ŵ_j, PipeDream's
  stash), atol 1e-6 (fp32 products of the same tensors); lr scaling gives lr/(1+s).
"""

import math

import pytest
import test_pretrain_gpt
import torch
from dist_harness import run_distributed
from test_async_policies import emulator, get_batch

from megatron_po.config import Config
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.optim import build_optimizer
from megatron_po.optim.memory import track_new_tensor_bytes
from megatron_po.optim.predictors import build_predictor, horizon_length

LR_FN = lambda i: 1e-2 * min(1.0, (i + 1) / 10)  # noqa: E731  (warm-up: the lr changes every step)


def random_optimizer(name, t, weight_decay=0.1, dtype=torch.float64, seed=0):
    """An optimizer over 3 random params whose state is random (after t steps by its step counter)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for shape in [(5, 4), (7,), (3, 3)]]
    opt = build_optimizer(name, [{"params": params[:2], "weight_decay": weight_decay},
                                 {"params": params[2:], "weight_decay": 0.0}], lr=LR_FN(t - 1),
                          weight_decay=weight_decay)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
    opt.step()
    for state in opt.state.values():
        for key in ("exp_avg", "momentum_buffer"):
            if key in state:
                state[key].copy_(torch.randn(state[key].shape, generator=g, dtype=dtype))
        if "exp_avg_sq" in state:
            state["exp_avg_sq"].copy_(torch.rand(state["exp_avg_sq"].shape, generator=g, dtype=dtype) + 0.1)
        if "step" in state:
            state["step"].fill_(t)
    return opt, params


def predicted(opt, steps, predictor, include_weight_decay=False, t=None):
    predictor.plan(LR_FN, t)
    opt.predictor = predictor
    out = [[torch.empty_like(p) for p in group["params"]] for group in opt.param_groups]
    opt.predict(steps, include_weight_decay, out=out)
    return [o for row in out for o in row]


def expected_rollout(opt, steps, t, zero_mean, include_weight_decay):
    """Simulate the optimizer's recurrences s steps ahead under the assumption, element by element."""
    out = []
    for group in opt.param_groups:
        lrs = [LR_FN(t + i) for i in range(steps)]
        decay = group["weight_decay"] if include_weight_decay and opt.decoupled_weight_decay else 0.0
        for p in group["params"]:
            state, w = opt.state[p], p.detach().clone()
            if "exp_avg" in state:  # Adam / AdamW
                (b1, b2), eps = group["betas"], group["eps"]
                m, v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
                m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                for i, lr in enumerate(lrs, start=1):
                    m = b1 * m + (0.0 if zero_mean else (1 - b1) * m_hat)
                    v = b2 * v + (1 - b2) * v_hat
                    w = w * (1 - lr * decay) - lr * (m / (1 - b1 ** (t + i))) / ((v / (1 - b2 ** (t + i))).sqrt() + eps)
            else:  # SGD momentum u: the bias-corrected mean of the buffer, from a unit-gradient run of t steps
                u, tau = group["momentum"], group["dampening"]
                unit = 1.0
                for _ in range(t - 1):
                    unit = u * unit + (1 - tau)
                buf = state["momentum_buffer"].clone()
                g_hat = buf / unit
                for lr in lrs:
                    buf = u * buf + (0.0 if zero_mean else (1 - tau) * g_hat)
                    w = w - lr * buf
            out.append(w)
    return out


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("t", [2, 40])
def test_each_predictor_equals_its_closed_form_on_random_states(name, t):
    steps = 3
    opt, params = random_optimizer(name, t)
    directions = [d for row in opt.update_direction() for d in row]
    lr_now = opt.param_groups[0]["lr"]
    cases = {
        ("linear", "full"): [p - steps * lr_now * d for p, d in zip(params, directions)],
        ("linear", "sqrt"): [p - math.sqrt(steps) * lr_now * d for p, d in zip(params, directions)],
        ("lr-schedule", "full"): [p - sum(LR_FN(t + i) for i in range(steps)) * d for p, d in zip(params, directions)],
        ("lr-schedule", "sqrt"): [p - sum(LR_FN(t + i) for i in range(steps)) / math.sqrt(steps) * d
                                  for p, d in zip(params, directions)],
    }
    for (predictor, horizon), expected in cases.items():
        got = predicted(opt, steps, build_predictor(predictor, horizon), t=t)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-14, msg=f"{predictor} {horizon}")
    for gradient in ("first-moment", "zero-mean"):
        for wd in (False, True):
            got = predicted(opt, steps, build_predictor("rollout", rollout_gradient=gradient, optimizer=opt), wd, t=t)
            expected = expected_rollout(opt, steps, t, gradient == "zero-mean", wd)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"rollout {gradient} decay={wd}")


def real_steps(opt, params, grads, first_step, count):
    for i in range(count):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = LR_FN(first_step + i)
        opt.step()


@pytest.mark.parametrize("name,weight_decay,momentum", [("adam", 0.0, 0.9), ("adamw", 0.1, 0.9),
                                                         ("sgd", 0.0, 0.9), ("sgd", 0.0, 0.0)])
def test_rollout_with_a_constant_gradient_reproduces_real_steps(name, weight_decay, momentum):
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True),
              torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)]
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    opt = build_optimizer(name, params, lr=LR_FN(0), weight_decay=weight_decay, sgd_momentum=momentum)
    t, steps = 3, 4  # early: bias corrections and the lr warm-up still move
    real_steps(opt, params, grads, 0, t)
    rollout = predicted(opt, steps, build_predictor("rollout", optimizer=opt), include_weight_decay=True, t=t)
    linear = predicted(opt, steps, build_predictor("linear"), include_weight_decay=True, t=t)
    real_steps(opt, params, grads, t, steps)
    for got, lin, real in zip(rollout, linear, params):
        torch.testing.assert_close(got, real.detach(), rtol=1e-12, atol=1e-14)
        assert (lin - real).abs().max() > 1e-4  # PipeOptim's linear rule is not exact here


@pytest.mark.parametrize("predictor,horizon,gradient", [("linear", "sqrt", "first-moment"),
                                                        ("lr-schedule", "full", "first-moment"),
                                                        ("rollout", "full", "zero-mean")])
def test_prediction_is_one_pass_without_weight_sized_temporaries(predictor, horizon, gradient):
    params = [torch.randn(256, 256, requires_grad=True) for _ in range(4)]
    opt = build_optimizer("adamw", params, lr=1e-3, weight_decay=0.1)
    opt.keep_direction = True  # as the predicting policies set it
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    pred = build_predictor(predictor, horizon, gradient, optimizer=opt)
    pred.plan(LR_FN, 1)
    opt.predictor = pred
    with track_new_tensor_bytes() as tracked:
        opt.predict(3.0, include_weight_decay=True)
    assert tracked.peak < 256 * 256 * 4, tracked.peak  # less than one parameter's worth


def _sharded_prediction(predictor, horizon):
    from test_distributed_optimizer import build, snapshot, train_step
    out = {}
    for sharded in (False, True):
        model, ddp, opt = build("adamw", sharded, cfg="llama")
        for step in range(2):
            train_step(model, ddp, opt, step)
        inner = opt.optimizer if sharded else opt
        inner.predictor = build_predictor(predictor, horizon, optimizer=inner)
        inner.predictor.plan(LR_FN, 2)
        if sharded:
            opt.predict_model_params(3.0, True)
        else:
            opt.predict(3.0, True)
        out[sharded] = snapshot(model)
    return out


@pytest.mark.parametrize("predictor,horizon", [("rollout", "full"), ("lr-schedule", "sqrt")])
def test_sharded_prediction_with_a_predictor_equals_unsharded(predictor, horizon):
    for out in run_distributed(_sharded_prediction, 2, args=(predictor, horizon)):
        for name, w in out[False].items():
            assert torch.equal(out[True][name], w), name


# ---- in the pipeline ---------------------------------------------------------------------------------


def test_pipeline_forward_uses_the_schedule_aware_prediction_interleaved():
    emu = emulator("pipeoptim", 2, 2, 1, "adam", weight_predictor="lr-schedule")
    checked = 0
    for stage in emu.stages:
        policy, original = stage.policy, stage.policy.before_forward
        assert all(getattr(o, "predictor", None) is p for o, p in zip(stage.optimizers, policy.predictors))

        def before_forward(mb, chunk, policy=policy, original=original):
            nonlocal checked
            opt, params = policy.optimizers[chunk], policy.params[chunk]
            s, t = policy.staleness[chunk][mb], policy.steps[chunk]
            live = [p.detach().clone() for p in params]
            directions = {id(p): d for g, row in zip(opt.param_groups, opt.update_direction())
                          for p, d in zip(g["params"], row)}
            original(mb, chunk)
            if s and t:
                b = sum(policy.lr_fn(t + i) for i in range(s))
                for p, w in zip(params, live):
                    torch.testing.assert_close(p.data, w - b * directions[id(p)], rtol=1e-6, atol=1e-7)
                checked += 1
        policy.before_forward = before_forward
    emu.train_segment(get_batch, 8)
    assert checked > 8


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_delay_compensation_corrects_each_gradient_toward_the_live_weights(method):
    lam = 50.0
    emu = emulator(method, 3, 1, 1, "adam", delay_compensation=lam)
    corrected = 0
    for stage in emu.stages:
        policy = stage.policy
        used = {}
        f, b = policy.before_forward, policy.after_backward

        def before_forward(mb, chunk, policy=policy, f=f, used=used):
            f(mb, chunk)
            used[mb] = [p.detach().clone() for p in policy.params[chunk]]  # what this forward runs on

        def after_backward(mb, chunk, policy=policy, b=b, used=used):
            nonlocal corrected
            params = policy.params[chunk]
            grads = [p.grad.clone() for p in params]
            b(mb, chunk)
            w_used = used.pop(mb)
            for p, g, w in zip(params, grads, w_used):
                # after the hook the parameters hold the live weights again
                torch.testing.assert_close(p.grad, g + lam * g * g * (p.data - w), rtol=1e-5, atol=1e-6)
            corrected += any(not torch.equal(p.grad, g) for p, g in zip(params, grads))
        policy.before_forward, policy.after_backward = before_forward, after_backward
    emu.train_segment(get_batch, 9)
    assert corrected > 4


def test_staleness_lr_scaling_divides_each_stage_lr_by_one_plus_s():
    D = 3
    emu = emulator("pipedream", D, 1, 1, "adam", staleness_lr_scaling="inverse")
    emu.train_segment(get_batch, 9)
    lr_fn = emu.stages[0].lr_fn
    for stage in emu.stages:
        s = D - stage.rank - 1  # the straight pipeline's staleness, k = 1
        assert stage.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr_fn(8) / (1 + s), rel=1e-12)
    emu = emulator("async-naive", 2, 1, 2, "adam", staleness_lr_scaling="inverse-sqrt")
    policy = emu.stages[0].policy
    ages = policy.gradient_staleness(0)
    assert len(ages) == 2  # k = 2 micro-batches per step: the mean of their factors
    assert policy.lr_scale(0) == pytest.approx(sum((1 + a) ** -0.5 for a in ages) / 2)


def _cfg(**parallel):
    cfg = Config()
    cfg.model.untie_embeddings_and_output_weights = True
    cfg.data.mock_data, cfg.data.vocab_size = True, 64
    cfg.parallel.pipeline_model_parallel_size = 2
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("parallel,message", [
    (dict(pipeline_method="1f1b", weight_predictor="rollout"), "--weight-predictor applies to asynchronous"),
    (dict(pipeline_method="pipedream", prediction_horizon="sqrt"), "--prediction-horizon applies to --pipeline-method pipeoptim"),
    (dict(pipeline_method="pipeoptim", rollout_gradient="zero-mean"), "--rollout-gradient applies to --weight-predictor rollout"),
    (dict(pipeline_method="async-naive", delay_compensation_lambda=1.0), "pipedream (its stash) or pipeoptim"),
    (dict(pipeline_method="pipeoptim", delay_compensation_lambda=-1.0), "must be >= 0"),
    (dict(pipeline_method="pipeoptim", delay_compensation_adaptive=True), "needs --delay-compensation-lambda > 0"),
    (dict(pipeline_method="1f1b", staleness_lr_scaling="inverse"), "--staleness-lr-scaling applies to asynchronous"),
])
def test_bad_predictor_flags_raise_one_config_error(parallel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(_cfg(**parallel), 2)
    cfg = _cfg(pipeline_method="pipeoptim", weight_predictor="rollout", rollout_gradient="zero-mean",
               prediction_horizon="sqrt", delay_compensation_lambda=2.0, staleness_lr_scaling="inverse")
    validate(cfg, 2)  # a valid combination


def test_rollout_rejects_optimizers_it_cannot_roll():
    opt = build_optimizer("lion", [torch.zeros(2, requires_grad=True)], lr=1e-3)
    with pytest.raises(ConfigError, match="Adam, AdamW and SGD"):
        build_predictor("rollout", optimizer=opt)
    with pytest.raises(ConfigError, match="unknown weight predictor"):
        build_predictor("quadratic")
    assert horizon_length(4.0, "sqrt") == 2.0


def test_delay_compensation_needs_one_micro_batch_per_step():
    with pytest.raises(ConfigError, match="update interval k = 1, got 2"):
        emulator("pipeoptim", 2, 1, 2, "adam", delay_compensation=1.0)




def test_predictor_flags_train_through_pretrain_with_tp2(corpus, tmp_path):
    """The flags reach the policies of a real run: PP=2 x TP=2 (4 processes), rollout with the √s horizon,
    delay compensation and staleness lr scaling together; the loss falls."""
    flags = dict(test_pretrain_gpt.ASYNC, **{"--pipeline-method": "pipeoptim", "--tensor-model-parallel-size": 2,
                                             "--weight-predictor": "rollout", "--prediction-horizon": "sqrt",
                                             "--delay-compensation-lambda": 1.0,
                                             "--staleness-lr-scaling": "inverse-sqrt"})
    records = test_pretrain_gpt.run_layout(corpus, tmp_path, "predictors", 4, **flags)
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
