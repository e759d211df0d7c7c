"""Figures that cannot drift: every figure README.md and docs/*.md quote from a results file is in that file.

The rule (what the lead, and anyone editing the docs, must comply with):

- **Blocks.** A page outside fenced code is cut into blocks: a paragraph (consecutive non-blank lines), a list
  item (its bullet line and the indented lines under it) and a table row (the header row and the |---| row
  are not checked). Headings are no blocks.
- **Results blocks and their files.** A block *cites* a results file when it holds a markdown link to a path
  under bench/results/, or names one as a path (`bench/results/...` bare, or a code span holding that path alone:
  a path inside a command is the command's input, not a citation). A cited folder
  stands for every .md/.json/.log file in it; bench/results/ itself stands for nothing (too broad to check).
  A block that cites one is a results block, checked against the files it cites. A table row or list item
  also takes the files of what introduces it: the paragraph directly above its table or list (for a list that
  follows a table: that table's introducing paragraph). Other blocks are not checked.
- **Figures.** In a results block: every decimal number (1.324, 4.617, 0.2) and every percentage
  (76 %, 52.9 %), with its unit suffix `x`/`×`/`%` if any. Not figures: integers without `%`, anything in
  inline code or a link target, the scientific notation of learning rates (3.2e-2), dotted versions
  (2.13.0) and a number right after `torch`, `CUDA`, `Python`, `issue(s)` or `v` (software versions, issue
  numbers). A range `1.339-1.494x` is two figures.
- **Matching** (a figure matches a file when):
  - a .md/.log file (or any text) holds the same decimal string as a number token, verbatim: `1.32` does not
    match `1.324`, and `1.3240` does not match `1.324` (quote the figure as the file prints it);
  - a .json file holds a number that rounds (half up) or truncates to the figure at the precision it is quoted
    with (reports print speed-ups rounded down), or whose string values hold it verbatim; for a percentage,
    the number or 100 times it.
  The figure passes when it matches any file its block cites.
- **Derived figures** (computed from quoted ones, in no file): an HTML comment in the same block,
  `<!-- derived: 76 % = 100 * 413 / 544; 1.375x = 352 / 256 -->`, lists each with the arithmetic that gives
  it (numbers, + - * / and parentheses). The test evaluates it: the result must round (or truncate) to the
  figure at its quoted precision, and every decimal input must itself match a cited file. Keep them few.

The failure message names the page, line, figure and the files it was looked for in.
"""

from __future__ import annotations

import ast
import glob
import json
import operator
import os
import re
import sys
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "bench/results/"
FENCE = re.compile(r"^\s*(```+|~~~+)")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.*?)\1", re.S)
COMMENT = re.compile(r"<!--(.*?)-->", re.S)
DERIVED = re.compile(r"^\s*derived:(.*)$", re.S)
PATH = re.compile(r"(?<![\w/.-])((?:\.\./)*bench/results/[\w./-]*)")
LIST_ITEM = re.compile(r"^(\s*)(?:[-*+]|\d+[.)])\s+")
TABLE_ROW = re.compile(r"^\s*\|")
TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
HEADING = re.compile(r"^#{1,6}\s")
# A number token: digits with an optional decimal part, a unit suffix x / × / % (a space allowed before %).
NUMBER = re.compile(r"(?<![\w.,/])(?<![A-Za-z_.]-)(\d+(?:\.\d+)?)(x|×|\s?%)?(?![\w.]*\d|[\w])")
NOT_FIGURE_BEFORE = re.compile(r"(?:\b(?:torch|CUDA|Python|issues?|v|version|glibc|Linux)\s*|[eE][-+]?)$")
FILE_TEXT_EXT = (".md", ".log", ".txt")


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def pages() -> list[str]:
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [os.path.join(ROOT, "README.md")] + docs


# --------------------------------------------------------------------------------------------------
# Blocks of a page and the results files they cite
# --------------------------------------------------------------------------------------------------


