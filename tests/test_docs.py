"""The README is a front page and docs/ is the manual; every command marked runnable runs as written.

- README.md has at most 250 lines and links every docs/*.md page;
- every relative link (and image) in README.md and docs/*.md points at an existing file, and an anchor
  (`page.md#section`) at an existing heading of that page; every repository path they cite exists;
- a fenced ```bash block preceded by the line `<!-- runnable -->` is run as written, from the root of a
  scratch copy of the checkout (symlinks, so the `runs/` it writes is thrown away), with `python` the
  interpreter running this test; it must exit 0. All other blocks are examples only (docs/getting_started.md
  says so). Runnable blocks must stay cheap (about 20 s of CPU time together): what they cost is a benchmark,
  not an assert here (`python bench/micro/startup_time.py --only docs`: each block's CPU time against
  `import torch` in the same run), so this test passes on a slower or busier machine alike.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MARKER = "<!-- runnable -->"
MAX_README_LINES = 250
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def pages() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def blocks(text: str) -> list[dict]:
    """Fenced code blocks: language, code, first line number (1-based, the fence), marked runnable or not."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        out.append({"lang": lang, "code": "\n".join(lines[start + 1:i]) + "\n", "line": start + 1,
                    "runnable": start > 0 and lines[start - 1].strip() == MARKER})
        i += 1
    return out


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    kept, inside = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if inside is None and m:
            inside = m.group(1)
        elif inside is not None and line.startswith(inside):
            inside = None
        elif inside is None:
            kept.append(line)
    return kept


def links(text: str) -> list[str]:
    """Link and image targets, outside fenced blocks and inline code spans (where brackets are not links)."""
    return LINK.findall("\n".join(re.sub(r"(`+).*?\1", "", line) for line in outside_fences(text)))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', '-N' for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_fences(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_a_front_page():
    n = len(read(README).split("\n")) - read(README).endswith("\n")
    assert n <= MAX_README_LINES, f"README.md has {n} lines; the front page keeps <= {MAX_README_LINES} (move detail to docs/)"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for t in links(read(README))}
    missing = [rel(p) for p in pages()[1:] if os.path.normpath(p) not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_relative_links_resolve():
    broken = []
    for page in pages():
        for target in links(read(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(dest):
                broken.append(f"{rel(page)}: {target} (no file {rel(dest)})")
            elif anchor and dest.endswith(".md") and anchor not in anchors(read(dest)):
                broken.append(f"{rel(page)}: {target} (no heading #{anchor} in {rel(dest)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


PATH_CITED = re.compile(r"(?<![\w/.$-])((?:megatron_po|bench|tools|tests|examples|scripts)/[\w./*-]*[\w*])")


def test_cited_paths_exist():
    """Repository paths the manual names (`megatron_po/...`, `bench/...`, `tools/...`, ...; globs allowed) exist,
    so moving or splitting a module shows which pages to update."""
    missing = sorted({f"{rel(page)}: {path}" for page in pages() for path in PATH_CITED.findall(read(page))
                      if not glob.glob(os.path.join(ROOT, path))})
    assert not missing, "paths cited in the docs that do not exist:\n" + "\n".join(missing)


def test_markers_precede_bash_blocks():
    """A marker must sit right above a ```bash fence, else the block it means would silently not run."""
    bad = []
    for page in pages():
        lines = read(page).split("\n")
        for i, line in enumerate(lines):
            if line.strip() == MARKER and not (i + 1 < len(lines) and re.match(r"^```bash\s*$", lines[i + 1])):
                bad.append(f"{rel(page)}:{i + 1}")
    assert not bad, f"{MARKER} not directly above a ```bash fence: {bad}"


def runnable_blocks() -> list[tuple[str, dict]]:
    return [(page, b) for page in pages() for b in blocks(read(page)) if b["runnable"]]


def test_there_are_runnable_blocks():
    """The command test below must not pass vacuously: the manual keeps at least a few checked commands."""
    found = runnable_blocks()
    assert len(found) >= 5, [f"{rel(p)}:{b['line']}" for p, b in found]


def scratch_checkout(tmp) -> tuple[str, dict]:
    """A copy of the checkout made of symlinks, where `python` and `.venv/bin/python` run this interpreter
    (`torchrun` and the rest of its bin directory come next on PATH)."""
    root = os.path.join(tmp, "checkout")
    os.makedirs(root)
    for name in os.listdir(ROOT):
        if name not in (".git", ".venv", "runs", ".pytest_cache"):
            os.symlink(os.path.join(ROOT, name), os.path.join(root, name))
    bin_dir = os.path.join(root, ".venv", "bin")
    os.makedirs(bin_dir)
    # A wrapper, not a symlink: a venv's interpreter finds its packages from the path it is started by.
    with open(os.path.join(bin_dir, "python"), "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    os.chmod(os.path.join(bin_dir, "python"), 0o755)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([bin_dir, os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    return root, env


def test_runnable_blocks_run(tmp_path):
    found = runnable_blocks()
    root, env = scratch_checkout(str(tmp_path))
    failures = []
    for page, block in found:
        where = f"{rel(page)}:{block['line']}"
        try:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]], cwd=root, env=env,
                               capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            failures.append(f"{where}: still running after 300 s")
            continue
        if r.returncode != 0:
            failures.append(f"{where}: exit {r.returncode}\n{block['code']}--- output ---\n{(r.stdout + r.stderr)[-3000:]}")
    assert not failures, "runnable blocks failed:\n" + "\n\n".join(failures)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
