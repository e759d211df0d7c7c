"""Hugging Face import and export for every family served (issue 56; megatron_po/models/hf/,
megatron_po/distributed/checkpoint_hf.py), in one process.

Each family's model is built by `transformers` from a tiny config (no download), every tensor and buffer drawn
at random (std 0.2, norms around 1, GLM-4.5's expert bias too: nothing is left at a value that hides a mistake),
and saved by `save_pretrained` (some families in several shards). Then:
- import-hf writes our checkpoint; our GPTModel built from it gives the transformers model's logits (fp32,
  |delta| <= 1e-5, the export tests' tolerance, on logits up to 5.2; measured 0 for Llama, Mistral and Qwen3,
  7.2e-7 for GPT-2, 8.3e-7 to 1.6e-6 for the MoE families, whose routing weights are computed in another order,
  4.9e-6 for DeepSeek-V3 and 3.9e-6 for Moonlight's shape, whose attention is multi-latent);
- the printed flag line parses and validates (one process) to the checkpoint's model config;
- export-hf (in shards where --max-shard-size says) writes every HF tensor bit for bit, loads with
  `from_pretrained` with nothing missing or unexpected, and names the same class.
The checks can fail: GLM-4.5 with its expert bias zeroed routes elsewhere (logits >= 1e-3 away), and so on per
family (`MATTERS`).
Bad input is one line and leaves no output: an architecture not served, a missing shard, a shape that disagrees
with config.json, a tensor nothing reads, a tokenizer directory without a tokenizer, an --out that is not empty;
on export too (a shard size that is no size, a --model-type that cannot hold the model). Streaming: DCP makes each
imported tensor when it writes it, the previous ones already released.
"""

import json
import os
import shlex
import weakref

import pytest
import torch

from tools.checkpoint_convert import main

BASE = dict(vocab_size=101, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
# Multi-latent attention's sizes in place of grouped-query attention's (DeepseekV3's head_dim is the rotary one).
BASE_MLA = dict({k: v for k, v in BASE.items() if k != "head_dim"}, num_key_value_heads=4, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# family: (config class, its arguments, --max-shard-size of save_pretrained and export-hf or None)
FAMILIES = {
    "gpt2": ("GPT2Config", dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                activation_function="gelu_new", tie_word_embeddings=True), None),
    "llama": ("LlamaConfig", dict(BASE, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE), "20KB"),
    "mistral": ("MistralConfig", dict(BASE, sliding_window=None, tie_word_embeddings=True), None),
    "qwen3": ("Qwen3Config", dict(BASE), "20KB"),
    "mixtral": ("MixtralConfig", dict(BASE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16), None),
    "qwen2_moe": ("Qwen2MoeConfig", dict(BASE, **MOE, num_experts=4, shared_expert_intermediate_size=24,
                                         mlp_only_layers=[0], norm_topk_prob=False, qkv_bias=False), "30KB"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, **MOE, num_experts=4, mlp_only_layers=[1], norm_topk_prob=True),
                  None),
    "glm4_moe": ("Glm4MoeConfig", dict(BASE, **MOE, n_routed_experts=4, n_group=1, topk_group=1,
                                       first_k_dense_replace=1, n_shared_experts=1, attention_bias=False,
                                       use_qk_norm=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}), "30KB"),
    # DeepSeek-V3: multi-latent attention with a query latent and YaRN whose factor, mscale and mscale_all_dim all
    # change numbers (tests/test_mla.py's), group routing (2 groups, the best 1), a dense first layer, a shared
    # expert, one MTP depth as the Hub holds it.
    "deepseek_v3": ("DeepseekV3Config", dict(BASE_MLA, **MOE, n_routed_experts=4, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                             num_nextn_predict_layers=1, q_lora_rank=16, rope_parameters=YARN),
                    "30KB"),
    # Moonlight's shape: no query latent (q_proj), plain RoPE, no groups, two shared experts, norms' epsilon 1e-5
    # (the latent norms' stays 1e-6 in transformers: --mla-latent-norm-epsilon 1e-6), no MTP depth.
    "deepseek_v3:moonlight": ("DeepseekV3Config", dict(BASE_MLA, **MOE, n_routed_experts=4, n_group=1,
                                                       topk_group=1, first_k_dense_replace=1, n_shared_experts=2,
                                                       routed_scaling_factor=2.446, num_nextn_predict_layers=0,
                                                       q_lora_rank=None, rms_norm_eps=1e-5,
                                                       rope_parameters={"rope_type": "default",
                                                                        "rope_theta": 50000.0}), None),
}
# What each family's check above could miss, zeroed in the HF model: the logits must move by >= 1e-3.
MATTERS = {"glm4_moe": "e_score_correction_bias", "deepseek_v3": "kv_a_layernorm", "qwen3": "q_norm", "llama": "o_proj.bias",
           "qwen3_moe": "k_norm", "qwen2_moe": "shared_expert_gate"}


