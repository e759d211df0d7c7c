"""What one device machine remembers between the calls of a lease (issue 44): the baselines it measured (the bf16
matmul peak, the plain GPT eager and compiled, ours eager), what each call measured, and how many calls it ran.

The device tool keeps git-ignored files of the working tree between calls to a warm machine, and a fresh machine
starts without them. The state lives in `.gpu_state/<GPU UUID>_<boot id>/` (git-ignored) in the checkout: a
second call on the same GPU since the same boot finds the first call's figures there; another machine, or the same
one rebooted, has another key and measures its own. Torch-free.

- `baselines.json`: {section: {"title", "commands", "figures", "lines", "code_hash", "call", "measured_at"}}: a
  section of gpu_budget.REUSABLE as gpu.py measured it; gpu.py takes it instead of measuring again when the code
  hash is the same, and every ratio read against it says "same machine" (not "same run").
- `measured.json`: {step: {"code_hash", "seconds", "status", "call", "started"}}: what earlier calls on this machine
  ran to the end (bench/gpu_check/gpu_plan.py counts them as the newest measurements).
- `calls`: one line per call (its label), so each call's files get their own names (`call1`, `call2`, ...).

`GPU_CHECK_GPU_UUID` and `GPU_CHECK_BOOT_ID` override the two halves of the key (tests fake machines with them),
`GPU_CHECK_STATE_DIR` the folder holding the machines' states (tests: a temporary one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from bench_common import write_text  # noqa: E402

STATE_DIR = ".gpu_state"  # in the checkout; .gitignore names it


def gpu_uuid() -> str:
    """The first GPU's UUID (nvidia-smi), "no-gpu" without one."""
    if os.environ.get("GPU_CHECK_GPU_UUID"):
        return os.environ["GPU_CHECK_GPU_UUID"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15)
        first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        first = ""
    return first or "no-gpu"


def boot_id() -> str:
    if os.environ.get("GPU_CHECK_BOOT_ID"):
        return os.environ["GPU_CHECK_BOOT_ID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


def machine_key() -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{gpu_uuid()}_{boot_id()}")


def machine_dir(repo: str, key: str | None = None) -> str:
    return os.path.join(os.environ.get("GPU_CHECK_STATE_DIR") or os.path.join(repo, STATE_DIR), key or machine_key())


def read(path: str) -> dict:
    """A JSON object file's contents, {} when it is missing or not one."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _update(path: str, key: str, value: dict) -> None:
    data = read(path)
    data[key] = value
    write_text(path, json.dumps(data, indent=1) + "\n", atomic=True)


def baselines(state_dir: str) -> dict:
    return read(os.path.join(state_dir, "baselines.json"))


def save_baseline(state_dir: str, section: str, entry: dict) -> None:
    _update(os.path.join(state_dir, "baselines.json"), section, entry)


def measured(state_dir: str) -> dict:
    return read(os.path.join(state_dir, "measured.json"))


def save_measured(state_dir: str, step: str, entry: dict) -> None:
    _update(os.path.join(state_dir, "measured.json"), step, entry)


def new_call(state_dir: str) -> str:
    """This call's label, `call<N>` with N one more than the calls this machine ran; recorded."""
    path = os.path.join(state_dir, "calls")
    os.makedirs(state_dir, exist_ok=True)
    try:
        with open(path) as f:
            n = sum(1 for line in f if line.strip())
    except OSError:
        n = 0
    label = f"call{n + 1}"
    with open(path, "a") as f:
        f.write(label + "\n")
    return label


def reusable(state_dir: str, code_hashes: dict[str, str]) -> set[str]:
    """The baselines this machine measured at the code hashes given (gpu.py reuses those)."""
    return {name for name, entry in baselines(state_dir).items() if entry.get("code_hash") == code_hashes.get(name)}
