"""Machine translation as a workload of the training loop (pretrain_nmt.py): the encoder-decoder model,
parallel-corpus micro-batches and validation BLEU, behind the interface of `gpt_workload.GPTWorkload`.

Data: `--data-path PREFIX` from tools/preprocess_nmt.py, read as `PREFIX_<split>_<src-lang|tgt-lang>`
(data/nmt_dataset.py). Micro-batches are length buckets of at most --micro-batch-size sentences and, with
--max-tokens, that many padded tokens; they are addressed like GPT samples (micro-batch m of DP rank d in
the iteration starting at `consumed_samples` is bucket consumed_samples / mbs + m * DP + d), so an
iteration takes M x DP buckets, `consumed_samples` counts sentence slots of --global-batch-size, and the
data order is the same under every layout. The per-micro-batch loss is the mean over its target tokens.

Pipeline messages vary in shape (batch and sentence lengths change per bucket), so the transport sends
their shapes in a header instead of agreeing on them up front.

Evaluation: the validation loss covers the whole validation split (every bucket once per evaluation,
the last group wrapping around; at most --eval-iters groups of M x DP buckets); then the validation sources are greedily decoded through
the pipeline (pipeline/decode.py; DP replicas decode different buckets) and scored with sacrebleu's
corpus BLEU against the references, the detokenised target ids (the normalised reference text).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ffn_hidden_size, normalize_nmt, num_microbatches, virtual_pipeline_size
from megatron_po.data.nmt_dataset import PairBatches, ParallelCorpus, load_tokenizer
from megatron_po.pipeline.partition import build_nmt_chunks_for_rank
from megatron_po.tensor_parallel import pad_vocab_size


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict:
    """sacrebleu's corpus BLEU and chrF (default settings: 13a tokenisation, chrF2)."""
    import sacrebleu
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score}


