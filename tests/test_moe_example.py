"""examples/moe_tiny.sh and examples/deepseek_v3_tiny.sh as written, but for their length: their pretrain_gpt.py
flags (read from the scripts) on the session's small corpus (instead of the full Bible the scripts prepare; a 5 %
test split of its 300 documents), on the scripts' 2 processes, the two runs one after the other in one launch; then
their export-hf lines.

Four iterations instead of 300 (deepseek_v3_tiny.sh's at a quarter of its batch): the runs train (EP = 2, the
start-up lines say so), each MoE layer's numbers reach the metrics file (the first layer dense, as the scripts'
--moe-layer-freq says), the checkpoints are written, and the exports give a Qwen2-MoE and a DeepSeek-V3 model that
transformers loads without missing or unexpected tensors (but DeepSeek-V3's MTP depth, which transformers does not
load). deepseek_v3_tiny.sh's run has multi-latent attention, group-limited routing and its MTP loss logged apart.
"""

import os
import re
import shlex

from dist_harness import run_distributed, run_mains
from test_pretrain_gpt import read_metrics

from tools.checkpoint_convert import main as convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "moe_tiny.sh")
DEEPSEEK_V3_SCRIPT = os.path.join(ROOT, "examples", "deepseek_v3_tiny.sh")


def script_command(text: str, program: str, values: dict) -> list[str]:
    """The arguments the script passes to `program`, its shell variables replaced by `values`."""
    line = re.search(re.escape(program) + r" \\?\n?(.*?)(?:\"\$@\"|\|\||\n\n|$)", text, re.S).group(1)
    line = line.replace("\\\n", " ")
    line = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: values.get(m.group(1), m.group(2)), line)
    line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line)
    return shlex.split(line)


def example_argv(text: str, corpus, values: dict) -> list[str]:
    """The script's pretrain_gpt.py flags on the small corpus, for 4 iterations logged every 2."""
    data = os.path.dirname(corpus["prefix"])
    argv = script_command(text, "pretrain_gpt.py", values)
    argv = [a.replace(os.path.join(data, "bible_text_document"), corpus["prefix"])
            .replace(os.path.join(data, "bible.model"), corpus["model"]) for a in argv]
    # The small corpus has 300 documents: the scripts' 0.1 % test split of the Bible would be empty here.
    return argv + ["--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1", "--save-interval", "4",
                   "--split", "90,5,5"]


def test_the_moe_examples_train_save_and_export(corpus, tmp_path, capfd):
    text, deepseek_text = open(SCRIPT).read(), open(DEEPSEEK_V3_SCRIPT).read()
    nproc = int(re.search(r"--nproc-per-node (\d+)", text).group(1))
    assert int(re.search(r"--nproc-per-node (\d+)", deepseek_text).group(1)) == nproc == 2
    data = os.path.dirname(corpus["prefix"])
    values = {"DATA": data, "OUT": str(tmp_path), "PY": "python", "TRAIN_ITERS": "4"}
    deepseek_out = tmp_path / "deepseek_v3"
    argv = example_argv(text, corpus, values)
    # a quarter of the script's batch (8 sequences of 128, not 32): the script's model at a quarter of the cost
    deepseek = example_argv(deepseek_text, corpus, dict(values, OUT=str(deepseek_out))) + [
        "--micro-batch-size", "2", "--global-batch-size", "8"]
    assert "--expert-model-parallel-size" in argv and "--expert-model-parallel-size" in deepseek
    assert run_distributed(run_mains, nproc, args=([argv, deepseek],), timeout=300) == [[0, 0]] * nproc
    out = capfd.readouterr().out
    assert "> MoE: 8 experts, top-2 (softmax), in layers [1, 2, 3]; EP 2 x expert TP 1 per stage; alltoall" in out
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "lm_loss" in r]
    assert len(records) == 2 and all(f"moe/aux_loss/layer{i}" in r for r in records for i in (1, 2, 3))
    assert not any("layer0" in k for k in records[0])

    # DeepSeek-V3: MoE in layers 1-3 and in the MTP depth's layer (4), routed within groups; MLA; the MTP loss
    assert ("> MoE: 16 experts, top-8 in 4 of 8 groups (sigmoid, router in fp32), in layers [1, 2, 3, 4]; EP 2 x "
            "expert TP 1 per stage; alltoall") in out
    assert "> MLA: 4 heads, query/key 32 + 16 rotary (one key head shared), value 32; query latent 64" in out
    records = [r for r in read_metrics(deepseek_out / "metrics.jsonl") if "lm_loss" in r]
    assert len(records) == 2 and all(r["mtp_loss"] > 0 and "moe/aux_loss/layer3" in r for r in records), records
    assert os.path.isdir(deepseek_out / "checkpoints")

    from transformers import AutoModelForCausalLM
    for script, out, cls in [(text, tmp_path, "Qwen2MoeForCausalLM"),
                             (deepseek_text, deepseek_out, "DeepseekV3ForCausalLM")]:
        export = script_command(script, "tools/checkpoint_convert.py", dict(values, OUT=str(out)))
        assert export[0] == "export-hf" and convert(export) == 0
        hf, loading = AutoModelForCausalLM.from_pretrained(str(out / "hf"), output_loading_info=True)
        # The MTP depth is the Hub's layer 4, as in DeepSeek-V3's own checkpoint: transformers does not load it
        unused = {k for k in loading["unexpected_keys"] if not k.startswith("model.layers.4.")}
        assert type(hf).__name__ == cls and not unused and not loading["missing_keys"], loading
        assert not loading["mismatched_keys"] and not loading["error_msgs"], loading
        assert bool(loading["unexpected_keys"]) == (cls == "DeepseekV3ForCausalLM"), loading
