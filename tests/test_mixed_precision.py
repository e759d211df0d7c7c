"""Mixed precision: bf16/fp16 model weights, fp32 main params, fp32 grad accumulation, loss scaling,
skipped non-finite steps and copy-free PipeOptim prediction.

Tolerances:
- bf16 vs fp32 training of the tiny GPT (AdamW, 30 steps, 2 micro-batches, clip 1.0): every step's loss
  within 0.02 absolute (measured ~0.006), and the loss falls by > 1.0 in both.
- fp32 gradient accumulation in the DDP buffer: equal to the fp32 sum of the bf16 per-micro-batch
  gradients (rtol=0, atol=0: the same additions in the same order).
- prediction into bf16: bitwise equal to the fp32 prediction rounded once to bf16.
"""

import copy
import dataclasses

import pytest
import torch
from dist_harness import run_distributed
from test_gpt_parallel import CONFIGS, SEED, VOCAB, make_batch

from megatron_po import parallel_state as ps
from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.distributed.ddp import DistributedDataParallel
from megatron_po.errors import ConfigError
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.optim import build_optimizer
from megatron_po.optim.clip_grads import clip_grad_norm_
from megatron_po.optim.memory import measure_training_memory, track_new_tensor_bytes
from megatron_po.optim.mixed_precision import (ConstantGradScaler, DynamicGradScaler, MixedPrecisionOptimizer,
                                               build_grad_scaler)


def adamw(groups):
    return build_optimizer("adamw", groups, lr=3e-3, weight_decay=0.01)


def loss_of(model, batch):
    return masked_mean_loss(model(input_ids=batch["tokens"], labels=batch["labels"]), batch["loss_mask"])


def train(dtype, steps, grad_scaler=None, accumulate_in_fp32=True, inject_inf_at=(), window_batches=8):
    """Tiny GPT, 2 micro-batches per step. fp32 uses the plain optimizer (the reference); bf16/fp16 the
    mixed-precision wrapper. Returns per-step (loss, skipped, loss scale after the step, params changed)."""
    torch.manual_seed(0)
    model = GPTModel(CONFIGS["gpt2"], VOCAB, SEED).to(dtype)
    ddp = DistributedDataParallel([model], None, grad_dtype=torch.float32 if accumulate_in_fp32 else dtype)
    params = list(model.parameters())
    mixed = dtype != torch.float32
    opt = MixedPrecisionOptimizer(adamw, params, grad_scaler=grad_scaler, clip_grad=1.0) if mixed else adamw(params)
    history = []
    for step in range(steps):
        before = [p.detach().clone() for p in params]
        ddp.zero_grad()
        total = 0.0
        for m in range(2):
            loss = loss_of(model, make_batch(n=4, seed=(2 * step + m) % window_batches)) / 2
            (opt.scale_loss(loss) if mixed else loss).backward()
            total += loss.item()
        ddp.finish_grad_sync()
        if step in inject_inf_at:
            params[3].main_grad.view(-1)[5] = float("inf")
        if mixed:
            result = opt.step()
            skipped, scale = result.skipped, opt.get_loss_scale()
        else:
            clip_grad_norm_(ddp.params, 1.0)
            opt.step()
            skipped, scale = False, 1.0
        moved = any(not torch.equal(b, p) for b, p in zip(before, params))
        history.append((total, skipped, scale, moved))
    return history


# ---- flags ---------------------------------------------------------------------------------------

def validate_precision_flags(**flags):
    """config_rules.validate on a mock-data config with these precision flags."""
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    cfg.precision = dataclasses.replace(cfg.precision, **flags)
    validate(cfg, 1)


