"""Context parallelism (--context-parallel-size) equals CP = 1 at the same global batch, composed with the rest.

One synchronous iteration (M = 2 micro-batches per DP rank) through the library's own path: the rank's model
chunks (pipeline/partition.py), DDP over DP x CP, the batch split into this CP rank's chunks
(data/context_split.py), the pipeline executor's forward/backward, the gradient sync. Each case runs with and
without CP (the same DP, TP, PP and flags): the mean loss over DP x CP and every parameter's gradient (TP shards
gathered, stages merged by global name) must agree. fp32; CP changes the order of the attention's sums (the blocks'
log-sum-exp merge) and of the gradient reduction: rtol 1e-5, atol 1e-6 on gradients, 1e-5 relative on the loss.

Cases: CP = 2 and 4 (learned positions and tied embeddings; RoPE, GQA, q/k norms), all_gather, CP x TP with
sequence parallelism, CP x DP, CP x PP under every synchronous schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-H2,
ZB-V), --reset-attention-mask / --reset-position-ids documents (a boundary inside a chunk, one on a chunk border,
one across ranks), full and selective recomputation, the unchunked output loss, --calculate-per-token-loss,
and --torch-compile (aot_eager: the ring runs between the compiled graphs). FP8, the asynchronous methods, the
distributed optimizer and whole runs: tests/test_context_parallel_training.py.
"""

from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
from cli_args import flags_to_argv
from dist_harness import run_distributed
from test_pipeline_parallel import global_grads

from megatron_po import parallel_state as ps
from megatron_po.config import parse_args, virtual_pipeline_size
from megatron_po.config_rules import validate
from megatron_po.data.context_split import split_for_this_rank
from megatron_po.data.document_masks import add_document_inputs
from megatron_po.distributed.ddp import (DistributedDataParallel, allreduce_embedding_grads,
                                         allreduce_sequence_parallel_grads)
from megatron_po.gpt_workload import reading_documents
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.tensor_parallel import model_parallel_seed
from megatron_po.training_step import average_over_dp, forward_backward, per_token_normalizer

VOCAB, EOD, M, MBS = 128, 127, 2, 2
BASE = {"--num-layers": 4, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
        "--micro-batch-size": MBS, "--hidden-dropout": 0.0, "--attention-dropout": 0.0,
        "--make-vocab-size-divisible-by": 8, "--mock-data": True, "--tokenizer-type": "NullTokenizer",
        "--vocab-size": VOCAB, "--seed": 7}
LLAMA = {"--position-embedding-type": "rope", "--no-position-embedding": True, "--normalization": "RMSNorm",
         "--swiglu": True, "--untie-embeddings-and-output-weights": True, "--disable-bias-linear": True,
         "--num-attention-heads": 8, "--group-query-attention": True, "--num-query-groups": 2,
         "--qk-layernorm": True}
DOCS = {"--reset-attention-mask": True, "--reset-position-ids": True}


def global_batch(num_samples: int, seq: int, documents: bool) -> list[dict]:
    """Samples of `seq` tokens; with `documents`, EODs at 5 (inside chunk 0 at CP = 2), 15 (a document starting
    on the border of chunks 1 and 2) and 20 (inside chunk 2), staggered per sample."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, EOD, (num_samples, seq + 1), generator=g)
    if documents:
        for i in range(num_samples):
            for at in (5, 15, 20):
                tokens[i, (at + i) % seq] = EOD
    mask = torch.ones(num_samples, seq)
    mask[0, -3:] = 0  # masked positions exercise the normalizer
    return [{"tokens": tokens[i:i + 1, :-1], "labels": tokens[i:i + 1, 1:], "loss_mask": mask[i:i + 1]}
            for i in range(num_samples)]


def one_iteration(flags: dict, compile_backend: str | None = None):
    """This rank's (mean loss over DP x CP or None, {global name: gradient}) after one forward/backward."""
    if compile_backend is not None:
        from megatron_po.models import compiled_layers
        compiled_layers.BACKEND = compile_backend
    cfg = parse_args(flags_to_argv({**BASE, **flags}))
    validate(cfg, torch.distributed.get_world_size())
    model_parallel_seed(cfg.training.seed)
    D, d = ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_rank()
    chunks = reading_documents(cfg, build_chunks_for_rank(cfg, VOCAB, ps.get_pipeline_model_parallel_rank(), D,
                                                          virtual_pipeline_size(cfg)))
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(with_context_parallel=True), bucket_size=20000)
    ddp.zero_grad()
    samples = global_batch(M * MBS * ps.get_data_parallel_world_size(), cfg.model.seq_length,
                           cfg.data.reset_attention_mask)
    batches = []
    for m in range(M):  # Megatron's order: micro-batch m of DP rank d
        rows = samples[m * MBS * ps.get_data_parallel_world_size() + d * MBS:][:MBS]
        b = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        add_document_inputs(b, EOD, cfg.data.reset_position_ids, cfg.data.reset_attention_mask)
        batches.append(split_for_this_rank(b))
    if cfg.training.calculate_per_token_loss:
        per_token_normalizer(batches)
    loss = forward_backward(cfg, chunks, ddp, batches)
    ddp.finish_grad_sync()
    allreduce_sequence_parallel_grads(ddp.params)
    allreduce_embedding_grads(ddp.params)
    return average_over_dp(loss), global_grads(chunks)