def hf_model(family: str, directory=None):
    """The family's transformers model, every float tensor random (norms around 1), saved to `directory`."""
    import transformers
    cls, kwargs, shard = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs)).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.2 + (1.0 if "norm" in name or name.endswith("ln_f.weight") else 0.0))
    if directory is not None:
        model.save_pretrained(str(directory), max_shard_size=shard or "50GB")
        if getattr(model.config, "num_nextn_predict_layers", 0):
            add_mtp_layer(model, directory)
    return model


def add_mtp_layer(model, directory):
    """The multi-token prediction layer (one depth) as GLM-4.5's Hub checkpoints hold it, which `save_pretrained`
    does not write: layer L's tensors (random, shaped as the last layer's), enorm, hnorm, eh_proj,
    shared_head.norm, and copies of the embedding and the head; in a shard of its own, added to the index."""
    from safetensors.torch import load_file, save_file
    with open(directory / "model.safetensors.index.json") as f:
        index = json.load(f)
    state = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(str(directory / f)).items()}
    last, h = model.config.num_hidden_layers - 1, model.config.hidden_size
    new = {k.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): torch.randn_like(v) * 0.2
           for k, v in state.items() if k.startswith(f"model.layers.{last}.")}
    g = f"model.layers.{last + 1}."
    new.update({g + "enorm.weight": 1 + 0.1 * torch.randn(h), g + "hnorm.weight": 1 + 0.1 * torch.randn(h),
                g + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h),
                g + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
                g + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                g + "shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file(new, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({k: "model-mtp.safetensors" for k in new})
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)


def logits_of_checkpoint(ckpt: str, ids: torch.Tensor):
    """Our GPTModel's logits (one process) from a checkpoint, and the checkpoint's extra."""
    from megatron_po.config import model_config_from_dict
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    from megatron_po.models.gpt import GPTModel
    weights, extra, _ = read_full_checkpoint(ckpt, progress=False)
    model = GPTModel(model_config_from_dict(extra["config"]["model"]), extra["padded_vocab_size"], seed=0)
    state = {k: v.float() for k, v in weights.items()}
    state.setdefault("output_layer.weight", state["embedding.word_embeddings.weight"])  # a tied head
    state.pop("mtp.embedding.word_embeddings.weight", None)  # an asynchronous run's MTP copy (one process: shared)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        rows = extra.get("hf_vocab_size", extra["vocab_size"])  # an imported checkpoint's, else the run's
        return model.eval()(ids).transpose(0, 1)[..., :rows], extra


