"""Autoregressive decoding (greedy and beam search) through the model chunks of any pipeline layout.

`Stepper` runs one decoding step through every virtual stage: this rank's chunks in virtual-stage order,
the activations between stages through a transport (point-to-point between pipeline ranks, a Mailbox in
one process), each chunk keeping its own key/value caches (`NMTModel.decode_step`). In one process the same
code runs a whole pipeline: pass every chunk in virtual-stage order with `num_stages=1`.

Only the last stage sees the logits, so the search runs there; its decision for the step (the next token
of every hypothesis, which hypothesis each continues, whether all sentences are done) is broadcast over
the pipeline group, and every rank reorders its caches and feeds the tokens on. Tensor-parallel ranks run
the same steps in lockstep (the logits are gathered over TP); data-parallel replicas decode different
sentences.

Beam search (fairseq's rule): each step scores every continuation of the k live hypotheses, takes the 2k
best; those ending in EOS among the best k are set aside as finished (score = log-probability / length **
length_penalty, the length counting the EOS), and the best k others live on. A sentence is done once it
has k finished hypotheses; at `max_length` tokens EOS is forced. `beam_size` 1 is greedy decoding.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from megatron_po import parallel_state as ps
from megatron_po.models.nmt import reorder_decode_state
from megatron_po.pipeline.executor import Mailbox

# Longest output: MAX_LENGTH_A x the longest source (EOS included) + MAX_LENGTH_B tokens, and never more
# target positions than the model was trained on (--decoder-seq-length).
MAX_LENGTH_A, MAX_LENGTH_B = 2, 10


def max_decode_length(longest_source: int, decoder_seq_length: int) -> int:
    return min(decoder_seq_length, MAX_LENGTH_A * longest_source + MAX_LENGTH_B)


class Stepper:
    """One pipeline rank's side of a decoding step (see the module docstring)."""

    def __init__(self, chunks: list, rank: int = 0, num_stages: int = 1, transport=None):
        self.chunks, self.rank, self.num_stages = chunks, rank, num_stages
        self.transport = transport if transport is not None else Mailbox()
        self.holds_logits = chunks[-1].post_process
        self.steps = 0  # message ids: unique over the stepper's life
        self.states = [{} for _ in chunks]

    def reset(self) -> None:
        self.states = [{} for _ in self.chunks]

    def step(self, batch: dict) -> torch.Tensor | None:
        """Logits [rows, V] of the newest position on the last stage, None elsewhere."""
        out = None
        for c, chunk in enumerate(self.chunks):
            vs = c * self.num_stages + self.rank
            hidden = None
            if not chunk.pre_process:
                hidden = tuple(self.transport.recv(self.rank, (vs - 1) % self.num_stages, ("act", self.steps, vs)))
            out = chunk.decode_step(batch, hidden, self.states[c])
            if not chunk.post_process:
                self.transport.send((vs + 1) % self.num_stages, ("act", self.steps, vs + 1), list(out))
        self.steps += 1
        return out if self.holds_logits else None

    def reorder(self, index: torch.Tensor) -> None:
        for state in self.states:
            reorder_decode_state(state, index)

    def share(self, decision: torch.Tensor | None, numel: int) -> torch.Tensor:
        """The last pipeline rank's `decision` on every pipeline rank."""
        if self.num_stages == 1:
            return decision
        if decision is None:
            decision = torch.empty(numel, dtype=torch.long, device=ps.get_device())
        dist.broadcast(decision, src=ps.get_pipeline_model_parallel_ranks()[-1],
                       group=ps.get_pipeline_model_parallel_group())
        return decision

    def finish(self) -> None:
        self.transport.flush()


