"""The HTTP API under generated input: Schemathesis draws requests from the server's own OpenAPI
schema (every operation, valid and invalid bodies, other methods) against the app with a tiny
model, on the real-text index; no request may get a 5xx or take over REQUEST_S. The suite runs
$TERAGRAM_FUZZ_EXAMPLES (default 50) examples per operation; benchmarks/fuzz.py runs more and
records the count ($TERAGRAM_FUZZ_OUT: where the counts go, as JSON)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from teragram.serve.app import ServeConfig, create_app

from tests.serve.test_app import checkpoint  # noqa: F401 (the tiny model the server runs)

EXAMPLES = int(os.environ.get("TERAGRAM_FUZZ_EXAMPLES", "50"))
REQUEST_S = 10.0  # a request slower than this is a hang
SEEN: dict = {"requests": 0, "by_operation": {}, "status": {}, "slowest_s": 0.0}


@pytest.fixture(scope="module")
def api_schema(real_index, checkpoint):  # noqa: F811
    app = create_app(ServeConfig(index=str(real_index), checkpoint=str(checkpoint), max_tokens=8))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_request_gets_a_server_error_or_hangs(case):
    t = time.perf_counter()
    response = case.call_and_validate(checks=[not_a_server_error])
    took = time.perf_counter() - t
    op = f"{case.method} {case.path}"
    SEEN["requests"] += 1
    SEEN["by_operation"][op] = SEEN["by_operation"].get(op, 0) + 1
    SEEN["status"][str(response.status_code)] = SEEN["status"].get(str(response.status_code), 0) + 1
    SEEN["slowest_s"] = max(SEEN["slowest_s"], took)
    assert took < REQUEST_S, f"{op} took {took:.1f} s"


def test_zz_the_requests_were_made():
    """Runs after the fuzzing (file order): every operation was tried, and the counts are kept."""
    assert SEEN["requests"] >= EXAMPLES and {"POST /", "POST /v1/completions", "POST /v1/score"} <= set(SEEN["by_operation"])
    assert not any(s.startswith("5") for s in SEEN["status"]), SEEN["status"]
    if os.environ.get("TERAGRAM_FUZZ_OUT"):
        Path(os.environ["TERAGRAM_FUZZ_OUT"]).write_text(json.dumps(SEEN | {"examples_per_operation": EXAMPLES}, indent=1))