def hf_tensors(directory) -> dict:
    from safetensors.torch import load_file
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_and_export_give_the_same_logits_and_tensors(family, tmp_path, capsys):
    import transformers

    from megatron_po.config import parse_args
    from megatron_po.config_rules import validate
    hf = hf_model(family, tmp_path / "hf")
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
                 "--make-vocab-size-divisible-by", "16", "--no-progress"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1].strip()
    ours, extra = logits_of_checkpoint(str(tmp_path / "ckpt"), ids)
    assert extra["hf_model_type"] == family.split(":")[0] and ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5

    # The flag line builds this model (and passes the start-up checks of a one-process run).
    cfg = parse_args(shlex.split(line) + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "101",
                                          "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"])
    validate(cfg, 1)
    assert {k: v for k, v in vars(cfg.model).items()} == extra["config"]["model"]

    shard = FAMILIES[family][2]
    assert main(["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2"), "--no-progress",
                 *(["--max-shard-size", shard] if shard else [])]) == 0
    first, second = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf2")
    assert first.keys() == second.keys()
    assert all(first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    assert os.path.isfile(tmp_path / "hf2" / "model.safetensors.index.json") == (shard is not None)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), output_loading_info=True)
    mtp_layer = f"model.layers.{getattr(hf.config, 'num_hidden_layers', 0)}."  # GLM-4.5's MTP: no HF module reads it
    info["unexpected_keys"] = {k for k in info["unexpected_keys"] if not k.startswith(mtp_layer)}
    assert type(back).__name__ == type(hf).__name__ and not any(info.values()), info
    with torch.no_grad():
        assert (back.eval()(ids).logits - theirs).abs().max().item() <= 1e-5  # GPT-2: gelu_new as gelu_pytorch_tanh

    if family in MATTERS:  # the comparisons above can fail
        with torch.no_grad():
            for name, t in hf.state_dict().items():
                if MATTERS[family] in name:
                    t.zero_()
            assert (hf(ids).logits - theirs).abs().max().item() >= 1e-3


def test_export_refuses_what_no_class_holds_in_one_line():
    from megatron_po.config import ModelConfig
    from megatron_po.errors import UserError
    from megatron_po.models.hf.configs import export_family
    llama_like = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)
    moe = dict(llama_like, num_experts=4, moe_router_topk=2)
    for model, needle in [
        (ModelConfig(normalization="RMSNorm"), "normalization=RMSNorm, MLP=GELU, positions=learned_absolute"),
        (ModelConfig(**llama_like, rotary_percent=0.5), "--rotary-percent 0.5"),
        (ModelConfig(**moe, moe_expert_capacity_factor=1.0), "dropless"),
        (ModelConfig(**moe, moe_router_topk_scaling_factor=2.5), "does not scale the weights"),
        (ModelConfig(**moe, qk_layernorm=True, moe_shared_expert_intermediate_size=32), "shared experts"),
        (ModelConfig(**dict(moe, add_bias_linear=True)), "--add-bias-linear"),
    ]:
        with pytest.raises(UserError, match=needle) as e:
            export_family(model)
        assert "\n" not in str(e.value)
    assert export_family(ModelConfig(**moe)).model_type == "mixtral"
    assert export_family(ModelConfig(**moe, moe_router_pre_softmax=True)).model_type == "qwen2_moe"
    assert export_family(ModelConfig(**moe, moe_router_score_function="sigmoid",
                                     moe_router_enable_expert_bias=True)).model_type == "glm4_moe"
    assert export_family(ModelConfig(**llama_like, qk_layernorm=True)).model_type == "qwen3"
    with pytest.raises(UserError, match="MistralForCausalLM cannot hold this model: q/k norms"):
        export_family(ModelConfig(**llama_like, qk_layernorm=True), "mistral")


# A dense multi-latent attention model of ours (DeepseekV3 holds it as first_k_dense_replace = the layers), YaRN on.
DENSE_MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=32,
                 normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, position_embedding_type="rope",
                 add_bias_linear=False, untie_embeddings_and_output_weights=True, multi_latent_attention=True,
                 q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12,
                 qk_layernorm=True, rotary_scaling_factor=4.0, mscale_all_dim=0.8,
                 yarn_original_max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)


