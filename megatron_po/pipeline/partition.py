"""Split the GPT layers over D pipeline ranks x v model chunks.

Virtual stage `vs = c*D + r` (rank r, chunk c, Megatron's numbering; ZB-V's "v" placement:
`schedules.virtual_stage`) holds the next `counts[vs]` contiguous layers, where `counts` is
layer_split.py's `pipeline_split` of the config (an even split `L / (D*v)`, or Megatron's uneven rules:
--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split,
--pipeline-model-parallel-layout); virtual stage 0 also holds the embedding and the last one
the final norm, output layer and loss, and the multi-token prediction depths (--mtp-num-layers, Megatron's
placement: beside its layers, models/mtp.py). Every builder of a rank's chunks ends in `placed` (device,
--torch-compile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_po import parallel_state as ps
from megatron_po.config import Config, is_async, virtual_pipeline_size
from megatron_po.layer_split import layers_per_virtual_stage, pipeline_split
from megatron_po.models.compiled_layers import compile_layers
from megatron_po.models.gpt import GPTModel
from megatron_po.pipeline.schedules import placement_of, virtual_stage
from megatron_po.pipeline.zero_bubble import ZB_SCHEDULES


def chunk_placements(counts: list[int], rank: int, num_stages: int, num_chunks: int,
                     placement: str = "interleaved") -> list[dict]:
    """Per model chunk of pipeline rank `rank`: its pre_process, post_process, layer_offset, num_layers, from
    `counts` (the layers of each virtual stage, layer_split.py). `placement` "v" (ZB-V): chunk 0 is virtual
    stage `rank`, chunk 1 is 2D-1-rank (schedules.virtual_stage)."""
    last = num_stages * num_chunks - 1
    offsets = [sum(counts[:vs]) for vs in range(last + 1)]
    vss = [virtual_stage(rank, c, num_stages, placement) for c in range(num_chunks)]
    return [dict(pre_process=vs == 0, post_process=vs == last, layer_offset=offsets[vs], num_layers=counts[vs])
            for vs in vss]


def placed(cfg: Config, chunks: list, device=None) -> list:
    """A rank's chunks, built with their parallel layout, moved to `device` and, with --torch-compile, every
    transformer layer compiled: the one place that compiles (models/compiled_layers.py)."""
    chunks = [chunk.to(device) if device is not None else chunk for chunk in chunks]
    if cfg.model.torch_compile:
        compile_layers(chunks, split_backward=cfg.parallel.pipeline_method in ZB_SCHEDULES)
    return chunks


def build_chunks_for_rank(cfg: Config, padded_vocab: int, rank: int, num_stages: int, num_chunks: int,
                          device=None) -> list[GPTModel]:
    """The v model chunks of pipeline rank `rank` (pure in the rank: the emulator builds every rank)."""
    chunks = []
    where = placement_of(cfg.parallel.pipeline_method)
    for placement in chunk_placements(pipeline_split(cfg, num_stages, num_chunks), rank, num_stages, num_chunks, where):
        # asynchronous stages sum no gradient across stages: an MTP block apart from the embedding owns its copy
        chunks.append(GPTModel(cfg.model, padded_vocab, cfg.training.seed,
                               sequence_parallel=cfg.parallel.sequence_parallel,
                               share_mtp_embedding=not is_async(cfg), **placement))
    return placed(cfg, chunks, device)


def build_nmt_chunks_for_rank(cfg: Config, padded_vocab: tuple[int, int], rank: int, num_stages: int,
                              num_chunks: int, device=None) -> list:
    """The same for the encoder-decoder model: the stacked Le + Ld layers split evenly (models/nmt.py; the uneven
    split flags are GPT's: config_rules refuses them here); `padded_vocab` = (source, target) padded vocabulary
    sizes."""
    from megatron_po.models.nmt import NMTModel
    chunks = []
    where = placement_of(cfg.parallel.pipeline_method)
    even = layers_per_virtual_stage(cfg.model.num_layers, num_stages, num_chunks)
    for placement in chunk_placements(even, rank, num_stages, num_chunks, where):
        chunks.append(NMTModel(cfg.model, cfg.nmt, *padded_vocab, cfg.training.seed, **placement))
    return placed(cfg, chunks, device)


def build_pipeline_chunks(cfg: Config, padded_vocab: int) -> list[GPTModel]:
    return build_chunks_for_rank(cfg, padded_vocab, ps.get_pipeline_model_parallel_rank(),
                                 ps.get_pipeline_model_parallel_world_size(), virtual_pipeline_size(cfg),
                                 ps.get_device())


@dataclass(frozen=True)
class ActivationSpecs:
    """What every message between GPT stages looks like: one [s, b, h] tensor (s split over TP ranks
    under sequence parallelism), activations and their gradients alike. Both ends know it, so the
    transport sends no shape header and can post receives early. Hashable: transports are cached."""

    shape: tuple
    dtype: torch.dtype = torch.float32

    def __call__(self, key) -> list:
        return [(self.shape, self.dtype)]


def gpt_message_specs(cfg: Config, micro_batch_size: int) -> ActivationSpecs:
    seq = cfg.model.seq_length // cfg.parallel.context_parallel_size  # this CP rank's 2 chunks
    if cfg.parallel.sequence_parallel:
        seq //= cfg.parallel.tensor_model_parallel_size
    dtype = torch.bfloat16 if cfg.precision.bf16 else torch.float16 if cfg.precision.fp16 else torch.float32
    return ActivationSpecs((seq, micro_batch_size, cfg.model.hidden_size), dtype)
