// teragram's page: four views over the server's JSON API (POST /, /v1/completions, /v1/score,
// GET /stats). No framework, no build step. Every request can be cancelled (AbortController):
// a cancelled stream closes its connection, and the server stops generating for it.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "teragram-api-key";
const fmt = (x) => Number(x).toLocaleString("en-US");
const pct = (x) => (100 * x).toFixed(x < 0.1 ? 1 : 0) + "%";

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids.flat(Infinity)) if (k != null) e.append(k instanceof Node ? k : String(k));
  return e;
}

// ---- pieces: sentencepiece's "▁" is a space, <0xNN> a byte of a multibyte character ----------
function piecesText(pieces) {
  let out = "", bytes = [];
  const flush = () => { if (bytes.length) { out += new TextDecoder().decode(new Uint8Array(bytes)); bytes = []; } };
  for (const p of pieces) {
    const m = /^<0x([0-9A-Fa-f]{2})>$/.exec(p);
    if (m) { bytes.push(parseInt(m[1], 16)); continue; }
    flush();
    out += p.replaceAll("\u2581", " ");
  }
  flush();
  return out;
}
const show = (piece) => piecesText([piece]).replaceAll("\n", "\u21b5").replaceAll(" ", "\u2423") || "\u2205";

// ---- messages, progress, cancelling ----------------------------------------------------------
function message(text, kind = "error") {
  const m = $("message");
  m.textContent = text;
  m.className = "message" + (kind === "info" ? " info" : "");
  m.hidden = !text;
}

let current = null; // the view's request in flight: {controller}
// work(signal) with a message on failure; a view's request (not `aside`) replaces the one in
// flight and shows its progress, with Cancel
async function task(label, work, aside = false) {
  const controller = new AbortController();
  const mine = { controller };
  if (!aside) {
    if (current) current.controller.abort();
    current = mine;
    message("");
  }
  const t0 = performance.now();
  const tick = () => { $("progress-text").textContent = `${label}… ${((performance.now() - t0) / 1000).toFixed(1)} s`; };
  const shown = aside ? null : setTimeout(() => { $("progress").hidden = false; }, 150);
  const timer = aside ? null : setInterval(tick, 100);
  tick();
  try {
    return await work(controller.signal);
  } catch (e) {
    if (aside || current === mine) message(e.name === "AbortError" ? "Cancelled." : e.message || String(e), e.name === "AbortError" ? "info" : "error");
  } finally {
    clearTimeout(shown);
    clearInterval(timer);
    if (current === mine) { current = null; $("progress").hidden = true; }
  }
}

// ---- the API ---------------------------------------------------------------------------------
function askKey() {
  return new Promise((resolve) => {
    const d = $("key-dialog");
    $("key-input").value = "";
    d.addEventListener("close", () => { sessionStorage.setItem(KEY, $("key-input").value); resolve(); }, { once: true });
    d.showModal();
  });
}

async function call(path, body, signal) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    const r = await fetch(path, body === undefined ? { headers, signal } : { method: "POST", headers, body: JSON.stringify(body), signal });
    if (r.status === 401) { await askKey(); continue; }
    if (!r.ok) {
      let text = `${r.status} ${r.statusText}`;
      try { text = (await r.json()).error || text; } catch (_) { /* not JSON */ }
      throw new Error(text);
    }
    return r;
  }
}
const api = async (path, body, signal) => (await call(path, body, signal)).json();
const query = (body, signal) => api("/", body, signal);
const isCnf = (q) => / AND | OR /.test(q);

// ---- Search ----------------------------------------------------------------------------------
function bars(dist, n = 15, cls = "bars") {
  const rows = Object.entries(dist).map(([id, v]) => ({ id, ...v })).sort((a, b) => b.cont_cnt - a.cont_cnt).slice(0, n);
  const top = rows.length ? rows[0].prob : 1;
  return el("div", { class: cls },
    rows.map((r) => [
      el("span", { class: "tok", title: `token ${r.id}` }, show(r.token)),
      el("div", { class: "track" }, el("div", { class: "fill", style: `width:${(100 * r.prob) / top}%` })),
      el("span", { class: "num", "data-token": r.id, "data-prob": r.prob }, r.prob.toFixed(3)),
      cls === "bars" ? el("span", { class: "num" }, fmt(r.cont_cnt)) : null,
    ]));
}

function stat(label, value, sub, id) {
  return el("div", { class: "card stat" }, el("div", { class: "label" }, label), el("div", { class: "big", id: id || null }, value), sub ? el("div", { class: "sub" }, sub) : null);
}

function tokenChips(pieces, ids) {
  return el("div", { class: "tokens" }, pieces.map((p, i) => el("span", { class: "chip" }, show(p), el("small", {}, ids[i]))));
}

