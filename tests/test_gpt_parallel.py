"""GPT under tensor and data parallelism equals the single-process model.

Tolerance: fp32, rtol=1e-5 / atol=1e-6 on losses and gradients (different reduction orders only).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig
from megatron_po.distributed.ddp import DistributedDataParallel, allreduce_sequence_parallel_grads
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.optim import build_optimizer
from megatron_po.tensor_parallel import gather_tensor, model_parallel_seed

VOCAB = 128  # already a multiple of 8 x 4: the same padded vocab for TP = 1, 2, 4
SEED = 7

CONFIGS = {
    "gpt2": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8),
    "llama": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                         hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         untie_embeddings_and_output_weights=True, add_bias_linear=False),
    # Llama-3-style attention: 8 heads in 4 key/value groups (1 or 2 per TP rank), head dim 12, per-head
    # q/k norms (replicated; their gradients summed over TP), zero-centered norms, RoPE on half of each head.
    "llama-gqa": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=16,
                             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                             untie_embeddings_and_output_weights=True, add_bias_linear=False,
                             group_query_attention=True, num_query_groups=4, kv_channels=12, qk_layernorm=True,
                             apply_layernorm_1p=True, rotary_percent=0.5),
}


def make_batch(n=4, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    mask = torch.ones(n, seq)
    mask[0, -3:] = 0  # some masked positions exercise the loss mask
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def full_grads(model) -> dict:
    """Gradients with tensor-parallel shards gathered into full tensors."""
    out = {}
    tp = ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            shards = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(shards, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = gather_tensor(shards, p.partition_dim, getattr(p, "partition_stride", 1))
        out[name] = g
    return out


def tp_loss_and_grads(cfg_name, sequence_parallel):
    model_parallel_seed(SEED)
    cfg = CONFIGS[cfg_name]
    model = GPTModel(cfg, VOCAB, SEED, sequence_parallel=sequence_parallel)
    batch = make_batch()
    loss = masked_mean_loss(model(input_ids=batch["tokens"], labels=batch["labels"]), batch["loss_mask"])
    loss.backward()
    allreduce_sequence_parallel_grads(list(model.parameters()))
    return loss.item(), full_grads(model)


def reference(cfg_name):
    torch.manual_seed(0)
    model = GPTModel(CONFIGS[cfg_name], VOCAB, SEED)
    batch = make_batch()
    loss = masked_mean_loss(model(input_ids=batch["tokens"], labels=batch["labels"]), batch["loss_mask"])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_gpt_matches_single_process(cfg_name, tp, sequence_parallel):
    ref_loss, ref_grads = reference(cfg_name)
    results = run_distributed(tp_loss_and_grads, tp, tp=tp, args=(cfg_name, sequence_parallel))
    for loss, grads in results:
        assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


# ---- data parallel -------------------------------------------------------------------------------

def dp_step(bucket_size, num_microbatches, per_rank_batch):
    """One optimizer step with DDP; returns the updated parameters."""
    cfg = CONFIGS["gpt2"]
    model = GPTModel(cfg, VOCAB, SEED)
    ddp = DistributedDataParallel([model], ps.get_data_parallel_group(), bucket_size=bucket_size)
    opt = build_optimizer("adamw", model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = make_batch(n=8)
    d, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rows = batch["tokens"].shape[0] // dp
    mine = {k: v[d * rows:(d + 1) * rows] for k, v in batch.items()}
    mbs = rows // num_microbatches
    ddp.zero_grad()
    for m in range(num_microbatches):
        mb = {k: v[m * mbs:(m + 1) * mbs] for k, v in mine.items()}
        loss = masked_mean_loss(model(input_ids=mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
        if m < num_microbatches - 1:
            with ddp.no_sync():
                (loss / num_microbatches).backward()
        else:
            (loss / num_microbatches).backward()
    ddp.finish_grad_sync()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(ddp.buckets)


def test_data_parallel_step_equals_single_process_on_concatenated_batch():
    # DP=1 with 2 micro-batches of 4 == DP=2 with 1 micro-batch of 4 each: same samples, same mean.
    ref, _ = run_distributed(dp_step, 1, args=(10**9, 2, None))[0]
    results = run_distributed(dp_step, 2, args=(10**9, 1, None))
    for params, _ in results:
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_ddp_many_buckets_equal_one_bucket():
    one, nb1 = run_distributed(dp_step, 2, args=(10**9, 2, None))[0]
    many, nb2 = run_distributed(dp_step, 2, args=(5000, 2, None))[0]
    assert nb1 == 1 and nb2 > 5
    for n, p in many.items():
        torch.testing.assert_close(p, one[n], rtol=0, atol=0, msg=n)


def test_model_layout_independent_init():
    """Layer i's weights do not depend on which layers a chunk holds (pipeline partitioning)."""
    cfg = dataclasses.replace(CONFIGS["gpt2"], num_layers=4)
    whole = GPTModel(cfg, VOCAB, SEED)
    tail = GPTModel(cfg, VOCAB, SEED, pre_process=False, layer_offset=2, num_layers=2)
    for (n1, p1), (n2, p2) in zip(whole.layers[2:].named_parameters(), tail.layers.named_parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def grad_norm_run(tp_size):
    from megatron_po.optim.clip_grads import global_grad_norm
    model_parallel_seed(SEED)
    model = GPTModel(CONFIGS["gpt2"], VOCAB, SEED)
    batch = make_batch()
    masked_mean_loss(model(input_ids=batch["tokens"], labels=batch["labels"]), batch["loss_mask"]).backward()
    return global_grad_norm(list(model.parameters()), ps.get_model_parallel_group())


def test_grad_norm_counts_each_parameter_once_under_tp():
    """TP-replicated params (norms, row biases, position embeddings) are counted once, shards once."""
    ref = run_distributed(grad_norm_run, 1, args=(1,))[0]
    for norm in run_distributed(grad_norm_run, 4, tp=4, args=(4,)):
        assert abs(norm - ref) <= 1e-5 * ref
