"""Code a newcomer can read (issue 47's bar): no module over 500 lines but the numba kernels'
(KERNELS: one kernel family to a file), no function over 100 lines, in the library and in the
scripts beside it (benchmarks/, experiments/, tools/)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("index", "builder", "model", "serve", "benchmarks", "experiments", "tools")
KERNELS = {"builder/feature_kernels.py"}  # numba kernels, exempt from the module bar
MAX_MODULE, MAX_FUNCTION = 500, 100


def sources() -> list[Path]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in files if f.split("/")[0] in FOLDERS]


def test_no_module_over_500_lines():
    long = {p.relative_to(REPO).as_posix(): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE}
    assert not {k: n for k, n in long.items() if k not in KERNELS}, long


def test_no_function_over_100_lines():
    long = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION:
                long.append(f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
