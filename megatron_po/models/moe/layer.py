"""The MoE layer, in the place of a transformer layer's MLP: router -> dispatch -> experts -> combine, plus the
shared experts (--moe-shared-expert-intermediate-size: a dense MLP every token goes through, its output added).

Input and output are the layer's activations [s, b, h] (s split over TP ranks under sequence parallelism,
which MoE with TP > 1 requires, as in Megatron: every rank of a stage holds distinct tokens).

--torch-compile: a compiled transformer layer (models/compiled_layers.py) runs the routed part (router,
dispatch, experts, combine) eagerly between its graphs: dropless routing gives every expert a data-dependent
number of tokens and the dispatch's collectives take sizes read from the routing, and the auxiliary losses'
backward reads the executor's scale at backward time (aux_losses.py). The attention, norms, residuals and the
shared experts stay compiled; the graphs' shapes do not depend on the routing, so no micro-batch recompiles
them (tests/test_moe_layer.py counts).

--moe-layer-recompute (Megatron's): the whole layer (router, dispatch, experts, combine, shared experts) keeps
only its input in the forward and runs again in the backward (models/recompute.py's checkpoint: the forward's
random streams, weights, expert bias and global aux loss counts replayed, so the numbers are those of the run
without it; nothing is counted twice). The dispatch's collectives run again in the backward on every rank alike.

`record`: a small per-layer record of what the router did since the trainer last read it (`take_records`):
the auxiliary losses without their coefficients, the tokens each expert got (this rank's tokens) and the
token-expert pairs the capacity dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_po import parallel_state as ps
from megatron_po.config import ModelConfig, recomputes_moe_layers
from megatron_po.models.moe.dispatcher import DISPATCHERS
from megatron_po.models.moe.experts import GroupedExperts
from megatron_po.models.moe.layout import local_experts
from megatron_po.models.moe.router import TopKRouter
from megatron_po.models.recompute import maybe_recompute, recompute_state
from megatron_po.tensor_parallel.graph_breaks import runs_eagerly


class MoERecord:
    """Sums over the training forwards since the last `take`, kept as tensors on the model's device (recording
    costs no device sync; `take` reads them)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert = self.dropped = None

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        self.losses[name] = value.float() + self.losses[name] if name in self.losses else value.float()

    def add_routing(self, tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> None:
        self.forwards += 1
        if self.tokens_per_expert is None:
            self.tokens_per_expert, self.dropped = tokens_per_expert.clone(), dropped.clone()
        else:
            self.tokens_per_expert += tokens_per_expert
            self.dropped += dropped

    def take(self) -> dict:
        """{aux_loss, z_loss (means over the forwards, where computed), tokens_per_expert (this rank's tokens),
        dropped_tokens (token-expert pairs), forwards}, then start again."""
        n = max(self.forwards, 1)
        out = {name: float(v) / n for name, v in self.losses.items()}
        none = self.tokens_per_expert is None
        out.update(tokens_per_expert=[0] * self.num_experts if none else self.tokens_per_expert.tolist(),
                   dropped_tokens=0 if none else int(self.dropped), forwards=self.forwards)
        self.reset()
        return out


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, layer_number: int, shared_experts=None):
        """`shared_experts`: a zero-argument factory of the shared experts' MLP (built last: the layer's draws
        are router, experts, shared experts)."""
        super().__init__()
        self.layer_number = layer_number
        self.router = TopKRouter(cfg, sequence_parallel)
        self.experts = GroupedExperts(cfg, local_experts(cfg.num_experts, ps.get_expert_model_parallel_world_size(),
                                                         ps.get_expert_model_parallel_rank()),
                                      ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                                      cfg.moe_grouped_gemm)
        self.dispatcher = DISPATCHERS[cfg.moe_token_dispatcher_type](cfg.num_experts)
        self.shared_experts = shared_experts() if shared_experts is not None else None
        self.record = self.router.record = MoERecord(cfg.num_experts)
        self.recompute = recomputes_moe_layers(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recompute:
            return self.compute(x)
        return maybe_recompute(True, self.compute, x, params=list(self.parameters()), state=recompute_state([self]))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts plus the shared experts: [s, b, h] -> [s, b, h]."""
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @runs_eagerly
    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Router, dispatch, experts, combine: [s, b, h] -> [s, b, h] (eager under torch.compile)."""
        probs, routing_map = self.router(x)
        tokens, counts, context = self.dispatcher.dispatch(x.reshape(-1, x.shape[-1]), probs, routing_map)
        return self.dispatcher.restore(self.experts(tokens, counts), context).view_as(x)


def moe_layers(chunks) -> list[MoELayer]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def take_records(chunks) -> dict[int, dict]:
    """{global layer number: MoERecord.take()} of this rank's MoE layers (the trainer's per-layer record)."""
    return {layer.layer_number: layer.record.take() for layer in moe_layers(chunks)}
