"""Muon's Newton-Schulz (optim/newton_schulz.py) and its use by the step: bf16 vs fp32, the coefficient sets,
batched = unbatched, and the fused QKV weight orthogonalised as three matrices (TP=1, TP=2 and the TP modes).

Bounds (random Gaussian matrices with aspect ratio >= 3, whose singular values after the Frobenius
normalisation are not tiny; a square one has some near 0, which no 5-step iteration lifts):
- "simple" (Keller Jordan's quintic, 5 steps): singular values of O in [0.67, 1.15], fp32 and bf16 (the
  iteration's known band, ~[0.68, 1.14] measured); "quintic" (5 steps) in [0.97, 1.04]; "polar_express"
  (8 steps) in [0.99, 1.01].
- bf16 vs fp32: ‖O_bf16 - O_fp32‖_F / ‖O_fp32‖_F < 0.03 (measured up to 0.018: bf16 keeps 8 significant bits).
- batched = unbatched: bitwise on this CPU (a stacked matmul runs the same kernel per matrix).
- split QKV vs a reference written from the formula: rtol 1e-5, atol 1e-6 (fp32; foreach vs per tensor).
- TP=2 vs TP=1, duplicated and distributed modes: rtol 1e-4, atol 1e-6 (fp32; distributed sums the Gram
  matrices over TP ranks, another rounding).
- Gram Newton-Schulz (opt-in, `--muon-gram-newton-schulz`) vs the standard iteration, the same coefficients:
  ‖O_gram - O‖_F / ‖O‖_F < 1e-3 in fp32 (measured ~1e-5 here, 1.5e-4 at GPT-1.3B's shapes: the product Q's
  rounding); in bf16 < 0.08 from the fp32 iteration (measured 0.03-0.06 here, where the standard bf16 iteration
  is 0.011-0.018 away: the product Q of the step polynomials, whose gains range over 1/σ_min, holds fewer
  significant bits of the small singular directions in bf16), about as orthogonal: its singular values in the
  iteration's band above widened by 0.01 (quintic: 0.968 measured, the band's 0.97); a matrix less than GRAM_MIN_ASPECT times wider than tall
  runs the standard iteration (bitwise); the default Muon does not use it (bitwise the step without the flag).
"""

import math

import pytest
import torch
from dist_harness import run_distributed
from test_gpt_parallel import CONFIGS

from megatron_po import parallel_state as ps
from megatron_po.errors import ConfigError
from megatron_po.optim import build_optimizer
from megatron_po.optim.muon import Muon, muon_scale, optimizer_param_groups
from megatron_po.optim.newton_schulz import (GRAM_MIN_ASPECT, coefficients, gram_newton_schulz_flops, newton_schulz,
                                             newton_schulz_flops)

LR, WD = 0.02, 0.1
SHAPES = [(32, 96), (96, 32), (48, 200)]
BANDS = {("simple", 5): (0.67, 1.15), ("quintic", 5): (0.97, 1.04), ("polar_express", 8): (0.99, 1.01)}


def ref_orthogonalise(u, coefficient_sets):
    """From the formula, per matrix, fp32: X = U/‖U‖_F (transposed if tall), X ← aX + (bA + cA²)X, A = XXᵀ."""
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for a, b, c in coefficient_sets:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("kind,steps", list(BANDS))
def test_bf16_newton_schulz_vs_fp32(kind, steps):
    torch.manual_seed(0)
    low, high = BANDS[(kind, steps)]
    for shape in SHAPES:
        u = torch.randn(4, *shape)
        o32 = newton_schulz(u, steps, kind, "highest")
        o16 = newton_schulz(u, steps, kind, "medium")
        assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16 and o16.shape == u.shape
        for o in (o32, o16.float()):
            s = torch.linalg.svdvals(o)
            assert low <= s.min() and s.max() <= high, (shape, s.min(), s.max())
        deviation = (o16.float() - o32).norm(dim=(-2, -1)) / o32.norm(dim=(-2, -1))
        assert deviation.max() < 0.03, deviation
        for i in range(4):  # the batched fp32 iteration is the formula, matrix by matrix
            torch.testing.assert_close(o32[i], ref_orthogonalise(u[i], coefficients(kind, steps)), rtol=1e-5,
                                       atol=1e-6)
    # on a CPU there are no TF32 matmuls: "high" is fp32 here (on a GPU it is TF32, ~10 bits)
    assert torch.equal(newton_schulz(u, 5, "simple", "high"), newton_schulz(u, 5, "simple", "highest"))
    assert torch.equal(newton_schulz(u, 5, "simple", "low"), newton_schulz(u, 5, "simple", "highest"))