class NMTWorkload:
    """pretrain_nmt.py's workload (see the module docstring)."""

    name = "nmt"
    chunks_for_rank = staticmethod(build_nmt_chunks_for_rank)

    def __init__(self, cfg: Config):
        self.cfg = normalize_nmt(cfg)
        self.valid = None

    def setup(self) -> None:
        d, n, m = self.cfg.data, self.cfg.nmt, self.cfg.model
        self.src_tokenizer = load_tokenizer(d.tokenizer_model)
        self.tgt_tokenizer = load_tokenizer(n.tgt_tokenizer_model) if n.tgt_tokenizer_model else self.src_tokenizer
        tp = self.cfg.parallel.tensor_model_parallel_size
        self.padded_vocab = tuple(pad_vocab_size(t.vocab_size, m.make_vocab_size_divisible_by, tp)
                                  for t in (self.src_tokenizer, self.tgt_tokenizer))
        # Open (and check) the corpus now: a missing or mismatched file fails before the model is built.
        self.corpora = {split: ParallelCorpus(d.data_path[0], split, n.src_lang, n.tgt_lang,
                                              self.src_tokenizer.vocab_size, self.tgt_tokenizer.vocab_size,
                                              mmap=d.mmap_bin_files)
                        for split in ("train", "valid", "test")}

    def model_chunks(self) -> list:
        return build_nmt_chunks_for_rank(self.cfg, self.padded_vocab, ps.get_pipeline_model_parallel_rank(),
                                         ps.get_pipeline_model_parallel_world_size(), virtual_pipeline_size(self.cfg),
                                         ps.get_device())

    def _batches(self, split: str, shuffle: bool) -> PairBatches | None:
        cfg, n, tgt = self.cfg, self.cfg.nmt, self.tgt_tokenizer
        corpus = self.corpora[split]
        if len(corpus) == 0 and split != "train":
            return None
        return PairBatches(corpus, bos=tgt.bos, eos=tgt.eos, pad=tgt.pad, max_src_length=cfg.model.seq_length,
                           max_tgt_length=n.decoder_seq_length, max_sentences=cfg.training.micro_batch_size,
                           max_tokens=n.max_tokens, seed=cfg.training.seed, shuffle=shuffle)

    def data(self):
        self.train = self._batches("train", shuffle=True)
        self.valid = self._batches("valid", shuffle=False)
        return self.train, self.valid, self._batches("test", shuffle=False)

    def microbatches(self, dataset: PairBatches, consumed_samples: int, num_mb: int, mbs: int) -> list[dict]:
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        first, device = consumed_samples // mbs, ps.get_device()
        return [{k: v.to(device) for k, v in dataset[first + m * dp + d].items()} for m in range(num_mb)]

    def message_specs(self, micro_batch_size: int):
        return None  # shapes change with every bucket: sent in a header

    def eval_iters(self, valid: PairBatches) -> int:
        """Groups of M x DP validation buckets: the whole split, at most --eval-iters of them."""
        per_iteration = num_microbatches(self.cfg, dist.get_world_size()) * ps.get_data_parallel_world_size()
        return min(self.cfg.training.eval_iters, math.ceil(len(valid) / per_iteration))

    def tokens_per_iteration(self, gbs: int) -> float:
        """Real (unpadded) source + target tokens of an average iteration."""
        src, tgt = self.train.mean_tokens()
        return (src + tgt) * gbs / self.cfg.training.micro_batch_size

    def flops_per_iteration(self, gbs: int) -> float:
        """Model FLOPs of an average iteration: its sentences times the FLOPs of a pair of mean lengths."""
        from megatron_po.flops import nmt_flops_per_sample
        m, n = self.cfg.model, self.cfg.nmt
        pairs = len(self.train.corpus)
        src, tgt = (float(x) * len(self.train) / pairs for x in self.train.mean_tokens())  # mean lengths
        per_pair = nmt_flops_per_sample(m.hidden_size, ffn_hidden_size(m), n.encoder_num_layers, n.decoder_num_layers,
                                        src, tgt, self.padded_vocab[1], m.swiglu)
        return per_pair * pairs / len(self.train) * gbs / self.cfg.training.micro_batch_size

    def translate(self, chunks, sources: list, beam_size: int = 1, length_penalty: float = 1.0) -> list[str] | None:
        """Decode `sources` (token ids) through this rank's chunks of the pipeline, the DP replicas
        sharing the work. Returns the detokenised outputs, in order, on the logging rank; None elsewhere."""
        from megatron_po.pipeline.decode import Stepper, translate_ids
        from megatron_po.pipeline.executor import P2PTransport
        D, v = ps.get_pipeline_model_parallel_world_size(), len(chunks)
        stepper = Stepper(chunks, ps.get_pipeline_model_parallel_rank(), D, P2PTransport(D, v) if D > 1 else None)
        tgt = self.tgt_tokenizer
        modes = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        out = translate_ids(stepper, sources, bos=tgt.bos, eos=tgt.eos, pad=tgt.pad, vocab_size=tgt.vocab_size,
                            max_source_length=self.cfg.model.seq_length,
                            decoder_seq_length=self.cfg.nmt.decoder_seq_length,
                            batch_sentences=self.cfg.training.micro_batch_size, batch_tokens=self.cfg.nmt.max_tokens,
                            beam_size=beam_size, length_penalty=length_penalty,
                            shard=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()))
        for c, mode in zip(chunks, modes):
            c.train(mode)
        if not stepper.holds_logits:
            return None
        if ps.get_data_parallel_world_size() > 1:
            parts = [None] * ps.get_data_parallel_world_size()
            dist.all_gather_object(parts, out, group=ps.get_data_parallel_group())
            out = {i: ids for part in parts for i, ids in part.items()}
        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
            return None
        return [tgt.detokenize(out[i]) for i in range(len(sources))]

    def evaluate_extra(self, chunks, iteration: int) -> dict:
        """Validation BLEU (greedy decoding) on the logging rank; {} elsewhere."""
        if self.valid is None:
            return {}
        corpus = self.valid.corpus
        count = len(corpus) if self.cfg.nmt.eval_bleu_sentences is None else min(len(corpus),
                                                                                 self.cfg.nmt.eval_bleu_sentences)
        if count == 0:
            return {}
        hypotheses = self.translate(chunks, [corpus.src[i] for i in range(count)])
        if hypotheses is None:
            return {}
        references = [self.tgt_tokenizer.detokenize(corpus.tgt[i]) for i in range(count)]
        return {"val_bleu": corpus_scores(hypotheses, references)["bleu"]}

    def checkpoint_extra(self) -> dict:
        """`vocab_size` bounds the rows a checkpoint may re-pad (the larger vocabulary)."""
        src, tgt = self.src_tokenizer.vocab_size, self.tgt_tokenizer.vocab_size
        return {"vocab_size": max(src, tgt), "src_vocab_size": src, "tgt_vocab_size": tgt,
                "padded_vocab_size": self.padded_vocab}

