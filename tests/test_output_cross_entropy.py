"""The chunked output layer + cross entropy (tensor_parallel/output_cross_entropy.py, --chunked-output-loss) equals
the unfused path (the logits, then `vocab_parallel_cross_entropy`):

- per-token losses, input and weight gradients, with and without label smoothing, over uneven chunks, both
  ways the backward gets them: the gradients computed in the forward and scaled (the loss's gradient is c *
  the loss weight given; nothing recomputed) and recomputed (any other gradient: random per token, or a
  mask the forward was not given): fp32 within rounding (rtol 1e-5 / atol 1e-6; measured: 5e-7 on the
  losses, 2e-7 relative on the gradients); bf16 weights and input: losses within 1e-5 (the same bf16
  logits, in fp32), gradients within bf16's resolution of the exact ones, as the unfused path's (2^-7 of
  the largest entry; measured: both within 0.65 %);
- TP = 2 (plain and sequence parallel, forked gloo ranks) = the single process's unfused results, both ways,
  with two all-reduces per chunk in a training forward (the unfused path makes three in all) and two in
  all in an evaluation;
- compiled (fullgraph): = the eager chunks within rounding, one graph per piece of math (a training forward's
  statistics and weighted gradients, a recomputing backward's gradients), no graph break, and no
  recompilation for another token count (dynamic in the tokens). "aot_eager" (TorchDynamo and
  AOTAutograd without code generation: the compiled branch of the math, the graphs and guards, in seconds);
  inductor's kernels run in tests/test_compiled_layers.py, whose compiled runs take the chunked loss;
- inside the pipelines: PipeOptim with every stage predicting (the backward must recompute the logits on
  the forward's weights, kept by the weight policy; the test shows the comparison fails without them),
  zero bubble's B/W split (the W op computes the output layer's weight gradient, as `_Linear`'s), and
  the NMT model with label smoothing over sentences of changing lengths; other methods run it by default
  (tests/test_async_policies.py, test_pipeline_parallel.py, test_zero_bubble.py, test_compiled_layers.py);
- bench/step/output_loss.py --quick runs.
"""

import os
import subprocess
import sys

import pytest
import torch
from dist_harness import run_distributed
from test_async_policies import SEED, VOCAB, get_batch, make_cfg

from megatron_po import parallel_state as ps
from megatron_po.pipeline.async_pipeline import AsyncEmulator
from megatron_po.pipeline.executor import Mailbox, StageRunner, emulate
from megatron_po.pipeline.partition import build_chunks_for_rank
from megatron_po.pipeline.schedules import build_schedule
from megatron_po.tensor_parallel import (ColumnParallelLinear, gather_tensor, model_parallel_seed,
                                         output_cross_entropy, vocab_parallel_cross_entropy)

S, B, H, V = 7, 3, 16, 64  # 21 tokens
CHUNK = 5 * V  # logits per chunk: 5 chunks of 4-5 tokens
FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(output_cross_entropy, "CHUNKS", 1)  # the count set by the logits per chunk
    monkeypatch.setattr(output_cross_entropy, "CHUNK_LOGITS", CHUNK)


def data(dtype=torch.float32, seq=S):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(seq, B, H, generator=g).to(dtype)
    target = torch.randint(0, V, (seq, B), generator=g)
    grad = torch.randn(seq, B, generator=g)
    return x, target, grad


def masked(seq=S):
    """A loss mask with zeros ([s, b]) and the gradient a masked mean gives each token's loss: c * mask."""
    mask = (torch.arange(seq * B).view(seq, B) % 5 != 3).float()
    return mask, mask * 0.37


def layer_of(dtype=torch.float32, **kwargs):
    torch.manual_seed(0)  # the full weight, whatever the TP size (layers.py)
    return ColumnParallelLinear(H, V, bias=False, **kwargs).to(dtype)


def loss_and_grads(layer, x, target, grad, smoothing, chunked, backend=None, loss_weight=None):
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = None
    if chunked:
        loss = output_cross_entropy.output_layer_cross_entropy(layer, x, target, smoothing, backend, loss_weight)
    else:
        loss = vocab_parallel_cross_entropy(layer(x)[0].float(), target, smoothing)
    loss.backward(grad)
    return loss.detach(), x.grad, layer.weight.grad