def test_batched_equals_unbatched_bitwise():
    torch.manual_seed(1)
    for precision in ("highest", "medium"):
        u = torch.randn(5, 24, 72)
        stacked = newton_schulz(u, 5, "simple", precision)
        for i in range(5):
            assert torch.equal(stacked[i], newton_schulz(u[i], 5, "simple", precision))
            assert torch.equal(stacked[i], newton_schulz(u[i:i + 1], 5, "simple", precision)[0])


def test_coefficient_rules_and_flops():
    assert coefficients("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    assert len(coefficients("quintic", 10)) == 10 and coefficients("quintic", 10)[5] == coefficients("quintic", 5)[0]
    assert coefficients("polar_express", 10)[8:] == [coefficients("polar_express", 8)[-1]] * 2
    with pytest.raises(ValueError, match="multiple of 5"):
        coefficients("quintic", 4)
    with pytest.raises(ValueError, match="at least 8"):
        coefficients("polar_express", 5)
    with pytest.raises(ValueError, match="coefficient type"):
        coefficients("cubic", 5)
    assert newton_schulz_flops(2048, 6144, 5) == newton_schulz_flops(6144, 2048, 5) == 5 * (4 * 2048**2 * 6144 +
                                                                                         2 * 2048**3)


def test_bad_settings_raise_one_line():
    model = torch.nn.Linear(4, 4)
    groups = [{"params": [model.weight], "use_muon": True}]
    for kwargs, match in [({"muon_fp32_matmul_prec": "bf16"}, "matmul precision"),
                          ({"muon_tp_mode": "gathered"}, "TP mode"),
                          ({"muon_coefficient_type": "polar_express"}, "at least 8 steps"),
                          ({"muon_coefficient_type": "quintic", "muon_num_ns_steps": 3}, "multiple of 5")]:
        with pytest.raises(ConfigError, match=match):
            build_optimizer("muon", groups, lr=LR, **kwargs)


def test_muon_step_batched_equals_unbatched():
    """The optimizer's grouping by shape changes no bit of the step (bf16, the default precision)."""
    from megatron_po.models.gpt import GPTModel
    torch.manual_seed(0)
    runs = []
    for batched in (True, False):
        model = GPTModel(CONFIGS["llama-gqa"], 64, 3)
        opt = build_optimizer("muon", optimizer_param_groups("muon", [model], WD), lr=LR, weight_decay=WD)
        opt.batch_newton_schulz = batched
        for step in range(1):
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---- fused QKV: Q, K and V orthogonalised and scaled separately ------------------------------------

def _attention(tp_mode="duplicated", split=True, steps=2):
    """A GQA self-attention (8 heads, 4 key/value groups, head dim 12) at this rank's TP size, one Muon
    step per gradient (fp32 Newton-Schulz); the full weights and gradients are drawn identically on every
    rank and each rank takes its TP slice. Returns (full initial qkv, full qkv grads, this rank's qkv after)."""
    from megatron_po.models.transformer import SelfAttention
    cfg = CONFIGS["llama-gqa"]
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    attn = SelfAttention(cfg, sequence_parallel=False)
    rows = attn.qkv.weight.shape[0] * tp
    gen = torch.Generator().manual_seed(7)
    full = {"qkv": torch.randn(rows, 64, generator=gen), "proj": torch.randn(64, 96, generator=gen)}
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in full.items()} for _ in range(steps)]

    def local(name, t):
        return t.chunk(tp, dim=0)[r] if name == "qkv" else t.chunk(tp, dim=1)[r]
    params = {"qkv": attn.qkv.weight, "proj": attn.proj.weight}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(local(n, full[n]))
    groups = [g for g in optimizer_param_groups("muon", [attn], WD) if g["use_muon"]]
    opt = build_optimizer("muon", groups, lr=LR, weight_decay=WD, muon_fp32_matmul_prec="highest",
                          muon_split_qkv=split, muon_tp_mode=tp_mode)
    for g in grads:
        for n, p in params.items():
            p.grad = local(n, g[n]).clone()
        opt.step()
    return full["qkv"], [g["qkv"] for g in grads], attn.qkv.weight.detach().clone()


