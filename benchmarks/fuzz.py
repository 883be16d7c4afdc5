"""The HTTP API under generated input (issue 64): tests/serve/test_fuzz.py (Schemathesis, requests
drawn from the server's OpenAPI schema against the app with a tiny model on the real-text index)
run with EXAMPLES examples per operation; the requests made, their statuses, the slowest, and the
bar: >= 2,000 requests, no 5xx, none over the test's 10 s.

    python -m benchmarks.fuzz [--examples 600]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, SMOKE_HELP, save, smoke_context, table

BAR = 2000


def run(examples: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fuzz.json"
        env = os.environ | {"TERAGRAM_FUZZ_EXAMPLES": str(examples), "TERAGRAM_FUZZ_OUT": str(out)}
        t = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider", "tests/serve/test_fuzz.py"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.time() - t
        if r.returncode or not out.exists():
            raise SystemExit(f"the fuzzing failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
        return json.loads(out.read_text()) | {"wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=600, help="Schemathesis examples per operation")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args(argv)
    if a.smoke:  # the suite runs the fuzzing itself (tests/serve/test_fuzz.py): here, that it collects
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", "tests/serve/test_fuzz.py"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode or "test_no_request_gets_a_server_error_or_hangs" not in r.stdout:
            raise SystemExit(f"smoke: tests/serve/test_fuzz.py does not collect:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return 0
    with smoke_context(False):
        res = run(a.examples)
        server_errors = sum(n for s, n in res["status"].items() if s.startswith("5"))
        met = res["requests"] >= BAR and server_errors == 0
        rows = [{"status": s, "requests": n} for s, n in sorted(res["status"].items())]
        md = (
            f"Schemathesis {res['examples_per_operation']} examples per operation: {res['requests']:,} requests in "
            f"{res['wall_s']:.0f} s, {server_errors} server errors, slowest {res['slowest_s']:.2f} s "
            f"(bar: >= {BAR:,} requests, no 5xx, none over 10 s: {'met' if met else 'missed'}).\n\n" + table(rows, ["status", "requests"])
        )
        print(md)
        save("fuzz", res | {"server_errors": server_errors, "bar_met": met}, md, checks={"no 5xx": server_errors == 0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
