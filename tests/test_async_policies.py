"""Asynchronous weight policies: every method's updates equal its formula in docs/ASYNC_PIPELINES.md.

Method: run the single-process emulator (tiny GPT chunks, fp32) with each rank's policy wrapped by a
`Recorder` that logs, per (rank, chunk) and in execution order, the weights each forward and backward ran
on, the inputs and output gradients the chunk got from its neighbours, each micro-batch's gradient
contribution and the weights after each step. Then an independent replay, per (rank, chunk), rebuilds
the whole weight history from the initial weights with torch.optim and the method's formula alone:

  naive      F: W_{t_f}                      B: W_{t_b}
  pipedream  F = B: W_{t_f}                  (gradient at the weights s steps earlier)
  2bw        F = B: W_{max(t_b - 1, 0)}      (W(t+1) = W(t) - η·U(∇f(W(t-1))))
  spectrain  F: W_{t_f} - s_f·η·v            B: W_{t_b} - s_b·η·v
  pipeoptim  F: W_{t_f} - (s + s_offset)·η·ΔW   B: W_{t_b}

t_f / t_b = the chunk's step count at F(j) / B(j), counted from the recorded events; s = t_b - t_f.
η·ΔW (and η·v) is the displacement of the last step, W_{t-1} - W_t (minus the decoupled decay
for AdamW), so the prediction is checked without the optimizer's `update_direction`. Gradients are
recomputed with torch.func on fresh leaves: forward at the formula's forward weights, backward at its
backward weights.

Tolerance: fp32, rtol 1e-4, atol 1e-5. Methods without prediction replay bitwise (torch.optim and
megatron_po.optim agree exactly); predicted weights rebuilt from the displacement differ from the
optimizer's ΔW by ~1 ulp·s, which Adam amplifies on rarely-seen embedding rows (largest deviation
observed over two segments: 1.6e-6). A wrong formula is off by about one step, ~lr·|ΔW| ≈ 1e-2:
`test_replay_rejects_a_wrong_staleness` checks the replay does fail then.
"""

import contextlib
import copy
import math

import pytest
import torch

from megatron_po.config import Config, ModelConfig
from megatron_po.errors import ConfigError
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.optim import build_optimizer
from megatron_po.optim.muon import optimizer_param_groups
from megatron_po.pipeline.async_pipeline import AsyncEmulator, segment_schedule
from megatron_po.pipeline.executor import Mailbox, StageRunner, WeightPolicy
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.pipeline.async_policy import spectrain_staleness
from megatron_po.pipeline.policies import build_policy
from megatron_po.pipeline.predicting_policies import PipeOptimPolicy
from megatron_po.pipeline.schedules import async_one_f_one_b, staleness
from megatron_po.tensor_parallel.random import recompute_weights

VOCAB = 64
SEED = 5
RTOL, ATOL = 1e-4, 1e-5
LR = {"adam": 1e-2, "adamw": 1e-2, "sgd": 0.1, "muon": 1e-2, "nag": 0.1, "nadamw": 1e-2}


def make_cfg(num_layers, tied=False):
    # No linear biases: the attention key bias has an exactly-zero true gradient (softmax ignores it), so
    # Adam would amplify rounding noise in it and no two implementations could agree to 1e-5.
    cfg = Config()
    cfg.model = ModelConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=2, seq_length=8,
                            hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                            untie_embeddings_and_output_weights=not tied, add_bias_linear=False)
    cfg.training.seed = SEED
    return cfg


def get_batch(mb, mbs=2, seq=8, salt=0, masked=True):
    g = torch.Generator().manual_seed(1000 * salt + mb)
    tokens = torch.randint(0, VOCAB, (mbs, seq + 1), generator=g)
    mask = torch.ones(mbs, seq)
    if masked and mb % 3:
        mask[0, -(mb % 3):] = 0  # varying masked tails exercise the loss mask
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def lr_fn_for(optimizer):
    base = LR[optimizer]
    return lambda i: base * (1.0 + 0.25 * i)  # changes every step: predictions must use the current lr


