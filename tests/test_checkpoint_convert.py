"""tools/checkpoint_convert.py: consolidation and Hugging Face export/import, in one process.

- A GPT-2-style model (LayerNorm, GELU, learned positions, tied head, biases) trained with TP=2 and a
  Llama-style one (RMSNorm, SwiGLU, RoPE, untied head, no biases) trained with PP=2 are consolidated;
  our GPTModel built from the consolidated file and the exported `transformers` model give the same
  logits on a batch (fp32, |delta| <= 1e-5; measured 0: the same ops in the same order). A Llama-3-style
  one with grouped-query attention (4 heads, 2 key/value groups), --kv-channels 12 (not hidden / heads),
  --apply-layernorm-1p, --rotary-base 500000 and --rotary-seq-len-interpolation-factor 2 (HF's linear rope
  scaling), trained with TP=2 (one group per rank), exports to a LlamaForCausalLM with num_key_value_heads
  2 and head_dim 12 and the same logits. A Llama-3.1-style one with --use-rope-scaling --rope-scaling-factor 8
  (head dimension 16, --rotary-base 500000: 3 of its 8 frequencies divided by 8, one blended) exports HF's
  "llama3" rope type and the same logits; init std 0.1 makes the positions matter enough that the same
  model without the scaling is 1e-3 or more away (at 0.02 it would be 5e-6, under the tolerance).
- import-hf round-trips exactly: every tensor of import(export(ckpt)) equals the checkpoint's (the
  vocabulary's 101 rows without the padding, which the export drops and the run that loads the import
  adds back), and re-exporting reproduces the HF tensors bit for bit and the same RoPE parameters. The
  imported checkpoint trains with --finetune (at PP = 2, its vocabulary padded on load).
- Unsupported combinations and bad paths give one error line.
"""

import json

import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import run_capturing, tiny_args

from tools.checkpoint_convert import config_path_of, main

ARCHS = {
    "gpt2": (2, {"--tensor-model-parallel-size": 2}),
    "llama": (2, {"--pipeline-model-parallel-size": 2, "--normalization": "RMSNorm", "--swiglu": True,
                  "--position-embedding-type": "rope", "--untie-embeddings-and-output-weights": True,
                  "--no-add-bias-linear": True}),
    "llama-gqa": (2, {"--tensor-model-parallel-size": 2, "--normalization": "RMSNorm", "--swiglu": True,
                      "--position-embedding-type": "rope", "--untie-embeddings-and-output-weights": True,
                      "--disable-bias-linear": True, "--group-query-attention": True, "--num-query-groups": 2,
                      "--kv-channels": 12, "--apply-layernorm-1p": True, "--rotary-base": 500000,
                      "--rotary-seq-len-interpolation-factor": 2}),
    "llama3-rope-scaling": (2, {"--tensor-model-parallel-size": 2, "--normalization": "RMSNorm", "--swiglu": True,
                                "--position-embedding-type": "rope", "--untie-embeddings-and-output-weights": True,
                                "--disable-bias-linear": True, "--kv-channels": 16, "--rotary-base": 500000,
                                "--use-rope-scaling": True, "--rope-scaling-factor": 8, "--init-method-std": 0.1}),
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request, tmp_path_factory):
    world, flags = ARCHS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    argv = tiny_args(str(d / "run"), **flags, **{"--num-layers": 2, "--train-iters": 2, "--save": str(d / "ckpt"),
                                                 "--make-vocab-size-divisible-by": 16})
    assert [c for c, _ in run_distributed(run_capturing, world, args=(argv,), timeout=120)] == [0] * world
    return {"arch": request.param, "ckpt": str(d / "ckpt"), "dir": d, "flags": flags}


def our_logits(safetensors_path, ids):
    """Logits of our GPTModel (one process, TP=1) built from a consolidated file and its JSON."""
    from safetensors.torch import load_file

    from megatron_po.config import ModelConfig
    from megatron_po.models.gpt import GPTModel
    with open(config_path_of(safetensors_path)) as f:
        info = json.load(f)
    weights = load_file(safetensors_path)
    model = GPTModel(ModelConfig(**info["config"]["model"]), info["padded_vocab_size"], seed=0)
    if "output_layer.weight" not in weights:  # tied: one tensor under the embedding's name
        weights["output_layer.weight"] = weights["embedding.word_embeddings.weight"]
    model.load_state_dict(weights, strict=True)
    model.eval()
    with torch.no_grad():
        return model(ids).transpose(0, 1)[..., :info["vocab_size"]], info, weights


