"""What every section of bench/gpu/gpu.py shares: a `Run` (its size, the sections done, the two ways to measure in a
fresh process), a `Section` (its commands, figures and Markdown), and the figures computed alike everywhere
(tokens/s, model TFLOP/s, MFU; ours through pretrain_gpt.py at this size, `measure_ours`)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import REPO, log, markdown_table, offline_env  # noqa: E402
from gpu_worker import SIZES, Size, padded_vocab  # noqa: E402


# Output lines a Run keeps of the section measuring now: a section that fails reports them (gpu.py's run_sections).
TAIL_LINES = 3


class BudgetSpent(RuntimeError):
    """A measuring process not started, or killed, because the run's time budget (--budget-s) ran out."""


@dataclass
class Section:
    """What a section measured: its title, the exact commands, its figures (into the JSON) and its
    Markdown lines (tables, notes)."""
    title: str
    commands: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    reused: str = ""  # not measured in this run: a baseline an earlier call measured on this machine (when, which)


class Run:
    """One `python bench/gpu/gpu.py` run: its size, the sections done so far (`done`: name -> Section), and the
    two ways a section measures, each in a fresh process whose output lines are progress.

    With a `deadline` (a time.perf_counter() value: --budget-s), no process starts after it and none runs past
    it: one that would is killed, and `cut_off` says so.

    Figures are kept as they are measured (issue 44): a worker prints `FIGURE <json>` lines, a section calls
    `figure(key, value)` after each of its measurements, and pretrain_gpt.py's per-iteration records are read as
    they come; each lands in `partial[section]` and `on_figure()` (gpu.py: rewrite the results) runs at once, so a
    section killed half-way leaves what it had measured in the results."""

    def __init__(self, size_name: str, timeout: float, stream_methods: list[str] | None = None,
                 deadline: float | None = None, eager_only: bool = False):
        self.size_name, self.size = size_name, SIZES[size_name]
        self.timeout = timeout
        self.stream_methods = stream_methods  # the stream sections' methods to run (keys; None: all of them)
        self.eager_only = eager_only  # gpu.py --eager-only: its EAGER_ONLY sections without their compiled runs
        self.deadline = deadline
        self.cut_off = False  # a process was killed (or not started) because the budget ran out
        self.done: dict[str, Section] = {}
        self.tmp = tempfile.mkdtemp(prefix="bench_gpu_")
        self.section: str | None = None  # the section measuring now
        self.partial: dict[str, dict] = {}  # section -> the figures it has measured so far
        self.on_figure = None  # called after every figure
        self.estimates: dict[str, float] = {}  # seconds to expect per section (the check's plan), over gpu_budget's
        self.code_hashes: dict[str, str] = {}  # gpu_plan.current_hashes: the code each section measures
        self.machine: dict[str, str] = {}  # GPU UUID and boot id (gpu_state)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)  # the section's last output lines

    def start_section(self, name: str) -> float:
        """Section `name` measures from now on (its figures, its output lines, whether the budget cut it off);
        returns the time.perf_counter() of its start."""
        self.section, self.cut_off = name, False
        self.tail.clear()
        return time.perf_counter()

    def figure(self, key: str, value) -> None:
        """Keep one figure of the section measuring now, and have the results rewritten with it."""
        self.partial.setdefault(self.section or "?", {})[key] = value
        if self.on_figure is not None:
            self.on_figure()

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def _stream(self, cmd: list[str], shown: str, prefix: str = "", on_line=None) -> list[str]:
        """Run `cmd` from the checkout, echo its output as it comes; its output lines. Raises on failure.
        `FIGURE {"key": value, ...}` lines become figures `<prefix><key>` as they come; `on_line(line)` sees
        every line.
        The process gets a process group of its own, killed whole (compile workers included) when it runs past
        its timeout, or when this process is interrupted while waiting for it."""
        timeout, by_budget = self.timeout, False
        if self.seconds_left() < timeout:
            timeout, by_budget = self.seconds_left(), True
            if timeout < 1:
                self.cut_off = True
                raise BudgetSpent(f"not started: the time budget is spent: {shown}")
        log(f"  $ {shown}")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        timed_out = threading.Event()

        def kill():  # a hung process, printing or not, ends the section
            timed_out.set()
            bench_common.kill_group(proc)
        killer = threading.Timer(timeout, kill)
        killer.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.strip() and not line.startswith(("FIGURE ", "RESULT ")):
                    self.tail.append(line.strip())
                if line.startswith("FIGURE "):
                    for key, value in json.loads(line[len("FIGURE "):]).items():
                        self.figure(prefix + key, value)
                elif not line.startswith("RESULT "):
                    log("    " + line.rstrip("\n"))
                if on_line is not None:
                    on_line(line)
            proc.wait()
        finally:
            killer.cancel()
            bench_common.kill_group(proc)  # what it left running (or all of it, when an exception interrupted the wait)
            proc.wait()
        if timed_out.is_set():
            if by_budget:
                self.cut_off = True
                raise BudgetSpent(f"cut off at the end of the time budget, after {timeout:.0f} s: {shown}")
            raise RuntimeError(f"killed after {self.timeout:.0f} s: {shown}")
        if proc.returncode != 0:
            raise RuntimeError(f"exit code {proc.returncode}: {shown}\n" + "\n".join(lines[-15:]))
        return lines

    def worker(self, name: str, *flags: str, errors: list | None = None,
               script: str = "gpu_worker.py") -> tuple[dict | None, str]:
        """(result, command) of `python bench/gpu/<script> name --size <size> flags` (default gpu_worker.py; a section
        module's own worker, gpu_fp8.py's). With `errors`, a failure (an out-of-memory, a compiler error) is appended
        there as (command, message) and the result is None, so that one failing measurement leaves the others of its
        section."""
        argv = [name, "--size", self.size_name, *flags]
        shown = " ".join(["python", f"bench/gpu/{script}", *argv])
        if errors is not None:
            try:
                return self.worker(name, *flags, script=script)
            except RuntimeError as e:
                errors.append((shown, str(e)))
                return None, shown
        label = " ".join([name, *(f.lstrip("-") for f in flags if f.startswith("-"))])
        lines = self._stream([sys.executable, os.path.join(HERE, script), *argv], shown, prefix=f"{label}: ")
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
        metrics = os.path.join(out, "metrics.jsonl")
        seen = [0]

        def iterations_so_far(line: str) -> None:  # each new per-iteration record: figures kept at once
            if "iteration" not in line or not os.path.exists(metrics):
                return
            records = [r for r in bench_common.read_metrics(metrics) if "tokens_per_sec" in r]
            if len(records) > seen[0]:
                seen[0] = len(records)
                self.figure(f"{label}: tokens_per_s by iteration", [r["tokens_per_sec"] for r in records])
                if records[-1].get("max_memory_gb") is not None:
                    self.figure(f"{label}: max_memory_bytes", records[-1]["max_memory_gb"] * 2**30)
        lines = self._stream([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv], shown,
                             on_line=iterations_so_far)
        return bench_common.read_metrics(metrics), shown, lines


