"""bench/gpu/gpu.py's sections `stream`, `stream_compiled`, `stream_compiled_muon`: the D = 4 asynchronous stream
in the single-process emulator, one worker process per method; what each stage costs (`stage_costs`) and the same as
bench/time_to_quality/time_to_quality.py's cost model (`ttq_cost_model`; schema in bench/time_to_quality/ttq_cost_model.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402
bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path

from bench_common import markdown_table  # noqa: E402
from gpu_run import Run, Section, failed_lines, gib, pct  # noqa: E402
from gpu_worker import D, Size, padded_vocab  # noqa: E402
from ttq_cost_model import cost_model_from_measurements  # noqa: E402


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
# compiled): issue 30's target, PipeOptim <= 1.01x async-naive per micro-batch, is judged on the AdamW pair.
# Muon's pair is a section of its own, of lower priority (each compiled method takes minutes on a GPU).
STREAM_COMPILED_METHODS = [
    ("async-naive", "async-naive", "adamw", 1, ("--compile",)),
    ("PipeOptim (AdamW)", "pipeoptim", "adamw", 1, ("--compile",)),
]
STREAM_COMPILED_MUON_METHODS = [
    ("async-naive (Muon)", "async-naive", "muon", 1, ("--compile",)),
    ("PipeOptim (Muon)", "pipeoptim", "muon", 1, ("--compile",)),
]


def method_key(method: str, optimizer: str, flags: tuple) -> str:
    """A stream method's name for --stream-methods: method:optimizer, and :separate for the separate prediction."""
    return ":".join([method, optimizer, *(f.lstrip("-") for f in flags if f != "--compile")])


STREAM_METHOD_KEYS = sorted({method_key(m, o, f) for methods in (STREAM_METHODS, STREAM_COMPILED_METHODS,
                                                                  STREAM_COMPILED_MUON_METHODS)
                             for _, m, o, _, f in methods})


class NoStreamMethod(RuntimeError):
    """--stream-methods leaves a stream section nothing to run (the section is skipped, not failed)."""


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


# Which stages a method's weight policy works on, as bench/time_to_quality/ttq_cost_model.py counts them: at k = 1 the last
# stage's weights are never stale (PipeOptim predicts nothing there, PipeDream stashes nothing); 2BW swaps
# versions on every stage.
POLICY_STAGES = {"pipeoptim": "stale", "pipedream": "stale", "pipedream-2bw": "all"}


def ttq_cost_model(results: dict, costs: list[dict], info: dict, size: Size, size_name: str) -> dict:
    """The stream's per-op costs as bench/time_to_quality/time_to_quality.py's cost model (`--cost-model PATH`; schema in
    bench/time_to_quality/ttq_cost_model.py): one average stage (so that it prices any D), the policies' hook time per op
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
            f"python bench/gpu/gpu.py ({size_name} size), section stream: the D = {D} asynchronous emulator, one process "
            "per method, one segment timed op by op with the device synchronised around every op and policy hook; "
            "medians per stage, then the mean over the stages (one average stage; the per-stage figures are in the "
            "bench's JSON, `stage_costs`).",
            "forward, backward: async-naive's ops less their (empty) policy hooks; step: the Step op less the "
            "policy's hooks, each optimizer's from async-naive with it (Muon's from PipeOptim (Muon) where "
            "async-naive did not run with Muon), at the Newton-Schulz precision this code runs by default.",
            "policy: each method's hook time per op kind (PipeOptim: the restore after a forward, and the prediction "
            "the step writes, i.e. its Step op less async-naive's; PipeDream: the version swap around a backward; "
            "2BW at k = 4: its version copies), AdamW runs, averaged over the stages the method works on "
            "(`stages`).",
            "Not measured here: NAG's step (PipeNAG, and 2BW + error feedback, need fp32 weights; this bench runs "
            "bf16), the split backward of the zero-bubble schedules, communication (one process, DP = 1)."])


def run_stream(run: Run, methods: list) -> tuple[dict, list[str], list, list[list]]:
    """Each method of `methods` in a worker process of its own: (results by label, commands, errors, table rows
    of ms per micro-batch, the ratio to async-naive with the same optimizer, memory and weight copies)."""
    if run.stream_methods is not None:
        methods = [m for m in methods if method_key(m[1], m[2], m[4]) in run.stream_methods]
        if not methods:
            raise NoStreamMethod(f"none of --stream-methods {' '.join(run.stream_methods)} runs in this section")
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


def compiled_stream(run: Run, methods: list, title: str) -> Section:
    results, commands, errors, rows = run_stream(run, methods)
    return Section(title, commands, {"D": D, "methods": results, "failed": [command for command, _ in errors]}, [
        "As the eager stream (section `stream`), with --torch-compile: every transformer layer compiled, and each "
        "optimizer step compiled with PipeOptim's prediction fused into it (one pass over the parameters writes the "
        "fp32 weights, the state, the live bf16 weights and the bf16 prediction). Compilation happens in the warm-up "
        "segment (and the drain that ends it), before the timed segments.", "",
        markdown_table(STREAM_COLUMNS, rows), *failed_lines(errors)])


def section_stream_compiled(run: Run) -> Section:
    return compiled_stream(run, STREAM_COMPILED_METHODS, f"The D = {D} stream under --torch-compile, AdamW")


def section_stream_compiled_muon(run: Run) -> Section:
    return compiled_stream(run, STREAM_COMPILED_MUON_METHODS, f"The D = {D} stream under --torch-compile, Muon")
