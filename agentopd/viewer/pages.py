"""The viewer's HTML pages (server-rendered, usable without JavaScript).

    GET /                                   runs index
    GET /runs/{run}                         run summary: SVG charts, latest metrics, counts
    GET /runs/{run}/episodes?...            episode list: filters + keyset pages (EpisodeQuery)
    GET /runs/{run}/episodes/{episode_id}   episode replay: turns, tool calls, token view, KL

Templates live in `templates/` and are rendered with autoescaping on: model and tool text
is only ever inserted as escaped text.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import jinja2
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from agentopd.types import StopReason
from agentopd.viewer.api import catalog, episode_detail, get_run, page_of, run_info
from agentopd.viewer.charts import kl_heatmap, line_chart, turn_bars
from agentopd.viewer.detail import LEVELS, build_view
from agentopd.viewer.queries import EpisodeQuery

router = APIRouter(include_in_schema=False)
TEMPLATES_DIR = Path(__file__).parent / "templates"


def run_url(run: str, *parts: Any, **query: Any) -> str:
    """/runs/<run>/<parts...>?<query>, every segment percent-encoded."""
    path = "/runs/" + quote(run, safe="") + "".join("/" + quote(str(p), safe="") for p in parts)
    query = {k: v for k, v in query.items() if v is not None}
    return path + ("?" + urlencode(query) if query else "")


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "–"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def make_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(run_url=run_url, quote=quote, levels=LEVELS, stop_reasons=[str(s) for s in StopReason])
    env.filters.update(fmt=fmt, fmt_time=fmt_time)
    return Jinja2Templates(env=env)


templates = make_templates()


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=status_code)


@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    cat = catalog(request)
    runs = [run_info(cat.get(name)) for name in cat.names()]
    return render(request, "index.html", runs=runs, root=str(cat.root))


CHARTS = (
    ("loss", ["loss"]),
    ("kl/mean", ["kl/mean"]),
    ("success", ["success_rate", "eval/success_rate", "eval/teacher_success_rate"]),
    ("reward/mean", ["reward/mean"]),
)


SELFTEST = "teacher/selftest_"


def teacher_selftest(rows: list[dict[str, Any]]) -> tuple[int, list[tuple[str, Any]], list[tuple[int, float]]] | None:
    """The teacher's pre-flight self-test (its step, its teacher/selftest_* values) and each later re-check (step,
    largest difference), from metrics.jsonl rows; None for a run without one (agentopd.step.selftest)."""
    first = next((r for r in rows if f"{SELFTEST}signal" in r), None)
    if first is None:
        return None
    values = sorted((k.removeprefix(SELFTEST), v) for k, v in first.items() if k.startswith(SELFTEST) and "recheck" not in k)
    rechecks = [(r["step"], r[f"{SELFTEST}recheck_max_diff"]) for r in rows if f"{SELFTEST}recheck_max_diff" in r]
    return first["step"], values, rechecks


@router.get("/runs/{run}", response_class=HTMLResponse)
def run_page(request: Request, run: str) -> HTMLResponse:
    r = get_run(request, run)
    info = run_info(r)
    rows = r.metrics()
    charts = [line_chart(rows, names, title) for title, names in CHARTS]
    latest = sorted((rows[-1] if rows else {}).items())
    selftest = teacher_selftest(rows)
    return render(
        request,
        "run.html",
        run=info,
        charts=charts,
        heatmap=kl_heatmap(rows),
        latest=latest,
        selftest=selftest,
        latest_step=rows[-1]["step"] if rows else None,
        n_rows=len(rows),
    )


@router.get("/runs/{run}/episodes", response_class=HTMLResponse)
def episodes_page(request: Request, run: str, q: Annotated[EpisodeQuery, Query()]) -> HTMLResponse:
    r = get_run(request, run)
    page = page_of(r, q)
    return render(request, "episodes.html", run=r.name, q=q, filters=q.filters(), page=page)


@router.get("/runs/{run}/episodes/{episode_id}", response_class=HTMLResponse)
def episode_page(request: Request, run: str, episode_id: str) -> HTMLResponse:
    r = get_run(request, run)
    with r.connect() as conn:
        if conn is None:
            raise HTTPException(404, f"run {run!r} has no trajectories")
        data = episode_detail(conn, episode_id)
    view = build_view(data, r.decoder())
    return render(request, "episode.html", run=r.name, ep=view, d=data, bars=turn_bars(data["turn_kl"]))


@router.get("/api-docs", response_class=HTMLResponse)
def api_docs(request: Request) -> HTMLResponse:
    """The JSON API from the app's OpenAPI schema, listed without any external script."""
    schema = request.app.openapi()
    endpoints = []
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            params = [(p["name"], p.get("in", ""), (p.get("schema") or {}).get("description") or p.get("description") or "")
                      for p in op.get("parameters", [])]
            endpoints.append((method.upper(), path, op.get("summary", ""), params))
    return render(request, "api_docs.html", endpoints=endpoints)
