"""The output layer and the vocab-parallel cross entropy as one computation over chunks of tokens, which never
holds the [tokens x V/tp] logits (--chunked-output-loss, the default; docs/compile.md).

The unfused path (`ColumnParallelLinear` then `vocab_parallel_cross_entropy`) materialises the logits, their
fp32 copy and the softmax: at vocab 50,257 and 4 x 2048 tokens 1.6 GB per fp32 copy, the largest activations
of the model. Here the tokens go through in `CHUNKS` chunks (more where one would exceed `CHUNK_LOGITS` logits),
and a training forward computes the gradients too, while it has each chunk's logits (as Liger-Kernel's fused
linear cross entropy):

    forward, per chunk:   z = x_c W^T (the weight's dtype, then fp32) -> row max m, p = exp(z - m) in place,
                          sum_j p_j, the target's logit (and sum_j z_j with label smoothing);
                          at TP > 1 the max all-reduced (MAX), the sums rescaled to it and all-reduced (SUM)
                          -> log-sum-exp and the loss per token, as in cross_entropy.py;
                          then w * dL/dz = w * (softmax(z) - (1 - a) onehot - a/V), from p in place, with w the
                          token's loss weight (its loss mask; 1 when none is given), and from it
                          G_x[c] = (w dL/dz) W and G_W += (w dL/dz)^T x_c (fp32); z is dropped
    backward:             the loss's gradient is c * w for a scalar c (the caller's masked sum or mean, times
                          the loss scale): dL/dx = c G_x, dL/dW = c G_W; no logits recomputed, the output
                          layer's three GEMMs of the unfused path and no fourth

Between the passes it keeps G_x ([tokens x h], the input's dtype) and G_W ([V/tp x h], fp32) besides the
[tokens] vectors. The backward checks, with one host sync, that the gradient it gets is c * w; where it is not
(a caller weighting the losses otherwise), it recomputes as below. Whether the backward reads the forward's
weights is the weight policy's word, not something a check could see (the asynchronous methods write weights
in place through `.data`, which leaves autograd's version counters alone, and swap in equal weights as other
tensors): a `recompute_weights` provider (tensor_parallel/random.py) says they will differ, and then the
forward keeps only the statistics, and the backward recomputes each chunk's logits on the forward's weights
(kept by the weight policy), dL/dz = (softmax(z) - (1 - a) onehot - a/V) * dL/dloss, dL/dx_c = dL/dz W (the
weights in the parameter at backward time, as `_Linear`'s), dL/dW += dL/dz^T x_c: one more GEMM of the output
layer per micro-batch (the price of the memory, as before the gradients moved into the forward). Under zero
bubble's split backward (weight_grads.py) the B op returns the input gradient and queues the weight
gradient, which the W op scales (or, recomputing, computes from the logits recomputed once more).

TP collectives: a training forward all-reduces twice per chunk (each chunk's softmax needs the whole row's
max and sum before its gradient); an evaluation, or a recomputing forward, twice in all (one fewer than
cross_entropy.py's three). They run eagerly between the chunks' math; with --torch-compile that math (the
GEMM, the reductions, the softmax gradient) runs as graphs compiled with `fullgraph=True`, dynamic in the
number of tokens, so neither a smaller last chunk nor another sequence length recompiles them.

Results equal the unfused path's within rounding, not bitwise: the max is merged chunk by chunk and over TP
ranks before the sums are rescaled to it, and the loss weight is applied before the GEMMs and c after them
(tests/test_output_cross_entropy.py states the tolerances).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_po.dynamo_import import import_dynamo
from megatron_po.parallel_state import get_tensor_model_parallel_world_size
from megatron_po.tensor_parallel import weight_grads
from megatron_po.tensor_parallel.cross_entropy import _all_reduce, local_targets
from megatron_po.tensor_parallel.layers import ColumnParallelLinear
from megatron_po.tensor_parallel.random import weights_kept_for_recompute

# Chunks a pass makes, at least. Each training chunk holds its fp32 logits (and, eagerly, their gradient in the
# weight's dtype): about 1/CHUNKS of the unfused path's; and each one reads and writes the fp32 weight-gradient
# accumulator [V/tp x h] once, so that memory traffic grows with the count (at 4 x 2048 tokens and V 50,304 on a GPU,
# 25 chunks moved about 31 GB a micro-batch; bench/results/gpu_nvidia_h100_80gb_hbm3_2026-11-27, docs/gpu.md).
CHUNKS = 6
# Logits per chunk, at most (1 GiB in fp32): long sequences and large vocabularies take more chunks than CHUNKS.
CHUNK_LOGITS = 2 ** 28


def _chunks(num_tokens: int, partition_vocab_size: int):
    """Row ranges: CHUNKS of them, or more where a chunk would exceed CHUNK_LOGITS logits, of sizes differing by
    at most one, and of two tokens at least (a compiled graph specializes a dim of size 1: no chunk of one token
    unless the whole is)."""
    count = max(CHUNKS, -(-num_tokens * partition_vocab_size // CHUNK_LOGITS))
    count = max(1, min(count, num_tokens // 2))
    size, longer = divmod(num_tokens, count)
    start = 0
    for i in range(count):
        stop = start + size + (i < longer)
        yield slice(start, stop)
        start = stop


# ---- the per-chunk math (compiled with --torch-compile) ------------------------------------------------------------

def _chunk_exp_statistics(hidden, weight, masked_target, in_slice, smoothing: bool):
    """The chunk's exp(z - row max) [chunk x V] (fp32), then per token: the max of its logits, sum_j exp(z_j -
    max), its target's logit (0 off this rank's vocab slice) and, with label smoothing, sum_j z_j."""
    logits = F.linear(hidden, weight).float()
    row_max = logits.amax(dim=-1)
    target_logit = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_slice, 0.0)
    sum_logits = logits.sum(dim=-1) if smoothing else None
    exp = logits.sub_(row_max.unsqueeze(-1)).exp_()  # in place: one [chunk x V] buffer eagerly
    return (exp, row_max, exp.sum(dim=-1), target_logit) + ((sum_logits,) if smoothing else ())


def _chunk_statistics(hidden, weight, masked_target, in_slice, smoothing: bool):
    """`_chunk_exp_statistics` without the exp (compiled, the graph does not write it: its sum reads it as made)."""
    return _chunk_exp_statistics(hidden, weight, masked_target, in_slice, smoothing)[1:]


def _logit_grads_of(probs, masked_target, in_slice, row_scale, label_smoothing: float, vocab_size: int, dtype):
    """(softmax - (1 - a) onehot - a/V) * row_scale, from `probs` (the softmax, in place), in `dtype` (the
    weight's: the unfused path casts it so in `.float()`'s backward)."""
    hit = (1.0 - label_smoothing) * in_slice.to(probs.dtype)
    if torch.compiler.is_compiling():  # one pointwise kernel: the one-hot as a comparison with the column index
        columns = torch.arange(probs.shape[-1], device=probs.device)
        grad = probs - torch.where(columns == masked_target.unsqueeze(-1), hit.unsqueeze(-1), 0.0)
    else:  # eagerly: in place, no [chunk x V] one-hot
        grad = probs.scatter_add_(-1, masked_target.unsqueeze(-1), -hit.unsqueeze(-1))
    if label_smoothing > 0:
        grad = grad.sub_(label_smoothing / vocab_size)
    return grad.mul_(row_scale.unsqueeze(-1)).to(dtype)


def _chunk_logit_grads(hidden, weight, masked_target, in_slice, log_sum_exp, grad_loss, label_smoothing: float,
                       vocab_size: int):
    """d loss / d logits of the chunk, its logits recomputed, in the weight's dtype."""
    probs = F.linear(hidden, weight).float().sub_(log_sum_exp.unsqueeze(-1)).exp_()
    return _logit_grads_of(probs, masked_target, in_slice, grad_loss, label_smoothing, vocab_size, weight.dtype)


