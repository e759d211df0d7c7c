"""The time-to-quality verdicts of bench/time_to_quality/time_to_quality.py on any clock: time to the target losses, the
speed-ups against the three synchronous baselines, the goal of issue 16 at each clock, the sensitivity to
the optimizer step's cost and the cost model's variants.

Baselines (the same runs' curves, timed on the same clock as the method):
- 1F1B at M = 2D, the practical synchronous configuration (T1 is its final loss, reached at its end);
- ZB-H1 at M = 2D, the strongest synchronous schedule here (same runs as 1F1B, a shorter flush);
- synchronous training at equal updates (one update per micro-batch of B), timed as 1F1B over D micro-batches
  of B/D (`ttq_clock.equal_updates_seconds_per_mb`): it reaches T1 before its end.
Speed-up to T1 against a baseline = the baseline's time to T1 / the method's mean time to T1 over seeds
(only when every seed reaches T1).
"""

from __future__ import annotations

import statistics

import ttq_clock as tc
import ttq_run as tr
from ttq_run import ASYNC, LABELS, Unit, cv

GOAL_SPEEDUP = 1.25
BASELINES = (("1f1b", "1F1B M=2D"), ("zb-h1", "ZB-H1 M=2D"), ("sync", "sync, 1 update/micro-batch"))


def finals(s, runs: list[dict]) -> dict:
    return {r["seed"]: tr.final_val(r, s.steps) for r in runs}


def val_ms(s, runs: list[dict]) -> tuple[float, float]:
    return cv.mean_std(list(finals(s, runs).values()))


def targets(s, study: dict, D: int, o: str) -> list[tuple[str, float]] | None:
    ref = study["runs"].get(Unit(o, "sync", 0, 2 * D))
    if not ref:
        return None
    t1 = val_ms(s, ref)[0]
    return [("T1 = 1F1B M=2D final", t1), ("T2 = T1 + 0.1", t1 + 0.1),
            ("T3 = (unigram + T1) / 2", (study["unigram"] + t1) / 2)]


def _mean_if_all(times: list) -> float | None:
    return statistics.fmean(times) if times and all(t is not None for t in times) else None


def timed_rows(s, study: dict, D: int, o: str, clock: tc.Clock | None = None) -> list[dict]:
    """configurations() of (D, o) on `clock`, each with its runs' times to every target ("per_target",
    per seed), its final loss ("val") and "speedup": {baseline: speed-up to T1 or None}."""
    rows, tgs = tc.configurations(s, study, D, o, clock), targets(s, study, D, o)
    ref_unit = Unit(o, "sync", 0, 2 * D)
    for row in rows:
        runs = study["runs"][row["unit"]]
        row["val"] = val_ms(s, runs)
        row["per_target"] = [[tc.time_to(r["curve"], t, row["sec_per_mb"]) for r in runs] for _, t in tgs or []]
        if tgs and row["unit"] == ref_unit:  # 1F1B M=2D's runs (any schedule) reach T1 at their end
            row["per_target"][0] = [s.steps * row["sec_per_mb"]] * len(runs)
    base_t1 = {}
    for name, _ in BASELINES:
        b = next((r for r in rows if r["name"] == name and r.get("M") == (1 if name == "sync" else 2 * D)), None)
        base_t1[name] = _mean_if_all(b["per_target"][0]) if b and tgs else None
    for row in rows:
        t1 = _mean_if_all(row["per_target"][0]) if tgs else None
        row["speedup"] = {name: (base / t1 if base and t1 else None) for name, base in base_t1.items()}
    return rows


