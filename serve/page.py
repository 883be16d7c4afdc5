"""The page at / (serve/static/: plain HTML, CSS and one script; no CDN, no build step): search,
documents, generation and scoring, through the server's own JSON API. Its files hold no data and
are served without the API key (guard.public); the page asks for the key and sends it."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def add_page(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
