"""Headless Debian Chromium driven by Selenium, offline: the page's tests (tests/serve/test_page.py)
and its screenshots (tools/page/screenshots.py). The driver is the system's (/usr/bin/chromedriver,
from `make browser`), named explicitly so that Selenium Manager never looks for one online."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@contextmanager
def chromium(width: int = 1200, height: int = 900):
    """A Selenium driver of a fresh headless Chromium (its own profile, removed after)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        raise RuntimeError(f"{CHROMIUM} and {CHROMEDRIVER} are needed: `make browser` installs them (Debian's chromium, chromium-driver)")
    profile = tempfile.mkdtemp(prefix="teragram-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for f in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@dataclass
class Running:
    url: str  # the server's base URL
    log: Callable[[], str]  # what it has written to stderr so far


@contextmanager
def server(args: list[str], *, api_key: str | None = None, cwd: Path | None = None, timeout_s: float = 300.0):
    """`teragram serve ARGS` in a process of its own on a free loopback port, once it answers
    /health (a Running)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "teragram.serve.main", "serve", *args, "--port", str(port)] + (["--api-key", api_key] if api_key else [])
    log = tempfile.TemporaryFile()  # not a pipe: a server that writes warnings must never block on a full one
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t = time.time()
    try:
        while True:
            try:
                if httpx.get(url + "/health", headers=headers).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - t > timeout_s:
                log.seek(0)
                raise RuntimeError(f"the server did not start in {time.time() - t:.0f} s: {log.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.1)

        def read() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        yield Running(url, read)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
