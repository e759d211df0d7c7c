"""Per-op cost models and the clock they give every pipeline schedule: seconds per iteration from the op list.

A cost model (JSON, schema "ttq-cost-model/1"; bench/time_to_quality/ttq_cost_model.py builds them from measurements or
derives them) prices one pipeline stage of a stated model on stated hardware, as ratios to the stage's
forward of one micro-batch:
- `forward_ms` (at `pipeline_stages` stages; the same model at D stages holds pipeline_stages / D times
  the layers per stage, so absolute times scale by that factor and the ratios stay);
- `ratios.backward` = `backward_input` + `backward_weight` (zero bubble's split backward);
- `ratios.step`: {optimizer: its step on the stage, once per update};
- `ratios.policy`: {asynchronous method: its weight policy's extra work per op kind ("Forward",
  "Backward", "Step": PipeOptim's restore and prediction, PipeDream's version swap, ...), on the
  "stale" stages (all but the last) or "all"}; async-naive has none;
- optional `p2p_ms` (one activation or gradient message between neighbouring stages on two ranks; absent:
  free; the H200 models price it with `p2p_message_ms`, derivation below) and `provenance` ("measured" or
  "derived": how the figures were obtained, printed with every clock);
- `variants`: named replacements of step / policy entries; `source`: one note per figure.

`stage_costs(cm, D, optimizer, method)` gives one method's per-op durations at D stages;
`sync_iteration` simulates a synchronous schedule's op list (one flush, its Step(None) on every rank
priced at that rank's step); `async_per_microbatch` takes the steady state of the no-flush stream from
its own op list (Step(c) after every k backwards, so the step costs 1/k per micro-batch), never from a
formula. tools/simulate_schedule.py `--cost-model` prints them; bench/time_to_quality/ttq_clock.py prices the study with them.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

from megatron_po.errors import ConfigError
from megatron_po.pipeline.schedule_ops import rank_chunk_of
from megatron_po.pipeline.schedules import build_schedule, staleness
from megatron_po.pipeline.simulator import Timeline, simulate

SCHEMA = "ttq-cost-model/1"
KINDS = ("Forward", "Backward", "Step")
STAGE_SETS = ("stale", "all")
PROVENANCES = ("measured", "derived")
REQUIRED_KEYS = {"schema", "name", "device", "model", "pipeline_stages", "data_parallel", "tokens_per_microbatch",
                 "forward_ms", "ratios", "source"}
TOP_KEYS = REQUIRED_KEYS | {"variants", "p2p_ms", "provenance", "derivation", "dims"}
DIMS = ("hidden_size", "seq_length", "micro_batch_size")  # a model's shape, where it states it: `at_sequence_length`
RATIO_KEYS = {"backward", "backward_input", "backward_weight", "step", "policy"}


def _fail(where: str, what: str):
    raise ConfigError(f"cost model {where}: {what}")


# --------------------------------------------------------------------------------------------------
# Check and load (one clear error line: ConfigError "cost model <where>: <what>")
# --------------------------------------------------------------------------------------------------


def per_stage(value, D: int) -> list[float]:
    """A ratio or measurement as one value per stage (a number: the same on every stage)."""
    return [float(value)] * D if isinstance(value, (int, float)) else [float(v) for v in value]


def _check_ratio(value, what: str, D: int, where: str, positive: bool = False) -> list[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        _fail(where, f"{what} must be a number or a list of {D} numbers, got {value!r}")
    if isinstance(value, list) and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        _fail(where, f"{what} must hold numbers, got {value!r}")
    values = per_stage(value, D)
    if len(values) != D:
        _fail(where, f"{what} has {len(values)} values; pipeline_stages is {D} (one per stage, or one number)")
    if any(not math.isfinite(v) or v < 0 or (positive and v == 0) for v in values):
        _fail(where, f"{what} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    return values


def _check_policy(policy, where: str, what: str, D: int) -> None:
    if not isinstance(policy, dict):
        _fail(where, f"{what} must be an object {{method: {{op kind: ratio, 'stages': ...}}}}")
    for m, e in policy.items():
        if not isinstance(e, dict):
            _fail(where, f"{what}.{m} must be an object")
        bad = set(e) - set(KINDS) - {"stages"}
        if bad:
            _fail(where, f"{what}.{m} has unknown keys {sorted(bad)}; allowed: {', '.join(KINDS)}, stages")
        if e.get("stages", "stale") not in STAGE_SETS:
            _fail(where, f"{what}.{m}.stages must be one of {', '.join(STAGE_SETS)}, got {e['stages']!r}")
        for k in KINDS:
            if k in e:
                _check_ratio(e[k], f"{what}.{m}.{k}", D, where)


def check_cost_model(cm, where: str = "") -> dict:
    """Raise ConfigError naming the first thing wrong (one line); return cm."""
    if not isinstance(cm, dict):
        _fail(where, "must be a JSON object")
    if cm.get("schema") != SCHEMA:
        _fail(where, f"schema must be {SCHEMA!r}, got {cm.get('schema')!r}")
    missing = sorted(REQUIRED_KEYS - set(cm))
    if missing:
        _fail(where, f"missing {', '.join(missing)}")
    unknown = sorted(set(cm) - TOP_KEYS)
    if unknown:
        _fail(where, f"unknown keys {unknown}")
    D = cm["pipeline_stages"]
    for key in ("pipeline_stages", "data_parallel", "tokens_per_microbatch"):
        if isinstance(cm[key], bool) or not isinstance(cm[key], int) or cm[key] < 1:
            _fail(where, f"{key} must be an integer >= 1, got {cm[key]!r}")
    _check_ratio(cm["forward_ms"], "forward_ms", D, where, positive=True)
    if "p2p_ms" in cm:
        _check_ratio(cm["p2p_ms"], "p2p_ms", 1, where)
    if cm.get("provenance", "measured") not in PROVENANCES:
        _fail(where, f"provenance must be one of {', '.join(PROVENANCES)}, got {cm['provenance']!r}")
    if "dims" in cm and (not isinstance(cm["dims"], dict) or set(cm["dims"]) != set(DIMS)
                         or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                    for v in cm["dims"].values())):
        _fail(where, f"dims must be an object of the integers >= 1 {', '.join(DIMS)}, got {cm['dims']!r}")
    if "derivation" in cm and (not isinstance(cm["derivation"], list)
                               or not all(isinstance(x, str) for x in cm["derivation"])):
        _fail(where, "derivation must be a list of strings")
    r = cm["ratios"]
    if not isinstance(r, dict):
        _fail(where, "ratios must be an object")
    missing = sorted(RATIO_KEYS - {"policy"} - set(r))
    if missing:
        _fail(where, f"ratios: missing {', '.join(missing)}")
    if set(r) - RATIO_KEYS:
        _fail(where, f"ratios: unknown keys {sorted(set(r) - RATIO_KEYS)}")
    b = _check_ratio(r["backward"], "ratios.backward", D, where, positive=True)
    bi = _check_ratio(r["backward_input"], "ratios.backward_input", D, where)
    bw = _check_ratio(r["backward_weight"], "ratios.backward_weight", D, where)
    if any(abs(x + y - z) > 1e-4 * z for x, y, z in zip(bi, bw, b)):
        _fail(where, f"ratios.backward_input + backward_weight must equal ratios.backward, got {bi} + {bw} vs {b}")
    if not isinstance(r["step"], dict) or not r["step"]:
        _fail(where, "ratios.step must be a non-empty object {optimizer: ratio}")
    for o, v in r["step"].items():
        _check_ratio(v, f"ratios.step.{o}", D, where)
    _check_policy(r.get("policy", {}), where, "ratios.policy", D)
    variants = cm.get("variants", {})
    if not isinstance(variants, dict):
        _fail(where, "variants must be an object {name: {note, step, policy}}")
    for n, v in variants.items():
        if not isinstance(v, dict) or set(v) - {"note", "step", "policy"}:
            _fail(where, f"variants.{n} may hold only note, step and policy")
        for o, x in v.get("step", {}).items():
            _check_ratio(x, f"variants.{n}.step.{o}", D, where)
        _check_policy(v.get("policy", {}), where, f"variants.{n}.policy", D)
    if not isinstance(cm["source"], list) or not all(isinstance(x, str) for x in cm["source"]):
        _fail(where, "source must be a list of strings")
    return cm


def with_variant(cm: dict, variant: str, where: str = "") -> dict:
    """A copy of cm whose step and policy entries are replaced by the variant's (per optimizer / method)."""
    if variant not in cm.get("variants", {}):
        _fail(where or cm["name"], f"no variant {variant!r}; it has {', '.join(cm.get('variants', {})) or 'none'}")
    v = cm["variants"][variant]
    out = copy.deepcopy(cm)
    out["ratios"]["step"].update(copy.deepcopy(v.get("step", {})))
    out["ratios"].setdefault("policy", {}).update(copy.deepcopy(v.get("policy", {})))
    out["name"] = f"{cm['name']} ({variant})"
    # The other variants stay with the base model: applied on top of this one they would price neither (a report's
    # variants table compares each variant with the default, which this copy no longer is).
    out["variants"] = {}
    return out


