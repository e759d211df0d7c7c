"""Committed results, docs and benchmark code name no machine's own paths (issue 37): a results file records
paths relative to the repository or as placeholders (`$TMPDIR`, `$OUT`, `~`), since a reader on another machine
must be able to trace and rerun every figure. Checked: bench/ (code, index and results), docs/ and the README.
Also checks bench_common.portable, which the benchmarks' command lines go through."""

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = (".md", ".json", ".py", ".log", ".txt", ".sh", ".csv", ".jsonl")
# An absolute home, temporary or work-area path (/root/..., /home/x/..., /tmp/..., /work/..., macOS's /Users and
# /var/folders, /mnt, /scratch), not preceded by a path or word character (so `bench/results/...` or
# `http://host/tmp/...` are not matched).
MACHINE_PATH = re.compile(r"(?<![\w.~$/:-])/(?:root|home|tmp|work|Users|mnt|scratch|private/var|var/folders)/")


def checked_files():
    roots = [os.path.join(REPO, "bench"), os.path.join(REPO, "docs")]
    files = [os.path.join(REPO, "README.md")]
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in (".cache", "__pycache__")]
            files += [os.path.join(folder, n) for n in names if n.endswith(TEXT)]
    return files


def test_no_machine_paths_in_results_docs_or_bench():
    found = []
    for path in checked_files():
        with open(path, errors="replace") as f:
            for number, line in enumerate(f, 1):
                for match in MACHINE_PATH.finditer(line):
                    found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()[:160]}")
                    break
    assert found == [], "machine paths in committed files:\n" + "\n".join(found[:40])


def test_the_pattern_catches_what_it_must():
    for bad in ("--out /root/out/gpu.md", "`/tmp/x/work`", "(/work/shared/docs/GPU_FINDINGS.md;", "/home/me/run"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("bench/results/tmp/x", "$TMPDIR/soakrun", "http://example.org/tmp/x", "~/work/x", "a/work/b"):
        assert not MACHINE_PATH.search(fine), fine


def test_portable_commands(monkeypatch, tmp_path):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_common
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    line = bench_common.command_line("bench/memory/soak.py", ["--work", str(tmp_path / "w"),
                                                             "--out", os.path.join(REPO, "bench", "results", "s.md")])
    assert line == "python bench/memory/soak.py --work $TMPDIR/w --out bench/results/s.md"
    assert not MACHINE_PATH.search(line)
