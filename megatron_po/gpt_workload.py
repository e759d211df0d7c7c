"""The GPT workload: what the training loop needs to know about the model and data it trains (the model
chunks of this rank, the datasets, micro-batches in Megatron's sample order, pipeline message shapes,
FLOPs). `nmt_workload.NMTWorkload` is the encoder-decoder counterpart with the same methods.

Data order follows Megatron's pretraining sampler: global batch `g` holds samples `[g*G, (g+1)*G)`;
micro-batch `m` of DP rank `d` holds `mbs` samples starting at `g*G + m*mbs*DP + d*mbs`.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, global_batch_size
from megatron_po.data.context_split import split_for_this_rank
from megatron_po.data.document_masks import add_document_inputs
from megatron_po.flops import gpt_flops_per_token
from megatron_po.optim.sample_schedule import SampleSchedule
from megatron_po.tensor_parallel import pad_vocab_size


def build_model_chunks(cfg: Config, padded_vocab: int) -> list:
    """This rank's model chunks (one without pipeline parallelism: the whole model)."""
    from megatron_po.pipeline.partition import build_pipeline_chunks
    return build_pipeline_chunks(cfg, padded_vocab)


def model_vocab_size(cfg: Config, tokenizer_vocab_size: int) -> int:
    """Rows of the model's word embedding and output layer: --padded-vocab-size (start-up checked it holds the
    tokenizer's vocabulary and divides by TP), else the tokenizer's vocabulary padded to a multiple of
    --make-vocab-size-divisible-by x TP."""
    m = cfg.model
    if m.padded_vocab_size is not None:
        return m.padded_vocab_size
    return pad_vocab_size(tokenizer_vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)


def build_data(cfg: Config, tokenizer_vocab_size: int):
    from megatron_po.data.gpt_dataset import build_gpt_datasets
    t = cfg.training
    world = dist.get_world_size()
    gbs = global_batch_size(cfg, world)
    # Validation restarts from its first sample at every evaluation, so numbers compare across evals.
    num_samples = (SampleSchedule(cfg, world).total_samples, t.eval_iters * gbs, t.eval_iters * gbs)
    train, valid, test = build_gpt_datasets(
        cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed, num_samples,
        cache_dir=cfg.data.data_cache_path, mock=cfg.data.mock_data, vocab_size=tokenizer_vocab_size,
        mmap_bin_files=cfg.data.mmap_bin_files)
    from megatron_po.data.data_loader import MicroBatchLoader
    return tuple(None if ds is None else MicroBatchLoader(
        ds, t.micro_batch_size, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
        cfg.data.num_workers, cfg.data.dataloader_type, t.seed) for ds in (train, valid, test))


def microbatches(dataset, consumed_samples: int, num_mb: int, mbs: int):
    """This DP rank's micro-batches of the global batch that starts at `consumed_samples` (`dataset`: a
    data_loader.MicroBatchLoader, or a plain dataset read in order)."""
    from megatron_po.data.data_loader import MicroBatchLoader
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    loader = dataset if isinstance(dataset, MicroBatchLoader) else MicroBatchLoader(dataset, mbs, d, dp)
    device = ps.get_device()
    return [{k: v.to(device) for k, v in loader.microbatch(consumed_samples + m * mbs * dp).items()}
            for m in range(num_mb)]


def reading_documents(cfg: Config, chunks: list) -> list:
    """--reset-position-ids / --reset-attention-mask: every stage needs the micro-batch's document positions
    (RoPE, the mask), so the executor hands each chunk the batch (`reads_batch`, as for NMT)."""
    if cfg.data.reset_position_ids or cfg.data.reset_attention_mask:
        for c in chunks:
            c.reads_batch = True
    return chunks


class GPTWorkload:
    """What the loop needs to know about the model and data it trains; `pretrain` talks to GPT through
    this, and to the encoder-decoder translation model through `nmt_workload.NMTWorkload` (same methods).
    Built before the process groups (`name` picks the config rules); `setup()` runs after them."""

    name = "gpt"
    eval_in_stream = True  # asynchronous pipelines evaluate between training ops (no evaluate_extra to run)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        """Tokenizer and padded vocabulary (TP-dependent padding)."""
        from megatron_po.data.tokenizer import build_tokenizer_from
        self.tokenizer = build_tokenizer_from(self.cfg.data)
        self.padded_vocab = model_vocab_size(self.cfg, self.tokenizer.vocab_size)

    def model_chunks(self) -> list:
        return reading_documents(self.cfg, build_model_chunks(self.cfg, self.padded_vocab))

    @staticmethod
    def chunks_for_rank(cfg: Config, padded_vocab, rank: int, num_stages: int, num_chunks: int, device=None):
        """Any pipeline rank's chunks (the asynchronous engine builds its own)."""
        from megatron_po.pipeline.partition import build_chunks_for_rank
        return reading_documents(cfg, build_chunks_for_rank(cfg, padded_vocab, rank, num_stages, num_chunks, device))

    def data(self):
        """(train, valid, test); real data is checked against the tokenizer's vocabulary."""
        return build_data(self.cfg, self.tokenizer.vocab_size)

    def microbatches(self, dataset, consumed_samples: int, num_mb: int, mbs: int) -> list[dict]:
        batches = microbatches(dataset, consumed_samples, num_mb, mbs)
        d = self.cfg.data
        for b in batches:
            if d.eod_mask_loss:  # Megatron: no loss where the input token is EOD
                b["loss_mask"] = b["loss_mask"].masked_fill(b["tokens"] == self.tokenizer.eod, 0.0)
            add_document_inputs(b, self.tokenizer.eod, d.reset_position_ids, d.reset_attention_mask)
        return [split_for_this_rank(b) for b in batches]  # context parallelism: this CP rank's chunks

    def message_specs(self, micro_batch_size: int):
        """Shapes both ends of a pipeline message agree on (None: sent in a header)."""
        from megatron_po.pipeline.partition import gpt_message_specs
        return gpt_message_specs(self.cfg, micro_batch_size)

    def eval_iters(self, valid) -> int:
        """Global batches of validation data per evaluation."""
        return self.cfg.training.eval_iters

    def tokens_per_iteration(self, gbs: int) -> float:
        return gbs * self.cfg.model.seq_length

    def flops_per_iteration(self, gbs: int) -> float:
        return gpt_flops_per_token(self.cfg, self.padded_vocab) * gbs * self.cfg.model.seq_length

    def evaluate_extra(self, chunks, iteration: int) -> dict:
        """Metrics beyond the validation loss, on the logging rank ({} elsewhere)."""
        return {}

    def checkpoint_extra(self) -> dict:
        return {"vocab_size": self.tokenizer.vocab_size, "padded_vocab_size": self.padded_vocab}
