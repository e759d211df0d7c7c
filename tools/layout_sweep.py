"""Every layout the start-up rules accept trains the same model (issue 59): a sampled search over the parallel-layout
space of tools/layout_space.py.

    python tools/layout_sweep.py --count 40             # draw (seed 59) until 40 layouts are accepted, run them
    python tools/layout_sweep.py --count 100 --seed 1   # the committed sweep: bench/results/layout_sweep.md

Run it from the repository's root (it writes `--out`, default bench/results/layout_sweep.md), under `nice`: it
launches up to 8 processes.

Each drawn layout gets the start-up rules' verdict (layout_space.verdict: config_rules.validate, no process group).
A refused layout must be refused by pretrain_gpt.py's entry with one `error:` line naming a flag, before any process
group is made (layout_space.refusal_problem). An accepted one trains `ITERATIONS` iterations through the training
loop itself (`training.pretrain`, what pretrain_gpt.py runs) on forked gloo ranks, fp32, and its loss and grad norm
of every iteration are compared with
- synchronous methods: the one-process run of the same global batch (`Layout.reference`), relative difference at
  most `TOLERANCE` = 1e-5, the equivalence tests' tolerance (reduction orders only); FSDP2 too (it reduce-scatters
  every micro-batch and sums the shards, so it is not bitwise; tests/test_fsdp.py holds it to DDP within 1e-6
  absolute on losses of ~4.8 and to the emulator within rtol 1e-5);
- asynchronous methods: the emulator of the same stream (`AsyncEmulator`, every pipeline rank in one process, built
  with the run's own arguments, each group of DP ranks' micro-batches as one micro-batch): bit for bit where the
  layout is pipeline parallelism alone (the rule those methods are held to, tests/test_async_pipeline.py), FSDP2
  sharded over one rank included; within `TOLERANCE` where TP, CP or DP change reduction orders, FSDP2 over
  several ranks with them (it groups the grad norm's squares by shard and, at k >= 2, reduce-scatters each
  micro-batch where DDP sums the micro-batches first: tests/test_fsdp.py pins both against DDP, docs/fsdp.md).
  Before FSDPOptimizer added the norm's squares in the model's order, FSDP2 over one rank was up to 7.1e-8 off
  (k >= 2 or interleaved, clipping active).

Processes are shared: one launch per world size (2, then 4, then 8) runs its layouts in sequence (each `pretrain`
builds its process groups and releases them after), and one one-process launch runs every reference and emulator,
each reference once.
A layout that fails or hangs ends its launch; the layouts after it run in a new one. The table (layout, the rules'
verdict, what it was compared with, the largest relative difference) is printed and written to `--out` with the
command, commit, machine and load.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # the results header every results file shares
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tests' forked-rank harness
sys.path.insert(0, ROOT)

import bench_common  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

from tools.golden import to_log, warm_imports  # noqa: E402
from tools.layout_space import ITERATIONS, WORLDS, Layout, refusal_problem, sample, sharding_family  # noqa: E402

TOLERANCE = 1e-5
SEED = 59
SECONDS_PER_JOB = 60  # a launch's time limit grows by this per job it runs (a hung job ends its launch)


def comparison(layout: Layout) -> str:
    """What an accepted layout's run is compared with."""
    if not layout.is_async:
        return "one process"
    alone = layout.tp == layout.cp == layout.dp == 1  # FSDP2 too: sharded over one rank
    return "emulator, bitwise" if alone else "emulator"


@dataclass
class Outcome:
    layout: Layout
    status: str  # refused | ok | differs | failed
    note: str = ""  # the refusal's line, or the error
    against: str = ""
    max_rel: float | None = None
    curve: dict | None = None
    expected: dict | None = None

    def row(self, i: int) -> list:
        diff = "" if self.max_rel is None else f"{self.max_rel:.1e}"
        verdict = "refused" if self.status == "refused" else "accepted"
        note = bench_common.portable(self.note).replace("|", "/")
        return [i, f"`{self.layout.name()}`", verdict, self.against, diff, self.status, note]


