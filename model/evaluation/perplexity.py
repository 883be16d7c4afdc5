"""Held-out evaluation: per-token log-probabilities, perplexity and bits per byte.

Each held-out document is read as EOS + its tokens and predicts its tokens + EOS, in windows
of the model's context (no window spans two documents); every token is predicted once.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from teragram.index.features import Features
from teragram.model.evaluation.mixing import EvalOptions, Stages, cont_cache_of, mix_stream, needs_states
from teragram.model.evaluation.stream import figures
from teragram.model.gpt import GPT, to_torch
from teragram.model.mixture import cont_cache as cc
from teragram.model.mixture.estimates import heldout_docs, heldout_estimates
from teragram.model.mixture.gate import Gate
from teragram.model.training.data import EvalData


def doc_windows(ids: np.ndarray, f_doc: Features | None, T: int, eos: int, k: int, *, prev=None, last: bool = True):
    """(offset, x, y, features) of the windows of one document read as EOS + ids, predicting
    ids + EOS, T positions each; offset is the window's first target within the document.
    f_doc: the held-out features of its positions (None: a model without index inputs).
    A piece of a document (stream.Chunk) is read the same way from its first target on: prev,
    (the token before it, that token's features or None), stands for EOS; without `last` its
    targets end before the document's EOS."""
    tok, f_prev = (eos, Features.empty(1, k, (np.int64,) * 5)) if prev is None else prev
    y_all = (np.append(ids, eos) if last else np.asarray(ids)).astype(np.int64)
    x_all = np.concatenate([[tok], ids]).astype(np.int64)[: len(y_all)]
    f_all = Features.combine([f_prev, f_doc]).map(lambda v: v[: len(y_all)]) if f_doc is not None else None
    for s in range(0, len(y_all), T):
        yield s, x_all[s : s + T], y_all[s : s + T], (f_all.map(lambda v, s=s: v[s : s + T]) if f_all is not None else None)


@torch.inference_mode()
def forward_docs(
    model: GPT,
    docs,
    eos: int,
    device: str = "cpu",
    *,
    first: int = 0,
    feats: Features | None = None,
    batch: int = 16,
    hidden=False,
    piece: tuple | None = None,
) -> dict:
    """The model over documents (token ids, no separator), each read as EOS + its tokens in
    windows of the model's context. Per predicted token: nll (mixture when the model has one),
    nll_model (the model's own softmax), maxp and top (its most likely token and that token's
    probability), target, doc (document number, from `first`), pos (index of the target in
    EOS+doc+EOS order minus one), and with hidden=True the final hidden states (for kNN-LM
    queries; hidden="ffn_in": the continuous cache's key states, cont_cache.key_states) as one
    float32 tensor on `device`. feats: the documents' held-out features laid out doc0 SEP doc1
    SEP ... (decoded), for a model with index inputs. piece: (offset, prev, last) when docs is one
    piece of a document (stream.Chunk; doc_windows's prev and last): pos stays the document's."""
    T, k = model.cfg.block_size, max(model.cfg.top_k, 1)
    key = "final" if hidden is True else hidden
    was = model.training
    model.eval()
    cuda = str(device).startswith("cuda")
    out: dict[str, list] = {n: [] for n in ("nll", "nll_model", "maxp", "top", "target", "doc", "pos", "hidden")}
    buf: list = []

    def flush():
        T_ = max(len(b[1]) for b in buf)
        n = len(buf)
        x = torch.full((n, T_), eos, dtype=torch.long)
        y = torch.full((n, T_), eos, dtype=torch.long)
        mask = torch.zeros((n, T_), dtype=torch.bool)
        padded = []  # each window's features, padded with "nothing found" to T_ positions
        for i, (_, xx, yy, ff, _) in enumerate(buf):
            m = len(xx)
            x[i, :m], y[i, :m], mask[i, :m] = torch.from_numpy(xx), torch.from_numpy(yy), True
            if ff is not None:
                padded.append(Features.combine([ff, Features.empty(T_ - m, k, (np.int64,) * 5)]))
        f = to_torch(Features.combine(padded, np.stack), device) if model.cfg.use_index else None
        xd, yd = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda), cc.key_states(model, key) if hidden else nullcontext() as got:
            h, _ = model.hidden(xd, f)
            nll, lp_y, maxlp, top = model.head_stats(h, yd, f)
        nll_model = -lp_y
        mk = mask.to(device)
        out["nll"].append(nll[mk].cpu().numpy())
        out["nll_model"].append(nll_model[mk].cpu().numpy())
        out["maxp"].append(maxlp[mk].exp().cpu().numpy())
        out["top"].append(top[mk].cpu().numpy())
        out["target"].append(y[mask].numpy())
        if hidden:
            out["hidden"].append(got[0].float()[mk])
        for s, xx, _, _, d in buf:
            out["doc"].append(np.full(len(xx), d))
            out["pos"].append(np.arange(s, s + len(xx)))
        buf.clear()

    at = 0  # the document's first position in feats
    offset, prev, last = (0, None, True) if piece is None else piece
    for j, ids in enumerate(docs):
        n = len(ids)
        f_doc = feats.map(lambda v, a=at, n=n: v[a : a + n]) if model.cfg.use_index else None
        at += len(ids) + 1
        for s, xx, yy, ff in doc_windows(np.asarray(ids), f_doc, T, eos, k, prev=prev, last=last):
            buf.append((offset + s, xx, yy, ff, first + j))
            if len(buf) == batch:
                flush()
    if buf:
        flush()
    model.train(was)
    hid = out.pop("hidden")
    res = {n: np.concatenate(v) if v else np.zeros(0) for n, v in out.items()}
    if hidden:
        res["hidden"] = torch.cat(hid) if hid else torch.zeros((0, model.cfg.n_embd), device=device)
    return res


