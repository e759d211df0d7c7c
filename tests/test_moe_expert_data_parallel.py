"""Expert gradients are summed over the expert-data-parallel group whenever that group has more than one rank, also
where the dense data-parallel x context-parallel size is 1 (issue 54 item 6; DESIGN.md: every group's reduction
is decided by that group's own size).

The layout: TP 2 with sequence parallelism and expert TP 1 on 2 ranks (EP 1). Both TP ranks hold every expert
whole and route their own half of the tokens to them, so each holds half of every expert's gradient: expert DP 2,
dense DP 1. Before the fix nothing summed those halves (the reductions were gated on the dense DP size), and the
run drifted from the one-process run. Checked against the one-process run at the same global batch, fp32:
- synchronous, plain DDP: the loss, every gradient, the gradient norm (rtol 1e-5 / atol 1e-6, moe_harness);
- synchronous, the distributed optimizer (the experts sharded over their expert-DP group of 2): two Adam steps
  with clipping always active, the losses, the norms and every updated weight (test_moe_optimizers' tolerances);
- asynchronous (PipeOptim, one stage), the plain optimizer with the bucketed DDP, with delay compensation (the
  mean taken at the step without a buffer) and with the distributed optimizer, against the emulator on the same
  micro-batches: losses and weights rtol 1e-5 / atol 1e-6 (SGD, clipping active).
"""

from __future__ import annotations

import torch
from dist_harness import run_distributed
from moe_harness import M, check_equal, distributed_run, reference
from test_moe_async import SEQ_AUX, train_distributed, train_emulator
from test_moe_optimizers import ATOL, CLIP, sharded_run
from test_moe_optimizers import reference as optimizer_reference


def test_synchronous_ddp_sums_expert_gradients_at_dense_dp_1():
    check_equal(run_distributed(distributed_run, 2, tp=2, args=({}, 1, 1, "1f1b", 1, True)), reference(M))


def test_distributed_optimizer_sums_and_shards_experts_at_dense_dp_1():
    ref_losses, ref_norms, ref_weights = optimizer_reference("adam", 1)
    for losses, norms, weights, (stepped, local), edp, _ in run_distributed(sharded_run, 2, tp=2,
                                                                            args=("adam", 1, None, 1)):
        assert edp == 2 and 0 < stepped < local  # each TP rank steps its half of every expert
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for norm, ref in zip(norms, ref_norms):
            assert ref > CLIP and abs(norm - ref) <= 1e-5 * ref, (norms, ref_norms)
        for k, w in weights.items():
            torch.testing.assert_close(w, ref_weights[k], rtol=1e-5, atol=ATOL, msg=k)


ASYNC_VARIANTS = {"bucketed": ({}, None), "delay-compensation": ({"delay_compensation": 0.5}, None),
                  "distributed-optimizer": ({}, {"use_distributed_optimizer": True})}


ASYNC = dict(mbs=2, masked=False, clip_grad=CLIP)


def _async_variants(distributed: bool):
    """Every variant in one launch, distributed (this rank's) or emulated: {variant: (losses, weights)}."""
    if distributed:
        return {name: train_distributed("pipeoptim", "sgd", 1, 1, (6,), SEQ_AUX, options, etp=1, precision=precision,
                                        **ASYNC)[:2] for name, (options, precision) in ASYNC_VARIANTS.items()}
    return {name: train_emulator("pipeoptim", "sgd", 1, 1, 1, (6,), SEQ_AUX, options, **ASYNC)[:2]
            for name, (options, _) in ASYNC_VARIANTS.items()}


def test_asynchronous_stage_sums_expert_gradients_at_dense_dp_1():
    emulated = run_distributed(_async_variants, 1, args=(False,))[0]
    results = run_distributed(_async_variants, 2, tp=2, args=(True,), timeout=300)
    for name in ASYNC_VARIANTS:
        emu_losses, emu_weights = emulated[name]
        for losses, weights in (r[name] for r in results):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(emu_losses), rtol=1e-5, atol=1e-6,
                                       msg=name)
            assert weights.keys() == emu_weights.keys()
            for k in weights:
                torch.testing.assert_close(weights[k], emu_weights[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
