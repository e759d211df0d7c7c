"""A checkpoint cannot run code when it is loaded (issue #35; docs/reliability.md, "Trust").

Hostile checkpoints: a good checkpoint of a run that reads every kind of metadata entry (PipeOptim
PP=2, fp16: policy steps and lr clocks, per-stage loss scales, optimizer state keys, RNG states), with
one entry -- or DCP's `.metadata` -- replaced by a pickle whose unpickling creates a file (the attacker
also rewrites checksums.json, so the checksums do not stop it). Each is loaded through training
start-up (`run_main`, what pretrain_gpt.py runs; 2 ranks) with --load of the hostile checkpoint and
--save of another directory holding a good checkpoint. Every load exits 2 on every rank before any
iteration, rank 0 printing ONE line naming the file and the entry; the file is never created; --save
is byte for byte what it was. The payloads are real: plain pickle, torch's own FileSystemReader and
DCP's `torch.load(weights_only=False)` create the file (`test_the_payloads_run_under_the_readers_we_replaced`).

Entries are hostile in two places: "pickle", the entry's own bytes as the previous format pickled our
metadata (read by checkpoint_trust.LegacyUnpickler), and "torch.save", the DCP wrapper around it (read
with torch's weights-only unpickler; DCP itself reads it with weights_only=False).

Also: --finetune and --use-checkpoint-args of a hostile `.metadata`, and tools/checkpoint_convert.py;
a checkpoint written by the previous release (tests/fixtures/checkpoint_v0.tar.xz, pickled metadata) still
loads, through the allow-list, to the same values; the JSON codec round-trips what we save exactly.
"""

import dataclasses
import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import run_capturing, tiny_args

from megatron_po.distributed import checkpoint_data
from megatron_po.distributed.checkpoint_integrity import checksum_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = os.path.join(ROOT, "tools", "checkpoint_convert.py")
LEGACY = os.path.join(ROOT, "tests", "fixtures", "checkpoint_v0.tar.xz")  # 67 KB: ckpt/ and expected.json

# Every metadata kind: async policy (policy_steps, policy_lr_steps), fp16 per-stage scales (grad_scaler).
RUN = {"--num-layers": 2, "--pipeline-model-parallel-size": 2, "--pipeline-method": "pipeoptim",
       "--untie-embeddings-and-output-weights": True, "--fp16": True, "--initial-loss-scale": 1024,
       "--train-iters": 2, "--eval-interval": 100}
ENTRIES = ["extra", "layout", "optimizer_type", "optimizer_state_keys.embedding.word_embeddings.weight",
           "policy_steps", "policy_lr_steps.stage0", "grad_scaler.stage0", "rng.rank0"]


class FileCreating:
    """Unpickling it creates `marker` (what any code could do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def payload(place: str, marker: str) -> bytes:
    if place == "pickle":  # the previous format: our metadata pickled, inside DCP's torch.save
        return torch_saved(pickle.dumps(FileCreating(marker)))
    return torch_saved(FileCreating(marker))  # DCP's torch.save wrapper itself


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    results = run_distributed(run_capturing, 2, args=(tiny_args(str(d / "run"), **RUN, **{"--save": str(d / "ckpt")}),),
                              timeout=180)
    assert [c for c, _ in results] == [0, 0], results
    return str(d / "ckpt")


def iteration_dir(root: str) -> str:
    return os.path.join(root, "iter_0000002")


def hostile_copy(good: str, dst: str, entry: str, data: bytes) -> str:
    """A copy of checkpoint `good` whose `entry` holds `data` (`.metadata`: the metadata object with a
    FileCreating in it), checksums rewritten to match; returns the file that holds it."""
    shutil.copytree(good, dst)
    path = iteration_dir(dst)
    meta_file = os.path.join(path, ".metadata")
    with open(meta_file, "rb") as f:
        md = pickle.load(f)  # our own good checkpoint
    if entry == ".metadata":
        md.planner_data = FileCreating(data.decode())
        target = meta_file
    else:
        (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == entry]
        target = os.path.join(path, info.relative_path)
        with open(target, "rb") as f:
            old = f.read()
        with open(target, "wb") as f:
            f.write(old[:info.offset] + data + old[info.offset + info.length:])
        shift = len(data) - info.length
        for k, v in md.storage_data.items():  # the items after it in the same file move
            if v.relative_path == info.relative_path and v.offset > info.offset:
                md.storage_data[k] = dataclasses.replace(v, offset=v.offset + shift)
        md.storage_data[index] = dataclasses.replace(info, length=len(data))
    with open(meta_file, "wb") as f:
        pickle.dump(md, f)
    checksum_checkpoint(path)
    return target


def snapshot(root: str) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            f = os.path.join(dirpath, name)
            out[os.path.relpath(f, root)] = hashlib.sha256(open(f, "rb").read()).hexdigest()
    return out


TENSOR = "a-tensor"  # a tensor entry of the checkpoint (the first a rank reads; tensor_entry)
CASES = [(".metadata", None)] + [(e, "pickle") for e in ENTRIES] + [(e, "torch.save") for e in ENTRIES + [TENSOR]]


def tensor_entry(good: str, prefix: str = "") -> str:
    """The first tensor entry (under `prefix`) in checkpoint `good`'s `.metadata` (a whole tensor or a chunk)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    with open(os.path.join(iteration_dir(good), ".metadata"), "rb") as f:
        md = pickle.load(f)
    return next(k.fqn for k in md.storage_data if k.fqn.startswith(prefix)
                and isinstance(md.state_dict_metadata[k.fqn], TensorStorageMetadata))