function cnfChips(r) {
  return el("div", { class: "clause" }, r.tokens.map((clause, c) => [
    c ? el("span", { class: "op" }, "AND") : null,
    clause.map((term, t) => [t ? el("span", { class: "op" }, "OR") : null, el("span", { class: "chip" }, piecesText(term))]),
  ]));
}

async function search(q) {
  const out = $("search-out");
  await task("Searching", async (signal) => {
    out.replaceChildren();
    if (isCnf(q)) {
      const r = await query({ query_type: "count", query: q }, signal);
      out.append(
        el("div", { class: "cards" }, stat("Co-occurrences", fmt(r.count), r.approx ? "approximate (a clause over max_clause_freq)" : "exact", "search-count")),
        el("div", { class: "card" }, el("h3", {}, "Query"), cnfChips(r)),
        el("p", {}, el("a", { href: "#documents?q=" + encodeURIComponent(q) }, "Documents holding it →")));
      return;
    }
    const c = await query({ query_type: "count", query: q }, signal);
    const ids = c.token_ids;
    if (!ids.length) throw new Error("the query has no tokens");
    const [p, ntd] = await Promise.all([
      query({ query_type: "prob", query_ids: ids }, signal),
      query({ query_type: "infgram_ntd", query_ids: ids }, signal),
    ]);
    const last = piecesText([c.tokens[ids.length - 1]]).trim();
    const ctx = piecesText(c.tokens.slice(0, -1)).trim();
    out.append(
      el("div", { class: "cards" },
        stat("Occurrences", fmt(c.count), c.approx ? "approximate" : `${ids.length} tokens`, "search-count"),
        stat(`P(${last} | ${ctx || "∅"})`, p.prompt_cnt ? p.prob.toPrecision(3) : "–", `${fmt(p.cont_cnt)} / ${fmt(p.prompt_cnt)}`, "search-prob"),
        stat("∞-gram context", `${ntd.suffix_len} tokens`, `occurs ${fmt(ntd.prompt_cnt)} times`, "search-suffix")),
      el("div", { class: "card" }, el("h3", {}, "Tokens"), tokenChips(c.tokens, ids)),
      el("div", { class: "card", id: "search-ntd" },
        el("h3", {}, `Next token after the longest suffix that occurs (${ntd.suffix_len} tokens, ${fmt(ntd.prompt_cnt)} times)`),
        bars(ntd.result_by_token_id)),
      el("p", {}, el("a", { href: "#documents?q=" + encodeURIComponent(q) }, "Documents holding it →")));
  });
}

// ---- Documents -------------------------------------------------------------------------------
const PAGE = 10;
let docsState = null; // {q | ids, offset}

function highlight(snippet, terms) {
  const needles = terms.map((t) => t.trim()).filter((t) => t.length).sort((a, b) => b.length - a.length);
  const frag = document.createDocumentFragment();
  let i = 0;
  while (i < snippet.length) {
    let best = -1, len = 0;
    for (const n of needles) {
      const j = snippet.indexOf(n, i);
      if (j >= 0 && (best < 0 || j < best)) { best = j; len = n.length; }
    }
    if (best < 0) break;
    frag.append(snippet.slice(i, best), el("mark", {}, snippet.slice(best, best + len)));
    i = best + len;
  }
  frag.append(snippet.slice(i));
  return frag;
}

async function documents(state) {
  docsState = state;
  const out = $("docs-out");
  await task("Finding documents", async (signal) => {
    const body = { query_type: "search_docs", maxnum: PAGE, offset: state.offset, max_disp_len: 160 };
    if (state.ids) body.query_ids = state.ids; else body.query = state.q;
    const r = await query(body, signal);
    const cnf = Array.isArray(r.tokens[0]);
    const terms = cnf ? r.tokens.flat().map(piecesText) : [piecesText(r.tokens)];
    const from = state.offset + 1, to = state.offset + r.documents.length;
    const pager = el("div", { class: "pager" },
      el("button", { class: "ghost", id: "docs-prev", onclick: () => documents({ ...state, offset: Math.max(0, state.offset - PAGE) }) }, "← Previous"),
      el("span", { class: "muted", id: "docs-range" }, r.documents.length ? `documents ${from}–${to}` : "no documents"),
      el("button", { class: "ghost", id: "docs-next", onclick: () => documents({ ...state, offset: state.offset + PAGE }) }, "Next →"));
    pager.children[0].disabled = state.offset === 0;
    pager.children[2].disabled = r.documents.length < PAGE;
    out.replaceChildren(
      el("div", { class: "cards" }, stat(cnf ? "Co-occurrences" : "Occurrences", fmt(r.cnt), r.approx ? "approximate" : "in the whole index", "docs-count")),
      el("div", { class: "card", id: "docs-list" },
        el("h3", {}, "Documents, in corpus order"),
        r.documents.map((d) => el("div", { class: "doc", "data-doc": d.doc_ix },
          el("span", { class: "src" }, d.metadata.source || "?"),
          el("span", { class: "meta" }, `document ${d.doc_ix} · record ${d.metadata.record ?? 0} · token ${fmt(d.needle_offset)} of ${fmt(d.metadata.length ?? 0)}`),
          el("div", { class: "snippet" }, highlight(d.snippet, terms)))),
        pager));
  });
}

