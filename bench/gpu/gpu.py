"""The project on one GPU, in one command (issue 29): writes bench/results/gpu_<device>.md and a .json with the
same figures beside it (device name slugged: gpu_nvidia_h200.md; gpu_cpu.md without a GPU).

    python bench/gpu/gpu.py                          # every section at the full size, GPT-1.3B (estimated 15-20 min on an H200)
    python bench/gpu/gpu.py --only peak gpt plain    # some sections; --skip leaves some out
    python bench/gpu/gpu.py --quick --out gpu_quick.md  # a tiny GPT, every code path on a CPU in about a minute
    python bench/gpu/gpu.py --only stream --stream-methods async-naive:adamw pipeoptim:adamw   # some methods
    python bench/gpu/gpu.py --budget-s 500           # start no section that cannot finish in 500 s; stop at 500 s

Sections run in the order below, which is their priority (bench/gpu_check/gpu_check.py splits them over two device calls),
except that `gpt` runs before `plain` and `compiled`, whose ratios read it.

Sections (names for --only / --skip), each measured in fresh processes (pretrain_gpt.py, bench/gpu/gpu_worker.py),
each with its exact command in the results:

  peak    the bf16 matmul peak: 8192^3 products, the mean of 20 after 3 warm-up (bench/step/overhead.py's matmul_peak)
  gpt     GPT-1.3B (24 layers, hidden 2048, 16 heads, seq 2048, micro-batch 4, global batch 16, bf16, mock
          data, vocab 50257 padded to 50304, dropout 0) through pretrain_gpt.py: ms per iteration (median after
          3 warm-up), tokens/s, model TFLOP/s (megatron_po/flops.py) and MFU against the peak measured above
  plain   bench/step/overhead.py's plain PyTorch GPT of the same shape (SDPA, bf16 autocast, fused AdamW), eager and
          torch.compile'd, beside ours: the ratio of tokens/s
  compiled  ours with --torch-compile (compiled layers and optimizer step), beside ours eager and the plain
          GPT compiled: issue 30's >= 1.0x the compiled plain GPT, >= 70 % MFU
  muon    Muon through pretrain_gpt.py at the defaults (bf16 Newton-Schulz, Q/K/V split) and as before issue
          31 (fp32, QKV whole), per iteration beside AdamW's (section gpt's, or measured here when gpt does not
          run); one layer's Newton-Schulz per
          precision, unbatched and batched: issue 31's Muon iteration <= 1.25x AdamW's
  stream  the D = 4 asynchronous stream in the single-process emulator (AsyncEmulator, bf16) for async-naive,
          PipeDream, PipeDream-2BW (k = 4), PipeOptim with AdamW (its prediction fused into the step, and
          separate: the code before issue 30), async-naive and PipeOptim with Muon, each method in a process of
          its own: ms per micro-batch, ratio to async-naive, peak memory, weight copies per chunk; each stage's
          forward, backward, optimizer step (AdamW, Muon) and PipeOptim prediction, and the step's share of
          forward + backward; the JSON's `stage_costs` holds them per stage, and `<out>_cost_model.json` is
          bench/time_to_quality/time_to_quality.py's cost model of them (`--cost-model PATH`; bench/time_to_quality/ttq_cost_model.py)
  stream_compiled  the same stream under --torch-compile for async-naive and PipeOptim with AdamW: issue 30's
          PipeOptim <= 1.01x async-naive per micro-batch
  stream_compiled_muon  the same for async-naive and PipeOptim with Muon
  fused   one 302 M-parameter stage's AdamW step with PipeOptim's prediction (none / separate / fused), eager and
          compiled (bench/step/fused_step.py's time_step_variants)
  fp16    pretrain_gpt.py --fp16 from the default initial loss scale 2^32: the iterations skipped while the scale
          falls, with the loss scale and lr over them
  gpipe   peak memory in GPipe's order (all forwards, then all backwards): ours --torch-compile beside the plain
          GPT compiled, each in a process of its own
  profile one compiled iteration after the warm-up, ours and the plain GPT, under torch.profiler: TorchDynamo
          graphs, compiled-graph calls, device kernels, host syncs, copies and where they happen (on request in
          the check: --steps profile; `--size small` runs it on a CPU at GPT-1.3B's shape scaled down)
  fp8     FP8 through torchao against our bf16, eager and compiled (bench/gpu/gpu_fp8.py)
  long_context  GPT-1.3B at 16,384 tokens per sequence, CP = 1: tokens/s, model TFLOP/s and MFU with the attention
          counted as Megatron does and over its causal half (bench/gpu/gpu_long_context.py)
  fsdp    the GPT with --use-torch-fsdp2 at DP 1 (one GPU) against DDP: ms per iteration and peak memory
          (bench/gpu/gpu_fsdp.py)
  targets the GPU targets (bench/gpu_check/gpu_targets.py), read from the sections above: met or not

Sections run in the order --only gives (bench/gpu_check/gpu_check.py puts baselines first), `targets` last. With
--state-dir (the check's, bench/gpu_check/gpu_state.py: this GPU since this boot), a baseline (peak, gpt, plain) that an
earlier call measured on this machine at the same code is taken from there instead of measured again, and every
figure read against it says so. Figures are kept as they are measured: the results are rewritten after each one
(atomically), so a section killed half-way leaves its partial figures (`partial` in the JSON).

Adding a measured section: a function `def section_<name>(run: Run) -> Section` (measure through `run.worker`
or `run.pretrain`, read earlier sections' figures from `run.done`) and one entry in bench/gpu_check/gpu_budget.py's
TABLE (its function, estimated seconds, the files it measures, its baselines). Ours with other flags, for one:

    def section_gpt_compiled(run: Run) -> Section:
        return measure_ours(run, "gpt_compiled", "GPT through pretrain_gpt.py --torch-compile", ["--torch-compile"])
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # --budget-s counts from here, before the imports (torch's take seconds)

import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import (RESULTS, load_at_end, load_at_start, loadavg, log, markdown_table, now,  # noqa: E402
                          offline_env)

offline_env()

import gpu_budget  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_state  # noqa: E402
import gpu_targets  # noqa: E402
import torch  # noqa: E402
from gpu_run import Run, Section, failed_lines, gib, measure_ours, num, pct, throughput, why_failed  # noqa: E402
from gpu_stream import (D, STREAM_COMPILED_METHODS, STREAM_COMPILED_MUON_METHODS, STREAM_METHOD_KEYS,  # noqa: E402
                        STREAM_METHODS, NoStreamMethod, method_key, section_stream, section_stream_compiled,
                        section_stream_compiled_muon, ttq_cost_model)
from gpu_worker import padded_vocab  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The sections (the stream's in bench/gpu/gpu_stream.py)
# --------------------------------------------------------------------------------------------------


def section_peak(run: Run) -> Section:
    result, command = run.worker("peak")
    return Section("bf16 matmul peak", [command], result,
                   [f"**{num(result['tflops'])} TFLOP/s**: {result['n']}^3 bf16 products of random matrices, the mean "
                    f"of {result['reps']} after {result['warmup']} warm-up. MFU below is against this figure."])


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
        "bench/step/overhead.py's PlainGPT as a user writes it: fp32 weights under bf16 autocast, "
        "F.scaled_dot_product_attention, fused AdamW (foreach on a CPU), the same micro-batches per iteration and "
        "clip 1.0, the "
        f"same (tied, padded) output layer; `torch.compile` with backend `{backend}`. Same FLOPs per iteration.", "",
        markdown_table(["", "ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "ours / this (tokens/s)"], rows),
        *failed_lines(errors)])


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
        f"bench/step/fused_step.py's `time_step_variants`: one stage of {num(result['parameters'] / 1e6)} M parameters "
        "(bf16 weights, fp32 main params, AdamW), per micro-batch: the step alone (naive), the step then a "
        "separate prediction into bf16 and the restore (separate, the code before issue 30), the step writing "
        "the prediction itself (fused); eager foreach ops, and the same function under torch.compile "
        "(--torch-compile). Median over alternated reps.", "",
        markdown_table(["variant", "", "ms", "vs naive"], rows)])


# (figures key, label, flags beside --optimizer muon, row) of section muon; the Gram iterations are opt-in (issue 44)
MUON_RUNS = [("muon", "gpt_muon", [], "Muon (bf16 Newton-Schulz, Q/K/V split: the defaults)"),
             ("muon_gram", "gpt_muon_gram", ["--muon-gram-newton-schulz"],
              "Muon, --muon-gram-newton-schulz (opt-in: Gram iterations on the MLP's matrices)"),
             ("muon_fp32_qkv_whole", "gpt_muon_fp32", ["--muon-fp32-matmul-prec", "highest", "--muon-no-split-qkv"],
              "Muon as before issue 31 (fp32, QKV whole)")]


def section_muon(run: Run) -> Section:
    """Muon through pretrain_gpt.py at the defaults (bf16 Newton-Schulz, Q/K/V split) and as before issue 31
    (fp32, QKV whole), beside AdamW's iteration (section gpt's, or measured here in the same run when gpt did not
    run: a ratio's baseline comes from the same run); one layer's Newton-Schulz per precision."""
    adamw = run.done.get("gpt")
    baseline = None
    if adamw is None:  # AdamW's iteration measured here, in the same run, when section gpt did not run
        adamw = baseline = measure_ours(run, "gpt_adamw", "", [])
    measured, rows = {}, [["AdamW (section gpt)" if baseline is None else "AdamW (measured here: section gpt did not "
                           "run)", f"{adamw.figures['ms_per_iteration']:.1f}", "1x"]]
    for key, label, flags, name in MUON_RUNS:
        sec = measured[key] = measure_ours(run, label, "", ["--optimizer", "muon", *flags])
        run.figure(f"{key} ms_per_iteration", sec.figures["ms_per_iteration"])
        sec.figures["over_adamw"] = ratio = sec.figures["ms_per_iteration"] / adamw.figures["ms_per_iteration"]
        rows.append([name, f"{sec.figures['ms_per_iteration']:.1f}", f"{ratio:.3f}x"])
    ns, ns_command = run.worker("newton_schulz")
    figures = {**{key: sec.figures for key, sec in measured.items()}, "newton_schulz": ns,
               **({"adamw": baseline.figures} if baseline else {})}
    ns_rows = [[key.split(",")[0], key.split(",")[1], f"{ms:.2f}", f"{ms * ns['layers_per_stage']:.1f}"]
               for key, ms in ns["ms"].items()]
    return Section("Muon: iteration vs AdamW, Newton-Schulz per precision",
                   [*(baseline.commands if baseline else []), *(c for sec in measured.values() for c in sec.commands),
                    ns_command], figures, [
        markdown_table(["optimizer", "ms / iteration", "vs AdamW"], rows), "",
        f"Newton-Schulz, {ns['steps']} steps on one layer's four matrices (QKV, projection, MLP up and down; hidden "
        f"{ns['hidden']}), median ms: one call per matrix (unbatched, before issue 31) and stacked by shape "
        f"(batched); highest = fp32, high = TF32, medium = bf16 (--muon-fp32-matmul-prec).", "",
        markdown_table(["precision", "calls", "ms per layer", f"ms per stage ({ns['layers_per_stage']} layers)"],
                       ns_rows)])


def section_targets(run: Run) -> Section:
    reused = {name: sec.reused for name, sec in run.done.items() if sec.reused}  # baselines from an earlier call
    rows = gpu_targets.rows({name: sec.figures for name, sec in run.done.items()}, reused)
    return Section("Targets", [], {"targets": rows}, [
        "The GPU targets (issue 44), read from the sections above (no measurement of its own): each a ratio of "
        "figures of this run (\"same run\"), or of this run and a baseline an earlier call measured on this "
        "machine, same GPU since the same boot (\"same machine\").", "",
        markdown_table(["target", "measured", "", "from"], rows)])


PROFILE_ROWS = [("unique_graphs", "TorchDynamo graphs compiled"), ("graph_breaks", "graph breaks"),
                ("recompiles", "recompiles"), ("compiled_graph_calls", "compiled-graph calls"),
                ("device_kernels", "device kernels"), ("host_syncs", "host syncs (item, is_nonzero, synchronize)"),
                ("copies", "copies (copy_, _to_copy, clone, contiguous, cat)"), ("cpu_ops", "CPU ops in all")]


def section_profile(run: Run) -> Section:
    """One compiled iteration after the warm-up, profiled (bench/gpu/gpu_worker.py profile): ours --torch-compile
    beside the plain GPT compiled, what each runs per iteration."""
    result, command = run.worker("profile")
    rows = [[what, *(str(result[who].get(key, "")) for who in ("ours", "plain_compiled"))] for key, what in PROFILE_ROWS]
    return Section("One compiled iteration profiled: ours beside the plain GPT", [command], result, [
        "torch.profiler over one iteration after the warm-up (the compiles): ours through pretrain_gpt.py --profile, "
        "then the plain GPT compiled in the same process; TorchDynamo's counts are what each one's compile added. "
        "What ours does that the plain one does not is where the compiled gap lies.", "",
        markdown_table(["per iteration", "ours --torch-compile", "plain GPT compiled"], rows), "",
        "Where the host syncs and copies happen (the outermost enclosing op that is not an aten op; the 10 most "
        "frequent of each):", "",
        markdown_table(["ours --torch-compile", "n", "plain GPT compiled", "n"],
                       [[*a, *b] for a, b in itertools.zip_longest(
                           *([[k, str(v)] for k, v in list(result[who].get("where", {}).items())[:10]]
                             for who in ("ours", "plain_compiled")), fillvalue=["", ""])])])


def section_gpipe(run: Run) -> Section:
    """Peak memory in GPipe's order: ours --torch-compile and the plain GPT compiled (bench/gpu/gpu_worker.py
    gpipe), each in a process of its own; the target reads ours / plain."""
    errors: list = []
    ours, ours_command = run.worker("gpipe", errors=errors)
    if ours is not None:
        run.figure("ours max_memory_bytes", ours["max_memory_bytes"])
    plain, plain_command = run.worker("plain", "--compile", "--gpipe", errors=errors)
    if ours is None or plain is None:
        raise RuntimeError("; ".join(message.splitlines()[0] for _, message in errors))
    figures = {"ours": ours, "plain_compiled": plain,
               "ours_over_plain_memory": ours["max_memory_bytes"] / plain["max_memory_bytes"]}
    rows = [["ours, --torch-compile", f"{ours['ms_per_iteration']:.1f}", gib(ours["max_memory_bytes"])],
            ["plain PyTorch, torch.compile", f"{plain['ms_per_iteration']:.1f}", gib(plain["max_memory_bytes"])]]
    return Section("Peak memory in GPipe's order", [ours_command, plain_command], figures, [
        f"Each iteration runs the {run.size.global_batch // run.size.micro_batch} micro-batches' forwards, then their "
        "backwards (GPipe's order on one stage: every micro-batch's activations, and ours' output-loss gradients, "
        "held at once), then the step. Ours: pretrain_gpt.py's training step with the GPipe schedule at one stage; "
        "the plain GPT: its losses kept, then backward one by one.", "",
        markdown_table(["", "ms / iteration", "peak GiB"], rows), "",
        f"ours / plain peak memory: **{figures['ours_over_plain_memory']:.3f}**"])


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


SECTIONS = {step.name: step for step in gpu_budget.TABLE if step.kind == "section"}  # bench/gpu_check/gpu_budget.py
EAGER_ONLY = ("fp8", "moe")  # --eager-only: these without their compiled runs (inductor's minutes on a CPU)


def section_function(name: str):
    """The function measuring section `name`: its table entry's `run`, here or in a module of bench/gpu (imported
    only when the section runs)."""
    module, _, function = SECTIONS[name].run.rpartition(":")
    return getattr(importlib.import_module(module), function) if module else globals()[function]


STREAM_SECTION_METHODS = {"stream": STREAM_METHODS, "stream_compiled": STREAM_COMPILED_METHODS,
                          "stream_compiled_muon": STREAM_COMPILED_MUON_METHODS}


def section_seconds(name: str, run: Run) -> float:
    """The estimated seconds of section `name` in this run (bench/gpu_check/gpu_budget.py's, for its size, the methods
    --stream-methods leaves it, and whether gpt ran)."""
    seconds = run.estimates.get(name) or gpu_budget.seconds(name, quick=run.size_name == "quick")
    if name == "muon" and "gpt" not in run.done:
        seconds += section_seconds("gpt", run)
    methods = STREAM_SECTION_METHODS.get(name)
    if methods and run.stream_methods is not None:
        chosen = [m for m in methods if method_key(m[1], m[2], m[4]) in run.stream_methods]
        seconds *= len(chosen) / len(methods)
    return seconds


# --------------------------------------------------------------------------------------------------
# The results files
# --------------------------------------------------------------------------------------------------


def device_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu_cores": os.cpu_count(),
            "platform": platform.platform(), "commit": bench_common.commit()}
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
             f"Code: commit {info['commit']}  ",
             f"Model: GPT, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, seq {s.seq}, micro-batch "
             f"{s.micro_batch}, global batch {s.global_batch}, vocab {s.vocab} (padded {padded_vocab(s)}), bf16, mock "
             "data; one process (data-parallel size 1)."]
    if run.size_name == "quick":
        lines += ["", f"> **Quick size (`--quick`): every figure below is from the tiny model above on {info['name']}.** "
                  "It exists so that the script runs in a test; its numbers measure nothing."]
    if run.size_name == "small":
        lines += ["", f"> **Small size (`--size small`): GPT-1.3B's shape scaled down, compiled with inductor, on "
                  f"{info['name']}.** For what a compiled iteration runs (graphs, host syncs, copies), not for speed."]
    return lines + [""]


def cost_model_path(path: str) -> str:
    """Where the time-to-quality cost model goes: beside the .md, `<name>_cost_model.json`."""
    return os.path.splitext(path)[0] + "_cost_model.json"


def status_lines(statuses: dict, run: Run, budget_s: float | None) -> list[str]:
    """Markdown: each section's status and seconds, and the command that runs what the budget left out."""
    rows = [[name, st["status"], "" if st.get("seconds") is None else f"{st['seconds']:.0f}", f"{st['estimate_s']:.0f}",
             st.get("note", "")] for name, st in statuses.items()]
    lines = ["## Sections: status and time", "",
             f"Time budget (--budget-s): {'none' if budget_s is None else f'{budget_s:.0f} s'}; estimated seconds from "
             "bench/gpu_check/gpu_budget.py.", "",
             markdown_table(["section", "status", "seconds", "estimated", "note"], rows), ""]
    left = [name for name, st in statuses.items() if st["status"] in ("skipped", "cut off") and name != "targets"
            and not st.get("note", "").startswith("none of --stream-methods")]
    if left:
        again = ["--only", *left, "targets", *(["--quick"] if run.size_name == "quick" else [])]
        lines += [f"Not measured in this run: {', '.join(left)}. To measure them: "
                  f"`{bench_common.command_line('bench/gpu/gpu.py', again)}`", ""]
    return lines


