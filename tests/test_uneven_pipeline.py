"""Uneven pipeline splits (Megatron-core's --decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-
pipeline-split, --pipeline-model-parallel-layout; megatron_po/layer_split.py).

- The pure split equals a transcription of Megatron-core's rule (transformer_block.py `get_num_layers_to_build`,
  transformer_layer.py `get_transformer_layer_offset`) on a grid of cases, and the layout grammar unrolls as
  pipeline_parallel_layer_layout.py's `parse_str_to_list` does.
- Synchronous 1F1B / GPipe / interleaved 1F1B with uneven stages (an embedding-only first stage and a loss-only last
  stage among them) equal the one-process model: mean loss and every gradient, fp32, rtol 1e-5 / atol 1e-6 (the
  tolerance of tests/test_pipeline_parallel.py); the emulator equals the distributed run bit for bit.
- PipeOptim and PipeDream (weight stashing) with uneven stages: the distributed run equals the emulator bit for bit
  (tests/test_async_pipeline.py's harness).
- A checkpoint saved under an interleaved uneven split (global layer names) loads under the even split at the same
  PP without interleaving and the next iteration matches (resharding load).
"""

from functools import partial

import pytest
import torch
import torch._dynamo  # noqa: F401  (model init imports it lazily: once here, not in every forked rank)
from dist_harness import run_distributed
from test_async_pipeline import merge, train_distributed, train_emulator
from test_pipeline_parallel import check_against_reference, emulated_run, pipeline_run, reference

from megatron_po.config import parse_args, virtual_pipeline_size
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.layer_split import layers_per_virtual_stage, parse_layout
from megatron_po.pipeline.partition import chunk_placements

# --------------------------------------------------------------------------------------------------
# The pure split against Megatron's rule
# --------------------------------------------------------------------------------------------------


