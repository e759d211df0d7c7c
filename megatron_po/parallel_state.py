"""Topology, process groups, and the one place that picks device and backend.

Rank layout follows Megatron: tensor-parallel (TP) ranks are adjacent (fastest varying), then data
parallel (DP), then pipeline parallel (PP):

    global_rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

so a TP group sits on one node's fast interconnect and pipeline stages span nodes.

Launch: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when present;
otherwise Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of the node list, a port
derived from the job id), so `srun python pretrain_gpt.py ...` works without torchrun; otherwise a
single process.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_po.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Device and backend: chosen here and nowhere else.
# --------------------------------------------------------------------------------------------------


def get_device() -> torch.device:
    """`cuda:<local_rank>` when GPUs exist, else `cpu`."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# --------------------------------------------------------------------------------------------------
# Launch environment
# --------------------------------------------------------------------------------------------------


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `node[03-05,9],gpu7` -> `node03`."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def read_launch_env(environ=None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
            launcher="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", _free_port(), "single")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------


@dataclass
class _State:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    model_parallel_group: object = None  # TP x PP ranks sharing one replica of the model
    tp_dp_group: object = None  # TP x DP ranks of one pipeline stage (stage-local reductions)
    embedding_group: object = None  # first and last pipeline stage (tied embeddings)
    pp_ranks: tuple = ()  # global ranks of my pipeline group, by stage
    dp_ranks: tuple = ()
    tp_ranks: tuple = ()


_STATE: _State | None = None


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def coords_of(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def check_topology(world_size: int, tp: int, pp: int) -> int:
    """Validate sizes; return the data-parallel size."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) = {tp * pp}"
        )
    return world_size // (tp * pp)


def init_distributed(timeout_minutes: float = 10.0, environ=None) -> LaunchEnv:
    """Start torch.distributed from the launch environment (idempotent)."""
    env = read_launch_env(environ)
    if dist.is_initialized():
        return env
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=get_backend(),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return env


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None) -> None:
    """Build every process group. Every rank must call this with the same arguments."""
    global _STATE
    assert dist.is_initialized(), "call init_distributed() first"
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    dp = check_topology(world, tp, pp)
    st = _State(tp=tp, pp=pp, dp=dp, vpp=virtual_pipeline_model_parallel_size)
    my_tp, my_dp, my_pp = coords_of(rank, tp, dp)

    # new_group must be called by every rank for every group, in the same order.
    for p in range(pp):
        for d in range(dp):
            ranks = [rank_of(t, d, p, tp, dp) for t in range(tp)]
            g = dist.new_group(ranks)
            if (d, p) == (my_dp, my_pp):
                st.tp_group, st.tp_ranks = g, tuple(ranks)
    for p in range(pp):
        for t in range(tp):
            ranks = [rank_of(t, d, p, tp, dp) for d in range(dp)]
            g = dist.new_group(ranks)
            if (t, p) == (my_tp, my_pp):
                st.dp_group, st.dp_ranks = g, tuple(ranks)
    for d in range(dp):
        for t in range(tp):
            ranks = [rank_of(t, d, p, tp, dp) for p in range(pp)]
            g = dist.new_group(ranks)
            if (t, d) == (my_tp, my_dp):
                st.pp_group, st.pp_ranks = g, tuple(ranks)
            emb = sorted({ranks[0], ranks[-1]})
            g = dist.new_group(emb)
            if (t, d) == (my_tp, my_dp):
                st.embedding_group = g
    for d in range(dp):
        ranks = [rank_of(t, d, p, tp, dp) for p in range(pp) for t in range(tp)]
        g = dist.new_group(ranks)
        if d == my_dp:
            st.model_parallel_group = g
    for p in range(pp):
        ranks = [rank_of(t, d, p, tp, dp) for d in range(dp) for t in range(tp)]
        g = dist.new_group(ranks)
        if p == my_pp:
            st.tp_dp_group = g
    _STATE = st


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


def _st() -> _State:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call initialize_model_parallel()")
    return _STATE


# Megatron-style accessors. Before initialization they describe a single process (size 1, rank 0),
# so layers and models can be built and tested without any process group.

def get_tensor_model_parallel_group():
    return _st().tp_group


def get_data_parallel_group():
    return _st().dp_group


def get_pipeline_model_parallel_group():
    return _st().pp_group


def get_model_parallel_group():
    return _st().model_parallel_group


def get_tensor_and_data_parallel_group():
    return _st().tp_dp_group


def get_embedding_group():
    return _st().embedding_group


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp if _STATE else 1


def get_tensor_model_parallel_rank() -> int:
    return coords_of(dist.get_rank(), _STATE.tp, _STATE.dp)[0] if _STATE else 0


def get_data_parallel_world_size() -> int:
    return _STATE.dp if _STATE else 1


def get_data_parallel_rank() -> int:
    return coords_of(dist.get_rank(), _STATE.tp, _STATE.dp)[1] if _STATE else 0


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pp if _STATE else 1


def get_pipeline_model_parallel_rank() -> int:
    return coords_of(dist.get_rank(), _STATE.tp, _STATE.dp)[2] if _STATE else 0


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _STATE.vpp if _STATE else None


def get_pipeline_model_parallel_ranks() -> tuple:
    """Global ranks of my pipeline group, indexed by stage."""
    return _st().pp_ranks


def get_data_parallel_ranks() -> tuple:
    return _st().dp_ranks


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in my tensor-parallel group (for broadcasts of data)."""
    return _st().tp_ranks[0]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