def _expected_qkv(w, grads, blocks, mu=0.95):
    """W after Muon steps on the fused QKV weight, each of its per-group blocks of rows (q, k, v) collected
    into a matrix of its own, orthogonalised and scaled (0.2·√max(rows, cols)) on its own."""
    groups = w.shape[0] // sum(blocks)
    buf = torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + g
        u = (g + mu * buf).view(groups, sum(blocks), -1)
        parts = [p.reshape(-1, w.shape[1]) for p in u.split(blocks, dim=1)]
        o = [0.2 * math.sqrt(max(p.shape)) * ref_orthogonalise(p, coefficients("simple", 5)) for p in parts]
        update = torch.cat([p.view(groups, n, -1) for p, n in zip(o, blocks)], dim=1).view_as(w)
        w = w * (1 - LR * WD) - LR * update
    return w


def test_split_qkv_equals_three_separate_orthogonalisations():
    w, grads, got = run_distributed(_attention, 1)[0]
    assert w.shape == (192, 64)  # (8 + 2·4) heads x 12
    torch.testing.assert_close(got, _expected_qkv(w, grads, (24, 12, 12)), rtol=1e-5, atol=1e-6)
    _, _, whole = run_distributed(_attention, 1, args=("duplicated", False))[0]
    torch.testing.assert_close(whole, _expected_qkv(w, grads, (48,)), rtol=1e-5, atol=1e-6)  # one matrix
    assert not torch.allclose(whole, got, rtol=1e-3, atol=1e-4)  # the split changed the step


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
def test_tp2_split_qkv_equals_tp1(tp_mode):
    """Each TP rank holds two whole key/value groups; the step equals TP=1's, exactly (duplicated: the
    gathered weight is the TP=1 weight) or up to rounding (distributed)."""
    w, grads, tp1 = run_distributed(_attention, 1)[0]
    for r, (_, _, got) in enumerate(run_distributed(_attention, 2, tp=2, args=(tp_mode,))):
        torch.testing.assert_close(got, tp1.chunk(2, dim=0)[r], rtol=1e-4, atol=1e-6, msg=f"rank {r}")


def test_tp2_blockwise_is_the_slices_own_step():
    """--muon-tp-mode blockwise (Megatron's default) is an approximation: each TP slice is stepped as a
    whole matrix (its own Q, K, V, scaled by their slice shapes), which is not TP=1's step."""
    w, grads, tp1 = run_distributed(_attention, 1)[0]
    for r, (_, _, got) in enumerate(run_distributed(_attention, 2, tp=2, args=("blockwise",))):
        expected = _expected_qkv(w.chunk(2, dim=0)[r], [g.chunk(2, dim=0)[r] for g in grads], (24, 12, 12))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"rank {r}")
        assert not torch.allclose(got, tp1.chunk(2, dim=0)[r], rtol=1e-3, atol=1e-4)


