"""Cross entropy over logits whose vocab dim is split across TP ranks, without gathering them.

The gathered logits would be [s, b, V]; with a 50k-256k vocab that is the largest activation of the
model. Instead each rank works on its [s, b, V/tp] slice and three all-reduces of [s, b] tensors
supply what the full softmax needs (Megatron's _VocabParallelCrossEntropy):

    1. max over the vocab (MAX)                 -> numerically safe exp
    2. logit of the target (SUM; only the owning rank contributes)
    3. sum of exp over the vocab (SUM)          -> log-partition

    loss = log(sum_j exp(z_j - m)) - (z_target - m)

The backward is analytic: d loss / d z = softmax(z) - onehot(target), computed in place in the saved
softmax buffer (so backward can run once per forward, which is all training needs).

Label smoothing uses torch's definition, so the result equals
`F.cross_entropy(gathered_logits, target, reduction="none", label_smoothing=alpha)`:
the target distribution is (1 - alpha) * onehot + alpha / V uniform over ALL V classes of the padded
vocab (the padded entries are real logits of the model, see pad_vocab_size), i.e.

    loss = (1 - alpha) * nll - alpha * mean_j log p_j,     grad = softmax - (1 - alpha) * onehot - alpha / V

Megatron spreads alpha over the V - 1 non-target classes instead (its alpha is ours times (V-1)/V) and
averages log p over the local vocab slice only, which is wrong for TP > 1. Here sum_j log p_j is summed
over the whole vocab: its partial sums ride in all-reduce 2 with the target logit, so smoothing costs no
extra collective.

There is no ignore_index: every target must be a valid id; drop tokens with a loss mask on the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_po.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron_po.tensor_parallel.layers import VocabUtility


def _all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_tensor_model_parallel_group())


def local_targets(target: torch.Tensor, partition_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's view of `target`: (the index into its vocab slice, 0 where the target is off the slice;
    the mask of those off it)."""
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
    off_slice = (target < start) | (target >= end)
    return (target - start).masked_fill(off_slice, 0), off_slice


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        # 1. Subtract the global max (out of place: the caller's logits stay intact).
        logits_max = vocab_parallel_logits.amax(dim=-1)
        _all_reduce(logits_max, op=dist.ReduceOp.MAX)
        logits = vocab_parallel_logits - logits_max.unsqueeze(-1)

        # 2. The target logit, from the one rank whose vocab slice holds the target.
        partition_vocab_size = logits.size(-1)
        vocab_size = partition_vocab_size * get_tensor_model_parallel_world_size()
        masked_target, target_mask = local_targets(target, partition_vocab_size)
        predicted_logits = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits = predicted_logits.masked_fill(target_mask, 0.0)
        if label_smoothing > 0:
            # sum_j (z_j - m) over the whole vocab, reduced together with the target logit.
            both = torch.stack([predicted_logits, logits.sum(dim=-1)])
            _all_reduce(both)
            predicted_logits, sum_logits = both[0], both[1]
        else:
            _all_reduce(predicted_logits)

        # 3. The partition function; logits becomes exp(logits), then the softmax, in place.
        exp_logits = logits.exp_()
        sum_exp_logits = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp_logits)
        log_sum_exp = torch.log(sum_exp_logits)
        loss = log_sum_exp - predicted_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))

        if label_smoothing > 0:
            # mean_j log p_j = mean_j (z_j - m) - log sum exp(z - m)
            mean_log_probs = sum_logits / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs

        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.backward_done = False
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.backward_done:  # the softmax buffer was overwritten by the first backward
            raise RuntimeError("vocab_parallel_cross_entropy: backward can run only once per forward")
        ctx.backward_done = True
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad_input = softmax  # reuse the buffer: this is the largest tensor of the step
        # Subtract the (smoothed) one-hot on the rank that owns the target.
        one_hot_weight = (1.0 - ctx.label_smoothing) * (~target_mask).to(grad_input.dtype)
        grad_input.scatter_add_(-1, masked_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad_input.sub_(ctx.label_smoothing / ctx.vocab_size)
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross entropy (shape of `target`) from logits [..., V/tp] split over the TP group."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
