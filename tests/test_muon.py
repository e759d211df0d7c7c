"""Muon (optim/muon.py): steps equal a reference written here from the formula, at TP=1, TP=2 and under the
distributed optimizer (DP=2, fp32 and bf16), ΔW and the PipeOptim prediction in closed form.

Tolerances: fp32 reference comparisons rtol=1e-5, atol=1e-6, with fp32 Newton-Schulz
(`muon_fp32_matmul_prec="highest"`; the default is bf16) (the reference and the optimizer run the same float
ops in another grouping: foreach vs per tensor, batched vs one matrix, a TP all-gather + concat vs the whole
matrix, so a few ulps of the Newton-Schulz matmuls differ); sharded vs unsharded and prediction identities
bitwise (rtol=atol=0) at the default bf16 precision, since the same ops run on the same numbers (each
matrix's owner runs the same Newton-Schulz on the same U, whichever rank it is).
"""

import math

import pytest
import torch
from dist_harness import run_distributed
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.errors import ConfigError
from megatron_po.optim import build_optimizer
from megatron_po.optim.muon import Muon, muon_param_groups, muon_scale, newton_schulz, optimizer_param_groups

LR, WD, MU = 0.02, 0.1, 0.95
TOL = dict(rtol=1e-5, atol=1e-6)


# ---- the reference, from the formula (not from optim/muon.py) -------------------------------------

