"""The project on one GPU, in one command (issue 29): writes bench/results/gpu_<device>.md and a .json with the
same figures beside it (device name slugged: gpu_nvidia_h200.md; gpu_cpu.md without a GPU).

    python bench/gpu.py                          # every section at the full size, GPT-1.3B (estimated 15-20 min on an H200)
    python bench/gpu.py --only peak gpt plain    # some sections; --skip leaves some out
    python bench/gpu.py --quick --out /tmp/g.md  # a tiny GPT, every code path on a CPU in about a minute

Sections (names for --only / --skip), each measured in fresh processes (pretrain_gpt.py, bench/gpu_worker.py),
each with its exact command in the results:

  peak    the bf16 matmul peak: 8192^3 products, the mean of 20 after 3 warm-up (bench/overhead.py's matmul_peak)
  gpt     GPT-1.3B (24 layers, hidden 2048, 16 heads, seq 2048, micro-batch 4, global batch 16, bf16, mock
          data, vocab 50257 padded to 50304, dropout 0) through pretrain_gpt.py: ms per iteration (median after
          3 warm-up), tokens/s, model TFLOP/s (megatron_po/flops.py) and MFU against the peak measured above
  plain   bench/overhead.py's plain PyTorch GPT of the same shape (SDPA, bf16 autocast, fused AdamW), eager and
          torch.compile'd, beside ours: the ratio of tokens/s
  compiled  ours with --torch-compile (compiled layers and optimizer step), beside ours eager and the plain
          GPT compiled: issue 30's >= 1.0x the compiled plain GPT, >= 70 % MFU
  muon    Muon through pretrain_gpt.py at the defaults (bf16 Newton-Schulz, Q/K/V split) and as before issue
          31 (fp32, QKV whole), per iteration beside AdamW's (section gpt); one layer's Newton-Schulz per
          precision, unbatched and batched: issue 31's Muon iteration <= 1.25x AdamW's
  stream  the D = 4 asynchronous stream in the single-process emulator (AsyncEmulator, bf16) for async-naive,
          PipeDream, PipeDream-2BW (k = 4), PipeOptim with AdamW (its prediction fused into the step, and
          separate: the code before issue 30), async-naive and PipeOptim with Muon, each method in a process of
          its own: ms per micro-batch, ratio to async-naive, peak memory, weight copies per chunk; each stage's
          forward, backward, optimizer step (AdamW, Muon) and PipeOptim prediction, and the step's share of
          forward + backward; the JSON's `stage_costs` holds them per stage, and `<out>_cost_model.json` is
          bench/time_to_quality.py's cost model of them (`--cost-model PATH`; bench/ttq_cost_model.py)
  stream_compiled  the same stream under --torch-compile for async-naive and PipeOptim, AdamW and Muon: issue
          30's PipeOptim <= 1.01x async-naive per micro-batch
  fused   one 302 M-parameter stage's AdamW step with PipeOptim's prediction (none / separate / fused), eager and
          compiled (bench/fused_step.py's time_step_variants)
  fp16    pretrain_gpt.py --fp16 from the default initial loss scale 2^32: the iterations skipped while the scale
          falls, with the loss scale and lr over them
  targets the GPU targets of issues 30 and 31, read from the sections above: met or not

Adding a measured section: a function `def section_<name>(run: Run) -> Section` (measure through `run.worker`
or `run.pretrain`, read earlier sections' figures from `run.done`) and one line in SECTIONS. Ours with other
flags, for one:

    def section_gpt_compiled(run: Run) -> Section:
        return measure_ours(run, "gpt_compiled", "GPT through pretrain_gpt.py --torch-compile", ["--torch-compile"])
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from bench_common import (REPO, RESULTS, add_repo_to_path, load_at_end, load_at_start, loadavg, log,  # noqa: E402
                          markdown_table, now, offline_env)

add_repo_to_path()
offline_env()

import torch  # noqa: E402
from gpu_worker import D, SIZES, Size, padded_vocab  # noqa: E402
from ttq_cost_model import cost_model_from_measurements  # noqa: E402


@dataclass
class Section:
    """What a section measured: its title, the exact commands, its figures (into the JSON) and its
    Markdown lines (tables, notes)."""
    title: str
    commands: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


class Run:
    """One `python bench/gpu.py` run: its size, the sections done so far (`done`: name -> Section), and the
    two ways a section measures, each in a fresh process whose output lines are progress."""

    def __init__(self, size_name: str, timeout: float):
        self.size_name, self.size = size_name, SIZES[size_name]
        self.timeout = timeout
        self.done: dict[str, Section] = {}
        self.tmp = tempfile.mkdtemp(prefix="bench_gpu_")

    def _stream(self, cmd: list[str], shown: str) -> list[str]:
        """Run `cmd` from the checkout, echo its output as it comes; its output lines. Raises on failure."""
        log(f"  $ {shown}")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timed_out = threading.Event()

        def kill():  # a hung process, printing or not, ends the section
            timed_out.set()
            proc.kill()
        killer = threading.Timer(self.timeout, kill)
        killer.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if not line.startswith("RESULT "):
                    log("    " + line.rstrip("\n"))
            proc.wait()
        finally:
            killer.cancel()
        if timed_out.is_set():
            raise RuntimeError(f"killed after {self.timeout:.0f} s: {shown}")
        if proc.returncode != 0:
            raise RuntimeError(f"exit code {proc.returncode}: {shown}\n" + "\n".join(lines[-15:]))
        return lines

    def worker(self, name: str, *flags: str, errors: list | None = None) -> tuple[dict | None, str]:
        """(result, command) of `python bench/gpu_worker.py name --size <size> flags`. With `errors`, a
        failure (an out-of-memory, a compiler error) is appended there as (command, message) and the result
        is None, so that one failing measurement leaves the others of its section."""
        argv = [name, "--size", self.size_name, *flags]
        shown = " ".join(["python", "bench/gpu_worker.py", *argv])
        if errors is not None:
            try:
                return self.worker(name, *flags)
            except RuntimeError as e:
                errors.append((shown, str(e)))
                return None, shown
        lines = self._stream([sys.executable, os.path.join(BENCH, "gpu_worker.py"), *argv], shown)
        result = next((ln[len("RESULT "):] for ln in reversed(lines) if ln.startswith("RESULT ")), None)
        if result is None:
            raise RuntimeError(f"no RESULT line from: {shown}")
        return json.loads(result), shown

    def pretrain(self, label: str, flags: list[str]) -> tuple[list[dict], str, list[str]]:
        """(metrics records, command, output lines) of pretrain_gpt.py with `flags` (metrics into a
        temporary directory, shown as $TMP in the command)."""
        out = os.path.join(self.tmp, label)
        os.makedirs(out, exist_ok=True)
        argv = [*flags, "--metrics-file", os.path.join(out, "metrics.jsonl"), "--data-cache-path",
                os.path.join(out, "cache")]
        shown = " ".join(["python", "pretrain_gpt.py", *argv]).replace(self.tmp, "$TMP")
        lines = self._stream([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv], shown)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], shown, lines


# --------------------------------------------------------------------------------------------------
# Figures shared by the sections
# --------------------------------------------------------------------------------------------------


def flops_per_iteration(size: Size) -> float:
    """Model FLOPs of one iteration (forward + backward, Megatron's dense convention) of the GPT of `size`."""
    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    return gpt_flops_per_token(parse_args(size.gpt_flags()), padded_vocab(size)) * size.global_batch * size.seq


def peak_tflops(run: Run) -> float | None:
    peak = run.done.get("peak")
    return peak.figures.get("tflops") if peak is not None else None


def throughput(run: Run, ms: float) -> dict:
    """ms per iteration -> tokens/s, model TFLOP/s and (with a measured peak) MFU."""
    tflops = flops_per_iteration(run.size) / ms * 1e3 / 1e12
    peak = peak_tflops(run)
    return {"ms_per_iteration": ms, "tokens_per_s": run.size.global_batch * run.size.seq / ms * 1e3,
            "model_tflops": tflops, "mfu": tflops / peak if peak else None}


def num(x: float) -> str:
    """A rate with 3 significant figures below 100 (the quick size's are tiny), else one decimal."""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.1f}"


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def failed_lines(errors: list) -> list[str]:
    """Markdown for the measurements of a section that failed (their command and the end of the error)."""
    out = []
    for command, message in errors:
        out += ["", f"Failed: `{command}`", "", "```", *message.splitlines()[-8:], "```"]
    return out


