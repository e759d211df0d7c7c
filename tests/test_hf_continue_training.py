"""Continued pretraining from a Hugging Face checkpoint and back (issue 56 items 3 and 4).

A Llama-3-shaped model (grouped-query attention, llama3 RoPE scaling, untied head), a Qwen3-MoE (q/k norms,
4 experts, top-2) and a DeepSeek-V3 (MLA, YaRN, MoE, an MTP depth) are built by `transformers` from tiny configs whose vocabulary is the byte-level BPE tokenizer
of tests/conftest.py (trained locally on the bundled corpus; the Llama's config holds 24 rows more, as Qwen's
and GLM's do: the run, which pads the tokenizer's ids to its own multiple, loads the rows it has room for),
saved with that tokenizer, and imported. The
flag line import-hf prints (model flags from config.json, `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR`) is what the run gets, with the corpus tools/preprocess_data.py tokenized with that
tokenizer. Each trains 3 iterations under PipeOptim at PP = 2 (Llama: TP = 2; Qwen3-MoE: TP = 2 with sequence
parallelism and EP = 2; DeepSeek-V3's shape, with multi-latent attention, group routing and one
multi-token prediction depth: EP = 2): the loss falls (DeepSeek-V3: the LM loss). The trained checkpoint exports (with the tokenizer, which
`AutoTokenizer` loads and which encodes as the original) and `transformers` gives our trained model's logits
(fp32, |delta| <= 1e-5, the export tests' tolerance).

The same import loads at any layout: a Qwen3-MoE import trains 2 iterations with the one-process run's losses at
TP 2 x CP 2 with EP 2 x expert TP 2, and at PP 2 x DP 2 with EP 2.
"""

import json
import os
import shlex
import shutil

import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import run_capturing
from test_hf_families import add_mtp_layer, logits_of_checkpoint

from tools.checkpoint_convert import main

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.02)
MODELS = {
    "llama3": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
               {"--tensor-model-parallel-size": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         norm_topk_prob=True),
                  {"--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--expert-model-parallel-size": 2,
                   "--expert-tensor-parallel-size": 1}),
    # DeepSeek-V3's shape: MLA with a query latent and YaRN, a dense first layer, sigmoid routing with the expert
    # bias in 2 groups, a shared expert, one MTP depth as the Hub holds it; PP 2 x EP 2 (DP 2).
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                             num_nextn_predict_layers=1,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                              "factor": 4.0, "original_max_position_embeddings": 16,
                                                              "mscale": 1.0, "mscale_all_dim": 1.0}),
                    {"--expert-model-parallel-size": 2}),
}
RUN = {"--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim", "--seq-length": 32,
       "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 3, "--lr": 3e-3, "--min-lr": 3e-3,
       "--lr-warmup-iters": 0, "--log-interval": 1, "--eval-iters": 0, "--seed": 5,
       "--make-vocab-size-divisible-by": 16}


