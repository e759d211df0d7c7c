"""Checkpoints that never lose a run: exact resume, resharding, rotation, atomicity, bad checkpoints.

Tiny GPTs on mock data (random tokens, NullTokenizer) through `training.run_main` on forked gloo ranks.

- Resume is bit-exact on CPU: 20 iterations (saving every 5, --keep-last 3) vs loading iteration 10
  (--ckpt-step 10) and running 10 more, for 1F1B PP=2, interleaved 1F1B, PipeOptim and PipeDream-2BW,
  with dropout on (so the per-rank RNG restore is exercised). Asynchronous runs drain at every save, so
  both runs drain at the same iterations.
- Resharding: a TP=2 x PP=2 checkpoint loaded under TP=1 x PP=1 x DP=4 and TP=1 x PP=4, and that PP=4
  checkpoint loaded back under TP=2 x PP=2; an interleaved (virtual pipeline) one under plain PP=2.
  Load + save under DP=4, resp. plain PP=2, reproduces every tensor (weights and optimizer state)
  exactly; under every new layout the next iteration's loss matches the original layout's within 1e-5
  and the updated weights within 5e-6 (fp32, different reduction orders, one AdamW step; measured
  2.4e-7 and 5.8e-7; a fresh optimizer would move them by ~lr = 1e-3).
- The padded vocabulary may change with the layout (re-padded on load); --bf16 checkpoints hold the
  fp32 main params and resume bit for bit.
- --use-distributed-optimizer: each rank writes its shard pieces into the per-parameter tensors. Resume
  is bit-exact (DP=2 fp32 and bf16, async PipeOptim PP=2 x DP=2, fp16 PipeOptim with per-stage loss
  scales); a DP=2 checkpoint loads under plain DP=1 and sharded DP=4, TP=2 x DP=2, PP=2 x DP=2 (every
  consolidated tensor equal after load + save; next loss within 1e-5, weights within 5e-6).
- A save SIGKILLed while `iter_N.partial/` exists leaves the previous checkpoint published and loadable.
- Bad --load (missing, other model shape, truncated files, other optimizer) -> exit code 2 on every
  rank and one line naming the problem, even when only one rank can see it.
"""

import contextlib
import importlib
import io
import json
import os
import shutil
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it: ~1.3 s once here instead of in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise ~1.3 s)
from cli_args import flags_to_argv
from dist_harness import run_distributed

from megatron_po.distributed.checkpoint_format import TRACKER, find_checkpoint, list_iterations, read_tracker
from megatron_po.distributed.checkpoint_load import read_full_checkpoint
from megatron_po.distributed.checkpoint_save import rotate_checkpoints
from megatron_po.errors import ConfigError, UserError
from megatron_po.training import run_main

importlib.import_module("megatron_po.data.gpt_dataset")  # likewise (training imports it lazily)


TINY = {"--num-layers": 4, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 32,
        "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 20, "--lr": 2e-3, "--min-lr": 2e-4,
        "--lr-warmup-iters": 2, "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": 100,
        "--make-vocab-size-divisible-by": 64, "--log-interval": 1, "--eval-interval": 100, "--eval-iters": 1,
        "--hidden-dropout": 0.1, "--attention-dropout": 0.1, "--seed": 5}


def tiny_args(out, **overrides):
    """argv of a tiny run writing its metrics (and data cache) under `out`."""
    os.makedirs(out, exist_ok=True)
    args = dict(TINY, **{"--data-cache-path": os.path.join(out, "cache"),
                         "--metrics-file": os.path.join(out, "metrics.jsonl")})
    args.update(overrides)
    return flags_to_argv(args)