def sensitivity(s, study: dict, D: int, o: str, clock: tc.Clock) -> dict:
    """{method: {baseline: {"ratio": r, "at0": speed-up at r = 0, "fn": r -> speed-up}}}: r = the largest
    step/(forward+backward) at which the method still reaches T1 >= GOAL_SPEEDUP x sooner than the baseline
    (1F1B or ZB-H1 at M = 2D; None if not even at r = 0), on `clock` with every step (the method's and the
    baseline's) priced at r (`ttq_clock.scale_steps`), the rest of the clock fixed. Methods some seed of
    which never reaches T1 are left out: quality, not the clock, decides them."""
    tgs = targets(s, study, D, o)
    ops = clock.ops.get((D, o))
    if not tgs or ops is None:
        return {}
    out = {}
    for unit in tr.async_units(o, D):
        m, own = unit.name, clock.ops.get((D, unit.opt), {})
        if unit not in study["runs"] or m not in own:
            continue
        mb = _mean_if_all([tc.time_to(r["curve"], tgs[0][1], 1.0) for r in study["runs"][unit]])
        if mb is None:
            continue
        k = tc.update_interval(m, D)
        out[m] = {}
        for base, _ in BASELINES[:2]:
            def speedup_at(r, base=base, own=own, m=m, k=k, mb=mb):
                sec_b = tc.sync_seconds_per_update(base, tc.scale_steps(ops, r)["async-naive"], D, 2 * D) / (2 * D)
                return s.steps * sec_b / (mb * tc.async_seconds_per_mb(tc.scale_steps(own, r)[m], D, k))
            out[m][base] = {"ratio": tc.largest_ratio(speedup_at, GOAL_SPEEDUP), "at0": speedup_at(0.0),
                            "fn": speedup_at}
    return out


def fmt_ratio(entry: dict) -> str:
    r = entry["ratio"]
    if r is None:
        return f"never ({tc.fmt_speedup(entry['at0'])} with a free step)"
    return f"≥ {r:.3g}" if r >= 64.0 else f"{r:.3f}"


def sensitivity_lines(s, study: dict, clocks: list[tc.Clock]) -> list[str]:
    """One line per (D, optimizer): each asynchronous method's largest step/(F+B) for the goal's speed-up
    against 1F1B and ZB-H1 at M = 2D on every clock, and each clock's own step/(F+B)."""
    lines = []
    for D in s.depths:
        for o in s.optimizers:
            sens = [sensitivity(s, study, D, o, c) for c in clocks]
            methods = [m for m in ASYNC if any(m in x for x in sens)]
            own = "; ".join(f"{c.key.upper()} {tc.step_ratio_of(c.ops[(D, o)]):.3f}" for c in clocks
                            if (D, o) in c.ops)  # (mean over stages: the scale r is on)
            said = []
            for m in methods:
                per = []
                for b, label in BASELINES[:2]:
                    per.append(f"vs {label} " + ", ".join(
                        f"{c.key.upper()} {fmt_ratio(x[m][b]) if m in x else '–'}" for c, x in zip(clocks, sens)))
                said.append(f"{LABELS[m]}: " + "; ".join(per))
            lines.append(f"- D={D}, {cv.OPT_LABELS[o]} (this clock's own step/(F+B): {own or '–'}): " +
                         (". ".join(said) if said else "no asynchronous method reaches T1 on every seed") + ".")
    return lines


# --------------------------------------------------------------------------------------------------
# The goal at every clock (markdown)
# --------------------------------------------------------------------------------------------------