def emulator(method, D, v, k, optimizer="adam", weight_decay=0.01, clip_grad=0.0, **options):
    torch.manual_seed(0)
    kwargs = {"lr": LR[optimizer], "weight_decay": weight_decay, "sgd_momentum": 0.9}
    if optimizer == "muon":  # fp32 Newton-Schulz: the replay's fp32-rounding differences must not flip bf16 roundings
        kwargs["muon_fp32_matmul_prec"] = "highest"
    return AsyncEmulator(make_cfg(D * v), VOCAB, method, D, v, k, optimizer, kwargs, lr_fn_for(optimizer),
                         clip_grad, **options)


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------


def snapshot(params):
    return [p.detach().clone() for p in params]


class Recorder(WeightPolicy):
    """Wraps a rank's policy; logs events per chunk: ("F", mb, weights, input), ("B", mb, weights,
    gradient contribution, output gradient), ("S", weights after the step)."""

    def __init__(self, inner, chunks):
        self.inner, self.chunks = inner, chunks
        self.params = [list(c.parameters()) for c in chunks]
        self.events = {c: [] for c in range(len(chunks))}
        self.out_grads = {}
        self.current = None
        for chunk in chunks:
            chunk.register_forward_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return  # evaluation
        mb, c = self.current
        hidden = kwargs["hidden_states"]
        self.events[c][-1]["input"] = None if hidden is None else hidden.detach().clone()
        output.register_hook(lambda g: self.out_grads.__setitem__((mb, c), g.detach().clone()))

    def use_schedule(self, schedule):
        self.inner.use_schedule(schedule)

    def copies_per_chunk(self):
        return self.inner.copies_per_chunk()

    def weights_for_recompute(self, mb, c):
        return self.inner.weights_for_recompute(mb, c)

    def before_forward(self, mb, c):
        self.inner.before_forward(mb, c)
        self.current = (mb, c)
        self.events[c].append({"kind": "F", "mb": mb, "weights": snapshot(self.params[c])})

    def after_forward(self, mb, c):
        self.inner.after_forward(mb, c)

    def before_backward(self, mb, c):
        self.inner.before_backward(mb, c)
        self._grad_before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params[c]]
        self.events[c].append({"kind": "B", "mb": mb, "weights": snapshot(self.params[c])})

    def after_backward(self, mb, c):
        ev = self.events[c][-1]
        ev["grad"] = [p.grad - g0 for p, g0 in zip(self.params[c], self._grad_before)]
        ev["out_grad"] = self.out_grads.pop((mb, c))
        self.inner.after_backward(mb, c)

    def before_step(self, c):
        self.inner.before_step(c)

    def after_step(self, c):
        self.inner.after_step(c)
        self.events[c].append({"kind": "S", "weights": snapshot(self.params[c])})


def record(emu):
    """Install recorders; return (recorders by rank, initial chunk copies by (rank, chunk))."""
    initial = {(s.rank, c): copy.deepcopy(chunk) for s in emu.stages for c, chunk in enumerate(s.chunks)}
    recorders = {}
    for s in emu.stages:
        s.policy = recorders[s.rank] = Recorder(s.policy, s.chunks)
    return recorders, initial


# --------------------------------------------------------------------------------------------------
# Independent replay
# --------------------------------------------------------------------------------------------------


def step_counts(events):
    """mb -> (t_f, t_b): the chunk's step count when F(mb) and B(mb) ran."""
    t, at_f, out = 0, {}, {}
    for ev in events:
        if ev["kind"] == "S":
            t += 1
        elif ev["kind"] == "F":
            at_f[ev["mb"]] = t
        else:
            out[ev["mb"]] = (at_f[ev["mb"]], t)
    return out


def torch_optimizer(name, model, lr, weight_decay):
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "muon":  # no torch counterpart; its own steps are checked against the formula in test_muon.py
        return build_optimizer("muon", optimizer_param_groups("muon", [model], weight_decay), lr,
                               weight_decay=weight_decay, muon_fp32_matmul_prec="highest")
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def keep_forward_weights(params):
    """A `recompute_weights` provider: keeps `params`' values now (the forward's) and returns the factory of the
    context that installs them around a recomputation in the backward."""
    kept = [p.detach().clone() for p in params]

    @contextlib.contextmanager
    def installed():
        now = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.data.copy_(k)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, n in zip(params, now):
                    p.data.copy_(n)
    return installed


