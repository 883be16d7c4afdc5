"""A GPU pipeline longer than one call of the lent machine (10 minutes a call; the machine and its
/tmp are kept only while calls follow each other): `start` copies the repository to a directory
of its own and runs the command there in a session of its own (it outlives the call), then waits
as `wait` does; `wait` waits for it up to a deadline and copies to $OUT the files of its output
directory that no earlier call copied, within what one call brings back (8 files of 16 MiB, 64
MiB together), small files bundled in tars. A machine lost between two calls then costs what the
last call had not brought back, not the run.

    python -m tools.device_pipeline start --home /tmp/jr --out-dir o --skip 'knnest-*' -- \\
        python -m benchmarks.joint gpu --carry .carry15 --work w --out o --stage all ...
    python -m tools.device_pipeline wait --home /tmp/jr            # the next call, at once
    python -m tools.device_pipeline feed --home /tmp/jr --into w/spool --seconds 5 .carry/next/*  # a call bringing input

The command runs in HOME (the repository's copy, the carried folders included), so relative
paths in it land there. Each call prints the pipeline's log tail and what it ships; MANIFEST.txt
in $OUT lists each shipped file's name, size and the bundle that holds it."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

MAX_FILES = 7  # a call brings back 8 files: one is MANIFEST.txt
MAX_FILE = 15 << 20  # under 16 MiB a file
MAX_TOTAL = 60 << 20  # under 64 MiB a call
SMALL = 4 << 20  # files under this go into bundles
PACKAGES = ("index", "builder", "model", "serve")  # pyproject's teragram.<folder>


def _state(home: Path) -> dict:
    f = home / "pipeline.json"
    if not f.exists():  # the usual cause: the machine went back between two calls, its /tmp with it
        raise SystemExit(f"{home}: no pipeline started here (on a machine given back since `start`, the run is lost: start it again)")
    return json.loads(f.read_text())


def _status(home: Path) -> int | None:
    """The command's exit status, None while it runs (a call that started it has ended since, so
    the status is read from the file its shell writes, not from a wait)."""
    rc = home / "rc"
    return int(rc.read_text()) if rc.exists() and rc.read_text().strip() else None


def start(home: Path, out_dir: str, skip: list[str], cmd: list[str]) -> None:
    """Copy the working tree (cwd) to HOME, run `cmd` there in a new session, logging to HOME/log,
    with the copy's packages importable as teragram.index, ... (links under HOME/.pkg, as an
    install would name them) ahead of PYTHONPATH."""
    if (home / "pipeline.json").exists():
        raise SystemExit(f"{home}: a pipeline was started there already (wait for it, or remove the directory)")
    shutil.copytree(Path.cwd(), home, symlinks=True, ignore=shutil.ignore_patterns(".git", ".venv"))
    (home / ".pkg" / "teragram").mkdir(parents=True)
    for name in PACKAGES:
        (home / ".pkg" / "teragram" / name).symlink_to(home / name)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(home / ".pkg"), str(home), os.environ.get("PYTHONPATH")]))}
    log = open(home / "log", "w")
    wrapped = ["bash", "-c", '"$@"; echo $? > rc', "bash", *cmd]  # the status outlives this call's process tree
    p = subprocess.Popen(wrapped, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state = {"pid": p.pid, "cmd": cmd, "out_dir": out_dir, "skip": skip, "started": time.time(), "shipped": {}}
    (home / "pipeline.json").write_text(json.dumps(state, indent=1))
    print(f"started pid {p.pid} in {home}: {' '.join(cmd)}", flush=True)


def _ship(home: Path, dest: Path, again: bool = False) -> None:
    """Copy the output files not shipped before (or changed since) to `dest`, within one call's limits."""
    st = _state(home)
    out = home / st["out_dir"]
    files = sorted(
        (p for p in out.rglob("*") if p.is_file() and not any(fnmatch.fnmatch(p.name, s) for s in st["skip"])),
        key=lambda p: (p.suffix != ".json", p.stat().st_mtime),  # the small JSON records first, then oldest first
    )
    sig = {str(p.relative_to(out)): [p.stat().st_size, p.stat().st_mtime] for p in files}
    todo = [p for p in files if again or st["shipped"].get(str(p.relative_to(out))) != sig[str(p.relative_to(out))]]
    dest.mkdir(parents=True, exist_ok=True)
    placed, too_big, total, lines, bundle, bundle_size = [], [], 0, [], [], 0
    n_files = 0

    def close_bundle():
        nonlocal bundle, bundle_size, n_files, total
        if bundle:
            name = f"bundle-{int(time.time() * 1000) % 10**9}-{n_files}.tar"
            with tarfile.open(dest / name, "w") as tar:
                for p in bundle:
                    tar.add(p, arcname=str(p.relative_to(out)))
                    lines.append(f"{p.relative_to(out)}\t{p.stat().st_size}\t{name}")
            placed.extend(bundle)
            n_files += 1
            total += bundle_size
            bundle, bundle_size = [], 0

    for p in todo:
        size = p.stat().st_size
        if size > MAX_FILE:
            lines.append(f"{p.relative_to(out)}\t{size}\tNOT SHIPPED: over {MAX_FILE:,} bytes")
            too_big.append(p)
            continue
        if total + bundle_size + size > MAX_TOTAL or n_files + (1 if bundle else 0) + 1 > MAX_FILES:
            break
        if size < SMALL:
            if bundle_size + size > MAX_FILE:
                close_bundle()
            bundle.append(p)
            bundle_size += size
        else:
            flat = str(p.relative_to(out)).replace("/", "_")  # files come back from one folder
            shutil.copyfile(p, dest / flat)
            lines.append(f"{p.relative_to(out)}\t{size}\t{flat}")
            placed.append(p)
            n_files += 1
            total += size
    close_bundle()
    for p in placed:
        st["shipped"][str(p.relative_to(out))] = sig[str(p.relative_to(out))]
    (home / "pipeline.json").write_text(json.dumps(st, indent=1))
    left = [p for p in todo if p not in placed and p not in too_big]
    (dest / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print(f"shipped {len(placed)} files ({total / 2**20:.1f} MiB) in {n_files} files; {len(left)} left for the next call", flush=True)


def place(files: list[Path], dest: Path) -> None:
    """Copy files into dest, each under a temporary name, then renamed: a command watching dest
    sees only whole files."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        tmp = dest / (f.name + ".part")
        shutil.copyfile(f, tmp)
        tmp.replace(dest / f.name)


def feed(home: Path, into: str, files: list[Path]) -> None:
    """Files this call carried, into HOME/INTO for the running command (a trainer's next shards)."""
    _state(home)
    place(files, home / into)
    for f in files:
        print(f"fed {f.name} ({f.stat().st_size / 2**20:.1f} MiB) into {home / into}", flush=True)


def wait(home: Path, seconds: float, again: bool = False) -> int:
    """Wait for the pipeline up to `seconds`, print its log's tail, ship what is new to $OUT.
    Returns 0 while it runs or once it ended well, 1 if it failed."""
    st = _state(home)
    deadline = time.time() + seconds
    while _status(home) is None and time.time() < deadline:
        time.sleep(2)
    rc = _status(home)
    log = (home / "log").read_text(errors="replace").splitlines()
    print("\n".join(log[-40:]))
    elapsed = time.time() - st["started"]
    print(f"--- pipeline {'running' if rc is None else f'ended with status {rc}'} after {elapsed:.0f} s", flush=True)
    if os.environ.get("OUT"):
        _ship(home, Path(os.environ["OUT"]), again)
    return 1 if rc else 0


def smoke() -> int:
    """start, feed and wait on a tiny working tree (one module) in a temporary folder: the command
    imports the copy's package, waits for the file fed to it, writes two files, and both are
    shipped to $OUT."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="teragram-smoke-") as tmp:
        tree, home = Path(tmp) / "tree", Path(tmp) / "home"
        (tree / "model").mkdir(parents=True)
        (tree / "model" / "mark.py").write_text("X = 41\n")
        (Path(tmp) / "fed.txt").write_text("fed")
        os.environ["OUT"] = str(Path(tmp) / "out")
        os.chdir(tree)
        code = (
            "import os, time; from teragram.model.mark import X; os.makedirs('o')\n"
            "while not os.path.exists('spool/fed.txt'): time.sleep(0.1)\n"
            "open('o/a.txt', 'w').write(str(X) + open('spool/fed.txt').read()); open('o/b.txt', 'w').write('b')"
        )
        start(home, "o", [], [sys.executable, "-c", code])
        feed(home, "spool", [Path(tmp) / "fed.txt"])
        rc = wait(home, 60)
        shipped = (Path(tmp) / "out" / "MANIFEST.txt").read_text()
        if rc or "a.txt" not in shipped or (home / "o" / "a.txt").read_text() != "41fed":
            raise SystemExit(f"smoke: the pipeline ended with {rc}, shipped: {shipped}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["start", "wait", "feed"])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--out-dir", default="o", help="start: the command's output directory, relative to HOME")
    ap.add_argument("--skip", action="append", default=[], help="start: names (glob) never shipped")
    ap.add_argument("--seconds", type=float, default=560, help="how long this call waits before shipping")
    ap.add_argument("--again", action="store_true", help="wait: ship every file again (a call whose files were lost)")
    ap.add_argument("--into", help="feed: the folder, relative to HOME, that the files go into")
    ap.add_argument("files", nargs="*", type=Path, help="feed: the files this call carried")
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = ap.parse_intermixed_args(argv[: len(argv) - len(cmd) - (1 if "--" in argv else 0)])  # feed's files anywhere
    if a.verb == "start":
        if not cmd:
            raise SystemExit("start: the command to run follows --")
        start(a.home, a.out_dir, a.skip, cmd)
    if a.verb == "feed":
        if not a.into or not a.files:
            raise SystemExit("feed: give --into and the files")
        feed(a.home, a.into, a.files)
    return wait(a.home, a.seconds, a.again)


if __name__ == "__main__":
    sys.exit(main())
