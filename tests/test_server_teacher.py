"""ServerTeacher against a FAKE of vLLM's `/v1/completions` (fast, in the main suite; the real
vLLM server is tested in tests/test_vllm_real.py, marked `vllm`).

The fake is a small FastAPI app that runs a tiny random-init Qwen3 model (a plain forward,
not HFTeacher) and answers in the response shape of vLLM's CompletionResponse as read from
vLLM's sources (vllm/entrypoints/openai/completion/protocol.py and serving.py): per choice,
`prompt_logprobs` is a list with one entry per prompt token, entry 0 null, entry p a map
token_id -> {"logprob", "rank", "decoded_token"} holding the actual token p (any rank) plus
the top `prompt_logprobs` tokens, never at a temperature, -inf clamped to -9999.0; with
`return_token_ids` the choice echoes `prompt_token_ids`. It is served in-process through
httpx's ASGI transport and once over real HTTP with uvicorn on 127.0.0.1. The parsed
logprobs must equal HFTeacher's on the same model. A server restarted on its port (`Restart`): the client sends its
requests again on a new connection and names the reconnect (what a run's self-test re-checks, tests/test_selftest.py).
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd.teacher import HFTeacher, ServerTeacher, TeacherMode, parse_prompt_logprobs
from agentopd.types import TokenStream

VOCAB = 128


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, so a wrong position would show
    return model.eval()


def make_streams(n: int, seed: int) -> list[TokenStream]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len, mask = rng.randint(1, 5), [rng.choice([1, 1, 0]) for _ in range(rng.randint(1, 12))]
        ids = [rng.randrange(VOCAB) for _ in range(prompt_len + len(mask))]
        out.append(TokenStream(ids, prompt_len, mask, [-0.5 * m for m in mask], [0] * len(mask)))
    return out


def fake_vllm(model, max_logprobs: int = 20, corrupt_prompt: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    def completions(body: dict):
        ids = body["prompt"]
        k = body.get("prompt_logprobs")
        if k is not None and k > max_logprobs:
            return JSONResponse({"error": {"message": f"Requested prompt logprobs of {k}, max {max_logprobs}"}}, 400)
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        prompt_logprobs: list[dict | None] = [None]
        for p in range(1, len(ids)):
            row_V = logprobs_TV[p - 1]
            actual = ids[p]
            entry = {
                str(actual): {
                    "logprob": max(row_V[actual].item(), -9999.0),
                    "rank": int((row_V > row_V[actual]).sum()) + 1,
                    "decoded_token": f"t{actual}",
                }
            }
            if k:
                top = row_V.topk(k)
                for rank, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                    entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": f"t{i}"})
            prompt_logprobs.append(entry)
        nxt = int(logprobs_TV[-1].argmax())
        echoed = list(ids) if body.get("return_token_ids") else None
        if corrupt_prompt and echoed:
            echoed[-1] = (echoed[-1] + 1) % 128
        choice = {
            "index": 0, "text": f"t{nxt}", "logprobs": None, "finish_reason": "length", "stop_reason": None,
            "token_ids": [nxt] if echoed else None, "prompt_logprobs": prompt_logprobs, "prompt_token_ids": echoed,
        }
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model") or "tiny",
                "choices": [choice], "usage": usage}

    return app


def check_equal(server_scores, hf_scores, topk: bool):
    for a, b in zip(server_scores, hf_scores):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        if topk:
            assert a.topk_ids == b.topk_ids
            for x, y in zip(a.topk_logprobs, b.topk_logprobs):
                assert x == pytest.approx(y, abs=1e-4)


@pytest.mark.parametrize("mode", [TeacherMode.LOGPROBS, TeacherMode.TOPK])
def test_server_scores_equal_hf_teacher(mode):
    model = tiny_model()
    streams = make_streams(6, seed=5)
    server = ServerTeacher("http://fake", model="tiny", top_k=4, max_concurrency=3,
                           transport=httpx.ASGITransport(app=fake_vllm(model)))
    got = server.score(streams, mode=mode)
    want = HFTeacher(model, device="cpu", top_k=4).score(streams, mode=mode)
    check_equal(got, want, topk=mode is TeacherMode.TOPK)
    if mode is TeacherMode.LOGPROBS:
        assert all(s.topk_ids is None for s in got)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Uvicorn:
    """`app` served by uvicorn on `port` of 127.0.0.1 in a thread, from construction until `stop()`."""

    def __init__(self, app: FastAPI, port: int):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """`app` served by uvicorn on a free local port in a thread, until the block ends; yields its URL."""
    port = free_port()
    served = Uvicorn(app, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        served.stop()


class Restart:
    """A server that goes down and comes back with `then` on the same port. `Restart(first, then)` serves `first`;
    `restart()` stops it, and the next connection to the port is accepted and closed before any answer (a server going
    down under its client), after which `then` serves there. So a client sees the failure, whatever its timing."""

    def __init__(self, first: FastAPI, then: FastAPI):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.then = then
        self.served = Uvicorn(first, self.port)
        self.dropped = threading.Event()

    def restart(self) -> None:
        self.served.stop()
        down = socket.socket()
        down.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        down.bind(("127.0.0.1", self.port))
        down.listen()

        def drop_one_then_serve() -> None:
            connection, _ = down.accept()
            connection.close()
            down.close()
            self.dropped.set()
            self.served = Uvicorn(self.then, self.port)

        threading.Thread(target=drop_one_then_serve, daemon=True).start()

    def stop(self) -> None:
        self.served.stop()


def test_over_real_http_with_uvicorn():
    model = tiny_model()
    with serving(fake_vllm(model)) as url:
        streams = make_streams(4, seed=6)
        got = ServerTeacher(f"{url}/", top_k=3).score(streams, mode="topk")
        check_equal(got, HFTeacher(model, device="cpu", top_k=3).score(streams, mode="topk"), topk=True)


def test_a_restarted_server_is_reconnected_and_named():
    model, other = tiny_model(), tiny_model(seed=1)
    streams = make_streams(3, seed=8)
    server = Restart(fake_vllm(model), fake_vllm(other))
    try:
        teacher = ServerTeacher(server.url, top_k=3)
        check_equal(teacher.score(streams), HFTeacher(model, device="cpu").score(streams), topk=False)
        assert teacher.take_reconnects() == []
        server.restart()
        got = teacher.score(streams)  # its first connection is dropped: sent again, answered by the new server
        assert server.dropped.is_set()
        check_equal(got, HFTeacher(other, device="cpu").score(streams), topk=False)
        (reconnect,) = teacher.take_reconnects()  # the requests in flight each reconnected: one event
        assert re.fullmatch(rf"reconnect to {server.url} \(after (RemoteProtocolError|ReadError|ConnectError)\)", reconnect)
        assert teacher.take_reconnects() == []  # read once
        teacher.score(streams)
        assert teacher.take_reconnects() == []  # no failure, no reconnect
    finally:
        server.stop()
    gone = ServerTeacher(server.url, reconnect_s=0.6)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"teacher server http://127.0.0.1:\d+: unreachable for 0.6 s \(ConnectError"):
        gone.score(streams)
    assert time.perf_counter() - t0 < 5


def test_parse_a_hand_written_vllm_payload():
    # prompt [5, 7], response [9, 3, 2] with mask [1, 0, 1]; top-2 requested
    stream = TokenStream([5, 7, 9, 3, 2], 2, [1, 0, 1], [-0.5, 0.0, -0.1], [0, 0, 1])
    payload = [
        None,
        {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "b"}, "1": {"logprob": -0.2, "rank": 1, "decoded_token": "x"},
         "2": {"logprob": -1.9, "rank": 2, "decoded_token": "y"}},
        {"9": {"logprob": -0.3, "rank": 1, "decoded_token": "c"}, "4": {"logprob": -1.5, "rank": 2, "decoded_token": "z"}},
        {"3": {"logprob": -9999.0, "rank": 120, "decoded_token": "d"}, "0": {"logprob": -0.01, "rank": 1, "decoded_token": "w"},
         "8": {"logprob": -5.0, "rank": 2, "decoded_token": "v"}},
        {"2": {"logprob": -0.7, "rank": 2, "decoded_token": "e"}, "6": {"logprob": -0.6, "rank": 1, "decoded_token": "u"}},
    ]
    sc = parse_prompt_logprobs(payload, stream, top_k=2)
    assert sc.logprobs == [-0.3, 0.0, -0.7]  # entry prompt_len + i; masked token -> 0.0
    assert sc.topk_ids == [[9, 4], [0, 8], [6, 2]]  # the actual token only where it ranks in the top 2
    assert sc.topk_logprobs == [[-0.3, -1.5], [-0.01, -5.0], [-0.6, -0.7]]
    assert parse_prompt_logprobs(payload, stream, top_k=None).topk_ids is None
    with pytest.raises(ValueError, match="entries"):
        parse_prompt_logprobs(payload[:-1], stream, top_k=None)
    broken = [dict(e) if e else None for e in payload]
    del broken[2]["9"]
    with pytest.raises(ValueError, match="actual token 9"):
        parse_prompt_logprobs(broken, stream, top_k=None)


def test_refusals_and_server_errors():
    model = tiny_model()
    streams = make_streams(2, seed=7)
    with pytest.raises(ValueError, match="temperature"):
        ServerTeacher("http://fake", temperature=0.7)
    ok = ServerTeacher("http://fake", transport=httpx.ASGITransport(app=fake_vllm(model)), top_k=30)
    with pytest.raises(ValueError, match="hidden"):
        ok.score(streams, mode="hidden")
    with pytest.raises(RuntimeError, match="HTTP 400"):
        ok.score(streams, mode="topk")  # 30 > the server's max logprobs
    bad = ServerTeacher("http://fake", transport=httpx.ASGITransport(app=fake_vllm(model, corrupt_prompt=True)))
    with pytest.raises(RuntimeError, match="changed the prompt"):
        bad.score(streams)


def test_a_runs_teacher_reconnect_s_reaches_its_server_teacher():
    """teacher.reconnect_s: how long a run's server teacher keeps trying an unreachable server (issue 53)."""
    from agentopd.backends.stages import RunContext, build_teacher
    from agentopd.config import load_config
    from agentopd.policy import rollout_config, trainer_config
    from agentopd.teacher.server import RECONNECT_S

    for extra, want in (([], RECONNECT_S), (["teacher.reconnect_s=7.5"], 7.5)):
        cfg = load_config("calculator", overrides=["teacher=http://127.0.0.1:9", "trainer.loss=sampled_k1", "eval.teacher=false",
                                                 "rollout.temperature=1.0", *extra])
        ctx = RunContext(cfg, None, "student", {"teacher": cfg.teacher.path}, trainer_config(cfg), rollout_config(cfg))
        teacher = build_teacher(ctx, "teacher")
        assert isinstance(teacher, ServerTeacher) and teacher.reconnect_s == want
    with pytest.raises(ValueError, match="reconnect_s"):
        load_config("calculator", overrides=["teacher.reconnect_s=0"])


def test_one_failed_request_leaves_none_of_the_others_running():
    """A server teacher's requests are gathered so that the first failure cancels the rest before the client closes:
    a plain gather returned the error with the other requests still in flight (their retries, up to reconnect_s,
    went on behind the run's back)."""
    import asyncio

    slow_done: list[int] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        if len(body["prompt"]) == 3:  # the one stream that fails at once
            return JSONResponse({"error": {"message": "boom"}}, 500)
        await asyncio.sleep(0.5)
        slow_done.append(len(body["prompt"]))
        return JSONResponse({"error": {"message": "late"}}, 500)

    streams = [TokenStream(list(range(n)), 1, [1] * (n - 1), [0.0] * (n - 1), [0] * (n - 1)) for n in (3, 4, 5, 6)]
    teacher = ServerTeacher("http://fake", transport=httpx.ASGITransport(app=app))

    async def main() -> set[asyncio.Task]:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            await teacher.ascore(streams)
        left = {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}
        await asyncio.sleep(0.8)  # long enough for a request left running to finish
        return left

    left = asyncio.run(main())
    assert not left and not slow_done, (left, slow_done)
