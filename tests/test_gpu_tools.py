"""The GPU entry points run on a CPU, so CI catches their rot (issue 29):

- the training, checkpoint and emulator path imports and runs without wandb, datasets and nltk, which a GPU
  image lacks: in a subprocess where the three are unimportable, every module a GPU run touches imports,
  and a tiny `pretrain_gpt.py --mock-data` run saves a checkpoint and a second one resumes from it;
- `bash scripts/run_gpu_tests.sh` on a machine without a GPU selects the suite's "cuda" tests and skips
  every one with "needs CUDA" (28 today), exit code 0;
- `bash scripts/gpu_check.sh --quick` (issues 34, 44: the command a lent GPU runs, one per device call), twice
  back to back from a fresh machine state as a lease runs it (issue 58): the first call measures the baselines and
  one test of each suite, the second every other step, each section that reads an earlier result among them, with
  the baselines reused (one pair of calls, shared by a test per section); each call runs `bench/gpu/gpu.py --quick`
  (with the three packages unimportable in it and every process it starts), in at most the 8 files the device tool
  brings back; its summary names every step with its status, the code commit and no machine path, and its
  closing screen every step with why; a section that raises says its exception, where and its last output lines;
  a tiny --budget-s ends the call before the budget, writes what
  it has and names what it left with the command that runs it; a step past its time is killed with its whole
  process group (no test times the call: how long it takes depends on the machine and its load;
  tests/test_gpu_plan.py: the order, the budget, the baselines per machine, the partial figures);
- gpu.py, there, writes its .md and .json where it is told, every section there, with figures the product's code gives:
  PipeDream holds D - r weight copies on rank r, 2BW two, PipeOptim one (bf16: the prediction is written
  into the bf16 model weights, the fp32 main params stay live); fp16 from a loss scale of 2^32 skips its
  first iterations, halving the scale each time; the per-stage costs hold forward, backward, the step of AdamW
  and Muon and PipeOptim's prediction for each of the 4 stages, and the cost model written beside them loads
  and prices a D = 8 pipeline in bench/time_to_quality/time_to_quality.py's own code. `--only` / `--skip` choose
  sections; with --budget-s it skips a section whose estimate does not fit and says so.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from cuda_harness import HAS_CUDA, OPTIONAL, ROOT, WITHOUT_OPTIONAL, tiny_args
from test_no_machine_paths import MACHINE_PATH

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_common  # noqa: E402  (puts the bench family folders on sys.path)
import gpu_budget  # noqa: E402
import gpu_check  # noqa: E402

GPU_PATH_MODULES = ["megatron_po.training", "megatron_po.async_training", "megatron_po.training_setup",
                    "megatron_po.gpt_workload", "megatron_po.data.gpt_dataset", "megatron_po.data.tokenizer",
                    "megatron_po.distributed.checkpoint_save", "megatron_po.distributed.checkpoint_load",
                    "megatron_po.pipeline.async_pipeline", "megatron_po.pipeline.pipenag", "megatron_po.training_log",
                    "megatron_po.monitor"]


def blocking_site(tmp_path) -> str:
    """A directory whose sitecustomize.py makes wandb, datasets and nltk unimportable in every Python that
    has it on PYTHONPATH (child processes included)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(WITHOUT_OPTIONAL + "\n")
    return str(site)


