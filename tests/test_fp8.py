"""FP8 through torchao (--fp8-format, --fp8-backend torchao or auto), on the CPU by torchao's emulation.

What these tests show (tolerances stated where a test is not bitwise; "measured" is this machine's figure):

- The GEMM (tensor_parallel/fp8.py) is torchao's: for tensorwise x {hybrid, e4m3} and rowwise x e4m3, in fp32
  and bf16, output, input gradient and weight gradient equal torchao's own `Float8Linear` bitwise, and differ
  from the exact matmul (relative error > 1e-3: FP8 is really on). Zero bubble's B op computes the input
  gradient alone and the W op gives the fused backward's weight gradient bitwise, also in a compiled layer (its
  FP8 GEMMs then run outside the graph, as the bf16 ones do). The backward casts the live
  weights (a weight policy swaps the parameter's storage between forward and backward), eager and compiled:
  compiled equals eager there bitwise.
- FP8 off changes nothing: no linear gets a GEMM, torchao is never imported; FP8 on marks exactly QKV, the
  attention projection and the MLP linears, and leaves parameters, names and initial values as they are.
- Training, tiny GPT on mock data: bf16 + FP8 (hybrid, tensorwise) stays within 0.005 of bf16 at every one of
  50 iterations (measured 3.4e-4; the loss moves 0.2), and is not bf16 (it differs). TP = 2 with sequence
  parallelism within 2e-3 of TP = 1 (per-shard scales; measured 3.9e-4). PP = 2 1F1B within 2e-4 of the one
  process run (measured 2.8e-5; 4.8e-7 without FP8, the FP8 roundings amplify the loss's reduction order),
  zero bubble (zb-h1) bitwise 1F1B. PipeOptim at PP = 2 equals the single-process emulator bitwise. Full
  recomputation and the distributed optimizer change nothing (bitwise); Muon with FP8 within 2e-3 of Muon
  without (measured 4e-4), all weights and optimizer state in high precision.
- Checkpoints: an FP8 run resumes bitwise; its checkpoint holds the tensors a bf16 run's holds, and loads into
  a bf16 run, and a bf16 checkpoint into an FP8 run (each continuing within 0.005 of the run that saved it;
  measured 1.2e-4 and 3.6e-5).
- Bad input: one line, exit 2, from the entry point (FP8 with --fp16, a GPU below compute capability 8.9 faked,
  GEMM dims not multiples of 16); the other rules' lines are rows of tests/test_config_rules.py.
- The GPU check's fp8 section (bench/gpu/gpu_fp8.py) runs at its quick size, eager (FP8 emulated).
"""

import json
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily, ~1 s: once here, not in forked ranks)
import torch.nn.functional as F
from cuda_harness import one_thread  # noqa: F401  (autouse fixture: one intra-op thread for the tiny models)
from dist_harness import run_distributed
from test_checkpoint import losses, run_capturing, tiny_args, train

from megatron_po.models import fp8 as model_fp8
from megatron_po.tensor_parallel import weight_grads
from megatron_po.tensor_parallel.fp8 import FP8Gemm, float8_config, fp8_linear

RECIPES = [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("rowwise", "e4m3")]
QUIET = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0}
FP8 = {"--fp8-format": "hybrid"}


def gemm(recipe="tensorwise", fmt="hybrid", emulate=True) -> FP8Gemm:
    return FP8Gemm(float8_config(recipe, fmt, emulate))


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- the GEMM ------------------------------------------------------------------------------------------------

def linear_grads(fn, x, w, b):
    """Output, input, weight and bias gradients of `fn(x, w, b)` under a fixed linear loss."""
    x, w, b = (torch.nn.Parameter(t.detach().clone()) for t in (x, w, b))
    y = fn(x, w, b)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def torchao_float8_linear(config):
    """fn(x, w, b) running torchao's own Float8Linear on `w` and `b`."""
    from torchao.float8.float8_linear import Float8Linear

    def fn(x, w, b):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
        lin.weight, lin.bias = w, b
        return Float8Linear.from_float(lin, config)(x)
    return fn