class _Beams:
    """The search state, kept on the last stage: scores of the live hypotheses, finished ones."""

    def __init__(self, num_sentences: int, beam_size: int, device):
        self.n, self.k = num_sentences, beam_size
        self.scores = torch.full((num_sentences, beam_size), float("-inf"), device=device)
        self.scores[:, 0] = 0.0  # the first step expands one hypothesis per sentence
        self.finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(num_sentences)]
        self.done = [False] * num_sentences

    def advance(self, logits: torch.Tensor, history: torch.Tensor, step: int, last: bool, *, eos: int,
                banned: list[int], vocab_size: int, length_penalty: float) -> torch.Tensor:
        """One step; returns [next tokens (n*k), source hypothesis of each (n*k), all done (1)]."""
        n, k = self.n, self.k
        lprobs = F.log_softmax(logits[:, :vocab_size].float(), dim=-1)
        lprobs[:, banned] = float("-inf")
        if last:  # the length limit: only EOS may follow
            keep = lprobs[:, eos].clone()
            lprobs.fill_(float("-inf"))
            lprobs[:, eos] = keep
        cand = (self.scores.reshape(n * k, 1) + lprobs).reshape(n, k * vocab_size)
        top_v, top_i = cand.topk(min(2 * k, k * vocab_size), dim=1)
        top_v, beam, word = top_v.tolist(), (top_i // vocab_size).tolist(), (top_i % vocab_size).tolist()
        next_tokens = torch.full((n, k), eos, dtype=torch.long)
        source = torch.zeros(n, k, dtype=torch.long)
        scores = torch.full((n, k), float("-inf"))
        for i in range(n):
            if self.done[i]:
                continue
            live = 0
            for r, (v, b, w) in enumerate(zip(top_v[i], beam[i], word[i])):
                if v == float("-inf"):
                    break
                if w == eos:
                    if r < k:
                        tokens = history[i * k + b, 1:].tolist()
                        self.finished[i].append((v / (step + 1) ** length_penalty, tokens))
                elif live < k:
                    next_tokens[i, live], source[i, live], scores[i, live] = w, b, v
                    live += 1
            self.done[i] = len(self.finished[i]) >= k or live == 0
        self.scores = scores.to(self.scores.device)
        rows = (torch.arange(n)[:, None] * k + source).reshape(-1)
        return torch.cat([next_tokens.reshape(-1), rows, torch.tensor([all(self.done)], dtype=torch.long)])

    def best(self) -> list[list[int]]:
        return [max(f, key=lambda x: x[0])[1] if f else [] for f in self.finished]


@torch.no_grad()
def generate(stepper: Stepper, src_tokens: torch.Tensor, src_mask: torch.Tensor, *, bos: int, eos: int, pad: int,
             vocab_size: int, max_length: int, beam_size: int = 1, length_penalty: float = 1.0):
    """Translate one batch of sources (src_tokens [n, s] with EOS, right-padded; src_mask True on tokens).
    Returns, on the rank holding the last stage, each sentence's best output ids (without EOS); None
    elsewhere. Every pipeline rank of the replica must call it with the same batch."""
    n, k = src_tokens.shape[0], beam_size
    device = src_tokens.device
    batch = {"src_tokens": src_tokens.repeat_interleave(k, 0), "src_mask": src_mask.repeat_interleave(k, 0)}
    history = torch.full((n * k, 1), bos, dtype=torch.long, device=device)
    beams = _Beams(n, k, device) if stepper.holds_logits else None
    stepper.reset()
    for step in range(max_length):
        logits = stepper.step({**batch, "tgt_tokens": history[:, -1:]})
        decision = None
        if beams is not None:
            decision = beams.advance(logits, history.cpu(), step, step == max_length - 1, eos=eos,
                                     banned=[pad, bos], vocab_size=vocab_size,
                                     length_penalty=length_penalty).to(device)
        decision = stepper.share(decision, 2 * n * k + 1)
        next_tokens, rows, all_done = decision[:n * k], decision[n * k:2 * n * k], bool(decision[-1])
        if all_done:
            break
        if k > 1:  # (greedy: every hypothesis continues itself)
            history = history.index_select(0, rows)
            stepper.reorder(rows)
        history = torch.cat([history, next_tokens[:, None]], dim=1)
    stepper.finish()
    return beams.best() if beams is not None else None


def translate_ids(stepper: Stepper, sources: list, *, bos: int, eos: int, pad: int, vocab_size: int,
                  max_source_length: int, decoder_seq_length: int, batch_sentences: int,
                  batch_tokens: int | None = None, beam_size: int = 1, length_penalty: float = 1.0,
                  shard: tuple[int, int] = (0, 1), progress: bool = False) -> dict[int, list[int]] | None:
    """Translate many sources (token id sequences without EOS): sorted by length, cut into batches of at
    most `batch_sentences` sentences (and `batch_tokens` padded tokens), batch j decoded by the replica
    `j % shard[1] == shard[0]` of a data-parallel group. Returns {source index: output ids} for this
    replica's batches on the rank holding the last stage; None elsewhere."""
    from megatron_po.data.nmt_dataset import bucket_batches
    rows = [torch.tensor(list(s[:max_source_length - 1]) + [eos], dtype=torch.long) for s in sources]
    lengths = np.array([len(r) for r in rows])
    order = np.argsort(-lengths, kind="stable")  # longest first: the slowest batch shows up early
    batches = bucket_batches(order, lengths, batch_sentences, batch_tokens)[shard[0]::shard[1]]
    device = ps.get_device()
    out = {} if stepper.holds_logits else None
    for ids in tqdm(batches, desc="translating", unit="batch", disable=not progress):
        src = torch.nn.utils.rnn.pad_sequence([rows[i] for i in ids], batch_first=True, padding_value=pad)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(rows[i]), dtype=torch.bool) for i in ids],
                                               batch_first=True)
        hyps = generate(stepper, src.to(device), mask.to(device), bos=bos, eos=eos, pad=pad, vocab_size=vocab_size,
                        max_length=max_decode_length(src.shape[1], decoder_seq_length), beam_size=beam_size,
                        length_penalty=length_penalty)
        if out is not None:
            out.update(zip((int(i) for i in ids), hyps))
    return out
