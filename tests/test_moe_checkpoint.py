"""Checkpoints of MoE models (issue 48 item 5): experts sharded by EP, resumed bit for bit, loaded under other
expert layouts.

Tiny MoE GPTs (4 experts, top-2, sigmoid scores with DeepSeek-V3's expert bias, aux loss and z-loss) on mock data
through `training.run_main` on forked gloo ranks, as tests/test_checkpoint.py does for the dense model.

- Each expert-parallel rank writes its experts as a block of the global [num_experts, ...] tensor (its slice of the
  ffn dim under expert TP), so the checkpoint holds the same tensors whatever the layout: the consolidated
  checkpoint has every expert tensor at its global shape, and the expert bias (a buffer) beside the weights.
- Resume is bit-exact: 6 iterations (saving every 3) against loading iteration 3 and running 3 more, under EP = 2
  (fp32, dropout on), PP = 2 x EP = 2 in bf16 (fp32 main params of the experts) and PipeOptim at PP = 2 x DP = 2
  with the distributed optimizer (experts sharded over their expert-data-parallel group); the expert bias has
  moved.
  Safe load is unchanged: the checkpoint's non-tensor entries are all JSON documents of the dense kinds.
- Another layout: an EP = 2 checkpoint loaded and saved again under EP = 4, TP = 2 x ETP = 1 x EP = 2 and
  TP = 1 x ETP = 2 x EP = 2 reproduces every tensor exactly (weights, expert bias, optimizer state); the next
  iteration under EP = 1 (one process), EP = 4 and TP = 2 x ETP = 2 x EP = 2 gives the reference's loss within
  1e-5 and its updated weights within 5e-6 (fp32, other reduction orders, one AdamW step; measured 2.4e-7 and
  9.3e-9; without the optimizer state the weights are 3.5e-3 off).
- The distributed optimizer's layout (its expert sharding over the expert-data-parallel group is issue 48 item 4):
  `FlatRange` pieces of expert tensors, cut inside rows over EDP = 2, land in the global tensor and load back under
  other EP x ETP layouts.
"""

import os

import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import assert_close, load_and_resave, losses, model_weights, read_all, tiny_args, train
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_po.distributed import checkpoint_data
from megatron_po.distributed.checkpoint_format import checkpoint_dir

MOE = {"--num-layers": 2, "--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 16,
       "--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": True,
       "--moe-router-bias-update-rate": 0.01, "--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001,
       "--disable-bias-linear": True}
EXPERTS = ("mlp.experts.fc1", "mlp.experts.fc1_gate", "mlp.experts.fc2")
JSON_KINDS = {"extra", "layout", "optimizer_type", "optimizer_state_keys", "rng", "grad_scaler",
              "policy_steps", "policy_lr_steps"}  # the last two: asynchronous pipelines' (dense ones too)


# ---- resume --------------------------------------------------------------------------------------------

RESUME = {
    "ep2": (2, {"--expert-model-parallel-size": 2}),
    "pp2-ep2-bf16": (4, {"--pipeline-model-parallel-size": 2, "--expert-model-parallel-size": 2, "--bf16": True,
                         "--swiglu": True}),
    # PipeOptim with the experts sharded over their expert-data-parallel group (EP 1 x DP 2) by the distributed
    # optimizer: the stream drains at each save, the policy's and the optimizer's pieces come back
    "pp2-dp2-pipeoptim-distributed-optimizer": (4, {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
                                                    "--untie-embeddings-and-output-weights": True,
                                                    "--use-distributed-optimizer": True}),
}


