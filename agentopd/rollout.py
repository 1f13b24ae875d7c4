"""The agent loop: (environment, engine) -> Episode + exact TokenStream, many episodes in flight.

    rollout = Rollout(env_factory=lambda: make_env("sql_db"), engine=engine, tokenizer=tok,
                      config=RolloutConfig(max_turns=6, temperature=1.0))
    specs = rollout.specs_for(task_ids, n=4, step=3, seed=0)     # n samples per task, stable ids
    episodes = rollout.run_sync(specs, on_episode=lambda spec, ep: store.add(ep, spec.episode_id))

One episode: reset the env; render the prompt (StreamBuilder); then per turn: generate from
the stream's token ids (token-in/token-out), append the sampled ids verbatim, parse tool calls (in the
format of the model's family, `rollout.tool_format`, agentopd.chat.formats);
a malformed call becomes a parse-error observation the model sees (`Turn.parse_error`); valid
calls (or the final answer) go to `env.step` in a worker thread so other episodes keep
generating; observations are appended as template deltas with tool output capped in tokens.
`template_kwargs` (e.g. `enable_thinking=False`, also `rollout.enable_thinking=false`) go to every chat-template render of the episode and into
`info["template_kwargs"]`, so `agentopd check-tokens` re-renders it the same way.
An episode stops on an answer (`answer`), the turn limit (`max_turns`), the context or a
turn without room to generate (`length`), its wall-clock budget (`timeout`), or an engine/env
failure (`error`, kept for inspection). Episodes run concurrently under `asyncio`; the engine
batches whatever is waiting at the same moment.

A `guide` (optional; agentopd.recipes.intervene) sees each sampled turn before it counts and may put
another policy's turn from the same prefix in its place: that turn is played on (the env executes its
tool calls) with mask 0, and the student's turn is kept as a branch (`Episode.branches`); the turn's
index goes to `info["intervened_turns"]`, the length of the guide's span to `info["intervened_tokens"]`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from agentopd.aio import gather_or_cancel
from agentopd.chat import ContextFull, StreamBuilder, chat_template_of
from agentopd.chat.bare_calls import ToolParsing
from agentopd.chat.formats import HARMONY_STOPS, ToolFormat, detect_format, error_hint, parse_turn, resolve_format
from agentopd.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentopd.env import EnvError, ToolEnv
from agentopd.types import INTERVENED, INTERVENED_TOKENS, TEMPLATE_KWARGS, Episode, Message, StopReason, TokenStream, Turn

PARSE_ERROR_TOOL = "parse_error"


@dataclass(frozen=True)
class RolloutConfig:
    max_turns: int = 8
    max_context: int = 2048
    max_new_tokens: int = 256  # per assistant turn
    max_tool_tokens: int = 256  # tool output cap, in tokens, per tool message
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    episode_timeout_s: float = 300.0
    concurrency: int = 64  # episodes in flight at once
    tool_format: ToolFormat = ToolFormat.AUTO  # how the model writes tool calls; auto: from the chat template (agentopd.chat.formats)
    # lenient: in the hermes family, a turn that is bare or fenced JSON naming an offered tool is a call too, as real
    # instruct models (Qwen2.5) write them; strict: only <tool_call> blocks (agentopd.chat.bare_calls)
    tool_parsing: ToolParsing = ToolParsing.LENIENT
    enable_thinking: bool | None = None  # passed to the chat template when set (false: Qwen3/3.5 without reasoning)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context", "max_new_tokens", "max_tool_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.episode_timeout_s <= 0:
            raise ValueError(f"rollout.episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        try:  # the sampler's own rules (SamplingParams), named by their config keys
            SamplingParams(max_tokens=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        except ValueError as e:
            raise ValueError(f"rollout.{e}") from None
        if self.tool_parsing not in tuple(ToolParsing):
            raise ValueError(f"rollout.tool_parsing must be one of {[p.value for p in ToolParsing]}, got {self.tool_parsing!r}")
        object.__setattr__(self, "tool_parsing", ToolParsing(self.tool_parsing))


@dataclass(frozen=True)
class EpisodeSpec:
    """What to play: a task (by id), the env seed, which sample of the task, and a stable id."""

    task_id: str
    seed: int
    episode_id: str
    sample_index: int = 0
    step: int = 0
    split: str = "train"
    policy_version: int = 0


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_config: Any = None) -> tuple[int, ...]:
    """Ids that end an assistant turn: the template's `<|im_end|>` (a harmony template's `<|call|>` and `<|return|>`,
    not `<|end|>`, after which a turn goes on), the eos token(s), and the model's generation-config eos ids when known."""
    ids: list[int] = []
    harmony = detect_format(chat_template_of(tokenizer)) is ToolFormat.HARMONY
    for stop in HARMONY_STOPS if harmony else ("<|im_end|>",):
        stop_id = tokenizer.convert_tokens_to_ids(stop)
        if isinstance(stop_id, int) and stop_id != tokenizer.unk_token_id:
            ids.append(stop_id)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids.extend(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return tuple(dict.fromkeys(ids))


def _env_call(env: Any, method: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the env; whatever it raises becomes an EnvError naming the env and the method."""
    try:
        return fn(*args, **kwargs)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(getattr(env.unwrapped, "name", type(env.unwrapped).__name__), method, e) from e


def turn_seed(episode_seed: int, turn: int) -> int:
    """The sampling seed of an episode's assistant turn `turn` (0-based)."""
    return (episode_seed * 1_000_003 + turn) % (1 << 63)


class EnvPool:
    """Idle instances of one env factory, reused across episodes — and across phases when the caller keeps the pool
    (agentopd.backends.stages.Players keeps one per source and split): an env per episode cost up to 42 ms of host
    time each (the math env drew its 1,000 problems), during which no other episode's prompt reached the engine."""

    def __init__(self, factory: Callable[[], ToolEnv]) -> None:
        self.factory = factory
        self._idle: list[ToolEnv] = []
        self._lock = threading.Lock()  # taken from the env worker threads

    def take(self) -> ToolEnv:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self.factory()

    def give(self, env: ToolEnv) -> None:
        with self._lock:
            self._idle.append(env)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for env in idle:
            env.close()


class Guide(Protocol):
    """May replace a sampled turn with another policy's (see the module docstring)."""

    async def __call__(self, spec: EpisodeSpec, turn: int, request: GenerateRequest, result: GenerateResult) -> GenerateResult | None:
        """The turn to play instead of `result` (sampled for `request`, the episode's 0-based `turn`), or None to keep it."""
        ...


@dataclass
class _Live:
    """An episode while it runs (kept outside the coroutine so a timeout can still build it)."""

    spec: EpisodeSpec
    env_name: str
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    bare_tools: frozenset[str] = frozenset()  # offered tools whose bare JSON calls count (rollout.tool_parsing=lenient)
    turns: list[Turn] = field(default_factory=list)
    builder: StreamBuilder | None = None
    reward: float = 0.0
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    branches: list[TokenStream] = field(default_factory=list)

    def replace(self, prefix: Sequence[int], rejected: GenerateResult, taken: GenerateResult) -> None:
        """A guide put `taken` in place of the student's next turn: the student's becomes a branch (the prefix as
        prompt, the rejected turn mask 1); info records the turn and the length of the guide's span."""
        turn, n = len(self.turns), len(rejected.token_ids)
        self.branches.append(TokenStream([*prefix, *rejected.token_ids], len(prefix), [1] * n, list(rejected.logprobs), [turn] * n))
        self.info.setdefault(INTERVENED, []).append(turn)
        self.info.setdefault(INTERVENED_TOKENS, []).append(len(taken.token_ids))

    def finish(self, stop: StopReason) -> Episode:
        return Episode(
            env=self.env_name,
            task_id=self.spec.task_id,
            messages=self.messages,
            tools=self.tools,
            turns=self.turns,
            reward=self.reward,
            success=self.success,
            stop_reason=stop,
            tokens=self.builder.build() if self.builder is not None else None,
            step=self.spec.step,
            sample_index=self.spec.sample_index,
            policy_version=self.spec.policy_version,
            info=self.info,
            branches=self.branches,
        )


class Rollout:
    """Plays episodes of one environment with one engine (see the module docstring)."""

    def __init__(
        self,
        env_factory: Callable[[], ToolEnv] | EnvPool,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig = RolloutConfig(),
        *,
        stop_ids: Sequence[int] | None = None,
        env_workers: int = 4,
        guide: Guide | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self._owns_envs = not isinstance(env_factory, EnvPool)  # a pool the caller passed outlives this rollout
        self.envs = EnvPool(env_factory) if self._owns_envs else env_factory
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
        if not self.stop_ids:
            raise ValueError("the tokenizer has no <|im_end|> or eos token: pass stop_ids")
        self._pool = ThreadPoolExecutor(max_workers=env_workers, thread_name_prefix="env")
        self.env_name = ""
        self.guide = guide
        self.template_kwargs = dict(template_kwargs or {})  # chat-template options (enable_thinking=False), kept in info
        if config.enable_thinking is not None:
            self.template_kwargs.setdefault("enable_thinking", config.enable_thinking)
        self.tool_format = resolve_format(config.tool_format, chat_template_of(tokenizer))

    # ---- planning ---------------------------------------------------------------------
    @staticmethod
    def specs_for(
        task_ids: Sequence[str], *, n: int = 1, step: int = 0, seed: int = 0, split: str = "train", policy_version: int = 0
    ) -> list[EpisodeSpec]:
        """n samples of each task; ids `<split>-<step>-<slot>` are stable, so a re-run replaces, never duplicates."""
        specs = []
        for i, task_id in enumerate(task_ids):
            for k in range(n):
                slot = i * n + k
                specs.append(
                    EpisodeSpec(
                        task_id=str(task_id),
                        seed=seed * 1_000_003 + step * 10_007 + slot,
                        episode_id=f"{split}-{step:06d}-{slot:05d}",
                        sample_index=k,
                        step=step,
                        split=split,
                        policy_version=policy_version,
                    )
                )
        return specs

    # ---- running ----------------------------------------------------------------------
    def run_sync(self, specs: Sequence[EpisodeSpec], on_episode: Callable[[EpisodeSpec, Episode], None] | None = None) -> list[Episode]:
        return asyncio.run(self.run(specs, on_episode))

    async def run(
        self, specs: Sequence[EpisodeSpec], on_episode: Callable[[EpisodeSpec, Episode], None] | None = None
    ) -> list[Episode]:
        """Play every spec, `concurrency` at a time; `on_episode` is called as each one finishes."""
        gate = asyncio.Semaphore(self.config.concurrency)

        async def one(spec: EpisodeSpec) -> Episode:
            async with gate:
                episode = await self.play(spec)
            if on_episode is not None:
                on_episode(spec, episode)
            return episode

        return await gather_or_cancel([one(s) for s in specs])

    async def play(self, spec: EpisodeSpec) -> Episode:
        env = await asyncio.get_running_loop().run_in_executor(self._pool, self.envs.take)  # a new env's set-up off the loop
        self.env_name = getattr(env, "name", type(env).__name__)
        live = _Live(spec, self.env_name)
        try:
            stop = await asyncio.wait_for(self._play(env, live), self.config.episode_timeout_s)
        except TimeoutError:
            stop = StopReason.TIMEOUT
            env = None  # its state is mid-step in a worker; don't reuse it
        except EnvError:
            raise  # the env itself failed (not the model): the run stops and names it
        except (ContextFull, ValueError, RuntimeError) as e:
            live.info["error"] = f"{type(e).__name__}: {e}"
            stop = StopReason.ERROR
        finally:
            self.engine.release(spec.episode_id)
        if env is not None:
            self.envs.give(env)
        return live.finish(stop)

    async def _step(self, env: ToolEnv, action: dict[str, Any]) -> tuple:
        return await asyncio.get_running_loop().run_in_executor(self._pool, _env_call, env, "step", env.step, action)

    async def _play(self, env: ToolEnv, live: _Live) -> StopReason:
        cfg = self.config
        loop = asyncio.get_running_loop()
        options = {"task_id": live.spec.task_id}
        obs, info = await loop.run_in_executor(
            self._pool, lambda: _env_call(env, f"reset(task {live.spec.task_id!r})", env.reset, seed=live.spec.seed, options=options)
        )
        live.tools = info.get("tools", [])
        if cfg.tool_parsing is ToolParsing.LENIENT:
            live.bare_tools = frozenset(t["function"]["name"] for t in live.tools if "function" in t)
        live.messages = [Message.from_dict(m) for m in obs]
        live.builder = b = StreamBuilder(
            self.tokenizer, obs, live.tools or None, max_context=cfg.max_context, max_tool_tokens=cfg.max_tool_tokens,
            template_kwargs=self.template_kwargs,
        )
        if self.template_kwargs:
            live.info[TEMPLATE_KWARGS] = dict(self.template_kwargs)
        params = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, stop_token_ids=self.stop_ids)
        while True:
            if not b.can_generate():
                return StopReason.LENGTH
            budget = min(cfg.max_new_tokens, b.remaining_context())
            # each turn's draws come from its own seed (a function of the episode's seed and the turn), not
            # from the engine's private stream: a resumed run samples exactly what an uninterrupted one did
            sampling = SamplingParams(max_tokens=budget, seed=turn_seed(live.spec.seed, len(live.turns)), **params)
            request = GenerateRequest(b.token_ids, sampling, live.spec.episode_id)
            result = await self.engine.generate(request)
            if result.finish_reason == FinishReason.ABORT:
                raise RuntimeError("the engine aborted the request")
            result, student = await self._guided(live, request, result)
            raw = b.add_assistant(result.token_ids, result.logprobs, result.finish_reason == FinishReason.STOP, student=student)
            parsed = parse_turn(raw, self.tool_format, bare_tools=live.bare_tools)
            assistant = Message("assistant", parsed.content, list(parsed.tool_calls))
            turn = Turn(assistant, [], raw_text=raw)
            live.turns.append(turn)
            live.messages.append(assistant)  # parsed; the sampled text is turn.raw_text
            out_of_room = result.finish_reason == FinishReason.LENGTH and budget < cfg.max_new_tokens
            if parsed.errors and not parsed.tool_calls:
                turn.parse_error = True
                observation = [_parse_error_message(parsed.errors, self.tool_format)]
            else:
                action = {"role": "assistant", "content": parsed.content, "tool_calls": [c.to_dict() for c in parsed.tool_calls]}
                if out_of_room:  # the turn was cut by the context, not finished: don't grade it
                    return StopReason.LENGTH
                obs, reward, terminated, truncated, info = await self._step(env, action)
                turn.reward = float(reward)
                turn.tool_errors = int(info.get("tool_errors", 0))
                turn.tool_calls = dict(info.get("tool_calls", {}))
                turn.tool_call_errors = dict(info.get("tool_call_errors", {}))
                if terminated:
                    live.reward = float(reward)
                    live.success = bool(info.get("success", reward >= 1.0))
                    return StopReason.ANSWER
                observation = list(obs)
                if parsed.errors:
                    turn.parse_error = True
                    observation.append(_parse_error_message(parsed.errors, self.tool_format))
                if truncated:
                    return StopReason.MAX_TURNS
            if out_of_room:
                return StopReason.LENGTH
            if len(live.turns) >= cfg.max_turns:
                return StopReason.MAX_TURNS
            try:
                seg = b.add_observation(observation)
            except ContextFull:
                return StopReason.LENGTH
            turn.observation = [Message.from_dict(m) for m in seg.messages]
            live.messages.extend(turn.observation)

    async def _guided(self, live: _Live, request: GenerateRequest, result: GenerateResult) -> tuple[GenerateResult, bool]:
        """The turn to play (the student's, or the guide's in its place) and whether it is the student's."""
        if self.guide is None:
            return result, True
        taken = await self.guide(live.spec, len(live.turns), request, result)
        if taken is None:
            return result, True
        live.replace(request.token_ids, result, taken)
        return taken, False

    def close(self) -> None:
        if self._owns_envs:
            self.envs.close()
        self._pool.shutdown(wait=True)


def _parse_error_message(errors: Sequence[str], fmt: ToolFormat = ToolFormat.HERMES) -> dict[str, Any]:
    text = "; ".join(errors)
    return {"role": "tool", "name": PARSE_ERROR_TOOL, "content": f"Error: could not parse your tool call: {text}. {error_hint(fmt)}"}