def hybrid_grad(model, names, w_forward, w_backward, kwargs, out_grad):
    """Parameter gradients of a forward run at `w_forward` whose backward finds `w_backward` in the
    parameter storage (what autograd computes when the weights are swapped between the two passes). Where
    they differ, the forward says so to what recomputes in the backward (the chunked output loss then keeps
    the forward's weights for its softmax instead of computing its gradients in the forward): a run whose
    policy claimed otherwise computes other gradients, and the comparison fails."""
    leaves = [w.clone().requires_grad_() for w in w_forward]
    changed = any(not torch.equal(a, b) for a, b in zip(w_forward, w_backward))
    with recompute_weights(keep_forward_weights if changed else None):
        out = torch.func.functional_call(model, dict(zip(names, leaves)), (), kwargs)
    with torch.no_grad():
        for leaf, w in zip(leaves, w_backward):
            leaf.data.copy_(w)
    grads = torch.autograd.grad(out, leaves, out_grad, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, w_forward)]


def close(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}, tensor {i}: {m}")


def replay(method, optimizer, weight_decay, rank, chunk_id, events, chunk0, spectrain=None, s_offset=0,
           include_weight_decay=False):
    """Check one (rank, chunk)'s recorded run against the method's formula; returns the number of
    checked forwards whose weights differ from the live ones (so tests can see the formula mattered)."""
    model = copy.deepcopy(chunk0)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    decay = [weight_decay if p.ndim > 1 else 0.0 for p in params]
    lr_fn = lr_fn_for(optimizer)
    opt = torch_optimizer(optimizer, model, lr_fn(0), weight_decay)
    history = [snapshot(params)]
    counts = step_counts(events)
    decoupled = optimizer in ("adamw", "muon")

    def predicted(t, s):
        """W_t - s·η·ΔW, with η·ΔW the last step's displacement (without decoupled decay)."""
        if t == 0 or s == 0:
            return history[t]
        lr = lr_fn(t - 1)
        out = []
        for w_prev, w, lam in zip(history[t - 1], history[t], decay):
            step = w_prev * (1 - lr * lam) - w if decoupled else w_prev - w
            shrink = (1 - s * lr * lam) if (decoupled and include_weight_decay) else 1.0
            out.append(w * shrink - s * step)
        return out

    def forward_weights_of(mb):
        t_f, t_b = counts[mb]
        if method in ("async-naive", "pipedream"):
            return history[t_f]
        if method == "pipedream-2bw":
            return history[max(t_b - 1, 0)]
        if method == "spectrain":
            return predicted(t_f, spectrain[mb][0])
        return predicted(t_f, t_b - t_f + s_offset)  # pipeoptim: s = s(j) + s_offset

    def backward_weights_of(mb):
        t_f, t_b = counts[mb]
        if method in ("async-naive", "pipeoptim"):
            return history[t_b]
        if method == "pipedream":
            return history[t_f]
        if method == "pipedream-2bw":
            return history[max(t_b - 1, 0)]
        return predicted(t_b, spectrain[mb][1])  # spectrain

    accumulated, forward_weights, inputs, num_predicted = None, {}, {}, 0
    for ev in events:
        if ev["kind"] == "F":
            mb = ev["mb"]
            w_f = forward_weights_of(mb)
            close(ev["weights"], w_f, f"rank {rank} chunk {chunk_id} forward weights of mb {mb}")
            num_predicted += any(not torch.equal(a, b) for a, b in zip(w_f, history[counts[mb][0]]))
            forward_weights[mb], inputs[mb] = w_f, ev["input"]
        elif ev["kind"] == "B":
            mb = ev["mb"]
            w_b = backward_weights_of(mb)
            close(ev["weights"], w_b, f"rank {rank} chunk {chunk_id} backward weights of mb {mb}")
            batch = get_batch(mb)
            kwargs = {"input_ids": batch["tokens"] if model.pre_process else None,
                      "hidden_states": inputs.pop(mb), "labels": batch["labels"] if model.post_process else None}
            if getattr(model, "reads_batch", False):  # as the executor calls it (an MTP block reads the tokens)
                kwargs = {"input_ids": batch, "hidden_states": kwargs["hidden_states"]}
            grad = hybrid_grad(model, names, forward_weights.pop(mb), w_b, kwargs, ev["out_grad"])
            close(ev["grad"], grad, f"rank {rank} chunk {chunk_id} gradient of mb {mb}")
            accumulated = grad if accumulated is None else [a + g for a, g in zip(accumulated, grad)]
        else:
            t = len(history) - 1
            with torch.no_grad():
                for p, w, g in zip(params, history[t], accumulated):
                    p.copy_(w)
                    p.grad = g
            for group in opt.param_groups:
                group["lr"] = lr_fn(t)
            opt.step()
            accumulated = None
            history.append(snapshot(params))
            close(ev["weights"], history[-1], f"rank {rank} chunk {chunk_id} weights after step {t + 1}")
    return num_predicted


