"""The viewer's JSON API (described by /openapi.json, listed at /api-docs); the pages mirror it.

    GET /api/runs                                  runs under the served path (RunInfo list)
    GET /api/runs/{run}                            one RunInfo
    GET /api/runs/{run}/episodes?env=&success=...  EpisodePage (keyset page, filters as EpisodeQuery)
    GET /api/runs/{run}/episodes/{episode_id}      the episode: every column, JSON arrays parsed,
                                                   plus turn_kl, prev_id, next_id
    GET /api/runs/{run}/metrics                    metrics.jsonl rows (non-finite numbers -> null)
"""

from __future__ import annotations

import math
import sqlite3
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from agentopd.viewer.detail import decode_row
from agentopd.viewer.queries import EpisodePage, EpisodeQuery, EpisodeSummary, episode_row, list_episodes, neighbours, run_stats
from agentopd.viewer.runs import Run, RunCatalog, RunNotFound, finite

router = APIRouter(prefix="/api", tags=["api"])


class RunInfo(BaseModel):
    name: str
    env: str | None = Field(None, description="from config.yaml, else the last step's episodes")
    last_step: int | None = Field(None, description="highest step in metrics.jsonl or trajectories.db")
    episodes: int = 0
    splits: dict[str, int] = Field(default_factory=dict, description="episodes per split")
    started_at: float | None = Field(None, description="unix time of the first episode or metrics row")
    success_rate: float | None = Field(None, description="last success_rate in metrics.jsonl")
    eval_success_rate: float | None = Field(None, description="last eval/success_rate in metrics.jsonl")
    has_trajectories: bool
    has_metrics: bool
    has_tokenizer: bool


class EpisodeDetail(EpisodeSummary):
    """Every column of the `episodes` row (docs/design.md 3.5), JSON arrays parsed."""

    model_config = ConfigDict(extra="allow")

    prompt_len: int | None = None
    token_ids: list[int] | None = None
    response_mask: list[int] | None = None
    logprobs: list[float | None] | None = None
    turn_index: list[int] | None = None
    teacher_logprobs: list[float | None] | None = Field(None, description="null until the teacher scored it")
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: list[dict[str, Any]] | None = None
    info: dict[str, Any] | None = None
    turn_kl: list[float | None] = Field(
        default_factory=list, description="per assistant turn: mean of logprobs - teacher_logprobs over its student tokens"
    )
    prev_id: str | None = Field(None, description="previous episode in (step, id) order")
    next_id: str | None = Field(None, description="next episode in (step, id) order")


class MetricsRows(BaseModel):
    run: str
    rows: list[dict[str, Any]] = Field(description="one object per metrics.jsonl line, each with `step`")


def catalog(request: Request) -> RunCatalog:
    return request.app.state.catalog


def get_run(request: Request, name: str) -> Run:
    try:
        return catalog(request).get(name)
    except RunNotFound:
        raise HTTPException(404, f"no run named {name!r}") from None


def last_value(rows: list[dict[str, Any]], key: str) -> float | None:
    for r in reversed(rows):
        if (v := finite(r.get(key))) is not None:
            return v
    return None


def run_info(run: Run) -> RunInfo:
    rows = run.metrics()
    info = RunInfo(
        name=run.name,
        env=run.config_env(),
        has_trajectories=run.has_db,
        has_metrics=bool(rows) or run.dir.metrics.is_file(),
        has_tokenizer=run.dir.tokenizer_dir() is not None,
        success_rate=last_value(rows, "success_rate"),
        eval_success_rate=last_value(rows, "eval/success_rate"),
    )
    steps = [r["step"] for r in rows]
    with run.connect() as conn:
        if conn is not None:
            stats = run_stats(conn)
            info.episodes, info.splits, info.started_at = stats.episodes, stats.splits, stats.started_at
            if stats.last_step is not None:
                steps.append(stats.last_step)
            if info.env is None and stats.envs:
                info.env = ", ".join(stats.envs)
    info.last_step = max(steps) if steps else None
    if info.started_at is None and rows:
        info.started_at = finite(rows[0].get("time", rows[0].get("timestamp")))
    return info


def episode_detail(conn: sqlite3.Connection, episode_id: str) -> dict[str, Any]:
    row = episode_row(conn, episode_id)
    if row is None:
        raise HTTPException(404, f"no episode {episode_id!r}")
    data = decode_row(row)
    data["prev_id"], data["next_id"] = neighbours(conn, data["step"], episode_id)
    return data


def page_of(run: Run, q: EpisodeQuery) -> EpisodePage:
    with run.connect() as conn:
        if conn is None:
            return EpisodePage(items=[], matches=0, matches_capped=False)
        try:
            return list_episodes(conn, q)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


@router.get("/runs", response_model=list[RunInfo])
def api_runs(request: Request) -> list[RunInfo]:
    cat = catalog(request)
    return [run_info(cat.get(name)) for name in cat.names()]


@router.get("/runs/{run}", response_model=RunInfo, responses={404: {"description": "unknown run"}})
def api_run(request: Request, run: str) -> RunInfo:
    return run_info(get_run(request, run))


@router.get("/runs/{run}/episodes", response_model=EpisodePage, responses={404: {"description": "unknown run"}})
def api_episodes(request: Request, run: str, q: Annotated[EpisodeQuery, Query()]) -> EpisodePage:
    return page_of(get_run(request, run), q)


@router.get(
    "/runs/{run}/episodes/{episode_id}",
    response_model=EpisodeDetail,
    responses={404: {"description": "unknown run or episode"}},
)
def api_episode(request: Request, run: str, episode_id: str) -> dict[str, Any]:
    with get_run(request, run).connect() as conn:
        if conn is None:
            raise HTTPException(404, f"run {run!r} has no trajectories")
        return episode_detail(conn, episode_id)


@router.get("/runs/{run}/metrics", response_model=MetricsRows, responses={404: {"description": "unknown run"}})
def api_metrics(request: Request, run: str) -> MetricsRows:
    r = get_run(request, run)
    return MetricsRows(run=r.name, rows=_json_safe(r.metrics()))