def fp8_gemm_grads_on(device: str, recipe: str, fmt: str, dtype: torch.dtype, emulate: bool):
    """(ours, torchao's Float8Linear, exact F.linear): output and gradients of one [4, 16, 64] x [48, 64]^T GEMM."""
    g = gemm(recipe, fmt, emulate)
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, dtype=dtype, device=device)
    w, b = torch.randn(48, 64, dtype=dtype, device=device) * 0.1, torch.randn(48, dtype=dtype, device=device)
    ours = linear_grads(lambda x, w, b: fp8_linear(x, w, b, g), x, w, b)
    return ours, linear_grads(torchao_float8_linear(g.config), x, w, b), linear_grads(F.linear, x, w, b)


@pytest.mark.parametrize("recipe,fmt", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_gemm_is_torchaos_float8_linear(recipe, fmt, dtype):
    ours, theirs, exact = fp8_gemm_grads_on("cpu", recipe, fmt, dtype, emulate=True)
    for name, a, b, e in zip(("output", "grad input", "grad weight", "grad bias"), ours, theirs, exact):
        assert a.dtype == dtype and torch.equal(a, b), name
        if name != "grad bias":  # the bias gradient is a plain sum
            assert rel(a, e) > 1e-3, name  # FP8 roundings: not the exact matmul


def test_zero_bubble_b_op_defers_the_fp8_weight_gradient():
    g = gemm()
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    w, b = torch.nn.Parameter(torch.randn(16, 32) * 0.1), torch.nn.Parameter(torch.randn(16))
    fp8_linear(x, w, b, g).square().sum().backward()
    fused = [t.grad.clone() for t in (x, w, b)]
    x.grad = w.grad = b.grad = None
    y = fp8_linear(x, w, b, g)
    with weight_grads.defer_weight_grads() as queue:
        y.square().sum().backward()  # the B op
    assert torch.equal(x.grad, fused[0]) and w.grad is None and b.grad is None and len(queue) == 1
    weight_grads.apply_weight_grads(queue)  # the W op
    assert torch.equal(w.grad, fused[1]) and torch.equal(b.grad, fused[2])


def fp8_mlp():
    from megatron_po.models.transformer import MLP
    from test_async_policies import make_cfg
    cfg = make_cfg(2).model
    cfg.fp8_format, cfg.add_bias_linear = "hybrid", True
    torch.manual_seed(0)
    mlp = MLP(cfg, False)
    for linear in (mlp.fc1, mlp.fc2):
        linear.fp8 = gemm()
    return mlp


def test_backward_casts_the_live_weights_eager_and_compiled():
    """A weight policy's swap (PipeOptim: forward on the prediction, backward on the live weights) through an FP8
    MLP: eager, the backward's input gradients are those of the live weights, not the prediction's; compiled
    (inductor's kernels round the emulation's fp32 differently: relative 1e-5 asserted, measured <= 1.3e-6) the
    same, so the compiled backward does not reuse the forward's weight scale (the prediction's) either."""
    from test_compiled_layers import layer_grads
    eager, compiled = fp8_mlp(), fp8_mlp()
    compiled.compile()
    x = torch.randn(16, 2, 32)
    predicted = [p.detach() + 0.05 * torch.randn_like(p) for p in eager.parameters()]
    expected = layer_grads(eager, x, predicted, "pointer")
    got = layer_grads(compiled, x, predicted, "pointer")
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got, expected)), [rel(a, b) for a, b in zip(got, expected)]
    # The backward on the prediction (what reading the forward's weights would give) is far from both.
    on_prediction = fp8_mlp()
    with torch.no_grad():
        for p, w in zip(on_prediction.parameters(), predicted):
            p.copy_(w)
    wrong = layer_grads(on_prediction, x, predicted, "pointer")
    assert rel(wrong[0], expected[0]) > 1e-2


