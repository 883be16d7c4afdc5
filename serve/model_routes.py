"""The model's routes (serve/app.py): /v1/completions (generation with live index lookups,
drafts, provenance, the gate's weights; streamed or not) and /v1/score (per-token
log-probabilities, model alone and gated, with the decontamination verdict). Their work runs in
the model's lane, in the model's process when it has one (serve/model_worker.py)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from teragram.index.errors import QueryError
from teragram.model.generation.draft import MAX_DRAFT
from teragram.serve.guard import released
from teragram.serve.index_query import Text, query_ids
from teragram.serve.lanes import holding, in_lane, produced, unless_gone

if TYPE_CHECKING:
    from teragram.serve.app import Served


MAX_STOPS = 16  # stop strings of a completion


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionRequest(_Strict):
    prompt: Text
    model: str | None = None
    max_tokens: int = Field(default=16, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    seed: int = Field(default=0, ge=0, le=2**63 - 1)  # torch's generator takes no more
    draft: int = Field(default=0, ge=0, le=MAX_DRAFT)  # draft up to this many tokens from exact matches (model/generation/draft.py)
    provenance: bool = False  # each token's indexed document, where its context matches >= 8 tokens


class ScoreRequest(_Strict):
    text: Text | None = None
    ids: list[int] | None = None


def _on_model(s: Served, kind: str, here):
    """A model request's work: here(req) with the model in this process, else the model's process's."""
    return (lambda req: s.worker.call(kind, req)) if s.worker else here


def _need_model(s: Served) -> None:
    if s.model is None and s.worker is None:
        raise StarletteHTTPException(404, "no model loaded: start the server with --checkpoint or --hf-model")


def add_completions(app: FastAPI, s: Served) -> None:
    """/v1/completions: generation with live index lookups, drafts and provenance, streamed or not."""
    cfg, idx, model, gate, model_lock = s.cfg, s.idx, s.model, s.gate, s.model_lock
    draft_stats = s.draft_stats

    def _prompt_ids(prompt: str) -> list[int]:
        ids = idx.tokenize(prompt)
        if len(ids) >= model.cfg.block_size:
            raise QueryError(f"prompt of {len(ids)} tokens does not fit the context of {model.cfg.block_size}")
        return ids

    def _prov(tok) -> dict:
        """A generated token with the indexed document its context matches (null below 8 tokens)."""
        return {"token": tok.id, "text": idx.piece(tok.id), "document": tok.provenance.to_json() if tok.provenance else None}

    def _match(tok) -> dict:
        """A streamed token's index match (the longest suffix of the text through it that the
        index holds, and how often it occurs there) and, with a gate, the gate's weights when it
        was drawn, summed by kind (Gate.shares): what the page shades a token by."""
        weights = gate.shares(tok.gate_weights) if tok.gate_weights is not None else None
        return {"length": int(tok.features.length[0]), "count": int(tok.features.count[0]), "gate": weights}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        client = request.client.host if request.client else "unknown"
        release = s.streams.take(client, cfg.max_streams_per_client) if req.stream else (lambda: None)
        try:
            out = await in_lane(s.lanes.model, _on_model(s, "complete", complete), req)
        except BaseException:
            release()
            raise
        if isinstance(out, Response):
            release()
            return out
        # a stream from the model's process holds the model's lock: read in a lane of its own, not the model's
        chunks = produced(lambda: out, s.lanes.stream if s.worker else s.lanes.model)
        return StreamingResponse(released(chunks, release), media_type="text/event-stream")

    def complete(req: CompletionRequest):
        _need_model(s)
        if req.max_tokens > cfg.max_tokens:
            raise QueryError(f"max_tokens {req.max_tokens} is over the cap of {cfg.max_tokens}")
        from teragram.model.generation.draft import Drafter
        from teragram.model.generation.sample import stream

        ids = _prompt_ids(req.prompt)
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        stop_ids = [idx.tokenize(s) for s in stops if s]
        drafter = Drafter(max_tokens=req.draft, stats=draft_stats)
        kw = dict(
            max_new_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop=stop_ids,
            seed=req.seed,
            gate=gate,
            draft=drafter,
            provenance=req.provenance,
        )
        created = int(time.time())
        name = req.model or "teragram"

        def run():
            state: dict = {}
            with model_lock:
                yield from stream(model, idx, ids, state=state, **kw)
            run.state = state  # type: ignore[attr-defined]

        if not req.stream:
            out = list(run())
            return JSONResponse(
                _completion(idx, ids, out, run.state, stops, created, name)
                | (  # type: ignore[attr-defined]
                    {"provenance": [_prov(t) for t in out]} if req.provenance else {}
                )
            )

        def sse():
            prev = ""
            new: list[int] = []
            for tok in run():
                new.append(tok.id)
                text = idx.decode(new)
                delta, prev = text[len(prev) :], text
                chunk = {
                    "id": f"cmpl-{created}",
                    "object": "text_completion",
                    "created": created,
                    "model": name,
                    "choices": [{"index": 0, "text": delta, "finish_reason": None}],
                    "match": _match(tok),
                } | ({"provenance": _prov(tok)} if req.provenance else {})
                yield f"data: {json.dumps(chunk)}\n\n"
            finish = "stop" if run.state["stopped"] in ("eos", "stop") else "length"  # type: ignore[attr-defined]
            yield f"data: {json.dumps({'id': f'cmpl-{created}', 'object': 'text_completion', 'choices': [{'index': 0, 'text': '', 'finish_reason': finish}]})}\n\n"
            yield "data: [DONE]\n\n"

        return sse()

    s.handlers["complete"] = complete


