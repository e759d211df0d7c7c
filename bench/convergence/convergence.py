"""Convergence of the pipeline methods at equal hyperparameters: loss, spread over seeds, throughput, memory.

    python bench/convergence/convergence.py                       # the full default run (~35 min on 2 shared cores)
    python bench/convergence/convergence.py --quick               # smoke run: tiny model, few steps, one seed
    python bench/convergence/convergence.py --depths 4 --optimizers adam --methods 1f1b pipedream pipeoptim --seeds 2

Trains the tiny GPT on the bundled World English Bible (examples/data/bible_web.en.jsonl.gz) with every
method of docs/ASYNC_PIPELINES.md -- GPipe, 1F1B, async-naive, PipeDream, PipeDream-2BW, SpecTrain (SGD
with momentum only) and PipeOptim -- at D = 4 and D = 8 pipeline stages, with Adam, AdamW and SGD with
momentum, several seeds each, and writes `<out>/convergence.md` (command, settings, tables, verdicts)
and `<out>/convergence.png` (loss curves, mean over seeds with a +-1 std band, one panel per (D, optimizer)).

How each method runs (single process, exact semantics; see the "fairness" section of the report):
- Asynchronous methods: `AsyncEmulator` (all D stages in one process, the op lists and per-op code of
  the distributed run), k = 1 (one update per micro-batch of B samples, as published), except
  PipeDream-2BW, which needs k >= D and runs with k = D: its updates average D micro-batches.
- GPipe and 1F1B: both apply W <- W - lr*U(mean gradient over one batch of B samples at W), the update
  of the unpipelined model, so one unpipelined run per (optimizer, seed) gives the convergence of both
  at every D (the same emulator code with D = 1, where no method has staleness). A start-up check runs
  the real GPipe and 1F1B op lists (`emulate` + `StageRunner`, M = D micro-batches of B/D samples, one
  flush and one step per batch, the semantics of `synchronous_forward_backward`) for a few updates and
  reports their loss difference to that reference.
- Throughput: the emulator runs stages one after another, so tokens/s is *simulated*. One calibration
  process per (D, optimizer) trains every method in turn (interleaved, so load from other processes hits
  them alike) and times each op and the weight-policy hooks inside it; a stage's op cost = a base shared
  by all methods (10th percentile of op time minus hook time) + the method's hook time (median). These
  costs go to `megatron_po.pipeline.simulator.simulate` with each method's schedule (async: the steady
  state of the no-flush stream; sync: one flush of M = D micro-batches plus the step), free communication.

Beyond the paper: the methods also include PREDICTOR_VARIANTS, PipeOptim with other weight predictors
(megatron_po/optim/predictors.py) and PipeOptim / PipeDream with gradient-side corrections (delay
compensation, staleness-aware lr scaling), each a column of its own; they get their own table (gap to
1F1B, fraction of PipeOptim's gap closed, throughput vs PipeOptim), the D = 4 "moonshot" verdict and
`<out>/predictors.png`.

Runs are independent jobs spread over `--jobs` worker processes (one torch thread each); each run's
result is kept in `<out>/.cache/runs/` so `--resume` continues an interrupted benchmark. The tokenizer,
the preprocessed corpus and the dataset indices are built once into `<out>/.cache/data/`.

`--workload nmt` runs the same comparison on the encoder-decoder translation model (pretrain_nmt.py's
model) and the bundled English-French Bible, by default with Adam at D = 4, and adds the greedy-decoding
validation BLEU of every run to the table (`NMTWorkload`):

    python bench/convergence/convergence.py --workload nmt --out bench/results/nmt
"""

# The command-line entry. The benchmark lives in the modules below (settings, workloads, runs, measure, stats,
# report, plots); the names other scripts use as `convergence.<name>` (bench/time_to_quality/, bench/deep_pipelines/,
# delay_robust.py, prediction_error.py, the tests; tests/test_bench_layout.py checks them) are imported here.

from __future__ import annotations

import argparse
import dataclasses  # noqa: F401  (convergence.dataclasses: the tests' dataclasses.replace on Settings)
import os
import sys
import time

# bench/ itself, for a caller that loads this file by path (the tests): the modules below are its siblings.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import REPO, command_line, loadavg, markdown_table, offline_env  # noqa: E402,F401

offline_env()

from convergence_measure import async_tokens_per_s, sync_seconds_per_update  # noqa: E402,F401
from convergence_plots import mean_band, plot, plot_predictors  # noqa: E402,F401
from convergence_report import main_table, predictor_table, write_report  # noqa: E402,F401
from convergence_runs import (_job_key, _optimizer_kwargs, _print, _training_config, build_emulator,  # noqa: E402,F401
                              calibrate_job, default_interval, plan_jobs, run_jobs, train_job)