def load_cost_model(path: str, variant: str | None = None) -> dict:
    """The checked cost model at `path`, with `variant`'s entries in place of the default's."""
    try:
        with open(path) as f:
            cm = json.load(f)
    except FileNotFoundError:
        _fail(path, "file not found")
    except json.JSONDecodeError as e:
        _fail(path, f"not valid JSON ({e})")
    check_cost_model(cm, path)
    return with_variant(cm, variant, path) if variant else cm


def provenance(cm: dict) -> str:
    """"measured" or "derived" (a model without the field was measured: the field came with derived ones)."""
    return cm.get("provenance", "measured")


def pipeline_priced(cm: dict, D: int) -> str:
    """The pipeline a clock at D stages prices, in words: the model the cost model prices over its
    `pipeline_stages`, split over D stages instead, each stage pipeline_stages / D of the priced one (its per-op
    costs scaled so; `stage_costs`), a p2p message the same at any D."""
    n = cm["pipeline_stages"]
    each = "the priced stage" if D == n else f"{n}/{D} = {n / D:.4g} of the priced stage"
    return f"D = {D} stages, each {each} (the cost model's, at {n} stages: {cm['model']})"


def format_speedup(x: float | None, bar: float = 1.25) -> str:
    """A speed-up as the studies' reports and the advisor print it: rounded down to 3 decimals, more where needed
    so that a value under the bar never prints at or above it (1.2486 -> 1.248x; 1.25 - 1e-16 -> 1.2499...x);
    0 (a pairing that never reaches the target loss) as "never", None or a non-finite value as "–"."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "never"
    digits = 3
    while True:
        text = f"{math.floor(x * 10 ** digits) / 10 ** digits:.{digits}f}"
        if not (x < bar <= float(text)) or digits >= 15:
            return text + "x"
        digits += 1


# --------------------------------------------------------------------------------------------------
# Messages between neighbouring stages (issue 41: the clocks priced p2p at 0 ms)
# --------------------------------------------------------------------------------------------------

# NOT MEASURED (no multi-GPU p2p measurement exists in this project: the H200 runs were one GPU): a stated,
# derived figure for two H200s of one HGX node. NVLink 4 gives 18 links x 25 GB/s = 450 GB/s one way (900 GB/s
# bidirectional, the H200 datasheet); nccl-tests reach 460-480 GB/s "busbw" for all-reduce on 8 x H100 SXM
# NVLink-4 (reported reference numbers), but one send/recv pair drives one peer's links without NVLS, so we take
# 350 GB/s one way (78 % of nominal). Latency: NCCL's per-message cost on NVLink (kernel launch, protocol
# handshake) is of the order of 10 us for small messages in nccl-tests' sendrecv; taken as 10 us, added once
# per message. A message is one micro-batch's activation (forward) or its gradient (backward) at a stage
# boundary: tokens x hidden x 2 bytes (bf16), independent of D (the same model over more stages sends the same
# tensor). Each op list's sends to another rank pay it as their arrival delay (simulator.simulate: a send never
# blocks the rank, the receiver waits for it): synchronous flushes and the asynchronous stream alike. A hand-off
# between two chunks of one rank (ZB-V's turn of the V) is no message and pays nothing (issue 57).
H200_NVLINK_P2P_GB_S = 350.0
H200_NCCL_P2P_LATENCY_US = 10.0


def activation_bytes(tokens: int, hidden: int, bytes_per_element: int = 2) -> int:
    """One micro-batch's activation (or its gradient) at a stage boundary: B x seq tokens x hidden elements."""
    return tokens * hidden * bytes_per_element