def blocks(text: str) -> list[dict]:
    """Paragraphs, list items and table rows outside fenced code, in order: {"kind", "line" (1-based),
    "text", "table" (id of its table, or None), "list" (id of its list, or None)}."""
    out, cur, fence, table_id, list_id = [], None, None, 0, 0
    in_table = in_list = False

    def close():
        nonlocal cur
        if cur is not None:
            out.append(cur)
        cur = None

    for i, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            close()
            fence, in_table, in_list = m.group(1), False, False
            continue
        if not line.strip():
            close()
            in_table = False
            continue
        if HEADING.match(line):
            close()
            in_table = in_list = False
            continue
        if TABLE_ROW.match(line):
            close()
            if not in_table:
                table_id, in_table, in_list = table_id + 1, True, False
            if not TABLE_RULE.match(line):
                out.append({"kind": "row", "line": i, "text": line, "table": table_id, "list": None})
            continue
        in_table = False
        if LIST_ITEM.match(line):
            close()
            if not in_list:
                list_id, in_list = list_id + 1, True
            cur = {"kind": "item", "line": i, "text": line, "table": None, "list": list_id}
            continue
        if cur is not None:
            cur["text"] += "\n" + line
            continue
        if in_list and line.startswith((" ", "\t")):
            cur = {"kind": "item", "line": i, "text": line, "table": None, "list": list_id}
            continue
        in_list = False
        cur = {"kind": "para", "line": i, "text": line, "table": None, "list": None}
    close()
    # The header row is a caption, not data: mark it so that it is not checked.
    seen = set()
    for b in out:
        if b["kind"] == "row" and b["table"] not in seen:
            seen.add(b["table"])
            b["kind"] = "header"
    return out


def cited(block_text: str, page: str) -> list[str]:
    """Results files (absolute paths) the block links or names; a folder: its .md/.json/.log files."""
    found = []
    for _, _, target in LINK.findall(block_text):
        path = target.split("#")[0]
        if path and not re.match(r"^[a-z][a-z0-9+.-]*:", path):
            found.append(os.path.normpath(os.path.join(os.path.dirname(page), path)))
    # A path names a results file when it stands alone: bare or as a whole code span (a path inside a command is an
    # input of the command, not a citation).
    spans = [m.group(2).strip() for m in CODE_SPAN.finditer(block_text)]
    bare = CODE_SPAN.sub(" ", LINK.sub(" ", block_text))
    for path in PATH.findall(bare) + [p for p in spans if PATH.fullmatch(p)]:
        base = ROOT if path.startswith(RESULTS) else os.path.dirname(page)
        found.append(os.path.normpath(os.path.join(base, path)))
    results_root = os.path.join(ROOT, "bench", "results")
    files = []
    for f in found:
        if not f.startswith(results_root + os.sep):
            continue  # not a results file (bench/results itself is too broad to check against)
        if os.path.isdir(f):
            files += sorted(p for p in glob.glob(os.path.join(f, "*")) if p.endswith((".json",) + FILE_TEXT_EXT))
        elif os.path.isfile(f):
            files.append(f)
    return list(dict.fromkeys(files))


def results_blocks(page: str, text: str) -> list[tuple[dict, list[str]]]:
    """The page's results blocks with the files each is checked against (see the module's rule)."""
    bs = blocks(text)
    own = [cited(b["text"], page) for b in bs]
    intro: dict[tuple, list[str]] = {}  # ("table" | "list", id) -> files of its introducing block
    for i, b in enumerate(bs):
        for kind in ("table", "list"):
            key = (kind, b[kind])
            if b[kind] is None or key in intro:
                continue
            j = i - 1
            files = []
            if j >= 0:
                if bs[j]["kind"] == "para":
                    files = own[j]
                elif bs[j]["table"] is not None:  # a list right after a table: the table's introduction
                    files = intro.get(("table", bs[j]["table"]), [])
            intro[key] = files
    out = []
    for b, files in zip(bs, own):
        if b["kind"] == "header":
            continue
        if b["kind"] in ("row", "item"):
            inherited = intro.get(("table", b["table"]) if b["kind"] == "row" else ("list", b["list"]), [])
            files = list(dict.fromkeys(files + inherited))
        if files:
            out.append((b, files))
    return out


# --------------------------------------------------------------------------------------------------
# Figures and matching
# --------------------------------------------------------------------------------------------------


def _visible(text: str) -> str:
    """The block's prose: comments and inline code blanked (their newlines kept, so offsets keep their line
    numbers), links reduced to their text."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    text = CODE_SPAN.sub(blank, COMMENT.sub(blank, text))
    return LINK.sub(lambda m: m.group(1) + "[" + m.group(2) + "]", text)


def figures(text: str) -> list[tuple[int, str, str]]:
    """(line offset within the block, number string, unit) of every figure in the block's prose. The low end of
    a range takes the unit of its high end (0.12-3.3 %: two percentages)."""
    text = _visible(text)
    matches = list(NUMBER.finditer(text))
    out = []
    for i, m in enumerate(matches):
        num, unit = m.group(1), (m.group(2) or "").strip()
        before = text[:m.start()]
        if NOT_FIGURE_BEFORE.search(before) or re.search(r"\d\.$", before) or re.match(r"\.\d", text[m.end():]):
            continue  # a version, an issue number, an exponent, a dotted version
        nxt = matches[i + 1] if i + 1 < len(matches) else None
        if not unit and nxt is not None and re.fullmatch(r"\s?[-–]\s?", text[m.end():nxt.start()]):
            unit = (nxt.group(2) or "").strip()
        if "." not in num and unit != "%":
            continue  # integers are counts and settings, not quoted figures (percentages are)
        out.append((before.count("\n"), num, unit))
    return out


def rounds_to(value: float | Decimal, figure: str) -> bool:
    """Whether value, rounded half up or truncated at figure's decimals, is figure."""
    q = Decimal(1).scaleb(-len(figure.split(".")[1])) if "." in figure else Decimal(1)
    v = value if isinstance(value, Decimal) else Decimal(repr(float(value)))
    f = Decimal(figure)
    return v.quantize(q, ROUND_HALF_UP) == f or v.quantize(q, ROUND_DOWN) == f


