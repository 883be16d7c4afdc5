"""The page at / (serve/static/) in headless Chromium (tools/page/browser.py; `make browser` installs
it), against a real server process with the tiny model, a gate and an API key, on the real-text
index: every view loads, its numbers are the API's (the Python API as oracle), a generation
renders token by token, errors render as messages, and a cancelled stream stops the server's
generation."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from teragram.index.engine import Index
from teragram.model.mixture.estimates import COMPONENTS
from teragram.model.mixture.gate import Gate, gate_features

from tests.serve.test_app import checkpoint  # noqa: F401 (the tiny model the server runs)
from tools.page.browser import chromium, server

KEY = "page-key"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(real_index, checkpoint, tmp_path_factory):  # noqa: F811
    X = gate_features(np.zeros(1), np.ones(1), *[[np.ones(1)] * len(COMPONENTS)] * 3, np.zeros(1))
    gate = tmp_path_factory.mktemp("gate") / "gate.json"
    Gate(np.random.default_rng(0).normal(0, 0.5, (X.shape[1], len(COMPONENTS)))).save(gate)
    args = ["--index", str(real_index), "--checkpoint", str(checkpoint), "--gate", str(gate)]
    with server(args, api_key=KEY) as running:
        yield running.url
        assert "Traceback" not in running.log()


@pytest.fixture(scope="module")
def browser(url):
    """One Chromium for the module, the API key given once through the page's own dialog."""
    with chromium() as d:
        d.get(url + "/#search")
        WebDriverWait(d, 20).until(lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open") is not None)
        d.find_element(By.ID, "key-input").send_keys(KEY)
        d.find_element(By.CSS_SELECTOR, "#key-form button").click()
        yield d


@pytest.fixture(scope="module")
def idx(real_index):
    return Index(real_index)


def wait(d, fn, timeout=30):
    return WebDriverWait(d, timeout).until(lambda d: fn())


def text(d, css: str) -> str:
    """The visible text of the first element matching css ("" if none), read at one moment."""
    return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)


def attrs(d, css: str, name: str) -> list[str]:
    """An attribute of every element matching css, read at one moment (no element goes stale between reads)."""
    return d.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))", css, name)


def submit(d, view: str, field: str, value: str) -> None:
    d.get(d.current_url.split("#")[0] + "#" + view)
    box = d.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)
    box.find_element(By.XPATH, "./ancestor::form//button[@type='submit']").click()


def test_every_view_loads_and_the_key_is_asked_once(browser, url, idx):
    d = browser
    assert httpx.get(url + "/stats").status_code == 401 and httpx.get(url + "/").status_code == 200  # the page itself is public
    wait(d, lambda: "tokens" in text(d, "#about"))
    assert text(d, "#about").startswith(f"{idx.n_tokens:,} tokens · {idx.n_docs:,} documents · model of")
    for view in ("search", "documents", "generate", "score"):
        d.find_element(By.CSS_SELECTOR, f"nav a[data-view={view}]").click()
        wait(d, lambda view=view: d.find_element(By.ID, f"view-{view}").is_displayed())
        shown = [v.get_attribute("id") for v in d.find_elements(By.CSS_SELECTOR, ".view") if v.is_displayed()]
        assert shown == [f"view-{view}"] and not d.find_element(By.ID, "key-dialog").get_attribute("open")