# --------------------------------------------------------------------------------------------------
# The formulas
# --------------------------------------------------------------------------------------------------

CASES = [
    # method, optimizer, D, v, k, segments (micro-batches each), policy options
    ("async-naive", "adam", 4, 1, 1, (8, 8), {}),
    ("async-naive", "sgd", 3, 2, 1, (6, 6), {}),
    ("pipedream", "adam", 4, 1, 1, (8, 8), {}),
    ("pipedream", "sgd", 4, 1, 2, (8, 8), {}),
    ("pipedream", "adam", 3, 2, 1, (6, 6), {}),
    ("pipedream-2bw", "adam", 4, 1, 4, (8, 8), {}),
    ("pipedream-2bw", "sgd", 2, 2, 2, (8, 4), {}),
    ("spectrain", "sgd", 4, 1, 1, (8, 8), {}),
    ("spectrain", "sgd", 2, 2, 1, (8, 4), {}),
    ("pipeoptim", "adam", 4, 1, 1, (8, 8), {}),
    ("pipeoptim", "sgd", 4, 1, 1, (8, 8), {"s_offset": 1}),
    ("pipeoptim", "adam", 3, 2, 1, (6, 6), {}),
    ("pipeoptim", "adamw", 4, 1, 2, (8, 8), {"include_weight_decay": True}),
    ("pipeoptim", "adamw", 3, 2, 1, (6, 6), {}),
    ("pipeoptim", "muon", 4, 1, 1, (8, 8), {"include_weight_decay": True}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,options", CASES,
                         ids=[f"{c[0]}-{c[1]}-D{c[2]}v{c[3]}k{c[4]}{'-' + str(c[6]) if c[6] else ''}"
                              for c in CASES])
def test_updates_follow_the_method_formula(method, optimizer, D, v, k, segments, options):
    torch.set_num_threads(1)
    weight_decay = 0.1 if optimizer in ("adamw", "muon") else 0.01  # large enough that extrapolating it shows
    emu = emulator(method, D, v, k, optimizer, weight_decay, **options)
    recorders, initial = record(emu)
    spectrain = {}
    for m in segments:
        if method == "spectrain":
            for key, per_mb in spectrain_staleness(segment_schedule(D, v, m, k, emu.microbatches_consumed)).items():
                spectrain.setdefault(key, {}).update(per_mb)
        emu.train_segment(get_batch, m)
    total_predicted = 0
    for r in range(D):
        for c in range(v):
            total_predicted += replay(method, optimizer, weight_decay, r, c, recorders[r].events[c], initial[(r, c)],
                                      spectrain.get((r, c)), options.get("s_offset", 0),
                                      options.get("include_weight_decay", False))
    steps = emu.steps_taken()
    assert all(n == sum(segments) // k for n in steps.values()), steps
    if method in ("spectrain", "pipeoptim"):
        assert total_predicted > 0, "no forward ran on predicted weights: the check proved nothing"


def test_replay_rejects_a_wrong_staleness():
    """Negative control: a PipeOptim run checked against the formula with s+1 must fail."""
    torch.set_num_threads(1)
    emu = emulator("pipeoptim", 4, 1, 1)
    recorders, initial = record(emu)
    emu.train_segment(get_batch, 8)
    with pytest.raises(AssertionError, match="forward weights"):
        replay("pipeoptim", "adam", 0.01, 0, 0, recorders[0].events[0], initial[(0, 0)], s_offset=1)


# --------------------------------------------------------------------------------------------------
# Staleness ingredients, memory, safety
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [2, 3, 4, 5, 8])
def test_spectrain_staleness_from_schedule_equals_paper_in_steady_state(D):
    M = 4 * D
    table = spectrain_staleness(async_one_f_one_b(D, 1, M))
    s = staleness(async_one_f_one_b(D, 1, M))
    for r in range(D):
        for mb in range(D, M - D):  # steady state: after warm-up, before the drain
            assert table[(r, 0)][mb] == (r // 2 + D - r - 1, r // 2), (r, mb, table[(r, 0)][mb])
            assert table[(r, 0)][mb][0] - table[(r, 0)][mb][1] == s[(r, 0)][mb]


def test_weight_copies_per_chunk():
    torch.set_num_threads(1)
    D = 4
    copies = {}
    for method, optimizer, k in [("async-naive", "adam", 1), ("pipedream", "adam", 1), ("pipedream-2bw", "adam", 4),
                                 ("spectrain", "sgd", 1), ("pipeoptim", "adam", 1), ("pipeoptim", "adam", 2)]:
        emu = emulator(method, D, 1, k, optimizer)
        emu.train_segment(get_batch, 12)
        copies[(method, k)] = [emu.copies_per_chunk()[(r, 0)] for r in range(D)]
    assert copies[("async-naive", 1)] == [1, 1, 1, 1]
    assert copies[("pipedream", 1)] == [D - r for r in range(D)]  # s_max + 1 = D - r
    assert copies[("pipedream-2bw", 4)] == [2, 2, 2, 2]
    assert copies[("spectrain", 1)] == [2, 2, 2, 2]  # the last stage predicts s_f = ⌊3/2⌋ = 1 too
    assert copies[("pipeoptim", 1)] == [2, 2, 2, 1]  # live + one cache; the last stage has s = 0
    assert max(copies[("pipeoptim", 2)]) <= 2


def test_interleaved_pipedream_copies_are_max_staleness_plus_one():
    torch.set_num_threads(1)
    emu = emulator("pipedream", 3, 2, 1)
    emu.train_segment(get_batch, 6)
    s = staleness(async_one_f_one_b(3, 2, 6))
    for key, n in emu.copies_per_chunk().items():
        assert n <= max(s[key].values()) + 1, (key, n)


class BumpingPolicy(WeightPolicy):
    """Writes the weights in place WITHOUT going through .data: bumps the autograd version counters."""

    def __init__(self, chunks):
        self.chunks = chunks

    def use_schedule(self, schedule):
        pass

    def before_forward(self, mb, c):
        with torch.no_grad():
            for p in self.chunks[c].parameters():
                p.mul_(1.0)


def test_in_place_writes_that_bump_versions_break_in_flight_backwards():
    """The hazard the policies avoid is real with D >= 3 (several micro-batches in flight): the same
    stream with a policy that writes through the parameters (not .data) fails, ours (all the runs
    above, D = 3 and 4) do not."""
    torch.set_num_threads(1)
    emu = emulator("async-naive", 3, 1, 1)
    for s in emu.stages:
        s.policy = BumpingPolicy(s.chunks)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        emu.train_segment(get_batch, 6)


def test_pipeoptim_predicts_only_with_state_and_with_s_plus_offset():
    torch.set_num_threads(1)
    for s_offset in (0, 1):
        emu = emulator("pipeoptim", 4, 1, 1, s_offset=s_offset)
        calls = {r: [] for r in range(4)}
        for st in emu.stages:
            opt = st.optimizers[0]
            # The policy predicts out of place (`predicted`, pointer swaps) for these chunks; spy on both.
            for name in ("predict", "predicted"):
                original = getattr(opt, name)

                def spy(steps, include_weight_decay=False, opt=opt, original=original, r=st.rank, **kw):
                    assert opt.has_state(), "predicted before the first step"
                    calls[r].append(steps)
                    return original(steps, include_weight_decay=include_weight_decay, **kw)
                setattr(opt, name, spy)
            # ...and the predictions a step writes (fused_steps.py), planned before it: the step creates the
            # state before it writes them.
            original_plan = opt.plan_prediction

            def plan(*requests, original=original_plan, r=st.rank):
                calls[r].extend(request.steps for request in requests)
                return original(*requests)
            opt.plan_prediction = plan
        recorders, initial = record(emu)
        emu.train_segment(get_batch, 10)
        s = staleness(async_one_f_one_b(4, 1, 10))
        for r in range(4):
            events = recorders[r].events[0]
            counts = step_counts(events)
            expected = [s[(r, 0)][mb] + s_offset for mb in sorted(counts)
                        if counts[mb][0] >= 1 and s[(r, 0)][mb] + s_offset > 0]
            assert calls[r] == expected, (r, calls[r], expected)
            # forwards before the chunk's first step ran on exactly the initial weights
            w0 = [p.detach() for p in initial[(r, 0)].parameters()]
            for ev in events:
                if ev["kind"] == "F" and counts[ev["mb"]][0] == 0:
                    assert all(torch.equal(a, b) for a, b in zip(ev["weights"], w0))
        assert calls[0] and (s_offset == 0) == (calls[3] == [])


def test_evaluation_runs_on_live_weights_without_policy():
    torch.set_num_threads(1)
    emu = emulator("pipeoptim", 4, 1, 1)
    emu.train_segment(get_batch, 8)
    before = emu.full_state_dict()
    batches = [get_batch(i, salt=7) for i in range(3)]
    loss = emu.evaluate(batches)
    after = emu.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    full = GPTModel(make_cfg(4).model, VOCAB, SEED)
    full.load_state_dict(before, strict=True)
    with torch.no_grad():
        ref = torch.stack([masked_mean_loss(full(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
                           for b in batches]).mean().item()
    assert math.isclose(loss, ref, rel_tol=1e-6), (loss, ref)


def test_forward_only_runner_never_calls_the_policy():
    class Exploding(WeightPolicy):
        def before_forward(self, mb, c):
            raise AssertionError("policy called during evaluation")
        after_forward = before_forward

    chunks = build_chunks_for_rank(make_cfg(1), VOCAB, 0, 1, 1)
    runner = StageRunner(rank=0, num_stages=1, chunks=chunks, transport=Mailbox(), get_batch=get_batch,
                         policy=Exploding(), forward_only=True)
    runner.forward(0, 0)
    assert 0 in runner.losses


# --------------------------------------------------------------------------------------------------
# Bad combinations
# --------------------------------------------------------------------------------------------------


def test_bad_combinations_raise_config_error():
    with pytest.raises(ConfigError, match="SGD with momentum"):
        emulator("spectrain", 4, 1, 1, "adam")
    with pytest.raises(ConfigError, match="SGD with momentum"):
        AsyncEmulator(make_cfg(4), VOCAB, "spectrain", 4, 1, 1, "sgd", {"lr": 0.1, "sgd_momentum": 0.0})
    with pytest.raises(ConfigError, match="SGD with momentum"):
        AsyncEmulator(make_cfg(4), VOCAB, "spectrain", 4, 1, 1, "nesterov", {"lr": 0.1})
    with pytest.raises(ConfigError, match="m=2 < D=4"):
        emulator("pipedream-2bw", 4, 1, 2)
    with pytest.raises(ConfigError, match="staleness 2"):  # interleaved: m = D is not enough here
        emulator("pipedream-2bw", 3, 2, 3)
    with pytest.raises(ConfigError, match="untie-embeddings-and-output-weights"):
        AsyncEmulator(make_cfg(4, tied=True), VOCAB, "pipeoptim", 4, 1, 1, "adam", {"lr": 1e-3})
    with pytest.raises(ConfigError, match="untie-embeddings-and-output-weights"):
        tied = build_chunks_for_rank(make_cfg(2, tied=True), VOCAB, 0, 1, 1)
        build_policy("pipeoptim", 0, tied, [None], async_one_f_one_b(1, 1, 2))
    with pytest.raises(ConfigError, match="unknown asynchronous pipeline method"):
        emulator("gpipe", 4, 1, 1)
    with pytest.raises(ConfigError, match="unknown asynchronous pipeline method"):
        build_policy("pipedream-flush", 0, [], [], None)
    with pytest.raises(ConfigError, match="s_offset do not apply to pipedream"):
        emulator("pipedream", 4, 1, 1, s_offset=1)
    with pytest.raises(ConfigError, match="s_offset must be"):
        emulator("pipeoptim", 4, 1, 1, s_offset=-1)
    emu = emulator("pipeoptim", 4, 1, 2)
    with pytest.raises(ConfigError, match="multiple of k"):
        emu.train_segment(get_batch, 7)


def test_policy_options_reach_the_policy():
    emu = emulator("pipeoptim", 2, 1, 1, s_offset=1, include_weight_decay=True)
    policy = emu.stages[0].policy
    assert isinstance(policy, PipeOptimPolicy) and policy.s_offset == 1 and policy.include_weight_decay


# ---- pointer swaps vs copies -------------------------------------------------------------------------

def _llama_style(cfg):
    cfg.model.normalization, cfg.model.swiglu, cfg.model.position_embedding_type = "RMSNorm", True, "rope"
    return cfg


@pytest.mark.parametrize("method,optimizer,style,v", [("pipeoptim", "adam", "gpt2", 1),
                                                      ("pipeoptim", "adamw", "llama", 2),
                                                      ("spectrain", "sgd", "gpt2", 1)])
def test_pointer_swaps_equal_copies_bit_for_bit(method, optimizer, style, v):
    """The predicting policies point the parameters at Ŵ for a pass and back after it (our layers save the
    parameters themselves for the backward); the copy-based fallback writes Ŵ in place and copies the live
    weights back. Both must give the same losses and weights bit for bit, with several micro-batches in
    flight (D=4), so the backwards of the swapping run read the live weights, never Ŵ."""
    torch.set_num_threads(1)
    results = []
    for swaps in (True, False):
        torch.manual_seed(0)
        cfg = make_cfg(4 * v)
        if style == "llama":
            _llama_style(cfg)
        kwargs = {"lr": LR[optimizer], "weight_decay": 0.01, "sgd_momentum": 0.9}
        emu = AsyncEmulator(cfg, VOCAB, method, 4, v, 1, optimizer, kwargs, lr_fn_for(optimizer), 0.0)
        for st in emu.stages:
            assert st.policy.swaps == [True] * v  # every module of our GPT chunks is known to allow it
            st.policy.swaps = [swaps] * v
        losses = emu.train_segment(get_batch, 8) + emu.train_segment(get_batch, 8)
        copies = {st.rank: st.policy.copies_per_chunk() for st in emu.stages}
        results.append((losses, emu.full_state_dict(), copies))
    (losses_swap, weights_swap, copies_swap), (losses_copy, weights_copy, copies_copy) = results
    assert losses_swap == losses_copy
    assert weights_swap.keys() == weights_copy.keys()
    assert all(torch.equal(weights_swap[k], weights_copy[k]) for k in weights_swap)
    assert copies_swap == copies_copy  # live + Ŵ while predicted, on every rank that predicts
    assert copies_swap[0] == {c: 2 for c in range(v)}


def test_unknown_modules_fall_back_to_copies():
    """A module whose autograd may save views or casts of its weights (F.linear saves weight.t(), Transformer
    Engine keeps its own copies) makes the chunk use the copy-based prediction."""
    from megatron_po.pipeline.predicting_policies import _backward_reads_parameters
    cfg = make_cfg(2)
    chunk = build_chunks_for_rank(cfg, VOCAB, 0, 2, 1)[0]
    assert _backward_reads_parameters(chunk)
    chunk.extra = torch.nn.Linear(4, 4)
    assert not _backward_reads_parameters(chunk)
    from megatron_po.optim import Adam
    policy = PipeOptimPolicy(0, [chunk], [Adam(chunk.parameters(), lr=1e-3)], None)
    assert policy.swaps == [False]