def compare(with_cp: list, without_cp: list, rtol=1e-5, atol=1e-6, loss_rtol=1e-5) -> None:
    """Every loss-holding rank's loss and every gradient of the CP run against the run without CP."""
    def merged(results):
        losses = {r[0] for r in results if r[0] is not None}
        grads = {}
        for _, g in results:
            grads.update(g)
        return losses, grads
    (cp_losses, cp_grads), (ref_losses, ref_grads) = merged(with_cp), merged(without_cp)
    assert len(ref_losses) == 1 and cp_losses, (cp_losses, ref_losses)
    ref = ref_losses.pop()
    for loss in cp_losses:  # every rank holding the loss reports the whole sequences' loss
        assert abs(loss - ref) <= loss_rtol * abs(ref), (loss, ref)
    assert cp_grads.keys() == ref_grads.keys()
    for name, g in cp_grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=rtol, atol=atol, msg=name)


def run_both(cp: int, flags: dict, tp: int = 1, pp: int = 1, dp: int = 1, vpp=None, backend=None):
    fn = partial(one_iteration, compile_backend=backend)
    with_cp = run_distributed(fn, tp * pp * dp * cp, tp=tp, pp=pp, vpp=vpp, cp=cp,
                              args=({**flags, "--context-parallel-size": cp},))
    without_cp = run_distributed(fn, tp * pp * dp, tp=tp, pp=pp, vpp=vpp, args=(flags,))
    return with_cp, without_cp


CASES = {  # id: (cp, flags, layout)
    "cp2": (2, {}, {}),
    "cp4-llama-gqa": (4, LLAMA, {}),
    "cp2-all-gather": (2, {**LLAMA, "--cp-comm-type": "allgather"}, {}),
    "cp4-all-gather-documents": (4, {**DOCS, "--cp-comm-type": "all_gather"}, {}),
    "cp2-documents": (2, {**LLAMA, **DOCS}, {}),
    "cp2-tp2-sequence-parallel": (2, {**LLAMA, "--tensor-model-parallel-size": 2, "--sequence-parallel": True},
                                  {"tp": 2}),
    "cp2-dp2": (2, {}, {"dp": 2}),
    "cp2-recompute-full": (2, {**LLAMA, "--recompute-granularity": "full", "--recompute-method": "uniform",
                               "--recompute-num-layers": 2}, {}),
    "cp2-recompute-selective": (2, {**LLAMA, **DOCS, "--recompute-granularity": "selective"}, {}),
    "cp2-unchunked-output-loss": (2, {"--no-chunked-output-loss": True}, {}),
    "cp2-per-token-loss-dp2": (2, {"--calculate-per-token-loss": True}, {"dp": 2}),
    "cp2-local-attention-backend": (2, {**DOCS, "--attention-backend": "local"}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_equals_cp1(case):
    cp, flags, layout = CASES[case]
    compare(*run_both(cp, flags, **layout))


PP_SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"--num-layers-per-virtual-pipeline-stage": 1},
                "zb-h1": {}, "zb-h2": {}, "zb-v": {"--num-layers-per-virtual-pipeline-stage": 1,
                                                            "--untie-embeddings-and-output-weights": True}}


@pytest.mark.parametrize("method", list(PP_SCHEDULES))
def test_context_parallel_under_every_synchronous_schedule(method):
    extra = PP_SCHEDULES[method]
    flags = {"--pipeline-model-parallel-size": 2, "--pipeline-method": "1f1b" if method == "interleaved" else method,
             **extra}
    if method != "gpipe":
        flags.update(DOCS)  # every stage then reads the micro-batch (document ids whole, positions split)
    vpp = 2 if "--num-layers-per-virtual-pipeline-stage" in extra else None
    compare(*run_both(2, flags, pp=2, vpp=vpp))


def test_context_parallel_under_torch_compile():
    """The compiled layers break their graph around the ring (its isend/irecv run eagerly)."""
    compare(*run_both(2, {**LLAMA, "--torch-compile": True}, backend="aot_eager"))
