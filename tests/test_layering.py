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


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """teragram module -> the teragram modules it imports, at any depth (imports under `if
    TYPE_CHECKING:` left out: they never run)."""
    mods = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            mods[".".join(["teragram", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = p

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text(), str(p))
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        here = m if p.name == "__init__.py" else m.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                names = [mod, *(f"{mod}.{a.name}" for a in node.names)]
            else:
                continue
            deps |= {d for n in names if (d := known(n)) and d != m and not m.startswith(d + ".")}
        graph[m] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    order, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return out


def test_no_import_circle_in_the_package():
    """No two modules of the installed package import each other, directly or through others,
    even inside functions (issue 47: train, knn, evals, evaluate and outputs once did)."""
    graph = module_graph()
    assert len(graph) > 50 and circles(graph) == []


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cli_parser_builds_without_the_server_packages():
    """`teragram train | eval | ...` run where FastAPI is not installed (the GPU machine): building
    the parser, every verb registered, imports none of it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('fastapi', 'uvicorn', 'starlette'): sys.modules[m] = None\n"
        "from teragram.serve.main import build_parser\n"
        "build_parser().parse_args(['train', '--config', 'x'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
