"""Delay-robust asynchronous training (issue 15): NAdamW, NAG + PipeNAG, error feedback.

Closed forms: each rule's update on random states (or on a recorded emulator run) equals its formula,
written here independently of the implementation. Distributed: the distributed run equals the
single-process emulator bit for bit: the PipeNAG and error-feedback rows of tests/test_async_pipeline.py.
Tolerances: optimizer-vs-torch comparisons are bitwise; formula-vs-implementation in fp32 at rtol 1e-5 /
atol 1e-6 on random states (the formula is evaluated in float64, or with other float op orders); replays
of recorded runs at rtol 1e-4 / atol 1e-5 as in tests/test_async_policies.py.
"""

import pytest
import torch
from test_async_policies import emulator, lr_fn_for, record, step_counts

from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.optim import NAG, NAdamW, build_optimizer
from megatron_po.pipeline.error_feedback import ErrorFeedback

SHAPES = [(5, 3), (7,), (2, 3, 4)]


def random_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def random_grads(seed, steps):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def run(opt, params, grads):
    history = [[p.detach().clone() for p in params]]
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


# ---------------------------------------------------------------------------------------------- NAdamW


@pytest.mark.parametrize("psi", [4e-3, 0.5])
def test_nadamw_equals_torch_nadam_bitwise_and_its_formula(psi):
    lr, betas, eps, wd = 1e-2, (0.99, 0.999), 1e-8, 0.1
    ours = [p.requires_grad_() for p in random_params(0)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    grads = random_grads(1, 6)
    h_ours = run(NAdamW(ours, lr, betas, eps, wd, psi), ours, grads)
    h_ref = run(torch.optim.NAdam(ref, lr, betas, eps, wd, psi, decoupled_weight_decay=True, foreach=True), ref, grads)
    for a, b in zip(h_ours, h_ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # the formula of the module docstring, in float64
    w = [p.double() for p in h_ours[0]]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    prod = 1.0
    for t, gs in enumerate(grads, start=1):
        mu = betas[0] * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = betas[0] * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod *= mu
        for i, g in enumerate(gs):
            g = g.double()
            w[i] = w[i] * (1 - lr * wd)
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            den = (v[i] / (1 - betas[1] ** t)).sqrt() + eps
            w[i] = w[i] - lr * (1 - mu) / (1 - prod) * g / den - lr * mu_next / (1 - prod * mu_next) * m[i] / den
        for x, y in zip(h_ours[t], w):
            torch.testing.assert_close(x, y.float(), rtol=1e-5, atol=1e-6)


def test_nadamw_direction_and_prediction_are_the_last_step():
    lr, wd = 1e-2, 0.1
    params = [p.requires_grad_() for p in random_params(2)]
    opt = build_optimizer("nadamw", [{"params": params, "weight_decay": wd}], lr, adam_beta1=0.99,
                          nadam_momentum_decay=0.05)
    history = run(opt, params, random_grads(3, 4))
    before, after = history[-2], history[-1]
    direction = opt.update_direction()[0]
    for b, a, d in zip(before, after, direction):  # W_after = W_before(1 - lr·λ) - lr·ΔW
        torch.testing.assert_close(a, b * (1 - lr * wd) - lr * d, rtol=1e-5, atol=1e-6)
    out = [[torch.empty_like(p) for p in params]]
    opt.predict(3, out=out)
    for w, p, d in zip(out[0], params, direction):
        torch.testing.assert_close(w, p.detach() - 3 * lr * d, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- NAG


@pytest.mark.parametrize("explicit", [True, False])
def test_nag_follows_eq10_at_zero_delay(explicit):
    """w_{t+1} = w_t + γ(w_t − w_{t−1}) − η(1−γ)(g_t + λw_t), w_{-1} = w_0 (buffer from 0). The explicit form
    holds w; the reformulated one holds the look-ahead y_t = w_t + γ(w_t − w_{t−1}), with g_t taken at y_t."""
    lr, gamma, wd = 0.1, 0.9, 0.01
    params = [p.requires_grad_() for p in random_params(4)]
    opt = NAG(params, lr, gamma, wd, explicit_lookahead=explicit)
    grads = random_grads(5, 5)
    history = run(opt, params, grads)
    w_prev = w = [p.double() for p in history[0]]
    for t, gs in enumerate(grads, start=1):
        held = w if explicit else [x + gamma * (x - xp) for x, xp in zip(w, w_prev)]
        new = [x + gamma * (x - xp) - lr * (1 - gamma) * (g.double() + wd * h)
               for x, xp, g, h in zip(w, w_prev, gs, held)]
        w_prev, w = w, new
        expected = w if explicit else [x + gamma * (x - xp) for x, xp in zip(w, w_prev)]
        for x, y in zip(history[t], expected):
            torch.testing.assert_close(x, y.float(), rtol=1e-5, atol=1e-6)
    if explicit:  # the look-ahead point the pipenag policy runs passes on
        point = dict(opt.predicted(gamma))
        for p, x, xp in zip(params, history[-1], history[-2]):
            torch.testing.assert_close(point[p], x + gamma * (x - xp), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("delay", [0, 1, 3, 1.5])
def test_error_feedback_closed_form(delay):
    """x_{t+1} = x_t − u_t − s·(u_t − u_{t−1}) with u_t the optimizer's update; the first step is untouched;
    s = 0 leaves every step bit for bit as the optimizer made it."""
    params = random_params(6)
    ef = ErrorFeedback([params])
    x = [p.clone() for p in params]
    last = None
    for t, updates in enumerate(random_grads(7, 5)):
        ef.begin(0)
        for p, u in zip(params, updates):  # "the optimizer": any displacement
            p.data.sub_(u)
        ef.end(0, delay)
        for i, u in enumerate(updates):
            x[i] = x[i] - u if last is None or delay == 0 else x[i] - u - delay * (u - last[i])
            if delay == 0:
                assert torch.equal(params[i], x[i])
            else:
                torch.testing.assert_close(params[i], x[i], rtol=1e-5, atol=1e-6)
        last = updates
    state = ef.state_dict()
    fresh = ErrorFeedback([params])
    fresh.load_state_dict(state)
    for a, b, c in zip(fresh.last[0], ef.last[0], last):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)  # u_t read off the weights: rounded


def _ef_records(emu):
    """Wrap every stage's ErrorFeedback.end: record (chunk, delay, u_t, u_{t−1}, after-opt, after-EF)."""
    records = {}
    for s in emu.stages:
        ef, rows = s.policy.error_feedback, records.setdefault(s.rank, [])

        def end(c, delay, ef=ef, rows=rows):
            before = [w.clone() for w in ef._scratch[c]]
            after_opt = [p.detach().clone() for p in ef.params[c]]
            last = None if ef.last[c] is None else [u.clone() for u in ef.last[c]]
            ErrorFeedback.end(ef, c, delay)
            rows.append((c, delay, [b - a for b, a in zip(before, after_opt)], last, after_opt,
                         [p.detach().clone() for p in ef.params[c]]))
        ef.end = end
    return records


@pytest.mark.parametrize("method,optimizer,D,k,expected_delay", [
    ("pipedream-2bw", "adamw", 3, 3, lambda r, i: 1 if i else 0),
    ("pipedream", "nadamw", 3, 1, lambda r, i: min(i, 3 - r - 1)),  # s(j) = D-r-1 once the warm-up is over
])
def test_error_feedback_in_the_stream(method, optimizer, D, k, expected_delay):
    emu = emulator(method, D, 1, k, optimizer, error_feedback=True)
    records = _ef_records(emu)
    from test_async_policies import get_batch
    emu.train_segment(lambda mb: get_batch(mb), 4 * D * k // k * k)
    for r, rows in records.items():
        assert rows
        for i, (c, delay, u, last, after_opt, after) in enumerate(rows):
            assert delay == expected_delay(r, i), (r, i, delay)
            for j in range(len(u)):
                want = after_opt[j] if last is None or delay == 0 else after_opt[j] - delay * (u[j] - last[j])
                torch.testing.assert_close(after[j], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- PipeNAG


@pytest.mark.parametrize("D,v", [(3, 1), (2, 2)])
def test_pipenag_replays_eq10(D, v):
    """Recorded run: F(j) on w_v + γ(w_v − w_{v−1}) (v = the step count at F(j)), B(j) on the same point, and
    w_{t+1} = w_t + γ(η_t/η_{t−1})(w_t − w_{t−1}) − η_t(1−γ)(g_t + λw_t), g_t the gradient at that point."""
    gamma, wd = 0.9, 0.01
    emu = emulator("pipenag", D, v, 1, "nag", weight_decay=wd)
    recorders, initial = record(emu)
    from test_async_policies import get_batch
    emu.train_segment(lambda mb: get_batch(mb), 4 * D * v)
    lr = lr_fn_for("nag")
    checked = 0
    for r, rec in recorders.items():
        for c, events in rec.events.items():
            names = [n for n, _ in initial[(r, c)].named_parameters()]
            wd_of = [wd if p.ndim > 1 else 0.0 for _, p in initial[(r, c)].named_parameters()]
            live = [[p.detach().clone() for _, p in initial[(r, c)].named_parameters()]]
            forwards = {}
            counts = step_counts(events)
            for ev in events:
                if ev["kind"] == "F":
                    t = counts[ev["mb"]][0]
                    w, wp = live[t], live[max(t - 1, 0)]
                    for x, a, b, n in zip(ev["weights"], w, wp, names):
                        torch.testing.assert_close(x, a + gamma * (a - b), rtol=1e-4, atol=1e-5, msg=n)
                    forwards[ev["mb"]] = ev["weights"]
                elif ev["kind"] == "B":
                    assert all(torch.equal(a, b) for a, b in zip(ev["weights"], forwards[ev["mb"]]))
                    grad, point = ev["grad"], ev["weights"]
                else:
                    t = len(live) - 1
                    w, wp = live[t], live[max(t - 1, 0)]
                    ratio = lr(t) / lr(t - 1) if t else 0.0
                    new = [a + gamma * ratio * (a - b) - lr(t) * (1 - gamma) * (g + lam * a)
                           for a, b, g, lam in zip(w, wp, grad, wd_of)]
                    for x, y, n in zip(ev["weights"], new, names):
                        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=n)
                    live.append(ev["weights"])
                    checked += 1
    assert checked >= D * v * 3
    # look-ahead points held: at most s_max + 1 besides the live weights (s_max = D-r-1 straight)
    if v == 1:
        assert all(n <= D - r + 1 for (r, _), n in emu.copies_per_chunk().items())


def test_pipenag_needs_nag():
    with pytest.raises(ConfigError, match="--optimizer nag"):
        emulator("pipenag", 2, 1, 1, "adam")


# ---------------------------------------------------------------------------------------------- distributed


# distributed run = emulator, bitwise: PipeNAG and error-feedback rows of test_async_pipeline.CASES


# ---------------------------------------------------------------------------------------------- flags


MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
PP2 = MOCK + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]


def test_flags_reach_the_config():
    cfg = parse_args(PP2 + ["--pipeline-method", "pipedream", "--optimizer", "nadamw", "--adam-beta1", "0.99",
                            "--nadam-momentum-decay", "0.04", "--async-error-feedback"])
    validate(cfg, 2)
    assert cfg.training.optimizer == "nadamw" and cfg.training.nadam_momentum_decay == 0.04
    assert cfg.parallel.async_error_feedback
    validate(parse_args(PP2 + ["--pipeline-method", "pipenag", "--optimizer", "nag"]), 2)


# ---------------------------------------------------------------------------------------------- entry point


ENTRY_CASES = {
    "pipenag": {"--pipeline-method": "pipenag", "--optimizer": "nag", "--lr": 0.5},
    "recipe": {"--pipeline-method": "pipedream", "--optimizer": "nadamw", "--adam-beta1": 0.99},
    "2bw-ef": {"--pipeline-method": "pipedream-2bw", "--async-update-interval": 2, "--async-error-feedback": True},
}


@pytest.mark.parametrize("case", list(ENTRY_CASES))
def test_train_through_pretrain(corpus, tmp_path, case):
    from test_pretrain_gpt import ASYNC, run_layout
    records = run_layout(corpus, tmp_path, case, 4, **dict(ASYNC, **ENTRY_CASES[case]))  # PP=2 x DP=2
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