def run_capturing(argv):
    """run_main on this rank; (exit code, what it printed to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(argv)
    return code, err.getvalue()


def train(out, world, **flags):
    """Run to completion; the logged records."""
    results = run_distributed(run_capturing, world, args=(tiny_args(out, **flags),), timeout=240)
    assert [c for c, _ in results] == [0] * world, results
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(records):
    return [r["lm_loss"] for r in records if "lm_loss" in r]


# ---- resume ------------------------------------------------------------------------------------------

METHODS = {
    "1f1b": {"--pipeline-model-parallel-size": 2},
    "interleaved": {"--pipeline-model-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1},
    "pipeoptim": {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
                  "--untie-embeddings-and-output-weights": True},
    "pipedream-2bw": {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipedream-2bw",
                      "--async-update-interval": 2, "--untie-embeddings-and-output-weights": True},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_resume_is_bit_exact_and_rotation_keeps_last(method, tmp_path):
    flags = dict(METHODS[method], **{"--save-interval": 5, "--global-batch-size": 4})  # 2 micro-batches
    ckpt = str(tmp_path / "ckpt")
    straight = losses(train(str(tmp_path / "straight"), 2, **flags, **{"--save": ckpt, "--keep-last": 3}))
    assert len(straight) == 20
    assert list_iterations(ckpt) == [10, 15, 20] and read_tracker(ckpt) == 20  # 5 rotated away
    # The resumed run saves elsewhere with the same interval, so an async pipeline drains at 15 as well.
    resumed = losses(train(str(tmp_path / "resumed"), 2, **flags,
                           **{"--load": ckpt, "--ckpt-step": 10, "--save": str(tmp_path / "ckpt2")}))
    assert resumed == straight[10:]  # bit for bit


# ---- resharding --------------------------------------------------------------------------------------

LAYOUTS = {"tp2pp2": (4, {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2}),
           "dp4": (4, {}),
           "pp4": (4, {"--pipeline-model-parallel-size": 4}),
           "pp2-interleaved": (2, {"--pipeline-model-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1}),
           "pp2": (2, {"--pipeline-model-parallel-size": 2})}


def load_and_resave(argv, src, step, dst):
    """Build this layout's model and optimizer as pretrain does, load `src` at `step`, save to `dst`."""
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    from megatron_po.config import parse_args, virtual_pipeline_size
    from megatron_po.data.tokenizer import build_tokenizer
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.gpt_workload import build_model_chunks
    from megatron_po.tensor_parallel import pad_vocab_size
    from megatron_po.training_setup import build_optimizer_for
    cfg = parse_args(argv)
    p = cfg.parallel
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 virtual_pipeline_size(cfg) if p.num_layers_per_virtual_pipeline_stage else None)
    if cfg.model.num_experts is not None:  # MoE (tests/test_moe_checkpoint.py)
        ps.initialize_expert_parallel(p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model, cfg.data.vocab_size)
    chunks = build_model_chunks(cfg, pad_vocab_size(tok.vocab_size, cfg.model.make_vocab_size_divisible_by,
                                                    p.tensor_model_parallel_size))
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), p.ddp_bucket_size,
                                  use_distributed_optimizer=cfg.precision.use_distributed_optimizer)
    optimizer = build_optimizer_for(cfg, chunks, ddp)
    extra = load_checkpoint(src, chunks, optimizer, step=step)
    save_checkpoint(dst, step, chunks, optimizer, extra)
    dist.barrier()


def read_all(root, step):
    """Every tensor of a checkpoint (model.* and optimizer.*), consolidated in this process."""
    return read_full_checkpoint(root, step, prefix="", progress=False)[0]


def model_weights(root, step):
    return read_full_checkpoint(root, step, prefix="model.", progress=False)[0]


def assert_close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    assert worst <= atol, worst


