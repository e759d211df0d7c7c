"""A fast start (issue 42): what a process imports before it can say `--help` or reject a flag.

Every rank, tool and bad-flag exit pays for what the entry points import. `import megatron_po.optim` used to
import torch._dynamo (~1 s, to break a frame cycle of the first optimizer: megatron_po/dynamo_import.py now does
that where an optimizer or a compiled function is built), so `python pretrain_gpt.py --help` took 1.84x the time
of `python -c "import torch"`. Asserted here as structure, not time: the entry points' `--help` and bad-flag
paths, and the library's package imports, load none of the heavy modules below. The time itself is a benchmark
(bench/micro/startup_time.py, its --quick mode run here: it runs and writes its ratios; no figure is asserted).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by none of the paths below: each costs from 0.1 s to seconds, and none is needed to parse flags.
HEAVY = ["torch._dynamo", "torch._inductor", "sympy", "transformers", "datasets", "sentencepiece", "tokenizers",
         "matplotlib", "torchao", "wandb", "tensorboard", "torch.utils.tensorboard", "nltk", "sacrebleu",
         "transformer_engine"]

# Runs a script as `python <script> <flag>` would, then reports its exit code and which HEAVY modules it loaded.
RUN_AS_MAIN = """
import json, runpy, sys
script, heavy = sys.argv[1], json.loads(sys.argv[3])
sys.argv = [script, sys.argv[2]]
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "loaded": [m for m in heavy if m in sys.modules]}))
"""


def env() -> dict:
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "pretrain_nmt.py"])
@pytest.mark.parametrize("flag, code", [("--help", 0), ("--no-such-flag", 2)])
def test_help_and_a_bad_flag_import_nothing_heavy(script, flag, code):
    r = subprocess.run([sys.executable, "-c", RUN_AS_MAIN, script, flag, json.dumps(HEAVY)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    assert result == {"code": code, "loaded": []}, result
    if flag == "--help":
        assert "--pipeline-method" in r.stdout
    else:
        assert r.stderr.strip().splitlines() == ["error: unrecognized arguments: --no-such-flag"], r.stderr


def test_library_imports_leave_torch_dynamo_for_later():
    """The packages an entry point or a tool imports at the top; torch._dynamo comes with the first optimizer."""
    code = ("import json, sys\n"
            "import megatron_po.optim, megatron_po.training, megatron_po.nmt_workload, megatron_po.pipeline.async_pipeline\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "import torch\n"
            "megatron_po.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)\n"
            "print(json.dumps([before, 'torch._dynamo' in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [False, True]


def test_startup_bench_quick_writes_its_ratios(tmp_path):
    """The bench runs each start-up command (and the manual's `--help` block) and writes a ratio for each
    against `import torch` measured in the same run; the figures themselves are not asserted."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_docs
    [help_block] = [f"{test_docs.rel(page)}:{block['line']}" for page, block in test_docs.runnable_blocks()
                    if block["code"].startswith("python pretrain_gpt.py --help")]
    out = tmp_path / "startup_time.md"
    r = subprocess.run([sys.executable, "bench/micro/startup_time.py", "--quick", "--block", help_block, "--out",
                        str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Start-up time") and "Command: `python bench/micro/startup_time.py --quick" in text
    assert "Commit: " in text and "Device: CPU" in text and "load average at start" in text
    for label in ("python -c 'import torch'", "python pretrain_gpt.py --help", "python pretrain_gpt.py --no-such-flag",
                  help_block):
        [row] = [line for line in text.splitlines() if line.startswith(f"| `{label}`")]
        assert row.rstrip(" |").endswith("x"), row  # a ratio against the bare import
    assert str(tmp_path) not in text and ROOT not in text  # repo-relative paths only
