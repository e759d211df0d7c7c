"""Cost models of the time-to-quality clock (bench/time_to_quality/time_to_quality.py `--cost-model PATH`): per-op costs of
one pipeline stage measured on real hardware, as ratios to the stage's forward, in a small JSON.

The study's curves (validation loss against micro-batches) do not depend on the clock; only the seconds
each micro-batch costs do. The CPU clock prices every op from the tiny model on one CPU thread (the
calibration's `op_times`); a cost model prices them at a stated model size, device and data-parallel
degree instead, so the same curves give the verdict at the costs of the hardware users run.

Schema (`"schema": "ttq-cost-model/1"`; every ratio is a number, the same on every stage, or a list of one
value per stage of `pipeline_stages`):
- `name`, `device`, `model`: what was measured (free text; printed in the report);
- `pipeline_stages` (D the stage was measured at), `data_parallel` (its DP degree), `tokens_per_microbatch`;
- `forward_ms`: the forward of one micro-batch on one stage, in milliseconds (the unit of the ratios; at
  another D the same model holds pipeline_stages / D times the layers per stage, so absolute times scale by
  that factor and the ratios stay);
- `ratios`: to the forward of the same stage:
  - `backward` (input + weight gradients), `backward_input` and `backward_weight` (ZB's split; the two
    must add up to `backward`);
  - `step`: {optimizer: the optimizer step of the stage, once per update};
  - `policy`: {asynchronous method: {op kind ("Forward" / "Backward" / "Step"): its weight policy's extra
    work per op (PipeOptim's prediction, PipeDream's version swap, ...), "stages": "stale" (every stage but
    the last: at k = 1 the last stage's weights are never stale) or "all"}}; async-naive has none, and a
    method without an entry is not priced by the model (its rows are left out of that clock);
- `variants` (optional): {name: {"note": why, "step": {...}, "policy": {...}}}: entries that replace the
  default's (`--cost-model PATH --cost-model-variant NAME`, and the report's variants table);
- `source`: how every figure was obtained (measurements, derivations, assumptions), one note per item.

`cost_model_from_measurements(...)` builds the dict from milliseconds (what bench/gpu/gpu.py measures);
`load_cost_model(path)` checks it (one clear error line); `op_times(cm, D, optimizer, methods)` gives the
clock's per-op costs in the calibration's format. `h200_1p3b()` is the shipped seed
(bench/results/time_to_quality/cost_model_h200_1p3b.json, `python bench/time_to_quality/ttq_cost_model.py --write-seed`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
REPO = os.path.dirname(BENCH)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from megatron_po.errors import ConfigError  # noqa: E402
from megatron_po.pipeline import cost_model as _cm  # noqa: E402

SCHEMA = _cm.SCHEMA
SEED_PATH = os.path.join(REPO, "bench", "results", "time_to_quality", "cost_model_h200_1p3b.json")
# The measured H200 model (bench/gpu/gpu.py's stream, docs/gpu.md): the default clock of the studies (issue 37).
MEASURED_PATH = os.path.join(REPO, "bench", "results", "gpu_nvidia_h200_a_cost_model.json")
DERIVED_SEQ8192_PATH = os.path.join(REPO, "bench", "results", "time_to_quality", "cost_model_h200_1p3b_seq8192_derived.json")
KINDS = _cm.KINDS


def _fail(where: str, what: str):
    raise SystemExit(f"error: cost model {where}: {what}")


# --------------------------------------------------------------------------------------------------
# Build (from measured milliseconds) and check
# --------------------------------------------------------------------------------------------------


def _ratio(ms, forward: list[float]):
    """ms / forward per stage; a number when the measurement is one number and the forward uniform."""
    values = [m / f for m, f in zip(_cm.per_stage(ms, len(forward)), forward)]
    return round(values[0], 6) if len(set(values)) == 1 and isinstance(ms, (int, float)) else [round(v, 6) for v in values]


def cost_model_from_measurements(*, name: str, device: str, model: str, pipeline_stages: int, data_parallel: int,
                                 tokens_per_microbatch: int, forward_ms, backward_ms, step_ms: dict,
                                 backward_input_ms=None, backward_weight_ms=None, policy_ms: dict | None = None,
                                 variants_ms: dict | None = None, source: list[str] = ()) -> dict:
    """A cost model from per-stage milliseconds (a number: every stage the same; a list: one per stage).

    forward_ms / backward_ms: one micro-batch's forward / whole backward on the stage; backward_input_ms +
    backward_weight_ms: ZB's split backward (default: half of backward_ms each, stated in `source`);
    step_ms: {optimizer: ms of its step on the stage}; policy_ms: {method: {"Forward"/"Backward"/"Step":
    ms of the policy's extra work per op, "stages": "stale" | "all"}}; variants_ms: {name: {"note": str,
    "step_ms": {...}, "policy_ms": {...}}}. Returns the checked dict (ratios to the forward)."""
    D = pipeline_stages
    fwd = _cm.per_stage(forward_ms, D)
    source = list(source)
    if backward_input_ms is None and backward_weight_ms is None:
        half = backward_ms / 2 if isinstance(backward_ms, (int, float)) else [b / 2 for b in backward_ms]
        backward_input_ms = backward_weight_ms = half
        source.append("ZB's split backward not measured: input and weight gradients half of the backward each.")

    def policy(entries: dict) -> dict:
        return {m: {**{k: _ratio(v, fwd) for k, v in e.items() if k in KINDS}, "stages": e.get("stages", "stale")}
                for m, e in entries.items()}

    cm = {"schema": SCHEMA, "name": name, "device": device, "model": model, "pipeline_stages": D,
          "data_parallel": data_parallel, "tokens_per_microbatch": tokens_per_microbatch,
          "forward_ms": round(fwd[0], 6) if isinstance(forward_ms, (int, float)) else [round(f, 6) for f in fwd],
          "ratios": {"backward": _ratio(backward_ms, fwd), "backward_input": _ratio(backward_input_ms, fwd),
                     "backward_weight": _ratio(backward_weight_ms, fwd),
                     "step": {o: _ratio(v, fwd) for o, v in step_ms.items()},
                     "policy": policy(policy_ms or {})},
          "variants": {n: {"note": v.get("note", ""),
                           **({"step": {o: _ratio(x, fwd) for o, x in v["step_ms"].items()}} if "step_ms" in v else {}),
                           **({"policy": policy(v["policy_ms"])} if "policy_ms" in v else {})}
                       for n, v in (variants_ms or {}).items()},
          "source": source}
    check_cost_model(cm, f"{name!r}")
    return cm


def _one_line(check):
    """megatron_po/pipeline/cost_model.py's `check` (shared with tools/simulate_schedule.py) with its ConfigError as
    one error line (SystemExit), as the bench commands report bad input."""
    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
    return checked


# check_cost_model(cm, where) -> cm; load_cost_model(path, variant=None) -> the checked model, the variant's entries in
# place of the default's; with_variant(cm, variant, where) -> a copy with the variant's step and policy entries.
check_cost_model, load_cost_model, with_variant = map(_one_line, (_cm.check_cost_model, _cm.load_cost_model,
                                                                  _cm.with_variant))


# --------------------------------------------------------------------------------------------------
# The clock's op costs
# --------------------------------------------------------------------------------------------------


def op_times(cm: dict, D: int, optimizer: str, methods) -> dict:
    """{method: {"rank": {"Forward", "Backward", "BackwardInput", "BackwardWeight", "Step": seconds}}} at
    D stages for `optimizer`'s step, in the calibration's format; methods the model has no policy entry
    for (other than async-naive) are left out, and so is everything when it has no step for `optimizer`."""
    n = cm["pipeline_stages"]
    r = cm["ratios"]
    if optimizer not in r["step"]:
        return {}
    if D != n and any(isinstance(v, list) for v in (cm["forward_ms"], r["backward"], r["backward_input"],
                                                   r["backward_weight"], r["step"][optimizer])):
        _fail(cm["name"], f"gives per-stage values for {n} stages; the report is at D={D} (use one number per "
                          "ratio to price another D)")
    scale = n / D / 1000.0  # the same model over D stages, in seconds

    def stage(value, i):  # (uniform when D != n, checked above)
        return (value[i] if isinstance(value, list) else value)

    base = {}
    for i in range(D):
        f = stage(cm["forward_ms"], i) * scale
        base[str(i)] = {"Forward": f, "Backward": stage(r["backward"], i) * f,
                        "BackwardInput": stage(r["backward_input"], i) * f,
                        "BackwardWeight": stage(r["backward_weight"], i) * f,
                        "Step": stage(r["step"][optimizer], i) * f}
    out = {"async-naive": base}
    for m in methods:
        e = r.get("policy", {}).get(m)
        if m == "async-naive" or e is None:
            continue
        if any(isinstance(e.get(k), list) for k in KINDS) and D != n:
            _fail(cm["name"], f"policy {m} gives per-stage values for {n} stages; the report is at D={D}")
        stale = e.get("stages", "stale") == "stale"
        out[m] = {str(i): {k: v + (stage(e.get(k, 0.0), i) * base[str(i)]["Forward"]
                                   if k in e and (not stale or i < D - 1) else 0.0)
                           for k, v in base[str(i)].items()} for i in range(D)}
    return out


def describe(cm: dict) -> str:
    """One line: what the model prices, for report headers."""
    r = cm["ratios"]

    def num(v):
        return f"{v:.3g}" if isinstance(v, (int, float)) else "per stage"
    steps = ", ".join(f"{o} {num(v)}" for o, v in r["step"].items())
    return (f"{cm['name']}: {cm['device']}; {cm['model']}; D = {cm['pipeline_stages']}, DP = {cm['data_parallel']}; "
            f"forward {num(cm['forward_ms'])} ms per stage and micro-batch; backward {num(r['backward'])} x forward "
            f"(ZB: input {num(r['backward_input'])}, weight {num(r['backward_weight'])}); step {steps} x forward")


# --------------------------------------------------------------------------------------------------
# The shipped seed: one NVIDIA H200, GPT 1.3B (issue 31, ../shared/docs/GPU_FINDINGS.md)
# --------------------------------------------------------------------------------------------------

# Measured on one NVIDIA H200 (torch 2.11.0+cu130, bf16), GPT 1.3B (24 layers, hidden 2048, 16 heads,
# seq 2048, micro-batch 4), D = 4 stages of 6 layers in the single-process asynchronous emulator.
EMULATOR_MS = {"adamw": {"async-naive": 169.1, "pipeoptim": 176.4, "pipedream": 175.7},
               "muon": {"async-naive": 1388.0, "pipeoptim": 1396.0}}
ADAMW_STEP_MS = 2.45          # fused AdamW step of one 302 M-parameter stage
PREDICTION_FOREACH_MS = 4.60  # a separate foreach prediction with fp32 temporaries, same stage
PREDICTION_FUSED_MS = 0.15    # issue 30's bound for the prediction fused into the step: the write of Ŵ
NS_LAYER_MS = {"fp32": 50.3, "tf32": 10.1, "bf16": 5.4}  # Newton-Schulz, 5 steps, one layer's 4 matrices


def _cpu_hook_ratios(results_json: str) -> dict:
    """From the committed CPU calibration (D = 4, AdamW and Muon; NAG for PipeNAG): each method's weight-policy
    hook time per op kind (averaged over its stages), as a multiple of PipeDream's hook time per stale
    stage (all op kinds). All of them are passes over the stage's weights (copies, swaps, the EF residual),
    so they are priced on the GPU as that multiple of PipeDream's measured cost."""
    with open(results_json) as f:
        ops = json.load(f)["op_times"]

    def hooks(block, m, stages):
        naive, own = ops[block]["async-naive"], ops[block][m]
        return {k: sum(own[str(r)][k] - naive[str(r)][k] for r in stages) / len(stages) for k in KINDS}
    D = 4
    blocks = ["D=4,adamw", "D=4,muon"]
    pd = sum(sum(hooks(b, "pipedream", range(D - 1)).values()) for b in blocks) / len(blocks)
    out = {}
    for m, bl in (("pipedream-2bw", blocks), ("2bw-ef", blocks), ("pipenag", ["D=4,nag"])):
        per = [hooks(b, m, range(D)) for b in bl]
        out[m] = {k: max(0.0, sum(p[k] for p in per) / len(per)) / pd for k in KINDS}
    return out