@pytest.mark.parametrize("name", list(MODELS))
def test_import_train_export(name, byte_bpe, hf_corpus, tmp_path):
    import contextlib
    import io

    import transformers
    from cli_args import flags_to_argv
    cls, kwargs, layout = MODELS[name]
    tok = transformers.AutoTokenizer.from_pretrained(str(byte_bpe["dir"]))
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    spare = 24 if name == "llama3" else 0  # Qwen's and GLM's configs hold more rows than their tokenizers' ids
    config = getattr(transformers, cls)(vocab_size=len(tok) + spare, **{**COMMON, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(hf_dir), max_shard_size="200KB")
    if getattr(config, "num_nextn_predict_layers", 0):
        add_mtp_layer(model, hf_dir)
    for f in os.listdir(byte_bpe["dir"]):
        shutil.copy(byte_bpe["dir"] / f, hf_dir / f)

    printed = io.StringIO()  # not capsys: the forked ranks below need a real sys.stderr (dist_harness)
    with contextlib.redirect_stdout(printed):
        assert main(["import-hf", "--hf", str(hf_dir), "--out", str(tmp_path / "imported"), "--no-progress",
                     "--make-vocab-size-divisible-by", "16"]) == 0
    line = printed.getvalue().strip().splitlines()[-1].strip()
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf_dir}" in line

    run = tmp_path / "run"
    argv = shlex.split(line) + flags_to_argv({**RUN, **layout, "--data-path": hf_corpus["prefix"],
                                               "--save": str(run / "ckpt"), "--save-interval": 3,
                                               "--data-cache-path": str(run / "cache"),
                                               "--metrics-file": str(run / "metrics.jsonl")})
    results = run_distributed(run_capturing, 4, args=(argv,), timeout=300)
    assert [c for c, _ in results] == [0] * 4, results
    with open(run / "metrics.jsonl") as f:
        losses = [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]
    assert len(losses) == 3 and losses[2] < losses[0], losses

    assert main(["export-hf", "--load", str(run / "ckpt"), "--out", str(tmp_path / "hf2"), "--no-progress"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert type(back).__name__ == {"llama3": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                   "deepseek_v3": "DeepseekV3ForCausalLM"}[name]
    ids = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    ours, extra = logits_of_checkpoint(str(run / "ckpt"), ids)
    with torch.no_grad():
        theirs = back(ids).logits
    assert extra["train_state"]["iteration"] == 3 and ours.shape == theirs.shape == (2, 32, len(tok))
    assert (ours - theirs).abs().max().item() <= 1e-5
    text = "In the beginning God created the heavens and the earth."
    exported_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf2"))
    assert exported_tok(text).input_ids == tok(text).input_ids


# The same imported checkpoint at three layouts; mock data (the same tokens at any layout), 2 iterations of 1F1B.
LAYOUTS = {
    "one process": (1, {}),
    "TP 2 x CP 2, EP 2 x expert TP 2": (4, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                           "--context-parallel-size": 2, "--expert-model-parallel-size": 2,
                                           "--expert-tensor-parallel-size": 2}),
    "PP 2 x DP 2, EP 2": (4, {"--pipeline-model-parallel-size": 2, "--expert-model-parallel-size": 2}),
}


def imported_qwen3_moe(tmp_path, **config) -> list[str]:
    """A Qwen3-MoE (vocabulary 128, 4 experts top-2, q/k norms) built by transformers from a tiny config (COMMON's
    sizes, `config` over them), saved under tmp_path/hf and imported into tmp_path/imported: the flag line import-hf
    printed (`--load ... --finetune` and the model flags), split."""
    import contextlib
    import io

    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=128, **dict(COMMON, initializer_range=0.2, **config),
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "hf"))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported"),
                     "--no-progress"]) == 0
    return shlex.split(printed.getvalue().strip().splitlines()[-1])


def test_an_import_loads_at_any_layout(tmp_path):
    """A Qwen3-MoE import (4 layers, 4 experts) trained 2 iterations at each layout of LAYOUTS: the losses equal the
    one-process run's (fp32, |delta| <= 1e-5, as tests/test_checkpoint.py's resharding: reduction orders only;
    measured <= 4.8e-7)."""
    from cli_args import flags_to_argv
    line = imported_qwen3_moe(tmp_path, num_hidden_layers=4)
    losses = {}
    for name, (world, layout) in LAYOUTS.items():
        run = tmp_path / name.replace(" ", "_")
        flags = {**RUN, "--pipeline-method": "1f1b", "--train-iters": 2, "--pipeline-model-parallel-size": 1,
                 "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": 127, **layout,
                 "--data-cache-path": str(run / "cache"), "--metrics-file": str(run / "metrics.jsonl")}
        results = run_distributed(run_capturing, world, args=(line + flags_to_argv(flags),), timeout=300)
        assert [c for c, _ in results] == [0] * world, results
        with open(run / "metrics.jsonl") as f:
            losses[name] = [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]
    reference = losses.pop("one process")
    assert len(reference) == 2
    for name, got in losses.items():
        assert max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (name, got, reference)