@pytest.mark.parametrize("entry,place", CASES, ids=[f"{e}-{p}" if p else e for e, p in CASES])
def test_a_hostile_entry_fails_start_up_with_one_line_and_runs_nothing(entry, place, good, tmp_path):
    """Every refused entry, tensor or not, gets the same line: `error: <file>: entry '<entry>' refused: ...`
    (no terminal escape codes: torch's own weights-only message carries some, and many lines)."""
    entry = tensor_entry(good) if entry == TENSOR else entry
    marker = str(tmp_path / "pwned")
    data = marker.encode() if place is None else payload(place, marker)
    hostile_file = hostile_copy(good, str(tmp_path / "hostile"), entry, data)
    save = str(tmp_path / "save")
    shutil.copytree(good, save)  # the run's own --save: a good checkpoint that must stay as it is
    before = snapshot(save)
    argv = tiny_args(str(tmp_path / "run"), **{**RUN, "--load": str(tmp_path / "hostile"), "--save": save,
                                               "--train-iters": 4})
    results = run_distributed(run_capturing, 2, args=(argv,), timeout=120)
    assert [c for c, _ in results] == [2, 2], results
    lines = [ln for ln in results[0][1].splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in results[0][1], results[0][1]
    line = lines[0]
    assert line.startswith("error: ") and hostile_file in line, line
    assert "refused" in line and (entry == ".metadata" or line.startswith(f"error: {hostile_file}: entry '{entry}' "
                                                                       f"refused: ")), line
    assert "\x1b" not in results[0][1] and "refused" not in results[1][1], results
    assert not os.path.exists(marker)
    assert snapshot(save) == before
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "metrics.jsonl")) or \
        "lm_loss" not in open(os.path.join(str(tmp_path / "run"), "metrics.jsonl")).read()  # no iteration ran


def test_a_refused_tensor_entry_reads_as_a_refused_metadata_entry(good, tmp_path):
    """Issue 42: the same one line, torch's weights-only refusal of a tensor entry (DCP's own torch.load) and of
    a non-tensor entry (ours): the file and the entry named, what was refused, no terminal escape codes."""
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    from megatron_po.distributed.checkpoint_trust import UntrustedCheckpoint
    marker = str(tmp_path / "pwned")
    after_entry = {}
    for entry in (tensor_entry(good, "model."), "extra"):
        hostile = str(tmp_path / entry)
        hostile_file = hostile_copy(good, hostile, entry, payload("torch.save", marker))
        with pytest.raises(UntrustedCheckpoint) as refused:
            read_full_checkpoint(hostile, progress=False)  # one process: the converter's reader
        message = str(refused.value)
        assert "\n" not in message and "\x1b" not in message, message
        assert message.startswith(f"{hostile_file}: entry '{entry}' refused: "), message
        after_entry[entry] = message.split(f"'{entry}'", 1)[1]
    assert len(set(after_entry.values())) == 1, after_entry
    assert " refused: torch's weights-only unpickler does not admit the global exec (" in after_entry["extra"]
    assert not os.path.exists(marker)


