"""Loading never moves state to the wrong place (issue 29): a load writes INTO the state tensors a fresh
run holds (same objects, devices, dtypes) and creates lazily made state exactly as a step would.

The bug it guards against: resuming on a GPU failed in the first step (`scalar tensor is expected to be on
cuda:0 but is on cpu`) because the checkpoint loader allocated optimizer step counts on the parameter's
device while the optimizers keep them on the CPU. CI has no GPU, so the same class of bug is made visible
on the CPU with parameters on the `meta` device: the loader must put step counts on the CPU and
per-element state on the parameters' device, as a step does, and a step must run after the load.

Every state tensor is recorded as (id, device, dtype, shape) before a load and compared after it:
- the ten predictive optimizers, through a torch.distributed.checkpoint (DCP) save/load and through
  their in-memory `load_state_dict`; state a fresh (never stepped) optimizer lacks is created by the
  optimizer's own `init_state` (keys, devices, dtypes and shapes equal to a stepped optimizer's);
- the bf16/fp16 fp32 main params (MixedPrecisionOptimizer), the distributed optimizer's main shards,
  the fp16 grad scaler;
- the asynchronous weight policies' versions: 2BW's older version, error-feedback buffers, PipeNAG (NAG's
  momentum buffer; its look-ahead points are recomputed), Muon's momentum and muon_update under PipeOptim;
- the tensor-parallel RNG tracker: states of another device's generator are not installed;
- MoE at EP = 2 (two ranks): the experts' blocks of the global tensors (weights, main params, distributed-optimizer
  pieces, optimizer state) and the routers' expert bias, a buffer.
Single process (one forked gloo rank per case; two for MoE), a 2-layer GPT of hidden size 32.
"""

import copy
import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (model init imports it lazily: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)
from dist_harness import run_distributed
from test_async_policies import VOCAB, get_batch, make_cfg

from megatron_po.optim import build_optimizer
from megatron_po.optim.build import OPTIMIZER_NAMES
from megatron_po.optim.muon import optimizer_param_groups

LR = 1e-2


# --------------------------------------------------------------------------------------------------
# Records of state tensors
# --------------------------------------------------------------------------------------------------


def describe(t: torch.Tensor) -> tuple:
    return t.device.type, t.dtype, tuple(t.shape)


def identities(tensors: dict) -> dict:
    """{key: (id, device, dtype, shape)} of the tensors (non-tensor values: their type)."""
    return {k: (id(v), *describe(v)) if torch.is_tensor(v) else type(v) for k, v in tensors.items()}


def layouts(tensors: dict) -> dict:
    return {k: describe(v) if torch.is_tensor(v) else type(v) for k, v in tensors.items()}


def optimizer_state(optimizer, names) -> dict:
    """{(parameter name, key): state value} of every stepped tensor, plus the stepped tensors themselves
    (the parameter, or the wrapper's fp32 main param / distributed-optimizer piece) as key "weights"."""
    from megatron_po.distributed.checkpoint_state import stepped_params
    stepped = stepped_params(optimizer)
    out = {}
    for name, p in names:
        s = stepped.get(id(p))
        if s is None or s.tensor is None:
            continue
        out[(name, "weights")] = s.tensor
        for key, value in s.inner.state.get(s.tensor, {}).items():
            out[(name, key)] = value
    return out


