"""Screenshots of the page (serve/static/), one PNG per view, from a real server on a real run:

    python -m tools.page.screenshots --run runs/default [--out docs/img]

RUN holds idx/, lm/ and gate.json, as `make demo` leaves them. The server starts with the gate,
headless Chromium (tools/page/browser.py) drives each view with a query of the embedded corpus, and
each view is saved at 1200 px wide, in 256 colours (small enough to commit)."""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tools.page.browser import chromium, server

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "data" / "default" / "heldout" / "test"


def _fill(d, field: str, value: str) -> None:
    box = d.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)


def _go(d, url: str, view: str, fields: dict[str, str], ready: str, timeout: float = 120) -> None:
    d.get(f"{url}/#{view}")
    for k, v in fields.items():
        _fill(d, k, v)
    d.find_element(By.CSS_SELECTOR, f"#view-{view} form button[type=submit]").click()
    WebDriverWait(d, timeout).until(lambda d: d.execute_script(f"return {ready}"))
    time.sleep(0.3)  # the last paint


def _save(d, path: Path) -> None:
    from PIL import Image

    d.save_screenshot(str(path))
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    print(f"{path} ({path.stat().st_size // 1024} KiB)")


def _scored_text() -> str:
    """A paragraph of prose from the first held-out document of the embedded corpus that has one."""
    for doc in sorted(HELDOUT.rglob("*.rst.gz")):
        for para in gzip.open(doc, "rt", encoding="utf-8").read().split("\n\n"):
            text = " ".join(para.split())
            if len(text) > 200 and sum(c.isalpha() or c == " " for c in text) > 0.95 * len(text):
                return text[:240]
    raise SystemExit(f"no prose paragraph under {HELDOUT}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/default", help="a run directory: idx/, lm/, gate.json (make demo)")
    p.add_argument("--out", default="docs/img")
    a = p.parse_args(argv)
    run, out = Path(a.run), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = ["--index", str(run / "idx"), "--checkpoint", str(run / "lm"), "--gate", str(run / "gate.json")]
    with server(args) as running, chromium(1200, 860) as d:
        url = running.url
        _go(d, url, "search", {"search-q": "A hacker is a person who"}, "document.querySelectorAll('#search-ntd .num').length > 0")
        _save(d, out / "search.png")
        _go(d, url, "documents", {"docs-q": "spin lock OR mutex AND interrupt"}, "document.querySelectorAll('#docs-list .doc').length > 0")
        _save(d, out / "documents.png")
        fields = {"gen-prompt": "The kernel", "gen-max": "60", "gen-temp": "0.8", "gen-seed": "1"}
        _go(d, url, "generate", fields, "document.getElementById('gen-status').innerText.includes('finished')")
        spans = d.find_elements(By.CSS_SELECTOR, ".tok-g")
        next((s for s in spans[5:] if len(s.get_attribute("textContent").strip()) > 2), spans[-1]).click()  # a word, to show its match
        WebDriverWait(d, 60).until(lambda d: d.find_elements(By.ID, "detail-kv"))
        time.sleep(0.3)
        _save(d, out / "generate.png")
        _go(d, url, "score", {"score-text": _scored_text()}, "document.getElementById('score-verdict') !== null")
        _save(d, out / "score.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