// ---- Generate --------------------------------------------------------------------------------
const mix = (a, b, t) => a.map((x, i) => Math.round(x + (b[i] - x) * t));
const MODEL_RGB = [232, 236, 243], INDEX_RGB = [45, 212, 191];
const shade = (t) => `rgb(${mix(MODEL_RGB, INDEX_RGB, Math.max(0, Math.min(1, t))).join(",")})`;
let gen = null; // {promptIds, toks: [{id, text, match, document}]}

function legend(gated) {
  const grad = el("span", { class: "grad", style: `background:linear-gradient(90deg, ${shade(0)}, ${shade(1)})` });
  return gated
    ? [el("span", {}, "gate's weight on the model"), grad, el("span", {}, "on the index")]
    : [el("span", {}, "no gate loaded: shaded by match length, 0"), grad, el("span", {}, "16+ tokens")];
}

async function generate() {
  const prompt = $("gen-prompt").value;
  const body = {
    prompt, stream: true, provenance: true,
    max_tokens: Number($("gen-max").value), temperature: Number($("gen-temp").value), seed: Number($("gen-seed").value),
  };
  const text = $("gen-text");
  $("gen-out").hidden = false;
  $("gen-detail").replaceChildren(el("p", { class: "muted" }, "Click a token to see its longest match in the index."));
  await task("Generating", async (signal) => {
    const promptIds = prompt ? (await query({ query_type: "count", query: prompt }, signal)).token_ids : [];
    gen = { promptIds, toks: [] };
    text.replaceChildren(el("span", { class: "prompt" }, prompt));
    $("gen-status").textContent = "";
    const r = await call("/v1/completions", body, signal);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "", finish = null;
    try {
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const line = buf.slice(0, cut).replace(/^data: /, "");
          buf = buf.slice(cut + 2);
          if (line === "[DONE]") continue;
          const chunk = JSON.parse(line);
          if (chunk.error) throw new Error(chunk.error);
          const ch = chunk.choices[0];
          if (ch.finish_reason) { finish = ch.finish_reason; continue; }
          addToken(text, ch.text, chunk);
        }
      }
    } finally {
      $("gen-status").textContent = `${gen.toks.length} tokens` + (finish ? ` · finished: ${finish}` : " · stopped");
    }
  });
}

function addToken(text, delta, chunk) {
  const i = gen.toks.length;
  const t = { id: chunk.provenance.token, piece: chunk.provenance.text, match: chunk.match, document: chunk.provenance.document };
  gen.toks.push(t);
  if (i === 0) $("gen-legend").replaceChildren(...legend(!!t.match.gate));
  const weight = t.match.gate ? t.match.gate.index : Math.min(t.match.length, 16) / 16;
  const title = t.match.gate
    ? `weights: model ${pct(t.match.gate.model)}, index ${pct(t.match.gate.index)}, cache ${pct(t.match.gate.cache)}`
    : `match of ${t.match.length} tokens`;
  text.append(el("span", { class: "tok-g", style: `background:${shade(weight)}`, title, "data-i": i, "data-token": t.id, onclick: (e) => tokenDetail(i, e.currentTarget) }, delta));
}

async function tokenDetail(i, span) {
  document.querySelectorAll(".tok-g.sel").forEach((s) => s.classList.remove("sel"));
  span.classList.add("sel");
  const t = gen.toks[i];
  const ctx = gen.promptIds.concat(gen.toks.slice(0, i + 1).map((x) => x.id)).slice(-64);
  const d = $("gen-detail");
  await task("Looking up", async (signal) => {
    const r = await query({ query_type: "infgram_ntd", query_ids: ctx }, signal);
    const match = ctx.slice(ctx.length - r.suffix_len);
    const kv = [["token", `${show(t.piece)} (${t.id})`], ["longest match", `${r.suffix_len} tokens`], ["occurrences", fmt(r.prompt_cnt)]];
    if (t.match.gate) kv.push(["gate", `model ${pct(t.match.gate.model)} · index ${pct(t.match.gate.index)} · cache ${pct(t.match.gate.cache)}`]);
    d.replaceChildren(
      el("h3", {}, "Longest match"),
      el("div", { class: "kv", id: "detail-kv", "data-suffix": r.suffix_len, "data-count": r.prompt_cnt }, kv.map(([k, v]) => [el("span", { class: "muted" }, k), el("b", {}, v)])),
      el("h3", {}, "What follows it in the index"),
      Object.keys(r.result_by_token_id).length ? bars(r.result_by_token_id, 10, "bars") : el("p", { class: "muted" }, "nothing: it ends its documents"),
      el("p", {},
        r.suffix_len ? el("a", { href: "#documents?ids=" + match.join(","), id: "detail-docs" }, "Documents holding the match →") : null,
        t.document ? el("span", { class: "muted" }, el("br"), `from ${t.document.source} (document ${t.document.doc_id})`) : null));
  }, true);
}

