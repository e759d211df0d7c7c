"""How well does each weight predictor foresee the weights a micro-batch's backward will run on?

    python bench/convergence/prediction_error.py                        # D = 4, Adam, seed 1, 256 micro-batches
    python bench/convergence/prediction_error.py --depth 8 --optimizer sgd

Trains PipeOptim (the paper's linear predictor) on the setting of bench/convergence/convergence.py (same tiny GPT,
corpus, lr schedule) in the single-process emulator. Before every forward F(j) of a stage with staleness
s(j) > 0, every predictor of megatron_po/optim/predictors.py computes the Ŵ it would use from the same
optimizer state (into scratch tensors; the run itself always uses PipeOptim's); after B(j) each is
compared with the weights the backward really ran on, W_B = the stage's live weights then. Reported per
stage: relative error = Σ_j ‖Ŵ_j − W_B(j)‖ / Σ_j ‖W_F(j) − W_B(j)‖ (0 = perfect foresight, 1 = no better
than not predicting, W_F = the live weights at F(j)), over the whole run and over its second half.
Writes `<out>/prediction_error.md`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

# (predictor, horizon, rollout gradient) of each column; "none" = the live weights at F(j).
PREDICTORS = {
    "linear (PipeOptim)": ("linear", "full", "first-moment"),
    "lr-schedule": ("lr-schedule", "full", "first-moment"),
    "rollout first-moment": ("rollout", "full", "first-moment"),
    "rollout zero-mean": ("rollout", "full", "zero-mean"),
    "linear, sqrt horizon": ("linear", "sqrt", "first-moment"),
    "rollout zero-mean, sqrt horizon": ("rollout", "sqrt", "zero-mean"),
}


def measure(depth: int, optimizer: str, steps: int, seed: int, log=print) -> dict:
    import torch
    import convergence as cb
    from megatron_po.optim.predictors import build_predictor

    torch.set_num_threads(1)
    s = cb.Settings(steps=steps)
    wl = cb.build_workload(s)
    wl.prepare()
    emu = cb.build_emulator(s, wl, "pipeoptim", depth, 1, optimizer, seed)  # (the micro-batch lr clock, k = 1)
    errors = defaultdict(lambda: defaultdict(list))  # rank -> column -> [‖Ŵ − W_B‖ per micro-batch]
    pending = {}

    def norm(a, b):
        return math.sqrt(sum(((x - y) ** 2).sum().item() for x, y in zip(a, b)))

    for stage in emu.stages:
        policy, opt = stage.policy, stage.optimizers[0]
        predictors = {name: build_predictor(*spec, optimizer=opt) for name, spec in PREDICTORS.items()}
        before_forward, after_backward = policy.before_forward, policy.after_backward

        def on_forward(mb, chunk, policy=policy, opt=opt, predictors=predictors, f=before_forward, r=stage.rank):
            s_j, params = policy.staleness[chunk][mb], policy.params[chunk]
            guesses = {"none": [p.detach().clone() for p in params]}
            if s_j > 0 and opt.has_state():
                for name, predictor in predictors.items():
                    predictor.plan(policy.lr_fn, policy.steps[chunk])
                    opt.predictor = predictor
                    out = [[torch.empty_like(p) for p in g["params"]] for g in opt.param_groups]
                    opt.predict(s_j, out=out)
                    by_param = {id(p): o for g, row in zip(opt.param_groups, out) for p, o in zip(g["params"], row)}
                    guesses[name] = [by_param[id(p)] for p in params]
                opt.predictor = None  # the run itself: PipeOptim's linear prediction
                pending[(r, mb)] = guesses
            f(mb, chunk)

        def on_backward(mb, chunk, policy=policy, b=after_backward, r=stage.rank):
            b(mb, chunk)
            guesses = pending.pop((r, mb), None)
            if guesses is not None:
                live = [p.detach() for p in policy.params[chunk]]
                for name, w in guesses.items():
                    errors[r][name].append(norm(w, live))

        policy.before_forward, policy.after_backward = on_forward, on_backward
    get_batch, start = wl.train_batch(seed), time.perf_counter()
    for end in range(s.eval_interval, steps + 1, s.eval_interval):
        emu.train_segment(get_batch, end - emu.microbatches_consumed)
        log(f"{end}/{steps} micro-batches ({time.perf_counter() - start:.0f} s)")
    return {"errors": errors, "val": emu.evaluate(wl.valid_batches())}


def report(errors: dict, command: str, depth: int, optimizer: str, steps: int, seed: int, val: float) -> str:
    columns = list(PREDICTORS)
    header = ["stage", "part"] + columns
    rows = []
    for r in sorted(errors):
        base = errors[r]["none"]
        half = len(base) // 2
        for part, lo in (("all", 0), ("second half", half)):
            rows.append([str(r), part] + [f"{sum(errors[r][c][lo:]) / sum(base[lo:]):.3f}" for c in columns])
    table = bench_common.markdown_table(header, rows)
    return f"""# Prediction error of the weight predictors (D = {depth}, {optimizer}, seed {seed})

Command: `{command}`; commit {bench_common.commit()}

PipeOptim (linear predictor) trained for {steps} micro-batches on the bench/convergence/convergence.py setting (final
validation loss {val:.3f}); at every forward with s(j) > 0 each predictor computed its Ŵ from the same state.
Relative error Σ‖Ŵ − W_B‖ / Σ‖W_F − W_B‖ (W_B: the weights the backward ran on; W_F: the live weights at
the forward, i.e. not predicting; 0 = perfect foresight, 1 = no better than not predicting). The last
stage has s = 0 and is not listed.

{table}
"""


def main(argv=None) -> int:
    p = bench_common.parser(__doc__)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd"])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=bench_common.RESULTS)
    args = p.parse_args(argv)
    command = "python bench/convergence/prediction_error.py" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    result = measure(args.depth, args.optimizer, args.steps, args.seed)
    text = report(result["errors"], command, args.depth, args.optimizer, args.steps, args.seed, result["val"])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prediction_error.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