def _chunk_weighted_grads(exp, masked_target, in_slice, softmax_scale, loss_weight, label_smoothing: float,
                          vocab_size: int, dtype):
    """loss weight * d loss / d logits of the chunk, from its exp(z - row max) (`_chunk_exp_statistics`, in
    place) and exp(row max - log-sum-exp), which turns it into the softmax."""
    probs = exp.mul_(softmax_scale.unsqueeze(-1))
    return _logit_grads_of(probs, masked_target, in_slice, loss_weight, label_smoothing, vocab_size, dtype)


_MATH = (_chunk_statistics, _chunk_logit_grads, _chunk_exp_statistics, _chunk_weighted_grads)
_compiled: dict[str, tuple] = {}  # backend -> _MATH under torch.compile


def _chunk_functions(backend: str | None) -> tuple:
    if backend is None:
        return _MATH
    if backend not in _compiled:
        import_dynamo()  # before torch.compile would, holding our callers' frames (dynamo_import.py)
        _compiled[backend] = tuple(torch.compile(fn, backend=backend, fullgraph=True) for fn in _MATH)
    return _compiled[backend]


def _token_dim_dynamic(backend: str | None, *tensors) -> None:
    """Compiled: the token dim (0) is dynamic from the first call (a last, smaller chunk or another length
    reuses the graph)."""
    if backend is not None:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _merge(row_max, sum_exp, target_logit, sum_logits, vocab_size: int, label_smoothing: float):
    """Per token: the max over every TP rank, log-sum-exp and the loss, from this rank's statistics (two
    all-reduces: the max, then the sums rescaled to it with the target logits)."""
    global_max = row_max.clone()
    _all_reduce(global_max, op=dist.ReduceOp.MAX)
    sums = torch.stack([sum_exp * (row_max - global_max).exp(), target_logit, *sum_logits])
    _all_reduce(sums)
    log_sum_exp = global_max + sums[0].log()
    loss = log_sum_exp - sums[1]
    if label_smoothing > 0:  # mean_j log p_j = mean_j z_j - log sum_j exp z_j (cross_entropy.py)
        mean_log_probs = sums[2] / vocab_size - log_sum_exp
        loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs
    return log_sum_exp, loss


