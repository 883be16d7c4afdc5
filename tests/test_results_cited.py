"""The figures the docs cite are in the results files they name (issue 65: figures a reader can trust).

- Every results file that README.md or docs/results.md names (`benchmarks/results/NAME.md`, or a
  bare `NAME.md` / `NAME_*.md` / `NAME_{a,b}.md` that is not another document) exists.
- In README.md, every block that names a results file (a paragraph, a list item, or a table: a
  table that names none is checked against the files named by the nearest block above it in its
  section, else below it) has each of its figures in those files (their .md and .json): a number
  written with a decimal point or a thousands separator, or with a k (thousands), anywhere in the
  block, and every number of a table's body. A figure matches a file's number rounded to the
  README's decimals (0.9971 is "0.997x"; 53,588 is "53.6k" or "54k"; a % also against the file's
  fractions). Not checked: integer percentages and ratios written in prose (8-22%, 13-53x:
  comparisons the README derives), numbers in `code`, index and model sizes (47M, 2.43B, 125M),
  dates, version numbers, the clauses that state a bar (`bar 50 ms`, `moonshot >= 35%`), and ALLOWED.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
DOCS = [README, REPO / "docs" / "results.md"]
# Files the docs name that are not results files: other documents, a user's own outputs and a tokenizer's file.
NOT_RESULTS = {
    "README.md",
    "results.md",
    "cli.md",
    "semantics.md",
    "format.md",
    "page.md",
    "STYLE.md",
    "gate.json",
    "gate-big.json",
    "tokenizer.json",
}
# Figures of the setup, not of a result: the 125M's 1,500 steps of 32 x 1,024 tokens.
ALLOWED = {"1,500", "1,024"}

FILE_TOKEN = re.compile(r"[\w./*{},-]+\.(?:md|json|png|txt)\b")
NUMBER = re.compile(r"(?<![\w.^/])(?<![A-Za-z]-)(\d+(?:,\d{3})*(?:\.\d+)?)(k|x|%)?(?![\w^/]|\.\d)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
SIZE = re.compile(r"\b\d[\d.,]*\s?[MB]\b")  # index and model sizes: 47M, 2.43B, 5.63M tokens
VERSION = re.compile(r"(?i)\b(?:linux(?:-source)?|python)[ -]\d[\d.]*")  # Linux 6.12, linux-source-6.1
RANGE_K = re.compile(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?k)\b")  # 53-54k: both ends are thousands
BAR = re.compile(r"\b(?:bar|moonshot)\b[^;)]*")
CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\([^)]*\)")


def cited_tokens(text: str) -> list[str]:
    """The results files a text names, as written (globs and braces kept)."""
    out = []
    for tok in FILE_TOKEN.findall(text):
        tok = tok.strip(".,")
        if tok.startswith("benchmarks/results/"):
            out.append(tok.removeprefix("benchmarks/results/"))
        elif "/" not in tok and tok not in NOT_RESULTS and not re.match(r"\d{4}-\d{2}-\d{2}-", tok):
            out.append(tok)
    return out


def expand(token: str) -> list[Path]:
    """The files a cited name stands for: `a_{x,y}.md` is two names, `a_*.md` a glob."""
    m = re.search(r"\{([^}]*)\}", token)
    if m:
        return [p for alt in m.group(1).split(",") for p in expand(token[: m.start()] + alt + token[m.end() :])]
    return sorted(RESULTS.glob(token)) if "*" in token else [RESULTS / token] if (RESULTS / token).exists() else []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_results_file_exists(doc):
    missing = sorted({t for t in cited_tokens(doc.read_text()) if not expand(t)})
    assert not missing, f"{doc.name} names results files that benchmarks/results/ lacks: {missing}"


def blocks(text: str) -> list[tuple[str, str]]:
    """(section heading, block) for README's paragraphs, list items and tables; code fences dropped."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)
    out, section = [], ""
    for chunk in re.split(r"\n\s*\n", text):
        lines = chunk.strip("\n").splitlines()
        if not lines:
            continue
        if lines[0].startswith("#"):
            section = lines[0]
            lines = lines[1:]
        current: list[str] = []
        for line in lines:
            in_table = bool(current) and current[0].startswith("|")
            if current and (line.startswith("- ") or line.startswith("|") != in_table):
                out.append((section, "\n".join(current)))
                current = []
            current.append(line)
        if current:
            out.append((section, "\n".join(current)))
    return out


