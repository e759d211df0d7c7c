"""--transformer-impl transformer_engine, tested on CPU without Transformer Engine.

TE cannot run here (no GPU; its import raises RuntimeError/OSError without the CUDA libraries), so the
TE path runs on `fake_transformer_engine`: TE 2.20.2's API (keywords, parameter names and attributes,
FP8 weight cast/cache semantics) with the local layers' math. What these tests show:

- Import guard: RuntimeError / OSError / ImportError / AssertionError raised by `import transformer_engine`
  (injected through a meta-path finder), and no visible GPU, end as ONE line "Transformer Engine
  requested but not usable: <reason>" from config validation and from the entry point (exit code 2);
  `--transformer-impl local` never tries to import it (the finder records no attempt).
- Flags: --fp8-format/--fp8-margin/--fp8-amax-history-len/--fp8-amax-compute-algo reach DelayedScaling
  (Format.E4M3 / HYBRID) and the autocast around the layers (also through the older fp8_autocast name);
  the amax reduction group is the TP x DP group of the pipeline stage (4 ranks, PP=2 x DP=2); flag rules.
- Layouts, no TE involved: local -> TE model names -> local, and local -> te.TransformerLayer state dicts
  per TP rank (TP=1 and 2; fused SwiGLU fc1 = [gate_r; up_r]) -> local, exactly, for LayerNorm/RMSNorm x
  GELU/SwiGLU x bias/no bias; the fused layouts compute the local MLP (rtol 1e-5, fp32, summation order).
- A TE model starts from the local model's weights and computes the same loss and gradients (GELU:
  measured bitwise; SwiGLU's joined gate/up GEMM: |delta grad| ~1e-8, asserted <= 1e-6); casts keep gate
  and up views of one buffer.
- is_first_microbatch: synchronous training passes True on the first forward after an optimizer step and
  False until the next (evaluation included); every asynchronous method passes None on every forward.
  Under (fake) FP8, synchronous TE training and asynchronous PipeDream on TE equal the local runs
  (atol 1e-6; measured 0), and enabling the weight cache under PipeDream changes the losses (measured
  by 7e-3; asserted > 1e-4), as it would on a GPU. PipeOptim on TE without FP8 equals local (measured 0).
- Checkpoints cross implementations: a local TP=2 + sequence-parallel checkpoint resumes on TE and
  continues the local run's losses (measured bitwise); the TE run's checkpoint holds the local run's
  names, shapes and values (weights and optimizer state within 1e-4 relative; measured max |delta|
  3.3e-7). tools/checkpoint_convert.py export-te (TP=2 shards) + import-te reproduce it exactly.
"""

import contextlib
import importlib.abc
import importlib.util
import json
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily, ~1 s: once here, not in forked ranks)
import fake_transformer_engine as fake
from dist_harness import run_distributed
from test_async_policies import get_batch, make_cfg
from test_checkpoint import losses, train

from megatron_po.config import ModelConfig, normalize_nmt, parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.models import te_layout, te_transformer
from megatron_po.models.gpt import GPTModel

TE = ["--transformer-impl", "transformer_engine"]
BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is ~10x faster than two on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_te(monkeypatch):
    fake.install()
    monkeypatch.setattr(te_transformer, "_gpu_visible", lambda: True)
    yield fake
    fake.uninstall()


class FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import transformer_engine...` raise `error`, and records the attempts."""

    def __init__(self, error: BaseException):
        self.error, self.attempts = error, []

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "transformer_engine":
            return None
        self.attempts.append(name)
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


@pytest.fixture
def failing_te():
    finders = []

    def install(error):
        finders.append(FailingImport(error))
        sys.meta_path.insert(0, finders[-1])
        return finders[-1]

    yield install
    for f in finders:
        sys.meta_path.remove(f)
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


# ---- import guard ------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError("cudnn shared object not found."),
                                   OSError("libcuda.so.1: cannot open shared object file: No such file or directory"),
                                   ImportError("No module named 'transformer_engine'"),
                                   AssertionError("Transformer Engine package version mismatch.")],
                         ids=lambda e: type(e).__name__)
def test_import_errors_become_one_line(error, failing_te, capsys):
    from megatron_po.training import run_main
    failing_te(error)
    with pytest.raises(ConfigError) as e:
        validate(parse_args(BASE + TE), 1)
    assert str(e.value).startswith(f"Transformer Engine requested but not usable: {error}")
    assert "\n" not in str(e.value)
    assert run_main(BASE + TE) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {e.value}"]


def test_no_visible_gpu_is_reported(fake_te, monkeypatch):
    monkeypatch.setattr(te_transformer, "_gpu_visible", lambda: False)
    with pytest.raises(ConfigError, match="^Transformer Engine requested but not usable: no CUDA device is visible"):
        validate(parse_args(BASE + TE), 1)


def test_local_never_imports_transformer_engine(failing_te):
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    from megatron_po.pipeline.partition import build_chunks_for_rank
    from megatron_po.tensor_parallel import model_parallel_seed
    finder = failing_te(RuntimeError("must not be imported"))
    cfg = parse_args(BASE + ["--swiglu", "--num-layers", "2"])
    validate(cfg, 1)
    model_parallel_seed(cfg.training.seed)  # dropout draws from the tracker
    chunks = build_chunks_for_rank(cfg, 128, 0, 1, 1)
    chunks[0](torch.randint(0, 100, (2, 16)), labels=torch.randint(0, 100, (2, 16))).mean().backward()
    named_parameters_global(chunks)
    assert finder.attempts == [] and "transformer_engine" not in sys.modules


# ---- flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    ([], dict(margin=0, fp8_format=fake.Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent")),
    (["--fp8-format", "e4m3", "--fp8-margin", "2", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"],
     dict(margin=2, fp8_format=fake.Format.E4M3, amax_history_len=1024, amax_compute_algo="max")),
])
def test_fp8_flags_map_to_delayed_scaling_and_autocast(flags, expected, fake_te, monkeypatch):
    argv = BASE + TE + (["--fp8-format", "hybrid"] if "--fp8-format" not in flags else []) + flags
    cfg = parse_args(argv)
    validate(cfg, 1)
    model = GPTModel(cfg.model, 128, seed=1)
    model(torch.randint(0, 100, (2, 16)))
    assert len(fake.AUTOCASTS) == 1  # one autocast around all the layers of the chunk
    args = fake.AUTOCASTS[0]
    assert args["enabled"] and args["amax_reduction_group"] is None  # one process: nothing to reduce over
    assert args["recipe"] == fake.DelayedScaling(**expected)

    # TE versions before `autocast` only have `fp8_autocast(enabled, fp8_recipe, fp8_group)`.
    seen = []
    monkeypatch.delattr(sys.modules["transformer_engine.pytorch"], "autocast")
    monkeypatch.setattr(sys.modules["transformer_engine.pytorch"], "fp8_autocast",
                        lambda **kw: seen.append(kw) or contextlib.nullcontext(), raising=False)
    model(torch.randint(0, 100, (2, 16)))
    assert seen == [dict(enabled=True, fp8_recipe=args["recipe"], fp8_group=None)]


def _amax_group_of_rank():
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    fake.AUTOCASTS.clear()
    cfg = ModelConfig(transformer_impl="transformer_engine", fp8_format="hybrid")
    with te_transformer.FP8Autocast(cfg)():
        pass
    group = fake.AUTOCASTS[0]["amax_reduction_group"]
    return ps.get_pipeline_model_parallel_rank(), sorted(dist.get_process_group_ranks(group))


def test_fp8_amaxes_are_reduced_within_the_pipeline_stage(fake_te):
    # PP=2 x DP=2 (TP=1): ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1 (TP fastest, then DP, then PP).
    assert run_distributed(_amax_group_of_rank, 4, pp=2) == [(0, [0, 1]), (0, [0, 1]), (1, [2, 3]), (1, [2, 3])]


def test_flag_rules(fake_te):
    for argv, needle in [(BASE + ["--fp8-format", "hybrid", "--fp8-backend", "te"],
                          "add --transformer-impl transformer_engine"),
                         (BASE + TE + ["--fp8-format", "e4m3", "--hidden-size", "40", "--num-attention-heads", "4"],
                          "divisible by 16"),
                         (BASE + TE + ["--fp8-format", "e4m3", "--seq-length", "6", "--micro-batch-size", "1"],
                          r"tokens of a micro-batch per rank \(6"),
                         (BASE + TE + ["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "must be >= 1")]:
        with pytest.raises(ConfigError, match=needle):
            validate(parse_args(argv), 1)
    with pytest.raises(ConfigError, match="wired for GPT"):
        validate(normalize_nmt(parse_args(BASE + TE)), 1, "nmt")
    # A GPU without FP8 (compute capability < 8.9): TE's own reason, when the model is built.
    reason = "Device compute capability 8.9 or higher required for FP8 execution."
    sys.modules["transformer_engine.pytorch"].is_fp8_available = lambda return_reason: (False, reason)
    with pytest.raises(ConfigError, match="needs FP8-capable GPUs .*: Device compute capability 8.9"):
        GPTModel(tiny(transformer_impl="transformer_engine", fp8_format="hybrid"), 64, seed=1)


# ---- layouts (no Transformer Engine at all) ----------------------------------------------------------

VARIANTS = {"layernorm-gelu-bias": dict(),
            "rmsnorm-swiglu": dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False),
            "layernorm-swiglu-bias": dict(swiglu=True),
            "rmsnorm-gelu": dict(normalization="RMSNorm", add_bias_linear=False)}


def tiny(**kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, ffn_hidden_size=64,
                       hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layouts_round_trip(variant):
    kw = VARIANTS[variant]
    cfg = tiny(**kw)
    swiglu, bias, rms = cfg.swiglu, cfg.add_bias_linear, cfg.normalization == "RMSNorm"
    local_model = GPTModel(cfg, 64, seed=2)
    state = {k: v.detach() for k, v in local_model.state_dict().items()}
    h, f = 32, 64

    # 1. The TE model's names: same tensors, renamed.
    te = te_layout.local_to_te(state, swiglu)
    mlp = "layernorm_mlp.fc1." if swiglu else "layernorm_mlp."
    expected = {"self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.weight",
                "self_attention.proj.weight", f"{mlp}layer_norm_weight"}
    expected |= {"layernorm_mlp.fc1.gate_weight", "layernorm_mlp.fc1.up_weight", "layernorm_mlp.fc2.weight"} if swiglu \
        else {"layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"}
    if not rms:
        expected.add("self_attention.layernorm_qkv.layer_norm_bias")
        expected.add(f"{mlp}layer_norm_bias")
    if bias:
        expected |= {"self_attention.layernorm_qkv.bias", "self_attention.proj.bias"}
        expected |= {"layernorm_mlp.fc1.gate_bias", "layernorm_mlp.fc1.up_bias", "layernorm_mlp.fc2.bias"} if swiglu \
            else {"layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_bias"}
    assert {k[len("layers.1."):] for k in te if k.startswith("layers.1.")} == expected
    back = te_layout.te_to_local(te)
    assert back.keys() == state.keys() and all(back[k] is state[k] for k in state)

    # 2. te.TransformerLayer's state dicts, per TP rank.
    for tp in (1, 2):
        shards = te_layout.to_transformer_layer(state, swiglu, tp)
        for r, s in enumerate(shards):
            assert s["layers.0.self_attention.layernorm_qkv.weight"].shape == (3 * h // tp, h)
            assert s["layers.0.self_attention.proj.weight"].shape == (h, h // tp)
            assert s["layers.0.layernorm_mlp.fc1_weight"].shape == ((2 if swiglu else 1) * f // tp, h)
            assert s["layers.0.layernorm_mlp.fc2_weight"].shape == (h, f // tp)
            assert s["embedding.word_embeddings.weight"].shape == (64 // tp, h)
            assert all(s[f"layers.0.{m}._extra_state"].numel() == 0 for m in te_layout.TRANSFORMER_LAYER_MODULES)
            if swiglu:  # rank r's fused rows: its slice of the gate, then its slice of up
                rows = slice(r * f // tp, (r + 1) * f // tp)
                assert torch.equal(s["layers.0.layernorm_mlp.fc1_weight"],
                                   torch.cat([state["layers.0.mlp.fc1_gate.weight"][rows],
                                              state["layers.0.mlp.fc1.weight"][rows]]))
        back = te_layout.from_transformer_layer(shards, swiglu)
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)

        # The per-rank fused layout computes the local MLP: sum over ranks of fc2_r(act(fc1_r(x))).
        x = torch.randn(5, h, generator=torch.Generator().manual_seed(tp))
        out = state["layers.0.mlp.fc2.bias"] if bias else 0.0
        for s in shards:
            y = x @ s["layers.0.layernorm_mlp.fc1_weight"].t()
            if bias:
                y = y + s["layers.0.layernorm_mlp.fc1_bias"]
            if swiglu:  # TE's swiglu: silu(first half) * second half
                gate, up = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(gate) * up
            else:
                y = torch.nn.functional.gelu(y, approximate="tanh")
            out = out + y @ s["layers.0.layernorm_mlp.fc2_weight"].t()
        with torch.no_grad():
            torch.testing.assert_close(out, local_model.layers[0].mlp(x), rtol=1e-5, atol=1e-6)
    assert "transformer_engine" not in sys.modules


# ---- the TE model ------------------------------------------------------------------------------------

# Llama-3-style attention options on the TE path: 2 key/value groups, head dim 12 (not 32 / 4), half the
# head dimensions rotated, zero-centered norm weights (TE's zero_centered_gamma).
GQA_VARIANT = dict(VARIANTS["rmsnorm-swiglu"], group_query_attention=True, num_query_groups=2, kv_channels=12,
                   rotary_percent=0.5, apply_layernorm_1p=True)


@pytest.mark.parametrize("variant", ["layernorm-gelu-bias", "rmsnorm-swiglu", "rmsnorm-swiglu-gqa-1p"])
def test_te_model_starts_from_and_computes_like_the_local_model(variant, fake_te):
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    kw = dict(VARIANTS.get(variant, GQA_VARIANT),
              position_embedding_type="rope" if "swiglu" in variant else "learned_absolute")
    local_model = GPTModel(tiny(**kw), 64, seed=4)
    te_model = GPTModel(tiny(transformer_impl="transformer_engine", **kw), 64, seed=4)
    ours, theirs = dict(named_parameters_global([local_model])), dict(named_parameters_global([te_model]))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    for model in (local_model, te_model):
        model(ids, labels=labels).mean().backward()
    torch.testing.assert_close(te_model(ids, labels=labels), local_model(ids, labels=labels), rtol=0, atol=1e-6)
    for k in ours:  # GELU measured bitwise; SwiGLU's joined gate/up GEMM rounds differently (~1e-8)
        torch.testing.assert_close(theirs[k].grad, ours[k].grad, rtol=0, atol=1e-6, msg=k)
    if "swiglu" in variant:  # a dtype cast keeps gate and up consecutive views of one buffer (one GEMM)
        te_model.double()
        fc1 = te_model.layers[0].layernorm_mlp.fc1
        assert fc1.up_weight.data_ptr() == fc1.gate_weight.data_ptr() + fc1.gate_weight.nbytes
        assert fc1.gate_weight.dtype == torch.float64


def _first_microbatch_flags(calls):
    """is_first_microbatch per layer forward (LayerNormLinear opens every layer)."""
    return [first for name, first in calls if name == "LayerNormLinear"]


def test_synchronous_training_caches_fp8_weights_between_steps(fake_te):
    from megatron_po.optim import build_optimizer
    local_model = GPTModel(tiny(), 64, seed=6)
    te_model = GPTModel(tiny(transformer_impl="transformer_engine", fp8_format="hybrid"), 64, seed=6)
    te_transformer.enable_fp8_weight_cache([te_model])
    opts = [build_optimizer("adamw", list(m.parameters()), lr=1e-2) for m in (local_model, te_model)]
    batches = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(6)]
    results = []
    for model, opt in zip((local_model, te_model), opts):
        fake.CALLS.clear()
        out = []
        for step in range(3):  # 2 micro-batches per step, then an evaluation forward on the same weights
            for ids, labels in batches[2 * step:2 * step + 2]:
                loss = model(ids, labels=labels).mean()
                (loss / 2).backward()
                out.append(loss.item())
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                out.append(model(*batches[0][:1]).float().mean().item())
        results.append(out)
    # Per step: micro-batch 0, micro-batch 1, step, evaluation (the first forward after the step); each
    # decision twice (two layers).
    per_step = [[True, False, True]] + [[False, False, True]] * 2
    assert _first_microbatch_flags(fake.CALLS) == [f for step in per_step for f in step for _ in range(2)]
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)


ASYNC = {"pipeoptim": 1, "spectrain": 1, "pipedream": 1, "pipedream-2bw": 3, "async-naive": 1}  # -> update interval


def _emulate(method, impl, fp8=None, cache=False, optimizer="sgd", microbatches=9):
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(5)
    cfg = make_cfg(3)
    cfg.model.transformer_impl, cfg.model.fp8_format = impl, fp8
    kwargs = {"lr": 0.1 if optimizer == "sgd" else 1e-2, "sgd_momentum": 0.9}
    emu = AsyncEmulator(cfg, 64, method, 3, 1, ASYNC[method], optimizer, kwargs)
    if cache:  # what must not be done: see te_transformer's docstring
        te_transformer.enable_fp8_weight_cache(emu.chunks)
    return emu.train_segment(lambda mb: get_batch(mb), microbatches)


@pytest.mark.parametrize("method", list(ASYNC))
def test_asynchronous_methods_never_reuse_fp8_weight_casts(method, fake_te):
    fake.CALLS.clear()
    _emulate(method, "transformer_engine", fp8="hybrid")
    firsts = [first for _, first in fake.CALLS]
    assert len(firsts) > 9 * 4 and set(firsts) == {None}  # every TE module call of every forward


def test_fp8_casts_under_async_pipelines_behave_as_documented(fake_te):
    local = _emulate("pipedream", "local")
    # PipeDream's backward uses the forward's weight version, which is also what TE's FP8 backward uses.
    torch.testing.assert_close(_emulate("pipedream", "transformer_engine", fp8="hybrid"), local, rtol=0, atol=1e-6)
    # A cached cast, re-cast in place while earlier micro-batches are in flight, corrupts their backward.
    wrong = _emulate("pipedream", "transformer_engine", fp8="hybrid", cache=True)
    assert max(abs(a - b) for a, b in zip(wrong, local)) > 1e-4
    # Without FP8 PipeOptim's prediction and restore reach the TE parameters like the local ones.
    torch.testing.assert_close(_emulate("pipeoptim", "transformer_engine", optimizer="adam"),
                               _emulate("pipeoptim", "local", optimizer="adam"), rtol=0, atol=1e-6)


# ---- checkpoints across implementations (2 ranks, TP=2, sequence parallel) ---------------------------

def test_checkpoints_load_across_implementations(fake_te, tmp_path, monkeypatch):
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    monkeypatch.setenv(fake.TRACE_ENV, str(tmp_path / "trace"))
    # Attention dropout 0: under sequence parallelism TE draws it from the default generator, the local
    # layer from the TP-rank tracker, so only those masks differ (hidden dropout is the same code).
    flags = {"--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--attention-dropout": 0.0,
             "--train-iters": 4, "--save-interval": 2, "--num-layers": 2, "--swiglu": True}
    local = losses(train(str(tmp_path / "local"), 2, **flags, **{"--save": str(tmp_path / "a")}))
    resumed = losses(train(str(tmp_path / "te"), 2, **flags, **{"--transformer-impl": "transformer_engine",
                                                             "--load": str(tmp_path / "a"), "--ckpt-step": 2,
                                                             "--save": str(tmp_path / "b")}))
    # The second run built TE modules on both ranks (2 layers: LayerNormLinear for QKV and for gate/up each).
    assert open(tmp_path / "trace").read().split().count("LayerNormLinear") == 2 * 2 * 2
    # fp32, same layout; SwiGLU's joined gate/up GEMM rounds differently from two GEMMs.
    torch.testing.assert_close(resumed, local[2:], rtol=0, atol=1e-5)
    a = read_full_checkpoint(str(tmp_path / "a"), 4, prefix="", progress=False)[0]
    b = read_full_checkpoint(str(tmp_path / "b"), 4, prefix="", progress=False)[0]
    tensors = sorted(k for k in a if torch.is_tensor(a[k]))
    assert sorted(k for k in b if torch.is_tensor(b[k])) == tensors
    assert any(k.startswith("model.layers.1.mlp.fc1_gate.") for k in tensors)
    for k in tensors:
        if k.startswith(("model.", "optimizer.")):
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)

    # tools/checkpoint_convert.py: te.TransformerLayer shards (TP=2) and back give the same tensors.
    from tools.checkpoint_convert import main
    te_dir, back = tmp_path / "te_layer", tmp_path / "back"
    assert main(["export-te", "--load", str(tmp_path / "a"), "--out", str(te_dir), "--tensor-model-parallel-size", "2",
                 "--no-progress"]) == 0
    assert json.load(open(te_dir / "te_config.json"))["transformer_layer"]["activation"] == "swiglu"
    assert main(["import-te", "--te", str(te_dir), "--out", str(back)]) == 0
    imported = read_full_checkpoint(str(back), 0, progress=False)[0]
    weights = read_full_checkpoint(str(tmp_path / "a"), 4, progress=False)[0]
    assert imported.keys() == weights.keys() and all(torch.equal(imported[k], weights[k]) for k in weights)
    assert main(["import-te", "--te", str(tmp_path), "--out", str(back)]) == 2  # no te_config.json: one line


def test_gqa_under_tp2_sequence_parallel_trains_like_the_local_layers(fake_te, tmp_path):
    """Grouped-query attention on the TE path (one key/value group per TP rank, head dim 12, zero-centered
    norms): the same losses as the local layers, 4 AdamW steps, fp32 (|delta| <= 1e-5)."""
    flags = {"--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--attention-dropout": 0.0,
             "--train-iters": 4, "--num-layers": 2, "--swiglu": True, "--normalization": "RMSNorm",
             "--position-embedding-type": "rope", "--group-query-attention": True, "--num-query-groups": 2,
             "--kv-channels": 12, "--apply-layernorm-1p": True, "--disable-bias-linear": True}
    local = losses(train(str(tmp_path / "local"), 2, **flags))
    te = losses(train(str(tmp_path / "te"), 2, **flags, **{"--transformer-impl": "transformer_engine"}))
    torch.testing.assert_close(te, local, rtol=0, atol=1e-5)
