"""What each step of a GPU check's call came to, read from what it left (a pytest log, gpu.py's results JSON, gpu.py's
own log), and the closing screen's list of the steps: status, seconds, why (a section that raised: its exception,
where and its last output lines, issue 58) and the command that runs again each one that did not end well.
bench/gpu_check/gpu_check.py runs the steps; this module only reads. Torch-free."""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from bench_common import markdown_table  # noqa: E402


def count_results(log_path: str) -> str:
    """What a cut-off pytest (-v) had reported: "12 PASSED, 1 FAILED" from its per-test lines."""
    with open(log_path, errors="replace") as f:
        found = re.findall(r"(PASSED|FAILED|SKIPPED|ERROR)\b", f.read())
    counts = {word: found.count(word) for word in ("PASSED", "FAILED", "ERROR", "SKIPPED") if word in found}
    return ", ".join(f"{n} {word.lower()}" for word, n in counts.items()) or "no test finished"


def last_lines(log_path: str, n: int = 3) -> str:
    """"; last lines: `...` / `...`": a log's last `n` non-empty lines, for a status's why (gpu.py's own crash)."""
    if not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        tail = [line.strip() for line in f.read().splitlines() if line.strip()][-n:]
    return "; last lines: " + " / ".join(f"`{t[:160]}`" for t in tail) if tail else ""


def pytest_summary(log_path: str) -> str:
    """pytest's closing line ("3 failed, 25 passed, 28 deselected in 88.29s"), or ""."""
    if not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        found = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|error).*? in [\d.]+s.*?) ?=*$", f.read(),
                           re.M)
    return found[-1] if found else ""


def section_statuses(data: dict, sections: list[str], rc: int | None, log_path: str) -> dict[str, dict]:
    """What gpu.py's results (`data`: its JSON) say of each of `sections`, as updates of the check's statuses:
    status, seconds and note (why: a section that raised, gpu.py's line of it: its exception, where, its last
    output lines); a section gpu.py did not finish says whether the budget killed it (`rc` None) or gpu.py ended
    (its exit code and its log's last lines, `log_path`), and whether its figures so far are in the results."""
    statuses, errors = data.get("section_status", {}), {e["section"]: e["error"] for e in data.get("failures", [])}
    partial = "its figures so far are in the results (`partial`)"
    out = {}
    for s in sections:
        st = statuses.get(s)
        if st is None or st.get("status") == "running":  # gpu.py ended (killed, crashed) in or before it
            why = "killed at the end of the budget" if rc is None else \
                f"gpu.py exit code {rc} before it" + last_lines(log_path)
            if st is not None and s in data.get("partial", {}):
                why += "; " + partial
            out[s] = {"status": "cut off" if rc is None else "failed", "note": why}
            continue
        note = st.get("note", "") or (errors.get(s, "").splitlines() or [""])[0][:160]
        if s in data.get("partial", {}):
            note = (note + "; " if note else "") + partial
        out[s] = {"status": st["status"], "seconds": st["seconds"], "note": note, "estimate_s": st["estimate_s"]}
    return out


def not_run_to_the_end(status: dict) -> list[str]:
    """The steps skipped, cut off or not reached (a stream section none of whose methods was asked for is not)."""
    return [n for n, st in status.items() if st["status"] in ("skipped", "cut off", "not reached")
            and not st.get("note", "").startswith("none of --stream-methods")]


def closing_steps(status: dict, flags: str = "") -> list[str]:
    """The closing screen's steps: every step of the call with its status, seconds and why (a section that raised:
    its exception, where it was raised and its last output lines: issue 58), and the command that runs again each
    one that did not end well (with `flags`: " --quick")."""
    rows = []
    for n, st in status.items():
        ended_well = st["status"] in ("passed", "done", "reused")
        rows.append([n, st["status"], "" if st["seconds"] is None else f"{st['seconds']:.0f}",
                     st.get("note", "").replace("|", "/"), "" if ended_well else f"`{again([n], flags)}`"])
    lines = ["## Steps of this call", "", "Each with its status and, where it did not end well, the command that "
             "runs it (the plain `bash scripts/gpu_check.sh` puts what no run measured first anyway):", "",
             markdown_table(["step", "status", "seconds", "why", "command"], rows), ""]
    failed = [n for n, st in status.items() if st["status"] == "failed"]
    if failed:
        lines.append(f"Failed: {', '.join(failed)}; again: `{again(failed, flags)}`  ")
    left = not_run_to_the_end(status)
    lines.append(f"Did not run to the end: all of them again: `{again(left, flags)}`" if left else
                 "Every step ran to its end.")
    return lines


def again(steps: list[str], flags: str = "") -> str:
    """The command that runs `steps` (with their baselines) in a call of their own, with `flags` (" --quick")."""
    return f"bash scripts/gpu_check.sh --steps {' '.join(steps)}{flags}"
