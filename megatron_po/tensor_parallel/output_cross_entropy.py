"""The output layer and the vocab-parallel cross entropy as one computation over chunks of tokens, which never
holds the [tokens x V/tp] logits (--chunked-output-loss, the default; docs/compile.md).

The unfused path (`ColumnParallelLinear` then `vocab_parallel_cross_entropy`) materialises the logits, their
fp32 copy and the softmax: at vocab 50,257 and 4 x 2048 tokens 1.6 GB per fp32 copy, the largest activations
of the model. Here the tokens go through in chunks of about `CHUNK_LOGITS` logits:

    forward,  per chunk:  z = x_c W^T (the weight's dtype, then fp32)   -> row max m_c, sum_j exp(z_j - m_c),
                          the target's logit (and sum_j z_j with label smoothing); z is dropped
    then, once:           the max all-reduced (MAX), the sums rescaled to it and all-reduced (SUM) with
                          the target logits: log-sum-exp and the loss per token, as in cross_entropy.py
    backward, per chunk:  z recomputed, dL/dz = (softmax(z) - (1 - a) onehot - a/V) * dL/dloss,
                          dL/dx_c = dL/dz W, dL/dW += dL/dz^T x_c

Only [tokens] vectors are kept between the passes (log-sum-exp, targets) besides the input: the backward
recomputes each chunk's logits, one more GEMM of the output layer per micro-batch (the price of the memory).
The TP collectives (two all-reduces of [tokens] vectors, one fewer than cross_entropy.py's three) run
eagerly between the chunks' math; with --torch-compile that per-chunk math (the GEMM, the reductions,
the softmax gradient) runs as two graphs compiled with `fullgraph=True`, dynamic in the number of tokens, so
neither a smaller last chunk nor another sequence length recompiles them.

What the backward reads, as the unfused path's: the softmax of the forward's weights (the logits are
recomputed on them: under the asynchronous methods a `recompute_weights` provider keeps them, as for an
activation recomputation, tensor_parallel/random.py) and, for the input gradient, the weights in the
parameter at backward time (`_Linear`). Under zero bubble's split backward (weight_grads.py) the B op
computes the input gradient and queues the weight gradient, which the W op computes from the logits
recomputed once more.

Results equal the unfused path's within rounding, not bitwise: the max is merged chunk by chunk and over TP
ranks before the sums are rescaled to it (tests/test_output_cross_entropy.py states the tolerances).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_po.parallel_state import get_tensor_model_parallel_world_size
from megatron_po.tensor_parallel import weight_grads
from megatron_po.tensor_parallel.cross_entropy import _all_reduce, local_targets
from megatron_po.tensor_parallel.layers import ColumnParallelLinear
from megatron_po.tensor_parallel.random import weights_kept_for_recompute

CHUNK_LOGITS = 2 ** 24  # logits per chunk (64 MiB in fp32), at most: tokens per chunk ~ this // (V / tp)


def _chunks(num_tokens: int, partition_vocab_size: int):
    """Row ranges of about CHUNK_LOGITS logits each, of sizes differing by at most one (a compiled graph
    specializes a dim of size 1: no last chunk of one token unless the whole is)."""
    count = max(1, -(-num_tokens // max(1, CHUNK_LOGITS // partition_vocab_size)))
    size, longer = divmod(num_tokens, count)
    start = 0
    for i in range(count):
        stop = start + size + (i < longer)
        yield slice(start, stop)
        start = stop


# ---- the per-chunk math (compiled with --torch-compile) ------------------------------------------------------------

def _chunk_statistics(hidden, weight, masked_target, in_slice, smoothing: bool):
    """Per token of the chunk: the max of its logits, sum_j exp(z_j - max), its target's logit (0 off this
    rank's vocab slice) and, with label smoothing, sum_j z_j."""
    logits = F.linear(hidden, weight).float()
    row_max = logits.amax(dim=-1)
    target_logit = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_slice, 0.0)
    sum_logits = logits.sum(dim=-1) if smoothing else None
    sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)  # in place: one [chunk x V] buffer eagerly
    return (row_max, sum_exp, target_logit) + ((sum_logits,) if smoothing else ())


def _chunk_logit_grads(hidden, weight, masked_target, in_slice, log_sum_exp, grad_loss, label_smoothing: float,
                       vocab_size: int):
    """d loss / d logits of the chunk, in the weight's dtype (the unfused path casts it so in `.float()`'s
    backward)."""
    probs = F.linear(hidden, weight).float().sub_(log_sum_exp.unsqueeze(-1)).exp_()
    hit = (1.0 - label_smoothing) * in_slice.to(probs.dtype)
    if torch.compiler.is_compiling():  # one pointwise kernel: the one-hot as a comparison with the column index
        columns = torch.arange(probs.shape[-1], device=probs.device)
        grad = probs - torch.where(columns == masked_target.unsqueeze(-1), hit.unsqueeze(-1), 0.0)
    else:  # eagerly: in place, no [chunk x V] one-hot
        grad = probs.scatter_add_(-1, masked_target.unsqueeze(-1), -hit.unsqueeze(-1))
    if label_smoothing > 0:
        grad = grad.sub_(label_smoothing / vocab_size)
    return grad.mul_(grad_loss.unsqueeze(-1)).to(weight.dtype)


_compiled: dict[str, tuple] = {}  # backend -> (statistics, logit grads) under torch.compile


