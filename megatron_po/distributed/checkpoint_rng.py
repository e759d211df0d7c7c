"""Each rank's random generators (Python, NumPy, torch, CUDA and the tensor-parallel tracker), saved as
`rng.rank<r>` and restored only when the checkpoint was saved under the same parallel layout. The
tracker's streams are states of the compute device's generator: they are restored only into a run on
the same kind of device (a CPU run cannot use a CUDA generator's state, nor the reverse)."""

from __future__ import annotations

import torch


def rng_state() -> dict:
    import random

    import numpy as np

    from megatron_po.tensor_parallel import get_rng_tracker
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> bool:
    """Restore the generators; returns False when the tracker's streams were saved on another kind of
    device and were left as this run seeded them."""
    import random

    import numpy as np

    from megatron_po.tensor_parallel import get_rng_tracker
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tracker = get_rng_tracker()
    same_device = tracker.matches(state["tracker"])
    if same_device:
        tracker.set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return same_device