@pytest.mark.parametrize("flags,message", [
    (dict(bf16=True, fp16=True), "--fp16 and --bf16"),
    (dict(bf16=True, loss_scale=1024.0), "--loss-scale"),
    (dict(fp16=True, loss_scale=0.0), "--loss-scale"),
    (dict(fp16=True, min_loss_scale=2.0**40), "--min-loss-scale"),
    (dict(fp16=True, hysteresis=0), "--hysteresis"),
    (dict(fp16=True, loss_scale_window=0), "--loss-scale-window"),
    (dict(bf16=True, overlap_param_gather=True), "--overlap-param-gather"),
])
def test_bad_precision_flags_raise_one_line_config_error(flags, message):
    with pytest.raises(ConfigError) as e:
        validate_precision_flags(**flags)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_precision_flags_pass():
    validate_precision_flags(bf16=True, accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=True,
                             overlap_param_gather=True)
    validate_precision_flags(fp16=True, loss_scale=4096.0)
    assert build_grad_scaler(fp16=False) is None
    assert isinstance(build_grad_scaler(fp16=True, loss_scale=8.0), ConstantGradScaler)
    dynamic = build_grad_scaler(fp16=True)
    assert isinstance(dynamic, DynamicGradScaler)
    assert (dynamic.scale, dynamic.min_scale, dynamic.growth_interval, dynamic.hysteresis) == (2.0**32, 1.0, 1000, 2)


# ---- loss scaler rules ---------------------------------------------------------------------------

def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    s = DynamicGradScaler(initial_scale=64.0, min_scale=4.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0  # first non-finite step: absorbed by hysteresis
    s.update(True)
    assert s.scale == 32.0  # second: back off
    s.update(True)
    assert s.scale == 16.0  # the counter is not refilled by clean steps, only by growth
    s.update(False), s.update(False)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0 and s.hysteresis_tracker == 2  # 3 clean steps in a row: grow, refill hysteresis
    s.update(False), s.update(True), s.update(False), s.update(False)
    assert s.scale == 32.0  # an inf resets the growth window (and uses one unit of hysteresis)
    s.update(True)
    assert s.scale == 16.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 4.0  # never below min_scale
    state = s.state_dict()
    t = DynamicGradScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state


# ---- training ------------------------------------------------------------------------------------

def test_bf16_training_tracks_fp32_loss_curve():
    torch.set_num_threads(1)
    ref = train(torch.float32, 30)
    for accumulate_in_fp32 in (True, False):
        run = train(torch.bfloat16, 30, accumulate_in_fp32=accumulate_in_fp32)
        worst = max(abs(a[0] - b[0]) for a, b in zip(ref, run))
        assert worst < 0.02, f"bf16 (fp32 grads={accumulate_in_fp32}) departs from fp32 by {worst}"
        assert not any(h[1] for h in run)
    assert ref[0][0] - ref[-1][0] > 1.0 and run[0][0] - run[-1][0] > 1.0


def megatron_loss_scales(skipped, scale, window, hysteresis, min_scale=1.0):
    """Megatron's DynamicGradScaler.update restated: the scale after each step, given which were skipped."""
    growth, left, out = 0, hysteresis, []
    for skip in skipped:
        if skip:
            growth, left = 0, left - 1
            if left <= 0:
                scale = max(scale / 2, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, left, scale = 0, hysteresis, scale * 2
        out.append(scale)
    return out


def test_fp16_dynamic_scaling_skips_inf_steps_backs_off_and_recovers():
    torch.set_num_threads(1)
    scaler = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0, growth_interval=4, hysteresis=2)
    history = train(torch.float16, 34, grad_scaler=scaler, inject_inf_at=(26, 27))
    losses, skipped, scales, _ = map(list, zip(*history))
    # A step is skipped exactly when nothing moves; the injected infs are skipped.
    assert all(moved != skip for _, skip, _, moved in history)
    assert skipped[26] and skipped[27]
    # 2**32 overflows fp16 gradients: step 0 is skipped but hysteresis keeps the scale; every further
    # overflow halves it (the counter refills only on growth) until the gradients fit.
    first_ok = skipped.index(False)
    assert skipped[0] and scales[0] == 2.0**32 and 5 < first_ok < 25
    assert scales[first_ok - 1] == 2.0**32 / 2 ** (first_ok - 1)
    # The whole trajectory follows Megatron's rules (window 4, hysteresis 2), and it exercised growth,
    # a skip absorbed by refilled hysteresis, and back-offs after growth.
    assert scales == megatron_loss_scales(skipped, 2.0**32, window=4, hysteresis=2)
    grew = [i for i in range(1, 34) if scales[i] > scales[i - 1]]
    absorbed = [i for i in range(first_ok, 34) if skipped[i] and scales[i] == scales[i - 1]]
    assert grew and absorbed and absorbed[0] > grew[0]
    # Training recovers: the loss falls after the skipped phase and after the injected infs.
    assert losses[-1] < losses[first_ok] - 0.5


def test_constant_loss_scale_skips_without_changing_scale():
    torch.set_num_threads(1)
    history = train(torch.float16, 4, grad_scaler=ConstantGradScaler(1024.0), inject_inf_at=(1,))
    assert [h[1] for h in history] == [False, True, False, False]
    assert {h[2] for h in history} == {1024.0}


def test_fp32_grad_accumulation_adds_bf16_grads_into_fp32_buffer():
    model = GPTModel(CONFIGS["gpt2"], VOCAB, SEED).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel([model], None, grad_dtype=torch.float32)
    assert ddp.grad_buffer.dtype == torch.float32 and all(p.grad is None for p in model.parameters())
    batches = [make_batch(n=2, seed=s) for s in range(3)]
    ddp.zero_grad()
    with ddp.no_sync():
        for b in batches:
            loss_of(model, b).backward()
    expected = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in ref.named_parameters()}
    for b in batches:
        ref.zero_grad(set_to_none=True)
        loss_of(ref, b).backward()
        for n, p in ref.named_parameters():
            expected[n] += p.grad.float()
    for n, p in model.named_parameters():
        assert p.grad is None, "the bf16 grad is freed once added into main_grad"
        torch.testing.assert_close(p.main_grad, expected[n], rtol=0, atol=0, msg=n)