# ---- the autograd function -------------------------------------------------------------------------------------------

class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, loss_weight, label_smoothing, backend, forward_weights, grads_now):
        """hidden [T, h] (the TP region's input), weight [V/tp, h], target [T], loss_weight [T] (fp32) ->
        per-token loss [T] (fp32). `grads_now`: compute the gradients in this pass (the backward will read
        these weights)."""
        # Detached: a compiled graph guards on requires_grad, which an evaluation's input would change
        hidden_, weight_ = hidden.detach(), weight.detach()
        partition_vocab = weight.shape[0]
        vocab_size = partition_vocab * get_tensor_model_parallel_world_size()
        masked_target, off_slice = local_targets(target, partition_vocab)
        in_slice = ~off_slice
        ctx.weight = weight  # the Parameter itself: the deferred W op accumulates into it (layers._Linear)
        ctx.label_smoothing, ctx.vocab_size, ctx.backend = label_smoothing, vocab_size, backend
        ctx.forward_weights = forward_weights
        if grads_now:
            loss, log_sum_exp, grad_input, grad_weight = _forward_with_grads(ctx, hidden_, weight_, masked_target,
                                                                             in_slice, loss_weight)
            ctx.save_for_backward(hidden, weight, masked_target, in_slice, log_sum_exp, loss_weight)
            # Handed out, scaled in place, by the first backward (a second one through a kept graph recomputes)
            ctx.kept_grads = (grad_input, grad_weight)
            return loss
        statistics = _chunk_functions(backend)[0]
        pieces = []
        for rows in _chunks(hidden.shape[0], partition_vocab):
            args = (hidden_[rows], masked_target[rows], in_slice[rows])
            _token_dim_dynamic(backend, *args)
            pieces.append(statistics(args[0], weight_, args[1], args[2], label_smoothing > 0))
        row_max, sum_exp, target_logit, *sum_logits = (torch.cat(p) for p in zip(*pieces))
        log_sum_exp, loss = _merge(row_max, sum_exp, target_logit, sum_logits, vocab_size, label_smoothing)
        ctx.save_for_backward(hidden, weight, masked_target, in_slice, log_sum_exp)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, masked_target, in_slice, log_sum_exp, *kept = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        defer = weight_grads.deferring() and need_weight and ctx.weight.grad_fn is None
        kept_grads, ctx.kept_grads = getattr(ctx, "kept_grads", None), None
        scale = None if kept_grads is None else _scale_of_kept_grads(grad_loss, *kept)
        if scale is not None:  # the forward's gradients hold: scaled, nothing recomputed
            grad_input, grad_weight = kept_grads
            grad_input = _scaled(grad_input, scale, hidden.dtype) if need_input else None
            grad_weight = _scaled(grad_weight, scale, weight.dtype) if need_weight else None
            if defer:
                weight_grads.defer(functools.partial(_scaled_weight_grad, ctx.weight, grad_weight))
                grad_weight = None
            return grad_input, grad_weight, None, None, None, None, None, None
        hidden = hidden.detach()
        # The logits' weights: the forward's, kept by the weight policy where they changed since
        forward_weight = weight.detach()
        if ctx.forward_weights is not None:
            with torch.no_grad(), ctx.forward_weights():
                forward_weight = weight.detach().clone()
        pass_args = (hidden, forward_weight, masked_target, in_slice, log_sum_exp, grad_loss.contiguous(),
                     ctx.label_smoothing, ctx.vocab_size, ctx.backend)
        grad_input, grad_weight = _grads(*pass_args, input_grad_weight=weight.detach() if need_input else None,
                                         weight_grad=need_weight and not defer)
        if defer:  # zero bubble's B op: the W op recomputes the logits for the weight gradient
            weight_grads.defer(functools.partial(_deferred_weight_grad, ctx.weight, pass_args))
        return grad_input, grad_weight, None, None, None, None, None, None


