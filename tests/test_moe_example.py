"""examples/moe_tiny.sh as written, but for its length: its pretrain_gpt.py flags (read from the script) on the
session's small corpus (instead of the full Bible the script prepares; a 5 % test split of its 300 documents), on
the script's 2 processes, then its export-hf line.

Four iterations instead of 300: the run trains (EP = 2, the start-up line says so), each MoE layer's numbers reach
the metrics file (the first layer dense, as the script's --moe-layer-freq says), the checkpoint is written, and the
export gives a Qwen2-MoE model that transformers loads without missing or unexpected tensors.
"""

import os
import re
import shlex

from dist_harness import run_distributed
from test_pretrain_gpt import read_metrics, run_pretrain

from tools.checkpoint_convert import main as convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "moe_tiny.sh")


def script_command(text: str, program: str, values: dict) -> list[str]:
    """The arguments the script passes to `program`, its shell variables replaced by `values`."""
    line = re.search(re.escape(program) + r" \\?\n?(.*?)(?:\"\$@\"|\|\||\n\n|$)", text, re.S).group(1)
    line = line.replace("\\\n", " ")
    line = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: values.get(m.group(1), m.group(2)), line)
    line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line)
    return shlex.split(line)


def test_the_moe_example_trains_saves_and_exports(corpus, tmp_path, capfd):
    text = open(SCRIPT).read()
    nproc = int(re.search(r"--nproc-per-node (\d+)", text).group(1))
    data = os.path.dirname(corpus["prefix"])
    values = {"DATA": data, "OUT": str(tmp_path), "PY": "python", "TRAIN_ITERS": "4"}
    argv = script_command(text, "pretrain_gpt.py", values)
    argv = [a.replace(os.path.join(data, "bible_text_document"), corpus["prefix"])
            .replace(os.path.join(data, "bible.model"), corpus["model"]) for a in argv]
    # The small corpus has 300 documents: the script's 0.1 % test split of the Bible would be empty here.
    argv += ["--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1", "--save-interval", "4",
             "--split", "90,5,5"]
    assert nproc == 2 and "--expert-model-parallel-size" in argv
    assert run_distributed(run_pretrain, nproc, args=(argv,), timeout=300) == [0] * nproc
    out = capfd.readouterr().out
    assert "> MoE: 8 experts, top-2 (softmax), in layers [1, 2, 3]; EP 2 x expert TP 1 per stage; alltoall" in out
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "lm_loss" in r]
    assert len(records) == 2 and all(f"moe/aux_loss/layer{i}" in r for r in records for i in (1, 2, 3))
    assert not any("layer0" in k for k in records[0])

    export = script_command(text, "tools/checkpoint_convert.py", values)
    assert export[0] == "export-hf" and convert(export) == 0
    from transformers import AutoModelForCausalLM
    hf, loading = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert type(hf).__name__ == "Qwen2MoeForCausalLM" and not any(loading.values()), loading