# ---- found-inf agreement over the model-parallel group -------------------------------------------

def _found_inf_agreed():
    torch.manual_seed(0)  # same weights on both ranks (they stand in for two TP ranks)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(adamw, list(layer.parameters()),
                                  model_parallel_group=ps.get_model_parallel_group())
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    if ps.get_tensor_model_parallel_rank() == 0:
        layer.weight.grad[0, 0] = float("nan")  # only this rank sees it
    result = opt.step()
    unchanged = all(torch.equal(b, p) for b, p in zip(before, layer.parameters()))
    return result.skipped, result.found_inf, unchanged


def test_found_inf_is_agreed_over_the_model_parallel_group():
    for skipped, found_inf, unchanged in run_distributed(_found_inf_agreed, 2, tp=2):
        assert skipped and found_inf and unchanged


# ---- prediction: fp32 main params are the cache ---------------------------------------------------

def _trained_bf16(steps=3, num_layers=2):
    cfg = dataclasses.replace(CONFIGS["gpt2"], num_layers=num_layers)
    model = GPTModel(cfg, VOCAB, SEED).to(torch.bfloat16)
    ddp = DistributedDataParallel([model], None, grad_dtype=torch.float32)
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    opt = MixedPrecisionOptimizer(adamw, groups, predict_chunk_numel=4096)
    assert not opt.has_state()
    for step in range(steps):
        ddp.zero_grad()
        loss_of(model, make_batch(n=4, seed=step)).backward()
        ddp.finish_grad_sync()
        assert not opt.step().skipped
    return model, ddp, opt