def assert_same_values(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if torch.is_tensor(want[k]):
            assert torch.equal(got[k].cpu(), want[k].cpu().to(got[k].dtype)), k
        else:
            assert got[k] == want[k], k


def groups_for(name: str, chunks) -> list[dict]:
    return optimizer_param_groups(name, chunks, 0.01)


# --------------------------------------------------------------------------------------------------
# The optimizers themselves: init_state = a first step's state; in-memory load_state_dict in place
# --------------------------------------------------------------------------------------------------


def meta_params():
    return [torch.nn.Parameter(torch.empty(6, 4, device="meta")), torch.nn.Parameter(torch.empty(4, device="meta"))]


def two_groups(name, params):
    if name == "muon":
        return [{"params": [params[0]], "use_muon": True}, {"params": [params[1]], "use_muon": False}]
    return [{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}]


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_init_state_is_what_a_first_step_creates_on_the_parameters_device(name):
    stepped_params, fresh_params = meta_params(), meta_params()
    stepped = build_optimizer(name, two_groups(name, stepped_params), lr=LR, weight_decay=0.01)
    fresh = build_optimizer(name, two_groups(name, fresh_params), lr=LR, weight_decay=0.01)
    for p in stepped_params:
        p.grad = torch.empty_like(p)
    stepped.step()
    for group, p in zip(fresh.param_groups, fresh_params):
        fresh.init_state(group, p, fresh.state[p])
    for a, b in zip(stepped_params, fresh_params):
        assert layouts(fresh.state[b]) == layouts(stepped.state[a])
        for key, value in fresh.state[b].items():  # per element on the parameter's device, counts on the CPU
            assert value.device.type == ("meta" if value.shape == b.shape else "cpu"), key


def cpu_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def run_steps(opt, params, seed, n):
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_load_state_dict_copies_into_the_state_held(name):
    source_params = cpu_params(0)
    source = build_optimizer(name, two_groups(name, source_params), lr=LR, weight_decay=0.01)
    run_steps(source, source_params, 0, 3)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)

    # A run that has stepped (with other gradients): its tensors are loaded into, none replaced.
    target_params = [p.detach().clone().requires_grad_() for p in source_params]
    target = build_optimizer(name, two_groups(name, target_params), lr=LR, weight_decay=0.01)
    run_steps(target, target_params, 7, 1)
    before = [identities(target.state[p]) for p in target_params]
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer))
    assert [identities(target.state[p]) for p in target_params] == before
    for a, b in zip(source_params, target_params):
        assert_same_values(target.state[b], source.state[a])

    # A fresh run: the loaded state is laid out as its own first step would lay it out.
    fresh_params = [p.detach().clone().requires_grad_() for p in source_params]
    fresh = build_optimizer(name, two_groups(name, fresh_params), lr=LR, weight_decay=0.01)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    for a, b in zip(source_params, fresh_params):
        assert layouts(fresh.state[b]) == layouts(source.state[a])
        assert_same_values(fresh.state[b], source.state[a])
    run_steps(source, source_params, 3, 2)  # and both continue alike
    run_steps(fresh, fresh_params, 3, 2)
    for a, b in zip(source_params, fresh_params):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# Through a checkpoint (DCP): plain optimizers, mixed precision, the distributed optimizer
# --------------------------------------------------------------------------------------------------


# A mixture of experts with DeepSeek-V3's expert bias (a checkpointed buffer), run at EP = 2 over 2 ranks: each
# rank's experts are a block of the global tensors (checkpoint_dcp.expert_block), loaded through views of them.
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16, "moe_router_score_function": "sigmoid",
       "moe_router_enable_expert_bias": True}


def build_run(name: str, precision: str = "fp32", device=None, seed: int = 5, moe: bool = False):
    """(chunks, ddp, optimizer) of a tiny GPT as training_setup builds them; `precision`: fp32, bf16,
    fp16 (dynamic loss scale) or distopt (bf16 + the distributed optimizer); `moe`: its MLPs mixtures of experts
    split over all ranks (EP = the data-parallel size)."""
    import dataclasses

    from megatron_po import parallel_state as ps
    from megatron_po.distributed.ddp import DistributedDataParallel
    from megatron_po.optim.mixed_precision import grad_buffer_dtype, model_dtype
    from megatron_po.pipeline.partition import build_chunks_for_rank
    from megatron_po.tensor_parallel import model_parallel_seed
    from megatron_po.training_setup import build_optimizer_for
    cfg = make_cfg(2)
    if moe:
        cfg.model = dataclasses.replace(cfg.model, **MOE)
        ps.initialize_expert_parallel(ps.get_data_parallel_world_size())
    cfg.training.optimizer, cfg.training.lr, cfg.training.seed = name, LR, seed
    pr = cfg.precision
    pr.bf16, pr.fp16 = precision in ("bf16", "distopt"), precision == "fp16"
    pr.use_distributed_optimizer = precision == "distopt"
    model_parallel_seed(seed)
    chunks = [c.to(model_dtype(pr.bf16, pr.fp16)) for c in build_chunks_for_rank(cfg, VOCAB, 0, 1, 1)]
    if device is not None:
        chunks = [c.to(device) for c in chunks]
        return chunks, None, build_optimizer(name, groups_for(name, chunks), lr=LR, weight_decay=0.01)
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), 2000,
                                  grad_dtype=grad_buffer_dtype(pr.bf16, pr.fp16),
                                  use_distributed_optimizer=pr.use_distributed_optimizer)
    return chunks, ddp, build_optimizer_for(cfg, chunks, ddp)