def test_zero_bubble_split_in_a_compiled_layer():
    """Under a split backward a compiled layer runs its FP8 GEMMs outside its graph (`layers.linear`), so the B op
    still defers their weight gradients: the same gradients as the eager layer's fused backward, bitwise."""
    from megatron_po.tensor_parallel import graph_breaks
    graph_breaks.install()
    eager, compiled = fp8_mlp(), fp8_mlp()
    for linear in (compiled.fc1, compiled.fc2):
        linear.gemm_in_compiled_graph = False
    compiled.compile(backend="aot_eager")  # the graph around the GEMMs; inductor's kernels are tested above
    x = torch.randn(16, 2, 32)
    grads = []
    for mlp, split in ((eager, False), (compiled, True)):
        xi = x.clone().requires_grad_()
        loss = mlp(xi).square().sum()
        if split:
            with weight_grads.defer_weight_grads() as queue:
                loss.backward()
            assert mlp.fc1.weight.grad is None and mlp.fc2.weight.grad is None and len(queue) == 2
            weight_grads.apply_weight_grads(queue)
        else:
            loss.backward()
        grads.append([xi.grad] + [p.grad for p in mlp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---- the model: what FP8 marks, and that FP8 off is untouched ------------------------------------------------

LAYER_LINEARS = ["attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"]


def test_fp8_marks_the_layer_linears_only_and_changes_no_parameter():
    from megatron_po.models.gpt import GPTModel
    from test_async_policies import make_cfg
    off, on = make_cfg(2), make_cfg(2)
    on.model.fp8_format = "hybrid"
    models = {name: GPTModel(c.model, 64, seed=3) for name, c in (("off", off), ("on", on))}
    for name, model in models.items():
        marked = sorted(n for n, m in model.named_modules() if getattr(m, "fp8", None) is not None)
        assert marked == ([] if name == "off" else sorted(f"layers.{i}.{x}" for i in range(2) for x in LAYER_LINEARS))
    assert models["on"].output_layer.fp8 is None
    a, b = models["off"].state_dict(), models["on"].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_off_never_imports_torchao():
    code = ("import sys; sys.path.insert(0, 'tests'); from test_async_policies import make_cfg; "
            "from megatron_po.models.gpt import GPTModel; import megatron_po.training; "
            "GPTModel(make_cfg(2).model, 64, seed=3); print('torchao' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


# ---- training (forked gloo ranks) ----------------------------------------------------------------------------

def max_delta(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_fp8_trains_within_tolerance_of_bf16_over_50_iterations(tmp_path):
    flags = {"--train-iters": 50, "--lr-decay-iters": 50, "--bf16": True, **QUIET}
    bf16 = losses(train(str(tmp_path / "bf16"), 1, **flags))
    fp8 = losses(train(str(tmp_path / "fp8"), 1, **flags, **FP8))
    assert len(fp8) == 50 and bf16[0] - bf16[-1] > 0.1  # it trains
    assert max_delta(fp8, bf16) <= 0.005
    assert fp8 != bf16


def test_tp2_sequence_parallel_equals_tp1_under_fp8(tmp_path):
    flags = {"--train-iters": 10, **QUIET, **FP8}
    tp1 = losses(train(str(tmp_path / "tp1"), 1, **flags))
    tp2 = losses(train(str(tmp_path / "tp2"), 2, **flags, **{"--tensor-model-parallel-size": 2,
                                                             "--sequence-parallel": True}))
    assert max_delta(tp2, tp1) <= 2e-3


def test_pp2_1f1b_and_zero_bubble_equal_the_one_process_run_under_fp8(tmp_path):
    flags = {"--train-iters": 10, **QUIET, **FP8}
    one = losses(train(str(tmp_path / "pp1"), 1, **flags))
    pp2 = losses(train(str(tmp_path / "pp2"), 2, **flags, **{"--pipeline-model-parallel-size": 2}))
    zb = losses(train(str(tmp_path / "zb"), 2, **flags, **{"--pipeline-model-parallel-size": 2,
                                                          "--pipeline-method": "zb-h1"}))
    assert max_delta(pp2, one) <= 2e-4
    assert zb == pp2


def _with_fp8(fn, *args):
    """`fn(*args)` in a rank whose test models (test_async_policies.make_cfg) run FP8."""
    import test_async_pipeline
    from test_async_policies import make_cfg

    def fp8_cfg(num_layers, tied=False):
        cfg = make_cfg(num_layers, tied)
        cfg.model.fp8_format = "hybrid"
        return cfg
    test_async_pipeline.make_cfg = fp8_cfg
    return fn(*args)


def test_pipeoptim_pp2_equals_the_emulator_bitwise_under_fp8():
    from test_async_pipeline import train_distributed, train_emulator
    args = ("pipeoptim", "adam", 2, 1, 1, (6, 6))
    emu_losses, _, emu_weights, _ = run_distributed(partial(_with_fp8, train_emulator), 1, args=args)[0]
    results = run_distributed(partial(_with_fp8, train_distributed), 2, pp=2, args=(args[0], args[1]) + args[3:])
    assert results[1][0] == emu_losses
    weights = {**results[0][2], **results[1][2]}
    assert weights.keys() == emu_weights.keys() and all(torch.equal(weights[k], emu_weights[k]) for k in weights)
    # and FP8 was on: the same emulator without it gives other losses
    plain = run_distributed(train_emulator, 1, args=args)[0][0]
    assert plain != emu_losses


def test_recomputation_distributed_optimizer_and_muon_under_fp8(tmp_path):
    flags = {"--train-iters": 6, **QUIET, **FP8}
    fp8 = losses(train(str(tmp_path / "fp8"), 1, **flags))
    recomputed = losses(train(str(tmp_path / "re"), 1, **flags, **{"--recompute-granularity": "full",
                                                                  "--recompute-method": "uniform",
                                                                  "--recompute-num-layers": 1}))
    assert recomputed == fp8
    dp2 = losses(train(str(tmp_path / "dp2"), 2, **flags))
    sharded = losses(train(str(tmp_path / "dist"), 2, **flags, **{"--use-distributed-optimizer": True}))
    assert sharded == dp2
    muon = {"--optimizer": "muon", "--save": str(tmp_path / "muon_ckpt"), "--save-interval": 6}
    muon_fp8 = losses(train(str(tmp_path / "muon"), 1, **flags, **muon))
    muon_plain = losses(train(str(tmp_path / "muon_plain"), 1, **{**flags, "--fp8-format": None,
                                                                   "--optimizer": "muon"}))
    assert max_delta(muon_fp8, muon_plain) <= 2e-3
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    state = read_full_checkpoint(str(tmp_path / "muon_ckpt"), 6, prefix="", progress=False)[0]
    dtypes = {v.dtype for v in state.values() if torch.is_tensor(v) and v.is_floating_point()}
    assert dtypes == {torch.float32}  # weights and Muon's momenta: high precision, nothing in FP8


# ---- checkpoints ---------------------------------------------------------------------------------------------

def test_fp8_checkpoints_resume_bitwise_and_load_across_precisions(tmp_path):
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    flags = {"--train-iters": 8, "--save-interval": 4, "--bf16": True}  # dropout on: RNG restore exercised
    fp8_ckpt, bf16_ckpt = str(tmp_path / "fp8_ckpt"), str(tmp_path / "bf16_ckpt")
    straight = losses(train(str(tmp_path / "straight"), 1, **flags, **FP8, **{"--save": fp8_ckpt}))
    plain = losses(train(str(tmp_path / "plain"), 1, **flags, **{"--save": bf16_ckpt}))
    resumed = losses(train(str(tmp_path / "resumed"), 1, **flags, **FP8, **{"--load": fp8_ckpt, "--ckpt-step": 4,
                                                                              "--save": str(tmp_path / "c1")}))
    assert resumed == straight[4:]  # bit for bit
    a = read_full_checkpoint(fp8_ckpt, 4, prefix="", progress=False)[0]
    b = read_full_checkpoint(bf16_ckpt, 4, prefix="", progress=False)[0]
    tensors = lambda s: {k: (v.dtype, tuple(v.shape)) for k, v in s.items() if torch.is_tensor(v)}  # noqa: E731
    assert tensors(a) == tensors(b)  # no FP8 state: the same tensors, dtypes and shapes
    to_bf16 = losses(train(str(tmp_path / "to_bf16"), 1, **flags, **{"--load": fp8_ckpt, "--ckpt-step": 4,
                                                                          "--save": str(tmp_path / "c2")}))
    to_fp8 = losses(train(str(tmp_path / "to_fp8"), 1, **flags, **FP8, **{"--load": bf16_ckpt, "--ckpt-step": 4,
                                                                              "--save": str(tmp_path / "c3")}))
    assert max_delta(to_bf16, straight[4:]) <= 0.005 and max_delta(to_fp8, plain[4:]) <= 0.005
    assert to_bf16 != straight[4:] and to_fp8 != plain[4:]  # each ran its own precision


# ---- bad input: one line, exit 2 -----------------------------------------------------------------------------

def _run_argv(argv, capability=None):
    if capability is not None:
        model_fp8._cuda_capability = lambda: capability  # this forked rank only
    return run_capturing(argv)


BAD = [
    ("fp16", {"--fp16": True}, None, "--fp8-format hybrid with --fp16"),
    ("old-gpu", {}, ("NVIDIA A100-SXM4-80GB", (8, 0)), "compute capability >= 8.9 (Ada, Hopper or newer) for its FP8 "
                                                       "GEMMs; this one (NVIDIA A100-SXM4-80GB) is 8.0"),
    ("dims", {"--seq-length": 24, "--micro-batch-size": 1}, None,
     "not: tokens per micro-batch (--seq-length x --micro-batch-size) 24"),
    ("recipe", {"--fp8-recipe": "mxfp8"}, None, "--fp8-recipe mxfp8 is not available with --fp8-backend torchao"),
]


@pytest.mark.parametrize("case,flags,capability,words", BAD, ids=[b[0] for b in BAD])
def test_bad_fp8_input_is_one_line_at_start_up(case, flags, capability, words, tmp_path):
    argv = tiny_args(str(tmp_path), **FP8, **flags)
    code, err = run_distributed(partial(_run_argv, capability=capability), 1, args=(argv,))[0]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0], err


# ---- the GPU check's fp8 section, at its quick size (FP8 emulated) -------------------------------------------

def test_gpu_fp8_section_runs_at_the_quick_size(tmp_path):
    """bench/gpu/gpu_fp8.py --quick --eager-only (the compiled runs take inductor's minutes on a CPU; the compiled
    FP8 layer is tested above): it measures ours bf16 and FP8 and the plain GPT under torchao's FP8, and writes the
    results with the loss target read off its own runs."""
    out = tmp_path / "fp8.md"
    proc = subprocess.run([sys.executable, "bench/gpu/gpu_fp8.py", "--quick", "--eager-only", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()
    assert "Quick size on cpu: FP8 emulated" in md and "python bench/gpu/gpu_fp8.py plain_fp8 --size quick" in md
    assert "--fp8-format hybrid --fp8-recipe tensorwise" in md and "not measured (--eager-only)" in md
    data = json.loads(out.with_suffix(".json").read_text())["figures"]
    assert set(data) >= {"bf16", "fp8", "plain_fp8", "loss", "ratios", "targets"}
    assert data["plain_fp8"]["fp8"].endswith("(emulated)") and data["fp8"]["tokens_per_s"] > 0
    assert data["targets"]["loss_delta"]["met"] and data["loss"]["fp8"] != data["loss"]["bf16"]