def env_without_optional(tmp_path) -> dict:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([blocking_site(tmp_path), ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_gpu_path_runs_without_wandb_datasets_nltk(tmp_path):
    first = tiny_args(tmp_path / "a", **{"--train-iters": 2, "--save": str(tmp_path / "ck"), "--save-interval": 2})
    second = tiny_args(tmp_path / "b", **{"--train-iters": 3, "--load": str(tmp_path / "ck")})
    code = f"""{WITHOUT_OPTIONAL}
import importlib
for name in {OPTIONAL!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    raise SystemExit(f"{{name}} is importable: the check below would prove nothing")
for name in {GPU_PATH_MODULES!r}:
    importlib.import_module(name)
from megatron_po.training import run_main
assert run_main({first!r}) == 0 and run_main({second!r}) == 0
print("loaded:", sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_without_optional(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout and "resumed from" in proc.stdout, proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks what the script does without a GPU; on a GPU it runs the suite itself")
def test_run_gpu_tests_script_skips_every_cuda_test_without_a_gpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_gpu_tests.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    skipped = re.search(r"(\d+) skipped", out)
    assert skipped and int(skipped.group(1)) >= 28 and "passed" not in out and "failed" not in out, out
    reasons = re.findall(r"SKIPPED \[\d+\] \S+: (.*)", out)
    assert reasons and set(reasons) == {"needs CUDA"}, out


SECTION_TITLES = {"peak": "bf16 matmul peak", "gpt": "GPT through pretrain_gpt.py", "plain": "Ours beside a plain PyTorch GPT",
                  "compiled": "GPT through pretrain_gpt.py --torch-compile", "muon": "Muon: iteration vs AdamW",
                  "stream": "asynchronous stream in the single-process emulator",
                  "stream_compiled": "stream under --torch-compile, AdamW",
                  "stream_compiled_muon": "stream under --torch-compile, Muon",
                  "fused": "optimizer step with PipeOptim's prediction", "fp16": "fp16: skipped iterations",
                  "gpipe": "Peak memory in GPipe's order", "profile": "One compiled iteration profiled",
                  "moe": "MoE GPT, 8 experts top-2: grouped GEMM against the loop",
                  "fp8": "FP8 (torchao) against bf16", "long_context": "Long context: 256 tokens per sequence, CP = 1",
                  "fsdp": "FSDP2 at DP 1 against DDP", "targets": "Targets"}


def run_bench(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu", "gpu.py"), *args], cwd=ROOT,
                          env=env_without_optional(tmp_path), capture_output=True, text=True, timeout=600)


def run_check(tmp_path, out_dir, *args, timeout=900, state=None) -> subprocess.CompletedProcess:
    """`bash scripts/gpu_check.sh ARGS --out-dir OUT_DIR` as the device runs it: its own Python, $OUT set; a
    machine state of its own (`state`; default a fresh machine's: its first call, nothing to reuse)."""
    env = dict(env_without_optional(tmp_path), PYTHON=sys.executable, OUT=str(out_dir),
               GPU_CHECK_STATE_DIR=str(state or str(out_dir) + "_state"))
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *args, "--out-dir", str(out_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check_summary(out_dir, label: str) -> tuple[dict, str]:
    """The summary's JSON and Markdown, with what every summary must hold: every planned step named with a
    status, the code commit, and no machine path in any file the check wrote."""
    data = json.loads((out_dir / f"gpu_check_{label}.json").read_text())
    md = (out_dir / f"gpu_check_{label}.md").read_text()
    assert data["commit"] == bench_common.commit() and f"Code: commit {bench_common.commit()}" in md
    assert set(data["status"]) == set(data["steps_planned"])
    for step in data["steps_planned"]:
        assert re.search(rf"^\| {step} \| (passed|done|reused|skipped|cut off|failed|not reached) \|", md, re.M), step
    for path in out_dir.iterdir():
        assert not MACHINE_PATH.search(path.read_text(errors="replace")), path
    return data, md


def test_the_fp8_section_is_registered():
    import gpu
    import gpu_fp8
    assert gpu.section_function("fp8") is gpu_fp8.section_fp8 and "fp8" in gpu_budget.PLANNED
    assert gpu_budget.baselines("fp8") == ["peak", "gpt", "plain", "compiled"]  # compiled's own read plain


# --------------------------------------------------------------------------------------------------
# A lease's two calls on one machine, from a fresh state (issues 44, 58), shared by the tests below: the first
# measures the baselines (peak, gpt, plain) and runs one test of each suite; the second every other step, every
# section that reads an earlier result among them, with the baselines reused from the first (the same machine).
# Both --eager-only: sections fp8 and moe without their compiled runs, which take inductor's minutes on a CPU
# (`compiled` and the compiled stream, gpipe, fused and profile run compiled as on a GPU).
# --------------------------------------------------------------------------------------------------

BASELINES = ["peak", "gpt", "plain"]
CALL1_STEPS = ["cuda_tests", *BASELINES, *gpu_budget.CPU_TEST_STEPS]
CALL2_STEPS = [step for step in gpu_budget.STEPS if step not in CALL1_STEPS]


@pytest.fixture(scope="module")
def lease(tmp_path_factory):
    """The two `bash scripts/gpu_check.sh --quick` calls back to back: {"calls": [proc1, proc2], "out": [dir1,
    dir2] (each call's $OUT, as the device tool gives it), "summary", "md", "bench" (gpu.py's JSON), "bench_md"}."""
    root = tmp_path_factory.mktemp("lease")
    state = root / "state"
    lease = {"calls": [], "out": [], "summary": [], "md": [], "bench": [], "bench_md": []}
    for i, steps in enumerate((CALL1_STEPS, CALL2_STEPS), start=1):
        out_dir = root / f"out{i}"
        # (a budget no call needs on an idle 2-core machine: a loaded one took over 1500 s for the second)
        proc = run_check(root, out_dir, "--quick", "--eager-only", "--steps", *steps, "--budget-s", "3000",
                         timeout=3100, state=state)
        lease["calls"].append(proc)
        lease["out"].append(out_dir)
        assert proc.returncode == 0, f"call{i}:\n" + proc.stdout[-4000:] + proc.stderr[-3000:]
        summary, md = check_summary(out_dir, f"call{i}")
        lease["summary"].append(summary)
        lease["md"].append(md)
        lease["bench"].append(json.loads((out_dir / f"gpu_cpu_call{i}.json").read_text()))
        lease["bench_md"].append((out_dir / f"gpu_cpu_call{i}.md").read_text())
    return lease


def figures(lease, call: int) -> dict:
    """gpu.py's figures of call `call` (1 or 2) by section."""
    return {name: s["figures"] for name, s in lease["bench"][call - 1]["sections"].items()}


def test_two_quick_calls_from_a_fresh_state_both_pass_and_the_second_names_every_step(lease):
    """Issue 58: the second call of a lease reuses the first's baselines and runs every section that reads them
    (fp8 failed there with `list index out of range`: it read the loss of a baseline from a file that died with
    the first call); both exit 0 (the fixture), every step ends well, and the closing screen names each."""
    first, second = lease["summary"]
    assert first["steps_planned"] == CALL1_STEPS and first["not_run_to_the_end"] == []
    assert {step: st["status"] for step, st in first["status"].items()} == {
        step: "passed" if step in gpu_budget.TEST_STEPS else "done" for step in CALL1_STEPS}
    assert set(second["steps_planned"]) == set(gpu_budget.with_baselines(CALL2_STEPS)) == {*BASELINES, *CALL2_STEPS}
    assert second["not_run_to_the_end"] == []
    assert {step: st["status"] for step, st in second["status"].items()} == {
        step: "reused" if step in BASELINES else "done" for step in second["steps_planned"]}
    assert all(st["seconds"] > 0 for st in first["status"].values())
    assert all(st["seconds"] > 0 for step, st in second["status"].items() if step not in BASELINES)
    for i, (proc, summary) in enumerate(zip(lease["calls"], lease["summary"]), start=1):
        screen = proc.stdout.split(f"[gpu_check] call{i} in")[-1]  # the output ends with the one screen
        assert "## Targets" in screen and "## Steps of this call" in screen and "Every step ran to its end." in screen
        for step, st in summary["status"].items():
            assert re.search(rf"^\| {step} +\| {st['status']} +\|", screen, re.M), (step, screen)
        assert len(os.listdir(lease["out"][i - 1])) <= 8  # what the device tool brings back
        assert "[gpu.py] " in (lease["out"][i - 1] / f"gpu_call{i}.log").read_text()  # gpu.py's progress, as it ran
    assert "reused, measured on this machine" in (lease["out"][1] / "gpu_call2.log").read_text()
    md1, md2 = lease["md"]
    assert "Command: `bash scripts/gpu_check.sh --quick --eager-only --steps cuda_tests" in md1
    assert "--out-dir $OUT" in md1
    assert "CUDA_VISIBLE_DEVICES= python -c" in md1 and "python bench/gpu/gpu.py --only peak gpt plain" in md1
    assert set(first["files"]) == {"cuda_tests_call1.log", "cpu_compile_tests_call1.log", "gpu_call1.log",
                                   "gpu_cpu_call1.md", "gpu_cpu_call1.json"}
    assert set(second["files"]) == {"gpu_call2.log", "gpu_cpu_call2.md", "gpu_cpu_call2.json",
                                    "gpu_cpu_call2_cost_model.json"}
    for i, sections in enumerate((BASELINES, CALL2_STEPS), start=1):
        data, md = lease["bench"][i - 1], lease["bench_md"][i - 1]
        assert data["size"] == "quick" and data["failures"] == [] and data["data_parallel_size"] == 1
        assert "Quick size (`--quick`)" in md and "failed" not in md and "Code: commit " in md
        done = list(data["sections"])  # the reused baselines first, targets last
        assert set(done) == {*BASELINES, *sections, "targets"} and done[-1] == "targets"
        assert i == 1 or done[:len(BASELINES)] == BASELINES
        for name in done:
            assert SECTION_TITLES[name] in md, name


def test_the_first_call_measures_the_baselines_and_one_test_of_each_suite(lease):
    first = lease["summary"][0]
    assert first["status"]["cuda_tests"]["note"].startswith("1 skipped" if not HAS_CUDA else "1 passed")
    assert first["status"]["cpu_compile_tests"]["note"].startswith("1 passed")
    assert first["status"]["cpu_compile_tests_rest"]["note"].startswith("2 passed")
    sections = figures(lease, 1)
    assert sections["peak"]["tflops"] > 0
    gpt = sections["gpt"]
    assert gpt["tokens_per_s"] > 0 and gpt["mfu"] == pytest.approx(gpt["model_tflops"] / sections["peak"]["tflops"])
    assert gpt["last_lm_loss"] > 0  # kept with the figures: a later call's fp8 reads it (issue 58)
    assert {"plain PyTorch, eager", "plain PyTorch, torch.compile"} <= set(sections["plain"])
    assert "python pretrain_gpt.py --num-layers 4" in lease["bench_md"][0]


def test_the_second_call_reuses_the_baselines_and_its_ratios_say_same_machine(lease):
    first, second = figures(lease, 1), figures(lease, 2)
    bench = lease["bench"][1]
    for name in BASELINES:
        assert second[name] == first[name] and "by call1" in bench["sections"][name]["reused"], name
    md = lease["bench_md"][1]
    assert "Reused, not measured in this run" in md and "**same-machine** ratios" in md


def test_fsdp_after_the_baselines_call(lease):
    """bench/gpu/gpu_fsdp.py on a CPU: the tiny GPT under DDP and under --use-torch-fsdp2 (DP 1), both timed."""
    import gpu
    import gpu_fsdp
    assert gpu.section_function("fsdp") is gpu_fsdp.section_fsdp and "fsdp" in gpu_budget.PLANNED
    fsdp = figures(lease, 2)["fsdp"]
    assert fsdp["ddp"]["tokens_per_s"] > 0 and fsdp["fsdp"]["tokens_per_s"] > 0
    assert fsdp["ratios"]["ms_fsdp_over_ddp"] > 0
    assert "FSDP2 at DP 1 against DDP" in lease["bench_md"][1] and "--use-torch-fsdp2" in lease["bench_md"][1]


def test_compiled_after_the_baselines_call(lease):
    compiled, first = figures(lease, 2)["compiled"], figures(lease, 1)
    assert compiled["tokens_per_s"] > 0
    assert compiled["over_plain_compiled"] == pytest.approx(
        compiled["tokens_per_s"] / first["plain"]["plain PyTorch, torch.compile"]["tokens_per_s"])
    assert compiled["over_ours_eager"] == pytest.approx(compiled["tokens_per_s"] / first["gpt"]["tokens_per_s"])


def test_muon_after_the_baselines_call(lease):
    """Muon's iterations against AdamW's: section gpt's, reused from the first call (not measured again)."""
    muon, gpt = figures(lease, 2)["muon"], figures(lease, 1)["gpt"]
    assert "adamw" not in muon  # AdamW not measured here: gpt's figures served
    for key in ("muon", "muon_fp32_qkv_whole", "muon_gram"):  # the opt-in Gram Newton-Schulz too
        assert muon[key]["over_adamw"] == pytest.approx(muon[key]["ms_per_iteration"] / gpt["ms_per_iteration"])
    assert set(muon["newton_schulz"]["ms"]) == {f"{p},{how}" for p in ("highest", "high", "medium")
                                                for how in ("unbatched", "batched")}
    assert "AdamW (section gpt)" in lease["bench_md"][1]


def test_stream_after_the_baselines_call(lease):
    data = lease["bench"][1]
    methods = figures(lease, 2)["stream"]["methods"]
    assert methods["async-naive"]["ratio_to_async_naive"] == 1.0
    copies = {label: [m["copies_per_chunk"][str(r)] for r in range(4)] for label, m in methods.items()}
    # bf16 PipeOptim: the step writes Ŵ into its own bf16 tensor (the forward points at it), so the stages
    # that predict hold live + Ŵ while it waits for its forward (issue 30; the fp32 main params are not counted)
    # (predicting before each forward, the code before issue 30, writes Ŵ into the bf16 model weights: one copy)
    assert copies == {"async-naive": [1] * 4, "PipeDream": [4, 3, 2, 1], "PipeDream-2BW": [2] * 4,
                      "PipeOptim (AdamW)": [2, 2, 2, 1], "PipeOptim (AdamW), prediction separate": [1] * 4,
                      "async-naive (Muon)": [1] * 4, "PipeOptim (Muon)": [2, 2, 2, 1]}
    # (ms per micro-batch is a difference of two timed segments: on a loaded CPU at this size it may be anything)
    assert all(m["memory"]["peak_bytes"] > 0 and m["built"]["parameters"] > 0 for m in methods.values())
    assert "python bench/gpu/gpu_worker.py stream --size quick --method pipedream-2bw --optimizer adamw --k 4" in \
        lease["bench_md"][1]
    assert "segment timed op by op" in (lease["out"][1] / "gpu_call2.log").read_text()

    cost = data["stage_costs"]
    assert cost["pipeline_stages"] == 4 and cost["data_parallel_size"] == 1 and cost["parameters"] > 0
    assert [s["stage"] for s in cost["stages"]] == [0, 1, 2, 3]
    for s in cost["stages"]:
        assert s["forward_ms"] > 0 and s["backward_ms"] > 0 and set(s["step_ms"]) == {"adamw", "muon"}
        assert set(s["prediction_ms"]) == {"adamw", "muon"}
    assert all(cost["stages"][r]["prediction_ms"]["adamw"] > 0 for r in range(3))  # s > 0 there: it predicts

    # bench/time_to_quality/time_to_quality.py reads the cost model written beside it (its own loader checks it)
    assert data["ttq_cost_model"] == "gpu_cpu_call2_cost_model.json"
    bench_common.add_repo_to_path()  # this checkout and every bench family on sys.path
    import ttq_cost_model
    model = ttq_cost_model.load_cost_model(str(lease["out"][1] / "gpu_cpu_call2_cost_model.json"))
    priced = ttq_cost_model.op_times(model, 8, "muon", ["pipeoptim", "pipedream", "pipedream-2bw"])
    assert set(priced) == {"async-naive", "pipeoptim", "pipedream", "pipedream-2bw"} and len(priced["pipeoptim"]) == 8
    assert priced["pipeoptim"]["0"]["Forward"] > priced["async-naive"]["0"]["Forward"]  # the prediction is priced
    assert "muon-run-prediction" in model["variants"]


def test_stream_compiled_after_the_baselines_call(lease):
    sections = figures(lease, 2)
    assert list(sections["stream_compiled"]["methods"]) == ["async-naive", "PipeOptim (AdamW)"]
    assert list(sections["stream_compiled_muon"]["methods"]) == ["async-naive (Muon)", "PipeOptim (Muon)"]
    compiled = {**sections["stream_compiled"]["methods"], **sections["stream_compiled_muon"]["methods"]}
    assert all(m["compiled"] for m in compiled.values())
    assert not any(m["compiled"] for m in sections["stream"]["methods"].values())


def test_fused_after_the_baselines_call(lease):
    assert {(r["variant"], r["compiled"]) for r in figures(lease, 2)["fused"]["rows"]} == \
        {(v, c) for v in ("naive", "separate", "fused") for c in (False, True)}


def test_fp16_after_the_baselines_call(lease):
    fp16 = figures(lease, 2)["fp16"]
    first = fp16["iterations"][0]
    assert fp16["initial_skipped"] >= 1 and first["loss_scale"] == 2.0**32 and first["grad_norm"] is None
    scales = [it["loss_scale"] for it in fp16["iterations"][:fp16["initial_skipped"]]]
    assert scales == [2.0**32 / 2**i for i in range(len(scales))]
    assert "--fp16" in lease["bench_md"][1]


def test_gpipe_after_the_baselines_call(lease):
    gpipe = figures(lease, 2)["gpipe"]
    assert gpipe["ours"]["schedule_ops"] == "F0 F1 B0 B1 S" and gpipe["plain_compiled"]["order"] == "gpipe"
    assert gpipe["ours_over_plain_memory"] > 0


def test_profile_after_the_baselines_call(lease):
    profile = figures(lease, 2)["profile"]
    assert profile["ours"]["cpu_ops"] > 0 and profile["plain_compiled"]["cpu_ops"] > 0
    assert profile["ours"]["unique_graphs"] >= 1 and profile["plain_compiled"]["unique_graphs"] >= 1


def test_moe_after_the_baselines_call(lease):
    """The MoE section's MFU reads the peak the first call measured."""
    moe, peak = figures(lease, 2)["moe"], figures(lease, 1)["peak"]["tflops"]
    assert not moe["compiled"] and moe["loss"]["grouped"] == moe["grouped"]["last_lm_loss"]  # (--eager-only)
    for key in ("grouped", "looped"):
        assert moe[key]["tokens_per_s"] > 0 and moe[key]["mfu"] == pytest.approx(moe[key]["model_tflops"] / peak)
    assert moe["loss_delta"] == pytest.approx(abs(moe["loss"]["grouped"] - moe["loss"]["looped"]))


def test_long_context_after_the_baselines_call(lease):
    """The long-context section's MFU reads the peak the first call measured."""
    long, peak = figures(lease, 2)["long_context"], figures(lease, 1)["peak"]["tflops"]
    assert long["seq_length"] == 256 and long["tokens_per_s"] > 0 and long["peak_tflops"] == peak
    for name in ("megatron", "causal"):
        assert long[name]["mfu"] == pytest.approx(long[name]["model_tflops"] / peak)


def test_fp8_after_the_baselines_call(lease):
    """Issue 58's failure: FP8 against bf16 reads the bf16 run and its last loss from section gpt, reused from the
    first call (--eager-only: without the compiled runs, which read section compiled of the same call)."""
    gpt = figures(lease, 1)["gpt"]
    fp8 = figures(lease, 2)["fp8"]
    assert fp8["bf16"] == gpt and fp8["loss"]["bf16"] == gpt["last_lm_loss"] and "bf16_compiled" not in fp8
    assert set(fp8["ratios"]) == {"eager_over_bf16_eager", "loss_delta", "eager_over_plain_fp8_eager"}
    assert fp8["ratios"]["eager_over_bf16_eager"] == pytest.approx(fp8["fp8"]["tokens_per_s"] / gpt["tokens_per_s"])
    assert fp8["ratios"]["loss_delta"] == pytest.approx(abs(fp8["loss"]["fp8"] - gpt["last_lm_loss"]))
    assert "bf16 figures from section(s) gpt (an earlier call on this machine)." in lease["bench_md"][1]


def test_targets_after_the_baselines_call(lease):
    targets = figures(lease, 2)["targets"]["targets"]
    assert len(targets) == 10 and all(t[1] != "not measured" and t[2] in ("met", "NOT MET") for t in targets
                                      if not t[0].startswith("FP8"))
    fp8 = {t[0]: t[1] for t in targets if t[0].startswith("FP8")}  # the compiled ones: not measured (--eager-only)
    assert list(fp8.values()).count("not measured") == 2 and len(fp8) == 3
    assert any("same machine" in t[3] for t in targets)  # read against a baseline of the first call


def test_gpu_bench_only_skip_and_budget(tmp_path):
    # --only / --skip; and a budget that fits the peak (quick estimate 10 s) but never the eager stream (60 s)
    # (targets, which measures nothing, runs whatever is left of the budget: it reads what the others measured)
    only = run_bench(tmp_path, "--quick", "--only", "peak", "gpt", "stream", "targets", "--skip", "gpt", "--budget-s",
                     "40", "--out", str(tmp_path / "o.md"))
    data = json.loads((tmp_path / "o.json").read_text())
    status = {name: st["status"] for name, st in data["section_status"].items()}
    assert list(status) == ["peak", "stream", "targets"] and status["stream"] == "skipped", only.stdout[-3000:]
    assert status["targets"] == "done"
    # the peak's worker: done, or (a loaded CPU's imports eating the budget) cut off at the budget, or skipped
    assert status["peak"] in ("done", "cut off", "skipped")
    assert list(data["sections"]) == (["peak"] if status["peak"] == "done" else []) + ["targets"]
    assert only.returncode == (1 if status["peak"] == "cut off" else 0)
    md = (tmp_path / "o.md").read_text()
    assert "| stream  | skipped |" in md and "stream targets --quick`" in md
    assert "To measure them: `python bench/gpu/gpu.py --only " in md


def test_gpu_check_tiny_budget_skips_every_step_and_names_what_it_left(tmp_path):
    out_dir = tmp_path / "call"
    proc = run_check(tmp_path, out_dir, "--quick", "--budget-s", "10", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data, md = check_summary(out_dir, "call1")
    assert data["steps_planned"] == gpu_budget.PLANNED
    timed = [s for s in gpu_budget.PLANNED if s not in gpu_budget.CPU_TEST_STEPS]
    # no timed step fits 10 s (every quick estimate exceeds 10 - 8 - 6 s of reserve): named, with the command; the
    # compile tests beside them start and are cut off at the end, or find the call over
    assert all(data["status"][s]["status"] == "skipped" for s in timed)
    assert all(data["status"][s]["status"] in ("cut off", "skipped") for s in gpu_budget.CPU_TEST_STEPS)
    assert data["not_run_to_the_end"] == gpu_budget.PLANNED
    again = f"bash scripts/gpu_check.sh --steps {' '.join(gpu_budget.PLANNED)} --quick"
    assert data["to_run_them"] == [again] and again in md
    assert "`bash scripts/gpu_check.sh --steps cuda_tests --quick`" in proc.stdout  # the closing screen


def test_gpu_check_budget_cuts_off_a_running_section_and_writes_its_summary(tmp_path):
    """A budget that lets gpu.py start: the peak is done, skipped or cut off (which one depends on the machine and
    its load), and the summary says which; fp16 does not fit the plan and is named."""
    out_dir = tmp_path / "out"
    proc = run_check(tmp_path, out_dir, "--quick", "--steps", "peak", "fp16", "--budget-s", "30", timeout=120)
    data, md = check_summary(out_dir, "call1")
    assert data["steps_planned"] == ["peak", "fp16"], proc.stdout[-3000:] + proc.stderr[-3000:]
    statuses = {step: st["status"] for step, st in data["status"].items()}
    assert statuses["fp16"] == "skipped" and "does not fit" in data["status"]["fp16"]["note"]
    assert statuses["peak"] in ("done", "cut off", "skipped"), statuses  # skipped: gpu.py's imports ate the budget
    assert data["not_run_to_the_end"] == [s for s in ("peak", "fp16") if statuses[s] != "done"]
    assert f"bash scripts/gpu_check.sh --steps {' '.join(data['not_run_to_the_end'])} --quick" in md
    assert "python bench/gpu/gpu.py --only peak targets --budget-s" in md


def test_a_step_past_its_time_is_killed_with_its_process_group(tmp_path):
    pid_file = tmp_path / "pid"
    rc, seconds = gpu_check.run_process(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"],
                                        str(tmp_path / "log"), timeout=1.0)
    assert rc is None and seconds >= 1.0  # killed (finished, it would give 0), not before its time (a lower bound)
    child = int(pid_file.read_text())
    for _ in range(50):  # its own child, the background sleep, was killed with the group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):  # killed, waiting for init to reap it
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} of the killed step still runs")
    assert gpu_check.run_process(["true"], str(tmp_path / "log2"), timeout=30)[0] == 0


def test_gpu_sections_are_the_table_entries_and_each_has_its_function():
    import gpu
    assert list(gpu.SECTIONS) == gpu_budget.SECTION_ORDER
    assert all(callable(gpu.section_function(name)) for name in gpu.SECTIONS)
    assert set(gpu_budget.STEPS) == set(gpu_budget.SECTION_ORDER) - {"targets"} | set(gpu_budget.TEST_STEPS)