class ResultsFile:
    """The number tokens of a results file (text: verbatim strings) and, for JSON, its numbers."""

    def __init__(self, path: str):
        self.path = path
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read()
        self.numbers: list[float] = []
        strings = [raw] if not path.endswith(".json") else []
        if path.endswith(".json"):
            def walk(x):
                if isinstance(x, bool):
                    return
                if isinstance(x, (int, float)):
                    self.numbers.append(x)
                elif isinstance(x, str):
                    strings.append(x)
                elif isinstance(x, dict):
                    for k, v in x.items():
                        strings.append(k)
                        walk(v)
                elif isinstance(x, list):
                    for v in x:
                        walk(v)
            walk(json.loads(raw))
        self.tokens = {m.group(1) for s in strings for m in re.finditer(r"(?<![\d.])(\d+(?:\.\d+)?)(?![\d]|\.\d)", s)}

    def holds(self, num: str, unit: str) -> bool:
        if num in self.tokens:
            return True
        scales = (1, 100) if unit == "%" else (1,)
        return any(rounds_to(v * s, num) for v in self.numbers for s in scales if isinstance(v, (int, float)))


_FILES: dict[str, ResultsFile] = {}


def results_file(path: str) -> ResultsFile:
    if path not in _FILES:
        _FILES[path] = ResultsFile(path)
    return _FILES[path]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr: str) -> tuple[Decimal, list[str]]:
    """The value of an arithmetic expression (numbers, + - * /, parentheses) and its decimal inputs."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Decimal(repr(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not plain arithmetic: {ast.unparse(node)}")
    tree = ast.parse(expr.replace("×", "*").replace("−", "-").strip(), mode="eval")
    inputs = re.findall(r"\d+\.\d+", expr)
    return ev(tree.body), inputs


def derived_figures(text: str) -> dict[tuple[str, str], str]:
    """{(number, unit): arithmetic} from the block's `<!-- derived: FIG = EXPR; ... -->` comments."""
    out = {}
    for body in COMMENT.findall(text):
        m = DERIVED.match(body)
        if not m:
            continue
        for part in filter(None, (p.strip() for p in m.group(1).split(";"))):
            fig, _, expr = part.partition("=")
            fm = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(x|×|%)?\s*", fig)
            if not fm or not expr.strip():
                raise ValueError(f"a derived figure reads 'FIG = EXPR', got {part!r}")
            out[(fm.group(1), fm.group(2) or "")] = expr.strip()
    return out