def test_export_matches_logits_and_import_round_trips(trained, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    d = tmp_path
    assert main(["consolidate", "--load", trained["ckpt"], "--out", str(d / "model.safetensors"), "--no-progress"]) == 0
    ids = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, info, weights = our_logits(str(d / "model.safetensors"), ids)
    tp = trained["flags"].get("--tensor-model-parallel-size", 1)
    padded = -(-101 // (16 * tp)) * 16 * tp  # 101 ids (100 + end of document) padded to a multiple of 16 x TP
    assert info["iteration"] == 2 and info["vocab_size"] == 101 and info["padded_vocab_size"] == padded

    assert main(["export-hf", "--load", trained["ckpt"], "--out", str(d / "hf"), "--no-progress"]) == 0
    hf, loading = AutoModelForCausalLM.from_pretrained(str(d / "hf"), output_loading_info=True)
    assert type(hf).__name__ == ("GPT2LMHeadModel" if trained["arch"] == "gpt2" else "LlamaForCausalLM")
    if trained["arch"] == "llama-gqa":
        assert (hf.config.num_attention_heads, hf.config.num_key_value_heads, hf.config.head_dim) == (4, 2, 12)
        assert hf.config.rope_parameters["rope_type"] == "linear" and hf.config.rope_parameters["factor"] == 2
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched tensors
    hf.eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5
    if trained["arch"] == "llama3-rope-scaling":
        assert hf.config.rope_parameters == LLAMA3_ROPE
        unscaled = AutoModelForCausalLM.from_pretrained(
            str(d / "hf"), rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).eval()
        with torch.no_grad():
            assert (unscaled(ids).logits - theirs).abs().max().item() >= 1e-3  # the check above can fail

    # Back into our format: the same tensors (the vocabulary unpadded), then the same HF tensors.
    assert main(["import-hf", "--hf", str(d / "hf"), "--out", str(d / "imported"),
                 "--make-vocab-size-divisible-by", "16", "--no-progress"]) == 0
    assert main(["consolidate", "--load", str(d / "imported"), "--out", str(d / "back.safetensors"),
                 "--no-progress"]) == 0
    back = load_file(str(d / "back.safetensors"))
    if trained["arch"] == "gpt2":
        del weights["output_layer.weight"]  # added above for the tied head; not a separate tensor
    assert back.keys() == weights.keys()
    for k, w in weights.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the vocabulary's 101 rows, unpadded
            assert torch.equal(back[k], w[:101]), k
        elif "--apply-layernorm-1p" in trained["flags"] and k.endswith("norm.weight"):  # imported as plain weights
            assert torch.equal(back[k], w + 1), k
        else:
            assert torch.equal(back[k], w), k
    assert main(["export-hf", "--load", str(d / "imported"), "--out", str(d / "hf2"), "--no-progress"]) == 0
    first, second = load_file(str(d / "hf" / "model.safetensors")), load_file(str(d / "hf2" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    with open(d / "hf" / "config.json") as f, open(d / "hf2" / "config.json") as g:
        assert json.load(f).get("rope_parameters") == json.load(g).get("rope_parameters")

    if trained["arch"] == "llama":  # the imported checkpoint is a starting point for training
        world, flags = ARCHS["llama"]
        argv = tiny_args(str(d / "ft"), **flags, **{"--num-layers": 2, "--train-iters": 1, "--load": str(d / "imported"),
                                                    "--finetune": True, "--make-vocab-size-divisible-by": 16})
        assert [c for c, _ in run_distributed(run_capturing, world, args=(argv,), timeout=120)] == [0] * world


def test_unsupported_combinations_and_bad_paths_give_one_line(tmp_path, capsys):
    from megatron_po.config import ModelConfig
    from megatron_po.errors import UserError
    from megatron_po.models.hf.configs import export_family
    model = ModelConfig(normalization="RMSNorm")  # RMSNorm + GELU + learned positions
    with pytest.raises(UserError, match="normalization=RMSNorm, MLP=GELU, positions=learned_absolute"):
        export_family(model)
    llama_with_qkv_bias = ModelConfig(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                                      position_embedding_type="rope", add_qkv_bias=True)
    with pytest.raises(UserError, match="--add-qkv-bias"):  # never a Llama without the bias
        export_family(llama_with_qkv_bias, "llama")
    with pytest.raises(UserError, match="multi-latent attention"):
        export_family(ModelConfig(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                                  multi_latent_attention=True))
    for argv, needle in [(["consolidate", "--load", str(tmp_path / "none"), "--out", str(tmp_path / "x.safetensors")],
                          "no such directory"),
                         (["export-hf", "--load", str(tmp_path), "--out", str(tmp_path / "hf")], "no checkpoint"),
                         (["import-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "ck")], "no config.json")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