def h200_1p3b(results_json: str | None = None) -> dict:
    """The seed cost model from the issue's H200 figures; every derivation is written into `source`."""
    D = 4
    naive_adamw = EMULATOR_MS["adamw"]["async-naive"] / D        # forward + backward + AdamW step per stage
    fb = naive_adamw - ADAMW_STEP_MS                               # 39.8 ms
    fwd, bwd = fb / 3, 2 * fb / 3                                  # backward = 2 x forward
    ns_rest = EMULATOR_MS["muon"]["async-naive"] / D - fb - 6 * NS_LAYER_MS["fp32"]  # Muon's step besides NS
    muon = {p: 6 * t + ns_rest for p, t in NS_LAYER_MS.items()}
    nag = ADAMW_STEP_MS * 5 / 7
    pd_hook = (EMULATOR_MS["adamw"]["pipedream"] - EMULATOR_MS["adamw"]["async-naive"]) / (D - 1)
    po_emulator = (EMULATOR_MS["adamw"]["pipeoptim"] - EMULATOR_MS["adamw"]["async-naive"]) / (D - 1)
    po_emulator_muon = (EMULATOR_MS["muon"]["pipeoptim"] - EMULATOR_MS["muon"]["async-naive"]) / (D - 1)
    cpu = _cpu_hook_ratios(results_json or os.path.join(os.path.dirname(SEED_PATH), "time_to_quality.json"))
    policy = {"pipeoptim": {"Forward": PREDICTION_FOREACH_MS, "stages": "stale"},
              "pipedream": {"Backward": pd_hook, "stages": "stale"},
              **{m: {**{k: round(c[k] * pd_hook, 6) for k in KINDS if c[k] > 0}, "stages": "all"} for m, c in cpu.items()}}
    f = lambda x: f"{x:.2f}"  # noqa: E731
    source = [
        "Device and model: one NVIDIA H200, torch 2.11.0+cu130, bf16; GPT 1.3B (24 layers, hidden 2048, 16 heads, "
        "seq 2048, vocab 50304, micro-batch 4 = 8,192 tokens); D = 4 stages of 6 layers (302 M parameters) in the "
        "single-process asynchronous emulator, one GPU, DP = 1 (../shared/docs/GPU_FINDINGS.md; issues 30, 31).",
        f"forward + backward per stage = async-naive AdamW emulator {EMULATOR_MS['adamw']['async-naive']} ms per "
        f"micro-batch / 4 stages - the fused AdamW step {ADAMW_STEP_MS} ms = {f(fb)} ms (the issues' '~42 ms' is "
        f"{f(naive_adamw)} ms with the step included). One average stage: the embedding and output layer are "
        "spread over the four, not priced per stage.",
        f"backward = 2 x forward (no figure splits them; the usual FLOP ratio): forward {f(fwd)} ms, backward "
        f"{f(bwd)} ms; ZB's split backward: input = weight = forward = {f(fwd)} ms each (same assumption).",
        f"AdamW step: {ADAMW_STEP_MS} ms (fused AdamW over one 302 M-parameter stage, measured) = "
        f"{ADAMW_STEP_MS / fb:.3f} x forward+backward.",
        f"Muon step = 6 layers x Newton-Schulz (5 steps, one layer's 4 matrices: fp32 {NS_LAYER_MS['fp32']}, TF32 "
        f"{NS_LAYER_MS['tf32']}, bf16 {NS_LAYER_MS['bf16']} ms) + the rest of the step (momentum, scaling, AdamW "
        f"for embeddings/norms/biases) = Muon async-naive emulator {EMULATOR_MS['muon']['async-naive']:.0f} ms / 4 - "
        f"forward+backward {f(fb)} - 6 x {NS_LAYER_MS['fp32']} (the emulator ran fp32 NS) = {f(ns_rest)} ms. "
        f"Default bf16 NS (the default after issue 31): {f(muon['bf16'])} ms = {muon['bf16'] / fb:.3f} x "
        f"forward+backward; variants muon-tf32-ns {f(muon['tf32'])} ms ({muon['tf32'] / fb:.2f} x), muon-fp32-ns "
        f"(the code before issue 31) {f(muon['fp32'])} ms ({muon['fp32'] / fb:.2f} x). DP = 1: with whole matrices "
        "owned across DP ranks (issue 31) the NS part divides by the DP degree (plus a gather, not measured).",
        f"NAG step (PipeNAG only): not measured; AdamW's {ADAMW_STEP_MS} ms x 5/7 = {f(nag)} ms (it reads and "
        "writes 5 fp32 tensors per parameter where AdamW does 7, both bandwidth-bound).",
        f"PipeOptim's prediction: {PREDICTION_FOREACH_MS} ms per forward (a separate foreach prediction with fp32 "
        "temporaries on one stage, measured), on every stage but the last (its weights are never stale at k = 1; "
        f"0.01 ms on the CPU). In the emulator PipeOptim costs {EMULATOR_MS['adamw']['pipeoptim'] - EMULATOR_MS['adamw']['async-naive']:.1f} "
        f"ms (Muon {EMULATOR_MS['muon']['pipeoptim'] - EMULATOR_MS['muon']['async-naive']:.0f} ms) per micro-batch over "
        f"async-naive = {f(po_emulator)} ({f(po_emulator_muon)}) ms per predicting stage: variant emulator-prediction. "
        f"Variant fused-prediction: {PREDICTION_FUSED_MS} ms, issue 30's bound for the prediction fused into the step "
        "(only the bf16 write of W-hat; not measured).",
        f"PipeDream: emulator {EMULATOR_MS['adamw']['pipedream']} - {EMULATOR_MS['adamw']['async-naive']} ms per "
        f"micro-batch over the 3 stages that stash = {f(pd_hook)} ms per backward (the version swap).",
        "PipeDream-2BW, 2BW + error feedback, PipeNAG: no GPU figure. Their weight-policy hooks (version copies, "
        "the error-feedback residual, the look-ahead swap) are passes over the stage's weights like PipeDream's: "
        "priced at their CPU hook time per op kind (bench/results/time_to_quality/time_to_quality.json, D = 4, "
        "averaged over all stages) as a multiple of PipeDream's CPU hook time per stale stage, times PipeDream's "
        f"GPU {f(pd_hook)} ms: " + "; ".join(
            f"{m} " + ", ".join(f"{k} {c[k]:.2f}x" for k in KINDS) for m, c in cpu.items()) + ".",
    ]
    return cost_model_from_measurements(
        name="h200_1p3b", device="one NVIDIA H200 (torch 2.11.0+cu130, bf16)",
        model="GPT 1.3B (24 layers, hidden 2048, seq 2048, micro-batch 4), one stage = 6 layers",
        pipeline_stages=D, data_parallel=1, tokens_per_microbatch=4 * 2048, forward_ms=fwd, backward_ms=bwd,
        backward_input_ms=fwd, backward_weight_ms=fwd, step_ms={"adamw": ADAMW_STEP_MS, "muon": muon["bf16"], "nag": nag},
        policy_ms=policy,
        variants_ms={
            "fused-prediction": {"note": "PipeOptim's prediction fused into the step (issue 30's bound, not measured)",
                                 "policy_ms": {"pipeoptim": {"Forward": PREDICTION_FUSED_MS, "stages": "stale"}}},
            "emulator-prediction": {"note": "PipeOptim's prediction at its cost inside the emulator run",
                                    "policy_ms": {"pipeoptim": {"Forward": po_emulator, "stages": "stale"}}},
            "muon-tf32-ns": {"note": "Muon's Newton-Schulz in TF32", "step_ms": {"muon": muon["tf32"]}},
            "muon-fp32-ns": {"note": "Muon's Newton-Schulz in fp32 (the code before issue 31)",
                             "step_ms": {"muon": muon["fp32"]}}},
        source=source)


