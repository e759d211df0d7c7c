"""The router: a token's scores over the experts, its top-k experts and their weights, the capacity drop,
the auxiliary losses and DeepSeek-V3's expert bias (Megatron-core's TopKRouter, its semantics).

Scores: softmax over the top-k logits (default), softmax over all logits before the top-k
(--moe-router-pre-softmax), or sigmoid (--moe-router-score-function sigmoid: the top-k scores normalized
to sum 1 when k > 1); times --moe-router-topk-scaling-factor. Group-limited routing (--moe-router-num-groups G,
--moe-router-group-topk g; Megatron's group_limited_topk): the experts in G equal groups, each group scored by
the sum of its top (k // g) selection scores, and the top-k taken among the experts of each token's g best
groups (DeepSeek-V3: k 8 of 256 experts in 4 of 8 groups, each scored by its top-2, as transformers'
DeepseekV3TopkRouter, which always sums a group's top-2). --moe-router-dtype fp32/fp64: the gating GEMM, the
scores and the weights in that dtype (the combine sums the experts' outputs in it, dispatcher.py); by default
the GEMM runs in the model's dtype and the scores in fp32. With --moe-router-enable-expert-bias the top-k
is taken over score + bias (sigmoid), the weights stay the unbiased scores; the bias moves after every
optimizer step by `rate x sign(mean load - load)` of the tokens each expert got since the last update
(`update_expert_bias`), which the forwards of training count (not evaluation, not recomputation). In an
asynchronous pipeline that is every step of the chunk, possibly between a micro-batch's forward and its
backward: a recomputation then routes with the bias its forward saw (`recompute_state`).

--moe-router-force-load-balancing (Megatron's, for benchmarks): the logits replaced by standard normal noise in
the forward, the gradient passed straight through (`RandomLogits`).

Capacity (--moe-expert-capacity-factor f): an expert takes at most ceil(f x T x k / E) of a micro-batch's T
tokens, those with the highest weights (--moe-token-drop-policy probs) or the first ones (position); with
--moe-pad-expert-input-to-capacity every expert gets exactly that many (padding tokens of weight 0). Ties are
broken by position (a stable sort), so the choice is reproducible.

One micro-batch's routing is decided over all of its tokens. Under sequence parallelism each TP rank holds a
slice of the sequence: the router logits (a [tokens, experts] tensor, small) are gathered over the TP group,
every TP rank routes the whole micro-batch and keeps its own rows. So the capacity, the dropped tokens and the
auxiliary losses are those of the one-process run at any TP size (Megatron instead computes the capacity of
each rank's own tokens). Under expert parallelism the router runs before the dispatch, on the rank's own
micro-batch: nothing to gather. Under context parallelism each CP rank holds two chunks of every sequence
(data/context_split.py): the logits are gathered over the CP group too and put back in sequence order, so the
capacity's position policy, the per-sequence loss and the ties see the sequence as one process does. Each rank
keeps the gradient of its own rows, and the gradients are averaged over DP x CP, so the auxiliary losses'
gradient is taken CP times, as the language-model loss is (its normalizer is the micro-batch's tokens / CP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig
from megatron_po.models.moe.aux_losses import (attach, load_balancing_loss, sequence_load_balancing_loss,
                                               switch_transformer_loss, z_loss)
from megatron_po.tensor_parallel.layers import linear
from megatron_po.tensor_parallel.random import is_recomputing
from megatron_po.tensor_parallel.sequence_pieces import gather_whole_sequence, this_rank_tokens


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's get_capacity over the token-expert pairs of one micro-batch."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Megatron's group_limited_topk (values, indices) of scores [T, E]: the experts in `num_groups` equal groups,
    each group scored by the sum of its top (topk // group_topk) scores; the top-k among the experts of each
    token's `group_topk` best groups (DeepSeek-V3's node-limited routing; its top-2 sum at topk 8, 4 groups)."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    picked = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, picked, True)
    mask = mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores.masked_fill(~mask, float("-inf")).topk(topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
                 num_groups: int | None = None, group_topk: int | None = None):
    """(weights [T, E] in the logits' dtype, zero outside the top-k; routing map [T, E] bool) of logits [T, E]
    (fp32 or fp64). `num_groups` / `group_topk`: the top-k of `group_limited_topk` (1 group: the plain top-k)."""
    def select(x):
        if group_topk and num_groups and num_groups > 1:
            return group_limited_topk(x, topk, num_groups, group_topk)
        return x.topk(topk, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            weights, top = select(torch.softmax(logits, dim=-1))
        else:
            top_logits, top = select(logits)
            weights = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:  # the bias chooses the experts; the weights are the unbiased scores
            top = select(scores + expert_bias).indices
            weights = scores.gather(1, top)
        else:
            weights, top = select(scores)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, top, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return probs, routing_map


def capacity_mask(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, drop_policy: str) -> torch.Tensor:
    """[T, E] bool: the `capacity` tokens each expert keeps, by weight (probs) or position, routed ones first."""
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        return torch.ones_like(routing_map)
    key = probs.detach() if drop_policy == "probs" else routing_map.to(torch.int8)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    return torch.zeros_like(routing_map).scatter(0, order, True)


def routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(scores [T, E], their top-k map): what the load-balancing losses measure (no bias, no capacity)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = scores.topk(topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)


def _sum_over_data_parallel(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(counts summed over the data-parallel ranks, their number). The router routes a whole micro-batch (its TP
    and CP pieces gathered), so the data-parallel group alone holds the other micro-batches of this step's slot."""
    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return counts, 1
    dist.all_reduce(counts, group=ps.get_data_parallel_group())
    return counts, ps.get_data_parallel_world_size()


class RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing (Megatron's RandomSTE, moe_utils.py, Megatron-LM d98e8a6): the forward
    returns standard normal logits in place of the router's, the backward hands the gradient to the real logits
    unchanged. Drawn from the default generator after the sequence gather, so every TP and CP rank of a stage draws
    the same logits for the same tokens (Megatron draws per rank: its ranks route their own tokens), and a
    recomputed MoE layer draws them again (checkpoint restores the generator)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


# Buffers that stay fp32 in a bf16/fp16 model: the expert bias and the load counts (bf16 would round them).
_FP32_BUFFERS = ("expert_bias", "tokens_per_expert", "global_tokens_per_expert", "global_forwards")


class TopKRouter(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.sequence_parallel = sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, mean=0.0, std=cfg.init_method_std)
        # Replicated; under sequence parallelism each TP rank's gradient covers its own tokens: summed over TP.
        self.weight.sequence_parallel = sequence_parallel
        if cfg.moe_router_enable_expert_bias:  # a buffer: checkpointed, never stepped by the optimizer
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        if cfg.moe_router_load_balancing_type == "global_aux_loss":  # the step's loads so far (`global_loss`)
            self.register_buffer("global_tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
            self.register_buffer("global_forwards", torch.zeros(()), persistent=False)
        else:
            self.global_tokens_per_expert = self.global_forwards = None
        # --moe-router-dtype: the gating GEMM and everything after it in this dtype (None: the GEMM in the model's
        # dtype, the scores in fp32, the weights handed on in the model's dtype), as Megatron's router_dtype.
        self.dtype = {None: None, "fp32": torch.float32, "fp64": torch.float64}[cfg.moe_router_dtype]
        self.record = None  # a MoERecord (layer.py) the forward adds its losses and loads to

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` keeps the bias and the counts fp32 (bf16 would round the bias and the counts)."""
        kept = {name: getattr(self, name) for name in _FP32_BUFFERS if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            setattr(self, name, after if after.dtype == torch.float32 else before.to(after.device))
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [s, b, h] (s split over TP under sequence parallelism) -> (weights [s*b, E] in x's dtype, routing map
        [s*b, E] bool) of this rank's tokens, flattened s-major."""
        b = x.shape[1]
        logits = linear(x, self.weight, dtype=self.dtype)  # [s, b, E]
        # route the whole micro-batch, its sequence in order (module docstring); the backward keeps my rows
        logits = gather_whole_sequence(logits, self.sequence_parallel)
        cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        seq = logits.shape[0]
        logits = logits.reshape(-1, self.num_experts).to(self.dtype or torch.float32)
        training = self.training and torch.is_grad_enabled()
        cfg = self.cfg
        if cfg.moe_router_force_load_balancing:
            logits = RandomLogits.apply(logits)
        if training and cfg.moe_z_loss_coeff:
            loss = z_loss(logits)
            logits = attach(logits, loss * cfg.moe_z_loss_coeff * cp)
            self._note("z_loss", loss)
        probs, routing_map = topk_routing(logits, self.topk, cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                                          cfg.moe_router_topk_scaling_factor, self.expert_bias,
                                          cfg.moe_router_num_groups, cfg.moe_router_group_topk)
        balancing = cfg.moe_router_load_balancing_type
        if training and cfg.moe_aux_loss_coeff and balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
            scores, topk_map = routing_scores_for_aux_loss(logits, self.topk, cfg.moe_router_score_function)
            dp = 1  # global_aux_loss: each DP rank's loss is its share of the DP sum, which is logged (as Megatron)
            if balancing == "aux_loss":
                loss = load_balancing_loss(scores, topk_map, self.topk)
            elif balancing == "seq_aux_loss":
                loss = sequence_load_balancing_loss(scores, topk_map, self.topk, seq, b)
            else:
                loss, dp = self.global_loss(scores, topk_map)
            probs = attach(probs, loss * cfg.moe_aux_loss_coeff * cp)
            self._note("aux_loss", loss * dp)
        routed = routing_map
        if cfg.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(probs.shape[0], self.num_experts, self.topk, cfg.moe_expert_capacity_factor)
            keep = capacity_mask(probs, routing_map, capacity, cfg.moe_token_drop_policy)
            routing_map = keep if cfg.moe_pad_expert_input_to_capacity else routing_map & keep
            probs = probs * routing_map
        probs, routing_map, routed = (this_rank_tokens(v.view(seq, b, -1), self.sequence_parallel)
                                      .reshape(-1, self.num_experts) for v in (probs, routing_map, routed))
        if training and not is_recomputing():
            with torch.no_grad():
                kept = routing_map & routed
                if self.tokens_per_expert is not None:
                    self.tokens_per_expert += kept.sum(dim=0)
                if self.record is not None:
                    self.record.add_routing(kept.sum(dim=0), (routed & ~routing_map).sum())
        return (probs if self.dtype is not None else probs.to(x.dtype)), routing_map

    def global_loss(self, scores: torch.Tensor, topk_map: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(Megatron's global_aux_loss without the coefficient, the DP size): this micro-batch's loads (its top-k
        counts) summed over the data-parallel ranks and averaged with those of the step's earlier forwards,
        against this micro-batch's scores, over the tokens of one micro-batch on every DP rank. The counts carry
        no gradient; they start again after every optimizer step (`after_optimizer_step`)."""
        counts, dp = _sum_over_data_parallel(topk_map.sum(dim=0).float())
        with torch.no_grad():
            self.global_tokens_per_expert += counts
            self.global_forwards += 1
        loads = (self.global_tokens_per_expert / self.global_forwards).to(scores.dtype)
        return switch_transformer_loss(scores, loads, self.topk, scores.shape[0] * dp), dp

    def recompute_state(self) -> list[torch.Tensor]:
        """What a recomputation of this router must see as its forward saw it (models/recompute.py): the expert
        bias, which an asynchronous stage moves at every step, possibly between a micro-batch's forward and its
        backward, so the recomputation routes the tokens as the forward did; the global aux loss's loads of the
        step so far, which later forwards add to (the recomputation adds its micro-batch again to the values its
        forward saw, and the checkpoint puts the current ones back after it)."""
        return [t for t in (self.expert_bias, self.global_tokens_per_expert, self.global_forwards) if t is not None]

    def _note(self, name: str, loss: torch.Tensor) -> None:
        if self.record is not None and not is_recomputing():
            self.record.add_loss(name, loss.detach())

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """bias += rate x sign(mean load - load), `tokens_per_expert` counted over the whole stage (every TP and DP
        rank); the counts start again from zero."""
        offset = tokens_per_expert.mean() - tokens_per_expert
        self.expert_bias += torch.sign(offset) * self.cfg.moe_router_bias_update_rate
        self.tokens_per_expert.zero_()


def routers_with_expert_bias(chunks) -> list[TopKRouter]:
    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


def after_optimizer_step(chunks) -> None:
    """What the routers of a stage's chunks do after its optimizer step: the expert biases move
    (`update_expert_bias`), the global aux loss's loads start again."""
    update_expert_bias(chunks)
    for router in (m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)):
        if router.global_forwards is not None:
            router.global_tokens_per_expert.zero_()
            router.global_forwards.zero_()


def update_expert_bias(chunks) -> None:
    """After an optimizer step of a stage: every expert bias of its model chunks moves by the tokens its router
    counted since the last update on every TP and DP rank of the stage (one all-reduce for all of them). Every
    rank of the stage holds the same layers, so all of them call the collective or none."""
    routers = routers_with_expert_bias(chunks)
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])
    group = ps.get_tensor_and_data_parallel_group() if ps.model_parallel_is_initialized() else None
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for router, c in zip(routers, counts):
        router.update_expert_bias(c)
