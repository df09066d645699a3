"""GET /dashboard: the engine seen live; GET /metrics; /docs without the internet.

`attach(app, service)` is all the app does with it: it adds

- `/dashboard`, one page of plain HTML, CSS and JS (static/, no build step, no CDN),
  fed by `/dashboard/events`, a server-sent event stream of frames (feed.py) computed
  only while a page listens, at most `FRAMES_PER_SECOND`; `/dashboard/snapshot` is one
  frame as JSON (`llm mlxs stats --live --plot` draws it);
- `/metrics` (server/metrics.py) and the counter of HTTP responses by API and status;
- `/docs`, FastAPI's Swagger UI served from the package (static/swagger/, Swagger UI's
  dist files under their Apache-2.0 licence), through FastAPI's documented self-hosting.

Every route is behind the Host/Origin guard (server/guard.py) like the rest of the
server; the event stream, the snapshot and /metrics also need the API key when one is
set. The page is only HTML: it asks for the key and keeps it in the tab (sessionStorage),
sending it as `Authorization: Bearer` on a streamed fetch (EventSource cannot send headers).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from ..metrics import Metrics, RequestCounter
from .feed import FRAMES_PER_SECOND, Client, Feed

STATIC = Path(__file__).parent / "static"
STATIC_URL = "/dashboard/static"


def attach(app: FastAPI, service) -> None:
    """The dashboard, /metrics and the offline /docs on `app` (created with docs_url=None)."""
    feed = Feed()
    metrics = Metrics(service, feed)
    app.state.feed, app.state.metrics = feed, metrics
    app.add_middleware(RequestCounter, counts=metrics.requests)  # outermost: refusals are counted too
    app.mount(STATIC_URL, StaticFiles(directory=STATIC), name="dashboard-static")
    app.include_router(metrics.router(service))
    app.include_router(router(service, feed))
    app.include_router(docs_router(app))


def router(service, feed: Feed) -> APIRouter:
    pages = APIRouter()
    keyed = APIRouter(dependencies=[Depends(service.policy.check_api_key)])

    @pages.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html",
                            headers={"Cache-Control": "no-store"})

    @keyed.get("/dashboard/snapshot", description="One frame of the dashboard's figures (docs/server.md)")
    async def snapshot() -> dict:
        return feed.frame(service, Client())

    # left out of the OpenAPI schema: a stream without end (a schema-driven fuzzer would wait on it)
    @keyed.get("/dashboard/events", response_class=StreamingResponse, include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        return StreamingResponse(_frames(service, feed, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    pages.include_router(keyed)
    return pages


async def _frames(service, feed: Feed, request: Request):
    """A frame now, then every 1/FRAMES_PER_SECOND s, until the page goes."""
    client = Client()
    feed.listeners += 1
    try:
        while True:
            frame = feed.frame(service, client)
            yield f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
            await asyncio.sleep(1 / FRAMES_PER_SECOND)
            if await request.is_disconnected():
                return
    finally:
        feed.listeners -= 1


def docs_router(app: FastAPI) -> APIRouter:
    """FastAPI's /docs with Swagger UI's files from the package, not a CDN."""
    docs = APIRouter(include_in_schema=False)
    redirect = "/docs/oauth2-redirect"

    @docs.get("/docs")
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url, title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + redirect,
            swagger_js_url=f"{root}{STATIC_URL}/swagger/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.svg",
        )

    @docs.get(redirect)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    return docs
