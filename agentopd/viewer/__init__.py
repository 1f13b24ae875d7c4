"""The trajectory viewer: replay a run's episodes in a browser (`agentopd view RUN_DIR`).

    from agentopd.viewer import create_app, serve
    app = create_app("runs/sql_db-20260101-120000")   # one run directory, or a folder of runs
    serve("runs/", host="127.0.0.1", port=8000)        # uvicorn; prints the URL

What it reads (docs/design.md 3.5), never writes: `trajectories.db` (opened read-only per request,
so a live run's new episodes show on reload), `metrics.jsonl` (re-read when it changes), and
a tokenizer in `<run>/tokenizer/` or `<run>/final/` to show token text (tokenizer files only;
no model is ever loaded). Without a tokenizer the token view shows ids.

Pages (`pages.py`): runs index, run summary with SVG charts, episode list with filters and
keyset pages, episode replay (turns, tool calls and results, token view shaded by the
teacher-student log-ratio, per-turn KL, replay controls). JSON API (`api.py`) under /api,
described by /openapi.json and listed offline at /api-docs (FastAPI's Swagger UI is off: it
loads from a CDN). Templates are autoescaped; responses carry a Content-Security-Policy
that allows only the viewer's own script and styles; the default bind is 127.0.0.1, where
requests for any other Host are refused (DNS-rebinding guard).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import MutableHeaders
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentopd.viewer import api, pages
from agentopd.viewer.runs import RunCatalog

__all__ = ["create_app", "serve"]

STATIC_DIR = Path(__file__).parent / "static"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class SecurityHeaders:
    """Pure ASGI middleware adding SECURITY_HEADERS to every response (no body buffering)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for k, v in SECURITY_HEADERS.items():
                    headers.setdefault(k, v)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(path: str | Path, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The viewer app for a run directory or a folder of run directories.

    `allowed_hosts`: Host header values accepted (None: any, as for tests and custom binds)."""
    app = FastAPI(
        title="agentopd trajectory viewer",
        description="Read-only view of agentopd runs: episodes (trajectories.db) and metrics (metrics.jsonl).",
        version="1",
        docs_url=None,  # Swagger UI and ReDoc load their scripts from a CDN: nothing may load from the internet
        redoc_url=None,
    )
    app.state.catalog = RunCatalog(path)
    app.include_router(api.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)

    app.add_middleware(SecurityHeaders)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith("/api/") or request.url.path.startswith("/static/"):
            return await http_exception_handler(request, exc)
        return pages.render(request, "error.html", exc.status_code, status=exc.status_code, detail=str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        if request.url.path.startswith("/api/"):
            return await request_validation_exception_handler(request, exc)
        problems = [f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return pages.render(request, "error.html", 400, status=400, detail="; ".join(problems))

    return app


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the viewer with uvicorn until interrupted; prints the URL first."""
    import uvicorn

    allowed = list(LOOPBACK_HOSTS) if host in LOOPBACK_HOSTS else None
    app = create_app(path, allowed_hosts=allowed)
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    print(f"agentopd viewer: http://{shown}:{port}/  (serving {app.state.catalog.root})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