def write_results(path: str, info: dict, command: str, run: Run, started: str, t0: float, failures: list,
                  statuses: dict | None = None, budget_s: float | None = None) -> None:
    """The .md, the .json beside it and (with section stream) the cost model; machine paths made portable."""
    statuses = statuses or {}
    lines = header(info, command, run, started)
    for name, section in run.done.items():
        commands = ["```", *section.commands, "```", ""] if section.commands else []
        reused = [f"> **Reused, not measured in this run**: {section.reused}.", ""] if section.reused else []
        read = [b for b in gpu_budget.baselines(name) if b in run.done and run.done[b].reused and not section.reused]
        if read:
            reused = [f"> Its ratios read {', '.join(read)} from an earlier call on this machine (the same GPU since the "
                      "same boot): **same-machine** ratios, not same-run.", ""]
        lines += [f"## {section.title} (`{name}`)", "", *reused, *commands, *section.lines, ""]
    for name, figures in run.partial.items():  # what a section that did not finish had measured
        if name not in run.done and figures:
            lines += [f"## `{name}`: did not finish; what it measured before", "", "```",
                      *(f"{k}: {json.dumps(v)}" for k, v in figures.items()), "```", ""]
    for name, error in failures:
        lines += [f"## `{name}`: failed", "", "```", error, "```", ""]
    if statuses:
        lines += status_lines(statuses, run, budget_s)
    lines.append(load_at_end(t0))
    bench_common.write_text(path, bench_common.portable("\n".join(lines) + "\n"), atomic=True)
    s = run.size
    data = {"schema": "megatron_po bench/gpu/gpu.py 1", "command": command, "size": run.size_name, "started": started,
            "minutes": (time.perf_counter() - t0) / 60, "device": info, "load_average_end": loadavg()[:2],
            "model": {**asdict(s), "padded_vocab": padded_vocab(s), "precision": "bf16"},
            "data_parallel_size": 1, "sections": {name: {"title": sec.title, "commands": sec.commands,
                                                         "figures": sec.figures, **({"reused": sec.reused}
                                                                                    if sec.reused else {})}
                                                  for name, sec in run.done.items()},
            "partial": {name: figures for name, figures in run.partial.items() if name not in run.done and figures},
            "failures": [{"section": n, "error": e} for n, e in failures], "budget_s": budget_s,
            "section_status": statuses, "code_hashes": {n: run.code_hashes.get(n) for n in statuses},
            "machine": run.machine}
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
            bench_common.write_text(cost_model_path(path), bench_common.portable(json.dumps(cost_model, indent=1)),
                                    atomic=True)
    bench_common.write_text(os.path.splitext(path)[0] + ".json", bench_common.portable(json.dumps(data, indent=1)),
                            atomic=True)


