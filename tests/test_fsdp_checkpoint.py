"""FSDP2 checkpoints (--ckpt-format torch_dist): each rank writes its rows of every parameter and of its optimizer
state into the same per-parameter tensors DDP and the distributed optimizer write (distributed/checkpoint_dcp.py),
and loads them back into the shards a fresh run holds.

Tiny GPTs on mock data through `training.run_main` (test_checkpoint.py's), AdamW, fp32, no dropout:
- resume is bit-exact: FSDP2 at DP 2, 6 iterations saving every 3, against loading iteration 3 and running 3;
  asynchronous too: PipeDream-2BW at PP 2 x FSDP 2 (its older weight version, kept as shards, is checkpointed
  through the policy's entries), 8 iterations saving every 4, against loading iteration 4;
- the DP 2 checkpoint of iteration 3 loads under TP 2 x PP 2 x FSDP (DP 1: the shards cover whole TP slices):
  the next 3 losses within 1e-5 of the DP 2 run's own (measured 4.8e-7; reduction orders differ);
- it loads into DDP, then into the distributed optimizer, then back into FSDP2 at DP 2 (load + save in each): every
  tensor of the four checkpoints (weights and Adam state) equal bit for bit;
- tools/checkpoint_convert.py export-hf of the FSDP2 run's last checkpoint gives a transformers GPT-2 whose logits
  equal our model's on the consolidated weights within 1e-5.
"""

import torch
import torch._dynamo  # noqa: F401  (imported lazily by model init: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)
from dist_harness import run_distributed
from test_checkpoint import losses, read_all, tiny_args, train

FSDP = {"--use-torch-fsdp2": True}
BASE = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--global-batch-size": 8, "--num-layers": 2}


def _load_and_resave(argv, src, step, dst):
    """Build the layout of `argv` (DDP, distributed optimizer or FSDP2) as pretrain does, load `src` at `step`,
    save it to `dst`."""
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    from megatron_po.config import parse_args
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    from megatron_po.gpt_workload import build_model_chunks
    from megatron_po.training_setup import build_optimizer_for, data_parallel
    cfg = parse_args(argv)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    chunks, ddp = data_parallel(cfg, build_model_chunks(cfg, 128))
    optimizer = build_optimizer_for(cfg, chunks, ddp)
    extra = load_checkpoint(src, chunks, optimizer, step=step)
    save_checkpoint(dst, step, chunks, optimizer, extra)
    dist.barrier()


def _chain(out):
    """The FSDP2 checkpoint into DDP, the DDP one into the distributed optimizer, that one into FSDP2."""
    for src, dst, flags in ((f"{out}/ck", f"{out}/ddp", {}),
                            (f"{out}/ddp", f"{out}/distopt", {"--use-distributed-optimizer": True}),
                            (f"{out}/distopt", f"{out}/back", FSDP)):
        _load_and_resave(tiny_args(f"{out}/chain", **BASE, **flags), src, 3, dst)


def test_resume_reshard_interchange_and_export(tmp_path):
    out = str(tmp_path)
    straight = losses(train(f"{out}/s", 2, **BASE, **FSDP, **{"--train-iters": 6, "--save-interval": 3,
                                                              "--save": f"{out}/ck"}))
    resumed = losses(train(f"{out}/r", 2, **BASE, **FSDP, **{"--train-iters": 6, "--load": f"{out}/ck",
                                                             "--ckpt-step": 3, "--save": f"{out}/ck_r"}))
    assert len(straight) == 6 and resumed == straight[3:]  # bit for bit
    other = losses(train(f"{out}/tp2pp2", 4, **BASE, **FSDP, **{
        "--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2, "--train-iters": 6,
        "--load": f"{out}/ck", "--ckpt-step": 3, "--save": f"{out}/ck_tp2pp2"}))
    assert max(abs(a - b) for a, b in zip(other, straight[3:])) <= 1e-5
    run_distributed(_chain, 2, args=(out,), timeout=120)
    saved = read_all(f"{out}/ck", 3)
    assert any(k.endswith(".exp_avg_sq") for k in saved)
    for name in ("ddp", "distopt", "back"):
        again = read_all(f"{out}/{name}", 3)
        assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved), name

    from test_checkpoint_convert import our_logits
    from transformers import AutoModelForCausalLM

    from tools.checkpoint_convert import main
    assert main(["consolidate", "--load", f"{out}/ck", "--out", f"{out}/model.safetensors", "--no-progress"]) == 0
    assert main(["export-hf", "--load", f"{out}/ck", "--out", f"{out}/hf", "--no-progress"]) == 0
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, _, _ = our_logits(f"{out}/model.safetensors", ids)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(f"{out}/hf").eval()(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_async_2bw_resume_is_bit_exact(tmp_path):
    flags = {**BASE, **FSDP, "--pipeline-model-parallel-size": 2, "--pipeline-method": "pipedream-2bw",
             "--async-update-interval": 2, "--untie-embeddings-and-output-weights": True, "--save-interval": 4}
    out = str(tmp_path)
    straight = losses(train(f"{out}/s", 4, **flags, **{"--train-iters": 8, "--save": f"{out}/ck"}))
    resumed = losses(train(f"{out}/r", 4, **flags, **{"--train-iters": 8, "--load": f"{out}/ck", "--ckpt-step": 4,
                                                     "--save": f"{out}/ck_r"}))
    assert len(straight) == 8 and resumed == straight[4:]
    assert any(k.startswith("policy.") and k.endswith(".older") for k in read_all(f"{out}/ck", 4))