# --------------------------------------------------------------------------------------------------
# Derived: the same 1.3B GPT with a micro-batch of one 8,192-token sequence (issue 36), from the measured model
# --------------------------------------------------------------------------------------------------

HIDDEN, SEQ_MEASURED, SEQ_LONG = 2048, 2048, 8192


def h200_1p3b_seq8192_derived(measured_path: str = MEASURED_PATH) -> dict:
    """The measured H200 model (micro-batch 4 x 2,048 tokens) re-derived for a micro-batch of 1 x 8,192 tokens of
    the same model: the same tokens per micro-batch, so every per-token cost (the dense matmuls, norms,
    element-wise work) and every per-parameter cost (the optimizer steps, PipeOptim's restore and prediction)
    stays in milliseconds; only causal attention's score and value products grow, from 2*s*h to 2*s'*h FLOPs
    per token and layer (flash attention skips the masked half of 4*s*h). Each step is written into
    `derivation`; nothing here was measured at 8,192 tokens."""
    m = load_cost_model(measured_path)
    h, s0, s1 = HIDDEN, SEQ_MEASURED, SEQ_LONG
    dense = 24 * h * h                      # forward matmul FLOPs per token and layer: QKV 6h^2, proj 2h^2, MLP 16h^2
    attn0, attn1 = 2 * s0 * h, 2 * s1 * h   # causal QK^T and AV forward FLOPs per token and layer
    f0 = m["forward_ms"]
    r = m["ratios"]
    b0 = r["backward"] * f0
    fwd_factor = (dense + attn1) / (dense + attn0)
    f1 = f0 * fwd_factor
    # Backward: dense 2x its forward (input + weight gradients, half each); flash attention's backward 2.5x its
    # forward (5 products against 2), all of it input gradient (attention's core has no weights).
    dense_share = 2 * dense / (2 * dense + 2.5 * attn0)  # of the measured backward
    b_dense = b0 * dense_share
    b_attn1 = (b0 - b_dense) * s1 / s0
    b1 = b_dense + b_attn1
    w1 = b_dense / 2
    bi1 = b1 - w1
    p2p, p2p_text = _cm.p2p_derivation(s1, h)  # one bf16 activation (or gradient) of a micro-batch
    step_ms = {o: v * f0 for o, v in r["step"].items()}
    policy = {meth: {**{k: e[k] * f0 for k in KINDS if k in e}, "stages": e.get("stages", "stale")}
              for meth, e in r.get("policy", {}).items()}
    fmt = lambda x: f"{x:.3f}"  # noqa: E731
    derivation = [
        f"Base: {os.path.relpath(measured_path, REPO)} ({m['name']}, MEASURED: {m['device']}; {m['model']}; "
        f"D = {m['pipeline_stages']}): forward {fmt(f0)} ms per stage and micro-batch of {m['tokens_per_microbatch']} "
        f"tokens, backward {fmt(b0)} ms, steps " + ", ".join(f"{o} {fmt(v)} ms" for o, v in step_ms.items()) + ".",
        f"This model: the same GPT, micro-batch 1 x {s1} tokens (the same {s1} tokens per micro-batch). Per token and "
        f"layer the forward does {dense / 1e6:.1f} MFLOP of dense matmuls (24h^2, h = {h}) and 2sh of causal "
        f"attention (QK^T and AV, 4sh halved by the mask): {attn0 / 1e6:.1f} MFLOP at s = {s0}, {attn1 / 1e6:.1f} at "
        f"s = {s1}. Forward x {fwd_factor:.4f} = {fmt(f1)} ms (attention taken to run at the dense matmuls' "
        "efficiency; the norms, embedding and output layer are per token and unchanged).",
        f"Backward: its dense part 2 x the dense forward, attention's 2.5 x (flash attention's backward: 5 products "
        f"against 2): dense share of the measured backward {dense_share:.4f} = {fmt(b_dense)} ms, kept; attention's "
        f"{fmt(b0 - b_dense)} ms x {s1}/{s0} = {fmt(b_attn1)} ms; backward {fmt(b1)} ms = {b1 / f1:.4f} x forward.",
        f"Zero bubble's split (not measured at either length): weight gradients = half of the dense backward = "
        f"{fmt(w1)} ms; input gradients the rest, attention's backward included = {fmt(bi1)} ms.",
        "Optimizer steps and PipeOptim's restore and prediction: per parameter, the same milliseconds as measured "
        "(the same parameters per stage); as ratios to the longer forward they shrink by " + fmt(1 / fwd_factor) + ". "
        "The steps are the EAGER steps measured (the compiled step was not measured on the H200: docs/gpu.md).",
        p2p_text + " (the measured model prices the same message the same way).",
    ]
    cm = cost_model_from_measurements(
        name="h200_1p3b_seq8192_derived", device=m["device"] + "; DERIVED, not measured at this shape",
        model="GPT 1.3B (24 layers, hidden 2048, 16 heads, vocab 50304), micro-batch 1 x 8192 tokens; one stage = "
              f"{24 // m['pipeline_stages']} layers at D = {m['pipeline_stages']}",
        pipeline_stages=m["pipeline_stages"], data_parallel=m["data_parallel"], tokens_per_microbatch=s1,
        forward_ms=f1, backward_ms=b1, backward_input_ms=bi1, backward_weight_ms=w1, step_ms=step_ms,
        policy_ms=policy, source=[f"derived from {os.path.relpath(measured_path, REPO)}: see derivation"])
    cm["source"] = [x for x in cm["source"] if not x.startswith("ZB's split backward not measured")]
    cm.update(provenance="derived", p2p_ms=round(p2p, 6), derivation=derivation)
    cm["dims"] = {"hidden_size": h, "seq_length": s1, "micro_batch_size": 1}
    return check_cost_model(cm, "derived seq8192")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write or check a time-to-quality cost model.")
    p.add_argument("--write-seed", nargs="?", const=SEED_PATH, metavar="PATH",
                   help=f"write the H200 seed (default {os.path.relpath(SEED_PATH, REPO)})")
    p.add_argument("--write-derived", nargs="?", const=DERIVED_SEQ8192_PATH, metavar="PATH",
                   help="write the derived 8,192-token model (default "
                        f"{os.path.relpath(DERIVED_SEQ8192_PATH, REPO)})")
    p.add_argument("--check", metavar="PATH", help="load a cost model and print what it prices")
    a = p.parse_args(argv)
    if a.write_seed:
        with open(a.write_seed, "w") as f:
            json.dump(h200_1p3b(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"> wrote {os.path.relpath(a.write_seed)}")
    if a.write_derived:
        with open(a.write_derived, "w") as f:
            json.dump(h200_1p3b_seq8192_derived(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"> wrote {os.path.relpath(a.write_derived)}")
    if a.check:
        print(describe(load_cost_model(a.check)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
