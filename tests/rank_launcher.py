"""Start the ranks of an entry point as separate processes, the way `srun` does (SLURM_* variables, no
torchrun), for tests and benchmarks that must kill, time or measure real processes.

Every process carries `MEGATRON_PO_RUN_TAG=<tag>` in its environment, so `tagged_processes(tag)` finds
whatever a run left behind (children included) by scanning /proc.
"""

from __future__ import annotations

import os
import subprocess
import sys

from dist_harness import free_port  # one port chooser for every launch the tests make

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG_VAR = "MEGATRON_PO_RUN_TAG"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")


def launch(script: str, argv: list[str], world: int, log_dir: str, tag: str,
           extra_env: dict | None = None) -> list[subprocess.Popen]:
    """`world` processes of `python script argv...` as Slurm tasks of one job on this host; rank r's
    stdout and stderr go to `<log_dir>/rank<r>.log`."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    base.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
                 "OMP_NUM_THREADS": "1", TAG_VAR: tag, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "SLURM_NTASKS": str(world), "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "127.0.0.1"})
    base.update(extra_env or {})
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for r in range(world):
        env = dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))
        with open(os.path.join(log_dir, f"rank{r}.log"), "w") as log:
            procs.append(subprocess.Popen([sys.executable, script, *argv], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment carries this run's tag (zombies excluded)."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        pids.append(int(entry))
    return pids


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS (resident) and RssAnon (heap and other anonymous pages: what a leak grows) of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0])
    return out
