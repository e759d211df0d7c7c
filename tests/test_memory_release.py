"""Objects let go of their memory (issues 29, 37): with the garbage collector disabled, so that only
reference counting frees anything, building a model, its optimizer and pipeline machinery, training it and
`del`-ing it gives back every tensor storage it allocated.

Measured as the bytes of live CPU tensor storages (every tensor gc tracks, each storage once) before the build
and after the `del`, with no throw-away build first: the first build in a process must be freed too. Each case
builds in a forked rank of this process, so the first build of a process is checked in a fresh interpreter of
its own (this file run as a script). The cycles this guards against: torch.optim's lazy first import of
torch._dynamo left a cycle of frames that held the builder's frames, the whole first emulator with them
(649,108 of its 649,108 bytes stayed until a collection); the asynchronous stage held its segment's runner,
which held the stage's bound `step` (0.87 MB of a 4-layer emulator stayed after `del`); every DDP parameter's
post-accumulate-grad hook held the DDP, which holds the parameters, through torch's C++ hook list, which the
collector cannot see (the synchronous model, its DDP buffers and optimizer were never freed, not even by
`gc.collect()`); the overlapped param gather's module pre-hooks likewise (a collectable cycle).
"""

import contextlib
import gc
import os
import subprocess
import sys

import pytest
import torch
from dist_harness import run_distributed
from test_async_policies import VOCAB, get_batch, make_cfg

from megatron_po.pipeline.async_pipeline import AsyncEmulator


def live_tensor_bytes() -> int:
    """Bytes of the live CPU tensors' storages. Tensors without real storage (the fake tensors a
    torch.compile of an earlier test may leave in the process, inherited by forked ranks) hold none."""
    from torch._subclasses.fake_tensor import is_fake
    seen, total = set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu" and not is_fake(o):  # type(): no lookups
            storage = o.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@contextlib.contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def held_after_del(build) -> tuple[int, int]:
    """(bytes the built objects held, bytes still live after they were deleted), gc disabled."""
    with collector_off():
        before = live_tensor_bytes()
        objects = build()
        held = live_tensor_bytes() - before
        del objects
        return held, live_tensor_bytes() - before


EMULATORS = {  # method, optimizer, policy options, precision flags
    "pipeoptim": ("pipeoptim", "adam", {}, {}),
    "2bw+error-feedback": ("pipedream-2bw", "adam", {"error_feedback": True}, {}),
    "pipedream+delay-compensation": ("pipedream", "adam", {"delay_compensation": 0.1}, {}),
    "pipenag": ("pipenag", "nag", {}, {}),
    "pipeoptim-muon-fp16": ("pipeoptim", "muon", {}, {"fp16": True, "initial_loss_scale": 1024.0}),
    "spectrain-distopt-overlap": ("spectrain", "sgd", {}, {"bf16": True, "use_distributed_optimizer": True,
                                                           "overlap_param_gather": True}),
}


def _emulator_held(method, optimizer, options, precision):
    def build():
        cfg = make_cfg(4)
        for key, value in precision.items():
            setattr(cfg.precision, key, value)
        emu = AsyncEmulator(cfg, VOCAB, method, 2, 1, 2 if method == "pipedream-2bw" else 1, optimizer,
                            {"lr": 1e-2, "sgd_momentum": 0.9}, lambda i: 1e-2, 0.0, **options)
        emu.train_segment(lambda mb: get_batch(mb), 4)
        emu.evaluate([get_batch(9)])
        return emu
    return held_after_del(build)


@pytest.mark.parametrize("case", list(EMULATORS))
def test_emulator_frees_its_tensors_on_del(case):
    [(held, left)] = run_distributed(_emulator_held, 1, args=EMULATORS[case])  # one thread, few objects
    assert held > 100_000 and left == 0, (held, left)


def _pipeline_rank_held(precision: dict):
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank

    def build():
        cfg = make_cfg(4)
        for key, value in precision.items():
            setattr(cfg.precision, key, value)
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = \
            "full", "uniform", 1
        rank = AsyncPipelineRank(cfg, VOCAB, "pipeoptim", 1, 1, "adam", {"lr": 1e-2}, None, 0.0)
        rank.train_segment(lambda mb: get_batch(mb), 4)
        rank.evaluate([get_batch(9)])
        return rank
    return held_after_del(build)


@pytest.mark.parametrize("precision", [{}, {"bf16": True, "use_distributed_optimizer": True,
                                            "overlap_param_gather": True}], ids=["fp32", "distopt-overlap"])
def test_pipeline_rank_frees_its_tensors_on_del(precision):
    for held, left in run_distributed(_pipeline_rank_held, 2, pp=2, args=(precision,)):
        assert held > 100_000 and left == 0, (held, left)


def _synchronous_held(precision: str):
    from megatron_po import parallel_state as ps
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.optim.mixed_precision import grad_buffer_dtype, model_dtype
    from megatron_po.pipeline.partition import build_chunks_for_rank
    from megatron_po.training_setup import build_optimizer_for
    from megatron_po.training_step import train_step

    def build():
        cfg = make_cfg(2)
        pr = cfg.precision
        pr.bf16 = precision != "fp32"
        pr.use_distributed_optimizer = pr.overlap_param_gather = precision == "distopt-overlap"
        chunks = [c.to(model_dtype(pr.bf16)) for c in build_chunks_for_rank(cfg, VOCAB, 0, 1, 1)]
        ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), 2000, grad_dtype=grad_buffer_dtype(pr.bf16),
                                      use_distributed_optimizer=pr.use_distributed_optimizer,
                                      overlap_param_gather=pr.overlap_param_gather)
        optimizer = build_optimizer_for(cfg, chunks, ddp)
        for i in range(2):  # forward, backward (the post-accumulate-grad hooks run), step
            train_step(cfg, chunks, ddp, optimizer, [get_batch(i), get_batch(i + 10)], lr=1e-3)
        return chunks, ddp, optimizer
    return held_after_del(build)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "distopt-overlap"])
def test_synchronous_model_ddp_and_optimizer_free_their_tensors_on_del(precision):
    [(held, left)] = run_distributed(_synchronous_held, 1, args=(precision,))
    assert held > 100_000 and left == 0, (held, left)


# The first builds of a fresh interpreter (this file run as a script): each builds in a rank forked from an
# interpreter that ran nothing but the imports of this file (the library's own, pytest's, the test helpers').
FIRST_BUILDS = {"emulator-pipeoptim": (_emulator_held, EMULATORS["pipeoptim"]),
                "synchronous-fp32": (_synchronous_held, ("fp32",))}


def test_first_builds_in_a_fresh_process_free_their_tensors_on_del():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "tests")]))
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    results = {name: (int(held), int(left)) for name, held, left in map(str.split, run.stdout.splitlines())}
    assert results.keys() == FIRST_BUILDS.keys(), run.stdout
    for name, (held, left) in results.items():
        assert held > 100_000 and left == 0, (name, held, left)


if __name__ == "__main__":
    for name, (held_by, args) in FIRST_BUILDS.items():
        [(held, left)] = run_distributed(held_by, 1, args=args)
        print(name, held, left)
