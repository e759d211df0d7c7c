"""How far the formula replay (test_async_policies.replay) lands from a recorded run, against its tolerance.

The case of tests/test_mtp.py::test_async_updates_follow_the_method_formula_with_mtp[pipeoptim-D2v1]: PipeOptim,
Adam, 2 stages, s_offset 1, test_moe_async's MoE GPT with one MTP depth, segments of 6 and 6 micro-batches. Instead
of stopping at the first value over the tolerance (rtol 1e-4 / atol 1e-5), it prints, per stage and kind of check,
the largest |difference| and the largest difference / tolerance (above 1: the test would fail). The knobs tell
rounding from a wrong formula: `--fp64` runs the emulator and the replay in float64 (rounding shrinks by ~1e9, a
wrong weight, gradient or step does not), `--eps` sets Adam's eps on both sides, `--replay-s-offset` replays with
another staleness than the run had (a wrong formula, for contrast), `--seed` draws other initial weights. It also
prints Adam's largest per-element gain from a gradient's rounding to the weight, lr / (sqrt(v_hat) + eps), over
every step and parameter of each stage.

    python tests/replay_conditioning.py                 # eps 1e-8: 1.37x the tolerance at seed 5
    python tests/replay_conditioning.py --fp64          # the same in float64: within 5e-15
    python tests/replay_conditioning.py --eps 1e-4      # the test's setting: 0.09x
"""

from __future__ import annotations

import argparse
import os
import sys
import types

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

import test_async_policies  # noqa: E402
import test_moe_async  # noqa: E402
from megatron_po.models.moe.aux_losses import aux_loss_scale  # noqa: E402


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eps", type=float, default=1e-8, help="Adam's eps, in the run and the replay")
    p.add_argument("--fp64", action="store_true", help="weights, activations and optimizer state in float64")
    p.add_argument("--seed", type=int, default=5, help="test_moe_async's SEED (initial weights)")
    p.add_argument("--no-mtp", action="store_true", help="the same GPT without the MTP depth")
    p.add_argument("--replay-s-offset", type=int, default=1, help="the s_offset the replay assumes (the run's: 1)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.fp64:
        import megatron_po.pipeline.async_stage as async_stage
        torch.set_default_dtype(torch.float64)  # the batches' masks, the replay's copies
        async_stage.model_dtype = lambda *_: torch.float64  # the emulator's chunks
    test_moe_async.SEED = a.seed
    test_async_policies.copy = types.SimpleNamespace(deepcopy=test_moe_async.deepcopy_keeping_marks)
    worst: dict = {}

    def close(actual, expected, what):  # replay's check, recorded instead of asserted
        rank, kind = what.split(" ")[1], what.split(" ", 4)[4].split(" of ")[0].split(" after ")[0]
        for x, y in zip(actual, expected):
            diff = (x.double() - y.double()).abs()
            ratio = (diff / (test_async_policies.ATOL + test_async_policies.RTOL * y.double().abs())).max().item()
            old = worst.get((rank, kind), (0.0, 0.0))
            worst[(rank, kind)] = (max(old[0], diff.max().item()), max(old[1], ratio))
    test_async_policies.close = close

    model = {} if a.no_mtp else {"mtp_num_layers": 1, "position_embedding_type": "rope"}
    emu = test_moe_async.moe_emulator("pipeoptim", "adam", 2, 1, 1, model, 0.01, adam_eps=a.eps, s_offset=1)
    assert next(emu.chunks[0].parameters()).dtype == torch.get_default_dtype()
    gains = {}  # stage -> the largest lr / (sqrt(v_hat) + eps) after any of its steps, over all its parameters

    def gain_after(stage):
        def step(c, step=stage.step):
            step(c)
            inner = getattr(stage.optimizers[c], "optimizer", stage.optimizers[c])
            for state in inner.state.values():
                t = state["step"].item()
                v_hat = state["exp_avg_sq"] / (1 - 0.999 ** t)
                gain = (test_async_policies.lr_fn_for("adam")(t - 1) / (v_hat.sqrt() + a.eps)).max().item()
                gains[stage.rank] = max(gains.get(stage.rank, 0.0), gain)
        return step
    for stage in emu.stages:
        stage.step = gain_after(stage)
    recorders, initial = test_async_policies.record(emu)
    for m in (6, 6):
        emu.train_segment(test_async_policies.get_batch, m)
    with aux_loss_scale(1.0):
        for r in range(2):
            test_async_policies.replay("pipeoptim", "adam", 0.01, r, 0, recorders[r].events[0], initial[(r, 0)], None,
                                       a.replay_s_offset, adam_eps=a.eps)
    for (rank, kind), (diff, ratio) in sorted(worst.items()):
        print(f"stage {rank} {kind:<17} largest |difference| {diff:.2e}   / tolerance {ratio:.3f}")
    print("Adam's largest gain lr / (sqrt(v_hat) + eps): " + ", ".join(f"stage {r} {g:.3g}" for r, g in gains.items()))
    overall = max(ratio for _, ratio in worst.values())
    print(f"worst difference / tolerance: {overall:.3f} ({vars(a)})")
    return overall


if __name__ == "__main__":
    main()
