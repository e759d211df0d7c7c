"""The predicting policies' side of the step fused with the prediction (optim/fused_prediction.py).

PipeOptim and SpecTrain run a chunk's forward on Ŵ = W − s·lr·ΔW. In the asynchronous stream the op
right before that forward on the chunk is, in the steady state, the chunk's own Step. Then the step
itself writes Ŵ, in the same pass over the parameters as the update, from the ΔW it has just computed,
into the tensor the forward will use; the forward points the parameters at it and back after it
(`p.data = Ŵ`, `p.data = live`), moving no data. Which forwards: read from the op list
(`_passes_between_steps`), never assumed: a Step(c) whose next op on chunk c is Forward(j, c) with
s ≠ 0 (s = s(j) + s_offset for PipeOptim, SpecTrain's s_f), in the straight and the interleaved streams
alike. With the distributed optimizer every prediction a step already sends in its packed all-gather
(PipeOptim's next forward, SpecTrain's next forward and backward) is written by the step into its
buffer's owned ranges.

Where the step does not write it (the fallback, the policies' own `_predict`): the forwards of a
segment's warm-up (after a drain the next op after the last step is the next segment's), a forward that
is not the first op after the step (k > 1: the later forwards between two steps), a chunk whose modules
need in-place weights (copies instead of pointer swaps), error feedback (it moves the weights after the
step), a mixed-precision step skipped for inf/NaN, and `fuse_prediction = False`.

Memory: the step's factored ΔW (Adam's √v̂ + ε, 4 bytes per parameter) dies with the step where every
prediction before the next step is fused (`keep_direction` off, decided step by step from the op list); where
some are not (the interleaved stream's later forwards, k > 1), that step keeps it for them as before. A
segment's warm-up forwards rebuild ΔW from the state (once per stage and segment). Ŵ exists from the step to
the end of the forward (in the straight stream the next op), in the model dtype (bf16: 2 bytes per parameter,
where the separate prediction wrote Ŵ into the model weights and copied the live ones back from the fp32 main
params).
"""

from __future__ import annotations

import torch

from megatron_po.optim.fused_prediction import PredictionRequest
from megatron_po.pipeline.schedules import Forward


class StepFusedPrediction:
    """Mixin of predicting_policies._PredictingPolicy. Needs `self.optimizers`, `self.steps`, `self.gathers`,
    `self.swaps`, `self.live`, `self.error_feedback`, `self._segment_first_step`, `self._passes_between_steps`,
    `self.lr_steps`, `self._note_copies` and the policy's `prefetch_passes(chunk, ops)`; policies override
    `_predicted_passes` and `_plan_predictor`."""

    fuse_prediction = True  # False: predict right before each pass (the separate prediction)

    def _predicted_passes(self, chunk: int, ops: list) -> list[tuple[str, int, float, bool]]:
        """As `prefetch_passes`, for every pass among `ops` that runs on a prediction (policies override)."""
        return []

    def _plan_predictor(self, chunk: int, lr_steps: int) -> None:
        """Before predicting for a chunk whose lr clock reads `lr_steps` (weight predictors' future lrs)."""

    def _fused_state(self) -> tuple[dict, dict]:
        if not hasattr(self, "_fused_planned"):
            self._fused_planned: dict[int, dict] = {}  # chunk -> {(kind, mb): request} of the step running
            self._fused_ready: dict[tuple[str, int, int], list] = {}  # (kind, mb, chunk) -> [(param, Ŵ)]
        return self._fused_planned, self._fused_ready

    def _fuses(self, chunk: int) -> bool:
        # Pointer swaps need Ŵ per model parameter: a sharded optimizer writes it into its gathered
        # buffers instead (and predicts in place into the model weights when it does not gather).
        sharded = hasattr(self.optimizers[chunk], "predict_shard")
        return (self.fuse_prediction and self.error_feedback is None
                and (self.gathers[chunk] if sharded else self.swaps[chunk]))

    def _ops_after_step(self, chunk: int, step_index: int) -> list:
        """The chunk's forwards and backwards between its step `step_index` (counted from the segment's
        first) and the next one."""
        between = self._passes_between_steps[chunk]
        return between[step_index] if step_index < len(between) else []

    def _fused_passes(self, chunk: int, ops: list) -> list[tuple[str, int, float, bool]]:
        """The predicted passes among `ops` that the step before them writes."""
        passes = self.prefetch_passes(chunk, ops)
        if not self.gathers[chunk]:  # a pointer swap: only the very next op, so Ŵ lives for one pass
            first = ops[0] if ops else None
            passes = [p for p in passes if p[0] == "F" and isinstance(first, Forward) and first.microbatch == p[1]]
        return [p for p in passes if p[2] != 0]

    def before_step(self, chunk):
        super().before_step(chunk)
        planned, _ = self._fused_state()
        opt = self.optimizers[chunk]
        fuses = self._fuses(chunk)
        ops = self._ops_after_step(chunk, self.steps[chunk] + 1 - self._segment_first_step[chunk])
        passes = self._fused_passes(chunk, ops) if fuses else []
        # Keep the step's ΔW only for predictions it will not write itself (read from the op list).
        unfused = sum(1 for p in self._predicted_passes(chunk, ops) if p[2] != 0) > len(passes)
        getattr(opt, "optimizer", opt).keep_direction = not fuses or unfused
        if not fuses:
            return
        if passes:
            self._plan_predictor(chunk, self.lr_steps[chunk] + 1)  # the lr clock after this step (if applied:
            # a skipped one writes nothing, and the forward predicts itself)
        requests = {}
        for kind, mb, steps, include_wd in passes:
            if self.gathers[chunk]:
                requests[(kind, mb)] = opt.plan_shard_prediction(kind, steps, include_wd)
            else:
                requests[(kind, mb)] = PredictionRequest(steps, include_wd)
        if requests and not self.gathers[chunk]:
            opt.plan_prediction(*requests.values())
        planned[chunk] = requests

    def _take_fused(self, chunk: int) -> dict:
        """After the chunk's step: {(kind, mb): request} it was asked to write (done or not). Pointer-swap
        results are held until their pass (`_install_fused`)."""
        planned, ready = self._fused_state()
        requests = planned.pop(chunk, {})
        if not self.gathers[chunk]:
            for (kind, mb), request in requests.items():
                if request.done and request.predicted:
                    ready[(kind, mb, chunk)] = request.predicted
                    self._note_copies(chunk)
        return requests

    @torch.no_grad()
    def _install_fused(self, chunk: int, key: tuple[str, int]) -> bool:
        """Point the chunk's parameters at the Ŵ its step wrote for pass `key`, if it did."""
        pairs = self._fused_state()[1].pop((*key, chunk), None)
        if not pairs:
            return False
        self.live[chunk] = [(p, p.data) for p, _ in pairs]
        for p, w in pairs:
            p.data = w
        return True

    def _fused_pending(self, chunk: int) -> bool:
        """Whether a Ŵ the step wrote is waiting for its pass (a weight copy held)."""
        return any(c == chunk for (_, _, c) in self._fused_state()[1])