def train(ddp, optimizer, seed: int, steps: int) -> None:
    """`steps` optimizer steps on random gradients (the DDP buffer holds every parameter's gradient)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ddp.grad_buffer.copy_(torch.randn(ddp.grad_buffer.shape, generator=g))
        result = optimizer.step()
        assert not getattr(result, "skipped", False)
        ddp.zero_grad()


def _checkpoint_round_trip(name: str, precision: str, root: str, moe: bool = False) -> None:
    from megatron_po.distributed.checkpoint_format import named_buffers_global, named_parameters_for_load
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    chunks, ddp, source = build_run(name, precision, moe=moe)
    train(ddp, source, 1, 3)
    for i, (_, b) in enumerate(named_buffers_global(chunks)):  # an expert bias that has moved
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(i)))
    save_checkpoint(root, 3, chunks, source, {"train_state": {}})
    want = optimizer_state(source, named_parameters_for_load(chunks))
    want_buffers = {k: v.clone() for k, v in named_buffers_global(chunks)}
    assert bool(want_buffers) == moe

    # Into a run that has stepped: every tensor keeps its object, device and dtype.
    chunks_b, ddp_b, target = build_run(name, precision, seed=6, moe=moe)
    train(ddp_b, target, 2, 1)
    names_b = named_parameters_for_load(chunks_b)
    held = optimizer_state(target, names_b)
    before = identities(held)
    params_before = identities(dict(names_b))
    buffers_before = identities(dict(named_buffers_global(chunks_b)))
    scaler = getattr(target, "grad_scaler", None)
    load_checkpoint(root, chunks_b, target)
    got = optimizer_state(target, names_b)
    assert identities(got) == before
    assert identities(dict(names_b)) == params_before
    assert identities(dict(named_buffers_global(chunks_b))) == buffers_before
    assert_same_values(got, want)
    assert_same_values(dict(named_buffers_global(chunks_b)), want_buffers)
    if scaler is not None:  # fp16: the loss scaler too, the same object with the saved scale
        assert target.grad_scaler is scaler and scaler.state_dict() == source.grad_scaler.state_dict()

    # Into a fresh run: the state its first step would create, with the saved values.
    chunks_c, ddp_c, fresh = build_run(name, precision, seed=7, moe=moe)
    names_c = named_parameters_for_load(chunks_c)
    weights_before = identities({k: v for k, v in optimizer_state(fresh, names_c).items() if k[1] == "weights"})
    load_checkpoint(root, chunks_c, fresh)
    got = optimizer_state(fresh, names_c)
    assert layouts(got) == layouts(want)
    assert identities({k: v for k, v in got.items() if k[1] == "weights"}) == weights_before
    assert_same_values(got, want)
    train(ddp, source, 3, 1)  # and the resumed run steps on exactly like the saved one
    train(ddp_c, fresh, 3, 1)
    for (_, p), (_, q) in zip(named_parameters_for_load(chunks), names_c):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_checkpoint_load_writes_into_every_optimizers_state(name, tmp_path):
    run_distributed(_checkpoint_round_trip, 1, args=(name, "fp32", str(tmp_path / "ck")))


@pytest.mark.parametrize("precision", ["bf16", "fp16", "distopt"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_checkpoint_load_writes_into_main_params_and_the_loss_scaler(name, precision, tmp_path):
    run_distributed(_checkpoint_round_trip, 1, args=(name, precision, str(tmp_path / "ck")))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "distopt"])
def test_checkpoint_load_writes_into_expert_blocks_and_the_expert_bias(precision, tmp_path):
    """MoE at EP = 2: the experts' weights, main params and optimizer state (blocks of the global tensors) and
    the routers' expert bias (a buffer) are loaded into the tensors the run holds."""
    run_distributed(_checkpoint_round_trip, 2, args=("adamw", precision, str(tmp_path / "ck"), True))