def goal_table(s, study: dict, clocks: list[tc.Clock]) -> tuple[list[str], list[list[str]], list[str]]:
    """One row per asynchronous method: its quality against 1F1B M=2D and sync at equal updates and its
    speed-up to T1 against each baseline on every clock; plus one verdict line per (D, optimizer): the goal
    (not worse than 1F1B M=2D beyond the spread, >= GOAL_SPEEDUP x sooner) against 1F1B and ZB-H1."""
    header = ["D", "optimizer", "method", "final val loss vs 1F1B M=2D", "vs sync, 1 update/micro-batch"]
    for c in clocks:
        header += [f"{c.key.upper()}: speed-up vs {label}" for _, label in BASELINES]
    table, lines = [], []
    for D in s.depths:
        for o in s.optimizers:
            per_clock = [{r["name"]: r for r in timed_rows(s, study, D, o, c)} for c in clocks]
            ref = study["runs"].get(Unit(o, "sync", 0, 2 * D))
            strict = study["runs"].get(Unit(o, "sync", 0, 1))
            if not ref:
                lines.append(f"- D={D}, {cv.OPT_LABELS[o]}: no 1F1B M=2D run: cannot judge.")
                continue
            rv = val_ms(s, ref)
            verdicts = [{b: [] for b, _ in BASELINES[:2]} for _ in clocks]
            best = [{b: None for b, _ in BASELINES[:2]} for _ in clocks]
            for unit in (u for u in tr.async_units(o, D) if u in study["runs"]):
                m, runs = unit.name, study["runs"][unit]
                v = val_ms(s, runs)
                n = min(len(runs), len(ref))
                quality = cv.compare(v, rv, n)
                cells = [str(D), cv.OPT_LABELS[o], LABELS[m] + ("" if unit.opt == o else f" ({unit.opt}, not counted)"),
                         f"{v[0]:.3f} vs {rv[0]:.3f}: {quality}",
                         f"{cv.compare(v, val_ms(s, strict), min(n, len(strict)))}" if strict else "–"]
                for i, c in enumerate(clocks):
                    row = per_clock[i].get(m)
                    sp = row["speedup"] if row else {}
                    cells += [tc.fmt_speedup(sp.get(b)) if row else "not priced" for b, _ in BASELINES]
                    for b, _ in BASELINES[:2]:
                        x = sp.get(b)
                        if unit.opt == o and x is not None and (best[i][b] is None or x > best[i][b][1]):
                            best[i][b] = (m, x)
                        if unit.opt == o and quality != "worse (real)" and x is not None and x >= GOAL_SPEEDUP:
                            verdicts[i][b].append(f"{LABELS[m]} {tc.fmt_speedup(x)}")
                table.append(cells)
            parts = []  # the verdict line of (D, o): per clock, per baseline
            for i, c in enumerate(clocks):
                said = []
                for b, label in BASELINES[:2]:
                    ok = verdicts[i][b]
                    top = best[i][b]
                    said.append(f"vs {label} **{'MET' if ok else 'NOT MET'}**" +
                                (f" ({', '.join(ok)})" if ok else
                                 f" (fastest to T1: {LABELS[top[0]]} {tc.fmt_speedup(top[1])})" if top else
                                 " (no asynchronous run reaches T1 on every seed)"))
                parts.append(f"{c.key.upper()} clock: " + "; ".join(said))
            lines.append(f"- **D={D}, {cv.OPT_LABELS[o]}**: " + ". ".join(parts) + ".")
    return header, table, lines


def variants_table(s, study: dict, clock: tc.Clock) -> tuple[list[str], list[list[str]]] | None:
    """Speed-up to T1 vs 1F1B M=2D / ZB-H1 M=2D of every asynchronous method under the cost model and each
    of its variants (the same curves; only the variant's step or policy costs change)."""
    from ttq_cost_model import with_variant
    cm = clock.cost_model
    if not cm or not cm.get("variants"):
        return None
    names = ["default", *cm["variants"]]
    clocks = [clock] + [tc.model_clock(with_variant(cm, n), study) for n in cm["variants"]]
    header = ["D", "optimizer", "method"] + [f"{n}: vs 1F1B / vs ZB-H1" for n in names]
    table = []
    for D in s.depths:
        for o in s.optimizers:
            per = [{r["name"]: r for r in timed_rows(s, study, D, o, c)} for c in clocks]
            for m in ASYNC:
                if m not in per[0] or per[0][m]["speedup"]["1f1b"] is None:
                    continue  # (a method some seed of which never reaches T1 has no speed-up on any clock)
                table.append([str(D), cv.OPT_LABELS[o], LABELS[m]] + [
                    " / ".join(tc.fmt_speedup(p[m]["speedup"].get(b)) for b in ("1f1b", "zb-h1")) if m in p else "–"
                    for p in per])
    return header, table


def variant_step_ratios(cm: dict) -> str:
    """The step/(forward+backward) of each of the cost model's variants that changes a step (uniform
    ratios; "per stage" otherwise)."""
    b = cm["ratios"]["backward"]
    out = []
    for name, v in cm.get("variants", {}).items():
        for o, x in v.get("step", {}).items():
            uniform = isinstance(x, (int, float)) and isinstance(b, (int, float))
            out.append(f"{name} ({o}) {x / (1 + b):.3f}" if uniform else f"{name} ({o}) per stage")
    return ", ".join(out)