def token_eval(
    model: GPT, heldout: str | Path, eos: int, sep: int, device: str = "cpu", *, batch: int = 16, hidden: bool | str = False
) -> dict:
    """forward_docs over every document of a held-out features directory at once (the hidden
    states as a numpy array); for text of any size, heldout_report streams it."""
    from teragram.model.evaluation.stream import heldout_chunks

    (ch,) = heldout_chunks(heldout, 1 << 62, features=model.cfg.use_index)
    r = forward_docs(model, ch.docs, eos, device, feats=ch.feats, batch=batch, hidden=hidden)
    if hidden:
        r["hidden"] = r["hidden"].cpu().numpy()
    return r


def doc_bytes(ev: EvalData, decode) -> np.ndarray:
    """UTF-8 bytes of each held-out document's text."""
    return np.array(
        [
            len(decode(np.asarray(ev.tokens[int(ev.starts[d]) : int(ev.starts[d + 1]) - 1]).tolist()).encode())
            for d in range(len(ev.starts) - 1)
        ]
    )


def docs_bytes(docs, decode) -> np.ndarray:
    """UTF-8 bytes of each document's text (token ids)."""
    return np.array([len(decode(np.asarray(d).tolist()).encode()) for d in docs], np.int64)


def summarize(nll: np.ndarray, nbytes: int) -> dict:
    return figures(len(nll), float(np.sum(nll)), nbytes)


def evaluate(model: GPT, heldout: str | Path, eos: int, sep: int, device: str = "cpu", batch: int = 16) -> dict:
    """Perplexity and bits per byte of the held-out features' text."""
    from teragram.index.tokenizer import load

    r = token_eval(model, heldout, eos, sep, device, batch=batch)
    ev = EvalData(heldout, model.cfg.block_size, eos, sep)
    sp = load(heldout)  # the held-out directory's tokenizer file (tokenizer.model or tokenizer.json)
    return summarize(r["nll"], int(doc_bytes(ev, sp.decode).sum()))


def gated_eval(
    model, index, heldout, device: str = "cpu", *, gate: Gate | None = None, cont_cache: bool = True, workers: int = 1, batch: int = 16
):
    """(gate, per-token nll of the model, per-token nll of the gated mixture) on the held-out
    features' text (index: its directory, or an opened Index or ClusterIndex). With gate=None a
    gate is fit on this text (the better of (t) and, with cont_cache, (t+cc): `gated`), which
    should then be validation text, never the text it will be reported on."""
    from teragram.index.engine import as_index

    idx = as_index(index)
    opts = EvalOptions(gate=gate, fit_gate=gate is None, cont_cache=cont_cache, workers=workers)
    r = token_eval(model, heldout, idx.eos_id, idx.sep, device, batch=batch, hidden=needs_states(opts) and cc.KEY)
    if needs_states(opts):
        r["cont_cache"] = cont_cache_of(r, gate.cont_cache if gate is not None else None, device)
    est = heldout_estimates(idx, heldout, workers)
    from teragram.model.evaluation.mixing import gated

    mixed, fitted, _ = gated(r, est, np.ones(len(r["nll"]), bool), opts)
    return fitted if fitted is not None else gate, r["nll"], mixed