def _forward_with_grads(ctx, hidden, weight, masked_target, in_slice, loss_weight):
    """The training forward: per-token loss and log-sum-exp, G_x = (w dL/dz) W (None unless the input needs it)
    and G_W = sum over chunks of (w dL/dz)^T x_c in fp32 (None unless the weight needs it)."""
    _, _, exp_statistics, weighted_grads = _chunk_functions(ctx.backend)
    smoothing, backend = ctx.label_smoothing, ctx.backend
    want_input, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_input = torch.empty_like(hidden) if want_input else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    log_sum_exps, losses = [], []
    for rows in _chunks(hidden.shape[0], weight.shape[0]):
        x, target, in_slice_c, w = hidden[rows], masked_target[rows], in_slice[rows], loss_weight[rows]
        _token_dim_dynamic(backend, x, target, in_slice_c, w)
        exp, row_max, sum_exp, target_logit, *sum_logits = exp_statistics(x, weight, target, in_slice_c,
                                                                          smoothing > 0)
        log_sum_exp, loss = _merge(row_max, sum_exp, target_logit, sum_logits, ctx.vocab_size, smoothing)
        softmax_scale = (row_max - log_sum_exp).exp()
        _token_dim_dynamic(backend, exp, softmax_scale)
        grad_logits = weighted_grads(exp, target, in_slice_c, softmax_scale, w, smoothing, ctx.vocab_size,
                                     weight.dtype)
        del exp
        if grad_input is not None:
            torch.mm(grad_logits, weight, out=grad_input[rows])
        if grad_weight is not None:
            _accumulate(grad_weight, grad_logits.t(), x)
        log_sum_exps.append(log_sum_exp)
        losses.append(loss)
    return torch.cat(losses), torch.cat(log_sum_exps), grad_input, grad_weight


def _scale_of_kept_grads(grad_loss, loss_weight):
    """c where `grad_loss` = c * loss_weight (to rounding): the forward's gradients then hold, scaled by c (a
    0-dim tensor); else None. One host sync."""
    grad_loss = grad_loss.float()
    at = loss_weight.abs().argmax().view(1)  # read through index_select: indexing with a tensor would sync twice more
    weight_at, grad_at = loss_weight.index_select(0, at)[0], grad_loss.index_select(0, at)[0]
    scale = torch.where(weight_at != 0, grad_at / weight_at, 0.0)
    expected = scale * loss_weight
    if not bool(((grad_loss - expected).abs() <= 1e-6 * expected.abs()).all()):
        return None
    return scale


def _scaled(grad, scale, dtype):
    """grad * scale in `dtype`, scaled in place (the forward's gradients go out once)."""
    return grad.mul_(scale).to(dtype)


def _scaled_weight_grad(weight, grad_weight):
    return [(weight, grad_weight)]


_FP32_OUT_GEMM = {"usable": True}  # False once torch.addmm(out_dtype=) failed here (it exists on CUDA, torch >= 2.8)