def p2p_message_ms(message_bytes: float, bandwidth_gb_s: float = H200_NVLINK_P2P_GB_S,
                   latency_us: float = H200_NCCL_P2P_LATENCY_US) -> float:
    """Milliseconds of one point-to-point message: latency + bytes / bandwidth (GB = 1e9 bytes)."""
    if message_bytes < 0 or bandwidth_gb_s <= 0 or latency_us < 0:
        raise ConfigError(f"p2p message: bytes {message_bytes}, bandwidth {bandwidth_gb_s} GB/s and latency "
                          f"{latency_us} us must be >= 0 (bandwidth > 0)")
    return latency_us / 1e3 + message_bytes / (bandwidth_gb_s * 1e9) * 1e3


def p2p_derivation(tokens: int, hidden: int, bandwidth_gb_s: float = H200_NVLINK_P2P_GB_S,
                   latency_us: float = H200_NCCL_P2P_LATENCY_US) -> tuple[float, str]:
    """(p2p_ms, the sentence a cost model's JSON records for it) for a bf16 activation of tokens x hidden."""
    nbytes = activation_bytes(tokens, hidden)
    ms = p2p_message_ms(nbytes, bandwidth_gb_s, latency_us)
    return ms, (f"p2p (DERIVED, not measured; megatron_po/pipeline/cost_model.py): one bf16 activation or gradient "
                f"of {tokens} tokens x hidden {hidden} = {nbytes / 1e6:.1f} MB per message, at {bandwidth_gb_s:g} GB/s "
                f"one way (NVLink 4 between two H200s of one node: 450 GB/s nominal, 78 % taken) + "
                f"{latency_us:g} us NCCL latency = {ms:.4f} ms; every send between two ranks pays it (forward and "
                "backward at each stage boundary; a hand-off between two chunks of one rank, ZB-V's turn, is no "
                "message: issue 57)")


