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
  says so at start-up, saves and resumes; PipeDream at PP 2 and FSDP2 at DP 2 run with it.
The one-line refusals (fp8 state, fp16 main params, other optimizers, PipeOptim's prediction) are rows of
tests/test_config_rules.py.
"""

import json

import pytest
import torch
from dist_harness import run_distributed, run_mains

from megatron_po.optim import build_optimizer

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
    pipedream = ["--pipeline-model-parallel-size", "2", "--pipeline-method", "pipedream",
                 "--untie-embeddings-and-output-weights"]
    argvs = [_tiny(tmp_path / "a", 4, *DISTOPT, *PRECISION_AWARE, "--save", str(tmp_path / "ck")),
             _tiny(tmp_path / "b", 5, *DISTOPT, *PRECISION_AWARE, "--load", str(tmp_path / "ck")),
             _tiny(tmp_path / "c", 4, *DISTOPT),
             _tiny(tmp_path / "d", 2, *DISTOPT, *PRECISION_AWARE, *pipedream),  # an asynchronous stage's optimizer
             _tiny(tmp_path / "e", 2, *PRECISION_AWARE, "--use-torch-fsdp2", "--grad-reduce-in-bf16")]  # FSDP2's
    assert run_distributed(run_mains, 2, args=(argvs,), timeout=300) == [[0] * 5] * 2
    out = capfd.readouterr().out
    assert out.count("> --use-precision-aware-optimizer: Adam's exp_avg stored in bf16, exp_avg_sq in bf16, both "
                     "computed in fp32; main params fp32; gradient buffer bf16") == 4

    def losses(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r}
    low, resumed, wide = losses("a"), losses("b"), losses("c")
    assert list(low) == list(wide) == [1, 2, 3, 4] and list(resumed) == [5]
    assert low[1] == wide[1]  # before any step
    assert all(low[i] != wide[i] and abs(low[i] - wide[i]) < 0.05 for i in (3, 4)), (low, wide)
