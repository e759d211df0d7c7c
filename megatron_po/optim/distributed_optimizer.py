"""The distributed optimizer (ZeRO-1, Megatron semantics): fp32 main params and optimizer state sharded
over the data-parallel ranks, for every optimizer of the predictive family.

Layout (built by `DistributedDataParallel(..., use_distributed_optimizer=True)`): every gradient bucket
is padded and cut into DP equal contiguous ranges that ignore parameter boundaries; DP rank d owns range
d of each bucket. Per step:
  1. backward reduce-scatters each bucket as soon as its gradients are complete: the owned range of the
     gradient buffer then holds the DP-mean gradient (on gloo, `ddp.full_grads`: an all-reduce, the
     cheaper collective there, and the whole buffer holds it);
  2. this rank unscales/checks/clips only its owned ranges (found-inf and the squared norm are summed
     over the DP group and the model-parallel group, so each element is counted once; with
     `full_grads` it checks the whole gradient and takes its norm with no collective over DP);
  3. the inner optimizer steps only this rank's fp32 main shard. It is built over flat views, one 1-D
     tensor per (parameter ∩ owned range) piece, with the model's param groups, so any per-element
     optimizer (Adam, AdamW, SGD/momentum/Nesterov, RMSprop, Adagrad, Lion) takes exactly the step
     the unsharded one would take on those elements;
  4. the updated shards are rounded into the model dtype and all-gathered into the model weights bucket
     by bucket (`all_gather` into the flat parameter buffer), asynchronously with
     `overlap_param_gather` (a forward pre-hook per module waits for its own bucket).

Memory per parameter (Adam, bf16 params, fp32 grads): 2 (params) + 4 (grads) + 12/DP (fp32 main param,
exp_avg, exp_avg_sq), Megatron's 6 + 12/DP. With fp32 model params the main shard is still a separate
fp32 copy (8 + 12/DP instead of Megatron's 8 + 8/DP): it is what makes prediction copy-free. With
--use-precision-aware-optimizer's bf16 moments (optimizers.py Adam) the shard's state is 2 + 2 bytes: 6 + 8/DP.

PipeOptim over sharded state: `predict_model_params(s)` computes Ŵ = W_main - s·lr·ΔW for this rank's
shard from this rank's optimizer state, writes it into the model weights' owned ranges and all-gathers
them exactly like updated shards; `restore_model_params()` is the normal main -> model copy + all-gather.
The fp32 main shards are the cache: no full-size weight copy is made. In asynchronous pipelines the
step itself writes the predicted shards it is about to gather (`plan_shard_prediction`, from the ΔW it
has just computed; optim/fused_prediction.py).

Checkpoints: distributed/checkpoint_dcp.py writes each rank's pieces straight into the per-parameter
tensors an unsharded optimizer writes (`model.<name>` = the fp32 main param, `optimizer.<name>.<key>`),
as DCP chunks at the pieces' offsets, without gathering; loading reads back each rank's own ranges, so
checkpoints move between DP sizes, TP/PP layouts and the sharded and unsharded optimizers. The
in-memory `state_dict()` here holds this rank's shard (inner state of its pieces, its fp32 main shards,
the loss scale) plus the layout it was cut with, and `load_state_dict` accepts it under the same layout
(same model, DP size, bucket size) only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_po.distributed.ddp import DistributedDataParallel, all_gather_single
from megatron_po.errors import ConfigError
from megatron_po.optim.fused_prediction import PredictionRequest
from megatron_po.optim.mixed_precision import MainParamsOptimizer, normalize_param_groups
from megatron_po.optim.optimizers import PredictiveOptimizer


@dataclass
class ShardPiece:
    """The part of one model parameter that lies in this rank's owned range of one bucket."""

    param: Tensor  # the model parameter
    bucket: int  # bucket index in the DDP
    start: int  # [start, end) in the flat grad / param buffers
    end: int
    main: Tensor  # fp32 1-D view into the bucket's main shard: what the inner optimizer steps