def test_a_dense_mla_model_exports_to_deepseek_v3_and_back(tmp_path, capsys):
    """Our dense MLA GPT (latent norms with --norm-epsilon 1e-5) -> export-hf: DeepseekV3ForCausalLM with
    first_k_dense_replace 2 and a line saying its latent norms take 1e-6; with --mla-latent-norm-epsilon 1e-6
    transformers gives our logits (1e-5) and import-hf brings back every tensor bit for bit."""
    import dataclasses

    import transformers

    from megatron_po.config import Config, ModelConfig
    from megatron_po.models.gpt import GPTModel
    from tools.checkpoint_convert import write_weights_checkpoint
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    for latent_eps in (None, 1e-6):
        model = ModelConfig(**DENSE_MLA, mla_latent_norm_epsilon=latent_eps)
        torch.manual_seed(0)
        net = GPTModel(model, 112, seed=0).eval()
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
            ours = net(ids).transpose(0, 1)[..., :101]
        cfg = Config().to_dict()
        cfg["model"] = dataclasses.asdict(model)
        d = tmp_path / str(latent_eps)
        write_weights_checkpoint(str(d / "ckpt"), dict(net.state_dict()), cfg, 101, 112, "test")
        capsys.readouterr()
        assert main(["export-hf", "--load", str(d / "ckpt"), "--out", str(d / "hf"), "--no-progress"]) == 0
        note = "note: the latent norms here take epsilon 1e-05; DeepseekV3ForCausalLM's"
        assert (note in capsys.readouterr().out) == (latent_eps is None)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d / "hf")).eval()
        assert type(hf).__name__ == "DeepseekV3ForCausalLM" and hf.config.first_k_dense_replace == 2
        with torch.no_grad():
            delta = (hf(ids).logits - ours).abs().max().item()
        assert delta <= 1e-5 if latent_eps else delta > 1e-6  # the epsilon matters
    assert main(["import-hf", "--hf", str(d / "hf"), "--out", str(d / "back"), "--no-progress"]) == 0
    back, extra = logits_of_checkpoint(str(d / "back"), ids)
    assert extra["config"]["model"]["num_experts"] is None and extra["config"]["model"]["mla_latent_norm_epsilon"] == 1e-6
    assert (back - ours).abs().max().item() <= 1e-5
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    first, _, _ = read_full_checkpoint(str(d / "ckpt"), progress=False)
    second, _, _ = read_full_checkpoint(str(d / "back"), progress=False)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k][:101] if "word_emb" in k or "output" in k else first[k], second[k]) for k in first)


