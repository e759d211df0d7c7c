"""A tiny MoE GPT, its one-process reference over a global batch, and a distributed run of the same batch under
any layout (TP, SP, DP, PP, EP, expert TP), for the MoE tests: loss, every full gradient and the routers'
records (tokens per expert, dropped tokens) to compare."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig
from megatron_po.data.context_split import split_for_this_rank
from megatron_po.distributed.checkpoint_format import named_parameters_global
from megatron_po.distributed.ddp import (DistributedDataParallel, allreduce_embedding_grads,
                                         allreduce_sequence_parallel_grads)
from megatron_po.models.gpt import GPTModel, masked_mean_loss
from megatron_po.models.moe.aux_losses import aux_loss_scale
from megatron_po.models.moe.layer import take_records
from megatron_po.pipeline.executor import synchronous_forward_backward
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.tensor_parallel import gather_tensor, model_parallel_seed

VOCAB, SEED, M, MBS, SEQ = 128, 7, 4, 2, 16

# 4 layers, the first dense (Megatron's list form), 8 experts top-2 with SwiGLU and shared experts; the
# auxiliary losses large enough to matter in the gradients.
BASE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                   attention_dropout=0.0, make_vocab_size_divisible_by=8, swiglu=True, add_bias_linear=False,
                   untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2,
                   moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]*1+[1]*3)",
                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_token_dispatcher_type="alltoall")


def make_cfg(**model) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(BASE, **model)
    cfg.training.seed = SEED
    return cfg


def microbatches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (n * MBS, SEQ + 1), generator=g)
    mask = torch.ones(n * MBS, SEQ)
    mask[0, -3:] = 0
    b = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}
    return [{k: v[i * MBS:(i + 1) * MBS] for k, v in b.items()} for i in range(n)]


def reference(n: int = M, **model):
    """One process, `n` micro-batches: (mean loss, {name: grad}, {layer: record}, the parameters' norm)."""
    return reference_results(*reference_model(n, **model))


def reference_results(net: GPTModel, loss: float):
    """`reference`'s tuple from the one-process model after its backwards (`reference_model`)."""
    grads = {f"model.{k}": p.grad for k, p in net.named_parameters()}
    params_norm = torch.stack([p.detach().double().square().sum() for p in net.parameters()]).sum().sqrt().item()
    return loss, grads, take_records([net]), params_norm


def reference_model(n: int = M, **model) -> tuple[GPTModel, float]:
    """The one-process model after its forwards and backwards over `n` micro-batches, and their mean loss."""
    torch.set_num_threads(1)
    model_parallel_seed(SEED)
    net = GPTModel(make_cfg(**model).model, VOCAB, SEED)
    losses = []
    for b in microbatches(n):
        loss = masked_mean_loss(net(input_ids=b["tokens"], labels=b["labels"], loss_mask=b["loss_mask"]),
                                b["loss_mask"])
        with aux_loss_scale(1.0 / n):  # what the executor gives every micro-batch
            (loss / n).backward()
        losses.append(loss.detach())
    return net, torch.stack(losses).mean().item()


def _all_gather(t: torch.Tensor, group, n: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of the whole parameter: TP shards, expert TP slices and every EP rank's experts gathered."""
    g = p.grad.detach().clone()
    if getattr(p, "expert_parallel", False):
        etp = ps.get_expert_tensor_parallel_world_size()
        if p.expert_tp_dim >= 0 and etp > 1:
            g = torch.cat(_all_gather(g, ps.get_expert_tensor_parallel_group(), etp), dim=p.expert_tp_dim)
        ep = ps.get_expert_model_parallel_world_size()
        if ep > 1:
            g = torch.cat(_all_gather(g, ps.get_expert_model_parallel_group(), ep), dim=0)
        return g
    tp = ps.get_tensor_model_parallel_world_size()
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        g = gather_tensor(_all_gather(g, ps.get_tensor_model_parallel_group(), tp), p.partition_dim,
                          getattr(p, "partition_stride", 1))
    return g


def distributed_run(model: dict, ep: int = 1, etp: int | None = None, method: str = "1f1b", num_chunks: int = 1,
                    sequence_parallel: bool = False):
    """This rank's part of the global batch (M micro-batches per DP rank) through the synchronous executor and
    DDP: (mean loss on the loss rank or None, {global name: full grad}, {layer: record}, (grad norms, params norm))."""
    loss, chunks, ddp = distributed_train(model, ep, etp, method, num_chunks, sequence_parallel)
    grads = {f"model.{name}": full_grad(p) for name, p in named_parameters_global(chunks)}
    return ((loss.item() if loss is not None else None), grads, take_records(chunks),
            grad_norms(ddp.params) + (params_norm(ddp.params),))


def distributed_train(model: dict, ep: int = 1, etp: int | None = None, method: str = "1f1b", num_chunks: int = 1,
                      sequence_parallel: bool = False):
    """`distributed_run`'s forwards and backwards: (the loss averaged over DP on the loss rank or None, this
    rank's chunks, their DDP with the gradients synchronized)."""
    torch.set_num_threads(1)
    ps.initialize_expert_parallel(ep, etp)
    model_parallel_seed(SEED)
    cfg = make_cfg(**model)
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.parallel.pipeline_method = method  # ZB-V places its two chunks in a V
    D = ps.get_pipeline_model_parallel_world_size()
    chunks = build_chunks_for_rank(cfg, VOCAB, ps.get_pipeline_model_parallel_rank(), D, num_chunks)
    # Under context parallelism: gradients over DP x CP, every sequence split into this CP rank's chunks.
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(with_context_parallel=True), bucket_size=20000)
    ddp.zero_grad()
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [split_for_this_rank(b) for b in microbatches(M * dp)[d * M:(d + 1) * M]]
    loss = synchronous_forward_backward(method, chunks, ddp, mine)
    ddp.finish_grad_sync()
    allreduce_sequence_parallel_grads(ddp.params)
    allreduce_embedding_grads(ddp.params)
    n = ps.get_data_parallel_world_size(with_context_parallel=True)
    if loss is not None and n > 1:
        dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
        loss = loss / n
    return loss, chunks, ddp


def grad_norms(params) -> tuple[float, float]:
    """The global gradient norm as synchronous training takes it (clip_grads) and as the mixed-precision
    optimizer does (its found-inf agreement included)."""
    from megatron_po.optim import build_optimizer
    from megatron_po.optim.clip_grads import global_grad_norm
    from megatron_po.optim.mixed_precision import MixedPrecisionOptimizer
    experts = ps.get_expert_tensor_model_pipeline_parallel_group()
    plain = global_grad_norm(params, ps.get_model_parallel_group(), experts)
    wrapped = MixedPrecisionOptimizer(lambda groups: build_optimizer("sgd", groups, lr=0.1), params,
                                      model_parallel_group=ps.get_model_parallel_group(), expert_group=experts)
    for p in params:  # the wrapper reads the DDP buffer (`main_grad`)
        assert p.main_grad is p.grad
    wrapped._main_grads()  # what its step does first
    return plain, wrapped.grad_norm()


def params_norm(params) -> float:
    """--log-params-norm's reading (run_controls.replica_sums)."""
    from megatron_po.run_controls import replica_sums
    return replica_sums(params, ps.get_model_parallel_group(),
                        ps.get_expert_tensor_model_pipeline_parallel_group())["params_norm"]


def check_equal(results, ref, rtol=1e-5, atol=1e-6):
    """Every rank's loss and gradients equal the reference's; the routers' records summed over the ranks too
    (each rank records its own tokens): the same tokens per expert, the same dropped tokens."""
    ref_loss, ref_grads, ref_records, ref_params_norm = ref
    losses = [r[0] for r in results if r[0] is not None]
    assert losses
    for loss in losses:
        assert abs(loss - ref_loss) < rtol * max(1.0, abs(ref_loss)), (loss, ref_loss)
    ref_norm = torch.stack([g.double().square().sum() for g in ref_grads.values()]).sum().sqrt().item()
    for *_, norms in results:  # every expert counted once, on every rank
        for norm in norms[:2]:
            assert abs(norm - ref_norm) < rtol * ref_norm, (norms, ref_norm)
        assert abs(norms[2] - ref_params_norm) < 1e-9 * ref_params_norm, (norms, ref_params_norm)
    merged = {}
    for _, grads, *_ in results:
        merged.update(grads)
    assert merged.keys() == ref_grads.keys(), set(merged) ^ set(ref_grads)
    for k, g in merged.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=rtol, atol=atol, msg=k)
    totals: dict = {}
    for _, _, records, _ in results:
        for layer, rec in records.items():
            t = totals.setdefault(layer, {"tokens_per_expert": torch.zeros(len(rec["tokens_per_expert"]),
                                                                           dtype=torch.int64), "dropped_tokens": 0})
            t["tokens_per_expert"] += torch.tensor(rec["tokens_per_expert"])
            t["dropped_tokens"] += rec["dropped_tokens"]
    assert totals.keys() == ref_records.keys()
    for layer, t in totals.items():
        assert t["tokens_per_expert"].tolist() == ref_records[layer]["tokens_per_expert"], layer
        assert t["dropped_tokens"] == ref_records[layer]["dropped_tokens"], layer
