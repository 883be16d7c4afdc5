"""Dependencies flow builder -> index <- model <- serve: every import of every module of the
four packages, read from its source (ast), stays inside that direction. benchmarks and tests are
outside the rule. The `teragram` entry point (serve/main.py) reaches the builder's verbs by
module name (VERB_MODULES), never by an import statement."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("index", "builder", "model", "serve")
ALLOWED = {"index": {"index"}, "builder": {"index", "builder"}, "model": {"index", "model"}, "serve": {"index", "model", "serve"}}


def imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, teragram package) of every import of teragram code in a module (any depth)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [f"teragram.{package}"]
            elif node.level >= 2:
                names = [f"teragram.{node.module or ''}"] if node.module else [f"teragram.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "teragram":
                out.append((node.lineno, parts[1] if len(parts) > 1 else ""))
            elif parts[0] in PACKAGES or parts[0] == "benchmarks":
                out.append((node.lineno, parts[0] + " (top-level name)"))
    return out


def violations() -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for line, dep in imports(path, pkg):
                if dep not in ALLOWED[pkg]:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {dep}")
    return bad


def test_imports_follow_the_dependency_direction():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from teragram.builder import build\n")
    assert imports(p, "index") == [(2, "builder")]
    p.write_text("from ..model import gpt\nimport teragram.serve.app\n")
    assert imports(p, "index") == [(1, "model"), (2, "serve")]


def test_index_knows_nothing_about_torch():
    for path in sorted((REPO / "index").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] == "torch" for m in mods), path


def test_entry_point_names_every_subsystem():
    from teragram.serve.main import VERB_MODULES

    assert sorted(VERB_MODULES) == sorted(f"teragram.{p}.cli" for p in PACKAGES)


def test_the_library_never_names_benchmarks_experiments_or_tools():
    """What a user needs from a benchmark becomes a library function with a verb: no module of
    the four packages refers a reader (or a user, in an error message) to those folders."""
    import re

    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\b(benchmarks|experiments|tools)[/.][a-z_]", line):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert bad == []