def test_deepseek_v3_refuses_what_it_cannot_hold_in_one_line(tmp_path, capsys):
    """Export: an MLA model without the latent norms, with softmax routing, with --mscale but no --mscale-all-dim,
    with plain RoPE and a softmax scale; import: rope_interleave false, attention_bias, mscale_all_dim without
    mscale, an explicit attention_factor, fewer key/value heads, a quantized checkpoint. One line each, nothing
    written. Kimi K2's model_type (kimi_k2, the same class) imports."""
    import shutil

    from megatron_po.config import ModelConfig
    from megatron_po.errors import UserError
    from megatron_po.models.hf.configs import export_family
    moe = dict(num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert export_family(ModelConfig(**DENSE_MLA)).model_type == "deepseek_v3"
    assert export_family(ModelConfig(**DENSE_MLA, **moe)).model_type == "deepseek_v3"
    for changes, needle in [
        (dict(qk_layernorm=False), "DeepseekV3ForCausalLM: multi-latent attention without the latent norms"),
        (dict(moe, moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
         "DeepseekV3ForCausalLM: softmax routing"),
        (dict(mscale=0.9, mscale_all_dim=0.0), "--mscale 0.9 with --mscale-all-dim 0"),
        (dict(rope_type="rope"), "--rope-type rope with a softmax scale"),
    ]:
        with pytest.raises(UserError, match=needle) as e:
            export_family(ModelConfig(**{**DENSE_MLA, **changes}))
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="LlamaForCausalLM cannot hold this model: multi-latent attention"):
        export_family(ModelConfig(**DENSE_MLA), "llama")

    src = tmp_path / "hf"
    hf_model("deepseek_v3:moonlight", src)
    capsys.readouterr()
    for case, changes, needle in [
        ("interleave", dict(rope_interleave=False), "rope_interleave false"),
        ("bias", dict(attention_bias=True), "attention_bias True: no equivalent here"),
        ("mscale", dict(rope_parameters=dict(YARN, mscale=0)), "mscale_all_dim 0.8 without mscale"),
        ("factor", dict(rope_parameters=dict(YARN, attention_factor=1.5)), "attention_factor 1.5"),
        ("kv-heads", dict(num_key_value_heads=2), "num_key_value_heads 2 with multi-latent attention's 4 heads"),
        ("quantized", dict(quantization_config={"quant_method": "fp8"}), "quantization_config (fp8)"),
    ]:
        shutil.copytree(src, tmp_path / case)
        _edit_json(tmp_path / case / "config.json", **changes)
        assert main(["import-hf", "--hf", str(tmp_path / case), "--out", str(tmp_path / "ckpt"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (case, err)
        assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()
    shutil.copytree(src, tmp_path / "kimi")  # Kimi K2's config.json: DeepseekV3ForCausalLM, model_type kimi_k2
    _edit_json(tmp_path / "kimi" / "config.json", model_type="kimi_k2")
    assert main(["import-hf", "--hf", str(tmp_path / "kimi"), "--out", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    assert logits_of_checkpoint(str(tmp_path / "ckpt"), torch.zeros(1, 4, dtype=torch.long))[1]["hf_model_type"] == \
        "deepseek_v3"


def _edit_json(path, **changes):
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.fixture(scope="module")
def sharded_qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3") / "hf"
    hf_model("qwen3", d)
    return d


@pytest.mark.parametrize("case", ["architecture", "missing-shard", "shape", "unread-tensor", "no-tokenizer",
                                  "not-empty"])
def test_bad_input_is_one_line_and_writes_nothing(case, sharded_qwen3, tmp_path, capsys):
    import shutil
    src = tmp_path / "hf"
    shutil.copytree(sharded_qwen3, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    extra = []
    if case == "architecture":
        _edit_json(src / "config.json", architectures=["Qwen3ForSequenceClassification"])
        needle = "Qwen3ForSequenceClassification' (model_type 'qwen3'): not served"
    elif case == "missing-shard":
        os.remove(src / sorted(set(index["weight_map"].values()))[1])
        needle = "is missing (model.safetensors.index.json lists it)"
    elif case == "shape":
        _edit_json(src / "config.json", intermediate_size=40)
        needle = ("shapes disagree with config.json: model.layers.0.mlp.up_proj.weight (48, 32) make our "
                  "layers.0.mlp.fc1.weight (48, 32), config.json (40, 32)")
    elif case == "unread-tensor":
        _edit_json(src / "config.json", num_hidden_layers=2, layer_types=["full_attention"] * 2)
        needle = "tensor model.layers.2."
    elif case == "no-tokenizer":
        (tmp_path / "tok").mkdir()
        extra = ["--tokenizer-model", str(tmp_path / "tok")]
        needle = "no tokenizer there"
    else:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "something").write_text("")
        needle = "exists and is not empty"
    assert main(["import-hf", "--hf", str(src), "--out", str(tmp_path / "ckpt"), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert sorted(os.listdir(tmp_path)) == (["ckpt", "hf"] if case == "not-empty" else
                                           ["hf", "tok"] if case == "no-tokenizer" else ["hf"])


def test_export_bad_input_is_one_line_and_writes_nothing(sharded_qwen3, tmp_path, capsys):
    """export-hf: an --out that is not empty, a --max-shard-size that is no size, a --model-type that cannot hold the
    model, a --tokenizer-model without a tokenizer: one line each, the output directory untouched."""
    assert main(["import-hf", "--hf", str(sharded_qwen3), "--out", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "tok").mkdir()
    capsys.readouterr()
    for extra, needle in [(["--out", str(tmp_path / "full")], "exists and is not empty"),
                          (["--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
                          (["--model-type", "mistral"], "MistralForCausalLM cannot hold this model: q/k norms"),
                          (["--tokenizer-model", str(tmp_path / "tok")], "no tokenizer there")]:
        argv = ["export-hf", "--load", str(tmp_path / "ckpt"), "--no-progress", "--out", str(tmp_path / "hf"), *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "full", "tok"] and os.listdir(tmp_path / "full") == ["x"]


def test_deferred_tensors_are_made_one_at_a_time(tmp_path):
    """dcp_save makes each Deferred tensor when it writes it: at every make, no earlier one is still alive."""
    from megatron_po.distributed.checkpoint_dcp import Deferred, dcp_save
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    alive, seen = weakref.WeakSet(), []

    def make(i):
        seen.append(len(alive))
        t = torch.full((64, 64), float(i))
        alive.add(t)
        return t

    from megatron_po.distributed.checkpoint_data import JsonEntry
    state = {f"model.w{i}": Deferred((64, 64), torch.float32, lambda i=i: make(i)) for i in range(6)}
    state["extra"] = JsonEntry({"config": {}})
    dcp_save(state, str(tmp_path / "iter_0000000"))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0")
    assert seen == [0] * 6
    weights, _, _ = read_full_checkpoint(str(tmp_path), progress=False)
    assert all(torch.equal(weights[f"w{i}"], torch.full((64, 64), float(i))) for i in range(6))


# DeepSeek-V3's config.json as the Hub holds it (its FP8 quantization_config aside: see the refusal above).
DEEPSEEK_V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "initializer_range": 0.02,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}


def test_deepseek_v3_hub_config_gives_megatron_recipe_flags():
    """The full-size DeepSeek-V3 config.json (no weights) reads as Megatron's DeepSeek-V3 recipe's model flags, which
    pass the start-up checks; our config of it writes the same config.json keys back."""
    import transformers

    from megatron_po.config import ModelConfig, parse_args
    from megatron_po.config_rules import validate
    from megatron_po.distributed.checkpoint_hf import model_flags
    from megatron_po.models.hf.configs import family_of, hf_config, model_fields
    family = family_of(DEEPSEEK_V3_HUB)
    fields = model_fields(family, transformers.DeepseekV3Config.from_dict(DEEPSEEK_V3_HUB))
    recipe = dict(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
                  multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                  qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, rope_type="yarn", rotary_base=10000,
                  rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0, norm_epsilon=1e-6, num_experts=256,
                  moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                  moe_layer_freq="([0]*3+[1]*58)", moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8,
                  moe_router_group_topk=4, mtp_num_layers=1, untie_embeddings_and_output_weights=True)
    assert {k: fields.get(k) for k in recipe} == recipe
    assert "mla_latent_norm_epsilon" not in fields and "yarn_original_max_position_embeddings" not in fields
    cfg = parse_args(shlex.split(model_flags(fields)) + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                                         "--vocab-size", "129280", "--micro-batch-size", "1",
                                                         "--global-batch-size", "8", "--train-iters", "1",
                                                         "--expert-model-parallel-size", "8"])
    validate(cfg, 8)
    assert vars(cfg.model) == {**vars(ModelConfig()), **fields}
    back = hf_config(family, ModelConfig(**fields), 129280).to_dict()
    assert back["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                       "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0}
    for key, value in DEEPSEEK_V3_HUB.items():
        if key in back and key != "rope_scaling":
            assert back[key] == value, key