def recomputations(monkeypatch) -> list:
    """Counts the backward's passes that recompute the logits (`_grads`)."""
    calls, grads = [], output_cross_entropy._grads
    monkeypatch.setattr(output_cross_entropy, "_grads", lambda *a, **k: calls.append(1) or grads(*a, **k))
    return calls


# gradient given to the per-token losses, the loss weight the forward is told, whether the backward recomputes
GRADIENTS = {"scaled": ("masked", "mask", False), "random": ("random", "mask", True),
             "untold-mask": ("masked", None, True), "equal": ("equal", None, False)}


def gradient_case(case, seq=S):
    kind, told, recomputes = GRADIENTS[case]
    mask, masked_grad = masked(seq)
    grad = {"masked": masked_grad, "random": data(seq=seq)[2], "equal": torch.full((seq, B), 0.37)}[kind]
    return grad, (mask if told else None), recomputes


@pytest.mark.parametrize("case", list(GRADIENTS))
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_equals_unfused(dtype, smoothing, case, monkeypatch):
    layer = layer_of(dtype)
    x, target, _ = data(dtype)
    grad, loss_weight, recomputes = gradient_case(case)
    expected = loss_and_grads(layer, x, target, grad, smoothing, chunked=False)
    chunks = list(output_cross_entropy._chunks(S * B, V))
    assert [r.stop - r.start for r in chunks] == [5, 4, 4, 4, 4]
    calls = recomputations(monkeypatch)
    got = loss_and_grads(layer, x, target, grad, smoothing, chunked=True, loss_weight=loss_weight)
    assert len(calls) == recomputes
    torch.testing.assert_close(got[0], expected[0], **(FP32 if dtype == torch.float32 else dict(rtol=0, atol=1e-5)))
    # bf16: each path within bf16's resolution of the exact gradients (fp32 arithmetic on the same bf16 values);
    # they round at different places (the loss weight before the GEMMs and c after them), so each other's error
    # adds up (measured: both <= 0.65 % of the largest entry)
    exact = expected if dtype == torch.float32 else loss_and_grads(layer_of(dtype).float(), x.float(), target, grad,
                                                                   smoothing, chunked=False)
    for a, b, reference, what in zip(got[1:], expected[1:], exact[1:], ("input grad", "weight grad")):
        assert a.dtype == b.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, **FP32, msg=what)
        else:
            for path in (a, b):
                assert (path.float() - reference).abs().max() <= 2 ** -7 * reference.abs().max(), what


def test_chunks_are_at_least_chunks_and_at_most_chunk_logits(monkeypatch):
    monkeypatch.setattr(output_cross_entropy, "CHUNKS", 6)
    sizes = lambda tokens, vocab: [r.stop - r.start for r in output_cross_entropy._chunks(tokens, vocab)]  # noqa: E731
    assert sizes(21, 10) == [4, 4, 4, 3, 3, 3]  # CHUNKS, however few logits
    assert sizes(40, V) == [5] * 8  # 40 x 64 logits, at most 5 x 64 a chunk: more than CHUNKS
    assert sizes(4, V) == [2, 2] and sizes(3, V) == [3] and sizes(1, V) == [1]  # two tokens at least, or all


def test_a_second_backward_through_a_kept_graph_recomputes(monkeypatch):
    layer = layer_of()
    x, target, _ = data()
    mask, grad = masked()
    calls = recomputations(monkeypatch)
    xi = x.clone().requires_grad_()
    loss = output_cross_entropy.output_layer_cross_entropy(layer, xi, target, loss_weight=mask)
    loss.backward(grad, retain_graph=True)
    assert calls == []  # the forward's gradients, handed out (scaled in place) once
    loss.backward(grad)
    assert calls == [1]
    expected = loss_and_grads(layer_of(), x, target, grad, 0.0, chunked=False)
    torch.testing.assert_close(xi.grad, 2 * expected[1], **FP32)
    torch.testing.assert_close(layer.weight.grad, 2 * expected[2], **FP32)


# ---- TP = 2 ---------------------------------------------------------------------------------------------------------