# --------------------------------------------------------------------------------------------------
# Another sequence length, and context parallelism: derived from the model's stated shape (`dims`)
# --------------------------------------------------------------------------------------------------


def at_sequence_length(cm: dict, seq_length: int, micro_batch_size: int | None = None,
                       context_parallel: int = 1) -> dict:
    """cm re-derived for micro-batches of `micro_batch_size` (default: the model's) x `seq_length` tokens, each
    sequence split over `context_parallel` ranks (each rank pricing its share). DERIVED, never measured: every
    step is written into the copy's `derivation`, and its provenance is "derived". Needs the model's `dims`
    (hidden_size, and the seq_length and micro_batch_size it was priced at); ConfigError where it has none.

    Per token and layer the forward does 24h^2 FLOPs of dense matmuls (QKV, projection, a 4h MLP) and 2sh of
    causal attention (QK^T and AV over s keys, halved by the mask); a CP rank holds 1/CP of the tokens and, the
    split being load-balanced, 1/CP of the attention. So the forward scales by tokens x (24h^2 + 2sh) (attention
    taken at the dense matmuls' efficiency). The backward: its dense part (2 x the dense forward) by the tokens,
    its attention part (2.5 x: flash attention's backward does 5 products against the forward's 2) by tokens x s;
    weight gradients stay half the dense backward. Optimizer steps and weight-policy work are per parameter: the
    same milliseconds, so their ratios to the forward shrink by its factor. A p2p message (one micro-batch's
    activation at a stage boundary) is this rank's tokens x h: repriced by `p2p_derivation` where the model's
    figure is that derivation's, else scaled by the tokens. The CP ring's own transfers are not priced: taken as
    hidden behind the blocks' attention (they overlap it)."""
    dims = cm.get("dims")
    if not dims:
        _fail(cm["name"], f"states no dims ({', '.join(DIMS)}): its per-micro-batch cost cannot be scaled to another "
                          "sequence length")
    if seq_length < 1 or (micro_batch_size is not None and micro_batch_size < 1) or context_parallel < 1:
        _fail(cm["name"], f"sequence length {seq_length}, micro-batch {micro_batch_size} and context-parallel size "
                          f"{context_parallel} must be >= 1")
    h, s0, b0 = dims["hidden_size"], dims["seq_length"], dims["micro_batch_size"]
    s1, b1, cp = seq_length, micro_batch_size or b0, context_parallel
    dense = 24 * h * h
    tok0, tok1 = b0 * s0, b1 * s1 / cp
    fwd_factor = tok1 * (dense + 2 * s1 * h) / (tok0 * (dense + 2 * s0 * h))
    dense_share = 2 * dense / (2 * dense + 2.5 * 2 * s0 * h)  # of the priced backward
    out = copy.deepcopy(cm)
    r = out["ratios"]
    per = lambda v, f: [f(x) for x in v] if isinstance(v, list) else f(v)  # noqa: E731
    b_dense = per(r["backward"], lambda b: b * dense_share * tok1 / tok0 / fwd_factor)  # as ratios to the new forward
    b_attn = per(r["backward"], lambda b: b * (1 - dense_share) * tok1 * s1 / (tok0 * s0) / fwd_factor)
    both = lambda a, b, f: [f(x, y) for x, y in zip(a, b)] if isinstance(a, list) else f(a, b)  # noqa: E731
    r["backward"] = both(b_dense, b_attn, lambda x, y: round(x + y, 6))
    r["backward_weight"] = per(b_dense, lambda x: round(x / 2, 6))
    r["backward_input"] = both(r["backward"], r["backward_weight"], lambda x, y: round(x - y, 6))
    out["forward_ms"] = per(cm["forward_ms"], lambda f: round(f * fwd_factor, 6))
    shrink = lambda v: round(v / fwd_factor, 6) if not isinstance(v, list) else [round(x / fwd_factor, 6) for x in v]  # noqa: E731
    for entries in [r["step"]] + [v.get("step", {}) for v in out.get("variants", {}).values()]:
        for k in entries:
            entries[k] = shrink(entries[k])
    for policy in [r.get("policy", {})] + [v.get("policy", {}) for v in out.get("variants", {}).values()]:
        for e in policy.values():
            for k in KINDS:
                if k in e:
                    e[k] = shrink(e[k])
    lines = [f"At another shape (cost_model.at_sequence_length, DERIVED from {cm['name']}, "
             f"{provenance(cm).upper()} at {b0} x {s0} tokens, hidden {h}): micro-batch {b1} x {s1} tokens"
             + (f", each sequence split over CP = {cp} ranks (each prices its {s1 // cp} tokens and 1/{cp} of the "
                "attention; the ring's transfers taken as hidden behind the blocks' attention)" if cp > 1 else "")
             + f". Forward per token and layer 24h^2 + 2sh FLOPs (causal): x {fwd_factor:.4f}; backward's dense "
             f"part (share {dense_share:.4f} of it) by the tokens, its attention part (2.5 x attention's forward) by "
             "tokens x s; weight gradients half the dense backward; steps and weight-policy work per parameter "
             "(the same ms)."]
    if "p2p_ms" in cm:
        derived, _ = p2p_derivation(tok0, h)
        if abs(cm["p2p_ms"] - derived) < 1e-6:
            ms, text = p2p_derivation(round(tok1), h)
        else:
            ms, text = cm["p2p_ms"] * tok1 / tok0, f"p2p: the model's {cm['p2p_ms']:g} ms x tokens {tok1:g}/{tok0}"
        out["p2p_ms"] = round(ms, 6)
        lines.append(text)
    out.update(name=f"{cm['name']} at {b1}x{s1}" + (f" CP={cp}" if cp > 1 else ""), provenance="derived",
               tokens_per_microbatch=b1 * s1, dims={"hidden_size": h, "seq_length": s1, "micro_batch_size": b1},
               model=f"{cm['model']}; DERIVED at micro-batch {b1} x {s1} tokens" + (f", CP = {cp}" if cp > 1 else ""))
    if cp > 1:  # priced per CP rank: no longer the shape of one whole-sequence stage, so not to be rescaled again
        del out["dims"]
    out["derivation"] = list(cm.get("derivation", [])) + lines
    return check_cost_model(out, out["name"])