@pytest.mark.parametrize("case", list(RESUME))
def test_resume_is_bit_exact(case, tmp_path):
    world, flags = RESUME[case]
    flags = {**MOE, **flags, "--train-iters": 6, "--save-interval": 3, "--global-batch-size": 4 * world // 2}
    ckpt = str(tmp_path / "ckpt")
    straight = losses(train(str(tmp_path / "straight"), world, **flags, **{"--save": ckpt}))
    resumed = losses(train(str(tmp_path / "resumed"), world, **flags, **{"--load": ckpt, "--ckpt-step": 3,
                                                                          "--save": str(tmp_path / "ckpt2")}))
    assert len(straight) == 6 and resumed == straight[3:]  # bit for bit
    saved = read_all(ckpt, 3)
    for layer in range(2):  # every expert at its global shape
        assert saved[f"model.layers.{layer}.mlp.experts.fc1"].shape == (4, 16, 32)
        assert saved[f"model.layers.{layer}.mlp.experts.fc2"].shape == (4, 32, 16)
        assert saved[f"optimizer.layers.{layer}.mlp.experts.fc1.exp_avg_sq"].shape == (4, 16, 32)
    # the biases saved after they moved (a layer's may be back at 0: the sign update's +rate, then -rate)
    assert any(saved[f"model.layers.{layer}.mlp.router.expert_bias"].abs().max() > 0 for layer in range(2))
    if "--bf16" in flags:  # the fp32 main params, as for dense weights
        assert saved["model.layers.0.mlp.experts.fc1_gate"].dtype == torch.float32
    assert_no_pickles(checkpoint_dir(ckpt, 3))


def assert_no_pickles(path):
    """Safe load unchanged: every entry that is not a tensor is one of our JSON documents (checkpoint_data.py),
    of the kinds a dense checkpoint holds; the experts and the expert bias are tensors."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_po.distributed.checkpoint_trust import load_metadata
    md = load_metadata(os.path.join(path, ".metadata"))
    entries = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert entries and all(k.split(".")[0] in JSON_KINDS for k in entries), entries
    for index, info in md.storage_data.items():
        if index.fqn in entries:
            with open(os.path.join(path, info.relative_path), "rb") as f:
                f.seek(info.offset)
                checkpoint_data.loads(f.read(info.length))  # raises unless it is JSON we wrote
    assert all(isinstance(md.state_dict_metadata[k], TensorStorageMetadata)
               for k in md.state_dict_metadata if k.startswith("model.") and ("experts" in k or "router" in k))


# ---- other layouts ------------------------------------------------------------------------------------

LAYOUTS = {"ep1": (1, {}),
           "ep4": (4, {"--expert-model-parallel-size": 4}),
           "tp2-etp1-ep2": (4, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                "--expert-tensor-parallel-size": 1, "--expert-model-parallel-size": 2}),
           "tp1-etp2-ep2": (4, {"--expert-tensor-parallel-size": 2, "--expert-model-parallel-size": 2}),
           "tp2-etp2-ep2": (4, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                "--expert-model-parallel-size": 2})}


def layout(name, **flags):
    """No dropout: under another layout the random generators are freshly seeded."""
    world, base = LAYOUTS[name]
    return world, {**MOE, "--swiglu": True, **base, "--hidden-dropout": 0.0, "--attention-dropout": 0.0,
                   "--lr-decay-iters": 4, **flags}


def test_ep2_checkpoint_loads_under_other_expert_layouts(tmp_path):
    def out(name):
        return str(tmp_path / name)

    # Reference: EP = 2 on 2 ranks for 3 iterations, a checkpoint after each.
    world, flags = layout("ep1", **{"--expert-model-parallel-size": 2})
    ref = losses(train(out("ref"), 2, **flags, **{"--train-iters": 3, "--save-interval": 1, "--save": out("ck_ref")}))
    a = read_all(out("ck_ref"), 2)
    assert all(f"model.layers.1.{e}" in a and f"optimizer.layers.1.{e}.exp_avg" in a for e in EXPERTS)

    # Load + save under another layout reproduces every tensor, the expert bias and optimizer state included.
    for name in ("ep4", "tp2-etp1-ep2", "tp1-etp2-ep2"):
        world, flags = layout(name)
        run_distributed(load_and_resave, world, args=(tiny_args(out(f"re_{name}"), **flags), out("ck_ref"), 2,
                                                      out(f"ck_re_{name}")), timeout=120)
        b = read_all(out(f"ck_re_{name}"), 2)
        assert a.keys() == b.keys(), (name, a.keys() ^ b.keys())
        assert all(torch.equal(a[k], b[k]) for k in a), (name, [k for k in a if not torch.equal(a[k], b[k])])

    # The next iteration under the new layout: the reference's loss and updated weights.
    for name in ("ep1", "ep4", "tp2-etp2-ep2"):
        world, flags = layout(name)
        got = losses(train(out(name), world, **flags, **{"--train-iters": 3, "--load": out("ck_ref"),
                                                          "--ckpt-step": 2, "--save": out(f"ck_{name}")}))
        assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (name, got, ref)
        assert_close(model_weights(out(f"ck_{name}"), 3), model_weights(out("ck_ref"), 3), 5e-6)



# ---- pieces of experts (the distributed optimizer's layout) -------------------------------------------

GLOBAL = torch.arange(4 * 4 * 6, dtype=torch.float32).view(4, 4, 6)  # [experts, ffn, hidden]


def _expert_piece(path, ep, etp, save):
    """This rank's experts of GLOBAL (EP x ETP x EDP over 4 ranks, ffn split over ETP) as the `FlatRange` piece a
    distributed optimizer over the expert-data-parallel group would own: under EDP = 2 the first or the rest of the
    flattened local tensor, cut inside a row; saved, or loaded into zeros and returned with the local tensor."""
    import torch.distributed as dist

    from megatron_po import parallel_state as ps
    from megatron_po.distributed.checkpoint_dcp import FlatRange, dcp_load, dcp_save
    from megatron_po.models.moe.experts import _mark
    from megatron_po.models.moe.layout import local_experts
    ps.initialize_expert_parallel(ep, etp)
    experts = local_experts(4, ep, ps.get_expert_model_parallel_rank())
    f = 4 // etp
    rows = slice(ps.get_expert_tensor_parallel_rank() * f, (ps.get_expert_tensor_parallel_rank() + 1) * f)
    p = _mark(torch.nn.Parameter(GLOBAL[experts.start:experts.stop, rows].clone()), etp, 1)
    edp = ps.get_expert_data_parallel_group()
    cut = p.numel() // 2 + 1
    if dist.get_world_size(edp) == 1:
        lo, hi = 0, p.numel()
    else:
        lo, hi = [(0, cut), (cut, p.numel())][dist.get_rank(group=edp)]
    piece = p.detach().reshape(-1)[lo:hi].clone() if save else torch.zeros(hi - lo)
    (dcp_save if save else dcp_load)({"w": FlatRange(p, lo, piece)}, path)
    return lo, piece, p.detach()


def test_expert_pieces_of_a_distributed_optimizer_land_in_the_global_tensor(tmp_path):
    """The general mechanism the distributed optimizer's expert shards use (FlatRange pieces shifted to the rank's
    expert block): pieces saved under EP = 2 x EDP = 2 form the global tensor, and load back under ETP = 2 x EP = 2
    (each rank its whole block) and EP = 4 x ETP = 1."""
    from megatron_po.distributed.checkpoint_dcp import dcp_load
    path = str(tmp_path / "ck")
    run_distributed(_expert_piece, 4, args=(path, 2, 1, True), timeout=60)
    whole = {"w": torch.zeros(4, 4, 6)}
    dcp_load(whole, path)
    assert torch.equal(whole["w"], GLOBAL)
    for ep, etp in ((2, 2), (4, 1)):
        for lo, piece, local in run_distributed(_expert_piece, 4, args=(path, ep, etp, False), timeout=60):
            assert torch.equal(piece, local.reshape(-1)[lo:lo + piece.numel()]), (ep, etp)