def check_page(page: str, text: str | None = None) -> list[str]:
    """One message per figure of the page that its cited files do not hold: 'page:line: figure ... '."""
    text = open(page, encoding="utf-8").read() if text is None else text
    problems = []
    for block, files in results_blocks(page, text):
        rf = [results_file(f) for f in files]
        names = ", ".join(rel(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        try:
            derived = derived_figures(block["text"])
        except ValueError as e:
            problems.append(f"{rel(page)}:{block['line']}: {e}")
            continue
        for (num, unit), expr in derived.items():
            try:
                value, inputs = evaluate(expr)
            except (ValueError, SyntaxError, ZeroDivisionError) as e:
                problems.append(f"{rel(page)}:{block['line']}: derived {num}{unit}: cannot evaluate {expr!r} ({e})")
                continue
            if not rounds_to(value, num):
                problems.append(f"{rel(page)}:{block['line']}: derived {num}{unit} = {expr} is {value:.6g}, "
                                f"which does not round to {num}")
            for x in inputs:
                if not any(f.holds(x, "") for f in rf):
                    problems.append(f"{rel(page)}:{block['line']}: derived {num}{unit}: its input {x} is in none of {names}")
        for offset, num, unit in figures(block["text"]):
            if (num, unit) in derived or (num, "") in derived:
                continue
            if not any(f.holds(num, unit) for f in rf):
                problems.append(f"{rel(page)}:{block['line'] + offset}: {num}{' ' + unit if unit == '%' else unit} "
                                f"is in none of {names}")
    return problems


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_quoted_figures_are_in_their_results_files(page):
    problems = check_page(page)
    assert not problems, ("figures quoted from results files that the files do not hold (quote them exactly as "
                          "the file has them, or mark a derived one; the rule is in tests/test_results_figures.py):\n"
                          + "\n".join(problems))


def test_the_docs_quote_results():
    """The check must not pass vacuously: the front page and the benchmarks page hold many checked figures."""
    n = {rel(p): sum(len(figures(b["text"])) for b, _ in results_blocks(p, open(p).read()))
         for p in pages() if rel(p) in ("README.md", os.path.join("docs", "benchmarks.md"))}
    assert all(v >= 30 for v in n.values()), n


def _synthetic(tmp_path, doc: str, report: str, data: dict | None = None) -> list[str]:
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "r.md").write_text(report)
    if data is not None:
        (res / "r.json").write_text(json.dumps(data))
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir(exist_ok=True)
    page.write_text(doc)
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        _FILES.clear()
        return check_page(str(page))
    finally:
        ROOT = old
        _FILES.clear()


def test_checker_catches_a_drifted_figure(tmp_path):
    report = "| unit | loss | speed-up |\n|---|---|---|\n| PipeOptim | 4.549 ± 0.012 | 1.324x |\n"
    ok = "Intro.\n\nPipeOptim ends at 4.549 ± 0.012, 1.324x sooner ([report](../bench/results/r.md)).\n"
    assert _synthetic(tmp_path, ok, report) == []
    drifted = ok.replace("1.324x", "1.33x")
    problems = _synthetic(tmp_path, drifted, report)
    assert len(problems) == 1 and problems[0].startswith("docs/p.md:3: 1.33x is in none of bench/results/r.md"), problems
    # Not a prefix match: 1.32 is not 1.324, and the file's 4.549 is not 4.55 (text is verbatim).
    assert len(_synthetic(tmp_path, ok.replace("1.324x", "1.32x").replace("4.549", "4.55"), report)) == 2


def test_checker_scopes_rows_items_and_json(tmp_path):
    report = "speed-up 1.324x\n"
    data = {"speedup": 1.32468, "loss": 4.5486, "share": 0.759}
    doc = ("The table below is from [the report](../bench/results/r.md) and `bench/results/r.json`.\n\n"
           "| unit | speed-up |\n|---|---|\n| PipeOptim | 1.324x, 1.325x, loss 4.549, 4.548, 75.9 % |\n"
           "| drifted | 1.33x |\n\n"
           "A paragraph citing nothing: 9.99x is not checked.\n\n"
           "- an item of a list under an uncited paragraph: 8.88x, not checked either\n")
    problems = _synthetic(tmp_path, doc, report, data)
    # 1.325x rounds from 1.32468; 4.549 rounds and 4.548 truncates 4.5486; 75.9 % is 100 x 0.759.
    assert [p.split(": ", 1)[1].split(" is")[0] for p in problems] == ["1.33x"], problems
    assert problems[0].startswith("docs/p.md:6:")


def test_checker_ignores_versions_codes_and_lrs(tmp_path):
    doc = ("On torch 2.11 and CUDA 13.0 (issue 36), lr 3.2e-2, `python x.py --ratio 0.5`, "
           "[v1.2 notes](../bench/results/r.md) at 1.324x.\n")
    assert _synthetic(tmp_path, doc, "1.324x") == []


def test_checker_checks_derived_arithmetic(tmp_path):
    report = "413 of 544 micro-batches; 352 and 256; speed-up 1.324x\n"
    ok = "It needs 76 % of them and ran 1.375x the samples ([r](../bench/results/r.md)). " \
         "<!-- derived: 76 % = 100 * 413 / 544; 1.375x = 352 / 256 -->\n"
    assert _synthetic(tmp_path, ok, report) == []
    wrong = ok.replace("1.375x = 352", "1.375x = 360")
    problems = _synthetic(tmp_path, wrong, report)
    assert len(problems) == 1 and "does not round to 1.375" in problems[0], problems
    unmarked = ok.split("<!--")[0] + "\n"
    assert len(_synthetic(tmp_path, unmarked, report)) == 2


def test_percent_ranges_are_percentages(tmp_path):
    data = {"gaps": [0.0012, 0.033]}
    doc = "ZB-V within 0.12-3.3 % of it ([map](../bench/results/r.json)).\n"
    assert _synthetic(tmp_path, doc, "", data) == []
    assert len(_synthetic(tmp_path, doc.replace("0.12-3.3", "0.2-1.0"), "", data)) == 2


if __name__ == "__main__":  # the report for the whole manual, without pytest
    bad = [p for page in pages() for p in check_page(page)]
    print("\n".join(bad) or "every quoted figure is in its results file")
    sys.exit(1 if bad else 0)
