"""What the CUDA test suite (tests/test_cuda_*.py, run on a GPU by `bash scripts/run_gpu_tests.sh`) shares.

Every test there takes the device as a parameter: "cpu" runs everywhere, so CI exercises the test code
itself and it cannot rot; "cuda" is skipped with the reason "needs CUDA" where torch sees no GPU. A test
moves work to a device the way a user would: in this process by letting `torch.cuda.is_available()`
answer for the device (`use_device`: parallel_state.get_device() is the one place that picks it), in a
subprocess by `CUDA_VISIBLE_DEVICES` (`pretrain_cli`).

A GPU image may lack wandb, datasets and nltk (issue 29). Every `pretrain_gpt.py` this suite starts runs
with those three made unimportable (`WITHOUT_OPTIONAL`), so a module-level import of one of them on the
training, checkpoint or emulator path fails the suite on any machine, CI's included.

The asynchronous emulator has no checkpoint of its own; `save_emulator` / `load_emulator` write each of
its D stages as the checkpoint of one pipeline rank with the product's save_checkpoint / load_checkpoint
(weights, optimizer state, the weight policy: 2BW's older version, error-feedback buffers), which is what
a distributed asynchronous run saves at a drain, rank by rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from cli_args import flags_to_argv

# cuBLAS fixes its workspace at its first use in a process, and deterministic GEMMs
# (torch.use_deterministic_algorithms) need this setting: set it when the tests are collected, before any
# CUDA work. On a CPU it changes nothing.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# The "cuda" twins also carry the marker `cuda` (registered in tests/conftest.py): `pytest -m cuda` selects them.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[needs_cuda, pytest.mark.cuda])]

OPTIONAL = ("wandb", "datasets", "nltk")  # not on the GPU image: nothing the GPU tests run may need them
# Python source that makes them unimportable (`import wandb` raises ImportError) in the process it runs in.
WITHOUT_OPTIONAL = f"import sys; sys.modules.update(dict.fromkeys({OPTIONAL!r}))"


# --------------------------------------------------------------------------------------------------
# Device and determinism in this process
# --------------------------------------------------------------------------------------------------


def use_device(device: str, monkeypatch) -> torch.device:
    """Run this test on `device`: "cpu" hides the GPU from every `torch.cuda.is_available()` check (the
    device, the backend, the random generators, the config rules all follow it); "cuda" changes nothing."""
    from megatron_po import parallel_state as ps
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = ps.get_device()
    assert got.type == device, got
    return got


@contextlib.contextmanager
def deterministic():
    """What --deterministic turns on (bit-reproducible kernels on a GPU; CPU runs are anyway), restored on exit."""
    from megatron_po import parallel_state as ps
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    ps.set_deterministic()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@contextlib.contextmanager
def single_process_group():
    """A one-process gloo group and TP = PP = DP = 1 (checkpoints are collectives), torn down on exit.
    gloo serves CUDA tensors here too: with one rank the checkpoint's collectives carry only metadata."""
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    ps.destroy_model_parallel()
    ps.init_distributed(environ={}, backend="gloo")  # no launcher variables: one process, a free port
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def one_thread():
    """Autouse in every module that imports it: tiny models run ~10x faster on one intra-op thread than on
    two on a loaded 2-core machine (the GPU's kernels do not care)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def synchronize() -> None:
    """Wait for the GPU, where this test uses it: not while `use_device("cpu")` hides it (torch 2.11 raises
    "invalid argument to exchangeDevice" there)."""
    if HAS_CUDA and torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# pretrain_gpt.py: argument lists, in this process and as a command
# --------------------------------------------------------------------------------------------------

TINY = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
        "--max-position-embeddings": 32, "--micro-batch-size": 4, "--global-batch-size": 8, "--train-iters": 8,
        "--lr": 1e-3, "--min-lr": 1e-4, "--lr-warmup-iters": 1, "--lr-decay-iters": 8, "--mock-data": True,
        "--tokenizer-type": "NullTokenizer", "--vocab-size": 100, "--make-vocab-size-divisible-by": 64,
        "--log-interval": 1, "--eval-interval": 1000, "--eval-iters": 1, "--seed": 7}


def tiny_args(out, **overrides) -> list[str]:
    """argv of a tiny GPT run on mock data writing its metrics (and data cache) under `out`; a flag set to
    True is a switch, to None or False is left out."""
    os.makedirs(out, exist_ok=True)
    args = dict(TINY, **{"--data-cache-path": os.path.join(out, "cache"),
                         "--metrics-file": os.path.join(out, "metrics.jsonl")})
    args.update(overrides)
    return flags_to_argv(args)


def read_records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def trained(records) -> list[dict]:
    """The logged training iterations (not the validation-only records)."""
    return [r for r in records if "lm_loss" in r]


def pretrain_cli(argv: list[str], device: str, out, timeout: float = 300) -> list[dict]:
    """`python pretrain_gpt.py argv` as a user runs it, on `device` (cpu: CUDA_VISIBLE_DEVICES=""), with
    wandb, datasets and nltk unimportable; returns the trained iterations' records. Fails with the
    command's output when it does not exit 0."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: one thread is far faster on a loaded machine
    code = (f"{WITHOUT_OPTIONAL}; import runpy; sys.argv[0] = 'pretrain_gpt.py'; "
            "runpy.run_path('pretrain_gpt.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"pretrain_gpt.py {' '.join(argv)} on {device}:\n{proc.stdout}\n{proc.stderr}"
    assert f"device {device}" in proc.stdout, proc.stdout  # the set-up line names the device it trained on
    return trained(read_records(out))


# --------------------------------------------------------------------------------------------------
# Where the model, its gradients and its optimizer state live
# --------------------------------------------------------------------------------------------------


def describe(t) -> tuple:
    """(device type, dtype, "like-param" or the shape) of a state tensor; the type name of anything else."""
    if not torch.is_tensor(t):
        return (type(t).__name__,)
    return (t.device.type, t.dtype, tuple(t.shape))


def placement(chunks, optimizer) -> dict[str, tuple]:
    """{what: describe(tensor)} for every parameter, every tensor an optimizer steps (the parameter, or its
    fp32 main param) and every entry of its optimizer state, by global parameter name."""
    from megatron_po.distributed.checkpoint_format import named_parameters_global
    from megatron_po.distributed.checkpoint_state import stepped_params
    stepped = stepped_params(optimizer)
    out = {}
    for name, p in named_parameters_global(chunks):
        out[f"param {name}"] = describe(p.data)
        s = stepped.get(id(p))
        if s is None or s.tensor is None:
            continue
        out[f"stepped {name}"] = describe(s.tensor)
        for key, value in s.inner.state.get(s.tensor, {}).items():
            like = torch.is_tensor(value) and value.shape == s.tensor.shape
            out[f"state {name} {key}"] = describe(value)[:2] + (("like-param",) if like else describe(value)[2:])
    return out


def misplaced(where: dict[str, tuple], device: str) -> list[str]:
    """Entries not where a training step puts them: parameters, stepped tensors and per-element state on
    `device`; step counters and other small state as torch.optim keeps them, 0-dim float32 on the CPU."""
    bad = []
    for what, d in where.items():
        if len(d) == 1:  # a Python number
            continue
        per_element = what.startswith(("param ", "stepped ")) or d[2] == "like-param"
        expected = device if per_element else "cpu"
        if d[0] != expected or (not per_element and d[1:] != (torch.float32, ())):
            bad.append(f"{what}: {d}")
    return bad


# --------------------------------------------------------------------------------------------------
# The asynchronous emulator (D stages in this process) and its checkpoints
# --------------------------------------------------------------------------------------------------

# Every asynchronous method issue 29 names: id -> (method, optimizer, update interval k, policy options).
EMULATED = {
    "pipeoptim-adamw": ("pipeoptim", "adamw", 1, {}),
    "pipeoptim-muon": ("pipeoptim", "muon", 1, {}),
    "pipedream": ("pipedream", "adamw", 1, {}),
    "2bw-ef": ("pipedream-2bw", "adamw", 4, {"error_feedback": True}),  # 2BW accumulates k >= D
    "pipenag": ("pipenag", "nag", 1, {}),
}
STAGES = 4
SEGMENT = 8  # micro-batches per segment (a multiple of every k above)


# A constant lr small enough that the stream is not chaotic: where the emulator runs on two devices,
# rounding differences stay at rounding level (on this project's CPU, weights perturbed by 1e-7 relative
# moved the losses of 24 micro-batches by <= 1e-6 and the weights by <= 3e-6; under the changing lr of
# tests/test_async_policies.py PipeOptim with AdamW amplified the same perturbation to 0.03 in the loss).
GENTLE_LR = {"adamw": 1e-3, "muon": 1e-3, "nag": 1e-2}

# Where the two devices are compared, Muon's Newton-Schulz runs in full fp32 ("highest"), not the default bf16
# ("medium"): bf16 matmuls accumulate and round differently on a GPU and on a CPU, and on the first H100
# (bench/results/gpu_nvidia_h100_80gb_hbm3_2026-11-27/cuda_tests_part1.log) eight bf16 steps moved a 512 x 128
# weight by 2.2e-3 of its norm against the CPU's, over the 1e-3 this comparison allows for rounding. The bf16
# path runs on the device in the bitwise resume test (one device, so one set of kernels).
GENTLE_EXTRA = {"muon": {"muon_fp32_matmul_prec": "highest"}}


def build_emulator(case: str, cfg=None, gentle: bool = False):
    """The tiny GPT of tests/test_async_policies.py in D = 4 stages on the device parallel_state picks
    (fp32, no dropout), running `case` of EMULATED: with that file's lr, which changes every step (so a
    prediction or a resumed schedule using a stale lr shows), or, `gentle`, GENTLE_LR held constant."""
    from test_async_policies import LR, SEED, VOCAB, lr_fn_for, make_cfg

    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    method, optimizer, k, options = EMULATED[case]
    model_parallel_seed(SEED)
    lr = GENTLE_LR[optimizer] if gentle else LR[optimizer]
    kwargs = {"lr": lr, "weight_decay": 0.01, "sgd_momentum": 0.9, **(GENTLE_EXTRA.get(optimizer, {}) if gentle else {})}
    return AsyncEmulator(cfg or make_cfg(STAGES), VOCAB, method, STAGES, 1, k, optimizer, kwargs,
                         None if gentle else lr_fn_for(optimizer), 0.0, **options)


def batches_on(device):
    """get_batch of tests/test_async_policies.py (masked tails included), its tensors on `device`."""
    from test_async_policies import get_batch
    return lambda mb: {k: v.to(device) for k, v in get_batch(mb).items()}


def emulator_state(emu) -> dict[str, torch.Tensor]:
    """Every weight, on the CPU."""
    return {k: v.cpu() for k, v in emu.full_state_dict().items()}


def save_emulator(emu, root: str, iteration: int) -> None:
    """Each stage as the checkpoint of its pipeline rank, `root`/stage<r> (taken at a drain: every
    segment ends with one)."""
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    for s in emu.stages:
        save_checkpoint(os.path.join(root, f"stage{s.rank}"), iteration, s.chunks, s.optimizers,
                        {"microbatches_consumed": emu.microbatches_consumed}, policy=s.policy, save_rng=False)


def load_emulator(emu, root: str) -> None:
    """Load what `save_emulator` wrote into a fresh emulator and continue its stream where it stopped (as
    AsyncPipelineRank.restore_progress does): the global micro-batch ids and every chunk's step count."""
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    for s in emu.stages:
        extra = load_checkpoint(os.path.join(root, f"stage{s.rank}"), s.chunks, s.optimizers, load_rng=False,
                                policy=s.policy)
    consumed = extra["microbatches_consumed"]
    emu.microbatches_consumed = consumed
    for s in emu.stages:
        s.steps = [consumed // emu.update_interval] * emu.num_chunks