def figures(block: str) -> list[str]:
    """The numbers of a block that the README reports as measured (see the module's docstring)."""
    is_table = block.startswith("|")
    rows = block.splitlines()[2:] if is_table else [block]
    out = []
    for row in rows:
        row = BAR.sub(" ", SIZE.sub(" ", VERSION.sub(" ", DATE.sub(" ", LINK.sub("]", CODE.sub(" ", row))))))
        row = RANGE_K.sub(r"\1k to \2", row)
        for m in NUMBER.finditer(row):
            num, suffix = m.group(1), m.group(2) or ""
            if num in ALLOWED:
                continue
            if is_table or "." in num or "," in num or suffix == "k":
                out.append(num + suffix)
    return out


def _numbers_of_json(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int | float):
        return [float(obj)] if math.isfinite(obj) else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers_of_json(v)]
    if isinstance(obj, str):
        return [float(n.replace(",", "")) for n, _ in NUMBER.findall(obj)]
    return []


@cache
def file_numbers(path: Path) -> tuple[float, ...]:
    """Every number of a results file's .md and .json."""
    nums = []
    md, js = path.with_suffix(".md"), path.with_suffix(".json")
    if md.exists():
        nums += [float(n.replace(",", "")) for n, _ in NUMBER.findall(md.read_text())]
        nums += [float(n) for n in re.findall(r"\d+\.\d+e[+-]\d+", md.read_text())]
    if js.exists():
        nums += _numbers_of_json(json.loads(js.read_text()))
    return tuple(abs(x) for x in nums)


@cache
def rounded(path: Path, decimals: int, scale: float) -> frozenset[int]:
    """The file's numbers times `scale`, rounded (half up) to `decimals`, as integers."""
    f = 10.0**decimals * scale
    return frozenset(math.floor(x * f + 0.5 + 1e-9) for x in file_numbers(path))


def found(figure: str, paths: list[Path]) -> bool:
    num, suffix = re.fullmatch(r"([\d,.]+)(k|x|%)?", figure).groups()
    num = num.replace(",", "")
    decimals = len(num.split(".")[1]) if "." in num else 0
    want = round(float(num) * 10**decimals)
    scales = {"k": [1e-3], "%": [1.0, 100.0]}.get(suffix or "", [1.0])
    return any(want in rounded(p, decimals, s) for p in paths for s in scales)


def checked_blocks() -> list[tuple[str, list[Path]]]:
    """README's blocks that name results files, each with its files; a table naming none takes the
    files of the nearest block above it in its section that names some, else of the one below."""
    bl = blocks(README.read_text())
    files = [[p for t in cited_tokens(b) for p in expand(t)] for _, b in bl]
    out = []
    for i, (section, block) in enumerate(bl):
        paths = files[i]
        if not paths and block.startswith("|"):
            near = [j for j in range(i - 1, -1, -1) if bl[j][0] == section and files[j]][:1]
            near = near or [j for j in range(i + 1, len(bl)) if bl[j][0] == section and files[j]][:1]
            paths = files[near[0]] if near else []
        if paths:
            out.append((block, paths))
    return out


def test_readme_figures_are_in_their_results_files():
    checked = checked_blocks()
    assert len(checked) >= 5, "README's results tables and limits should name their results files"
    bad = []
    for block, paths in checked:
        missing = [f for f in figures(block) if not found(f, paths)]
        if missing:
            bad.append(f"{[p.name for p in paths]}: {missing} in {block[:120]!r}")
    assert not bad, "README figures not found in the results files they cite:\n" + "\n".join(bad)


def test_the_check_catches_a_changed_figure(tmp_path):
    """The oracle itself, on a results file of its own: the file's figures at any rounding are
    found, a figure moved off them is not; setup numbers, sizes, dates, bars and code are skipped."""
    md = tmp_path / "bench.md"
    md.write_text("| query | median ms |\n|---|---|\n| count | 0.0111 |\n\n38,456 tokens/s -> 53.3x; 0.9971x (t+cc)\n")
    md.with_suffix(".json").write_text(json.dumps({"rows": [{"ratio": 0.2571, "p99 ms": 89.02596}]}))
    for figure in ("0.011", "0.0111", "38k", "38.5k", "53.3x", "0.997x", "25.7%", "89.0", "89"):
        assert found(figure, [md]), figure
    for figure in ("0.012", "39k", "53.2x", "0.996x", "25.8%", "89.1"):
        assert not found(figure, [md]), figure
    assert figures("| count | 0.011 ms | 0.24 ms |\n|---|---|---|\n| a | 1,234 | 7 (2 shards) |") == ["1,234", "7", "2"]
    assert figures("at 2.43B, 47M tokens (bar 50 ms: met) 1.5x on 2026-12-05 `--memory 8.5` 3.25 ms") == ["1.5x", "3.25"]
    assert figures("Linux 6.12 and linux-source-6.1 at 53-54k and 0.9-1.1x") == ["53k", "54k", "0.9", "1.1x"]