def test_scales_follow_the_orthogonalised_shape():
    """The split parts get their own scale: Q (8 heads·12 = 96 rows) and K, V (48 rows each) at cols 64."""
    from megatron_po.models.transformer import SelfAttention
    attn = SelfAttention(CONFIGS["llama-gqa"], sequence_parallel=False)
    groups = [g for g in optimizer_param_groups("muon", [attn], WD) if g["use_muon"]]
    opt = Muon(groups, lr=LR)
    assert attn.qkv.weight.muon_qkv_rows == (24, 12, 12) and not hasattr(attn.proj.weight, "muon_qkv_rows")
    runs = opt._row_scales(groups[0], attn.qkv.weight, opt._orthogonalised_shapes(attn.qkv.weight))
    assert runs[:2] == [(0, 24, muon_scale(96, 64)), (24, 48, muon_scale(48, 64))] and len(runs) == 8
    assert runs[-1] == (168, 192, muon_scale(48, 64))


# ---- Gram Newton-Schulz (opt-in) -------------------------------------------------------------------

@pytest.mark.parametrize("kind,steps", [("simple", 5), ("simple", 4), ("quintic", 5), ("polar_express", 8)])
def test_gram_newton_schulz_equals_the_standard_iteration(kind, steps):
    torch.manual_seed(0)
    stack = torch.randn(3, 24, 100)  # wide, batched
    tall = torch.randn(120, 30)  # iterated transposed: wide too
    for u in (stack, tall):
        ref = newton_schulz(u, steps, kind, "highest")
        gram = newton_schulz(u, steps, kind, "highest", gram=True)
        assert gram.shape == ref.shape and (gram - ref).norm() / ref.norm() < 1e-3
        bf16, bf16_gram = (newton_schulz(u, steps, kind, "medium", gram=g).float() for g in (False, True))
        assert (bf16_gram - ref).norm() / ref.norm() < 0.08
        if (kind, steps) in BANDS:  # as orthogonal as the iteration is: within its band, as the standard one
            lo, hi = BANDS[(kind, steps)]
            sv = torch.linalg.svdvals(bf16_gram)
            assert lo - 0.01 <= sv.min() and sv.max() <= hi + 0.01


def test_gram_leaves_squarish_matrices_to_the_standard_iteration_and_saves_flops():
    torch.manual_seed(0)
    u = torch.randn(32, 32 * GRAM_MIN_ASPECT - 1)
    assert torch.equal(newton_schulz(u, 5, gram=True), newton_schulz(u, 5))
    m = 2048  # GPT-1.3B's MLP matrices [h, 4h]: 90 m³ standard, 60 m³ Gram in bf16 (restarts), 50 m³ in fp32
    assert newton_schulz_flops(m, 4 * m, 5) == 90 * m ** 3
    assert gram_newton_schulz_flops(m, 4 * m, 5) == 60 * m ** 3
    assert gram_newton_schulz_flops(m, 4 * m, 5, bf16=False) == 50 * m ** 3


def test_muon_gram_flag_is_opt_in_and_steps_alike():
    from megatron_po.config import parse_args
    from megatron_po.models.gpt import GPTModel
    from megatron_po.optim.muon import muon_kwargs
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--optimizer", "muon"]
    assert muon_kwargs(parse_args(base).training)["muon_gram_newton_schulz"] is False
    assert muon_kwargs(parse_args(base + ["--muon-gram-newton-schulz"]).training)["muon_gram_newton_schulz"] is True
    runs = {}
    for gram in (None, False, True):  # None: the default, without the keyword
        torch.manual_seed(0)
        model = GPTModel(CONFIGS["llama-gqa"], 64, 3)
        kwargs = {} if gram is None else {"muon_gram_newton_schulz": gram}
        opt = build_optimizer("muon", optimizer_param_groups("muon", [model], WD), lr=LR, weight_decay=WD,
                              muon_fp32_matmul_prec="highest", **kwargs)
        assert opt.gram_newton_schulz is bool(gram)
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[gram] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(runs[None], runs[False]))  # the default numerics, bitwise
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(runs[False], runs[True]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))  # the Gram path ran somewhere
