"""Random-number streams that know about tensor parallelism (Megatron's CudaRNGStatesTracker, any device).

Two streams matter in a tensor-parallel model:
  * the DEFAULT generator, identical on every rank of a TP group (and of a DP group). Everything that is
    replicated across TP ranks draws from it: weight initialization (each rank builds the full master
    weight and keeps its slice, see layers.py), dropout on replicated activations (after attention and
    MLP, on embeddings). Identical draws keep the replicas identical.
  * the `model-parallel-rng` stream held by the tracker, different on every TP rank. Randomness inside a
    TP-split region (dropout on attention probabilities of this rank's heads) must differ across ranks,
    otherwise head h on rank 0 and head h on rank 1 would share a mask that the TP=1 model would not.

        with get_rng_tracker().fork():
            attention_probs = F.dropout(attention_probs, p, training)

    (`on_model_parallel_rng(F.dropout, attention_probs, p, training)` in code that torch.compile traces.)

The tracker swaps generator states in and out of the default generator of the device that
`parallel_state.get_device()` names (the CPU generator on CPU, the current CUDA generator on GPU).

Seeds follow Megatron: default = seed + 100 * pp_rank (stages hold different layers, so they need
different streams), model-parallel = that + 2718 + tp_rank.
"""

from __future__ import annotations

import contextlib
import random as _py_random

import numpy as np
import torch
import torch.utils.checkpoint

from megatron_po.parallel_state import (
    get_device,
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
)
from megatron_po.tensor_parallel.graph_breaks import runs_eagerly

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


# The default generator of the device we compute on: the only place that tells CPU and CUDA apart.
def _get_rng_state() -> torch.Tensor:
    if get_device().type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if get_device().type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    # torch.cuda.manual_seed touches only the CUDA generator; on CPU the CPU generator is the default.
    if get_device().type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be swapped into the device's default generator.

    `fork(name)` installs the named state, runs the block, saves the advanced state back under the name
    and restores the default state, so the default stream is not consumed by forked draws."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the states, for checkpoints (state tensors are never mutated, only replaced)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def matches(self, states: dict[str, torch.Tensor]) -> bool:
        """Whether `states` can be installed here: the same streams, each a state of the generator this
        run's device uses (its dtype, device and size; a checkpoint saved on another kind of device holds
        another generator's states, e.g. CUDA's 16-byte Philox state instead of the CPU's Mersenne Twister)."""
        return set(states) == set(self.states_) and all(
            torch.is_tensor(states[k]) and (states[k].dtype, states[k].device, states[k].shape)
            == (v.dtype, v.device, v.shape) for k, v in self.states_.items())

    def add(self, name: str, seed: int) -> None:
        # Two streams from one seed would be identical: refuse, as Megatron does.
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        orig_state = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(orig_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added (call model_parallel_seed first)")
        orig_state = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(orig_state)


_RNG_STATE_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _RNG_STATE_TRACKER


# A compiled graph cannot swap generator states: a compiled layer (--torch-compile) runs this eagerly.
@runs_eagerly
def on_model_parallel_rng(function, *args, **kwargs):
    """`function(*args, **kwargs)` drawing from the model-parallel stream (`fork()`): dropout inside a
    TP-split region."""
    with _RNG_STATE_TRACKER.fork():
        return function(*args, **kwargs)


def model_parallel_seed(seed: int) -> None:
    """Seed every generator of this rank (Megatron's _set_random_seed + model_parallel_cuda_manual_seed).

    default generator (+ Python, NumPy): seed + 100 * pp_rank   same on all TP and DP ranks of a stage
    tracker 'model-parallel-rng':        that + 2718 + tp_rank   different on every TP rank
    """
    seed = seed + 100 * get_pipeline_model_parallel_rank()
    _py_random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA generator; weight init draws from the CPU one
    _RNG_STATE_TRACKER.reset()
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + get_tensor_model_parallel_rank())


# Who provides the weights a recomputation must see (the pipeline's weight policy, set per forward pass).
_recompute_weights = None


@contextlib.contextmanager
def recompute_weights(provider):
    """Install `provider` for the checkpointed regions whose FORWARD runs inside this block.

    `provider(params)` is called once per region, in its forward, with the region's parameters (which
    hold the weights that forward runs on); it returns None when the region's recomputation will see the
    same weights anyway, else a zero-argument context-manager factory that installs those weights around
    the recomputation. A pipeline whose weights change between a micro-batch's forward and its backward
    (asynchronous methods, see pipeline/policies.py) provides one; None (the default) keeps the weights
    that are live at the recomputation."""
    global _recompute_weights
    previous, _recompute_weights = _recompute_weights, provider
    try:
        yield
    finally:
        _recompute_weights = previous


def weights_kept_for_recompute(params: list[torch.Tensor]):
    """For a computation outside `checkpoint` that recomputes from `params` in its backward (the chunked output
    loss, output_cross_entropy.py), called in its forward: what `checkpoint` asks the installed provider, None
    or the factory of the context that puts the forward's weights in `params` for the recomputation."""
    return None if _recompute_weights is None else _recompute_weights(params)


_recomputing: list = []  # non-empty while a checkpointed region runs again in the backward


def is_recomputing() -> bool:
    """A checkpointed region is being recomputed: what its forward counted (e.g. the MoE router's tokens per
    expert) must not be counted again."""
    return bool(_recomputing)


# Its context_fn (the replays below) is not one torch.compile traces: a compiled layer (--torch-compile) runs a
# recomputed region eagerly, in the forward and in the recomputation alike (layers called inside it still run
# compiled: --recompute-granularity full checkpoints whole compiled layers).
@runs_eagerly
def checkpoint(function, *args, params=(), state=()):
    """Activation recomputation that replays BOTH random streams and the forward's weights.

    torch.utils.checkpoint restores the default generators for the recomputation, but the tracker's
    states live outside torch: without help, a forked dropout would draw a new mask when recomputed
    and the gradient would belong to a different mask than the forward. We snapshot the tracker at
    forward time, install the snapshot for the recomputation and put the current states back after.
    `params`: the parameters `function` reads; the weights the forward ran on are re-installed for
    the recomputation when a `recompute_weights` provider says they will have changed by then.
    `state`: small tensors other than parameters that `function` reads and that may change between the
    forward and the backward (the MoE routers' expert bias, which an asynchronous stage moves at every
    step): their forward values are kept and put in place, always, for the recomputation."""
    tracker = get_rng_tracker()
    snapshot: dict[str, torch.Tensor] = {}
    provider = _recompute_weights
    installed = []  # the region's context-manager factory from the provider, set in the forward
    kept_state: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward_context():
        snapshot.update(tracker.get_states())
        if provider is not None and params:
            installed.append(provider(params))
        kept_state.extend(t.detach().clone() for t in state)
        yield

    @contextlib.contextmanager
    def recompute_context():
        current = tracker.get_states()
        tracker.set_states(snapshot)
        weights = installed[0] if installed and installed[0] is not None else contextlib.nullcontext
        _recomputing.append(True)
        _swap_state(state, kept_state)
        try:
            with weights():
                yield
        finally:
            _swap_state(state, kept_state)
            _recomputing.pop()
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (forward_context(), recompute_context()))


@torch.no_grad()
def _swap_state(state, kept) -> None:
    """Exchange the values of `state` and `kept` in place (the same call swaps back)."""
    for t, k in zip(state, kept):
        scratch = t.detach().clone()
        t.detach().copy_(k)
        k.copy_(scratch)