# --------------------------------------------------------------------------------------------------
# On the ranks: jobs run in sequence in one launch
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    name: str  # its directory under the sweep's work directory
    kind: str  # "pretrain" (the layout's run, or a one-process reference) or "emulate" (an asynchronous layout)
    layout: Layout


def _run_jobs(jobs: list[Job], workdir: str) -> None:
    """Every job in turn on this launch's ranks; rank 0 marks each one done (`done` in its directory)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    to_log(os.path.join(workdir, f"{jobs[0].name}.rank{rank}.log"))
    for job in jobs:
        out = os.path.join(workdir, job.name)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
        dist.barrier()
        print(f"=== {job.name}: {job.kind} {job.layout.name()}", flush=True)
        (_emulate if job.kind == "emulate" else _pretrain)(job.layout, os.path.join(out, "metrics.jsonl"))
        dist.barrier()
        if rank == 0:  # with the threads this process holds now: released groups keep the count flat
            with open(os.path.join(out, "done"), "w") as f:
                f.write(str(_threads()))


def _threads() -> int:
    """This process's threads, the C++ ones (gloo's) included."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def _pretrain(layout: Layout, metrics_file: str) -> None:
    """The training loop pretrain_gpt.py runs, on this launch's ranks; its groups forgotten after (as run_main does)."""
    from megatron_po import parallel_state as ps
    from megatron_po import rank_watchdog
    from megatron_po.config import parse_args
    from megatron_po.training import pretrain
    try:
        pretrain(parse_args(layout.argv() + ["--metrics-file", metrics_file]))
    finally:
        rank_watchdog.stop_watchdog()
        # An FSDP2 model outlives pretrain as garbage in reference cycles (its hooks refer to its modules), its
        # DeviceMeshes holding the groups: collected first, so that releasing the groups ends their threads.
        gc.collect()
        ps.destroy_model_parallel()