def test_search_shows_the_apis_numbers(browser, idx):
    d = browser
    submit(d, "search", "search-q", "of the")
    wait(d, lambda: d.find_elements(By.CSS_SELECTOR, "#search-ntd .num[data-prob]"))
    ids = idx.tokenize("of the")
    assert text(d, "#search-count") == f"{idx.count(ids).count:,}"
    p = idx.prob(ids[:-1], ids[-1])
    assert text(d, "#search-prob") == f"{p.prob:.3g}".replace("e-0", "e-")
    ntd = idx.infgram_ntd(ids)
    shown = {
        int(e.get_attribute("data-token")): float(e.get_attribute("data-prob"))
        for e in d.find_elements(By.CSS_SELECTOR, "#search-ntd .num[data-prob]")
    }
    want = {t: c / ntd.prompt_cnt for t, (c, _) in ntd.result_by_token_id.items()}
    assert len(shown) == min(15, len(want)) and all(np.isclose(want[t], q) for t, q in shown.items())
    assert min(shown.values()) >= sorted(want.values())[-len(shown)] - 1e-12  # the largest ones
    submit(d, "search", "search-q", "kernel AND lock OR mutex")
    wait(d, lambda: d.find_elements(By.CSS_SELECTOR, ".clause"))
    from teragram.index import cnf

    assert text(d, "#search-count") == f"{idx.count_cnf(cnf.tokenize_cnf(idx, 'kernel AND lock OR mutex')).count:,}"


def test_documents_are_paged_with_the_match_highlighted(browser, idx):
    d = browser
    frequent = (idx.decode([int(t)]).strip() for t in np.argsort(idx.unigram[: idx.vocab_size])[::-1][:100])
    q = next(q for q in frequent if q and len(idx.docs(idx.tokenize(q), max=20).docs) > 10)  # a text on two pages
    ids = idx.tokenize(q)
    want = idx.docs(ids, max=20, context=200).docs
    submit(d, "documents", "docs-q", q)
    wait(d, lambda: attrs(d, "#docs-range", "id") and text(d, "#docs-range") == "documents 1–10")
    assert [int(x) for x in attrs(d, "#docs-list .doc", "data-doc")] == [h.doc_id for h in want[:10]]
    assert (
        attrs(d, "#docs-list .doc", "data-doc")
        and d.execute_script("return document.querySelector('#docs-list .src').textContent") == want[0].metadata["source"]
    )
    assert d.execute_script("return document.querySelectorAll('#docs-list mark').length") > 0
    assert text(d, "#docs-count") == f"{idx.count(ids).count:,}"
    d.find_element(By.ID, "docs-next").click()
    wait(d, lambda: text(d, "#docs-range") == f"documents 11–{len(want)}")
    assert [int(x) for x in attrs(d, "#docs-list .doc", "data-doc")] == [h.doc_id for h in want[10:20]]


def test_generation_renders_token_by_token_and_a_token_opens_its_match(browser, url, idx):
    d = browser
    d.get(url + "/#generate")
    # record how many tokens are on the page each time the page changes: a stream shows them one by one
    d.execute_script(
        "window.seen = []; new MutationObserver(() => window.seen.push(document.querySelectorAll('.tok-g').length))"
        ".observe(document.getElementById('gen-text'), {childList: true});"
    )
    for field, value in (("gen-prompt", "The kernel"), ("gen-max", "24"), ("gen-temp", "0.8"), ("gen-seed", "3")):
        d.find_element(By.ID, field).clear()
        d.find_element(By.ID, field).send_keys(value)
    d.find_element(By.CSS_SELECTOR, "#gen-form button").click()
    wait(d, lambda: "finished" in text(d, "#gen-status"))
    full = httpx.post(
        url + "/v1/completions", json={"prompt": "The kernel", "max_tokens": 24, "temperature": 0.8, "seed": 3}, headers=H
    ).json()
    spans = d.find_elements(By.CSS_SELECTOR, ".tok-g")
    assert "".join(s.get_attribute("textContent") for s in spans) == full["choices"][0]["text"]
    assert len(spans) == full["usage"]["completion_tokens"]
    counts = [c for c in d.execute_script("return window.seen") if c > 0]
    assert counts == sorted(counts) and len(set(counts)) >= min(4, len(spans)), counts  # appended in several steps, never all at once
    assert all(s.get_attribute("title").startswith("weights: model") for s in spans) and "gate's weight" in text(d, "#gen-legend")
    i = min(3, len(spans) - 1)
    spans[i].click()
    wait(d, lambda: d.find_elements(By.ID, "detail-kv"))
    prompt = idx.tokenize("The kernel")
    ctx = (prompt + [int(s.get_attribute("data-token")) for s in spans[: i + 1]])[-64:]
    r = idx.infgram_ntd(ctx)
    kv = d.find_element(By.ID, "detail-kv")
    assert (int(kv.get_attribute("data-suffix")), int(kv.get_attribute("data-count"))) == (r.suffix_len, r.prompt_cnt)
    d.find_element(By.ID, "detail-docs").click()
    wait(d, lambda: d.find_elements(By.CSS_SELECTOR, "#docs-list .doc"))
    assert text(d, "#docs-count") == f"{r.prompt_cnt:,}"


