"""Topology, process groups, and the one place that picks device and backend.

Rank layout follows Megatron: tensor-parallel (TP) ranks are adjacent (fastest varying), then context
parallel (CP), then data parallel (DP), then pipeline parallel (PP):

    global_rank = ((pp_rank * DP + dp_rank) * CP + cp_rank) * TP + tp_rank

so a TP group sits on one node's fast interconnect, a CP ring next to it, and pipeline stages span nodes.
Context parallelism shards no weights: the CP ranks of one DP rank hold the same replica and each sees its
share of every sequence, so gradients are reduced over DP x CP (`get_data_parallel_group(
with_context_parallel=True)`, Megatron's "data parallel group with context parallel"); the data loader
still reads one share of the global batch per DP rank.

Launch: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when present;
otherwise Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of the node list, a port
derived from the job id), so `srun python pretrain_gpt.py ...` works without torchrun; otherwise a
single process.

Faults: every process group (the world's and each new_group) gets `--distributed-timeout-minutes`, so a
collective or receive that a live but stuck peer never completes fails instead of hanging. A
heartbeat watchdog (megatron_po/rank_watchdog.py) finds ranks that died (SIGKILL, OOM killer, lost node),
which a blocked peer cannot tell from slow ones, and makes every rank exit with a line naming the lost one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
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


def reduce_scatter_grads(group) -> bool:
    """How the distributed optimizer averages gradients over `group`: a reduce-scatter (each rank gets
    the mean of the range it owns; half an all-reduce's bytes), or, on gloo, an all-reduce. gloo's
    reduce-scatter costs more than its all-reduce at every size we measured (0.1-8 MB on 2 ranks), and a
    rank holding the whole mean gradient can check it for inf/NaN and take its norm without one more
    collective over the data-parallel group: at k = 1 an asynchronous stage steps after every micro-batch."""
    return dist.get_backend(group) != "gloo"


def set_deterministic() -> None:
    """`--deterministic`: the same seed and layout give bit-identical runs on GPUs too. Call before the
    process group and any CUDA work exist. CPU runs (gloo) are deterministic without it.

    - `torch.use_deterministic_algorithms(True)`: deterministic kernels where torch has a choice (e.g.
      the embedding backward's index_add without atomics); an op without one raises instead of drifting;
    - cuDNN deterministic, its autotuner off (`benchmark` would pick kernels by timing);
    - `CUBLAS_WORKSPACE_CONFIG=:4096:8`, which cuBLAS needs for reproducible split-K GEMMs;
    - `NCCL_ALGO=Ring` unless set: one reduction order for every message size (NCCL may otherwise pick
      tree or ring by size and topology, and the sums round differently)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


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
    cp: int = 1
    tp_group: object = None
    dp_group: object = None
    cp_group: object = None  # the CP ranks sharing every sequence of one DP rank (the ring)
    dp_cp_group: object = None  # DP x CP: the replicas whose gradients are averaged
    pp_group: object = None
    model_parallel_group: object = None  # TP x PP ranks sharing one replica of the model (one DP, one CP rank)
    tp_dp_group: object = None  # TP x CP x DP ranks of one pipeline stage (stage-local reductions)
    embedding_group: object = None  # first and last pipeline stage (tied embeddings)
    pp_ranks: tuple = ()  # global ranks of my pipeline group, by stage
    dp_ranks: tuple = ()
    tp_ranks: tuple = ()
    cp_ranks: tuple = ()  # global ranks of my CP group, by CP rank
    dp_cp_ranks: tuple = ()


_STATE: _State | None = None
# Of the world group and every group built here (new_group would otherwise default to 30 minutes).
_TIMEOUT = datetime.timedelta(minutes=10)
_MADE: list = []  # every group initialize_model_parallel and initialize_expert_parallel made (destroy_model_parallel)
_ON_RELEASE: list = []  # what modules holding objects built on the groups drop when they go (`on_release`)


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def coords_of(rank: int, tp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank (`context_parallel_rank_of`: its CP rank)."""
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def context_parallel_rank_of(rank: int, tp: int, cp: int) -> int:
    return (rank // tp) % cp


def check_topology(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """Validate sizes; return the data-parallel size."""
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(f"--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}) and "
                          f"--context-parallel-size ({cp}) must be >= 1")
    if world_size % (tp * pp * cp) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp})" + (f" x --context-parallel-size ({cp})" if cp > 1 else "")
            + f" = {tp * pp * cp}"
        )
    return world_size // (tp * pp * cp)


def init_distributed(timeout_minutes: float = 10.0, environ=None, backend: str | None = None) -> LaunchEnv:
    """Start torch.distributed from the launch environment (idempotent); `backend` (--distributed-backend)
    defaults to nccl on CUDA, gloo on CPU."""
    global _TIMEOUT
    env = read_launch_env(environ)
    if dist.is_initialized():
        return env
    _TIMEOUT = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend or get_backend(),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=_TIMEOUT,
    )
    return env


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              context_parallel_size: int = 1) -> None:
    """Build every process group. Every rank must call this with the same arguments."""
    global _STATE
    assert dist.is_initialized(), "call init_distributed() first"
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = check_topology(world, tp, pp, cp)
    st = _State(tp=tp, pp=pp, dp=dp, vpp=virtual_pipeline_model_parallel_size, cp=cp)
    my_tp, my_dp, my_pp = coords_of(rank, tp, dp, cp)
    my_cp = context_parallel_rank_of(rank, tp, cp)
    at = lambda t, d, p, c: rank_of(t, d, p, tp, dp, c, cp)  # noqa: E731

    # new_group must be called by every rank for every group, in the same order.
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                ranks = [at(t, d, p, c) for t in range(tp)]
                g = _new_group(ranks)
                if (d, p, c) == (my_dp, my_pp, my_cp):
                    st.tp_group, st.tp_ranks = g, tuple(ranks)
    for p in range(pp):
        for t in range(tp):
            for c in range(cp):
                ranks = [at(t, d, p, c) for d in range(dp)]
                g = _new_group(ranks)
                if (t, p, c) == (my_tp, my_pp, my_cp):
                    st.dp_group, st.dp_ranks = g, tuple(ranks)
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                ranks = [at(t, d, p, c) for p in range(pp)]
                g = _new_group(ranks)
                if (t, d, c) == (my_tp, my_dp, my_cp):
                    st.pp_group, st.pp_ranks = g, tuple(ranks)
                emb = sorted({ranks[0], ranks[-1]})
                g = _new_group(emb)
                if (t, d, c) == (my_tp, my_dp, my_cp):
                    st.embedding_group = g
    for d in range(dp):
        for c in range(cp):
            ranks = [at(t, d, p, c) for p in range(pp) for t in range(tp)]
            g = _new_group(ranks)
            if (d, c) == (my_dp, my_cp):
                st.model_parallel_group = g
    for p in range(pp):
        ranks = [at(t, d, p, c) for d in range(dp) for c in range(cp) for t in range(tp)]
        g = _new_group(ranks)
        if p == my_pp:
            st.tp_dp_group = g
    if cp > 1:  # with CP = 1 these are the TP-less DP groups above (no new groups: the same order as before)
        _context_parallel_groups(st, at, my_tp, my_dp, my_pp, my_cp)
    else:
        st.cp_group, st.cp_ranks = None, (rank,)
        st.dp_cp_group, st.dp_cp_ranks = st.dp_group, st.dp_ranks
    _STATE = st


def _context_parallel_groups(st: _State, at, my_tp: int, my_dp: int, my_pp: int, my_cp: int) -> None:
    """The CP rings (one per TP rank, DP rank and stage) and the DP x CP groups gradients are averaged over."""
    for p in range(st.pp):
        for d in range(st.dp):
            for t in range(st.tp):
                ranks = [at(t, d, p, c) for c in range(st.cp)]
                g = _new_group(ranks)
                if (t, d, p) == (my_tp, my_dp, my_pp):
                    st.cp_group, st.cp_ranks = g, tuple(ranks)
    for p in range(st.pp):
        for t in range(st.tp):
            ranks = [at(t, d, p, c) for d in range(st.dp) for c in range(st.cp)]
            g = _new_group(ranks)
            if (t, p) == (my_tp, my_pp):
                st.dp_cp_group, st.dp_cp_ranks = g, tuple(ranks)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def _new_group(ranks: list[int]):
    """A process group of `ranks` (every rank calls it, in the same order), released by destroy_model_parallel."""
    group = dist.new_group(ranks, timeout=_TIMEOUT)
    _MADE.append(group)
    return group


def on_release(callback) -> None:
    """`callback()` runs as destroy_model_parallel releases the groups: a module that keeps objects built on them
    (pipeline/executor.py's transports) drops them there, in the process that made them (a forked child that
    dropped the last reference to an object holding its parent's group would run that group's destructor, which
    waits for threads that did not survive the fork)."""
    _ON_RELEASE.append(callback)


def destroy_model_parallel() -> None:
    """Forget the groups and release them (the watchdog, if one runs, is stopped first: rank_watchdog.stop_watchdog).
    Each gloo group holds threads and connections until it is destroyed: a process that builds groups again and
    again (a launch running many layouts, tools/layout_sweep.py) would pile them up. Local: no rank waits for
    another."""
    global _STATE, _EXPERT
    _STATE = _EXPERT = None
    _MESHES.clear()
    for callback in _ON_RELEASE:
        callback()
    while _MADE:
        group = _MADE.pop()
        with contextlib.suppress(ValueError):  # gone already, with the default group
            dist.destroy_process_group(group)


def _st() -> _State:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call initialize_model_parallel()")
    return _STATE


# Megatron-style accessors. Before initialization they describe a single process (size 1, rank 0),
# so layers and models can be built and tested without any process group.

def get_tensor_model_parallel_group():
    return _st().tp_group


def get_data_parallel_group(with_context_parallel: bool = False):
    """The DP ranks of my TP rank, CP rank and stage; `with_context_parallel`: DP x CP, the ranks holding
    replicas of my weights (gradients are averaged over it)."""
    return _st().dp_cp_group if with_context_parallel else _st().dp_group


def get_context_parallel_group():
    """My CP ring (None with CP = 1)."""
    return _st().cp_group


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
    return coords_of(dist.get_rank(), _STATE.tp, _STATE.dp, _STATE.cp)[0] if _STATE else 0


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if _STATE is None:
        return 1
    return _STATE.dp * _STATE.cp if with_context_parallel else _STATE.dp


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    if _STATE is None:
        return 0
    dp_rank = coords_of(dist.get_rank(), _STATE.tp, _STATE.dp, _STATE.cp)[1]
    return dp_rank * _STATE.cp + get_context_parallel_rank() if with_context_parallel else dp_rank


def get_context_parallel_world_size() -> int:
    return _STATE.cp if _STATE else 1


def get_context_parallel_rank() -> int:
    return context_parallel_rank_of(dist.get_rank(), _STATE.tp, _STATE.cp) if _STATE else 0


def get_context_parallel_ranks() -> tuple:
    """Global ranks of my CP group, by CP rank."""
    return _st().cp_ranks


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pp if _STATE else 1


def get_pipeline_model_parallel_rank() -> int:
    return coords_of(dist.get_rank(), _STATE.tp, _STATE.dp, _STATE.cp)[2] if _STATE else 0


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _STATE.vpp if _STATE else None


def get_pipeline_model_parallel_ranks() -> tuple:
    """Global ranks of my pipeline group, indexed by stage."""
    return _st().pp_ranks


def get_data_parallel_ranks(with_context_parallel: bool = False) -> tuple:
    return _st().dp_cp_ranks if with_context_parallel else _st().dp_ranks


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in my tensor-parallel group (for broadcasts of data)."""
    return _st().tp_ranks[0]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# --------------------------------------------------------------------------------------------------
# Expert parallelism (Mixture of Experts), Megatron's layout
# --------------------------------------------------------------------------------------------------
#
# A pipeline stage's ranks, in rank order (TP fastest, then the data-parallel ranks), are laid out again
# for the experts as ETP x EP x EDP (expert tensor parallel fastest, then expert parallel, then expert
# data parallel), as Megatron-core's expert rank generator does. With ETP = TP (the default) an EP group is
# EP consecutive data-parallel ranks of one (tp, pp) coordinate: the experts are split over ranks carved
# out of the data-parallel ones, and the expert-data-parallel group holds the ranks with the same experts.
# Every rank of a stage holds distinct tokens (MoE with TP > 1 needs sequence parallelism, as in Megatron),
# so a token may go to any expert of its dispatch group (ETP x EP ranks). Only the stage's rank list enters
# here: a layout that adds context-parallel ranks to the stage carves the experts from those too.


@dataclass
class _ExpertState:
    ep: int = 1
    etp: int = 1
    edp: int = 1
    ep_group: object = None  # ranks holding different experts (same ETP rank): the alltoall
    etp_group: object = None  # ranks holding different slices of the same experts
    dispatch_group: object = None  # ETP x EP: the ranks whose tokens reach each other's experts
    edp_group: object = None  # ranks holding the same expert slices: their gradients are summed
    expert_mp_group: object = None  # ETP x EP x PP: every expert slice of the model once (gradient norm)
    ep_rank: int = 0
    etp_rank: int = 0


_EXPERT: _ExpertState | None = None


def stage_ranks(pp_rank: int) -> list[int]:
    """The global ranks of pipeline stage `pp_rank`, in rank order (TP fastest, then CP, then DP)."""
    st = _st()
    return [rank_of(t, d, pp_rank, st.tp, st.dp, c, st.cp) for d in range(st.dp) for c in range(st.cp)
            for t in range(st.tp)]


def expert_layout(stage: list[int], etp: int, ep: int) -> dict[str, list[list[int]]]:
    """The expert groups of one pipeline stage, its ranks `stage` in rank order re-read as ETP x EP x EDP
    (ETP fastest): {"etp": [...], "ep": [...], "dispatch": [...], "edp": [...]}, each a list of rank lists. With
    context parallelism the stage's ranks are TP x CP x DP: experts are carved out of DP x CP, as in Megatron."""
    n = len(stage)
    if n % (etp * ep):
        raise ConfigError(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) = {etp * ep} "
                          f"does not divide the {n} ranks of a pipeline stage (tensor x context x data parallel)")
    edp = n // (etp * ep)
    at = lambda t, e, d: stage[t + etp * (e + ep * d)]  # noqa: E731
    return {"etp": [[at(t, e, d) for t in range(etp)] for d in range(edp) for e in range(ep)],
            "ep": [[at(t, e, d) for e in range(ep)] for d in range(edp) for t in range(etp)],
            "dispatch": [[at(t, e, d) for e in range(ep) for t in range(etp)] for d in range(edp)],
            "edp": [[at(t, e, d) for d in range(edp)] for e in range(ep) for t in range(etp)]}


def initialize_expert_parallel(expert_model_parallel_size: int = 1,
                               expert_tensor_parallel_size: int | None = None) -> None:
    """Build the expert groups (after `initialize_model_parallel`; every rank calls it with the same sizes).
    `expert_tensor_parallel_size` None: the TP size (Megatron's default)."""
    global _EXPERT
    st, rank = _st(), dist.get_rank()
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size or st.tp
    ex = _ExpertState(ep=ep, etp=etp, edp=st.tp * st.cp * st.dp // (ep * etp))
    mp = {}  # ETP x EP x PP: the same (edp, ep, etp position) on every stage
    for p in range(st.pp):
        layout = expert_layout(stage_ranks(p), etp, ep)
        for kind, field_name in (("etp", "etp_group"), ("ep", "ep_group"), ("dispatch", "dispatch_group"),
                                 ("edp", "edp_group")):
            for ranks in layout[kind]:
                g = _new_group(ranks)
                if rank in ranks:
                    setattr(ex, field_name, g)
                    if kind == "ep":
                        ex.ep_rank = ranks.index(rank)
                    if kind == "etp":
                        ex.etp_rank = ranks.index(rank)
        for d, ranks in enumerate(layout["dispatch"]):
            mp.setdefault(d, []).extend(ranks)
    for d in sorted(mp):
        g = _new_group(sorted(mp[d]))
        if rank in mp[d]:
            ex.expert_mp_group = g
    _EXPERT = ex


def expert_parallel_is_initialized() -> bool:
    return _EXPERT is not None


# Before `initialize_expert_parallel` the layout is EP = 1, ETP = TP: every rank holds every expert, split like
# the dense layers over TP, and the expert groups are the dense ones.

def get_expert_model_parallel_world_size() -> int:
    return _EXPERT.ep if _EXPERT else 1


def get_expert_model_parallel_rank() -> int:
    return _EXPERT.ep_rank if _EXPERT else 0


def get_expert_tensor_parallel_world_size() -> int:
    return _EXPERT.etp if _EXPERT else get_tensor_model_parallel_world_size()


def get_expert_tensor_parallel_rank() -> int:
    return _EXPERT.etp_rank if _EXPERT else get_tensor_model_parallel_rank()


def get_expert_model_parallel_group():
    return _EXPERT.ep_group if _EXPERT else None


def get_expert_tensor_parallel_group():
    return _EXPERT.etp_group if _EXPERT else (_STATE.tp_group if _STATE else None)


def get_expert_tensor_and_model_parallel_group():
    """ETP x EP ranks (Megatron's expert tensor and model parallel group)."""
    return _EXPERT.dispatch_group if _EXPERT else (_STATE.tp_group if _STATE else None)


def get_expert_data_parallel_group():
    return _EXPERT.edp_group if _EXPERT else (_STATE.dp_group if _STATE else None)


def get_expert_data_parallel_world_size() -> int:
    return _EXPERT.edp if _EXPERT else get_data_parallel_world_size()


def get_expert_tensor_model_pipeline_parallel_group():
    """ETP x EP x PP ranks: every expert slice of the model once (Megatron's expert tensor-model-pipeline group)."""
    return _EXPERT.expert_mp_group if _EXPERT else (_STATE.model_parallel_group if _STATE else None)


# --------------------------------------------------------------------------------------------------
# Device meshes of the groups (FSDP2 shards over a DeviceMesh: distributed/fsdp.py)
# --------------------------------------------------------------------------------------------------

_MESHES: dict = {}


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (an FSDP2 parameter or gradient). torch.distributed.tensor imports sympy (~1 s):
    it is imported where FSDP2 is applied, so that `--help` and a bad flag stay fast (tests/test_startup.py), and no
    DTensor exists before then."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def device_mesh(group):
    """A one-dimensional DeviceMesh over the ranks of `group` (built once per group, on this device type)."""
    from torch.distributed.device_mesh import DeviceMesh
    key = id(group)
    if key not in _MESHES or _MESHES[key][0] is not group:
        _MESHES[key] = (group, DeviceMesh.from_group(group, get_device().type))
    return _MESHES[key][1]


# --------------------------------------------------------------------------------------------------
# Naming ranks (error lines, the watchdog: megatron_po/rank_watchdog.py)
# --------------------------------------------------------------------------------------------------


def describe_rank(rank: int) -> str:
    """`rank 5 (pipeline stage 1, data-parallel rank 0, tensor-parallel rank 1)`."""
    if _STATE is None:
        return f"rank {rank}"
    tp, dp, pp = coords_of(rank, _STATE.tp, _STATE.dp, _STATE.cp)
    cp = f", context-parallel rank {context_parallel_rank_of(rank, _STATE.tp, _STATE.cp)}" if _STATE.cp > 1 else ""
    return f"rank {rank} (pipeline stage {pp}, data-parallel rank {dp}{cp}, tensor-parallel rank {tp})"


def peer_ranks() -> tuple:
    """The ranks this one shares a process group with (tensor, context, data and pipeline parallel), itself
    included: the peers whose heartbeats a failed receive or collective is read against."""
    st = _st()
    return tuple(sorted({*st.tp_ranks, *st.cp_ranks, *st.dp_ranks, *st.pp_ranks}))


def group_timeout() -> datetime.timedelta:
    """The timeout every process group was built with (--distributed-timeout-minutes)."""
    return _TIMEOUT
