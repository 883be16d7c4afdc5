"""tools/device_pipeline: a command started in its own session, waited for over several
calls, its output shipped within one call's limits, each file once (again when it changes)."""

import sys
import tarfile
from pathlib import Path

import pytest

from tools import device_pipeline as dp


def _unpack(out: Path) -> dict[str, bytes]:
    """The files shipped to one call's OUT, as the command wrote them (bundles opened)."""
    got = {}
    for line in (out / "MANIFEST.txt").read_text().splitlines():
        name, _, holder = line.split("\t")
        if holder.startswith("NOT SHIPPED"):
            continue
        if holder.endswith(".tar"):
            with tarfile.open(out / holder) as tar:
                got[name] = tar.extractfile(name).read()
        else:
            got[name] = (out / holder).read_bytes()
    return got


def test_pipeline_ships_each_file_once_within_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(dp, "MAX_FILES", 3)
    monkeypatch.setattr(dp, "MAX_FILE", 3000)
    monkeypatch.setattr(dp, "MAX_TOTAL", 6000)
    monkeypatch.setattr(dp, "SMALL", 1000)
    repo = tmp_path / "repo"
    (repo / "model").mkdir(parents=True)
    (repo / "model" / "mark.py").write_text("X = 41\n")
    monkeypatch.chdir(repo)
    script = (
        "import os, sys, time; from teragram.model.mark import X\n"  # the copy's packages import as teragram.*
        "os.makedirs('o', exist_ok=True)\n"
        "open('o/rec.json', 'w').write(str(X))\n"
        "for i in range(6): open(f'o/s{i}.npz', 'wb').write(bytes([i]) * 700)\n"
        "for i in range(3): open(f'o/big{i}.tgz', 'wb').write(bytes([i]) * 2500)\n"
        "open('o/knnest-x.npz', 'wb').write(b'k' * 10)\n"
        "open('o/huge.bin', 'wb').write(b'h' * 4000)\n"
    )
    home = tmp_path / "home"
    dp.start(home, "o", ["knnest-*"], [sys.executable, "-c", script])
    shipped: dict[str, bytes] = {}
    for call in range(6):
        out = tmp_path / f"out{call}"
        monkeypatch.setenv("OUT", str(out))
        assert dp.wait(home, 30) == 0
        files = [p for p in out.iterdir() if p.name != "MANIFEST.txt"]
        assert len(files) <= 3 and sum(p.stat().st_size for p in files) <= 6000 + 3 * 10240  # tar headers aside
        got = _unpack(out)
        assert not set(got) & set(shipped)  # each file once
        shipped |= got
    want = {f"s{i}.npz": bytes([i]) * 700 for i in range(6)} | {f"big{i}.tgz": bytes([i]) * 2500 for i in range(3)}
    assert shipped == want | {"rec.json": b"41"}  # knnest-* skipped; huge.bin over MAX_FILE: named, never shipped
    assert any("huge.bin\t4000\tNOT SHIPPED" in (tmp_path / f"out{c}" / "MANIFEST.txt").read_text() for c in range(6))
    (home / "o" / "rec.json").write_text("42")  # a record rewritten ships again
    monkeypatch.setenv("OUT", str(tmp_path / "again"))
    dp.wait(home, 1)
    assert _unpack(tmp_path / "again") == {"rec.json": b"42"}


def test_failed_command_reports_failure(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    dp.start(tmp_path / "home", "o", [], [sys.executable, "-c", "raise SystemExit(3)"])
    assert dp.wait(tmp_path / "home", 30) == 1
    assert dp._status(tmp_path / "home") == 3


def test_main_takes_the_command_after_double_dash(tmp_path, monkeypatch, capsys):
    """The command's own options (--out, --stage ...) are not the pipeline's: everything after --."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    home = tmp_path / "home"
    code = "import sys; open('args', 'w').write(' '.join(sys.argv[1:]))"
    assert dp.main(["start", "--home", str(home), "--seconds", "30", "--", sys.executable, "-c", code, "--out", "o", "--stage", "all"]) == 0
    assert (home / "args").read_text() == "--out o --stage all"
    assert dp.main(["wait", "--home", str(home), "--seconds", "0"]) == 0
    assert "ended with status 0" in capsys.readouterr().out


def test_wait_without_a_pipeline_is_one_line(tmp_path):
    """A machine given back between calls holds no pipeline: wait says so in one line, no traceback."""
    with pytest.raises(SystemExit, match="no pipeline started here"):
        dp.main(["wait", "--home", str(tmp_path / "gone"), "--seconds", "0"])


def test_feed_takes_its_files_after_the_options(tmp_path, monkeypatch):
    """`feed --home H --into D --seconds S FILE...` (files last, as a call writes it) puts each file
    whole into HOME/D for the running command, which sees it and ends."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    home, fed = tmp_path / "home", tmp_path / "x.txt"
    fed.write_text("fed")
    code = "import os, time\nwhile not os.path.exists('spool/x.txt'): time.sleep(0.1)\nopen('got', 'w').write(open('spool/x.txt').read())"
    assert dp.main(["start", "--home", str(home), "--seconds", "0", "--", sys.executable, "-c", code]) == 0
    assert dp.main(["feed", "--home", str(home), "--into", "spool", "--seconds", "30", str(fed)]) == 0
    assert (home / "got").read_text() == "fed" and not list((home / "spool").glob("*.part"))