def ref_orthogonalise(u, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def ref_muon(w, grads, lr=LR, wd=WD, mu=MU, nesterov=True, scale=None):
    """W after one Muon step per gradient: B ← μB + G, U = G + μB (or B), W ← W(1-lr·λ) - lr·s·O(U)."""
    rows, cols = w.shape
    scale = 0.2 * math.sqrt(max(rows, cols)) if scale is None else scale
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + g
        u = g + mu * buf if nesterov else buf
        w = w * (1 - lr * wd) - lr * scale * ref_orthogonalise(u)
    return w


class Toy(nn.Module):
    """Embedding, two hidden matrices (one tall, one wide), a norm with bias, an output layer."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 12, bias=True)
        self.down = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.output_layer = nn.Linear(8, 11, bias=False)


def groups_of(model):
    return optimizer_param_groups("muon", [model], WD)


def test_newton_schulz_is_nearly_orthogonal_and_scale_modes():
    torch.manual_seed(0)
    for shape in [(6, 10), (10, 6), (8, 8)]:
        u = torch.randn(shape)
        o = newton_schulz(u)
        s = torch.linalg.svdvals(o)
        assert s.min() > 0.6 and s.max() < 1.25, s  # the quintic's known band around 1, not exactly 1
        torch.testing.assert_close(o, ref_orthogonalise(u), **TOL)
    assert muon_scale(12, 8, "spectral", 0.2) == pytest.approx(0.2 * math.sqrt(12))
    assert muon_scale(12, 8, "unit_rms_norm", 1.0) == pytest.approx(math.sqrt(12 / 8))
    assert muon_scale(8, 12, "shape_scaling", 1.0) == 1.0 and muon_scale(12, 3, "shape_scaling", 1.0) == 2.0
    with pytest.raises(ValueError, match="muon scale mode"):
        muon_scale(2, 2, "bogus")


def test_groups_route_embeddings_output_norms_and_biases_to_adamw():
    model = Toy()
    groups = groups_of(model)
    muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    assert muon == {id(model.up.weight), id(model.down.weight)}
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decay[id(model.embedding.weight)] == WD and decay[id(model.norm.bias)] == 0.0
    assert len(decay) == len(list(model.parameters()))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


@pytest.mark.parametrize("nesterov", [True, False])
def test_steps_equal_the_reference_tp1(nesterov):
    torch.manual_seed(0)
    model, steps = Toy(), 3
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer("muon", groups_of(model), lr=LR, weight_decay=WD, muon_use_nesterov=nesterov,
                          muon_fp32_matmul_prec="highest")
    adamw_twin = Toy()
    adamw_twin.load_state_dict(model.state_dict())
    twin_groups = [{"params": [p for n, p in adamw_twin.named_parameters() if n in ("embedding.weight",
                                                                                      "output_layer.weight")],
                    "weight_decay": WD},
                   {"params": [adamw_twin.up.bias, adamw_twin.norm.weight, adamw_twin.norm.bias], "weight_decay": 0.0}]
    torch_adamw = torch.optim.AdamW(twin_groups, lr=LR, weight_decay=WD, foreach=True)
    grads = [_grads(model, s) for s in range(steps)]
    for s in range(steps):
        for (n, p), (_, q) in zip(model.named_parameters(), adamw_twin.named_parameters()):
            p.grad, q.grad = grads[s][n].clone(), grads[s][n].clone()
        opt.step()
        torch_adamw.step()
    for name in ("up.weight", "down.weight"):
        expected = ref_muon(initial[name], [g[name] for g in grads], nesterov=nesterov)
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), expected, **TOL, msg=name)
    for name in ("embedding.weight", "output_layer.weight", "up.bias", "norm.weight", "norm.bias"):
        torch.testing.assert_close(dict(model.named_parameters())[name], dict(adamw_twin.named_parameters())[name],
                                   rtol=0, atol=0, msg=name)


def test_update_direction_and_prediction_closed_form():
    torch.manual_seed(1)
    model = Toy()
    opt = build_optimizer("muon", groups_of(model), lr=LR, weight_decay=WD, muon_fp32_matmul_prec="highest")
    for s in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = _grads(model, s)[n]
        opt.step()
    params = dict(model.named_parameters())
    directions = {id(p): d for g, row in zip(opt.param_groups, opt.update_direction())
                  for p, d in zip(g["params"], row)}
    for name in ("up.weight", "down.weight"):  # ΔW is what the last step subtracted (decay apart), over lr
        p = params[name]
        torch.testing.assert_close(directions[id(p)], (before[name] * (1 - LR * WD) - p.detach()) / LR, **TOL)
        rows, cols = p.shape  # = 0.2·√max(rows, cols)·O: an RMS of 0.2 (O's singular values near 1)
        assert directions[id(p)].pow(2).mean().sqrt() == pytest.approx(0.2 * math.sqrt(max(rows, cols) * min(rows, cols)
                                                                                         / (rows * cols)), rel=0.3)
    for include_wd in (False, True):
        predicted = Toy()
        out = [[dict(predicted.named_parameters())[n] for p in g["params"] for n, q in params.items() if q is p]
               for g in opt.param_groups]
        opt.predict(3.0, include_weight_decay=include_wd, out=out)
        for g in opt.param_groups:
            for p in g["params"]:
                name = next(n for n, q in params.items() if q is p)
                decay = 1 - 3 * LR * g["weight_decay"] if include_wd else 1.0
                expected = p.detach() * decay - 3 * LR * directions[id(p)]
                torch.testing.assert_close(dict(predicted.named_parameters())[name].detach(), expected, **TOL,
                                           msg=name)


def test_bad_muon_settings_raise():
    model = Toy()
    with pytest.raises(ConfigError, match="--optimizer muon: invalid muon momentum"):
        build_optimizer("muon", groups_of(model), lr=LR, muon_momentum=1.0)
    with pytest.raises(ConfigError, match="Newton-Schulz"):
        build_optimizer("muon", groups_of(model), lr=LR, muon_num_ns_steps=0)
    with pytest.raises(ConfigError, match="scale mode"):
        build_optimizer("muon", groups_of(model), lr=LR, muon_scale_mode="nope")
    with pytest.raises(ConfigError, match="use_muon"):  # not silently AdamW for everything
        build_optimizer("muon", model.parameters(), lr=LR)
    assert all("use_muon" not in g for g in optimizer_param_groups("adamw", [model], WD))
    assert muon_param_groups(optimizer_param_groups("adamw", [model], WD), [model]) == groups_of(model)


# ---- TP=2: whole matrices are orthogonalised ------------------------------------------------------

def _tp_run(steps):
    from megatron_po.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(5)
    full = {"col.weight": torch.randn(10, 6, generator=gen), "col.bias": torch.randn(10, generator=gen),
            "row.weight": torch.randn(6, 10, generator=gen), "row.bias": torch.randn(6, generator=gen)}
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in full.items()} for _ in range(steps)]

    def local(name, t):  # this rank's slice of a full tensor (column-parallel: rows, row-parallel: columns)
        if name.startswith("col"):
            return t.chunk(tp, dim=0)[r]
        return t.chunk(tp, dim=1)[r] if name == "row.weight" else t

    model = nn.Module()
    model.col = ColumnParallelLinear(6, 10, bias=True)
    model.row = RowParallelLinear(10, 6, bias=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(local(n, full[n]))
    opt = build_optimizer("muon", groups_of(model), lr=LR, weight_decay=WD, muon_fp32_matmul_prec="highest")
    for s in range(steps):
        for n, p in model.named_parameters():
            p.grad = local(n, grads[s][n]).clone()
        opt.step()
    expected = {n: local(n, ref_muon(full[n], [g[n] for g in grads])) for n in ("col.weight", "row.weight")}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, expected


def test_tp2_orthogonalises_the_full_matrix_equal_to_tp1():
    tp1 = run_distributed(_tp_run, 1, args=(3,))[0][0]
    gen = torch.Generator().manual_seed(5)  # _tp_run's draws, again: the row-parallel weight's shards alone
    full = [torch.randn(shape, generator=gen) for shape in [(10, 6), (10,), (6, 10), (6,)]]
    grads = [[torch.randn(t.shape, generator=gen) for t in full] for _ in range(3)]
    per_shard = [ref_muon(full[2].chunk(2, dim=1)[r], [g[2].chunk(2, dim=1)[r] for g in grads]) for r in range(2)]
    for r, (got, expected) in enumerate(run_distributed(_tp_run, 2, tp=2, args=(3,))):
        for name in ("col.weight", "row.weight"):
            torch.testing.assert_close(got[name], expected[name], **TOL, msg=f"rank {r} {name}")
            dim = 0 if name == "col.weight" else 1
            torch.testing.assert_close(got[name], tp1[name].chunk(2, dim=dim)[r], **TOL, msg=f"TP=1 vs 2 {name}")
        # orthogonalising each shard on its own would give another step (the test would catch it):
        assert not torch.allclose(got["row.weight"], per_shard[r], rtol=1e-3, atol=1e-3)


# ---- the distributed optimizer (ZeRO-1), DP=2, fp32 and bf16 ----------------------------------------

def _distopt_run(dtype, steps=3):
    from test_distributed_optimizer import BUCKET, SEED, VOCAB, CONFIGS, train_step

    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.models.gpt import GPTModel
    from megatron_po.optim.distributed_optimizer import DistributedOptimizer
    from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer
    from megatron_po.tensor_parallel import model_parallel_seed

    out = {}
    for sharded in (False, True):
        model_parallel_seed(SEED)
        model = GPTModel(CONFIGS["llama"], VOCAB, SEED).to(dtype)
        ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), bucket_size=BUCKET,
                                      grad_dtype=torch.float32, use_distributed_optimizer=sharded)
        groups = optimizer_param_groups("muon", [model], WD)
        factory = lambda g: build_optimizer("muon", g, lr=LR, weight_decay=WD)  # noqa: E731
        if sharded:
            opt = DistributedOptimizer(factory, groups, ddp, model_parallel_group=ps.get_model_parallel_group())
            cut = [p for p in ddp.params if p.ndim == 2 and sum(piece.param is p for piece in opt.pieces) and
                   sum(piece.end - piece.start for piece in opt.pieces if piece.param is p) < p.numel()]
            out["cut_matrices"] = len(cut)
        elif dtype != torch.float32:
            opt = MixedPrecisionOptimizer(factory, groups, model_parallel_group=ps.get_model_parallel_group())
        else:
            opt = factory(groups)
        for s in range(steps):
            train_step(model, ddp, opt, s)
        if sharded:
            opt.finish_param_sync()
        out[sharded] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out[(sharded, "dw")] = [d for row in opt.update_direction() for d in row]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distributed_optimizer_dp2_equals_unsharded(dtype):
    """Each DP rank owns ranges cutting through matrices; each matrix's owner assembles its whole U from
    the pieces and sends the O pieces back, which makes the step the unsharded one (whose DP ranks share the
    Newton-Schulz work out too), bitwise (a reduce-scatter and an all-reduce over 2 ranks add the same two
    numbers; the assembled U is exact; the same Newton-Schulz runs on it). bf16 model weights: against the
    mixed-precision optimizer's fp32 main params, also bitwise."""
    for r, out in enumerate(run_distributed(_distopt_run, 2, args=(dtype,))):
        assert out["cut_matrices"] > 0, "no matrix was cut by the shards: the test proves nothing"
        for name in out[False]:
            torch.testing.assert_close(out[True][name], out[False][name], rtol=0, atol=0, msg=f"rank {r} {name}")
        for a, b in zip(out[(True, "dw")], out[(False, "dw")]):
            torch.testing.assert_close(a, b.float(), rtol=0, atol=0)


def test_distributed_optimizer_tp2_dp2_equals_unsharded():
    """TP=2 x DP=2: U pieces to the DP owner, then the owner's TP ranks gather the matrix; bitwise as above."""
    for r, out in enumerate(run_distributed(_distopt_run, 4, tp=2, args=(torch.float32, 2))):
        for name in out[False]:
            torch.testing.assert_close(out[True][name], out[False][name], rtol=0, atol=0, msg=f"rank {r} {name}")


def test_flags_reach_the_optimizer():
    from megatron_po.config import parse_args
    from megatron_po.training_setup import build_optimizer_for
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--optimizer", "muon",
                      "--muon-momentum", "0.9", "--no-muon-use-nesterov", "--muon-num-ns-steps", "3",
                      "--muon-scale-mode", "shape_scaling", "--muon-extra-scale-factor", "1.0", "--adam-beta1", "0.8"])
    opt = build_optimizer_for(cfg, [Toy()], None)
    assert isinstance(opt, Muon)
    (hidden,) = [g for g in opt.param_groups if g["use_muon"]]
    assert (hidden["momentum"], hidden["nesterov"], hidden["num_ns_steps"], hidden["scale_mode"],
            hidden["extra_scale_factor"], hidden["betas"]) == (0.9, False, 3, "shape_scaling", 1.0, (0.8, 0.999))
    assert len(hidden["params"]) == 2
