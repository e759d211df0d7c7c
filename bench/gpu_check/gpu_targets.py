"""The GPU targets (issue 44; issues 30, 31 and 34 before it), read from gpu.py's figures: one table that gpu.py's
section `targets` and the check's closing screen (bench/gpu_check/gpu_check.py) both use. Torch-free.

Each target is a ratio of two figures of the same run, or of this run and a baseline measured on the same machine
by an earlier call (gpu_state.py: the figures then say `reused`); `value(sections)` takes the JSON's
{section: figures} and returns the figure or None where its sections did not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _get(sections: dict, *path):
    x = sections
    for key in path:
        if not isinstance(x, dict) or key not in x or x[key] is None:
            return None
        x = x[key]
    return x


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _stream_ratio(sections: dict, section: str, label: str, base: str):
    methods = _get(sections, section, "methods") or {}
    return _ratio(_get(methods, label, "ms_per_microbatch"), _get(methods, base, "ms_per_microbatch"))


PLAIN_COMPILED = "plain PyTorch, torch.compile"
# FP8's bounds (issue 43) on the ratios bench/gpu/gpu_fp8.py computes within its own run (it reads them from here)
FP8_BOUNDS = {"compiled_over_bf16_compiled": 1.25, "compiled_over_plain_fp8_compiled": 1.0, "loss_delta": 0.02}


@dataclass(frozen=True)
class Target:
    name: str
    bound: float
    higher_is_better: bool
    sections: tuple[str, ...]  # where its figures come from (the first measures it)
    value: Callable[[dict], float | None]

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.bound if self.higher_is_better else value <= self.bound


TARGETS = [
    Target("--torch-compile ours / compiled plain GPT, tokens/s >= 1.0", 1.0, True, ("compiled", "plain"),
           lambda s: _get(s, "compiled", "over_plain_compiled")),
    Target("--torch-compile ours, MFU of the measured bf16 peak >= 0.70", 0.70, True, ("compiled", "peak"),
           lambda s: _get(s, "compiled", "mfu")),
    Target("--torch-compile ours / compiled plain GPT, peak memory <= 1.0", 1.0, False, ("compiled", "plain"),
           lambda s: _ratio(_get(s, "compiled", "max_memory_bytes"),
                            _get(s, "plain", PLAIN_COMPILED, "max_memory_bytes"))),
    Target("the same in GPipe's order (all forwards, then all backwards), peak memory <= 1.0", 1.0, False,
           ("gpipe",), lambda s: _get(s, "gpipe", "ours_over_plain_memory")),
    Target("D = 4 stream under --torch-compile, PipeOptim / async-naive per micro-batch <= 1.01", 1.01, False,
           ("stream_compiled",), lambda s: _stream_ratio(s, "stream_compiled", "PipeOptim (AdamW)", "async-naive")),
    Target("Muon iteration / AdamW iteration <= 1.10 (the default Muon)", 1.10, False, ("muon", "gpt"),
           lambda s: _get(s, "muon", "muon", "over_adamw")),
    Target("D = 4 eager stream, PipeOptim-Muon / PipeOptim-AdamW per micro-batch <= 1.8 (issue 31)", 1.8, False,
           ("stream",), lambda s: _stream_ratio(s, "stream", "PipeOptim (Muon)", "PipeOptim (AdamW)")),
    Target("FP8 --torch-compile / ours bf16 --torch-compile, tokens/s >= 1.25",
           FP8_BOUNDS["compiled_over_bf16_compiled"], True, ("fp8",),
           lambda s: _get(s, "fp8", "ratios", "compiled_over_bf16_compiled")),
    Target("FP8 --torch-compile / plain GPT under torchao's FP8, compiled, tokens/s >= 1.0",
           FP8_BOUNDS["compiled_over_plain_fp8_compiled"], True, ("fp8",),
           lambda s: _get(s, "fp8", "ratios", "compiled_over_plain_fp8_compiled")),
    Target("FP8 last loss - bf16 last loss, |delta| <= 0.02", FP8_BOUNDS["loss_delta"], False, ("fp8",),
           lambda s: _get(s, "fp8", "ratios", "loss_delta")),
]


def rows(sections: dict, reused: dict[str, str] | None = None) -> list[list[str]]:
    """[target, measured, met / NOT MET, from which sections and how] for every target."""
    reused = reused or {}
    out = []
    for t in TARGETS:
        value = t.value(sections)
        if value is None:
            out.append([t.name, "not measured", "", "sections " + ", ".join(t.sections)])
            continue
        how = [f"{s}: same machine, {reused[s]}" for s in t.sections if s in reused]
        out.append([t.name, f"{value:.3f}", "met" if t.met(value) else "NOT MET",
                    "sections " + ", ".join(t.sections) + ("; " + "; ".join(how) if how else "; same run")])
    return out
