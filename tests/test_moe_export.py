"""tools/checkpoint_convert.py export-hf of MoE GPTs (issue 48 item 5): Mixtral, Qwen2-MoE, Qwen3-MoE.

Each model is trained 2 iterations under expert parallelism (its experts saved as blocks of the global tensors),
consolidated, and exported; our GPTModel built from the consolidated file (one process) and the exported
`transformers` model give the same logits on a batch (fp32, |delta| <= 1e-5 as the dense export test; measured
<= 2.4e-6 on logits up to 4.3: our router takes the softmax of the top-k logits where HF renormalizes the top-k
of the softmax, the same numbers up to rounding, and sums a token's experts in another order). Init std 0.2
makes the routing matter: the same export with two experts of the last MoE layer swapped is 0.1 or more away
(measured 1.2 to 2.1).

- mixtral: every layer MoE, top-2 softmax, grouped-query attention, untied head, aux loss and z-loss (training
  only), EP = 2.
- qwen2_moe: shared experts (Qwen2-MoE's gated shared expert: a zero gate and twice our down projection), a dense
  first layer (--moe-layer-freq list form -> mlp_only_layers), --moe-router-pre-softmax (norm_topk_prob false),
  --apply-layernorm-1p, TP = 2 with sequence parallelism x EP = 2 (expert TP 1).
- qwen3_moe: --qk-layernorm (q_norm/k_norm), --moe-layer-freq 2 (dense layers 1 and 3), --kv-channels 12.

What no class can express is one error line (sigmoid scores without the expert bias, a capacity, a top-k scaling
factor with softmax scores, biases, shared experts with --qk-layernorm and softmax scores), from the converter
too. (Sigmoid scores with the expert bias export to GLM-4.5: tests/test_hf_families.py.)
"""

import json
import shutil

import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import run_capturing, tiny_args
from test_checkpoint_convert import our_logits

from tools.checkpoint_convert import main

LLAMA_LIKE = {"--normalization": "RMSNorm", "--swiglu": True, "--position-embedding-type": "rope",
              "--disable-bias-linear": True, "--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 16,
              "--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001, "--init-method-std": 0.2,
              "--hidden-dropout": 0.0, "--attention-dropout": 0.0}
ARCHS = {
    "mixtral": (2, {"--num-layers": 2, "--expert-model-parallel-size": 2, "--group-query-attention": True,
                    "--num-query-groups": 2, "--untie-embeddings-and-output-weights": True}, "MixtralForCausalLM"),
    "qwen2_moe": (2, {"--num-layers": 3, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                      "--expert-tensor-parallel-size": 1, "--expert-model-parallel-size": 2,
                      "--moe-shared-expert-intermediate-size": 24, "--moe-layer-freq": "([0]*1+[1]*2)",
                      "--moe-router-pre-softmax": True, "--apply-layernorm-1p": True}, "Qwen2MoeForCausalLM"),
    "qwen3_moe": (2, {"--num-layers": 4, "--expert-model-parallel-size": 2, "--qk-layernorm": True,
                      "--moe-layer-freq": 2, "--kv-channels": 12}, "Qwen3MoeForCausalLM"),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request, tmp_path_factory):
    world, flags, _ = ARCHS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    argv = tiny_args(str(d / "run"), **LLAMA_LIKE, **flags, **{"--train-iters": 2, "--save": str(d / "ckpt"),
                                                               "--make-vocab-size-divisible-by": 16})
    assert [c for c, _ in run_distributed(run_capturing, world, args=(argv,), timeout=120)] == [0] * world
    return {"arch": request.param, "ckpt": str(d / "ckpt")}