from convergence_settings import (ALL_METHODS, LABELS, MUON_NOTE, OPT_LABELS, OPTIMIZERS,  # noqa: E402,F401
                                  PREDICTOR_VARIANTS, Settings, nmt_settings, quick_settings, validate)
from convergence_stats import _final_val, compare, fmt, gap_closed, mean_std, summarize  # noqa: E402,F401
from convergence_workloads import WORKLOADS, NMTWorkload, build_workload  # noqa: E402,F401


def run_benchmark(s: Settings, log=_print) -> dict:
    """Prepare data, run every job, write `<out>/convergence.md` and `<out>/convergence.png`.
    Returns {"md": path, "png": path, "summary": ..., "table": (header, rows)}."""
    validate(s)
    os.makedirs(s.out, exist_ok=True)
    load0 = loadavg()[0]
    start = time.perf_counter()
    wl = build_workload(s)
    log(f"> preparing data in {os.path.relpath(s.cache(), os.getcwd())}")
    wl.prepare()
    jobs = plan_jobs(s)
    log(f"> {len(jobs)} jobs ({sum(1 for j in jobs if j[0] == 'train')} training runs of {s.steps} micro-batches) "
        f"on {s.jobs} worker(s)")
    results, reused = run_jobs(s, jobs, log)
    summary = summarize(s, results, wl.tokens_per_microbatch)
    png = plot(s, summary, os.path.join(s.out, "convergence.png"))
    if any(m in PREDICTOR_VARIANTS for m in s.methods):
        plot_predictors(s, summary, os.path.join(s.out, "predictors.png"))
    elapsed = time.perf_counter() - start
    load1 = loadavg()[0]
    text = write_report(s, wl, summary, elapsed, (load0, load1), png, reused)
    md = bench_common.write_text(os.path.join(s.out, "convergence.md"), text)
    log(f"> wrote {md} and {png} ({elapsed / 60:.1f} min)")
    return {"md": md, "png": png, "summary": summary, "table": main_table(s, summary)}


def build_parser() -> argparse.ArgumentParser:
    p = bench_common.parser(__doc__)
    p.add_argument("--depths", type=int, nargs="+", default=None, help="pipeline stages D (default 4 8)")
    p.add_argument("--optimizers", nargs="+", default=None, choices=OPTIMIZERS, help="default: adam adamw sgd")
    p.add_argument("--methods", nargs="+", default=None, choices=ALL_METHODS, help="default: all")
    p.add_argument("--seeds", type=int, default=None, help="seeds per (method, optimizer, D) (default 3; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="micro-batches per run (default 256; --quick 32)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    p.add_argument("--out", default=None, help="output directory (default bench/results)")
    p.add_argument("--workload", default="gpt", choices=sorted(WORKLOADS),
                   help="gpt, or nmt: the encoder-decoder translation model (defaults: Adam, D = 4; BLEU columns)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one torch thread each)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs from <out>/.cache/runs")
    p.add_argument("--eval-interval", type=int, default=None, help="micro-batches between evaluations")
    p.add_argument("--lr", nargs="+", default=None, metavar="OPT=LR", help="peak lr per optimizer, e.g. adam=1e-3")
    p.add_argument("--cache-dir", default=None, help="tokenizer, corpus, indices and run cache (default <out>/.cache)")
    p.add_argument("--muon-fp32-matmul-prec", default=None, choices=["medium", "high", "highest", "low"],
                   help="Muon's Newton-Schulz precision (default here: highest = fp32, the study's; training's "
                        "default is medium = bf16)")
    p.add_argument("--muon-split-qkv", action="store_true",
                   help="Muon: Q, K and V orthogonalised separately (training's default; here off, the study's)")
    return p


def settings_from_args(argv=None) -> Settings:
    args = build_parser().parse_args(argv)
    s = Settings()
    if args.workload == "nmt":
        s = nmt_settings(s)
    if args.quick:
        s = quick_settings(s)
        s.seeds = 1
    for name in ("depths", "optimizers", "methods", "seeds", "steps", "out", "eval_interval", "cache_dir"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.lr:
        lr = dict(s.lr)
        for item in args.lr:
            o, _, v = item.partition("=")
            if o not in OPTIMIZERS or not v:
                raise SystemExit(f"error: --lr {item!r}: expected OPT=LR with OPT in {OPTIMIZERS}")
            lr[o] = float(v)
        s.lr = lr
    if args.muon_fp32_matmul_prec is not None:
        s.muon_fp32_matmul_prec = args.muon_fp32_matmul_prec
    s.muon_split_qkv = args.muon_split_qkv
    s.workload, s.jobs, s.resume = args.workload, args.jobs, args.resume
    s.out = os.path.abspath(s.out)
    given = sys.argv[1:] if argv is None else list(argv)
    s.command = command_line("bench/convergence/convergence.py", given, quote=True)
    return s


def main(argv=None) -> int:
    s = settings_from_args(argv)
    try:
        run_benchmark(s)
    except NotImplementedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