def _load_onto_meta(name: str, root: str) -> str | None:
    """Save a CPU run; load it into a fresh run whose parameters are on the meta device (DCP cannot
    read into meta tensors: only their allocation runs); compare with what a step on meta creates, then
    step. Returns None, or what went wrong."""
    from megatron_po.distributed import checkpoint_load
    from megatron_po.distributed.checkpoint_format import named_parameters_for_load
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    chunks, ddp, source = build_run(name)
    train(ddp, source, 1, 2)
    save_checkpoint(root, 2, chunks, source, {"train_state": {}})

    def meta_grads(chunks):
        for c in chunks:
            for p in c.parameters():
                p.grad = torch.empty_like(p)

    reference_chunks, _, reference = build_run(name, device="meta")
    meta_grads(reference_chunks)
    reference.step()
    want = layouts(optimizer_state(reference, named_parameters_for_load(reference_chunks)))

    meta_chunks, _, fresh = build_run(name, device="meta")
    real_load = checkpoint_load.dcp_load
    # The small data entries are read; the tensors (meta) are left as allocated.
    checkpoint_load.dcp_load = lambda state, path, md=None: (real_load(state, path, md)
                                                             if all(isinstance(v, bytes) for v in state.values()) else None)
    try:
        checkpoint_load.load_checkpoint(root, meta_chunks, fresh, verify=False)
    finally:
        checkpoint_load.dcp_load = real_load
    got = layouts(optimizer_state(fresh, named_parameters_for_load(meta_chunks)))
    if set(got) != set(want):
        return f"loaded state entries {sorted(set(got) ^ set(want))} differ from a step's"
    wrong = {key: (v, want[(name, key)]) for (name, key), v in got.items() if want[(name, key)] != v}
    if wrong:
        return f"loaded state (device, dtype, shape) differs from a step's: {wrong} (loaded, a step's)"
    meta_grads(meta_chunks)
    try:
        fresh.step()
    except RuntimeError as e:
        return f"the step after the load failed: {e}"
    return None


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_loaded_state_lands_where_a_step_puts_it_for_parameters_on_another_device(name, tmp_path):
    """The GPU resume failure, on a CPU: step counts on the CPU, the rest on the parameters' device."""
    [problem] = run_distributed(_load_onto_meta, 1, args=(name, str(tmp_path / "ck")))
    assert problem is None, problem


# --------------------------------------------------------------------------------------------------
# Asynchronous weight policies and their optimizers (one pipeline rank, D = 1)
# --------------------------------------------------------------------------------------------------


def build_rank(method: str, optimizer: str, options: dict, seed: int = 5):
    from megatron_po.pipeline.async_pipeline import AsyncPipelineRank
    from megatron_po.tensor_parallel import model_parallel_seed
    model_parallel_seed(seed)
    cfg = make_cfg(2)
    cfg.training.seed = seed
    return AsyncPipelineRank(cfg, VOCAB, method, 1, 1, optimizer, {"lr": LR, "weight_decay": 0.01,
                                                                   "sgd_momentum": 0.9}, None, 0.0, **options)


def policy_tensors(rank) -> dict:
    """{(param index, key): tensor} of the weight versions the rank's policy holds."""
    policy = rank.stage.policy
    index = {p: i for i, p in enumerate(policy.params[0])}
    return {(index[p], k): t for p, versions in policy.state_dict()["weights"].items() for k, t in versions.items()}


def rank_state(rank) -> dict:
    from megatron_po.distributed.checkpoint_format import named_parameters_for_load
    state = optimizer_state(rank.stage.optimizers, named_parameters_for_load(rank.chunks))
    state.update({("policy",) + k: t for k, t in policy_tensors(rank).items()})
    return state