def test_export_gives_the_same_logits(trained, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    d = tmp_path
    assert main(["consolidate", "--load", trained["ckpt"], "--out", str(d / "model.safetensors"), "--no-progress"]) == 0
    ids = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, info, weights = our_logits(str(d / "model.safetensors"), ids)
    experts = [v for k, v in weights.items() if k.endswith("mlp.experts.fc1")]
    assert experts and all(v.shape == (4, 16, 32) for v in experts)  # all experts, gathered from both EP ranks

    assert main(["export-hf", "--load", trained["ckpt"], "--out", str(d / "hf"), "--no-progress"]) == 0
    hf, loading = AutoModelForCausalLM.from_pretrained(str(d / "hf"), output_loading_info=True)
    assert type(hf).__name__ == ARCHS[trained["arch"]][2]
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched tensors
    config = hf.config
    assert (config.num_experts_per_tok, getattr(config, "num_experts", None) or config.num_local_experts) == (2, 4)
    if trained["arch"] == "qwen2_moe":
        assert config.mlp_only_layers == [0] and config.norm_topk_prob is False
    if trained["arch"] == "qwen3_moe":
        assert config.mlp_only_layers == [1, 3] and config.norm_topk_prob is True and config.head_dim == 12
    hf.eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5

    # The check can fail: experts 0 and 1 of the last MoE layer swapped in the export move the logits.
    state = load_file(str(d / "hf" / "model.safetensors"))
    first = [k for k in state if ".experts.0." in k]
    last_layer = max(int(k.split(".")[2]) for k in first)
    for k in (k for k in first if k.startswith(f"model.layers.{last_layer}.")):
        other = k.replace(".experts.0.", ".experts.1.")
        state[k], state[other] = state[other], state[k]
    (d / "swapped").mkdir()
    shutil.copy(d / "hf" / "config.json", d / "swapped" / "config.json")
    save_file(state, str(d / "swapped" / "model.safetensors"), metadata={"format": "pt"})
    swapped = AutoModelForCausalLM.from_pretrained(str(d / "swapped")).eval()
    with torch.no_grad():
        assert (swapped(ids).logits - theirs).abs().max().item() >= 0.1


def moe_model(**overrides):
    from megatron_po.config import ModelConfig
    base = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                num_experts=4, moe_router_topk=2, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32)
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize("overrides, needle", [
    ({"moe_router_score_function": "sigmoid"}, "sigmoid without the expert bias"),
    ({"moe_expert_capacity_factor": 1.0}, "dropless"),
    ({"moe_router_topk_scaling_factor": 2.5}, "does not scale the weights"),
    ({"add_bias_linear": True}, "--add-bias-linear"),
    ({"qk_layernorm": True, "moe_shared_expert_intermediate_size": 32}, "Qwen3MoeForCausalLM: shared experts"),
    ({"normalization": "LayerNorm"}, "MixtralForCausalLM: normalization=LayerNorm"),
    ({"multi_latent_attention": True}, "multi-latent attention"),
], ids=["sigmoid-no-bias", "capacity", "scaling", "bias", "qk-norm-shared", "layernorm", "mla"])
def test_what_no_hf_class_holds_is_one_line(overrides, needle):
    from megatron_po.errors import UserError
    from megatron_po.models.hf.configs import export_family
    with pytest.raises(UserError, match=needle):
        export_family(moe_model(**overrides))
    with pytest.raises(UserError, match="LlamaForCausalLM cannot hold this model: a mixture of experts"):
        export_family(moe_model(), "llama")  # never silently as a Llama
    assert export_family(moe_model()).model_type == "mixtral"
    assert export_family(moe_model(moe_router_pre_softmax=True)).model_type == "qwen2_moe"


def test_the_converter_refuses_an_unexportable_checkpoint_with_one_line(tmp_path, capsys):
    """A model with an expert capacity (written as import-te writes a checkpoint): exit 2, one line, nothing out."""
    import dataclasses

    from megatron_po.config import Config
    from megatron_po.models.gpt import GPTModel
    from tools.checkpoint_convert import write_weights_checkpoint
    model = moe_model(moe_expert_capacity_factor=1.0)
    weights = {k: v for k, v in GPTModel(model, 112, seed=0).state_dict().items()}
    cfg = Config().to_dict()
    cfg["model"] = dataclasses.asdict(model)
    write_weights_checkpoint(str(tmp_path / "ckpt"), weights, cfg, 101, 112, "test")
    capsys.readouterr()
    assert main(["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "dropless" in err[0], err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    with open(tmp_path / "ckpt" / "iter_0000000" / "checksums.json") as f:
        assert json.load(f)  # a real checkpoint was refused, not a missing one



def test_the_converter_builds_an_moe_model_on_the_meta_device():
    """export-hf and import-hf learn a checkpoint's tensors from the model built on the meta device: the experts'
    per-expert seeding draws its seed from the default generator there too (a meta tensor has no value to seed
    with; before, the build raised "Tensor.item() cannot be called on meta tensors"). The draw is the one a CPU build makes, so
    the weights are the same as before: the MoE golden curves (tests/golden/ep2_moe_*.json) did not move."""
    from megatron_po.config import ModelConfig
    from megatron_po.distributed.checkpoint_hf import meta_model_tensors
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=16, swiglu=True)
    experts = {k: t for k, t in meta_model_tensors(m, 64).items() if ".experts." in k}
    assert experts and all(t.is_meta for t in experts.values())
    assert {tuple(t.shape) for k, t in experts.items() if k.endswith("fc1")} == {(4, 16, 32)}, experts