# --------------------------------------------------------------------------------------------------
# Per-op durations of one method at D stages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCosts:
    """One method's per-op durations at D stages, in seconds, one value per stage: forward, the backward
    split into input and weight gradients, the optimizer step (once per update), and the p2p latency of
    one message. A method's weight-policy work is folded into the op it runs with."""
    forward: tuple
    backward_input: tuple
    backward_weight: tuple
    step: tuple
    p2p: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def backward(self) -> tuple:
        return tuple(b + w for b, w in zip(self.backward_input, self.backward_weight))


def stage_costs(cm: dict, D: int, optimizer: str, method: str = "async-naive") -> StageCosts:
    """`method`'s per-op durations at D stages with `optimizer`'s step (the synchronous schedules and
    async-naive: no policy work). ConfigError when the model does not price the optimizer or the method,
    or gives per-stage values for another D."""
    n, r = cm["pipeline_stages"], cm["ratios"]
    if optimizer not in r["step"]:
        _fail(cm["name"], f"prices no {optimizer!r} step (it has {', '.join(r['step'])})")
    policy = r.get("policy", {}).get(method, {}) if method != "async-naive" else {}
    if method != "async-naive" and method not in r.get("policy", {}) and not is_synchronous(method):
        _fail(cm["name"], f"prices no weight policy for {method!r} (it has {', '.join(r.get('policy', {})) or 'none'})")
    entries = [cm["forward_ms"], r["backward_input"], r["backward_weight"], r["step"][optimizer],
               *[policy.get(k, 0.0) for k in KINDS]]
    if D != n and any(isinstance(v, list) for v in entries):
        _fail(cm["name"], f"gives per-stage values for {n} stages; asked for D={D} (one number per ratio prices any D)")

    def at(value, i):  # uniform when D != n (checked above)
        return value[i] if isinstance(value, list) else value

    scale = n / D / 1000.0  # the same model over D stages, in seconds
    stale = policy.get("stages", "stale") == "stale"
    fwd, bi, bw, step = [], [], [], []
    for i in range(D):
        f = at(cm["forward_ms"], i) * scale
        extra = {k: at(policy.get(k, 0.0), i) * f if (not stale or i < D - 1) else 0.0 for k in KINDS}
        fwd.append(f + extra["Forward"])
        bi.append(at(r["backward_input"], i) * f + extra["Backward"])
        bw.append(at(r["backward_weight"], i) * f)
        step.append(at(r["step"][optimizer], i) * f + extra["Step"])
    return StageCosts(tuple(fwd), tuple(bi), tuple(bw), tuple(step), float(cm.get("p2p_ms", 0.0)) / 1000.0)