def _chunk_functions(backend: str | None) -> tuple:
    if backend is None:
        return _chunk_statistics, _chunk_logit_grads
    if backend not in _compiled:
        _compiled[backend] = tuple(torch.compile(fn, backend=backend, fullgraph=True)
                                   for fn in (_chunk_statistics, _chunk_logit_grads))
    return _compiled[backend]


def _token_dim_dynamic(backend: str | None, *tensors) -> None:
    """Compiled: the token dim (0) is dynamic from the first call (a last, smaller chunk or another length
    reuses the graph)."""
    if backend is not None:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)


# ---- the autograd function -------------------------------------------------------------------------------------------

class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, label_smoothing, backend, forward_weights):
        """hidden [T, h] (the TP region's input), weight [V/tp, h], target [T] -> per-token loss [T] (fp32)."""
        statistics, _ = _chunk_functions(backend)
        # Detached: a compiled graph guards on requires_grad, which an evaluation's input would change
        hidden_, weight_ = hidden.detach(), weight.detach()
        tp = get_tensor_model_parallel_world_size()
        partition_vocab = weight.shape[0]
        masked_target, off_slice = local_targets(target, partition_vocab)
        in_slice = ~off_slice
        smoothing = label_smoothing > 0
        pieces = []
        for rows in _chunks(hidden.shape[0], partition_vocab):
            args = (hidden_[rows], masked_target[rows], in_slice[rows])
            _token_dim_dynamic(backend, *args)
            pieces.append(statistics(args[0], weight_, args[1], args[2], smoothing))
        row_max, sum_exp, target_logit, *sum_logits = (torch.cat(p) for p in zip(*pieces))
        # Merge over the TP ranks: the global max, each rank's sum rescaled to it
        global_max = row_max.clone()
        _all_reduce(global_max, op=dist.ReduceOp.MAX)
        sums = torch.stack([sum_exp * (row_max - global_max).exp(), target_logit, *sum_logits])
        _all_reduce(sums)
        log_sum_exp = global_max + sums[0].log()
        loss = log_sum_exp - sums[1]
        if smoothing:  # mean_j log p_j = mean_j z_j - log sum_j exp z_j (cross_entropy.py)
            mean_log_probs = sums[2] / (partition_vocab * tp) - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs
        ctx.save_for_backward(hidden, weight, masked_target, in_slice, log_sum_exp)
        ctx.weight = weight  # the Parameter itself: the deferred W op accumulates into it (layers._Linear)
        ctx.label_smoothing, ctx.vocab_size, ctx.backend = label_smoothing, partition_vocab * tp, backend
        ctx.forward_weights = forward_weights
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, masked_target, in_slice, log_sum_exp = ctx.saved_tensors
        hidden = hidden.detach()
        # The logits' weights: the forward's, kept by the weight policy where they changed since
        forward_weight = weight.detach()
        if ctx.forward_weights is not None:
            with torch.no_grad(), ctx.forward_weights():
                forward_weight = weight.detach().clone()
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        defer = weight_grads.deferring() and need_weight and ctx.weight.grad_fn is None
        pass_args = (hidden, forward_weight, masked_target, in_slice, log_sum_exp, grad_loss.contiguous(),
                     ctx.label_smoothing, ctx.vocab_size, ctx.backend)
        grad_input, grad_weight = _grads(*pass_args, input_grad_weight=weight.detach() if need_input else None,
                                         weight_grad=need_weight and not defer)
        if defer:  # zero bubble's B op: the W op recomputes the logits for the weight gradient
            weight_grads.defer(functools.partial(_deferred_weight_grad, ctx.weight, pass_args))
        return grad_input, grad_weight, None, None, None, None


def _grads(hidden, forward_weight, masked_target, in_slice, log_sum_exp, grad_loss, label_smoothing, vocab_size,
           backend, input_grad_weight=None, weight_grad=False):
    """Chunk by chunk: the input's gradient through `input_grad_weight` (None: not wanted) and, with
    `weight_grad`, the weight's (accumulated in fp32 for a low-precision weight; returned in its dtype);
    None for one not wanted."""
    _, logit_grads = _chunk_functions(backend)
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
            if grad_logits.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:
                grad_weight += grad_logits.t().mm(hidden[rows])
    return grad_input, None if grad_weight is None else grad_weight.to(forward_weight.dtype)


@torch.no_grad()  # as in the backward: the W op runs outside autograd, and grad mode is a compiled graph's guard
def _deferred_weight_grad(weight, pass_args):
    _, grad_weight = _grads(*pass_args, weight_grad=True)
    return [(weight, grad_weight)]


def output_layer_cross_entropy(output_layer: ColumnParallelLinear, hidden: torch.Tensor, target: torch.Tensor,
                               label_smoothing: float = 0.0, backend: str | None = None) -> torch.Tensor:
    """Per-token cross entropy [s, b] of `output_layer`'s logits of `hidden` [s, b, h] (the last stage's
    final-normed states; [s/tp, b, h] under sequence parallelism) against `target` [s, b]: what
    `vocab_parallel_cross_entropy(output_layer(hidden)[0].float(), target, label_smoothing)` computes.
    `backend`: the per-chunk math under torch.compile with that backend (--torch-compile), else eagerly."""
    if output_layer.bias is not None or output_layer.gather_output:
        raise ValueError("output_layer_cross_entropy: an output layer without bias and with vocab-parallel output")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    x = output_layer.parallel_input(hidden)  # [s, b, h]: the TP region mapping (its collectives run eagerly)
    weight = output_layer.weight
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    forward_weights = weights_kept_for_recompute([weight]) if needs_grad else None
    loss = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), label_smoothing,
                                     backend, forward_weights)
    return loss.view(target.shape)
