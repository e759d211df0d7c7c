"""This data-parallel rank's micro-batches in Megatron's sample order, optionally prepared in the background
by DataLoader worker processes (--num-workers, --dataloader-type).

Training reads a stream of sample positions: the micro-batch that starts at position `start` (over all DP
ranks) gives DP rank d the positions [start + d*mbs, start + (d+1)*mbs), as Megatron's pretraining sampler
does; consecutive micro-batches start mbs*DP apart. Position p is dataset sample
- single: p mod len(dataset) (the dataset is built for every sample training asks for; the modulo only
  matters when it is not);
- cyclic: pass e = p // len(dataset) visits the samples in a random order seeded by (seed, e).
The order is a function of the position alone: the number of workers, a restart (resume, evaluation) and
the DP size (for a fixed global batch) do not change which samples a global batch holds.

With num_workers > 0 a torch DataLoader walks the stream ahead of training (prefetch_factor micro-batches
per worker, returned in order); asking for a position other than the next one restarts it there.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

DATALOADER_TYPES = ("single", "cyclic")


def sample_index(position: int, length: int, dataloader_type: str, seed: int, orders: dict | None = None) -> int:
    """Which dataset sample stream position `position` reads. `orders` caches cyclic passes' orders."""
    epoch, offset = divmod(position, length)
    if dataloader_type == "single":
        return offset
    orders = {} if orders is None else orders
    if epoch not in orders:
        if len(orders) >= 2:  # a micro-batch spans at most two passes
            orders.pop(next(iter(orders)))
        orders[epoch] = np.random.default_rng([seed, epoch]).permutation(length)
    return int(orders[epoch][offset])


class _MicroBatchIndices:
    """The batch sampler: this rank's index lists from `start` on, one per micro-batch, without end."""

    def __init__(self, loader: MicroBatchLoader, start: int):
        self.loader, self.start = loader, start

    def __iter__(self):
        for start in itertools.count(self.start, self.loader.stride):
            yield self.loader.indices(start)


class MicroBatchLoader:
    """Micro-batches (dicts of stacked CPU tensors) of `dataset` for DP rank `dp_rank` of `dp_size`."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0,
                 dataloader_type: str = "single", seed: int = 0):
        if dataloader_type not in DATALOADER_TYPES:
            raise ValueError(f"dataloader_type must be one of {DATALOADER_TYPES}, not {dataloader_type!r}")
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank = micro_batch_size, dp_rank
        self.stride = micro_batch_size * dp_size
        self.num_workers, self.dataloader_type, self.seed = num_workers, dataloader_type, seed
        self._iterator, self._next_start = None, None
        self._orders: dict = {}  # cyclic: pass -> sample order
        self.restarts = 0  # worker pools started (one per jump in the stream; tests check it stays small)

    def __len__(self) -> int:
        return len(self.dataset)

    def indices(self, start: int) -> list[int]:
        first = start + self.dp_rank * self.micro_batch_size
        return [sample_index(p, len(self.dataset), self.dataloader_type, self.seed, self._orders)
                for p in range(first, first + self.micro_batch_size)]

    def microbatch(self, start: int) -> dict[str, torch.Tensor]:
        """This rank's part of the micro-batch that starts at stream position `start`."""
        if self.num_workers == 0:
            return default_collate([self.dataset[i] for i in self.indices(start)])
        if self._iterator is None or start != self._next_start:
            self.restarts += 1
            self._iterator = iter(DataLoader(self.dataset, batch_sampler=_MicroBatchIndices(self, start),
                                             num_workers=self.num_workers, persistent_workers=False))
        self._next_start = start + self.stride
        return next(self._iterator)