def measure_peak(run: Run) -> None:
    """The bf16 matmul peak, MFU's denominator, measured in this run unless gpu.py's section peak ran already."""
    if "peak" not in run.done:
        result, command = run.worker("peak")
        run.done["peak"] = Section("bf16 matmul peak", [command], result)


def section_alone(argv: list[str], file: str, doc: str, title: str, section, quick_note: str,
                  model_size=None) -> int:
    """A section of the GPU check run on its own (bench/gpu/gpu_fp8.py, gpu_moe.py): `--quick` (the tiny model, every
    path on a CPU), `--eager-only` (without --torch-compile, whose compiles take minutes on a CPU: what the CPU tests
    run); writes the .md and a .json beside it (default bench/results/<script>_<device>[_quick].md). `section(run,
    compiled)` measures; `model_size(run)` is the model the Markdown names (default the run's size)."""
    import torch
    offline_env()
    name = os.path.basename(file)[:-len(".py")]
    ap = bench_common.parser(doc)
    ap.add_argument("--quick", action="store_true", help="the tiny model: every path on a CPU")
    ap.add_argument("--out", help=f"the .md to write (the .json beside it); default bench/results/{name}_<device>.md")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measuring process (default 600)")
    ap.add_argument("--eager-only", action="store_true", help="without --torch-compile (inductor's minutes on a CPU): "
                                                              "what the CPU test runs")
    args = ap.parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    t0 = time.perf_counter()
    run = Run("quick" if args.quick else "full", args.timeout or 600)
    out = args.out or os.path.join(bench_common.RESULTS, f"{name}_{slug}{'_quick' if args.quick else ''}.md")
    command = bench_common.command_line(bench_common.script(file), argv)
    done = section(run, compiled=not args.eager_only)
    s = model_size(run) if model_size else run.size
    lines = [*bench_common.header(file, argv, f"{title} on {device}", command),
             f"Model: GPT, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, seq {s.seq}, micro-batch "
             f"{s.micro_batch}, global batch {s.global_batch}, vocab {s.vocab}, mock data, one process.", ""]
    if args.quick:
        lines += [f"> **Quick size on {device}: {quick_note}; its numbers measure nothing.**", ""]
    lines += [f"## {done.title}", "", "```", *done.commands, "```", "", *done.lines, "", bench_common.load_at_end(t0)]
    data = {"schema": f"megatron_po bench/gpu/{name}.py 1", "command": command, "size": run.size_name,
            "device": device, "machine": bench_common.machine(), "load_average_end": bench_common.loadavg()[:2],
            "figures": done.figures, "commands": done.commands}
    bench_common.write_text(out, bench_common.portable("\n".join(lines) + "\n"))
    bench_common.write_text(os.path.splitext(out)[0] + ".json", bench_common.portable(json.dumps(data, indent=1)))
    log(f"[{name}.py] wrote {out} in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def why_failed(e: Exception, tail: list[str]) -> tuple[str, str]:
    """(one line, the whole text) of a section that raised `e`: the exception's type and message, where this checkout
    raised it (the innermost frame in it), and the section's last output lines (`tail`): the line goes into the
    status tables (the check's closing screen: issue 58), the text into the results' block of the failed section."""
    message = str(e).splitlines() or [""]
    ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(REPO + os.sep)]
    where = f" (at {os.path.relpath(ours[-1].filename, REPO)}:{ours[-1].lineno} in {ours[-1].name})" \
        if ours else ""
    line = f"{type(e).__name__}: {message[0][:300]}{where}"
    if tail:
        line += "; last lines: " + " / ".join(f"`{t[:160]}`" for t in tail)
    text = "".join(traceback.format_exception(e)).rstrip()
    if tail:
        text += "\n\nThe section's last output lines:\n" + "\n".join(tail)
    return line, text