def _completion(idx, ids: list[int], out: list, state: dict, stops: list[str], created: int, name: str) -> dict:
    """A non-streamed completion's answer (OpenAI's text_completion), with the count of generated
    tokens that continued a match of >= 16 tokens in the index."""
    new = [t.id for t in out]
    text = idx.decode(new)
    for stop_text in stops:
        if stop_text and stop_text in text:
            text = text[: text.index(stop_text)]
    finish = "stop" if state["stopped"] in ("eos", "stop") else "length"
    long = sum(int(t.features.length[0]) >= 16 for t in out[:-1]) + (
        1 if ids and out and int(state["features"][len(ids) - 1].length[0]) >= 16 else 0
    )
    return {
        "id": f"cmpl-{created}",
        "object": "text_completion",
        "created": created,
        "model": name,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)},
        "index_matches": {"long_match_tokens": long, "min_match": 16},
    }


def add_score(app: FastAPI, s: Served) -> None:
    """/v1/score: per-token log-probabilities with and without the index, and through the gate."""
    cfg, idx, model, gate, model_lock = s.cfg, s.idx, s.model, s.gate, s.model_lock

    @app.post("/v1/score")
    async def score_route(req: ScoreRequest, request: Request):  # stopped if its client goes while it waits for the model
        return await unless_gone(request.receive, s.lanes.model, _on_model(s, "score", score), req)

    def score(req: ScoreRequest):
        _need_model(s)
        import torch
        from teragram.index.features import Features
        from teragram.model.gpt import blinded, to_torch

        ids = query_ids(idx, req.text, req.ids, cfg.max_query_tokens)
        if not ids:
            raise QueryError("nothing to score")
        if len(ids) > model.cfg.block_size:
            raise QueryError(f"text of {len(ids)} tokens is over the context of {model.cfg.block_size}")
        x = [idx.eos_id] + ids[:-1]  # the text is read as a document: EOS, then its tokens
        r = idx.score(ids, top_k=model.cfg.top_k, max_len=model.cfg.max_match)
        # features of x's positions: none for the EOS slot, then those of ids[:-1]
        fx = Features.combine([Features.empty(1, model.cfg.top_k, (np.int64,) * 5), r.map(lambda a: a[:-1])])

        def t(a):
            return torch.as_tensor(np.asarray(a, dtype=np.int64)).unsqueeze(0).to(cfg.device)

        f = to_torch(fx.map(lambda a: a[None]), cfg.device) if model.cfg.use_index else None
        X, Y = t(x), t(ids)
        reads_cc = gate is not None and gate.cont_cache is not None
        with holding(model_lock), torch.no_grad():
            if reads_cc:  # the continuous cache compares the model's key states of the text's positions
                from teragram.model.mixture.cont_cache import key_states

                with key_states(model, gate.cont_cache.key) as got:
                    h = model.hidden(X, f)[0]
                keys = got[-1][0].double().cpu().numpy()
            else:
                h = model.hidden(X, f)[0]
            with_idx, logp = model.head_losses(h, Y, f)  # the final distribution's nll (the index inputs' mixture, if any)
            without = model(X, Y, blinded(f))[0] if f is not None else with_idx  # a model without index inputs: the same
        out = {
            "tokens": [idx.tokenizer.id_to_piece(int(i)) for i in ids],
            "token_ids": ids,
            "logprobs_with_index": (-with_idx[0]).tolist(),
            "logprobs_without_index": (-without[0]).tolist(),
            "features": [
                {"match_length": int(fx.length[i]), "continuation": int(fx.cont[i]), "count": int(fx.count[i])} for i in range(len(ids))
            ],
            "decontamination": _decontamination(idx, ids, r.length, model.cfg.max_match),
        }
        if gate is not None:  # the model's distribution mixed with the index's and the cache's estimates
            from teragram.model.mixture import cont_cache as cc
            from teragram.model.mixture.estimates import estimates
            from teragram.model.mixture.gate import component_logp, gate_inputs, mix_nll_multi

            maxlp, top = logp[0].max(-1)
            est = {k: v[: len(ids)] for k, v in estimates(idx, ids).items()}  # targets: ids (no final EOS)
            X_g = gate_inputs(est, maxlp.exp().cpu().numpy(), top.cpu().numpy(), gate.components)
            ccols = None
            if reads_cc:  # one document: the first target has no history
                doc = np.zeros(len(ids), np.int64)
                q = cc.target_probs(keys, np.asarray(ids), doc, gate.cont_cache.temperatures, window=gate.cont_cache.window)
                ccols = (q.astype(np.float32).astype(np.float64), cc.first_rows(doc))
            w = gate(X_g)
            nll = mix_nll_multi(component_logp(est, with_idx[0].cpu().numpy(), gate.components, ccols), w)
            out["logprobs_with_gate"] = (-nll).tolist()
            out["gate_weights"] = [gate.shares(row) for row in w]  # by kind: the model, the index, the caches
        return JSONResponse(out)

    s.handlers["score"] = score


def _decontamination(idx, ids: list[int], lengths: np.ndarray, max_match: int) -> dict:
    """The scored text's verdict as a held-out document under `teragram eval --decontaminate`:
    left out when >= 80% of its 13-grams are in the index (index/heldout.py). lengths: its
    positions' match lengths, capped at max_match (<= 0: uncapped); scored again if capped lower."""
    from teragram.index.heldout import DECONTAMINATION_N, DECONTAMINATION_SHARE, ngram_share

    if 0 < max_match < DECONTAMINATION_N:
        lengths = idx.score(ids, top_k=0, max_len=DECONTAMINATION_N).length
    share = ngram_share(lengths, DECONTAMINATION_N)
    return {
        "ngram": DECONTAMINATION_N,
        "ngrams": max(len(ids) - DECONTAMINATION_N + 1, 0),
        "share_in_index": share,
        "threshold": DECONTAMINATION_SHARE,
        "contaminated": share >= DECONTAMINATION_SHARE,
    }