# --------------------------------------------------------------------------------------------------
# Pricing op lists
# --------------------------------------------------------------------------------------------------

SYNCHRONOUS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb-h1", "zb-h2", "zb-v")


def is_synchronous(method: str) -> bool:
    return method in SYNCHRONOUS


def chunks_of(method: str, v: int = 2) -> int:
    """Model chunks per rank of a synchronous method (interleaved: v; ZB-V: 2 in a V; else 1)."""
    return 2 if method == "zb-v" else v if method.startswith("interleaved-") else 1


def _schedule_name(method: str) -> str:
    return {"interleaved-zb-h1": "zb-h1"}.get(method, method)


def _simulate(schedule, c: StageCosts) -> Timeline:
    """The schedule on costs c: each of a rank's v chunks costs 1/v of its stage (equal model size)."""
    D, v = schedule.num_stages, schedule.num_chunks

    def per_vs(values):  # virtual stage vs holds 1/v of the stage of the rank that runs it
        return [values[rank_chunk_of(vs, D, schedule.placement)[0]] / v for vs in range(D * v)]
    return simulate(schedule, per_vs(c.forward), per_vs(c.backward_input), c.p2p, per_vs(c.step),
                    t_weight=per_vs(c.backward_weight))


def sync_iteration(method: str, D: int, M: int, c: StageCosts, v: int = 2) -> Timeline:
    """One flush of a synchronous schedule (M micro-batches, then every rank's Step(None) at its own
    step cost): the timeline's makespan is the time per iteration. ConfigError if the schedule does not
    admit (D, M, v)."""
    if not is_synchronous(method):
        raise ConfigError(f"{method!r} is not a synchronous schedule ({', '.join(SYNCHRONOUS)})")
    if c.num_stages != D:
        raise ConfigError(f"costs are for {c.num_stages} stages, asked for D={D}")
    return _simulate(build_schedule(_schedule_name(method), D, chunks_of(method, v), M), c)