def _emulate(layout: Layout, metrics_file: str) -> None:
    """The asynchronous layout's stream in one process (AsyncEmulator), built as pretrain builds the distributed
    one (`async_engine_arguments`, the same seeds, data order and loss bookkeeping), with TP = CP = DP = 1 and each
    micro-batch the DP ranks' micro-batches together; its loss and the loss stage's grad norm per iteration."""
    import copy

    import torch

    from megatron_po.async_training import async_engine_arguments, loss_stage_grad_norm, stream_batches
    from megatron_po.config import data_parallel_size, num_microbatches, parse_args, virtual_pipeline_size
    from megatron_po.gpt_workload import GPTWorkload
    from megatron_po.optim.sample_schedule import SampleSchedule
    from megatron_po.pipeline.async_pipeline import AsyncEmulator
    from megatron_po.tensor_parallel import model_parallel_seed
    cfg = parse_args(layout.argv())
    world, p = layout.world, cfg.parallel
    num_mb, dp = num_microbatches(cfg, world), data_parallel_size(cfg, world)
    arguments = async_engine_arguments(cfg, num_mb, SampleSchedule(cfg, world))
    stages, chunks = p.pipeline_model_parallel_size, virtual_pipeline_size(cfg)
    one = copy.deepcopy(cfg)  # the same run on one process: every rank of the pipeline in it
    one.parallel = dataclasses.replace(p, tensor_model_parallel_size=1, context_parallel_size=1,
                                       pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
                                       sequence_parallel=False, expert_model_parallel_size=1,
                                       expert_tensor_parallel_size=None)
    one.training.micro_batch_size = cfg.training.micro_batch_size * dp
    torch.manual_seed(cfg.training.seed)  # as training_setup.initialize
    model_parallel_seed(cfg.training.seed)
    workload = GPTWorkload(one)
    workload.setup()
    train_ds = workload.data()[0]
    emulator = AsyncEmulator(one, workload.padded_vocab, p.pipeline_method, stages, chunks,
                             build_chunks=workload.chunks_for_rank, **arguments)
    pending, records = {}, []

    def on_loss(mb: int, loss: torch.Tensor) -> None:  # as train_asynchronous logs an iteration
        g = mb // num_mb
        pending.setdefault(g, []).append(loss)
        if len(pending[g]) == num_mb:
            mean = float(torch.stack(pending.pop(g)).mean().double())
            norm = loss_stage_grad_norm(emulator.stages[-1])
            records.append({"iteration": g + 1, "lm_loss": mean, "grad_norm": norm})
    emulator.train_segment(stream_batches(one, workload, train_ds, 1), ITERATIONS * num_mb, on_loss=on_loss)
    with open(metrics_file, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


# --------------------------------------------------------------------------------------------------
# In the parent: launches, comparisons, the table
# --------------------------------------------------------------------------------------------------


def run_jobs(jobs: list[Job], world: int, workdir: str) -> dict[str, dict | str]:
    """{job name: its curve, or why it has none} for jobs run on `world` forked ranks, launch after launch: a failed
    or hung job ends its launch, the jobs after it run in the next."""
    out: dict[str, dict | str] = {}
    pending = list(jobs)
    while pending:
        error = None
        try:
            run_distributed(_run_jobs, world, args=(pending, workdir), timeout=60 + SECONDS_PER_JOB * len(pending))
        except (AssertionError, TimeoutError) as e:
            error = str(e)
        for job in list(pending):
            if not os.path.exists(os.path.join(workdir, job.name, "done")):
                break
            out[job.name] = read_curve(os.path.join(workdir, job.name, "metrics.jsonl"))
            with open(os.path.join(workdir, job.name, "done")) as f:
                out[job.name]["threads"] = int(f.read())
            pending.remove(job)
        if error is not None and pending:
            job = pending.pop(0)
            os.makedirs(os.path.join(workdir, job.name), exist_ok=True)
            with open(os.path.join(workdir, job.name, "error.txt"), "w") as f:
                f.write(error)
            out[job.name] = _last_line(error)
    return out


def _last_line(error: str) -> str:
    """The failure's own line (the last of the first rank's traceback)."""
    lines = [ln.strip() for ln in error.split("--- rank")[1 if "--- rank" in error else 0].splitlines() if ln.strip()]
    return lines[-1] if lines else error.strip()


def read_curve(path: str) -> dict:
    with open(path) as f:
        records = [r for r in map(json.loads, f) if "lm_loss" in r]
    return {"loss": [r["lm_loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def max_relative_difference(curve: dict, expected: dict) -> float:
    """The largest |a - b| / |b| over the loss and grad norm of every iteration (inf where the lengths differ)."""
    worst = 0.0
    for key in ("loss", "grad_norm"):
        a, b = curve[key], expected[key]
        if len(a) != len(b) or len(a) != ITERATIONS:
            return math.inf
        for x, y in zip(a, b):
            worst = max(worst, abs(x - y) / abs(y) if y else abs(x))
    return worst


def run_layouts(layouts: list[Layout], workdir: str, log=print) -> list[Outcome]:
    """Run accepted layouts and compare each with its reference or emulator (outcomes in the layouts' order)."""
    references: dict[Layout, Job] = {}
    expected = []  # per layout, the job of what it is compared with
    for layout in layouts:  # an asynchronous layout's emulator; a synchronous one's one-process run
        ref = layout if layout.is_async else layout.reference()
        kind = "emulate" if layout.is_async else "pretrain"
        expected.append(references.setdefault(ref, Job(f"{kind}-{len(references):03d}", kind, ref)).name)
    started = time.perf_counter()
    curves = run_jobs(list(references.values()), 1, workdir)
    log(f"> {len(references)} references and emulators on 1 process: {time.perf_counter() - started:.1f} s")
    for world in WORLDS:
        jobs = [Job(f"layout-{i:03d}", "pretrain", layout) for i, layout in enumerate(layouts) if layout.world == world]
        if jobs:
            started = time.perf_counter()
            curves.update(run_jobs(jobs, world, workdir))
            log(f"> {len(jobs)} layouts on {world} processes: {time.perf_counter() - started:.1f} s")
    outcomes = []
    for i, (layout, name) in enumerate(zip(layouts, expected)):
        curve, ref = curves[f"layout-{i:03d}"], curves[name]
        outcome = Outcome(layout, "ok", against=comparison(layout))
        if isinstance(curve, str) or isinstance(ref, str):
            outcome.status = "failed"
            outcome.note = curve if isinstance(curve, str) else f"its reference ({name}) failed: {ref}"
        else:
            outcome.curve, outcome.expected = curve, ref
            outcome.max_rel = max_relative_difference(curve, ref)
            if outcome.max_rel > (0.0 if outcome.against == "emulator, bitwise" else TOLERANCE):
                outcome.status = "differs"
        outcomes.append(outcome)
    return outcomes


def sweep(seed: int, count: int, workdir: str, log=print) -> list[Outcome]:
    """Draw until `count` layouts are accepted; check every refusal; run and compare every accepted layout."""
    accepted, refused = sample(seed, count)
    log(f"> seed {seed}: {len(accepted)} accepted, {len(refused)} refused")
    outcomes = [Outcome(layout, "refused", refusal_problem(layout, line) or line) for layout, line in refused]
    for outcome, (_, line) in zip(outcomes, refused):
        if outcome.note != line:  # what is wrong with the refusal
            outcome.status, outcome.note = "failed", f"bad refusal: {outcome.note}"
    return run_layouts(accepted, workdir, log) + outcomes


def summary(outcomes: list[Outcome]) -> list[str]:
    from collections import Counter
    status = Counter(o.status for o in outcomes)
    accepted = [o for o in outcomes if o.status != "refused"]
    ran = [o for o in accepted if o.max_rel is not None]
    worst = max((o.max_rel for o in ran if o.against != "emulator, bitwise"), default=0.0)
    bitwise = [o for o in ran if o.against == "emulator, bitwise"]
    return [f"{len(outcomes)} layouts drawn: {len(accepted)} accepted by the start-up rules, {status['refused']} "
            f"refused with one line naming a flag before any process group.",
            f"Of the accepted: {status['ok']} train like their reference, {status['differs']} differ, "
            f"{status['failed']} failed.",
            f"Largest relative difference against one process or the emulator: {worst:.1e} (tolerance "
            f"{TOLERANCE:g}); pipeline-only asynchronous layouts equal to their emulator bit for bit: "
            f"{sum(o.max_rel == 0 for o in bitwise)} of {len(bitwise)}.",
            "Per world size (accepted / run / ok): " + ", ".join(
                f"{w}: {sum(o.layout.world == w for o in accepted)} / "
                f"{sum(o.layout.world == w for o in ran)} / "
                f"{sum(o.layout.world == w and o.status == 'ok' for o in accepted)}" for w in WORLDS)]


def table(outcomes: list[Outcome]) -> str:
    rows = [o.row(i + 1) for i, o in enumerate(outcomes)]
    return bench_common.markdown_table(["#", "layout", "start-up rules", "compared with", "max rel. difference",
                                        "outcome", "note"], rows)


def main(argv=None) -> int:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--count", type=int, default=40, help="draw until this many layouts are accepted")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", default=os.path.join("bench", "results", "layout_sweep.md"),
                        help="the results file (default: %(default)s; \"\" writes none)")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a temporary directory)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    warm_imports()
    started = time.perf_counter()
    lines = bench_common.Lines(bench_common.card(
        __file__, argv, "Layout sweep: every accepted layout trains the same model", "CPU, gloo, forked ranks, fp32",
        f"seed {args.seed}, {args.count} accepted layouts, {ITERATIONS} iterations each, tolerance {TOLERANCE:g}"))
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = sweep(args.seed, args.count, args.workdir or tmp, log=lines.emit)
    for line in summary(outcomes):
        lines.emit(line)
    lines.emit()
    lines.emit(table(outcomes))
    lines.emit()
    lines.emit(bench_common.load_at_end(started))
    if args.out:
        lines.write(args.out)
    return 0 if all(o.status in ("ok", "refused") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