def _accumulate(grad_weight, grad_logits_t, hidden):
    """grad_weight (fp32) += grad_logits_t @ hidden, in place: for low-precision operands on a GPU one GEMM whose
    fp32 output is the accumulator (cuBLAS accumulates in fp32 anyway; no [V/tp x h] product in between, which
    every chunk would write and read again), else through the product in the operands' dtype."""
    if grad_logits_t.dtype == torch.float32:  # addmm's out= form, which torch's FLOP counter counts (addmm_ it does not)
        torch.addmm(grad_weight, grad_logits_t, hidden, out=grad_weight)
        return
    if grad_logits_t.is_cuda and _FP32_OUT_GEMM["usable"]:
        try:
            torch.addmm(grad_weight, grad_logits_t, hidden, out_dtype=torch.float32, out=grad_weight)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # this torch has no such GEMM: the product, always
            _FP32_OUT_GEMM["usable"] = False
    grad_weight += grad_logits_t.mm(hidden)


def _grads(hidden, forward_weight, masked_target, in_slice, log_sum_exp, grad_loss, label_smoothing, vocab_size,
           backend, input_grad_weight=None, weight_grad=False):
    """Chunk by chunk, the logits recomputed: the input's gradient through `input_grad_weight` (None: not wanted)
    and, with `weight_grad`, the weight's (accumulated in fp32 for a low-precision weight; returned in its dtype);
    None for one not wanted."""
    logit_grads = _chunk_functions(backend)[1]
    grad_input = torch.empty_like(hidden) if input_grad_weight is not None else None
    grad_weight = None
    if weight_grad:
        grad_weight = torch.zeros(forward_weight.shape, dtype=torch.float32, device=forward_weight.device)
    for rows in _chunks(hidden.shape[0], forward_weight.shape[0]):
        args = (hidden[rows], masked_target[rows], in_slice[rows], log_sum_exp[rows], grad_loss[rows])
        _token_dim_dynamic(backend, *args)
        grad_logits = logit_grads(args[0], forward_weight, *args[1:], label_smoothing, vocab_size)
        if grad_input is not None:
            torch.mm(grad_logits, input_grad_weight, out=grad_input[rows])
        if grad_weight is not None:
            _accumulate(grad_weight, grad_logits.t(), hidden[rows])
    return grad_input, None if grad_weight is None else grad_weight.to(forward_weight.dtype)


@torch.no_grad()  # as in the backward: the W op runs outside autograd, and grad mode is a compiled graph's guard
def _deferred_weight_grad(weight, pass_args):
    _, grad_weight = _grads(*pass_args, weight_grad=True)
    return [(weight, grad_weight)]


def output_layer_cross_entropy(output_layer: ColumnParallelLinear, hidden: torch.Tensor, target: torch.Tensor,
                               label_smoothing: float = 0.0, backend: str | None = None,
                               loss_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token cross entropy [s, b] of `output_layer`'s logits of `hidden` [s, b, h] (the last stage's
    final-normed states; [s/tp, b, h] under sequence parallelism) against `target` [s, b]: what
    `vocab_parallel_cross_entropy(output_layer(hidden)[0].float(), target, label_smoothing)` computes.
    `backend`: the per-chunk math under torch.compile with that backend (--torch-compile), else eagerly.
    `loss_weight` [s, b]: how the caller will weight the losses (its loss mask; default: equally); a backward
    whose gradient is another weighting is still exact, but recomputes the logits (see the module docstring)."""
    if output_layer.bias is not None or output_layer.gather_output:
        raise ValueError("output_layer_cross_entropy: an output layer without bias and with vocab-parallel output")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    x = output_layer.parallel_input(hidden)  # [s, b, h]: the TP region mapping (its collectives run eagerly)
    weight = output_layer.weight
    # Read here, not in output_layer's forward, whose pre-hooks would wait for an overlapped all-gather of it
    # (--overlap-param-gather): the DDP waits for it before the chunk's forward instead (distributed/ddp.py).
    weight.read_outside_forward = True
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    forward_weights = weights_kept_for_recompute([weight]) if needs_grad else None
    flat_target = target.reshape(-1)
    if loss_weight is None:
        loss_weight = torch.ones(flat_target.shape, dtype=torch.float32, device=flat_target.device)
    else:
        loss_weight = loss_weight.reshape(-1).to(torch.float32)
    # The gradients in the forward where the backward will read its weights (no provider keeps others for it)
    loss = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, flat_target, loss_weight, label_smoothing,
                                     backend, forward_weights, needs_grad and forward_weights is None)
    return loss.view(target.shape)