# Seconds kept at the end of --budget-s for writing the results.
WRITE_RESERVE_S = 2.0


class Terminated(BaseException):
    """SIGTERM (a caller's time limit, bench/gpu_check/gpu_check.py's): stop measuring, write what was measured. Not an
    Exception, so that no section's own error handling takes it for a failed measurement."""


def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the results be written
    raise Terminated()


def take_baselines(run: Run, names: list[str], state_dir: str | None, statuses: dict) -> None:
    """The baselines among `names` that an earlier call measured on this machine at the same code: into `run.done`
    as they were, marked reused (their status: reused)."""
    if not state_dir:
        return
    for name, entry in gpu_state.baselines(state_dir).items():
        if name in names and entry.get("code_hash") == run.code_hashes.get(name) and entry.get("size") == run.size_name:
            how = (f"measured on this machine (GPU {run.machine['gpu_uuid']}, boot {run.machine['boot_id']}) by "
                   f"{entry['call']} at {entry['measured_at']}, code hash {entry['code_hash']}")
            run.done[name] = Section(entry["title"], entry["commands"], entry["figures"], entry["lines"], reused=how)
            statuses[name] = {"status": "reused", "seconds": 0.0, "estimate_s": 0.0, "note": how}
            log(f"[gpu.py] {name}: reused, {how}")