def test_bf16_prediction_is_fp32_prediction_rounded_once_and_restore_is_exact():
    model, _, opt = _trained_bf16()
    params = list(model.parameters())
    live = [p.detach().clone() for p in params]
    # Reference: the inner optimizer's own fused predict, out= fp32 copies, rounded once to bf16.
    fp32_out = [[m.detach().clone() for m in g["params"]] for g in opt.param_groups]
    opt.optimizer.predict([3.0, 1.0], include_weight_decay=True, out=fp32_out)
    expected = {id(p): t.to(torch.bfloat16) for g, out in zip(opt.model_groups, fp32_out) for p, t in zip(g, out)}

    opt.predict_model_params([3.0, 1.0], include_weight_decay=True)
    assert any(not torch.equal(p, w) for p, w in zip(params, live))
    for p in params:
        assert torch.equal(p, expected[id(p)])
    opt.restore_model_params()
    for p, w in zip(params, live):
        assert torch.equal(p, w)
    # update_direction is the fp32 ΔW of the main params, aligned with the model's groups.
    directions = opt.update_direction()
    assert [len(r) for r in directions] == [len(g) for g in opt.model_groups]
    assert all(d.dtype == torch.float32 and d.shape == p.shape
               for row, g in zip(directions, opt.model_groups) for d, p in zip(row, g))


def test_prediction_allocates_no_full_size_weight_copy():
    model, ddp, opt = _trained_bf16(num_layers=6)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    before = measure_training_memory(params, ddp, opt)
    with track_new_tensor_bytes() as tracked:
        opt.predict_model_params(2.0)
        opt.restore_model_params()
    after = measure_training_memory(params, ddp, opt)
    assert after == before, "predict + restore must not leave new buffers behind"
    assert tracked.live == 0
    # Temporaries: two fp32 tensors (Ŵ before rounding, Adam's denominator) of one prediction chunk
    # (4096 elements, or the largest parameter), under half of even a bf16 copy of the weights (2 bytes
    # per parameter), which is what a policy-held cache would cost.
    assert 0 < tracked.peak <= 2 * 4 * max(4096, largest), tracked.peak
    assert tracked.peak < 0.5 * 2 * n, (tracked.peak, n)
    # Per parameter: bf16 weights (2) + fp32 grads (4) + fp32 main params (4) + Adam (8) = 18, Megatron's.
    per = before.per_param()
    assert (per["params"], per["grads"], per["main_params"]) == (2.0, 4.0, 4.0)
    assert 8.0 <= per["optimizer_state"] < 8.01  # + 4-byte step counters
    assert 18.0 <= per["total"] < 18.01


def test_state_dict_round_trip_and_param_keyed_state():
    model, ddp, opt = _trained_bf16(2)
    saved = copy.deepcopy(opt.state_dict())
    assert all(t.dtype == torch.float32 for t in saved["main_params"])
    assert set(opt.state[next(model.parameters())]) == {"step", "exp_avg", "exp_avg_sq"}

    def more_steps(model, ddp, opt):
        for step in range(2, 4):
            ddp.zero_grad()
            loss_of(model, make_batch(n=4, seed=step)).backward()
            ddp.finish_grad_sync()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    expected = more_steps(model, ddp, opt)
    fresh = GPTModel(CONFIGS["gpt2"], VOCAB, SEED + 1).to(torch.bfloat16)  # other weights: all come from the state
    fresh_ddp = DistributedDataParallel([fresh], None, grad_dtype=torch.float32)
    groups = [{"params": [p for p in fresh.parameters() if p.ndim > 1], "weight_decay": 0.01},
              {"params": [p for p in fresh.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    fresh_opt = MixedPrecisionOptimizer(adamw, groups)
    fresh_opt.load_state_dict(saved)
    for a, b in zip(more_steps(fresh, fresh_ddp, fresh_opt), expected):
        assert torch.equal(a, b)


def test_inner_optimizer_must_be_predictive():
    with pytest.raises(TypeError):
        MixedPrecisionOptimizer(lambda g: torch.optim.SGD(g, lr=0.1), [torch.nn.Parameter(torch.zeros(2))])