@dataclass(frozen=True)
class SteadyState:
    """The no-flush stream's steady state: seconds per micro-batch (the slope of the makespan over
    micro-batches), the bubble (idle share of rank-time in the steady window), peak activations in
    flight per rank and the largest staleness s (optimizer steps between a forward and its backward)."""
    seconds_per_microbatch: float
    bubble_fraction: float
    peak_activations: int
    max_staleness: int


def async_per_microbatch(D: int, k: int, c: StageCosts, v: int = 1) -> SteadyState:
    """Steady state of the asynchronous stream at update interval k, from its op list: two streams of N
    and 2N micro-batches (N a multiple of k and D, past the warm-up) are simulated, and the difference
    of their makespans over N is the time per micro-batch (the ramp and drain cancel)."""
    if c.num_stages != D:
        raise ConfigError(f"costs are for {c.num_stages} stages, asked for D={D}")
    unit = math.lcm(k, D)
    n = unit * max(1, math.ceil(8 * D / unit))
    short, long_ = (_simulate(build_schedule("async", D, v, m, update_interval=k), c) for m in (n, 2 * n))
    per_mb = (long_.makespan - short.makespan) / n
    busy = (sum(long_.busy.values()) - sum(short.busy.values())) / n
    s = max(max(per.values(), default=0) for per in staleness(long_.schedule).values())
    bubble = 1.0 - busy / (D * per_mb) if per_mb > 0 else 0.0
    return SteadyState(per_mb, 0.0 if abs(bubble) < 1e-9 else bubble,
                       max(long_.peak_activations.values()), s)


def weight_copies(method: str, D: int, k: int = 1, error_feedback: bool = False) -> int:
    """Weight-sized tensors per chunk on the most loaded rank (policies.py's table; PipeDream's stash from
    the schedule's own staleness at k): synchronous 1, async-naive 1, PipeDream s_max + 1, PipeDream-2BW 2,
    PipeOptim 2 (live + prediction cache); error feedback adds one (the previous update; its scratch is
    reused and not counted)."""
    if is_synchronous(method) or method == "async-naive":
        n = 1
    elif method in ("pipeoptim", "pipedream-2bw", "spectrain"):
        n = 2
    elif method in ("pipedream", "pipenag"):
        unit = math.lcm(k, D)
        sched = build_schedule("async", D, 1, unit * max(1, math.ceil(4 * D / unit)), update_interval=k)
        s_max = max(max(per.values(), default=0) for per in staleness(sched).values())
        n = s_max + (1 if method == "pipedream" else 2)
    else:
        raise ConfigError(f"unknown method {method!r}")
    return n + (1 if error_feedback else 0)


# --------------------------------------------------------------------------------------------------
# Work a model has no figure for: derived from its AdamW step (stated wherever it is used)
# --------------------------------------------------------------------------------------------------