def remember(run: Run, name: str, status: dict, state_dir: str | None, call: str) -> None:
    """What this machine measured, for its later calls: the section (a baseline: its figures) at this code."""
    if not state_dir:
        return
    sec = run.done[name]
    gpu_state.save_measured(state_dir, name, {"code_hash": run.code_hashes.get(name), "seconds": status["seconds"],
                                              "status": "done", "call": call, "started": now(),
                                              "size": run.size_name, "commit": bench_common.commit()})
    if gpu_budget.BY_NAME[name].reusable:
        gpu_state.save_baseline(state_dir, name, {"title": sec.title, "commands": sec.commands, "figures": sec.figures,
                                                  "lines": sec.lines, "code_hash": run.code_hashes.get(name),
                                                  "call": call, "measured_at": now(), "size": run.size_name})


def run_sections(run: Run, names: list[str], write, state_dir: str | None = None, call: str = "") -> tuple[list, dict]:
    """Measure `names` in the order given (`targets` last), each skipped when its estimate exceeds the budget left,
    a baseline this machine measured at this code taken from `state_dir`; `write()` after each section and
    after each figure; (failures as (name, error), statuses by name: status, seconds, estimate_s, note)."""
    failures, statuses = [], {}
    ordered = [n for n in names if n != "targets"] + [n for n in names if n == "targets"]
    take_baselines(run, ordered, state_dir, statuses)
    run.on_figure = lambda: write(failures, statuses)
    for i, name in enumerate(ordered):
        if name in statuses:  # reused
            continue
        estimate, left = section_seconds(name, run), run.seconds_left()
        status = {"status": "skipped", "seconds": None, "estimate_s": estimate}
        if estimate > left and estimate > 0:  # a section that measures nothing (targets) always runs
            statuses[name] = {**status, "note": f"time budget: {max(left, 0):.0f} s left"}
            log(f"[gpu.py] {name} skipped: estimated {estimate:.0f} s, {max(left, 0):.0f} s of the budget left")
            continue
        log(f"[gpu.py] {name} ({(time.perf_counter() - STARTED) / 60:.1f} min)")
        started = run.start_section(name)
        statuses[name] = {**status, "status": "running"}
        try:
            eager = {"compiled": False} if run.eager_only and name in EAGER_ONLY else {}
            run.done[name] = section_function(name)(run, **eager)
            status["status"] = "cut off" if run.cut_off else "done"
        except NoStreamMethod as e:
            status["note"] = str(e)
        except Terminated:
            failures.append((name, "terminated (SIGTERM) while measuring"))
            statuses[name] = {**status, "status": "cut off", "seconds": time.perf_counter() - started,
                              "note": "terminated (SIGTERM)"}
            for rest in ordered[i + 1:]:
                statuses[rest] = {"status": "skipped", "seconds": None, "estimate_s": section_seconds(rest, run),
                                  "note": "terminated (SIGTERM)"}
            break
        except Exception as e:  # noqa: BLE001  (record it, measure the rest)
            status["note"], text = why_failed(e, list(run.tail))
            log(f"[gpu.py] {name} failed: {status['note']}")
            failures.append((name, text))
            status["status"] = "cut off" if run.cut_off else "failed"
        status["seconds"] = time.perf_counter() - started
        statuses[name] = status
        if status["status"] == "done" and name != "targets":
            remember(run, name, status, state_dir, call)
        write(failures, statuses)  # after each: a later crash keeps it
    run.section = None
    return failures, statuses


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the tiny size: every section on a CPU in about a minute")
    ap.add_argument("--size", choices=["full", "quick", "small"], default=None,
                    help="full (GPT-1.3B), quick (= --quick) or small (GPT-1.3B's shape scaled down, inductor: the "
                         "section profile on a CPU)")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections, in this order")
    ap.add_argument("--skip", nargs="+", choices=list(SECTIONS), default=[], help="leave these sections out")
    ap.add_argument("--out", help="the .md to write (the .json goes beside it); default "
                                  "bench/results/gpu_<device>[_quick].md")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per measuring process (also quick)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run: a section whose estimate (bench/gpu_check/gpu_budget.py) exceeds "
                         "what is left is skipped, a process still measuring when the budget ends is killed (its section: cut off), "
                         "and the results are written before the end (default: no budget)")
    ap.add_argument("--seconds", nargs="+", default=[], metavar="SECTION=S",
                    help="the seconds to expect of these sections (the check's plan: their last measured), instead "
                         "of bench/gpu_check/gpu_budget.py's estimates")
    ap.add_argument("--state-dir", default=None,
                    help="this machine's state (bench/gpu_check/gpu_state.py): baselines measured there at this code are "
                         "reused, what this run measures is recorded there")
    ap.add_argument("--call", default="", help="this call's label in the state (the check's: call1, call2, ...)")
    ap.add_argument("--eager-only", action="store_true", help=f"{', '.join(EAGER_ONLY)} without --torch-compile (CPU tests)")
    ap.add_argument("--stream-methods", nargs="+", choices=STREAM_METHOD_KEYS, metavar="METHOD:OPTIMIZER",
                    help="the stream sections' methods to run (default all): " + ", ".join(STREAM_METHOD_KEYS))
    args = ap.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= WRITE_RESERVE_S:
        ap.error(f"--budget-s must exceed {WRITE_RESERVE_S:.0f} s (kept for writing the results)")
    t0 = STARTED
    deadline = None if args.budget_s is None else t0 + args.budget_s - WRITE_RESERVE_S
    size = args.size or ("quick" if args.quick else "full")
    run = Run(size, args.timeout, args.stream_methods, deadline, args.eager_only)
    for pair in args.seconds:
        name, _, value = pair.partition("=")
        run.estimates[name] = float(value)
    run.code_hashes = gpu_plan.current_hashes(bench_common.REPO, list(SECTIONS))
    run.machine = {"gpu_uuid": gpu_state.gpu_uuid(), "boot_id": gpu_state.boot_id()}
    signal.signal(signal.SIGTERM, on_sigterm)
    info = device_info()
    out = args.out or os.path.join(RESULTS, f"gpu_{info['slug']}{'' if size == 'full' else '_' + size}.md")
    command = bench_common.command_line("bench/gpu/gpu.py", argv)
    started = now()
    names = [n for n in (args.only or SECTIONS) if n not in args.skip]
    log(f"[gpu.py] {info['name']}, torch {info['torch']}, size {run.size_name}: sections {', '.join(names)} -> {out}"
        + ("" if args.budget_s is None else f"; budget {args.budget_s:.0f} s"))

    def write(failures, statuses):
        write_results(out, info, command, run, started, t0, failures, statuses, args.budget_s)
    try:
        failures, statuses = run_sections(run, names, write, args.state_dir, args.call)
        write(failures, statuses)
    finally:
        shutil.rmtree(run.tmp, ignore_errors=True)
    wrote = [p for p in (out, os.path.splitext(out)[0] + ".json", cost_model_path(out)) if os.path.exists(p)]
    skipped = [n for n, st in statuses.items() if st["status"] == "skipped"]
    bad = [n for n, st in statuses.items() if st["status"] in ("failed", "cut off")]
    log(f"[gpu.py] wrote {', '.join(wrote)} in {(time.perf_counter() - t0) / 60:.1f} min"
        + (f"; FAILED or CUT OFF: {', '.join(bad)}" if bad else "")
        + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