def megatron_rule(L, D, v, first=None, last=None, embedding=False, loss=False):
    """(layers, offset) of every virtual stage vs = c*D + r, as Megatron-core computes them per (pp_rank r,
    vp_stage c) (the two functions transcribed, vp_size None when v = 1)."""
    def to_build(r, c):
        if first is not None or last is not None:
            left, stages = L, D
            if first is not None:
                left, stages = left - first, stages - 1
            if last is not None:
                left, stages = left - last, stages - 1
            per_rank = left // stages if stages > 0 else 0
            if r == 0 and first is not None:
                per_rank = first
            if r == D - 1 and last is not None:
                per_rank = last
        else:
            per_rank = (L + embedding + loss) // D
        n = per_rank // v
        n -= int(embedding and c == 0 and r == 0)
        n -= int(loss and c == v - 1 and r == D - 1)
        return n

    def offset(r, c):
        if first is not None or last is not None:
            middle = D - (first is not None) - (last is not None)
            f, g = first or 0, last or 0
            mid_rank = r if first is None else r - 1
            if v > 1:
                per_chunk = f // v + (L - f - g) // v + g // v
                return c * per_chunk if r == 0 else c * per_chunk + f // v + mid_rank * ((L - f - g) // v // middle)
            per_rank = (L - f - g) // middle if middle > 0 else 0
            return 0 if r == 0 else mid_rank * per_rank + f
        per_rank = (L + embedding + loss) // D
        per_chunk = per_rank // v  # Megatron: offset = (c * D + r) * per_chunk, less the embedding's place
        return (c * D + r) * per_chunk - int(embedding and (c, r) != (0, 0))

    return ([to_build(vs % D, vs // D) for vs in range(D * v)], [offset(vs % D, vs // D) for vs in range(D * v)])


SPLITS = [  # L, D, v, flags
    (36, 4, 1, dict(first=11, last=5)), (61, 4, 1, dict(first=16)), (61, 4, 1, dict(last=13)),
    (8, 2, 1, dict(first=3)), (8, 2, 1, dict(last=1)), (8, 2, 1, dict(first=1, last=7)),
    (12, 3, 1, dict(first=2, last=6)),
    (20, 4, 2, dict(first=2, last=6)), (20, 4, 2, dict(first=2)), (24, 3, 2, dict(last=4)), (14, 4, 1, dict(last=2)),
    (7, 2, 1, dict(embedding=True)), (7, 4, 1, dict(loss=True)), (6, 4, 1, dict(embedding=True, loss=True)),
    (14, 2, 2, dict(embedding=True, loss=True)), (3, 4, 1, dict(embedding=True)), (8, 4, 2, {}),
]


@pytest.mark.parametrize("L,D,v,flags", SPLITS, ids=[f"L{c[0]}-D{c[1]}v{c[2]}-{'-'.join(c[3]) or 'even'}"
                                                     for c in SPLITS])
def test_split_follows_megatrons_rule(L, D, v, flags):
    counts, offsets = megatron_rule(L, D, v, **flags)
    kw = {{"embedding": "account_for_embedding", "loss": "account_for_loss"}.get(k, k): x for k, x in flags.items()}
    got = layers_per_virtual_stage(L, D, v, **kw)
    assert got == counts and sum(got) == L
    placed = {vs: p for r in range(D) for vs, p in zip(range(r, D * v, D), chunk_placements(got, r, D, v))}
    assert [placed[vs]["layer_offset"] for vs in range(D * v)] == offsets
    assert [placed[vs]["num_layers"] for vs in range(D * v)] == counts
    assert placed[0]["pre_process"] and placed[D * v - 1]["post_process"]


def test_layout_grammar_and_deepseek_v3s_layout():
    # pipeline_parallel_layer_layout.py's own docstring example and the DeepSeek-V3 model zoo's layout (61 layers,
    # 1 MTP depth, PP 16 x 2 virtual stages: 2 layers per stage, the embedding's stage 1, the MTP/loss stage none)
    assert parse_layout("Ettt|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert parse_layout("(|ab)*2,cd".replace("a", "t").replace("b", "t").replace("c", "m").replace("d", "L")) == \
        ["", "tt", "ttmL"]
    counts = layers_per_virtual_stage(61, 16, 2, layout="Et|(tt|)*30mL", mtp_num_layers=1)
    assert counts == [1] + [2] * 30 + [0]
    cfg = parse_args(["--num-layers", "61", "--pipeline-model-parallel-size", "16", "--mtp-num-layers", "1",
                      "--pipeline-model-parallel-layout", "Et|(tt|)*30mL"])
    assert virtual_pipeline_size(cfg) == 2
    # rank 15's chunk 1 is the last virtual stage: no transformer layer, the MTP depth and the loss
    assert chunk_placements(counts, 15, 16, 2)[1] == dict(pre_process=False, post_process=True, layer_offset=61,
                                                          num_layers=0)
    with pytest.raises(ConfigError, match="standalone MTP stage is not built here"):
        layers_per_virtual_stage(4, 2, 2, layout="Ett|tt|m|L", mtp_num_layers=1)


def test_recipe_style_command_lines_pass_the_start_up_rules():
    mock = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    for argv, world in [(["--num-layers", "36", "--pipeline-model-parallel-size", "4",
                          "--decoder-first-pipeline-num-layers", "11", "--decoder-last-pipeline-num-layers", "5"], 4),
                        (["--num-layers", "20", "--pipeline-model-parallel-size", "4",
                          "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "2",
                          "--decoder-last-pipeline-num-layers", "6"], 4),
                        (["--num-layers", "7", "--pipeline-model-parallel-size", "2",
                          "--account-for-embedding-in-pipeline-split"], 2),
                        (["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-"
                          "pipeline-split", "--account-for-loss-in-pipeline-split",
                          "--num-layers-per-virtual-pipeline-stage", "2"], 2),
                        (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-method", "pipeoptim",
                          "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1", "--position-embedding-type",
                          "rope", "--micro-batch-size", "2", "--global-batch-size", "4",
                          "--pipeline-model-parallel-layout", "Et|(t|)*2tmL"], 2)]:
        validate(parse_args(mock + argv), world)
    cfg = parse_args(mock + ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-"
                             "pipeline-split", "--account-for-loss-in-pipeline-split",
                             "--num-layers-per-virtual-pipeline-stage", "2"])
    assert virtual_pipeline_size(cfg) == 2  # (6 + 2) / (2 x 2), as Megatron


# --------------------------------------------------------------------------------------------------
# Synchronous schedules: equal to the one-process model; emulator = distributed run
# --------------------------------------------------------------------------------------------------

SYNC = [  # name, method, D, v, ParallelConfig fields (8 layers)
    ("llama", "1f1b", 2, 1, {"decoder_first_pipeline_num_layers": 3}),
    ("gpt2", "1f1b", 4, 1, {"pipeline_model_parallel_layout": "E|ttt|tt|tttL"}),  # embedding-only first stage
    ("gpt2", "gpipe", 2, 1, {"pipeline_model_parallel_layout": "Etttttttt|L"}),  # loss-only last stage
    ("llama", "1f1b", 2, 2, {"pipeline_model_parallel_layout": "Ettt|t|ttt|tL"}),  # interleaved
    ("gpt2", "1f1b", 2, 2, {"decoder_first_pipeline_num_layers": 2,  # Megatron's per-chunk rule: 1 | 3 | 1 | 3
                            "num_virtual_stages_per_pipeline_rank": 2}),
]


@pytest.mark.parametrize("name,method,D,v,split", SYNC, ids=[f"{c[0]}-{c[1]}-D{c[2]}v{c[3]}-{'-'.join(c[4])}"
                                                              for c in SYNC])
def test_uneven_pipeline_matches_unpipelined(name, method, D, v, split):
    ref_loss, ref_grads = reference(name)
    results = run_distributed(pipeline_run, D, pp=D, args=(name, method, v, False, split))
    check_against_reference(results, ref_loss, ref_grads)
    if D == 2:  # the emulator runs the same ops in one process: bitwise
        emu_loss, emu_grads = run_distributed(emulated_run, 1, args=(name, method, D, v, split))[0]
        assert [r[0] for r in results if r[0] is not None] == [emu_loss]
        merged = {k: g for _, grads in results for k, g in grads.items()}
        assert merged.keys() == emu_grads.keys() and all(torch.equal(merged[k], emu_grads[k]) for k in merged)


# --------------------------------------------------------------------------------------------------
# Asynchronous methods: distributed = emulator, bit for bit
# --------------------------------------------------------------------------------------------------

ASYNC = [  # method, optimizer, D, v, k, segments, split (D x v layers)
    ("pipeoptim", "adam", 2, 2, 1, (4, 6), {"pipeline_model_parallel_layout": "Ett|t|t|L"}),
    ("pipedream", "sgd", 2, 1, 1, (4, 6), {"pipeline_model_parallel_layout": "E|ttL"}),
]


@pytest.mark.parametrize("method,optimizer,D,v,k,segments,split", ASYNC, ids=[f"{c[0]}-D{c[2]}v{c[3]}" for c in ASYNC])
def test_uneven_async_distributed_equals_emulator_bitwise(method, optimizer, D, v, k, segments, split):
    emu_losses, emu_eval, emu_weights, emu_copies = run_distributed(
        partial(train_emulator, parallel=split), 1, args=(method, optimizer, D, v, k, segments))[0]
    results = run_distributed(partial(train_distributed, parallel=split), D, pp=D,
                              args=(method, optimizer, v, k, segments))
    last = results[D - 1]
    assert last[0] == emu_losses and last[1] == emu_eval
    weights, copies = merge(results)
    assert weights.keys() == emu_weights.keys()
    assert all(torch.equal(weights[name], emu_weights[name]) for name in weights)
    assert copies == emu_copies


# --------------------------------------------------------------------------------------------------
# Checkpoints: saved uneven, loaded even (global layer names, resharding load)
# --------------------------------------------------------------------------------------------------


def test_uneven_checkpoint_loads_under_the_even_split(tmp_path):
    """8 layers at PP 2 split 1 | 3 | 1 | 3 (--decoder-first-pipeline-num-layers 2, 2 virtual stages per rank:
    Megatron's interleaved uneven split) for 3 iterations, a checkpoint after each; loaded at iteration 2 under the
    even split 4 | 4 without interleaving, the third iteration's loss and weights match (the names are global: layers.<i>
    whatever stage held them)."""
    from test_checkpoint import assert_close, losses, model_weights, train

    def out(name):
        return str(tmp_path / name)

    even = {"--num-layers": 8, "--pipeline-model-parallel-size": 2, "--hidden-dropout": 0.0,
            "--attention-dropout": 0.0, "--lr-decay-iters": 4}
    uneven = {**even, "--decoder-first-pipeline-num-layers": 2, "--num-virtual-stages-per-pipeline-rank": 2}
    ref = losses(train(out("uneven"), 2, **uneven, **{"--train-iters": 3, "--save-interval": 1,
                                                       "--save": out("ck_uneven")}))
    got = losses(train(out("even"), 2, **even, **{"--train-iters": 3, "--load": out("ck_uneven"), "--ckpt-step": 2,
                                                   "--save": out("ck_even")}))
    assert len(got) == 1 and abs(got[0] - ref[2]) <= 1e-5, (got, ref)
    weights = model_weights(out("ck_uneven"), 3)
    assert {k.split(".")[1] for k in weights if k.startswith("layers.")} == set(map(str, range(8)))
    assert_close(model_weights(out("ck_even"), 3), weights, 5e-6)