def model_chunks(model: GPT, idx, chunks, device: str = "cpu", *, batch: int = 16, hidden=False, stages: Stages | None = None):
    """Chunks (model/evaluation/stream.py) with the model's outputs and each document's bytes
    filled in; held-out features computed for a model that reads them (and not given)."""
    from teragram.index.features import FeatureConfig
    from teragram.index.heldout import held_out_features

    stages = Stages() if stages is None else stages
    cfg = FeatureConfig("held-out", model.cfg.max_match, max(model.cfg.top_k, 1))
    tail = None  # a piece's last token's features, read by the document's next piece
    for ch in chunks:
        if model.cfg.use_index and ch.feats is None:
            with stages("features"):
                ch.feats = piece_features(idx, ch, cfg) if ch.piece else held_out_features(idx, ch.docs, cfg)
        piece = None
        if ch.piece:
            prev = (int(ch.prefix[-1]), tail) if ch.offset else None
            piece = (ch.offset, prev, not ch.open)
            if model.cfg.use_index and ch.open:
                tail = ch.feats.map(lambda v: v[-1:])
        with stages("model"):
            ch.r = forward_docs(model, ch.docs, idx.eos_id, device, first=ch.first, feats=ch.feats, batch=batch, hidden=hidden, piece=piece)
            ch.nbytes = piece_bytes(ch, idx.decode) if ch.piece else docs_bytes(ch.docs, idx.decode)
        ch.feats = None
        yield ch


def piece_features(idx, ch, cfg) -> Features:
    """The held-out features of a piece's tokens (stream.Chunk), and the separator's row when it
    ends its document: computed over the cfg.max_len tokens before it too, all that they read."""
    from teragram.index import heldout

    c = max(0, ch.offset - cfg.max_len)  # the document from token c on: not its whole prefix again
    ids = np.concatenate([ch.prefix[c:], ch.docs[0]])
    return heldout.piece_features(idx, ids, ch.offset - c, ch.offset - c + ch.targets, cfg.max_len, cfg)


def piece_bytes(ch, decode) -> np.ndarray:
    """A piece's UTF-8 bytes: 0, but the document's last piece's, the whole document's."""
    return np.zeros(1, np.int64) if ch.open else docs_bytes([np.concatenate([ch.prefix, ch.docs[0]])], decode)


def heldout_report(
    model: GPT, index, heldout, device: str = "cpu", opts: EvalOptions | None = None, *, batch: int = 16, stages: Stages | None = None
):
    """(report, fitted) of held-out features' text: perplexity and bits per byte of the model,
    or of its mixture with the index gate or a peer's interpolation (with the model alone under
    "model"); fitted is what was fit here (a Gate, or the baseline's parameters), else None.
    With decontaminate, documents with >= 80% of their 13-grams in the index are left out of
    everything, fitting included, and the report says how many. index: its directory, or an
    opened Index or ClusterIndex (index/cluster.py: the estimates computed by its holders).
    Streamed a chunk of documents at a time (mix_stream)."""
    from teragram.index.engine import as_index
    from teragram.index.tokenizer import check_same
    from teragram.model.evaluation.stream import heldout_chunks, prefetch

    idx = as_index(index)
    check_same(heldout, idx.path)
    opts = EvalOptions() if opts is None else opts
    stages = Stages() if stages is None else stages
    hidden = "final" if opts.baseline == "knn" else needs_states(opts) and cc.KEY
    split = model.cfg.block_size * batch  # pieces of whole batches of windows: the model's outputs are the document's read whole
    chunks = heldout_chunks(heldout, opts.chunk_tokens, features=model.cfg.use_index, split=split)
    chunks = prefetch(model_chunks(model, idx, chunks, device, batch=batch, hidden=hidden, stages=stages))
    return mix_stream(chunks, idx, opts, device=device, stages=stages)


def mix_report(
    r: dict, per_doc: np.ndarray, index, heldout, opts: EvalOptions | None = None, *, device: str = "cpu", stages: Stages | None = None
):
    """mix_stream of a model's per-token outputs r held in memory (forward_docs's fields: nll,
    maxp, top, target, doc, and hidden for the kNN baseline; "cont_cache" as saved, or the
    continuous cache's key states under "hidden", read here on device) on the documents of
    `heldout` (held-out features, or saved outputs: model/evaluation/outputs.py), per_doc their
    UTF-8 bytes, as one chunk."""
    from teragram.model.evaluation.stream import Chunk

    ch = Chunk(0, heldout_docs(heldout), r=dict(r), nbytes=np.asarray(per_doc))
    return mix_stream([ch], index, opts, device=device, stages=stages)