# --------------------------------------------------------------------------------------------------
# Figures shared by the sections
# --------------------------------------------------------------------------------------------------


def flops_per_iteration(size: Size, model_flags: tuple[str, ...] = ()) -> float:
    """Model FLOPs of one iteration (forward + backward, Megatron's dense convention; a mixture of experts on its
    active parameters) of the GPT of `size` with `model_flags` (--num-experts ...)."""
    from megatron_po.config import parse_args
    from megatron_po.flops import gpt_flops_per_token
    cfg = parse_args(size.gpt_flags() + list(model_flags))
    return gpt_flops_per_token(cfg, padded_vocab(size)) * size.global_batch * size.seq


def peak_tflops(run: Run) -> float | None:
    peak = run.done.get("peak")
    return peak.figures.get("tflops") if peak is not None else None


def throughput(run: Run, ms: float, size: Size | None = None, model_flags: tuple[str, ...] = ()) -> dict:
    """ms per iteration -> tokens/s, model TFLOP/s and (with a measured peak) MFU, of the GPT of `size` (default the
    run's) with `model_flags`."""
    size = size or run.size
    tflops = flops_per_iteration(size, model_flags) / ms * 1e3 / 1e12
    peak = peak_tflops(run)
    return {"ms_per_iteration": ms, "tokens_per_s": size.global_batch * size.seq / ms * 1e3,
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


def measure_ours(run: Run, label: str, title: str, extra_flags: list[str], size: Size | None = None,
                 model_flags: tuple[str, ...] = ()) -> Section:
    """The GPT of this size (`size`, default the run's) through pretrain_gpt.py --bf16 plus `model_flags` (which
    change the FLOPs: --num-experts ...) and `extra_flags`: the median ms per iteration after the warm-up, from the
    per-iteration records (--log-interval 1), and what follows from it."""
    s = size or run.size
    flags = s.gpt_flags() + ["--bf16", "--train-iters", str(s.iterations), "--log-interval", "1", "--log-throughput",
                             "--eval-interval", str(10 * s.iterations), "--eval-iters", "1", *model_flags,
                             *extra_flags]
    records, command, output = run.pretrain(label, flags)
    timed = [r for r in records if "tokens_per_sec" in r][s.warmup:]
    times = sorted(s.global_batch * s.seq / r["tokens_per_sec"] * 1e3 for r in timed)
    figures = throughput(run, times[len(times) // 2], s, model_flags)
    held = next((re.search(r"holds ([\d.]+) M parameters", ln) for ln in output if "holds" in ln), None)
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    # the last loss kept with the figures: a later section reads it from there, also from a baseline an earlier call
    # on this machine measured (its metrics file died with that call's temporary folder: issue 58)
    figures.update(parameters_millions=float(held.group(1)) if held else None, iterations_timed=len(times),
                   last_lm_loss=losses[-1] if losses else None,
                   max_memory_bytes=records[-1].get("max_memory_gb", 0.0) * 2**30, padded_vocab=padded_vocab(s),
                   flops_per_iteration=flops_per_iteration(s, model_flags))
    row = [f"{figures['ms_per_iteration']:.1f}", f"{figures['tokens_per_s']:,.0f}", num(figures["model_tflops"]),
           pct(figures["mfu"]), gib(figures["max_memory_bytes"])]
    return Section(title, [command], figures, [
        f"{figures['parameters_millions']} M parameters; median of the {len(times)} iterations after {s.warmup} "
        f"warm-up; {num(figures['flops_per_iteration'] / 1e12)} TFLOP per iteration (megatron_po/flops.py).", "",
        markdown_table(["ms / iteration", "tokens/s", "model TFLOP/s", "MFU", "peak GiB"], [row])])
