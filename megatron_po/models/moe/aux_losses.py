"""The router's auxiliary losses and how their gradients reach the model without any loss plumbing.

Megatron-core's way (MoEAuxLossAutoScaler): an auxiliary loss is attached to an activation that the main
loss depends on (the routing weights, or the router logits for the z-loss) by an autograd function that is
the identity forward and, in the backward, also gives the auxiliary loss the gradient `scale`. So every
pipeline stage backpropagates its own layers' auxiliary losses as part of its ordinary backward, and no
stage sends a loss anywhere. `scale` is what the main loss of the micro-batch is multiplied by before its
backward (1/M for the mean over M micro-batches, times the fp16 loss scale): the pipeline executor sets it
around every backward (`aux_loss_scale`), so the auxiliary losses are averaged like the language-model loss.

The losses (E experts, top-k, T tokens of one micro-batch, s_t,i the router's score of expert i for token t):
- load balancing (aux_loss, Switch Transformer): coeff * E / (k T^2) * sum_i (sum_t s_t,i) * n_i, n_i the
  tokens whose top-k (of the unbiased scores) holds expert i; 1.0 x coeff when perfectly balanced;
- sequence load balancing (seq_aux_loss, DeepSeek-V2): the same per sequence of the micro-batch, averaged;
- global load balancing (global_aux_loss, Megatron's, after Qiu et al. 2025): the micro-batch's scores against
  the loads n_i of the step's forwards so far, each summed over the data-parallel ranks and averaged over the
  forwards, T the tokens of one micro-batch on every DP rank (router.py, `TopKRouter.global_loss`);
- z-loss (ST-MoE): coeff * mean_t logsumexp(logits_t)^2.
"""

from __future__ import annotations

import contextlib

import torch

_SCALE = [1.0]  # the backward's gradient of every auxiliary loss (see module docstring)


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """The gradient the auxiliary losses get in the backwards run inside this block."""
    previous, _SCALE[0] = _SCALE[0], float(scale)
    try:
        yield
    finally:
        _SCALE[0] = previous


class AuxLossScaler(torch.autograd.Function):
    """`output` unchanged; its backward also starts the backward of `aux_loss` with gradient `scale`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, _SCALE[0])


def attach(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    return AuxLossScaler.apply(output, aux_loss)


def switch_transformer_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                            num_tokens: int) -> torch.Tensor:
    """E / (k T^2) x sum_i (sum_t s_t,i) n_i over the rows of scores [rows, E], the loads n_i and the tokens T
    they were counted over (Megatron's switch_load_balancing_loss_func), without the coefficient."""
    num_experts = scores.shape[1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts / (topk * num_tokens * num_tokens))


def load_balancing_loss(scores: torch.Tensor, topk_map: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch Transformer's loss over one micro-batch, without the coefficient: scores [T, E] (fp32),
    topk_map [T, E] (the top-k of those scores)."""
    return switch_transformer_loss(scores, topk_map.sum(dim=0).to(scores.dtype), topk, scores.shape[0])


def sequence_load_balancing_loss(scores: torch.Tensor, topk_map: torch.Tensor, topk: int,
                                 seq_length: int, batch_size: int) -> torch.Tensor:
    """The same loss for every sequence of the micro-batch, averaged; tokens are [s, b] flattened."""
    num_experts = scores.shape[1]
    probs = scores.view(seq_length, batch_size, num_experts)
    share = topk_map.view(seq_length, batch_size, num_experts).sum(dim=0, dtype=scores.dtype)
    share = share / (seq_length * topk / num_experts)  # [b, E]: 1 where expert i gets its equal share
    return (share * probs.mean(dim=0)).sum(dim=1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, without the coefficient: logits [T, E] (fp32)."""
    return torch.logsumexp(logits, dim=-1).square().mean()
