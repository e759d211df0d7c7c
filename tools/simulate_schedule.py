r"""Print a pipeline schedule, simulate its timeline and draw it.

    python tools/simulate_schedule.py --pipeline-method 1f1b --num-stages 4 --num-chunks 2 \
        --num-microbatches 8 --png /tmp/interleaved.png

    python tools/simulate_schedule.py --pipeline-method all --num-stages 4 --num-microbatches 8 \
        --t-forward 20 --t-backward 40 --t-weight 20

`--t-forward` / `--t-backward` are the cost of one micro-batch through one whole pipeline stage; with
`--num-chunks v` each chunk costs 1/v of that, so runs with different v compare at equal model size.
`--t-backward` is the whole backward; zero-bubble schedules split it into B (input gradient,
t_backward - t_weight) and W (weight gradients, `--t-weight`, default half the backward).
`--pipeline-method all` prints one row per schedule (bubble fraction, peak in-flight micro-batches
per rank); interleaved schedules there use `--num-chunks` (2 when it is 1).

Which pipeline should I use at D stages and M micro-batches per update? `--cost-model PATH` prices every
method, synchronous and asynchronous (k = 1, 2, M), from its own op list at a measured or derived per-op
cost model (megatron_po/pipeline/cost_model.py; work a model has no figure for, such as PipeDream's stash on a
model that did not measure it, is derived there and says so), and prints time per iteration, bubble, weight
copies, activations in flight and the deep-pipeline study's verdict where it has one, with the horizon it was
judged at (the synchronous run's updates and micro-batches), its seeds and its speed-up range (median and
10-90 %; "range not computed" where the study did not compute one). For Muon it also prints, for any (D, M), the
speed-up PREDICTED for PipeOptim, PipeOptim + error feedback and async-naive (median, 10-90 % over seed pairings,
the median's 80 % interval, the verdict it implies, "uncertain" where that interval crosses the bar) by the
sample-efficiency model refitted on the D = 4, 8 and 16 studies (megatron_po/pipeline/sample_efficiency.py:
ln r = beta[method] x tau(D, k) + gamma x log2(M / k), tau the mean staleness in updates read off the op lists;
the fit: bench/results/deep_pipelines/predictions_refit.md), its interval calibrated by leaving each depth out
(the figures close this help). The D = 8 fit before it (issue 50, predictions.md) got 6 of 8 verdicts right at
the settings it had not seen (every PipeOptim one; async-naive at M = 1 met where it predicted a miss) but only
2 of 8 medians inside its 80 % intervals, which it took from its own residual:

    python tools/simulate_schedule.py --cost-model bench/results/gpu_nvidia_h200_a_cost_model.json \
        --optimizer muon --num-stages 8 --num-microbatches 4

Long sequences: `--seq-length S` (with `--micro-batch-size B`, default the model's, and `--context-parallel-size
CP`) re-derives the cost model's per-micro-batch cost for micro-batches of B x S tokens, each sequence split over
CP ranks, where the model states its shape (`dims`): per token and layer 24h^2 + 2sh FLOPs (causal attention),
steps per parameter, messages by their tokens (cost_model.at_sequence_length). The figures are DERIVED, not
measured, and the table says so:

    python tools/simulate_schedule.py --cost-model bench/results/gpu_nvidia_h200_a_cost_model.json \
        --num-stages 4 --num-microbatches 2 --seq-length 16384 --micro-batch-size 1 --context-parallel-size 2
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import math
import os
import textwrap

from megatron_po.errors import ConfigError, UserError
from megatron_po.pipeline import cost_model as cmm
from megatron_po.pipeline import sample_efficiency as se
from megatron_po.pipeline.schedules import build_schedule, staleness
from megatron_po.pipeline.simulator import plot_timeline, simulate


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAR = 1.25  # issue 36's target: the same loss this much sooner
# The study's verdicts: the study at >= 512 updates (issue 41) first, then the older short-horizon one.
VERDICTS = [os.path.join("bench", "results", "deep_pipelines", "*_verdicts.json"),
            os.path.join("bench", "results", "time_to_quality", "deep_pipelines*_verdicts.json")]
# The sample-efficiency model the predictions come from (bench/deep_pipelines/deep_pipelines_predict.py): the
# refit on every depth (issue 57); a fit without a calibrated interval is issue 50's, on the D = 8 study.
PREDICTIONS = os.path.join("bench", "results", "deep_pipelines", "predictions_refit.json")
FITTED = ("predicted (model fitted on the D = 4, 8 and 16 studies: Muon, hidden 64, 512 updates; 80 % interval "
          "calibrated by leaving each depth out)")
FITTED_D8 = "predicted (model fitted on the D = 8 study: Muon, hidden 64, 512 updates)"


def calibration_text(path: str = PREDICTIONS) -> str:
    """The predictions' interval and its leave-one-depth-out coverage, from the fit at `path` (the --help's last
    paragraph)."""
    full = path if os.path.isabs(path) else os.path.join(REPO, path)
    if not os.path.isfile(full):
        return f"The predictions' interval: {path} is missing, so no prediction is printed."
    with open(full) as f:
        fit = json.load(f)["fit"]
    if "interval" not in fit:
        return f"The predictions' interval ({path}): the fit's own residual at a new setting (not calibrated)."
    iv, cov = fit["interval"], fit["lodo"]["coverage"]
    h = se.t90(iv["dof"]) * iv["sd"]
    n, own, cal = (sum(c[k] for c in cov) for k in ("n", "own", "calibrated"))
    return (f"The predictions' 80 % interval of the median ({path}): ln r +- {se.t90(iv['dof']):.3f} x "
            f"{iv['sd']:.4f} = +- {h:.4f}, r within a factor {math.exp(h):.3f} either way at every setting; sd = the "
            f"root-mean-square error of the {iv['dof']} leave-one-depth-out predictions (each depth's units predicted "
            "by the fit to the other depths), t at that many degrees of freedom. Leave-one-depth-out coverage, the "
            "width taken from the other depths' errors: " +
            ", ".join(f"D = {c['D']} {c['calibrated']} of {c['n']}" for c in cov) +
            f" ({cal} of {n}; nominal 80 %); the fit's own interval (issue 50's construction): " +
            ", ".join(f"D = {c['D']} {c['own']} of {c['n']}" for c in cov) + f" ({own} of {n}).")


def parse_args(argv=None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest + "\n" + textwrap.fill(calibration_text(), 115),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline-method", choices=["none", "gpipe", "1f1b", "async", "zb-h1", "zb-h2", "zb-v", "all"],
                   default="1f1b",
                   help="1f1b with --num-chunks > 1 is Megatron's interleaved 1F1B; async streams "
                        "micro-batches without a flush and steps each chunk every --update-interval backwards; "
                        "zb-h1 / zb-h2 / zb-v: zero bubble (zb-h1 with --num-chunks > 1: interleaved; zb-v: "
                        "--num-chunks 2 in a V); all: a table")
    p.add_argument("--num-stages", type=int, default=4, help="pipeline ranks D")
    p.add_argument("--num-chunks", type=int, default=1, help="model chunks per rank v (virtual pipeline size)")
    p.add_argument("--num-microbatches", type=int, default=8, help="micro-batches M")
    p.add_argument("--t-forward", type=float, default=1.0, help="forward time of one stage (all its chunks)")
    p.add_argument("--t-backward", type=float, default=2.0, help="backward time of one stage (all its chunks)")
    p.add_argument("--t-weight", type=float, default=None,
                   help="weight-gradient part of --t-backward (zero-bubble W); default: half of it")
    p.add_argument("--t-p2p", type=float, default=0.0, help="latency of one activation/gradient message")
    p.add_argument("--t-step", type=float, default=0.0, help="time of one optimizer step op")
    p.add_argument("--update-interval", type=int, default=1, help="async: step after every k backwards")
    p.add_argument("--png", default=None, help="write the Gantt chart here")
    p.add_argument("--cost-model", default=None, metavar="PATH",
                   help="price every method at D = --num-stages, M = --num-microbatches with this per-op cost model "
                        "(e.g. bench/results/gpu_nvidia_h200_a_cost_model.json, measured) and print the table")
    p.add_argument("--optimizer", default="adamw", help="with --cost-model: whose step to price (default adamw)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="with --cost-model: price micro-batches of this many tokens per sequence (DERIVED from the "
                        "model's stated shape: cost_model.at_sequence_length)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="with --seq-length: sequences per micro-batch (default: the cost model's)")
    p.add_argument("--context-parallel-size", type=int, default=1,
                   help="with --seq-length: each sequence split over this many ranks, each pricing its share")
    p.add_argument("--map", nargs=2, default=None, metavar=("DS", "MS"),
                   help="with --cost-model: the (D, M) map instead of one table, e.g. --map 4,8,16 2,4,8,16,32: "
                        "per cell the best synchronous schedule and the fastest asynchronous stream (k = M) against it")
    p.add_argument("--verdicts", action="append", default=None, metavar="PATH",
                   help="with --cost-model: a study's verdicts file or glob (repeatable; the first with a verdict for "
                        f"(D, M, optimizer) is used; '' for none; default: {', '.join(VERDICTS)})")
    p.add_argument("--predictions", default=PREDICTIONS, metavar="PATH",
                   help="with --cost-model and --optimizer muon: the fitted sample-efficiency model the predicted "
                        f"speed-ups come from ('' for none; default {PREDICTIONS})")
    return p.parse_args(argv)


def _fit(path: str | None, optimizer: str) -> dict | None:
    """The fitted model of `path` (predictions.json's "fit"), or None: no file, or an optimizer it was not fitted
    on (Muon only)."""
    if not path or optimizer != "muon":
        return None
    full = path if os.path.isabs(path) else os.path.join(REPO, path)
    if not os.path.isfile(full):
        return None
    with open(full) as f:
        return json.load(f)["fit"]


def fitted_label(fit: dict) -> str:
    """How a prediction of `fit` is marked: the refit with its calibrated interval, or issue 50's D = 8 fit."""
    return FITTED if "interval" in fit else FITTED_D8


def _predicted(fit: dict | None, method: str, ef: bool, D: int, M: int, k, bound: float) -> str | None:
    """The prediction of one asynchronous row, marked as such, or None where the model has no coefficient."""
    p = se.predict(fit, "po-ef" if ef else method, D, M, k, bound) if fit else None
    return f"{fitted_label(fit)}: {se.describe(p, cmm.format_speedup)}" if p else None


def _simulate(args, method: str, num_chunks: int):
    schedule = build_schedule(method, args.num_stages, num_chunks, args.num_microbatches,
                              update_interval=args.update_interval if method == "async" else 1)
    v = schedule.num_chunks
    t_w = args.t_backward / 2 if args.t_weight is None else args.t_weight
    if not 0 <= t_w <= args.t_backward:
        raise ConfigError(f"--t-weight ({t_w}) must be in [0, --t-backward ({args.t_backward})]")
    timeline = simulate(schedule, args.t_forward / v, (args.t_backward - t_w) / v, args.t_p2p, args.t_step,
                        t_weight=t_w / v)
    return schedule, timeline


ALL = [("gpipe", 1), ("1f1b", 1), ("1f1b", None), ("zb-h1", 1), ("zb-h1", None), ("zb-h2", 1), ("zb-v", 2),
       ("async", 1)]


def table_of_all(args) -> str:
    """One row per schedule: makespan, bubble fraction, bubble time / ideal, peak in flight per rank."""
    v_inter = args.num_chunks if args.num_chunks > 1 else 2
    ideal = args.num_microbatches * (args.t_forward + args.t_backward)
    lines = [f"D={args.num_stages} M={args.num_microbatches} t_F={args.t_forward:g} t_B+t_W={args.t_backward:g} "
             f"t_W={args.t_backward / 2 if args.t_weight is None else args.t_weight:g} (per stage); ideal {ideal:g}",
             f"{'schedule':<22} {'v':>2} {'makespan':>9} {'bubble':>7} {'extra/ideal':>11}  peak in flight per rank"]
    for method, v in ALL:
        v = v or v_inter
        try:
            schedule, tl = _simulate(args, method, v)
        except ConfigError as e:  # e.g. interleaving needs M % D == 0
            lines.append(f"{method:<22} {v:>2}  skipped: {e}")
            continue
        name = ("interleaved-" if v > 1 and method == "zb-h1" else "") + schedule.name
        peaks = " ".join(str(tl.peak_activations[r]) for r in sorted(tl.peak_activations))
        lines.append(f"{name:<22} {v:>2} {tl.makespan:>9.4g} {tl.bubble_fraction:>7.4f} "
                     f"{(tl.makespan - ideal) / ideal:>11.4f}  {peaks}")
    return "\n".join(lines)


SYNC_ROWS = [("1f1b", "1F1B"), ("interleaved-1f1b", "interleaved 1F1B (v=2)"), ("zb-h1", "ZB-H1"),
             ("interleaved-zb-h1", "interleaved ZB-H1 (v=2)"), ("zb-h2", "ZB-H2"), ("zb-v", "ZB-V")]
ASYNC_ROWS = [("async-naive", False, "async-naive"), ("pipedream", False, "PipeDream"),
              ("pipedream-2bw", False, "PipeDream-2BW"), ("pipeoptim", False, "PipeOptim"),
              ("pipeoptim", True, "PipeOptim + error feedback")]


def _verdicts(paths: list[str] | None, cm: dict, D: int, M: int, optimizer: str) -> dict:
    """The study's verdict entry for this (cost model, D, M, optimizer) from the first verdicts file the globs
    `paths` name that has one (the new study's folder comes first by default): {"rows": {row label: verdict},
    "summary", "source", and where the file gives them "status", "horizon_updates", "horizon_microbatches",
    "sync_seeds", "rule", "row_stats": {row label: {"seeds", "speedup_median", "speedup_p10", "speedup_p90"}}}
    (bench/deep_pipelines/deep_pipelines_report.py writes them; a row may also be such a dict with "verdict").
    Older files lack the horizon and seeds: they are read from the study's JSON beside its report
    (settings.steps micro-batches, steps / M updates of the synchronous run; each unit's runs)."""
    import glob
    key = f"D={D},M={M},{optimizer}"
    for path in filter(None, paths or []):  # --verdicts "": none
        for full in sorted(glob.glob(path if os.path.isabs(path) else os.path.join(REPO, path))):
            if not os.path.isfile(full):
                continue
            with open(full) as f:
                entry = json.load(f).get("verdicts", {}).get(key)
            if entry and entry.get("cost_model") in (None, cm["name"]):
                return _with_study_facts(dict(entry), M)
    return {}


def _with_study_facts(entry: dict, M: int) -> dict:
    """entry with the horizon and seeds an older verdicts file leaves out, from the study's JSON if it is there."""
    src = entry.get("source", "")
    data_path = os.path.join(REPO, os.path.splitext(src)[0] + ".json") if src else ""
    if "horizon_updates" in entry or not os.path.isfile(data_path):
        return entry
    with open(data_path) as f:
        data = json.load(f)
    steps = data.get("settings", {}).get("steps")
    if steps:
        entry["horizon_microbatches"], entry["horizon_updates"] = steps, steps // M
    seeds = {u.get("label"): len(u.get("runs", [])) for u in data.get("units", [])}
    sync = [n for label, n in seeds.items() if str(label).startswith("sync")]
    if sync:
        entry["sync_seeds"] = sync[0]
    entry["row_stats"] = {label: {"seeds": n} for label, n in seeds.items()}
    return entry


def _row_verdict(verdicts: dict, key: str) -> str | None:
    """One row's verdict with its seeds and its speed-up range (median and 10-90 %), or None."""
    row = verdicts.get("rows", {}).get(key)
    if row is None:
        return None
    stats = {**verdicts.get("row_stats", {}).get(key, {}), **(row if isinstance(row, dict) else {})}
    text = row.get("verdict", "") if isinstance(row, dict) else row
    seeds = stats.get("seeds")
    parts = [text] + ([f"{seeds} seed{'s' if seeds != 1 else ''}"] if seeds and " seed" not in text else [])
    if all(stats.get(f) is not None for f in ("speedup_median", "speedup_p10", "speedup_p90")):
        parts.append(f"speed-up median {cmm.format_speedup(stats['speedup_median'])}, 10-90 % {cmm.format_speedup(stats['speedup_p10'])}-"
                     f"{cmm.format_speedup(stats['speedup_p90'])}")
    else:
        parts.append("range not computed")
    return "; ".join(p for p in parts if p)


def _study_line(verdicts: dict, default_source) -> str:
    """The study's summary with its status, horizon, the synchronous run's seeds and the rule."""
    facts = [] if verdicts.get("status", "final") == "final" else [f"status: {verdicts['status']}"]
    if verdicts.get("horizon_updates") is not None:
        facts.append(f"horizon {verdicts['horizon_updates']} updates of the synchronous run"
                     + (f" ({verdicts['horizon_microbatches']} micro-batches)"
                        if verdicts.get("horizon_microbatches") is not None else ""))
    else:
        facts.append("horizon not recorded")
    if verdicts.get("sync_seeds") is not None:
        facts.append(f"{verdicts['sync_seeds']} seeds of the synchronous run")
    if verdicts.get("rule"):
        facts.append(f"rule: {verdicts['rule']}")
    return f"study ({verdicts.get('source', default_source)}): {verdicts['summary']}; " + "; ".join(facts)


def _sync_flushes(D: int, M: int, base) -> dict:
    """Each synchronous schedule's flush of M micro-batches at D stages on `base` costs, by row label: (schedule
    name, its Timeline, or the reason the schedule does not admit (D, M))."""
    out = {}
    for name, label in SYNC_ROWS:
        try:
            out[label] = (name, cmm.sync_iteration(name, D, M, base))
        except (ConfigError, ValueError) as e:
            out[label] = (name, e)
    return out


def cost_model_of(args) -> tuple[dict, list[str]]:
    """The --cost-model, re-derived at --seq-length / --micro-batch-size / --context-parallel-size when given, and
    the derivation lines that re-deriving added (printed with the table)."""
    cm = cmm.load_cost_model(args.cost_model)
    if args.seq_length is None:
        if args.micro_batch_size is not None or args.context_parallel_size != 1:
            raise ConfigError("--micro-batch-size and --context-parallel-size apply with --seq-length")
        return cm, []
    at = cmm.at_sequence_length(cm, args.seq_length, args.micro_batch_size, args.context_parallel_size)
    return at, at["derivation"][len(cm.get("derivation", [])):]


def throughput_map(args) -> str:
    """Per (D, M): the fastest synchronous schedule's ms per micro-batch and the fastest asynchronous stream's
    speed against it (the bound on any asynchronous win: equal sample efficiency at best)."""
    cm, _ = cost_model_of(args)
    try:
        ds, ms = ([int(x) for x in v.split(",")] for v in args.map)
    except ValueError:
        raise ConfigError(f"--map takes two comma-separated lists of integers, got {' '.join(args.map)}") from None
    opt = args.optimizer
    fit = _fit(args.predictions, opt)
    lines = [f"optimizer {opt}; cost model {cm['name']} ({cmm.provenance(cm).upper()}); per cell: best synchronous "
             "schedule, its ms per micro-batch; the fastest asynchronous stream (k = M) and its speed against it"
             + (f"; PipeOptim's speed-up to its final loss at k = M, {fitted_label(fit)}" if fit else ""),
             "| D \\ M | " + " | ".join(str(M) for M in ms) + " |", "|---|" + "---|" * len(ms)]
    runner_up = {label: [] for _, label in SYNC_ROWS}  # per best schedule: the next one's gap per cell, in %
    for D in ds:
        cells = []
        base, _ = cmm.method_costs(cm, D, opt, "1f1b")
        for M in ms:
            sync = {label: tl.makespan / M for label, (_, tl) in _sync_flushes(D, M, base).items()
                    if not isinstance(tl, Exception)}
            best = min(sync, key=sync.get)
            second = min((k for k in sync if k != best), key=sync.get)
            runner_up[best].append((second, 100 * (sync[second] / sync[best] - 1)))
            fast = {}
            for method, ef, label in ASYNC_ROWS:
                if method == "pipedream-2bw" and M < D:
                    continue
                try:
                    c, _ = cmm.method_costs(cm, D, opt, method, error_feedback=ef)
                except ConfigError:
                    continue
                fast[label] = cmm.async_per_microbatch(D, M, c).seconds_per_microbatch
            quick = min(fast, key=fast.get)
            p = se.predict(fit, "pipeoptim", D, M, M, sync[best] / fast["PipeOptim"]) if fit else None
            cells.append(f"{best} {1e3 * sync[best]:.1f} ms; {quick} k={M}: {sync[best] / fast[quick]:.2f}x"
                         + (f"; PipeOptim k={M} predicted {cmm.format_speedup(p['speedup'])} ({p['verdict']}"
                            f"{'' if p['firm'] else ', uncertain'})" if p else ""))
        lines.append(f"| {D} | " + " | ".join(cells) + " |")
    for label, cells in runner_up.items():
        if cells:
            gaps = [g for _, g in cells]
            lines.append(f"where {label} is the best ({len(cells)} cells), the next synchronous schedule "
                         f"({' / '.join(dict.fromkeys(n for n, _ in cells))}) is {min(gaps):.2f}-{max(gaps):.2f} % "
                         "slower per micro-batch")
    return "\n".join(lines)


def methods_table(args) -> str:
    """Every method priced at (D, M) on the cost model, fastest first within its family."""
    cm, derived = cost_model_of(args)
    D, M, opt = args.num_stages, args.num_microbatches, args.optimizer
    rows, notes, predicted = [], set(), {}
    base, _ = cmm.method_costs(cm, D, opt, "1f1b")
    for label, (name, tl) in _sync_flushes(D, M, base).items():
        if isinstance(tl, Exception):
            rows.append((label, "-", None, None, None, None, None, f"not admitted: {tl}"))
            continue
        v = cmm.chunks_of(name)
        rows.append((label, "-", tl.makespan, tl.makespan / M, tl.bubble_fraction, cmm.weight_copies(name, D),
                     max(tl.peak_activations.values()) / v, ""))
    best_sync = min((r[3] for r in rows if r[3] is not None), default=None)
    for k in dict.fromkeys((1, 2, M)):
        for method, ef, label in ASYNC_ROWS:
            if method == "pipedream-2bw" and k < D:
                continue  # 2BW accumulates over at least D micro-batches per step
            try:
                c, why = cmm.method_costs(cm, D, opt, method, error_feedback=ef)
            except ConfigError as e:
                rows.append((label, k, None, None, None, None, None, f"not priced: {str(e).split(': ', 1)[-1]}"))
                continue
            notes.update(why)
            s = cmm.async_per_microbatch(D, k, c)
            rows.append((label, k, M * s.seconds_per_microbatch, s.seconds_per_microbatch, s.bubble_fraction,
                         cmm.weight_copies(method, D, k, ef), s.peak_activations, f"staleness <= {s.max_staleness}"))
            predicted[(label, k)] = (method, ef)
    verdicts = _verdicts(args.verdicts or VERDICTS, cm, D, M, opt)
    fit = _fit(args.predictions, opt)
    lines = [f"D={D} M={M} optimizer {opt}; cost model {cm['name']} ({cmm.provenance(cm).upper()}): {cm['device']}; "
             f"prices {cmm.pipeline_priced(cm, D)}; p2p {cm.get('p2p_ms', 0.0):g} ms per message between two ranks "
             "(none between two chunks of one rank)",
             f"{'method':<27} {'k':>2} {'ms/iteration':>12} {'ms/micro-batch':>14} {'vs best sync':>12} {'bubble':>7} "
             f"{'weights':>7} {'act.':>5}  notes / verdict"]
    for label, k, it, per, bubble, copies, act, note in rows:
        if it is None:
            lines.append(f"{label:<27} {k!s:>2} {'':>12} {'':>14} {'':>12} {'':>7} {'':>7} {'':>5}  {note}")
            continue
        key = label if k == "-" else f"{label}, k={k}"
        verdict = _row_verdict(verdicts, key)
        if verdict is None and k != "-" and best_sync / per < BAR:
            # k = M: the same samples per update as the flush, plus staleness: its throughput bounds its win.
            # k < M updates more often per sample: it would need BAR / ratio x the flush's sample efficiency.
            verdict = (f"throughput {best_sync / per:.2f}x < {BAR}x: no {BAR}x win at equal sample efficiency" if k == M
                       else f"needs {BAR * per / best_sync:.2f}x the sample efficiency of the best sync for a {BAR}x win")
        if (label, k) in predicted:  # beside the bound and any measured verdict, marked as a prediction
            said = _predicted(fit, *predicted[(label, k)], D, M, k, best_sync / per)
            verdict = "; ".join(x for x in (verdict, said) if x) or None
        lines.append(f"{label:<27} {k!s:>2} {1e3 * it:>12.2f} {1e3 * per:>14.3f} {best_sync / per:>11.3f}x "
                     f"{bubble:>7.3f} {copies:>7} {act:>5g}  {note}{'; ' if note and verdict else ''}{verdict or ''}")
    lines.append("ms/iteration: M micro-batches (synchronous: one flush + every rank's step; asynchronous: the "
                 "stream's steady state, a step per k micro-batches); vs best sync: its ms/micro-batch over this one's; "
                 "weights: weight-sized copies per chunk; act.: peak activations in flight on a rank, in one stage's "
                 "micro-batches")
    lines += [f"note: {n}" for n in sorted(notes)]
    lines += [f"derived: {d}" for d in derived]
    if verdicts.get("summary"):
        lines.append(_study_line(verdicts, args.verdicts))
    else:
        lines.append("study: no verdict at this (D, M, optimizer, cost model)")
    if fit:
        lines.append(f"predictions: speed-up to the best synchronous schedule's final loss = bound / r, ln r = "
                     "beta[method] x tau + gamma x log2(M / k) (tau: mean staleness in updates from the op list); "
                     "median [10-90 % over seed pairings], the median's 80 % interval, rule (b) on the predicted 10th "
                     f"percentile; {fitted_label(fit)[len('predicted ('):-1]} ({args.predictions}; how it did on the "
                     "settings it had not seen: the study's reports, docs/benchmarks.md)")
    elif opt != "muon":
        lines.append("predictions: none for this optimizer (the sample-efficiency model is fitted on Muon)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.cost_model:
            print(throughput_map(args) if args.map else methods_table(args))
            return 0
        if args.pipeline_method == "all":
            print(table_of_all(args))
            return 0
        schedule, timeline = _simulate(args, args.pipeline_method, args.num_chunks)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)

    print(schedule)
    print()
    print(timeline.table())
    M = schedule.num_microbatches
    ideal = M * (args.t_forward + args.t_backward)
    print(f"ideal compute per rank {ideal:.4g}; bubble time / ideal = "
          f"{(timeline.makespan - ideal) / ideal if ideal else 0.0:.4f}")
    if args.pipeline_method == "async":
        print("\nstaleness s(mb) per (rank, chunk): optimizer steps between F(mb) and B(mb)")
        for (r, c), per_mb in sorted(staleness(schedule).items()):
            values = [per_mb[mb] for mb in sorted(per_mb)]
            print(f"  rank {r} chunk {c}: max {max(values)}  {' '.join(map(str, values))}")
    if args.png:
        plot_timeline(timeline, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
