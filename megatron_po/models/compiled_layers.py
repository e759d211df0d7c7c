"""--torch-compile: every transformer layer compiled with torch.compile (inductor), as torchtitan compiles
each block. The compiler fuses what runs between the GEMMs and attention (norms, bias adds, GELU/SwiGLU,
dropout, residual adds, RoPE) on CUDA and on CPU alike.

`compile_layers` is applied in one place, where a rank's model chunks are built after the parallel
layout (pipeline/partition.py): `nn.Module.compile()` on each layer, so modules, parameters and
state_dict keys stay as they are (a compiled run's checkpoint loads into an eager run and back). A graph
is compiled lazily, at the first call with a new shape or mode: the first training micro-batches
(forward, then backward) and the first evaluation (eval mode, no gradients: a graph of its own). Every
layer of one shape shares one graph.

What each compiled graph holds, and what runs outside it:
- tensor-parallel GEMMs are inside; at TP > 1 the region mappings' collectives (sequence parallelism too)
  run between graphs (tensor_parallel/mappings.py: traced into a graph, torch 2.11 computed wrong
  gradients). A GEMM saves its weight for the backward as the Parameter itself (a graph input), so the
  weight policies of the asynchronous pipelines, which point parameters at other tensors between passes
  or write them in place, see the same weights in the backward as eagerly;
- under zero-bubble schedules (split backward) the GEMMs run eagerly between graphs: the B op defers their
  weight gradients at backward time (tensor_parallel/weight_grads.py), which a compiled backward cannot;
- dropout drawing from the TP-rank stream (attention dropout; hidden dropout under sequence parallelism)
  and the regions of --recompute-granularity selective run eagerly (tensor_parallel/random.py); a compiled
  graph's own dropout draws through inductor's RNG from the device generator, so its masks are not an
  eager run's (the same in a recomputation, which replays the generator);
- pointing a parameter at another tensor of the same shape, dtype and strides does not recompile.

`compile_summary()` says what was compiled and how long it took (TorchDynamo's counters and timings);
the training log prints it once, when the first iteration is done (training_log.Progress).
"""

from __future__ import annotations

from megatron_po.dynamo_import import import_dynamo
from megatron_po.tensor_parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, graph_breaks

BACKEND = "inductor"  # torch.compile's backend (tests may pick a cheaper one)
_compiled_layers = 0  # layers compiled in this process


def compile_layers(chunks: list, split_backward: bool = False) -> list:
    """Compile every transformer layer of `chunks` (each chunk's `layers`) in place; returns `chunks`.
    `split_backward`: the schedule splits backwards into B and W ops (zero bubble)."""
    global _compiled_layers
    import_dynamo()  # before torch.compile would, holding our callers' frames (dynamo_import.py)
    graph_breaks.install()
    for chunk in chunks:
        for layer in chunk.layers:
            if split_backward:
                for module in layer.modules():
                    if isinstance(module, (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear)):
                        module.gemm_in_compiled_graph = False
            layer.compile(backend=BACKEND)
            _compiled_layers += 1
        if getattr(chunk, "output_layer", None) is not None:  # the chunked output loss's per-chunk math
            chunk.output_loss_backend = BACKEND
    return chunks


def compile_stats() -> dict:
    """TorchDynamo's process-wide counts: `graphs` (distinct graphs traced; a train and an eval graph of one
    layer are two), `backward_graphs` (backwards compiled at their first run; one loaded with its forward
    from AOTAutograd's cache is not counted), `frames` (frames compiled: the first of a code object and
    every recompilation), `seconds` (tracing and compiling, forward and backward)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    backward = [t for name, times in compilation_time_metrics.items() if name.endswith("bw_compiler") for t in times]
    forward = compilation_time_metrics.get("_compile.compile_inner", [])
    return {"graphs": counters["stats"]["unique_graphs"], "backward_graphs": len(backward),
            "frames": counters["frames"]["ok"], "seconds": sum(forward) + sum(backward)}


def compile_summary() -> str | None:
    """One line for the log (None when no layer of this process is compiled): call it once the first
    micro-batches have run their forward and backward."""
    if _compiled_layers == 0:
        return None
    stats = compile_stats()
    return (f"> torch.compile: compiled {_compiled_layers} layers ({stats['graphs']} distinct graphs) in "
            f"{stats['seconds']:.1f} s")
