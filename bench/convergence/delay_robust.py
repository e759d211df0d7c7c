"""Delay-robust asynchronous training at D = 4 (issue 15): PipeNAG, its reference-code recipe, error feedback.

    python bench/convergence/delay_robust.py --jobs 1                  # 3 seeds, D = 4, writes bench/results/delay_robust.md
    python bench/convergence/delay_robust.py --quick                   # smoke run

Reuses bench/convergence/convergence.py's machinery (workload, emulator runs `train_job`, run cache, mean ± std, the
"within spread" verdict) and its default settings (tiny GPT on the bundled Bible, 256 micro-batches of
B = 8, cosine lr with warm-up, weight decay 0.01, no clipping). Rows, all with the same data and seeds:

- sync AdamW (the unpipelined reference = GPipe/1F1B updates), PipeDream AdamW, PipeDream-2BW AdamW;
- the PipeNAG recipe its reference code runs: PipeDream (weight stashing) + NAdamW, β1 = 0.99, ψ = 0.004
  (literal), and the same with ψ scaled to the run length (ψ·50,000/steps, so μ_t ends where the paper's
  50,000-step run ends: the short run otherwise tests a different optimizer, ASYNC_OPTIMIZERS.md);
- PipeNAG as written (`pipenag` + `nag`, γ = 0.9, lr = the SGD-momentum lr / (1 − γ) = 1.0, the same
  effective step as bench/convergence/convergence.py's SGD-momentum runs; not tuned);
- error feedback: 2BW AdamW + EF (the paper's s = 1 rule), PipeDream AdamW + EF (our s-step rule);
- Muon (`--runs sync-muon 2bw-muon 2bw-muon-ef`): sync Muon, 2BW-Muon and 2BW-Muon + EF (the paper's pairing).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
import convergence as cv  # noqa: E402
import convergence_runs  # noqa: E402  (where the jobs read _optimizer_kwargs: the override goes there)

D = 4
# label -> (optimizer, method, extra optimizer kwargs, weight-policy options)
RUNS = {
    "sync-adamw": ("adamw", "sync", {}, {}),
    "pipedream-adamw": ("adamw", "pipedream", {}, {}),
    "2bw-adamw": ("adamw", "pipedream-2bw", {}, {}),
    "recipe": ("nadamw", "pipedream", {"adam_beta1": 0.99}, {}),
    "recipe-psi-scaled": ("nadamw", "pipedream", {"adam_beta1": 0.99, "nadam_momentum_decay": "scaled"}, {}),
    "pipenag": ("nag", "pipenag", {}, {}),
    "2bw-adamw-ef": ("adamw", "pipedream-2bw", {}, {"error_feedback": True}),
    "pipedream-adamw-ef": ("adamw", "pipedream", {}, {"error_feedback": True}),
    "sync-muon": ("muon", "sync", {}, {}),
    "2bw-muon": ("muon", "pipedream-2bw", {}, {}),
    "2bw-muon-ef": ("muon", "pipedream-2bw", {}, {"error_feedback": True}),
}
# the asynchronous row each one should beat (same pipeline method, or the method the recipe replaces)
BASELINE = {"recipe": "pipedream-adamw", "recipe-psi-scaled": "pipedream-adamw", "pipenag": "pipedream-adamw",
            "2bw-adamw-ef": "2bw-adamw", "pipedream-adamw-ef": "pipedream-adamw", "2bw-muon-ef": "2bw-muon"}
LABELS = {"sync-adamw": "sync AdamW (GPipe/1F1B)", "pipedream-adamw": "PipeDream AdamW",
          "2bw-adamw": "PipeDream-2BW AdamW", "recipe": "recipe: PipeDream + NAdamW β1=0.99 (ψ=0.004)",
          "recipe-psi-scaled": "recipe, ψ scaled to the run", "pipenag": "PipeNAG (pipenag + nag)",
          "2bw-adamw-ef": "PipeDream-2BW AdamW + EF (s=1, paper)",
          "pipedream-adamw-ef": "PipeDream AdamW + EF (s-step, ours)", "sync-muon": "sync Muon (GPipe/1F1B)",
          "2bw-muon": "PipeDream-2BW Muon", "2bw-muon-ef": "PipeDream-2BW Muon + EF (s=1, paper)"}


def train(s: cv.Settings, label: str, seed: int) -> dict:
    optimizer, method, extra, options = RUNS[label]
    extra = {k: (0.004 * 50_000 / s.steps if v == "scaled" else v) for k, v in extra.items()}
    base_kwargs = convergence_runs._optimizer_kwargs
    convergence_runs._optimizer_kwargs = lambda s_, o: {**base_kwargs(s_, o), **extra}
    cv.PREDICTOR_VARIANTS[label] = (method, options)
    cv.LABELS[label] = LABELS[label]
    try:
        r = cv.train_job(s, 0 if method == "sync" else D, optimizer, "sync" if method == "sync" else label, seed)
    finally:
        convergence_runs._optimizer_kwargs = base_kwargs
    r["label"] = label
    return r


def _describe(r: dict) -> str:
    return f"{r['label']} seed {r['seed']}: val {r['val'][-1][1] if r['val'] else float('nan'):.4f} ({r['seconds']:.0f} s)"


def main(argv=None) -> int:
    p = bench_common.parser(__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="runs one after another (1) or in worker processes")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--out", default=os.path.join(cv.REPO, "bench", "results"))
    a = p.parse_args(argv)
    s = cv.Settings(depths=[D], seeds=a.seeds, out=a.out, jobs=a.jobs)
    if a.quick:
        s = cv.quick_settings(s)
    s = dataclasses.replace(s, lr={**s.lr, "nadamw": s.lr["adamw"], "nag": s.lr["sgd"] / (1 - s.sgd_momentum)})
    cv.build_workload(s).prepare()  # tokenizer, corpus, indices: once, into <out>/.cache/data
    start, head = time.perf_counter(), bench_common.header(__file__, argv, "Delay-robust asynchronous training, D = 4")
    results = bench_common.run_cached_jobs([(s, label, seed) for seed in range(1, a.seeds + 1) for label in a.runs],
                                           None, train, workers=a.jobs, describe=_describe)
    ref = {label: cv.mean_std([cv._final_val(r, s.steps) for r in results if r["label"] == label]) for label in a.runs}

    def verdict(label, other):
        if label == other or other not in ref:
            return ""
        return f"{ref[label][0] - ref[other][0]:+.3f}, {cv.compare(ref[label], ref[other], a.seeds)}"

    rows = []
    for label in a.runs:
        base = BASELINE.get(label)
        rows.append([LABELS[label], cv.fmt(*ref[label]),
                     verdict(label, "sync-muon" if RUNS[label][0] == "muon" else "sync-adamw"),
                     f"{LABELS[base]}: {verdict(label, base)}" if base else ""])
    lines = [*head,
             f"Seeds: {a.seeds}; {s.steps} micro-batches of B = {s.micro_batch}; peak lr "
             f"{ {k: round(v, 6) for k, v in s.lr.items()} }; wall {(time.perf_counter() - start) / 60:.1f} min.", "",
             cv.markdown_table(["run", "final validation loss (mean ± std)", "vs sync, same optimizer",
                                "vs its asynchronous baseline"], rows), "",
             "Verdicts: a difference is real only when the mean ± std intervals do not overlap "
             "(bench/convergence/convergence.py's rule). Details of each rule: docs/delay_robust.md.", "",
             bench_common.load_at_end(start)]
    bench_common.publish(lines, os.path.join(a.out, "delay_robust.md" if not a.quick else "delay_robust_quick.md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