def _tp_run(seq):
    import torch.distributed as dist
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    x, target, _ = data(seq=seq)
    out = {}
    calls = []
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)
    for sp in (False, True):
        layer = layer_of(sequence_parallel=sp)
        xs = x.chunk(tp, dim=0)[rank] if sp else x  # sequence parallel: this rank's part of the sequence
        for smoothing in (0.0, 0.1):
            for case in ("scaled", "random", "evaluation"):
                grad, loss_weight, _ = gradient_case("scaled" if case == "evaluation" else case, seq)
                calls.clear()
                dist.all_reduce = counting
                try:
                    xi = xs.clone().requires_grad_()
                    layer.weight.grad = None
                    with torch.set_grad_enabled(case != "evaluation"):
                        loss = output_cross_entropy.output_layer_cross_entropy(layer, xi, target, smoothing,
                                                                               loss_weight=loss_weight)
                finally:
                    dist.all_reduce = all_reduce
                if case != "evaluation":
                    loss.backward(grad)
                out[(sp, smoothing, case)] = (loss.detach(), xi.grad, layer.weight.grad, len(calls))
    return out


def test_tp2_chunked_equals_single_process_unfused():
    seq = 8  # sequence parallelism splits the sequence in two
    results = run_distributed(_tp_run, 2, tp=2, args=(seq,))
    x, target, _ = data(seq=seq)
    chunks = len(list(output_cross_entropy._chunks(seq * B, V // 2)))
    for sp in (False, True):
        for smoothing in (0.0, 0.1):
            for case in ("scaled", "random", "evaluation"):
                grad = gradient_case("scaled" if case == "evaluation" else case, seq)[0]
                loss, x_grad, w_grad = loss_and_grads(layer_of(), x, target, grad, smoothing, chunked=False)
                ranks = [r[(sp, smoothing, case)] for r in results]
                for rank_loss, _, _, all_reduces in ranks:
                    torch.testing.assert_close(rank_loss, loss, **FP32)
                    # the max, then the rescaled sums with the target logits: per chunk in a training forward
                    # (the row's softmax before its gradient), once over all chunks in an evaluation
                    assert all_reduces == (2 if case == "evaluation" else 2 * chunks), (case, all_reduces)
                if case == "evaluation":
                    continue
                got_x = torch.cat([r[1] for r in ranks]) if sp else ranks[0][1]
                torch.testing.assert_close(got_x, x_grad, **FP32)
                torch.testing.assert_close(gather_tensor([r[2] for r in ranks], 0), w_grad, **FP32)


# ---- compiled: graphs, graph breaks, recompilations --------------------------------------------------------------------

def test_compiled_chunks_equal_eager_without_breaks_or_recompiles(monkeypatch):
    from torch._dynamo.utils import counters

    from megatron_po.models.compiled_layers import compile_stats
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(output_cross_entropy, "_compiled", {})
    layer = layer_of()
    graphs = []
    # 21 tokens in 5 chunks of 4-5, then 33 in 9 of 3-4; the gradients computed in the forward, then recomputed
    for seq, case in ((S, "scaled"), (11, "scaled"), (S, "random"), (11, "random")):
        x, target, _ = data(seq=seq)
        grad, loss_weight, _ = gradient_case(case, seq)
        expected = loss_and_grads(layer, x, target, grad, 0.1, chunked=True, loss_weight=loss_weight)
        got = loss_and_grads(layer, x, target, grad, 0.1, chunked=True, backend="aot_eager", loss_weight=loss_weight)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, **FP32)
        graphs.append(compile_stats()["graphs"])
    # a training forward's two graphs (the chunk's statistics and exp, its weighted logit gradients), then the
    # recomputing backward's (logit gradients), each dynamic in the tokens
    assert graphs == [2, 2, 3, 3], graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


# ---- inside the pipelines ---------------------------------------------------------------------------------------------

def pipeoptim_run(chunked, s_offset=1, segment=6):
    """PipeOptim at D = 2 with s_offset 1: the last stage's forward too runs on a prediction, its backward on the
    live weights."""
    model_parallel_seed(SEED)
    cfg = make_cfg(2)
    cfg.model.chunked_output_loss = chunked
    emu = AsyncEmulator(cfg, VOCAB, "pipeoptim", 2, 1, 1, "adam", {"lr": 1e-3, "weight_decay": 0.01},
                        lambda i: 1e-3, 0.0, s_offset=s_offset)
    losses = emu.train_segment(get_batch, segment)
    return losses, emu.full_state_dict()


def test_pipeoptim_backward_recomputes_the_logits_on_the_forward_weights(monkeypatch):
    unfused_losses, unfused = pipeoptim_run(False)
    losses, weights = pipeoptim_run(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(unfused_losses), **FP32)
    for k in unfused:
        torch.testing.assert_close(weights[k], unfused[k], rtol=1e-4, atol=1e-5, msg=k)
    # Recomputed on the backward's weights instead, the output layer's gradients (and the weights) differ
    monkeypatch.setattr(output_cross_entropy, "weights_kept_for_recompute", lambda params: None)
    _, wrong = pipeoptim_run(True)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong["output_layer.weight"], unfused["output_layer.weight"], rtol=1e-4, atol=1e-5)


def zero_bubble_run(chunked, D=2, M=4):
    """ZB-H1 in the emulator: the micro-batch losses, the gradients, and the W ops' deferred closures."""
    model_parallel_seed(SEED)
    cfg = make_cfg(2 * D)
    cfg.model.chunked_output_loss = chunked
    cfg.parallel.pipeline_method = "zb-h1"
    chunks = {r: build_chunks_for_rank(cfg, VOCAB, r, D, 1) for r in range(D)}
    params = [p for r in range(D) for c in chunks[r] for p in c.parameters()]
    mailbox = Mailbox()
    runners = {r: StageRunner(rank=r, num_stages=D, chunks=chunks[r], transport=mailbox, get_batch=get_batch,
                              loss_scale=1.0 / M) for r in range(D)}
    deferred = []
    original = StageRunner.backward_weight

    def counting(self, mb, c, sync_grads=False):
        deferred.append(len(self.deferred[(mb, c)]))
        output_layer = self.chunks[c].output_layer
        before = None if output_layer is None or output_layer.weight.grad is None else output_layer.weight.grad.clone()
        original(self, mb, c, sync_grads)
        if output_layer is not None:  # the W op, not the B op, gave the output layer its gradient
            assert before is None or not torch.equal(before, output_layer.weight.grad)
    StageRunner.backward_weight = counting
    try:
        emulate(build_schedule("zb-h1", D, 1, M), runners)
    finally:
        StageRunner.backward_weight = original
    return [runners[D - 1].losses[m] for m in range(M)], [p.grad for p in params], sum(deferred)


def test_zero_bubble_defers_the_output_layer_weight_gradient_to_w(monkeypatch):
    unfused = zero_bubble_run(False)
    calls = recomputations(monkeypatch)
    chunked = zero_bubble_run(True)
    assert calls == []  # the executor hands the model its loss mask: the forward's gradients hold
    torch.testing.assert_close(torch.stack(chunked[0]), torch.stack(unfused[0]), **FP32)
    for a, b in zip(chunked[1], unfused[1]):
        torch.testing.assert_close(a, b, **FP32)
    assert chunked[2] == unfused[2] == 4 * (4 * 4 + 1)  # per micro-batch: 4 linears in 4 layers, the output layer


def test_nmt_label_smoothed_loss_chunked_equals_unfused(monkeypatch):
    from test_nmt_model import SEED as NMT_SEED, VARIANTS, batches, make_cfg as nmt_cfg

    from megatron_po.models.gpt import masked_mean_loss
    from megatron_po.models.nmt import NMTModel
    results = []
    calls = recomputations(monkeypatch)
    for chunked in (False, True):
        cfg = nmt_cfg("shared")  # tied output layer, label smoothing 0.1
        cfg.model.chunked_output_loss = chunked
        model_parallel_seed(NMT_SEED)
        model = NMTModel(cfg.model, cfg.nmt, *VARIANTS["shared"]["vocab"], NMT_SEED)
        losses = []
        for b in batches(VARIANTS["shared"]["vocab"], n=3):  # lengths change every batch
            loss = masked_mean_loss(model(b), b["loss_mask"])
            loss.backward()
            losses.append(loss.detach())
        results.append((torch.stack(losses), [p.grad for p in model.parameters()]))
    assert calls == []  # the batch's loss mask reaches the chunked loss: its gradients are the forward's
    torch.testing.assert_close(results[1][0], results[0][0], **FP32)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, **FP32)


def test_output_loss_bench_quick():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "bench/step/output_loss.py", "--quick"], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| unfused", "| chunked"))]
    assert len(rows) == 2, out.stdout
    # both variants computed the same losses (the last column: their sum), each in its own process
    sums = [float(row.split("|")[-2]) for row in rows]
    assert abs(sums[0] - sums[1]) <= 1e-5 * abs(sums[0]), rows