class DistributedOptimizer(MainParamsOptimizer):
    """Megatron's distributed optimizer around a PredictiveOptimizer.

    inner_optimizer_factory: called once with the shard pieces' groups (one per model param group, same
        keys), returns a PredictiveOptimizer, e.g. `lambda groups: build_optimizer("adam", groups, lr=...)`.
    model_param_groups: the model params (tensors or group dicts); all must be managed by `ddp`.
    ddp: a DistributedDataParallel built with `use_distributed_optimizer=True`.
    grad_scaler, clip_grad, model_parallel_group: as for MixedPrecisionOptimizer; found-inf and the grad
        norm are summed over `ddp.dp_group` and then `model_parallel_group`.
    expert_group: with MoE experts, as for MixedPrecisionOptimizer: the experts' squares of this rank's
        shards are summed over their expert-data-parallel group (the ranks sharing them), then over
        `expert_group`, so every expert element counts once.

    MoE experts are sharded over their expert-data-parallel group (ddp.py: the expert buckets' `group`):
    each rank steps, predicts and gathers its range of every expert bucket among the ranks holding the
    same experts, as Megatron shards them; everything else is as for the dense buckets.
    """

    def __init__(self, inner_optimizer_factory: Callable[[list[dict]], PredictiveOptimizer], model_param_groups,
                 ddp: DistributedDataParallel, grad_scaler=None, clip_grad: float = 0.0,
                 model_parallel_group=None, predict_chunk_numel: int = 1 << 20, expert_group=None):
        if not getattr(ddp, "use_distributed_optimizer", False):
            raise ConfigError("the distributed optimizer needs DistributedDataParallel(..., "
                              "use_distributed_optimizer=True) (its padded, sharded buffers)")
        self.ddp = ddp
        groups = normalize_param_groups(model_param_groups)
        group_of: dict[int, int] = {}
        for i, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in ddp.param_range:
                    raise ConfigError("a parameter given to the distributed optimizer is not managed by its DDP")
                if id(p) in group_of:
                    raise ValueError("a parameter appears in more than one param group")
                group_of[id(p)] = i

        # fp32 main shard of every bucket: this rank's owned range, padding included (it stays 0).
        self.main_shards: list[Tensor] = []
        self.pieces: list[ShardPiece] = []
        piece_groups: list[list[Tensor]] = [[] for _ in groups]
        piece_of_main: list[list[ShardPiece]] = [[] for _ in groups]
        for b, bucket in enumerate(ddp.buckets):
            lo, hi = ddp.owned_range(bucket)
            shard = ddp.param_buffer[lo:hi].detach().to(torch.float32, copy=True)
            self.main_shards.append(shard)
            for p in bucket.params:
                p_start, p_end = ddp.param_range[id(p)]
                start, end = max(p_start, lo), min(p_end, hi)
                if start >= end or id(p) not in group_of:
                    continue
                piece = ShardPiece(p, b, start, end, shard[start - lo:end - lo])
                self.pieces.append(piece)
                piece_groups[group_of[id(p)]].append(piece.main)
                piece_of_main[group_of[id(p)]].append(piece)
        self._group_pieces = piece_of_main
        # With an all-reduced gradient (`ddp.full_grads`, gloo) every DP rank holds the same whole mean
        # gradient: found-inf and the norm are taken over all of it, with no collective over DP.
        self._optimized_params = [p for p in ddp.params if id(p) in group_of]
        main_groups = [{**g, "params": pieces} for g, pieces in zip(groups, piece_groups)]
        if not any(main_groups[i]["params"] for i in range(len(groups))):
            raise ConfigError(f"DP rank {ddp.dp_rank} owns no parameter elements: the model is too small "
                              f"for {ddp.dp_size} data-parallel ranks")
        self.optimizer = inner_optimizer_factory(main_groups)
        if not isinstance(self.optimizer, PredictiveOptimizer):
            raise TypeError(f"the inner optimizer must be a PredictiveOptimizer, got {type(self.optimizer).__name__}")
        attach = getattr(self.optimizer, "attach_shards", None)
        if attach is not None:  # Muon orthogonalises whole matrices: it gathers its pieces' buckets (optim/muon.py)
            attach([(piece.main, piece.param, piece.start - ddp.param_range[id(piece.param)][0],
                     piece.end - ddp.param_range[id(piece.param)][0]) for piece in self.pieces], groups, ddp)
        self.model_groups = [g["params"] for g in groups]
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.model_parallel_group = model_parallel_group
        self.expert_group = expert_group
        self.predict_chunk_numel = predict_chunk_numel
        self._device = ddp.grad_buffer.device
        self._shard_grads: list[Tensor] | None = None
        self.defer_param_gather = False  # see `start_gathers`
        self._live_changed = False
        self.predicted_buffers: dict[object, Tensor] = {}  # slot -> full flat buffer like ddp.param_buffer
        self._predicted_pending: list[Tensor] = []

    # -- MainParamsOptimizer hooks --------------------------------------------------------------

    def _before_weights_change(self):
        self.ddp.finish_param_sync()

    def _main_grads(self):
        # After the reduce-scatter the owned range of the grad buffer holds the DP-mean gradient; use it
        # in place when it is fp32, else as an fp32 copy of the shard.
        ddp, shard_grads = self.ddp, []
        for bucket in ddp.buckets:
            lo, hi = ddp.owned_range(bucket)
            g = ddp.grad_buffer[lo:hi]
            shard_grads.append(g if g.dtype == torch.float32 else g.float())
        for piece in self.pieces:
            lo = ddp.owned_range(ddp.buckets[piece.bucket])[0]
            piece.main.grad = shard_grads[piece.bucket][piece.start - lo:piece.end - lo]
        self._shard_grads = shard_grads
        if ddp.full_grads:  # unscaled and checked whole (the owned ranges are views into it)
            return [ddp.grad_buffer[bucket.start:bucket.end] for bucket in ddp.buckets]
        return shard_grads

    def _norm_pieces(self):
        if self.ddp.full_grads:
            if self._shard_grads is None:
                return []
            return [(p.main_grad.view(-1), p) for p in self._optimized_params]
        return [(piece.main.grad, piece.param) for piece in self.pieces if piece.main.grad is not None]

    def _release_main_grads(self):
        for piece in self.pieces:
            piece.main.grad = None
        self._shard_grads = None

    def _write_owned_ranges(self) -> None:
        """Round this rank's fp32 main shards into the model weights' owned ranges."""
        ddp = self.ddp
        for bucket, shard in zip(ddp.buckets, self.main_shards):
            lo, hi = ddp.owned_range(bucket)
            ddp.param_buffer[lo:hi].copy_(shard)

    def _copy_main_to_model(self):
        self._write_owned_ranges()
        if self.defer_param_gather:  # asynchronous pipelines: gathered with the next predictions
            self._live_changed = True
            return
        self.ddp.start_param_sync()  # asynchronous with overlap_param_gather

    def _agreement_groups(self):
        if self.ddp.full_grads:
            return [self.model_parallel_group]
        return [self.ddp.dp_group, self.model_parallel_group]

    def _expert_agreement_groups(self):
        if self.ddp.full_grads:
            return [self.expert_group]
        return [self.ddp.expert_group, self.expert_group]  # this rank's shards of its experts, then all experts

    def _prediction_targets(self, buf: Tensor | None = None):
        buf = self.ddp.param_buffer if buf is None else buf
        return [[buf[piece.start:piece.end] for piece in pieces] for pieces in self._group_pieces]

    # -- PipeOptim: predicted shards travel like updated shards ----------------------------------

    @torch.no_grad()
    def predict_model_params(self, steps, include_weight_decay: bool = False) -> None:
        """Ŵ of this rank's shard from this rank's state, then all-gathered into the model weights."""
        super().predict_model_params(steps, include_weight_decay)  # writes the owned ranges
        self.ddp.start_param_sync(async_op=False)

    @torch.no_grad()
    def restore_model_params(self) -> None:
        self._before_weights_change()
        self._write_owned_ranges()
        self.ddp.start_param_sync(async_op=False)

    def finish_param_sync(self) -> None:
        """Wait for overlapped all-gathers (before reading the weights outside a forward, e.g. to save)."""
        if self._live_changed or self._predicted_pending:
            self.start_gathers(async_op=False)
        self.ddp.finish_param_sync()

    # -- asynchronous pipelines: one packed all-gather per micro-batch ---------------------------
    # With `defer_param_gather` a step only writes the updated shard; the policy then predicts the
    # shards of the passes before the next step into separate full buffers (`predict_shard`) and
    # `start_gathers` sends the live and all predicted shards in ONE all-gather per bucket. A pass on
    # predicted weights points the parameters at their buffer (`point_model_at`) and back after it: the
    # restore moves no data.

    def predicted_buffer(self, slot) -> Tensor:
        if slot not in self.predicted_buffers:
            self.predicted_buffers[slot] = torch.zeros_like(self.ddp.param_buffer)
        return self.predicted_buffers[slot]

    @torch.no_grad()
    def predict_shard(self, slot, steps, include_weight_decay: bool = False) -> None:
        """Ŵ of this rank's shard into the owned ranges of buffer `slot` (gathered by `start_gathers`)."""
        from megatron_po.optim.mixed_precision import predict_into
        # A pending (--overlap-param-gather) gather of this buffer would, when waited for, copy every rank's piece
        # home, this rank's old prediction over the new one: wait for it first, as a step does.
        self._before_weights_change()
        buf = self.predicted_buffer(slot)
        predict_into(self.optimizer, steps, self._prediction_targets(buf), include_weight_decay,
                     self.predict_chunk_numel)
        self._predicted_pending.append(buf)

    def plan_shard_prediction(self, slot, steps, include_weight_decay: bool = False) -> PredictionRequest:
        """`predict_shard(slot, ...)` written by the next step, in the same pass as the update, from the ΔW
        it computes (optim/fused_prediction.py); gathered by `start_gathers` if `request.done`."""
        request = PredictionRequest(steps, include_weight_decay, self._prediction_targets(self.predicted_buffer(slot)),
                                    chunk_numel=self.predict_chunk_numel, slot=slot)
        self._planned = [*self._planned, request]
        return request

    def _step_and_write(self, requests):
        super()._step_and_write(requests)
        self._predicted_pending += [self.predicted_buffers[r.slot] for r in requests if r.done and r.slot is not None]

    def start_gathers(self, async_op: bool) -> None:
        """One all-gather per bucket of everything changed since the last: the live shard (after a step)
        and the predicted shards; waited for by the forward pre-hooks or `finish_param_sync`."""
        buffers = ([self.ddp.param_buffer] if self._live_changed else []) + self._predicted_pending
        self._live_changed, self._predicted_pending = False, []
        self.ddp.start_packed_param_sync(buffers, async_op)

    def point_model_at(self, slot=None) -> None:
        """Point every parameter at its view of buffer `slot` (None: the live `ddp.param_buffer`)."""
        buf = self.ddp.param_buffer if slot is None else self.predicted_buffers[slot]
        for p in self.ddp.params:
            start, end = self.ddp.param_range[id(p)]
            p.data = buf[start:end].view_as(p)

    # -- inspection and checkpoints --------------------------------------------------------------

    @torch.no_grad()
    def update_direction(self, include_weight_decay: bool = False) -> list[list[Tensor | None]]:
        """Full ΔW per model param group aligned with the model params (fp32), all-gathered over DP:
        collective, and a full-size fp32 temporary, so for inspection and tests, not the training loop.
        Every DDP-managed parameter is stepped on every step, so either all entries are tensors or (before
        the first step) all are None."""
        if not self.has_state():
            return [[None] * len(g) for g in self.model_groups]
        ddp = self.ddp
        full = torch.zeros(ddp.grad_buffer.numel(), dtype=torch.float32, device=self._device)
        for pieces, directions in zip(self._group_pieces, self.optimizer.update_direction(include_weight_decay)):
            for piece, d in zip(pieces, directions):
                if d is not None:
                    full[piece.start:piece.end].copy_(d)
        for bucket in ddp.buckets:
            if bucket.size > 1:
                lo, hi = ddp.owned_range(bucket)
                all_gather_single(full[bucket.start:bucket.end], full[lo:hi].clone(), bucket.group, async_op=False)
        out = []
        for params in self.model_groups:
            row = []
            for p in params:
                start, end = ddp.param_range[id(p)]
                row.append(full[start:end].view_as(p).clone())
            out.append(row)
        return out

    def _layout(self) -> dict:
        ddp = self.ddp
        return {"dp_size": ddp.dp_size, "dp_rank": ddp.dp_rank,
                "buckets": [(b.start, b.end) for b in ddp.buckets],
                "pieces": [(piece.start, piece.end) for piece in self.pieces]}

    def state_dict(self) -> dict:
        """This rank's shard: inner optimizer state of its pieces, fp32 main shards, loss scale, layout."""
        self.finish_param_sync()
        return {"optimizer": self.optimizer.state_dict(), "main_shards": list(self.main_shards),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
                "layout": self._layout()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a shard saved under the same layout; the model weights are refreshed from it."""
        saved, mine = state["layout"], self._layout()
        if saved != mine:
            what = (f"DP={saved['dp_size']} rank {saved['dp_rank']}" if saved["dp_size"] != mine["dp_size"]
                    or saved["dp_rank"] != mine["dp_rank"] else "another bucket layout")
            raise ConfigError(f"distributed optimizer state was saved under {what}; this run has "
                              f"DP={mine['dp_size']} rank {mine['dp_rank']} with its own buckets: for resharding "
                              "to another layout save and load through distributed/checkpoint_save.py")
        self.optimizer.load_state_dict(state["optimizer"])
        for shard, saved_shard in zip(self.main_shards, state["main_shards"]):
            shard.copy_(saved_shard)
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.restore_model_params()