def test_the_payloads_run_under_the_readers_we_replaced(good, tmp_path):
    """Control: each payload does create its file when read as before (plain pickle, DCP's reader)."""
    from torch.distributed.checkpoint import FileSystemReader
    marker = tmp_path / "ran"
    hostile_copy(good, str(tmp_path / "meta"), ".metadata", str(marker).encode())
    FileSystemReader(iteration_dir(str(tmp_path / "meta"))).read_metadata()
    assert marker.exists()
    marker.unlink()
    torch.load(io.BytesIO(payload("torch.save", str(marker))), weights_only=False)  # DCP's load_bytes
    assert marker.exists()
    marker.unlink()
    pickle.loads(torch.load(io.BytesIO(payload("pickle", str(marker))), weights_only=False))  # the old loader
    assert marker.exists()


class StorageCarryingPayload:
    """Pickles as a tensor storage does (torch.storage._load_from_bytes of torch.save'd bytes), with a
    FileCreating inside those bytes: the previous format's RNG tensors were pickled so."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return torch.storage._load_from_bytes, (torch_saved(FileCreating(self.marker)),)


def test_a_payload_inside_a_pickled_tensor_storage_is_refused(tmp_path):
    from megatron_po.distributed.checkpoint_trust import UntrustedCheckpoint, read_byte_entry
    marker = str(tmp_path / "pwned")
    entry = torch_saved(pickle.dumps({"torch": StorageCarryingPayload(marker)}))
    refusal = r"F: entry 'rng.rank0' refused: .* would call exec \(inside a tensor"
    with pytest.raises(UntrustedCheckpoint, match=refusal):
        read_byte_entry(entry, "F", "rng.rank0")
    assert not os.path.exists(marker)
    pickle.loads(torch.load(io.BytesIO(entry), weights_only=False))  # control: the previous loader runs it
    assert os.path.exists(marker)


def test_a_metadata_pointing_outside_its_directory_is_refused(good, tmp_path):
    from megatron_po.distributed.checkpoint_dcp import read_metadata
    from megatron_po.distributed.checkpoint_trust import UntrustedCheckpoint
    path = iteration_dir(shutil.copytree(good, str(tmp_path / "ckpt")))
    meta_file = os.path.join(path, ".metadata")
    md = pickle.load(open(meta_file, "rb"))
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../../secret")
    pickle.dump(md, open(meta_file, "wb"))
    with pytest.raises(UntrustedCheckpoint, match=r"\.metadata: refused: it points at '\.\./\.\./secret', outside"):
        read_metadata(path)


def test_finetune_use_checkpoint_args_and_the_converter_refuse_a_hostile_metadata(good, tmp_path):
    marker = str(tmp_path / "pwned")
    hostile = str(tmp_path / "hostile")
    meta_file = hostile_copy(good, hostile, ".metadata", marker.encode())
    for flags in ({"--finetune": True}, {"--use-checkpoint-args": True}):
        argv = tiny_args(str(tmp_path / "run"), **{**RUN, "--load": hostile, **flags})
        results = run_distributed(run_capturing, 2, args=(argv,), timeout=120)
        assert [c for c, _ in results] == [2, 2], (flags, results)
        lines = [ln for ln in results[0][1].splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {meta_file}: refused"), (flags, lines)
    # Every converter command reads through read_checkpoint (read_full_checkpoint): one of them.
    r = subprocess.run([sys.executable, CONVERT, "consolidate", "--load", hostile, "--out",
                        str(tmp_path / "m.safetensors"), "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()], r
    assert r.stderr.startswith(f"error: {meta_file}: refused to unpickle builtins.exec"), r.stderr
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "m.safetensors")


# ---- real checkpoints: the previous format, the codec ---------------------------------------------------


def test_a_previous_release_checkpoint_loads_to_the_values_it_saved(tmp_path):
    """tests/fixtures/checkpoint_v0.tar.xz: a PipeOptim PP=2 fp16 checkpoint of iteration 2 written by the
    previous format's writer (make_checkpoint_v0.py), its metadata pickled; expected.json holds what that
    writer saved and the loss of iteration 3 of its uninterrupted run. Every entry reads back to those
    values through the allow-list, and resuming from it gives that loss (equal here; 1e-6 relative, as
    the reference came from another machine, whose CPU kernels may order float sums differently)."""
    import json
    import tarfile

    from megatron_po.distributed.checkpoint_dcp import dcp_load, read_metadata
    with tarfile.open(LEGACY) as tar:
        tar.extractall(tmp_path / "v0", filter="data")
    expected = json.load(open(tmp_path / "v0" / "expected.json"))
    path = iteration_dir(str(tmp_path / "v0" / "ckpt"))
    md = read_metadata(path)
    small = {k: b"" for k in md.state_dict_metadata if not k.startswith(("model.", "optimizer.", "policy."))}
    dcp_load(small, path)
    assert small["extra"]["train_state"] == expected["train_state"]
    assert list(small["layout"]) == expected["layout"] and isinstance(small["layout"], tuple)
    assert small["optimizer_type"] == expected["optimizer_type"]
    keys = small["optimizer_state_keys.embedding.word_embeddings.weight"]
    assert keys["keys"]["exp_avg"] == ("like-param", torch.float32) and keys["lr"] == expected["lr"]
    assert small["grad_scaler.stage1"] == expected["grad_scaler.stage1"]
    assert small["policy_steps"] == expected["policy_steps"]
    for r in (0, 1):
        rng = small[f"rng.rank{r}"]
        assert hashlib.sha256(rng["torch"].numpy().tobytes()).hexdigest() == expected["rng_torch_sha256"][r]
        assert rng["numpy"][1].dtype == np.uint32 and int(rng["numpy"][1].sum()) == expected["rng_numpy_sum"][r]
        assert isinstance(rng["python"], tuple) and rng["python"][1][-1] == expected["rng_python_index"][r]
    argv = tiny_args(str(tmp_path / "run"), **{**expected["flags"], "--load": str(tmp_path / "v0" / "ckpt"),
                                               "--train-iters": 3})
    results = run_distributed(run_capturing, 2, args=(argv,), timeout=120)
    assert [c for c, _ in results] == [0, 0], results
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    loss = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(loss) == 1 and loss[0] == pytest.approx(expected["loss_at_3"], rel=1e-6, abs=0)


def test_json_entries_round_trip_exactly():
    from megatron_po.distributed.checkpoint_rng import rng_state
    state = rng_state()
    back = checkpoint_data.loads(checkpoint_data.dumps(state))
    assert back["python"] == state["python"] and isinstance(back["python"], tuple)
    assert back["numpy"][0] == state["numpy"][0] and back["numpy"][2:] == state["numpy"][2:]
    assert back["numpy"][1].dtype == state["numpy"][1].dtype and (back["numpy"][1] == state["numpy"][1]).all()
    assert torch.equal(back["torch"], state["torch"]) and back["torch"].dtype == torch.uint8
    value = {"keys": {"step": ((), torch.float32), "m": ("like-param", torch.bfloat16)}, "lr": 0.1 + 0.2,
             3: "an int key", "$tuple": [1], "t": torch.randn(2, 3).to(torch.bfloat16), "inf": float("inf")}
    back = checkpoint_data.loads(checkpoint_data.dumps(value))
    assert back.keys() == value.keys() and back["keys"] == value["keys"] and back["lr"] == value["lr"]
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.bfloat16 and back[3] == value[3]
    assert back["$tuple"] == [1] and back["inf"] == float("inf")
    with pytest.raises(TypeError, match="cannot write a FileCreating"):
        checkpoint_data.dumps({"x": FileCreating("nowhere")})
    for bad in (b'{"$dtype": "load"}', b'{"$ndarray": {"dtype": "|O", "shape": [1], "data": ""}}', b"\x80\x04."):
        with pytest.raises(ValueError):
            checkpoint_data.loads(bad)


def _run_bench(out: str) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("checkpoint_load_time",
                                                  os.path.join(ROOT, "bench", "micro", "checkpoint_load_time.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick", "--out", out])


def test_the_load_time_bench_runs_quick_and_writes_its_results(tmp_path):
    """bench/micro/checkpoint_load_time.py --quick (a forked process: it builds its own process group)."""
    import multiprocessing as mp
    import re
    out = str(tmp_path / "load_time.md")
    proc = mp.get_context("fork").Process(target=_run_bench, args=(out,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    text = open(out).read()
    for field in ("Command: `python bench/micro/checkpoint_load_time.py --quick", "Commit: ", "Device: CPU",
                  "load average at start", "load average at end"):
        assert field in text, field
    medians = {m[0].strip(): float(m[1]) for m in re.findall(r"^\| ([a-z, ]+?)\s*\| ([0-9.]+)", text, re.M)}
    assert set(medians) == {"trusted", "trusted, previous format"} and all(v > 0 for v in medians.values())
    ratio = float(re.search(r"ratio previous format / this format: ([0-9.]+)", text).group(1))
    assert ratio == pytest.approx(medians["trusted, previous format"] / medians["trusted"], rel=0.01)
