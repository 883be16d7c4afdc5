"""Shared helpers for benchmark scripts: measured subprocesses, machine/commit info, results.

Every benchmark prints a short table last and writes benchmarks/results/NAME.{json,md,png}
with the command line, the git commit and the machine it ran on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# where results go: $TERAGRAM_RESULTS when set, else benchmarks/results/
RESULTS = Path(os.environ.get("TERAGRAM_RESULTS", REPO / "benchmarks" / "results"))


def commit() -> str:
    """The commit measured: $TERAGRAM_COMMIT when set (for a copy of the working tree whose git
    metadata can be stale), else git's HEAD (-dirty with local changes)."""
    if os.environ.get("TERAGRAM_COMMIT"):
        return os.environ["TERAGRAM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def sh(*cmd) -> None:
    """Run a command (echoed first), failing on a non-zero exit."""
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def read_jsonl(path: Path):
    """The records of a .jsonl.zst file, one at a time."""
    import zstandard

    with zstandard.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def run_measured(cmd: list[str], **kw) -> dict:
    """Run a command; its wall time and peak RSS (MB, the child and its waited-for children)."""
    t = time.time()
    p = subprocess.Popen(cmd, **kw)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return {"wall_s": time.time() - t, "peak_rss_mb": ru.ru_maxrss / 1024}


def table(rows: list[dict], cols: list[str]) -> str:
    """A markdown table of rows (dicts) in the given columns."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, data: dict, markdown: str, fig=None) -> None:
    """Write NAME.json (data + provenance), NAME.md (provenance + table), NAME.png (fig)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    prov = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(prov | data, indent=1, default=float) + "\n")
    head = f"`{prov['command']}` at commit `{prov['commit']}` on {prov['machine']['cpu']} ({prov['machine']['cores']} cores, {prov['machine']['mem_gib']} GiB), {prov['date']}\n\n"
    (RESULTS / f"{name}.md").write_text(head + markdown + "\n")
    if fig is not None:
        fig.savefig(RESULTS / f"{name}.png", dpi=120, bbox_inches="tight")
    print(markdown)


def linux_corpus(workdir: Path, mb: float, split: str) -> Path:
    """The first `mb` MB of the train or held-out split of linux-source-6.1, as JSON lines (zstd)."""
    from benchmarks import corpora

    out = Path(workdir) / f"linux-{split}-{mb:g}mb.jsonl.zst"
    if not out.exists():
        print("exporting", out, corpora.export(["linux-source-6.1"], out, max_bytes=int(mb * 1e6), split=split, level=3), flush=True)
    return out


def default_workdir() -> Path:
    from benchmarks import corpora

    return corpora.cache_dir().parent / "bench"