def test_reshard_tp2pp2_to_dp4_pp4_and_back_and_interleaved_to_plain(tmp_path):
    def out(name):
        return str(tmp_path / name)

    def layout(name, **flags):
        # No dropout: under another layout the random generators are freshly seeded (per-rank streams
        # do not map across layouts), which would change the masks.
        world, base = LAYOUTS[name]
        return world, {**base, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--lr-decay-iters": 4, **flags}

    # Reference: TP=2 x PP=2 for 4 iterations, a checkpoint after each.
    world, flags = layout("tp2pp2")
    ref = losses(train(out("ref"), world, **flags, **{"--train-iters": 4, "--save-interval": 1, "--save": out("ck_ref")}))

    # Load + save under another layout reproduces every tensor, optimizer state included (TP shards
    # gathered, pipeline stages merged).
    world, flags = layout("dp4")
    run_distributed(load_and_resave, world, args=(tiny_args(out("re_dp4"), **flags), out("ck_ref"), 2,
                                                  out("ck_re_dp4")), timeout=120)
    a, b = read_all(out("ck_ref"), 2), read_all(out("ck_re_dp4"), 2)
    assert any(k.startswith("optimizer.") and k.endswith(".exp_avg_sq") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The next iteration under the new layout: same loss and the same updated weights (optimizer state
    # loaded: a fresh Adam would move every weight by ~lr).
    for name in ("dp4", "pp4"):
        world, flags = layout(name)
        got = losses(train(out(name), world, **flags, **{"--train-iters": 3, "--load": out("ck_ref"),
                                                          "--ckpt-step": 2, "--save": out(f"ck_{name}")}))
        assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (name, got, ref)
        assert_close(model_weights(out(f"ck_{name}"), 3), model_weights(out("ck_ref"), 3), 5e-6)

    # And back: the PP=4 checkpoint of iteration 3 under TP=2 x PP=2.
    world, flags = layout("tp2pp2")
    got = losses(train(out("back"), world, **flags, **{"--train-iters": 4, "--load": out("ck_pp4"),
                                                        "--save": out("ck_back")}))
    assert len(got) == 1 and abs(got[0] - ref[3]) <= 1e-5, (got, ref)
    assert_close(model_weights(out("ck_back"), 4), model_weights(out("ck_ref"), 4), 5e-6)

    # Interleaved (virtual pipeline) checkpoint -> plain PP=2.
    world, flags = layout("pp2-interleaved")
    inter = losses(train(out("inter"), world, **flags, **{"--train-iters": 3, "--save-interval": 1,
                                                           "--save": out("ck_inter")}))
    world, flags = layout("pp2")
    run_distributed(load_and_resave, world, args=(tiny_args(out("re_pp2"), **flags), out("ck_inter"), 2,
                                                  out("ck_re_pp2")), timeout=120)
    a, b = read_all(out("ck_inter"), 2), read_all(out("ck_re_pp2"), 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got = losses(train(out("plain"), world, **flags, **{"--train-iters": 3, "--load": out("ck_inter"),
                                                         "--ckpt-step": 2, "--save": out("ck_plain")}))
    assert len(got) == 1 and abs(got[0] - inter[2]) <= 1e-5, (got, inter)
    assert_close(model_weights(out("ck_plain"), 3), model_weights(out("ck_inter"), 3), 5e-6)


# ---- distributed optimizer ---------------------------------------------------------------------------

# Small buckets (the tiny GPT has ~21k parameters): several buckets, and DP shards that cut through
# parameters, so a parameter's optimizer state lies on two ranks.
DISTOPT = {"--use-distributed-optimizer": True, "--ddp-bucket-size": 3000}

DISTOPT_RESUME = {
    "dp2": (2, {}),
    "dp2-bf16": (2, {"--bf16": True}),
    "muon-dp2": (2, {"--optimizer": "muon"}),  # momentum and muon_update shards; the U gather on resume
    "interleaved-pp2-dp2": (4, {"--pipeline-model-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1}),
    "pipeoptim-pp2-dp2": (4, {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
                              "--untie-embeddings-and-output-weights": True}),
    # Per-stage loss scales (grad_scaler.stage<vs>), after growing once (window 2) on both stages.
    "pipeoptim-pp2-fp16": (2, {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
                               "--untie-embeddings-and-output-weights": True, "--fp16": True,
                               "--initial-loss-scale": 1024, "--loss-scale-window": 2}),
}


@pytest.mark.parametrize("case", list(DISTOPT_RESUME))
def test_distributed_optimizer_resume_is_bit_exact(case, tmp_path):
    """Each rank writes its shard pieces of the fp32 main params and optimizer state into the
    per-parameter tensors; resuming under the same layout continues bit for bit (dropout on)."""
    world, flags = DISTOPT_RESUME[case]
    flags = {**DISTOPT, **flags, "--train-iters": 6, "--save-interval": 3, "--global-batch-size": 4 * world}
    ckpt = str(tmp_path / "ckpt")
    straight = losses(train(str(tmp_path / "straight"), world, **flags, **{"--save": ckpt}))
    resumed = losses(train(str(tmp_path / "resumed"), world, **flags, **{"--load": ckpt, "--ckpt-step": 3,
                                                                          "--save": str(tmp_path / "ckpt2")}))
    assert len(straight) == 6 and resumed == straight[3:]
    if "--fp16" in flags:  # each virtual stage's own loss scale, grown from 1024 by the window of 2
        from megatron_po.distributed.checkpoint_dcp import dcp_load
        from megatron_po.distributed.checkpoint_format import checkpoint_dir
        scalers = {f"grad_scaler.stage{vs}": b"" for vs in range(2)}
        dcp_load(scalers, checkpoint_dir(ckpt, 3))
        assert all(v["scale"] > 1024 for v in scalers.values()), scalers


def test_distributed_optimizer_reshards_to_plain_other_dp_tp_and_pp(tmp_path):
    """A --use-distributed-optimizer DP=2 checkpoint holds full per-parameter tensors, like a plain one:

    - load + save under the plain optimizer at DP=1 and the distributed one at DP=4 reproduces every
      tensor (weights and optimizer state, consolidated) bit for bit, and so does loading that plain
      checkpoint back into the distributed optimizer at DP=2;
    - the next iteration under plain DP=1, distributed DP=4, TP=2 x DP=2 and PP=2 x DP=2 has the original
      layout's loss within 1e-5 and its updated weights within 5e-6 (fp32, other reduction orders, one
      AdamW step; a fresh optimizer would move them by ~lr = 2e-3)."""
    def out(name):
        return str(tmp_path / name)

    nodrop = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--lr-decay-iters": 4}
    ref = losses(train(out("ref"), 2, **nodrop, **DISTOPT, **{"--train-iters": 4, "--save-interval": 1,
                                                              "--save": out("ck_ref")}))
    original = read_all(out("ck_ref"), 2)
    assert any(k.startswith("optimizer.") and k.endswith(".exp_avg_sq") for k in original)
    for name, world, flags, src in [("plain_dp1", 1, {}, "ck_ref"), ("distopt_dp4", 4, DISTOPT, "ck_ref"),
                                    ("distopt_dp2", 2, DISTOPT, "ck_re_plain_dp1")]:
        run_distributed(load_and_resave, world, timeout=120,
                        args=(tiny_args(out(f"re_{name}"), **nodrop, **flags), out(src), 2, out(f"ck_re_{name}")))
        again = read_all(out(f"ck_re_{name}"), 2)
        assert again.keys() == original.keys(), name
        assert all(torch.equal(again[k], original[k]) for k in original), name

    for name, world, flags in [("plain_dp1", 1, {}), ("distopt_dp4", 4, DISTOPT),
                               ("distopt_tp2", 4, {**DISTOPT, "--tensor-model-parallel-size": 2}),
                               ("distopt_pp2", 4, {**DISTOPT, "--pipeline-model-parallel-size": 2})]:
        got = losses(train(out(name), world, **nodrop, **flags, **{"--train-iters": 3, "--load": out("ck_ref"),
                                                                    "--ckpt-step": 2, "--save": out(f"ck_{name}")}))
        assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (name, got, ref)
        assert_close(model_weights(out(f"ck_{name}"), 3), model_weights(out("ck_ref"), 3), 5e-6)


def test_flat_ranges_split_into_contiguous_blocks():
    """A distributed-optimizer piece (a flat range of a parameter) is written as rectangular blocks of
    the parameter that are contiguous in memory and cover the range exactly once."""
    import math

    from megatron_po.distributed.checkpoint_dcp import _blocks
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        n = math.prod(shape)
        numbered = torch.arange(n).view(shape)
        for a in range(n + 1):
            for b in range(a, n + 1):
                covered = []
                for start, offsets, sizes in _blocks(shape, a, b):
                    block = numbered[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].reshape(-1).tolist()
                    assert block == list(range(start, start + math.prod(sizes)))  # contiguous from `start`
                    covered += block
                assert sorted(covered) == list(range(a, b)) and len(_blocks(shape, a, b)) <= 2 * len(shape) - 1


# ---- atomicity ---------------------------------------------------------------------------------------

def _free_port():
    from dist_harness import free_port
    return free_port()


def _rank_main(rank, port, argv):
    """One rank of a forked run (its own process group, from the torchrun-style environment)."""
    import sys
    sys.stderr = open(os.devnull, "w")  # the killed run's traceback is expected noise
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, MEGATRON_PO_TEST_SAVE_PAUSE="4:120:1")
    torch.set_num_threads(1)
    os._exit(run_main(argv))


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path):
    import multiprocessing as mp
    ckpt = tmp_path / "ckpt"
    argv = tiny_args(str(tmp_path / "killed"), **{"--pipeline-model-parallel-size": 2, "--train-iters": 6,
                                                   "--save-interval": 2, "--save": str(ckpt),
                                                   "--distributed-timeout-minutes": 0.5})
    port = str(_free_port())
    procs = [mp.get_context("fork").Process(target=_rank_main, args=(rank, port, argv)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        # Iteration 4's files are all in iter_0000004.partial/ (DCP writes .metadata last), unpublished;
        # rank 1 sleeps there (MEGATRON_PO_TEST_SAVE_PAUSE) while rank 0 waits to publish.
        marker = ckpt / "iter_0000004.partial" / ".metadata"
        deadline = time.time() + 120
        while not marker.exists():
            assert time.time() < deadline and all(p.is_alive() for p in procs), "save of iteration 4 never began"
            time.sleep(0.05)
        procs[1].kill()  # SIGKILL
        procs[1].join()
        # Rank 0 waits at the barrier before publishing; its peer dies: it must fail, not publish.
        procs[0].join(timeout=60)
        assert procs[0].exitcode not in (None, 0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert read_tracker(str(ckpt)) == 2 and list_iterations(str(ckpt)) == [2]
    assert (ckpt / "iter_0000004.partial").exists()

    resumed = train(str(tmp_path / "resumed"), 2, **{"--pipeline-model-parallel-size": 2, "--train-iters": 6,
                                                     "--save-interval": 2, "--save": str(ckpt), "--load": str(ckpt)})
    assert [r["iteration"] for r in resumed if "lm_loss" in r] == [3, 4, 5, 6]  # picked iteration 2
    assert list_iterations(str(ckpt)) == [2, 4, 6] and not (ckpt / "iter_0000004.partial").exists()


# ---- flags and bad checkpoints -----------------------------------------------------------------------

SMALL = {"--num-layers": 2, "--pipeline-model-parallel-size": 2, "--train-iters": 2, "--eval-interval": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A PP=2 checkpoint of iteration 2 (2 layers), with the validation loss of its weights."""
    d = tmp_path_factory.mktemp("saved")
    records = train(str(d / "run"), 2, **SMALL, **{"--save": str(d / "ckpt")})
    return {"ckpt": str(d / "ckpt"), "val_loss": records[-1]["val_loss"], "dir": d}


def failing_load(tmp_path, world, ckpt, **flags):
    """Every rank exits with code 2; the one error line rank 0 printed."""
    results = run_distributed(run_capturing, world, timeout=60,
                              args=(tiny_args(str(tmp_path / "bad"), **{**SMALL, **flags, "--load": ckpt}),))
    assert [c for c, _ in results] == [2] * world, results
    lines = [ln for ln in results[0][1].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in results[0][1], results[0][1]
    return lines[0]


def damaged_copy(saved, tmp_path, damage):
    ckpt = str(tmp_path / "damaged")
    shutil.copytree(saved["ckpt"], ckpt)
    damage(os.path.join(ckpt, "iter_0000002"))
    return ckpt


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def garble(path):
    with open(path, "r+b") as f:
        f.write(b"\0" * 64)


def garble_a_tensor(end: bool):
    """Zeros over 32 bytes of the first tensor entry stored in __1_0.distcp: its start (the zip header: torch.load
    reads the bytes as a bare pickle, whose opcode 0 its weights-only unpickler refuses) or its end (the zip's
    central directory: torch.load's RuntimeError)."""
    def damage(d, file="__1_0.distcp"):
        from megatron_po.distributed.checkpoint_trust import load_metadata
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        md = load_metadata(os.path.join(d, ".metadata"))
        info = min((info for index, info in md.storage_data.items() if info.relative_path == file
                    and isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata)), key=lambda i: i.offset)
        with open(os.path.join(d, file), "r+b") as f:
            f.seek(info.offset + info.length - 32 if end else info.offset)
            f.write(b"\0" * 32)
    return damage


BAD_LOADS = {
    # case: (world, flags, damage, words the error line must hold)
    "missing-path": (1, {"--pipeline-model-parallel-size": 1}, "nowhere", ["no such directory", "nowhere"]),
    "missing-step": (2, {"--ckpt-step": 7}, None, ["--ckpt-step 7", "available: 2"]),
    "other-shape": (2, {"--hidden-size": 64}, None,
                    ["embedding.word_embeddings.weight", "(128, 32)", "(128, 64)"]),
    # Only rank 1 (layers 2-3) lacks its parameters: rank 0 must fail too, with rank 1's reason.
    "only-last-stage-misfits": (2, {"--num-layers": 4}, None, ["layers.2.", "not in the checkpoint"]),
    "extra-params": (1, {"--num-layers": 1, "--pipeline-model-parallel-size": 1}, None, ["layers.1.", "lacks"]),
    "truncated-shard": (2, {}, lambda d: truncate(os.path.join(d, "__1_0.distcp")), ["__1_0.distcp", "truncated"]),
    "truncated-metadata": (2, {}, lambda d: truncate(os.path.join(d, ".metadata")), [".metadata", "corrupt"]),
    # Same size, garbled start: its checksum names it (the rank verifying that file; the ranks agree) ...
    "garbled-shard": (2, {}, lambda d: garble(os.path.join(d, "__1_0.distcp")), ["__1_0.distcp", "corrupt", "SHA-256"]),
    # ... and without the check only the ranks that read it notice; DCP shares the failure.
    "garbled-shard-unverified": (2, {"--no-verify-checkpoint": True}, lambda d: garble(os.path.join(d, "__1_0.distcp")),
                                 ["cannot read the checkpoint", "__1_0.distcp: entry '", "' is corrupt"]),
    # ... a tensor entry's too (its zip header garbled: torch.load's error, named by file and entry).
    "garbled-tensor-start-unverified": (2, {"--no-verify-checkpoint": True}, garble_a_tensor(end=False),
                                        ["__1_0.distcp: entry 'model.", "' refused: ", "opcode 0 (corrupt bytes"]),
    "garbled-tensor-end-unverified": (2, {"--no-verify-checkpoint": True}, garble_a_tensor(end=True),
                                      ["cannot read the checkpoint", "__1_0.distcp: entry 'model.",
                                       "' is corrupt (RuntimeError: "]),
    "other-optimizer": (2, {"--optimizer": "sgd"}, None, ["SGD", "--no-load-optim"]),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_bad_load_fails_every_rank_with_one_line(case, saved, tmp_path):
    world, flags, damage, needles = BAD_LOADS[case]
    if damage == "nowhere":
        ckpt = str(tmp_path / "nowhere")
    elif damage is not None:
        ckpt = damaged_copy(saved, tmp_path, damage)
    else:
        ckpt = saved["ckpt"]
    line = failing_load(tmp_path, world, ckpt, **flags)
    for n in needles:
        assert n in line, line


def test_finetune_loads_weights_only_and_restarts_at_zero(saved, tmp_path):
    # SGD would not accept the saved AdamW state: --finetune must not load it. With lr 0 the weights stay
    # those of the checkpoint, so the validation loss after iteration 1 is the checkpoint's, exactly.
    records = train(str(tmp_path / "ft"), 2, **{**SMALL, "--load": saved["ckpt"], "--finetune": True,
                                                "--optimizer": "sgd", "--lr": 0.0, "--min-lr": 0.0,
                                                "--lr-warmup-iters": 0, "--train-iters": 1, "--eval-interval": 1})
    assert [r["iteration"] for r in records] == [1]
    assert records[0]["val_loss"] == saved["val_loss"]


def test_no_load_optim_and_rng_resume_at_the_saved_iteration(saved, tmp_path):
    records = train(str(tmp_path / "nlo"), 2, **{**SMALL, "--load": saved["ckpt"], "--no-load-optim": True,
                                                 "--no-load-rng": True, "--optimizer": "sgd", "--train-iters": 3})
    assert [r["iteration"] for r in records if "lm_loss" in r] == [3]


def test_find_checkpoint_and_rotation(tmp_path):
    root = str(tmp_path)
    for it in (1, 2, 3, 4):
        os.makedirs(os.path.join(root, f"iter_{it:07d}"))
    os.makedirs(os.path.join(root, "iter_0000005.partial"))  # a crashed save is never picked
    assert find_checkpoint(root) == 4  # tracker lost (crash before it was first written): newest published
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("2")
    assert find_checkpoint(root) == 2 and find_checkpoint(root, 3) == 3
    with pytest.raises(UserError, match="--ckpt-step 9.*available: 1, 2, 3, 4"):
        find_checkpoint(root, 9)
    assert rotate_checkpoints(root, 1) == [1, 3]  # keeps the newest (4) and the tracked one (2)
    assert list_iterations(root) == [2, 4]


@pytest.mark.parametrize("flags, needle", [
    (["--keep-last", "2"], "--keep-last needs --save"),
    (["--save", "x", "--keep-last", "0"], "--keep-last must be >= 1"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--finetune"], "--finetune needs --load"),
])
def test_checkpoint_flag_rules(flags, needle):
    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", *flags])
    with pytest.raises(ConfigError, match=needle):
        validate(cfg, 1)


@pytest.mark.parametrize("world, flags, rows", [
    (1, {"--pipeline-model-parallel-size": 1, "--make-vocab-size-divisible-by": 16}, 112),  # fewer rows
    (2, {"--pipeline-model-parallel-size": 1, "--tensor-model-parallel-size": 2,
         "--make-vocab-size-divisible-by": 24}, 144),  # more rows, split over TP ranks
    (2, {"--pipeline-model-parallel-size": 1, "--make-vocab-size-divisible-by": 16, **DISTOPT}, 112),  # DP shards
])
def test_vocabulary_padding_may_change_with_the_layout(saved, tmp_path, world, flags, rows):
    """The padded vocabulary (a multiple of --make-vocab-size-divisible-by x TP) of the 128-row checkpoint
    changes under another layout: the 101 real rows (and their optimizer state) load unchanged, padding
    rows are kept where both have them and start at zero where only the new layout has them."""
    run_distributed(load_and_resave, world, timeout=120,
                    args=(tiny_args(str(tmp_path / "run"), **{**SMALL, **flags}), saved["ckpt"], 2, str(tmp_path / "ck")))
    old, new = read_all(saved["ckpt"], 2), read_all(str(tmp_path / "ck"), 2)
    assert old.keys() == new.keys()
    vocab_keys = [k for k in old if k.startswith(("model.embedding.word_embeddings.weight",
                                                  "optimizer.embedding.word_embeddings.weight.exp_avg"))]
    assert len(vocab_keys) == 3  # weight, exp_avg, exp_avg_sq
    for k in old:
        if k in vocab_keys:
            keep = min(rows, 128)
            assert new[k].shape[0] == rows and torch.equal(new[k][:keep], old[k][:keep]) and not new[k][keep:].any(), k
        else:
            assert torch.equal(new[k], old[k]), k


def test_bf16_checkpoint_keeps_fp32_main_params_and_resumes_exactly(tmp_path):
    """With --bf16 the checkpoint's weights are the optimizer's fp32 main params (not the rounded model
    copy), so resuming continues bit for bit, and the same checkpoint loads into an fp32 run."""
    flags = {"--pipeline-model-parallel-size": 2, "--bf16": True, "--train-iters": 6, "--save-interval": 3,
             "--global-batch-size": 4}
    ckpt = str(tmp_path / "ckpt")
    straight = losses(train(str(tmp_path / "straight"), 2, **flags, **{"--save": ckpt}))
    weights = model_weights(ckpt, 3)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any((w != w.to(torch.bfloat16).float()).any() for w in weights.values())  # not bf16-rounded
    resumed = losses(train(str(tmp_path / "resumed"), 2, **flags, **{"--load": ckpt, "--ckpt-step": 3,
                                                                      "--save": str(tmp_path / "ckpt2")}))
    assert resumed == straight[3:]
    fp32 = {k: v for k, v in flags.items() if k not in ("--bf16", "--save-interval")}
    assert len(losses(train(str(tmp_path / "fp32"), 2, **fp32, **{"--load": ckpt, "--ckpt-step": 3}))) == 3
