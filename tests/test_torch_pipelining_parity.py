"""Our pipeline schedules give the same gradients as torch.distributed.pipelining's.

The same GPT chunks (`build_chunks_for_rank`, untied embeddings, no dropout) are run in the same forked
gloo processes twice on the same micro-batches: once by our executor (`synchronous_forward_backward`,
which runs `run_rank` on `build_schedule(method, D, v, M)`), once by torch's schedule on
`PipelineStage`s wrapping those chunks. torch's last stage returns the logits and its `loss_fn` applies
the same vocab-parallel cross-entropy and masked mean as our runner; torch averages over micro-batches
with `scale_grads=True` (divide the summed gradients by M at the end), we by scaling each
micro-batch loss by 1/M before its backward.

Compared: every parameter's gradient and the mean loss, fp32, rtol=1e-5 / atol=1e-6 (the two paths
differ only in where 1/M is applied; bitwise is not required, though with M=4, a power of two, the
scaling is exact and the results currently come out bitwise equal).

Pairs: our gpipe vs ScheduleGPipe, our 1f1b vs Schedule1F1B (PP=2 and PP=4), our interleaved 1f1b
(v=2) vs ScheduleInterleaved1F1B (PP=2).
"""

import dataclasses

import pytest
import torch
from dist_harness import run_distributed
from torch import nn
# Imported here, in the parent, so the forked ranks inherit it (importing it in each child costs ~2 s).
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig
from megatron_po.models.gpt import masked_mean_loss
from megatron_po.pipeline.executor import synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.tensor_parallel import model_parallel_seed, vocab_parallel_cross_entropy

VOCAB = 128
SEED = 11
SEQ = 16
MBS = 2
M = 4
RTOL, ATOL = 1e-5, 1e-6

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                    hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                    untie_embeddings_and_output_weights=True)


def make_cfg(position: str) -> Config:
    cfg = Config()
    extra = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 add_bias_linear=False) if position == "rope" else {}
    cfg.model = dataclasses.replace(MODEL, **extra)
    cfg.training.seed = SEED
    return cfg


def microbatches():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (M * MBS, SEQ + 1), generator=g)
    mask = torch.ones(M * MBS, SEQ)
    mask[0, -3:] = 0  # a partly masked sample exercises the loss mask
    mask[-1, :5] = 0
    full = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}
    return [{k: v[i * MBS:(i + 1) * MBS] for k, v in full.items()} for i in range(M)]


class StageAdapter(nn.Module):
    """torch.pipelining passes positional tensors: tokens [b, s] into the first stage, hidden states
    [s, b, h] between stages; the last stage returns the (full, TP=1) logits [s, b, V]."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        if self.chunk.pre_process:
            return self.chunk(input_ids=x)
        return self.chunk(hidden_states=x)


def torch_loss_fn(logits, target):
    """target packs labels and loss mask: [b, s, 2] int64 (torch splits one target tensor per mb)."""
    labels, mask = target[..., 0], target[..., 1]
    per_token = vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).t()  # [b, s]
    return masked_mean_loss(per_token, mask)


def grads_of(chunks, D, rank):
    out = {}
    for c, chunk in enumerate(chunks):
        vs = c * D + rank
        for name, p in chunk.named_parameters():
            assert p.grad is not None, (vs, name)
            out[f"vs{vs}.{name}"] = p.grad.detach().clone()
    return out


def run_both(method, position, num_chunks):
    model_parallel_seed(SEED)
    D, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    chunks = build_chunks_for_rank(make_cfg(position), VOCAB, rank, D, num_chunks)
    mbs = microbatches()

    # ours
    ours_loss = synchronous_forward_backward(method, chunks, None, mbs)
    ours = grads_of(chunks, D, rank)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)

    # torch.distributed.pipelining on the same chunks
    group = ps.get_pipeline_model_parallel_group()
    stages = [PipelineStage(StageAdapter(chunk), c * D + rank, D * num_chunks, torch.device("cpu"),
                            group=group) for c, chunk in enumerate(chunks)]
    if num_chunks > 1:
        schedule = ScheduleInterleaved1F1B(stages, M, loss_fn=torch_loss_fn, scale_grads=True)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[method]
        schedule = cls(stages[0], M, loss_fn=torch_loss_fn, scale_grads=True)
    tokens = torch.cat([b["tokens"] for b in mbs])
    target = torch.stack([torch.cat([b["labels"] for b in mbs]),
                          torch.cat([b["loss_mask"] for b in mbs]).long()], dim=-1)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    losses = [] if is_last else None
    args = (tokens,) if is_first else ()
    schedule.step(*args, target=target if is_last else None, losses=losses, return_outputs=False)
    theirs = grads_of(chunks, D, rank)
    theirs_loss = torch.stack(losses).mean() if is_last else None

    losses_out = None
    if is_last:
        losses_out = (ours_loss.item(), theirs_loss.item())
    return losses_out, ours, theirs


CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 2, 2)]


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("method,pp,v", CASES)
def test_gradients_equal_torch_pipelining(method, pp, v, position):
    results = run_distributed(run_both, pp, pp=pp, args=(method, position, v), timeout=60)
    losses = [r[0] for r in results if r[0] is not None]
    assert len(losses) == 1
    ours_loss, theirs_loss = losses[0]
    assert abs(ours_loss - theirs_loss) <= RTOL * abs(theirs_loss) + ATOL, (ours_loss, theirs_loss)
    seen = set()
    for _, ours, theirs in results:
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=RTOL, atol=ATOL, msg=k)
        seen |= {k.split(".")[0] for k in ours}
    assert seen == {f"vs{i}" for i in range(pp * v)}  # every virtual stage compared