# Passes over weight-sized fp32 tensors per step against the fused AdamW step's 7 (read p, g, m, v; write
# p, m, v), all bandwidth-bound: error feedback ~9 (copy W; u = W_before - W; W -= s(u - u_prev); u_prev = u),
# PipeDream-2BW's version copy 2 (read and write the weights).
DERIVED_STEP_PASSES = {"error_feedback": 9, "pipedream-2bw": 2}
ADAMW_PASSES = 7


def derived_step_ratio(cm: dict, what: str) -> float:
    """Extra work per step of `what` ("error_feedback", "pipedream-2bw") as a multiple of the forward:
    DERIVED, passes / 7 of the model's AdamW step."""
    if "adamw" not in cm["ratios"]["step"]:
        _fail(cm["name"], f"has no AdamW step to derive {what}'s work from")
    return DERIVED_STEP_PASSES[what] / ADAMW_PASSES * cm["ratios"]["step"]["adamw"]


# PipeDream's weight stash (policies.PipeDreamPolicy) where a model has no figure for it, in the same passes: on a
# stage with micro-batches in flight (all but the last), per update the clone of the version the step is about to
# overwrite (read, write: 2), and per backward the swap of the forward's version in and of the live weights back
# out (each `_swap` a clone and two copies: 6 passes, twice: 12). Charged on every backward of those stages: exact
# at k = 1, where every micro-batch there ran its forward on an older version; an upper bound at k > 1, where one
# whose forward saw the live version swaps nothing. Keeping the versions costs memory (weight_copies), not time.
PIPEDREAM_STASH_PASSES = {"Backward": 12, "Step": 2}


def derived_pipedream_policy(cm: dict) -> dict:
    """PipeDream's stash as a policy entry (multiples of the forward, stages but the last): DERIVED, passes / 7
    of the model's AdamW step (PIPEDREAM_STASH_PASSES)."""
    if "adamw" not in cm["ratios"]["step"]:
        _fail(cm["name"], "has no AdamW step to derive PipeDream's stash from")
    adamw = cm["ratios"]["step"]["adamw"]
    scaled = lambda n: [n / ADAMW_PASSES * a for a in adamw] if isinstance(adamw, list) else n / ADAMW_PASSES * adamw  # noqa: E731
    return {kind: scaled(n) for kind, n in PIPEDREAM_STASH_PASSES.items()} | {"stages": "stale"}


def method_costs(cm: dict, D: int, optimizer: str, method: str, error_feedback: bool = False
                 ) -> tuple[StageCosts, list[str]]:
    """A method's per-op costs (synchronous schedules: no policy work) and notes on every derived part:
    PipeDream's stash and PipeDream-2BW's version copy where the model has no figure for them, error feedback's
    passes."""
    notes = []
    policy = cm["ratios"].get("policy", {})
    if method == "pipedream" and method not in policy:
        policy = policy | {"pipedream": derived_pipedream_policy(cm)}
        cm = cm | {"ratios": cm["ratios"] | {"policy": policy}}
        notes.append("PipeDream's stash derived (12/7 of the AdamW step per backward, 2/7 per update, stages but the "
                     "last; an upper bound at k > 1, and where the AdamW step is eager)")
    base = "async-naive" if is_synchronous(method) else method
    derived = {}
    if base == "pipedream-2bw" and base not in policy:
        base, derived["pipedream-2bw"] = "async-naive", derived_step_ratio(cm, "pipedream-2bw")
        notes.append("2BW's version copy derived (2/7 of the AdamW step per update)")
    if error_feedback:
        derived["error_feedback"] = derived_step_ratio(cm, "error_feedback")
        notes.append("error feedback derived (9/7 of the AdamW step per update)")
    c = stage_costs(cm, D, optimizer, base)
    if derived:
        f = stage_costs(cm, D, optimizer).forward
        extra = sum(derived.values())
        c = StageCosts(c.forward, c.backward_input, c.backward_weight,
                       tuple(s + extra * x for s, x in zip(c.step, f)), c.p2p)
    return c, notes