# --------------------------------------------------------------------------------------------------
# The sections
# --------------------------------------------------------------------------------------------------


def section_peak(run: Run) -> Section:
    result, command = run.worker("peak")
    return Section("bf16 matmul peak", [command], result,
                   [f"**{num(result['tflops'])} TFLOP/s**: {result['n']}^3 bf16 products of random matrices, the mean "
                    f"of {result['reps']} after {result['warmup']} warm-up. MFU below is against this figure."])


def measure_ours(run: Run, label: str, title: str, extra_flags: list[str]) -> Section:
    """The GPT of this size through pretrain_gpt.py --bf16 plus `extra_flags`: the median ms per iteration
    after the warm-up, from the per-iteration records (--log-interval 1), and what follows from it."""
    s = run.size
    flags = s.gpt_flags() + ["--bf16", "--train-iters", str(s.iterations), "--log-interval", "1", "--log-throughput",
                             "--eval-interval", str(10 * s.iterations), "--eval-iters", "1", *extra_flags]
    records, command, output = run.pretrain(label, flags)
    timed = [r for r in records if "tokens_per_sec" in r][s.warmup:]
    times = sorted(s.global_batch * s.seq / r["tokens_per_sec"] * 1e3 for r in timed)
    figures = throughput(run, times[len(times) // 2])
    held = next((re.search(r"holds ([\d.]+) M parameters", ln) for ln in output if "holds" in ln), None)
    figures.update(parameters_millions=float(held.group(1)) if held else None, iterations_timed=len(times),
                   max_memory_bytes=records[-1].get("max_memory_gb", 0.0) * 2**30, padded_vocab=padded_vocab(s),
                   flops_per_iteration=flops_per_iteration(s))
    row = [f"{figures['ms_per_iteration']:.1f}", f"{figures['tokens_per_s']:,.0f}", num(figures["model_tflops"]),
           pct(figures["mfu"]), gib(figures["max_memory_bytes"])]
    return Section(title, [command], figures, [
        f"{figures['parameters_millions']} M parameters; median of the {len(times)} iterations after {s.warmup} "
        f"warm-up; {num(figures['flops_per_iteration'] / 1e12)} TFLOP per iteration (megatron_po/flops.py).", "",
        markdown_table(["ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "peak GiB"], [row])])


def section_gpt(run: Run) -> Section:
    return measure_ours(run, "gpt", "GPT through pretrain_gpt.py", [])


def section_plain(run: Run) -> Section:
    errors: list = []
    eager, eager_command = run.worker("plain", errors=errors)
    compiled, compiled_command = run.worker("plain", "--compile", errors=errors)
    if eager is None and compiled is None:
        raise RuntimeError("; ".join(message.splitlines()[0] for _, message in errors))
    rows, figures = [], {"failed": [command for command, _ in errors]}
    ours = run.done.get("gpt")
    for name, result in (("ours (pretrain_gpt.py)", ours.figures if ours else None),
                         ("plain PyTorch, eager", eager), ("plain PyTorch, torch.compile", compiled)):
        if result is None:
            continue
        figures[name] = fig = {**result, **throughput(run, result["ms_per_iteration"])}
        ratio = ours.figures["tokens_per_s"] / fig["tokens_per_s"] if ours else None
        fig["ours_tokens_per_s_over_this"] = ratio
        rows.append([name, f"{fig['ms_per_iteration']:.1f}", f"{fig['tokens_per_s']:,.0f}", num(fig["model_tflops"]),
                     pct(fig["mfu"]), "n/a" if ratio is None else f"{ratio:.3f}x"])
    backend = run.size.compile_backend
    return Section("Ours beside a plain PyTorch GPT of the same shape", [eager_command, compiled_command], figures, [
        "bench/overhead.py's PlainGPT as a user writes it: fp32 weights under bf16 autocast, "
        "F.scaled_dot_product_attention, fused AdamW (foreach on a CPU), the same micro-batches per iteration and "
        "clip 1.0, the "
        f"same (tied, padded) output layer; `torch.compile` with backend `{backend}`. Same FLOPs per iteration.", "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "ours / this (tokens/s)"], rows),
        *failed_lines(errors)])


# label, method, optimizer, update interval k (2BW accumulates k >= D micro-batches per update), worker flags
STREAM_METHODS = [
    ("async-naive", "async-naive", "adamw", 1, ()),
    ("PipeDream", "pipedream", "adamw", 1, ()),
    ("PipeDream-2BW", "pipedream-2bw", "adamw", D, ()),
    ("PipeOptim (AdamW)", "pipeoptim", "adamw", 1, ()),
    ("PipeOptim (AdamW), prediction separate", "pipeoptim", "adamw", 1, ("--separate",)),
    ("async-naive (Muon)", "async-naive", "muon", 1, ()),
    ("PipeOptim (Muon)", "pipeoptim", "muon", 1, ()),
]
# The same under --torch-compile (compiled layers; the optimizer step with PipeOptim's prediction fused into it
# compiled): issue 30's target, PipeOptim <= 1.01x async-naive per micro-batch, is judged here.
STREAM_COMPILED_METHODS = [
    ("async-naive", "async-naive", "adamw", 1, ("--compile",)),
    ("PipeOptim (AdamW)", "pipeoptim", "adamw", 1, ("--compile",)),
    ("async-naive (Muon)", "async-naive", "muon", 1, ("--compile",)),
    ("PipeOptim (Muon)", "pipeoptim", "muon", 1, ("--compile",)),
]


def naive_step_ms(results: dict, optimizer: str, r: int) -> float | None:
    """Stage r's Step op (policy hooks included) under async-naive with `optimizer`: the step alone."""
    label = next((lb for lb, method, opt, k, flags in STREAM_METHODS
                  if method == "async-naive" and opt == optimizer and lb in results), None)
    return results[label]["stages"][r]["step"] if label else None


def policy_step_ms(results: dict, label: str, optimizer: str, r: int) -> float:
    """What a method's weight policy adds to stage r's Step op: its hooks, and the prediction a step writes
    when it is fused into it (the method's Step op less async-naive's with the same optimizer; the hooks
    alone when async-naive did not run with that optimizer)."""
    ops = results[label]["stages"][r]
    naive = naive_step_ms(results, optimizer, r)
    # two medians from two processes: a difference below zero is their noise, counted as nothing
    return max(0.0, ops["step"] - naive) if naive is not None else ops["step_hooks"]


def stage_costs(results: dict) -> list[dict]:
    """Per stage of the D = 4 stream, in ms: forward and backward (async-naive's ops: no policy work),
    the optimizer step per optimizer (async-naive's Step op with that optimizer) and PipeOptim's prediction
    (its hooks around a forward, which restore the live weights and predict where the step did not, plus
    what the fused prediction adds to the step)."""
    base = results.get("async-naive") or next(iter(results.values()))
    out = []
    for r in range(D):
        ops = base["stages"][r]
        stage = {"stage": r, "forward_ms": ops["forward"] - ops["forward_hooks"],
                 "backward_ms": ops["backward"] - ops["backward_hooks"], "step_ms": {}, "prediction_ms": {}}
        for label, method, optimizer, k, flags in STREAM_METHODS:
            if label not in results or k != 1 or flags:
                continue
            ops = results[label]["stages"][r]
            naive = naive_step_ms(results, optimizer, r)
            stage["step_ms"].setdefault(optimizer, (naive if naive is not None else ops["step"] - ops["step_hooks"]))
            if method == "pipeoptim":
                stage["prediction_ms"][optimizer] = ops["forward_hooks"] + policy_step_ms(results, label, optimizer, r)
        out.append(stage)
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


# Which stages a method's weight policy works on, as bench/ttq_cost_model.py counts them: at k = 1 the last
# stage's weights are never stale (PipeOptim predicts nothing there, PipeDream stashes nothing); 2BW swaps
# versions on every stage.
POLICY_STAGES = {"pipeoptim": "stale", "pipedream": "stale", "pipedream-2bw": "all"}


def ttq_cost_model(results: dict, costs: list[dict], info: dict, size: Size, size_name: str) -> dict:
    """The stream's per-op costs as bench/time_to_quality.py's cost model (`--cost-model PATH`; schema in
    bench/ttq_cost_model.py): one average stage (so that it prices any D), the policies' hook time per op
    kind averaged over the stages they work on."""
    stale = list(range(D - 1))

    def policy(label: str, method: str, optimizer: str) -> dict:
        stages = stale if POLICY_STAGES[method] == "stale" else list(range(D))
        ops = results[label]["stages"]
        return {"Forward": mean([ops[r]["forward_hooks"] for r in stages]),
                "Backward": mean([ops[r]["backward_hooks"] for r in stages]),
                "Step": mean([policy_step_ms(results, label, optimizer, r) for r in stages]),
                "stages": POLICY_STAGES[method]}

    policies = {method: policy(label, method, optimizer) for label, method, optimizer, k, flags in STREAM_METHODS
                if method in POLICY_STAGES and optimizer == "adamw" and not flags and label in results}
    variants = {}
    if "PipeOptim (Muon)" in results:
        variants["muon-run-prediction"] = {"note": "PipeOptim's hooks measured in the Muon run (its prediction "
                                                   "follows Muon's update)",
                                           "policy_ms": {"pipeoptim": policy("PipeOptim (Muon)", "pipeoptim", "muon")}}
    separate = "PipeOptim (AdamW), prediction separate"
    if separate in results:
        variants["prediction-separate"] = {"note": "PipeOptim predicting right before each forward (the code "
                                                   "before issue 30) instead of in the step",
                                           "policy_ms": {"pipeoptim": policy(separate, "pipeoptim", "adamw")}}
    steps = {o: mean([c["step_ms"][o] for c in costs]) for o in ("adamw", "muon") if o in costs[0]["step_ms"]}
    device = f"{info['name']} (torch {info['torch']}, CUDA {info['cuda']}, bf16)"
    model = (f"GPT {size.layers} layers, hidden {size.hidden}, {size.heads} heads, seq {size.seq}, micro-batch "
             f"{size.micro_batch}, vocab {padded_vocab(size)}, untied embeddings; one stage = {size.layers // D} layers")
    return cost_model_from_measurements(
        name=f"gpu_{info['slug']}_{size_name}", device=device, model=model, pipeline_stages=D, data_parallel=1,
        tokens_per_microbatch=size.micro_batch * size.seq,
        forward_ms=mean([c["forward_ms"] for c in costs]), backward_ms=mean([c["backward_ms"] for c in costs]),
        step_ms=steps, policy_ms=policies, variants_ms=variants, source=[
            f"python bench/gpu.py ({size_name} size), section stream: the D = {D} asynchronous emulator, one process "
            "per method, one segment timed op by op with the device synchronised around every op and policy hook; "
            "medians per stage, then the mean over the stages (one average stage; the per-stage figures are in the "
            "bench's JSON, `stage_costs`).",
            "forward, backward: async-naive's ops less their (empty) policy hooks; step: the Step op less the "
            "policy's hooks, AdamW from async-naive, Muon from PipeOptim (Muon), at the Newton-Schulz precision "
            "this code runs by default.",
            "policy: each method's hook time per op kind (PipeOptim: the restore after a forward, and the prediction "
            "the step writes, i.e. its Step op less async-naive's; PipeDream: the version swap around a backward; "
            "2BW at k = 4: its version copies), AdamW runs, averaged over the stages the method works on "
            "(`stages`).",
            "Not measured here: NAG's step (PipeNAG, and 2BW + error feedback, need fp32 weights; this bench runs "
            "bf16), the split backward of the zero-bubble schedules, communication (one process, DP = 1)."])


def run_stream(run: Run, methods: list) -> tuple[dict, list[str], list, list[list]]:
    """Each method of `methods` in a worker process of its own: (results by label, commands, errors, table rows
    of ms per micro-batch, the ratio to async-naive with the same optimizer, memory and weight copies)."""
    results, commands, errors = {}, [], []
    for label, method, optimizer, k, flags in methods:
        result, command = run.worker("stream", "--method", method, "--optimizer", optimizer, "--k", str(k), *flags,
                                     errors=errors)
        commands.append(command)
        if result is not None:
            results[label] = result
    if not results:
        raise RuntimeError("; ".join(message.splitlines()[0] for _, message in errors))
    rows = []
    for label, method, optimizer, k, flags in methods:
        if label not in results:
            rows.append([label, optimizer, k, "failed", "", "", "", ""])
            continue
        res = results[label]
        naive = next((results[lb]["ms_per_microbatch"] for lb, m, o, _, f in methods
                      if m == "async-naive" and o == optimizer and lb in results), None)
        res["ratio_to_async_naive"] = res["ms_per_microbatch"] / naive if naive else None
        copies = " / ".join(str(res["copies_per_chunk"][str(r)]) for r in range(D))
        ratio = "n/a" if naive is None else f"{res['ratio_to_async_naive']:.3f}x"
        rows.append([label, optimizer, k, f"{res['ms_per_microbatch']:.1f}", ratio, gib(res["memory"]["peak_bytes"]),
                     gib(res["built"].get("memory_allocated_bytes")), copies])
    return results, commands, errors, rows


STREAM_COLUMNS = ["method", "optimizer", "k", "ms / micro-batch", "vs async-naive (same optimizer)", "peak GiB",
                  "after build GiB", "weight copies"]


def section_stream(run: Run) -> Section:
    results, commands, errors, rows = run_stream(run, STREAM_METHODS)
    costs = stage_costs(results)
    cost_rows = []
    for c in costs:
        fb = c["forward_ms"] + c["backward_ms"]
        steps = c["step_ms"]
        cost_rows.append([c["stage"], f"{c['forward_ms']:.2f}", f"{c['backward_ms']:.2f}",
                          *(f"{steps[o]:.2f} ({pct(steps[o] / fb)})" if o in steps else "n/a" for o in ("adamw", "muon")),
                          *(f"{c['prediction_ms'][o]:.2f}" if o in c["prediction_ms"] else "n/a" for o in ("adamw", "muon"))])
    first = next(iter(results.values()))
    memory, parameters = first["memory"]["measure"], first["built"]["parameters"]
    figures = {"D": D, "methods": results, "stage_costs": costs, "failed": [command for command, _ in errors]}
    s = run.size
    return Section(f"The D = {D} asynchronous stream in the single-process emulator", commands, figures, [
        f"All {D} stages in one process (`AsyncEmulator`), bf16 with fp32 main params, untied embeddings (asynchronous "
        f"methods need them: {parameters / 1e6:.1f} M parameters), micro-batch "
        f"{s.micro_batch}, k = 1 unless said, eager (no --torch-compile). ms per micro-batch in the steady state: "
        f"(T({s.stream_long}) - T({s.stream_short})) / {s.stream_long - s.stream_short} over two segments after a "
        "warm-up; the emulator runs the stages one after another, so this is the whole pipeline's work per "
        "micro-batch. Each method in a process of its own; peak memory: "
        f"{memory}; after build: weights and optimizer state before the first step. Weight copies per chunk: live "
        "weights included, ranks 0..3 (`copies_per_chunk`). PipeOptim writes its prediction in the optimizer step "
        "where the next op is the predicted forward; \"prediction separate\" predicts right before each forward "
        "(the code before issue 30).", "",
        markdown_table(STREAM_COLUMNS, rows), "",
        "Per stage (one segment with the device synchronised around every op and policy hook, median ms): forward "
        "and backward from async-naive; the optimizer step (its share of that stage's forward + backward) from "
        "async-naive with that optimizer; PipeOptim's prediction = its hooks around a forward (the restore) plus "
        "what its Step op takes over async-naive's (the prediction written by the step; none on the last stage, "
        "s = 0).", "",
        markdown_table(["stage", "forward", "backward", "AdamW step (share)", "Muon step (share)",
                        "prediction (AdamW)", "prediction (Muon)"], cost_rows), *failed_lines(errors)])


def section_stream_compiled(run: Run) -> Section:
    results, commands, errors, rows = run_stream(run, STREAM_COMPILED_METHODS)
    return Section(f"The D = {D} stream under --torch-compile", commands,
                   {"D": D, "methods": results, "failed": [command for command, _ in errors]}, [
        "As the eager stream above, with --torch-compile: every transformer layer compiled, and each optimizer "
        "step compiled with PipeOptim's prediction fused into it (one pass over the parameters writes the fp32 "
        "weights, the state, the live bf16 weights and the bf16 prediction). Compilation happens in the warm-up "
        "segment (and the drain that ends it), before the timed segments.", "",
        markdown_table(STREAM_COLUMNS, rows), *failed_lines(errors)])


def section_compiled(run: Run) -> Section:
    """Ours under --torch-compile, beside ours eager (section gpt) and the plain GPT compiled (section plain)."""
    section = measure_ours(run, "gpt_compiled", "GPT through pretrain_gpt.py --torch-compile", ["--torch-compile"])
    fig = section.figures
    others = {"ours_eager": ("ours, eager (section gpt)", run.done["gpt"].figures if "gpt" in run.done else None),
              "plain_compiled": ("plain PyTorch, torch.compile (section plain)",
                                 run.done["plain"].figures.get("plain PyTorch, torch.compile")
                                 if "plain" in run.done else None)}
    rows = []
    for key, (name, theirs) in others.items():
        if theirs:
            fig[f"over_{key}"] = ratio = fig["tokens_per_s"] / theirs["tokens_per_s"]
            rows.append([name, f"{theirs['tokens_per_s']:,.0f}", f"{ratio:.3f}x"])
    if rows:
        section.lines += ["", markdown_table(["compiled ours vs", "its tokens/s", "compiled ours / it"], rows)]
    return section


def section_fused(run: Run) -> Section:
    result, command = run.worker("fused_step")
    rows = [[r["variant"], "compiled" if r["compiled"] else "eager", f"{r['ms']:.3f}", f"{r['vs_naive']:.3f}x"]
            for r in result["rows"]]
    return Section("One stage's optimizer step with PipeOptim's prediction", [command], result, [
        f"bench/fused_step.py's `time_step_variants`: one stage of {num(result['parameters'] / 1e6)} M parameters "
        "(bf16 weights, fp32 main params, AdamW), per micro-batch: the step alone (naive), the step then a "
        "separate prediction into bf16 and the restore (separate, the code before issue 30), the step writing "
        "the prediction itself (fused); eager foreach ops, and the same function under torch.compile "
        "(--torch-compile). Median over alternated reps.", "",
        markdown_table(["variant", "", "ms", "vs naive"], rows)])


def section_muon(run: Run) -> Section:
    """Muon through pretrain_gpt.py at the defaults (bf16 Newton-Schulz, Q/K/V split) and as before issue 31
    (fp32, QKV whole), beside AdamW's iteration (section gpt); one layer's Newton-Schulz per precision."""
    muon = measure_ours(run, "gpt_muon", "", ["--optimizer", "muon"])
    before = measure_ours(run, "gpt_muon_fp32", "", ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest",
                                                     "--muon-no-split-qkv"])
    ns, ns_command = run.worker("newton_schulz")
    adamw = run.done.get("gpt")
    figures = {"muon": muon.figures, "muon_fp32_qkv_whole": before.figures, "newton_schulz": ns}
    rows = []
    for name, sec in (("Muon (bf16 Newton-Schulz, Q/K/V split: the defaults)", muon),
                      ("Muon as before issue 31 (fp32, QKV whole)", before)):
        ratio = sec.figures["ms_per_iteration"] / adamw.figures["ms_per_iteration"] if adamw else None
        sec.figures["over_adamw"] = ratio
        rows.append([name, f"{sec.figures['ms_per_iteration']:.1f}", "n/a" if ratio is None else f"{ratio:.3f}x"])
    if adamw:
        rows.insert(0, ["AdamW (section gpt)", f"{adamw.figures['ms_per_iteration']:.1f}", "1x"])
    ns_rows = [[key.split(",")[0], key.split(",")[1], f"{ms:.2f}", f"{ms * ns['layers_per_stage']:.1f}"]
               for key, ms in ns["ms"].items()]
    return Section("Muon: iteration vs AdamW, Newton-Schulz per precision", [*muon.commands, *before.commands,
                                                                           ns_command], figures, [
        markdown_table(["optimizer", "ms / iteration", "vs AdamW"], rows), "",
        f"Newton-Schulz, {ns['steps']} steps on one layer's four matrices (QKV, projection, MLP up and down; hidden "
        f"{ns['hidden']}), median ms: one call per matrix (unbatched, before issue 31) and stacked by shape "
        f"(batched); highest = fp32, high = TF32, medium = bf16 (--muon-fp32-matmul-prec).", "",
        markdown_table(["precision", "calls", "ms per layer", f"ms per stage ({ns['layers_per_stage']} layers)"],
                       ns_rows)])


def target_rows(run: Run) -> list[list]:
    """The issues' GPU targets, each: target, measured, met? ("not measured" where its sections did not run)."""
    done = {name: sec.figures for name, sec in run.done.items()}

    def row(target: str, value: float | None, bound: float, higher_is_better: bool, how: str) -> list:
        if value is None:
            return [target, "not measured", "", how]
        met = value >= bound if higher_is_better else value <= bound
        return [target, f"{value:.3f}", "met" if met else "NOT MET", how]

    def stream_ratio(section: str, label: str, base: str) -> float | None:
        methods = done.get(section, {}).get("methods", {})
        if label in methods and base in methods:
            return methods[label]["ms_per_microbatch"] / methods[base]["ms_per_microbatch"]
        return None

    compiled = done.get("compiled", {})
    muon = done.get("muon", {}).get("muon", {})
    return [
        row("issue 30: compiled ours / compiled plain PyTorch GPT (tokens/s) >= 1.0",
            compiled.get("over_plain_compiled"), 1.0, True, "sections plain, compiled"),
        row("issue 30: MFU of compiled ours >= 0.70 (an H200)", compiled.get("mfu"), 0.70, True,
            "sections peak, compiled"),
        row("issue 30: D = 4 stream, PipeOptim / async-naive per micro-batch <= 1.01 (--torch-compile)",
            stream_ratio("stream_compiled", "PipeOptim (AdamW)", "async-naive"), 1.01, False, "section stream_compiled"),
        row("issue 31: Muon iteration / AdamW iteration <= 1.25 (DP = 1)", muon.get("over_adamw"), 1.25, False,
            "sections gpt, muon"),
        row("issue 31: D = 4 stream, PipeOptim-Muon / PipeOptim-AdamW per micro-batch <= 1.8 (eager)",
            stream_ratio("stream", "PipeOptim (Muon)", "PipeOptim (AdamW)"), 1.8, False, "section stream"),
    ]


def section_targets(run: Run) -> Section:
    rows = target_rows(run)
    return Section("Targets", [], {"targets": rows}, [
        "The GPU targets of issues 30 and 31, read from the sections above (no measurement of its own).", "",
        markdown_table(["target", "measured", "", "from"], rows)])


def section_fp16(run: Run) -> Section:
    s = run.size
    # No warm-up: the lr decays from the first iteration, so the table shows whether skipped ones advance it.
    flags = s.gpt_flags(lr_warmup_iters=0) + ["--fp16", "--train-iters", str(s.fp16_iterations), "--log-interval", "1",
                             "--eval-interval", str(10 * s.fp16_iterations), "--eval-iters", "1"]
    records, command, _ = run.pretrain("fp16", flags)
    records = [r for r in records if "lm_loss" in r]
    skipped = [r["grad_norm"] is None for r in records]
    initial = next((i for i, x in enumerate(skipped) if not x), len(skipped))
    iterations = [{k: r.get(k) for k in ("iteration", "loss_scale", "lr", "lm_loss", "grad_norm", "consumed_samples")}
                  for r in records]
    rows = [[r["iteration"], "skipped" if r["grad_norm"] is None else "stepped", f"{r['loss_scale']:.0f}",
             f"{r['lr']:.3e}", f"{r['lm_loss']:.4f}", r["consumed_samples"]] for r in iterations]
    lrs = [r["lr"] for r in iterations[:initial]]
    said = (f"**{initial} of {len(records)} iterations skipped before the first step** (dynamic loss scale from 2^32)"
            if initial < len(records) else f"**all {initial} iterations skipped**: no step taken from 2^32 within them")
    return Section("fp16: skipped iterations from the initial loss scale", [command],
                   {"initial_skipped": initial, "iterations": iterations}, [
        said + (f"; the lr over them went {lrs[0]:.3e} -> {lrs[-1]:.3e}, the consumed samples "
                f"{iterations[0]['consumed_samples']} -> {iterations[initial - 1]['consumed_samples']}." if lrs else "."),
        "",
        markdown_table(["iteration", "step", "loss scale", "lr", "lm loss", "consumed samples"], rows)])


SECTIONS = {  # name -> the function measuring it; run in this order (later sections read earlier figures)
    "peak": section_peak,
    "gpt": section_gpt,
    "plain": section_plain,
    "compiled": section_compiled,
    "muon": section_muon,
    "stream": section_stream,
    "stream_compiled": section_stream_compiled,
    "fused": section_fused,
    "fp16": section_fp16,
    "targets": section_targets,
}


# --------------------------------------------------------------------------------------------------
# The results files
# --------------------------------------------------------------------------------------------------


def device_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu_cores": os.cpu_count(),
            "platform": platform.platform()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
    else:
        info["name"] = "cpu"
    info["slug"] = re.sub(r"[^a-z0-9]+", "_", info["name"].lower()).strip("_")
    return info


def header(info: dict, command: str, run: Run, started: str) -> list[str]:
    s = run.size
    lines = [f"# GPU benchmark: {info['name']}", "", f"Command: `{command}`  ", f"Started {started}; "
             f"{load_at_start()}  ",
             f"Device: {info['name']}" + (f", {info['memory_bytes'] / 2**30:.0f} GiB, {info['multiprocessors']} SMs"
                                         if "memory_bytes" in info else "") +
             f"; torch {info['torch']}, CUDA {info['cuda']}; {info['cpu_cores']} CPU cores, {info['platform']}  ",
             f"Model: GPT, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, seq {s.seq}, micro-batch "
             f"{s.micro_batch}, global batch {s.global_batch}, vocab {s.vocab} (padded {padded_vocab(s)}), bf16, mock "
             "data; one process (data-parallel size 1)."]
    if run.size_name == "quick":
        lines += ["", f"> **Quick size (`--quick`): every figure below is from the tiny model above on {info['name']}.** "
                  "It exists so that the script runs in a test; its numbers measure nothing."]
    return lines + [""]


def cost_model_path(path: str) -> str:
    """Where the time-to-quality cost model goes: beside the .md, `<name>_cost_model.json`."""
    return os.path.splitext(path)[0] + "_cost_model.json"


def write_results(path: str, info: dict, command: str, run: Run, started: str, t0: float, failures: list) -> None:
    lines = header(info, command, run, started)
    for name, section in run.done.items():
        commands = ["```", *section.commands, "```", ""] if section.commands else []
        lines += [f"## {section.title} (`{name}`)", "", *commands, *section.lines, ""]
    for name, error in failures:
        lines += [f"## `{name}`: failed", "", "```", error, "```", ""]
    lines.append(load_at_end(t0))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    s = run.size
    data = {"schema": "megatron_po bench/gpu.py 1", "command": command, "size": run.size_name, "started": started,
            "minutes": (time.perf_counter() - t0) / 60, "device": info, "load_average_end": loadavg()[:2],
            "model": {**asdict(s), "padded_vocab": padded_vocab(s), "precision": "bf16"},
            "data_parallel_size": 1, "sections": {name: {"title": sec.title, "commands": sec.commands,
                                                         "figures": sec.figures} for name, sec in run.done.items()},
            "failures": [{"section": n, "error": e} for n, e in failures]}
    stream = run.done.get("stream")
    if stream is not None:
        built = next(iter(stream.figures["methods"].values()))["built"]
        data["stage_costs"] = {
            "source": "section stream: one segment of the D = 4 emulator timed op by op, device synchronised, median",
            "pipeline_stages": D, "data_parallel_size": 1, "micro_batch_size": s.micro_batch,
            "tokens_per_microbatch": s.micro_batch * s.seq, "precision": "bf16", "parameters": built["parameters"],
            "model": {"num_layers": s.layers, "hidden_size": s.hidden, "num_attention_heads": s.heads,
                      "seq_length": s.seq, "padded_vocab": padded_vocab(s), "untied_embeddings": True},
            "stages": stream.figures["stage_costs"]}
        try:  # ttq_cost_model checks what it builds and says what is wrong in one line (SystemExit)
            cost_model = ttq_cost_model(stream.figures["methods"], stream.figures["stage_costs"], info, s,
                                        run.size_name)
        except SystemExit as e:
            data["ttq_cost_model"] = f"not written: {e}"
        else:
            data["ttq_cost_model"] = os.path.basename(cost_model_path(path))
            with open(cost_model_path(path), "w") as f:
                json.dump(cost_model, f, indent=1)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description="Measure the project on one GPU; write bench/results/gpu_<device>.md/.json")
    ap.add_argument("--quick", action="store_true", help="the tiny size: every section on a CPU in about a minute")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    ap.add_argument("--skip", nargs="+", choices=list(SECTIONS), default=[], help="leave these sections out")
    ap.add_argument("--out", help="the .md to write (the .json goes beside it); default "
                                  "bench/results/gpu_<device>[_quick].md")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measuring process (default 600; quick 300)")
    args = ap.parse_args(argv)
    run = Run("quick" if args.quick else "full", args.timeout or (300 if args.quick else 600))
    info = device_info()
    out = args.out or os.path.join(RESULTS, f"gpu_{info['slug']}{'_quick' if args.quick else ''}.md")
    command = " ".join(["python", "bench/gpu.py", *argv])
    started, t0, failures = now(), time.perf_counter(), []
    names = [n for n in (args.only or SECTIONS) if n not in args.skip]
    log(f"[gpu.py] {info['name']}, torch {info['torch']}, size {run.size_name}: sections {', '.join(names)} -> {out}")
    try:
        for name in sorted(names, key=list(SECTIONS).index):
            log(f"[gpu.py] {name} ({(time.perf_counter() - t0) / 60:.1f} min)")
            try:
                run.done[name] = SECTIONS[name](run)
            except Exception as e:  # noqa: BLE001  (record it, measure the rest)
                log(f"[gpu.py] {name} failed: {e}")
                failures.append((name, f"{type(e).__name__}: {e}"))
            write_results(out, info, command, run, started, t0, failures)  # after each: a later crash keeps it
    finally:
        shutil.rmtree(run.tmp, ignore_errors=True)
    wrote = [p for p in (out, os.path.splitext(out)[0] + ".json", cost_model_path(out)) if os.path.exists(p)]
    log(f"[gpu.py] wrote {', '.join(wrote)} in {(time.perf_counter() - t0) / 60:.1f} min"
        + (f"; FAILED: {', '.join(n for n, _ in failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