def test_errors_render_as_messages(browser):
    d = browser
    submit(d, "generate", "gen-prompt", "word " * 200)  # the page's own form refuses max_tokens over the server's cap (/stats)
    wait(d, lambda: d.find_element(By.ID, "message").is_displayed())
    assert text(d, "#message").endswith("does not fit the context of 64") and text(d, "#message").startswith("prompt of ")
    submit(d, "search", "search-q", "a OR b OR c OR d OR e OR f OR g OR h OR i AND x")
    wait(d, lambda: d.find_element(By.ID, "message").is_displayed() and "terms" in text(d, "#message"))
    assert "\n" not in text(d, "#message") and "Traceback" not in d.page_source


def test_score_heat_maps_and_verdict(browser, url, idx, real_index):
    d = browser
    from tests.conftest import real_texts

    sample = real_texts(1)[0][1][:100]  # indexed text, within the tiny model's context of 64 tokens
    submit(d, "score", "score-text", sample)
    wait(d, lambda: d.find_elements(By.ID, "score-verdict"))
    r = httpx.post(url + "/v1/score", json={"text": d.find_element(By.ID, "score-text").get_attribute("value")}, headers=H).json()
    model = [float(x) for x in attrs(d, "#score-model .heat span", "data-bits")]
    gated = [float(x) for x in attrs(d, "#score-gated .heat span", "data-bits")]
    np.testing.assert_allclose(model, -np.array(r["logprobs_without_index"]) / np.log(2), rtol=1e-9)
    np.testing.assert_allclose(gated, -np.array(r["logprobs_with_gate"]) / np.log(2), rtol=1e-9)
    assert r["decontamination"]["contaminated"] and "contaminated" in text(d, "#score-verdict")  # indexed text: in the index


def test_cancel_stops_the_generation_on_the_server(browser, url):
    d = browser
    long = {"prompt": "The kernel", "max_tokens": 512, "temperature": 0}
    assert httpx.post(url + "/v1/completions", json=long, headers=H, timeout=120).json()["choices"][0]["finish_reason"] == "length"
    before = httpx.get(url + "/stats", headers=H).json()["drafts"]["tokens"]
    d.get(url + "/#generate")
    for field, value in (("gen-prompt", "The kernel"), ("gen-temp", "0")):
        d.find_element(By.ID, field).clear()
        d.find_element(By.ID, field).send_keys(value)
    submit(d, "generate", "gen-max", "512")  # greedy: the same 512 tokens, no end of text before them
    wait(d, lambda: d.find_elements(By.CSS_SELECTOR, ".tok-g") and d.find_element(By.ID, "cancel").is_displayed(), timeout=60)
    d.find_element(By.ID, "cancel").click()
    wait(d, lambda: text(d, "#message") == "Cancelled.")
    time.sleep(1.0)
    made = httpx.get(url + "/stats", headers=H).json()["drafts"]["tokens"] - before
    assert 0 < made < 512, made  # the server stopped generating when the page let go
    r = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 2}, headers=H, timeout=30)
    assert r.status_code == 200
