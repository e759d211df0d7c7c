"""Pipeline-parallel GPT (GPipe, 1F1B, interleaved 1F1B) equals the unpipelined model.

Same micro-batches, same initial weights (layout-independent init): the mean loss and every
parameter's gradient must match the single-process model, fp32, rtol=1e-5 / atol=1e-6. The
single-process emulator must match the distributed executor exactly (bitwise: same ops, same order
within each rank, one thread).
"""

import dataclasses

import pytest
import torch
from dist_harness import run_distributed
from test_gpt_parallel import CONFIGS, SEED, VOCAB, full_grads, make_batch

from megatron_po import parallel_state as ps
from megatron_po.config import Config
from megatron_po.distributed.checkpoint_format import named_parameters_global
from megatron_po.distributed.ddp import (DistributedDataParallel, allreduce_embedding_grads,
                                         allreduce_sequence_parallel_grads)
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate, synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank, gpt_message_specs
from megatron_po.pipeline.schedules import build_schedule
from megatron_po.tensor_parallel import model_parallel_seed

NUM_LAYERS = 8
M = 4


def make_cfg(name, parallel=None):
    """`parallel`: ParallelConfig fields to set (the pipeline method, an uneven split: test_uneven_pipeline.py)."""
    cfg = Config()
    cfg.model = dataclasses.replace(CONFIGS[name], num_layers=NUM_LAYERS)
    cfg.training.seed = SEED
    cfg.parallel = dataclasses.replace(cfg.parallel, **(parallel or {}))
    return cfg


def microbatches(n=M, mbs=2):
    b = make_batch(n=n * mbs, seed=3)
    return [{k: v[i * mbs:(i + 1) * mbs] for k, v in b.items()} for i in range(n)]


def reference(name, n=M):
    torch.set_num_threads(1)
    model = GPTModel(make_cfg(name).model, VOCAB, SEED)
    losses = []
    for b in microbatches(n):
        loss = masked_mean_loss(model(input_ids=b["tokens"], labels=b["labels"]), b["loss_mask"])
        (loss / n).backward()
        losses.append(loss.detach())
    grads = {f"model.{k}": p.grad for k, p in model.named_parameters()}
    return torch.stack(losses).mean().item(), grads


def global_grads(chunks):
    """{global name: full gradient} of this rank (TP shards gathered)."""
    out = {}
    for name, p in named_parameters_global(chunks):
        for c in chunks:  # find the owning chunk to gather TP shards
            for local_name, q in c.named_parameters():
                if q is p:
                    out[f"model.{name}"] = full_grads(c)[local_name]
                    break
            else:
                continue
            break
    return out


def pipeline_run(name, method, num_chunks, agreed_shapes=False, parallel=None):
    model_parallel_seed(SEED)
    cfg = make_cfg(name, parallel)
    D = ps.get_pipeline_model_parallel_world_size()
    chunks = build_chunks_for_rank(cfg, VOCAB, ps.get_pipeline_model_parallel_rank(), D, num_chunks)
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), bucket_size=20000)
    ddp.zero_grad()
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = microbatches(M * dp)
    mine = mbs[d * M:(d + 1) * M]
    specs = gpt_message_specs(cfg, mine[0]["tokens"].shape[0]) if agreed_shapes else None
    loss = synchronous_forward_backward(method, chunks, ddp, mine, message_specs=specs)
    ddp.finish_grad_sync()
    allreduce_sequence_parallel_grads(ddp.params)
    allreduce_embedding_grads(ddp.params)
    if loss is not None and dp > 1:
        import torch.distributed as dist
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        loss = loss / dp
    return (loss.item() if loss is not None else None), global_grads(chunks)


def check_against_reference(results, ref_loss, ref_grads):
    losses = [r[0] for r in results if r[0] is not None]
    assert losses, "no rank returned a loss"
    for loss in losses:
        assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (loss, ref_loss)
    merged = {}
    for _, grads in results:
        merged.update(grads)
    assert merged.keys() == ref_grads.keys(), set(merged) ^ set(ref_grads)
    for k, g in merged.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("pp,method,v", [(2, "gpipe", 1), (2, "1f1b", 1), (4, "gpipe", 1), (4, "1f1b", 1),
                                         (2, "1f1b", 2), (4, "1f1b", 2)])
def test_pipeline_matches_unpipelined(name, pp, method, v):
    ref_loss, ref_grads = reference(name)
    results = run_distributed(pipeline_run, pp, pp=pp, args=(name, method, v))
    check_against_reference(results, ref_loss, ref_grads)


@pytest.mark.parametrize("pp,method,v", [(4, "1f1b", 1), (2, "1f1b", 2)])
def test_agreed_shapes_transport_matches_unpipelined(pp, method, v):
    """The header-free protocol with receives posted ahead gives the same results."""
    ref_loss, ref_grads = reference("llama")
    results = run_distributed(pipeline_run, pp, pp=pp, args=("llama", method, v, True))
    check_against_reference(results, ref_loss, ref_grads)


def test_tp2_pp2_dp2_matches_single_process():
    ref_loss, ref_grads = reference("gpt2", n=2 * M)
    results = run_distributed(pipeline_run, 8, tp=2, pp=2, args=("gpt2", "1f1b", 1))
    check_against_reference(results, ref_loss, ref_grads)


def test_one_stage_interleaved_chunks_matches_unpipelined():
    """D=1 with v=2 chunks: tied embedding copies live on one rank."""
    ref_loss, ref_grads = reference("gpt2")
    results = run_distributed(pipeline_run, 1, args=("gpt2", "1f1b", 2))
    check_against_reference(results, ref_loss, ref_grads)


def emulated_run(name, method, D, v, parallel=None):
    model_parallel_seed(SEED)
    cfg = make_cfg(name, parallel)
    mbs = microbatches()
    mailbox = Mailbox()
    runners = {}
    for r in range(D):
        chunks = build_chunks_for_rank(cfg, VOCAB, r, D, v)
        runners[r] = StageRunner(rank=r, num_stages=D, chunks=chunks, transport=mailbox,
                                 get_batch=mbs.__getitem__, loss_scale=1.0 / M)
    emulate(build_schedule(method, D, v, M), runners)
    all_chunks = [c for r in range(D) for c in runners[r].chunks]
    allreduce_embedding_grads([p for c in all_chunks for p in c.parameters()])
    loss = torch.stack([runners[D - 1].losses[m] for m in range(M)]).mean().item()
    return loss, global_grads(all_chunks)


@pytest.mark.parametrize("method,D,v", [("1f1b", 4, 1), ("gpipe", 2, 1), ("1f1b", 2, 2)])
def test_emulator_equals_distributed_executor(method, D, v):
    emu_loss, emu_grads = run_distributed(emulated_run, 1, args=("llama", method, D, v))[0]
    results = run_distributed(pipeline_run, D, pp=D, args=("llama", method, v))
    dist_loss = [r[0] for r in results if r[0] is not None][0]
    assert dist_loss == emu_loss
    merged = {}
    for _, g in results:
        merged.update(g)
    assert merged.keys() == emu_grads.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], emu_grads[k], rtol=0, atol=0, msg=k)
