"""GET /dashboard: a live page of the server's own metrics (running and waiting requests,
KV usage, tokens/s, TTFT and inter-token latency histograms).

The page is one self-contained HTML file (no external scripts, styles or fonts, so it works
air-gapped); its script reads ./metrics once a second. It sits behind the API key like every
other route; a browser cannot send a Bearer token on navigation, so here the key is also
accepted as the password of HTTP Basic auth (the browser asks for it once).
"""

from __future__ import annotations

import html
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from asyncserve.http.serving import ServerState

DASHBOARD_PATH = "/dashboard"


def _page(model_name: str) -> str:
    template = resources.files("asyncserve.http").joinpath("static/dashboard.html").read_text()
    return template.replace("__MODEL__", html.escape(model_name))


def routes(state: ServerState) -> list[Route]:
    page = _page(state.model_names[0])

    async def dashboard(request: Request) -> Response:
        # Never cached: the page is tied to this server's key and model.
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    return [Route(DASHBOARD_PATH, dashboard, methods=["GET"])]