// ---- Score -----------------------------------------------------------------------------------
const LOW = [255, 247, 236], HIGH = [215, 48, 31];
const heatColor = (bits) => `rgb(${mix(LOW, HIGH, Math.min(bits, 14) / 14).join(",")})`;

function heat(title, tokens, logprobs, id) {
  const bits = logprobs.map((lp) => -lp / Math.LN2);
  const ppl = Math.exp(-logprobs.reduce((a, b) => a + b, 0) / logprobs.length);
  return el("div", { class: "card", id },
    el("h3", {}, title),
    el("div", { class: "sub", "data-ppl": ppl }, `perplexity ${ppl.toFixed(2)} · ${(bits.reduce((a, b) => a + b, 0) / bits.length).toFixed(2)} bits per token`),
    el("div", { class: "heat" }, tokens.map((p, i) => el("span", { style: `background:${heatColor(bits[i])}`, title: `${show(p)}: ${bits[i].toFixed(2)} bits`, "data-bits": bits[i] }, piecesText([p])))));
}

async function score() {
  const out = $("score-out");
  await task("Scoring", async (signal) => {
    const r = await api("/v1/score", { text: $("score-text").value }, signal);
    const dc = r.decontamination;
    const gated = r.logprobs_with_gate ? ["Gated (model + index + caches)", r.logprobs_with_gate] : ["Model with its index inputs", r.logprobs_with_index];
    out.replaceChildren(
      el("div", { class: "card verdict", id: "score-verdict" },
        el("span", { class: "badge " + (dc.contaminated ? "out" : "kept") }, dc.contaminated ? "contaminated" : "kept"),
        el("span", {}, `${pct(dc.share_in_index)} of its ${fmt(dc.ngrams)} ${dc.ngram}-grams are in the index; `
          + `eval --decontaminate leaves out text at ${pct(dc.threshold)} or more.`)),
      el("div", { class: "legend" }, el("span", {}, "surprisal 0 bits"), el("span", { class: "grad", style: `background:linear-gradient(90deg, ${heatColor(0)}, ${heatColor(14)})` }), el("span", {}, "14+ bits")),
      el("div", { class: "scores" }, heat("Model alone", r.tokens, r.logprobs_without_index, "score-model"), heat(gated[0], r.tokens, gated[1], "score-gated")));
  });
}

// ---- views -----------------------------------------------------------------------------------
function route() {
  const [name, qs] = (location.hash.slice(1) || "search").split("?");
  const view = ["search", "documents", "generate", "score"].includes(name) ? name : "search";
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + view; });
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === view));
  const params = new URLSearchParams(qs || "");
  if (view === "documents" && (params.get("q") || params.get("ids"))) {
    const ids = params.get("ids") ? params.get("ids").split(",").map(Number) : null;
    $("docs-q").value = params.get("q") || "";
    documents({ q: params.get("q"), ids, offset: 0 });
  }
}

async function about() {
  try {
    const s = await api("/stats");
    const m = s.model ? `model of ${fmt(s.model.params)} parameters` : "no model";
    $("about").textContent = `${fmt(s.index.tokens)} tokens · ${fmt(s.index.documents)} documents · ${m}`;
    $("gen-max").max = s.limits.max_tokens;
  } catch (e) { message(e.message); }
}

window.addEventListener("DOMContentLoaded", () => {
  $("cancel").addEventListener("click", () => current && current.controller.abort());
  $("search-form").addEventListener("submit", (e) => { e.preventDefault(); search($("search-q").value); });
  $("docs-form").addEventListener("submit", (e) => { e.preventDefault(); documents({ q: $("docs-q").value, ids: null, offset: 0 }); });
  $("gen-form").addEventListener("submit", (e) => { e.preventDefault(); generate(); });
  $("score-form").addEventListener("submit", (e) => { e.preventDefault(); score(); });
  window.addEventListener("hashchange", route);
  route();
  about();
});