def _policy_round_trip(method: str, optimizer: str, options: dict, keys: set, root: str) -> None:
    from megatron_po.distributed.checkpoint_load import load_checkpoint
    from megatron_po.distributed.checkpoint_save import save_checkpoint
    source = build_rank(method, optimizer, options)
    source.train_segment(lambda mb: get_batch(mb), 4)
    source.train_segment(lambda mb: get_batch(mb), 4)
    save_checkpoint(root, 2, source.chunks, source.stage.optimizers, {"train_state": {}}, policy=source.stage.policy)
    want = rank_state(source)
    assert keys <= {k[-1] for k in want}  # the versions and optimizer state the case is about

    target = build_rank(method, optimizer, options, seed=6)  # has stepped: its versions exist
    target.train_segment(lambda mb: get_batch(mb, salt=3), 4)
    before = identities(rank_state(target))
    load_checkpoint(root, target.chunks, target.stage.optimizers, policy=target.stage.policy)
    assert identities(rank_state(target)) == before
    assert_same_values(rank_state(target), want)
    assert target.stage.policy.steps == source.stage.policy.steps

    # In memory (a state dict keyed by this run's parameters): the policy copies into what it holds too.
    saved = source.stage.policy.state_dict()
    mine = dict(zip(source.stage.policy.params[0], target.stage.policy.params[0]))
    target.stage.policy.load_state_dict({"steps": saved["steps"], "weights": {
        mine[p]: {k: t.clone() for k, t in versions.items()} for p, versions in saved["weights"].items()}})
    assert identities(rank_state(target)) == before
    assert_same_values(rank_state(target), want)

    fresh = build_rank(method, optimizer, options, seed=7)  # has not stepped: the load creates the versions
    load_checkpoint(root, fresh.chunks, fresh.stage.optimizers, policy=fresh.stage.policy)
    got = rank_state(fresh)
    assert layouts(got) == layouts(want)
    assert_same_values(got, want)
    fresh.restore_progress(8)
    source.train_segment(lambda mb: get_batch(mb), 4)
    fresh.train_segment(lambda mb: get_batch(mb), 4)
    for a, b in zip(source.full_state_dict().values(), fresh.full_state_dict().values()):
        assert torch.equal(a, b)


POLICY_CASES = {  # method, optimizer, options, state entries that must be there
    "2bw+error-feedback": ("pipedream-2bw", "adam", {"error_feedback": True}, {"older", "ef_update", "exp_avg"}),
    "pipenag": ("pipenag", "nag", {}, {"momentum_buffer"}),  # its look-ahead points are recomputed
    "pipeoptim+muon": ("pipeoptim", "muon", {}, {"momentum_buffer", "muon_update", "step"}),
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_checkpoint_load_writes_into_the_policys_weight_versions(case, tmp_path):
    run_distributed(_policy_round_trip, 1, args=(*POLICY_CASES[case], str(tmp_path / "ck")))


# --------------------------------------------------------------------------------------------------
# Random generators
# --------------------------------------------------------------------------------------------------


def _rng_states() -> None:
    from megatron_po.distributed.checkpoint_rng import rng_state, set_rng_state
    from megatron_po.tensor_parallel import get_rng_tracker, model_parallel_seed
    model_parallel_seed(5)
    tracker = get_rng_tracker()
    saved = rng_state()
    with tracker.fork():
        torch.rand(3)
    restored = set_rng_state(copy.deepcopy(saved))
    assert layouts(tracker.get_states()) == layouts(saved["tracker"])  # CPU bytes of the CPU generator
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in saved["tracker"].items())

    # Saved on a GPU: the tracker held CUDA generator states (16 bytes each); a CPU run keeps its own.
    model_parallel_seed(5)
    seeded = identities(tracker.get_states())
    other_device = copy.deepcopy(saved)
    other_device["tracker"] = {k: torch.zeros(16, dtype=torch.uint8) for k in saved["tracker"]}
    restored_other = set_rng_state(other_device)
    assert identities(tracker.get_states()) == seeded
    with tracker.fork():
        torch.rand(3)  # still a usable CPU generator state
    assert restored is True and restored_other is False  # which the loader reports


def test_rng_tracker_takes_only_its_own_devices_generator_states():
    run_distributed(_rng_states, 1)


def test_helpers_compare_what_they_should():
    """The records above can fail: a replaced tensor or one on another device changes them."""
    t = torch.zeros(3)
    assert identities({"a": t}) != identities({"a": t.clone()})
    assert layouts({"a": t}) != layouts({"a": t.to(torch.int8)})
    assert layouts({"a": t}) != layouts({"a": torch.zeros(3, device="meta")})
