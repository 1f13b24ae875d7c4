"""The main job through the CLI on tiny models: run directory and metric contracts (docs/design.md 3.5,
3.6), interrupt + --resume, local model folders as student/teacher, export and eval.

The embedded default is built at TINY_SPEC sizes into a temporary AGENTOPD_HOME (the real
sizes take minutes; `agentopd run` then finds them cached, exactly as after a first run).
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentopd.bootstrap import TINY_SPEC

SHORT = [
    "steps=2", "rollout.tasks_per_step=3", "rollout.n=2", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=4", "eval.every=1", "run.checkpoint_every=1", "trainer.lr=1e-3",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip
METRICS = [
    "loss", "grad_norm", "lr", "tool_mask/llm_tokens", "tool_mask/tool_tokens", "tool_mask/tool_ratio",
    "num_turns/min", "num_turns/max", "num_turns/mean", "kl/mean", "kl/turn_0", "tool/parse_error_rate",
    "reward/mean", "success_rate", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
]  # fmt: skip
EPISODE_COLUMNS = {
    "id", "step", "env", "task_id", "reward", "success", "num_turns", "stop_reason", "prompt_len",
    "token_ids", "response_mask", "logprobs", "turn_index", "teacher_logprobs", "messages",
}  # fmt: skip


@pytest.fixture(scope="module")
def home(tiny_home):
    return tiny_home


@pytest.mark.parametrize("env", ["sql_db", "calculator"])
def test_short_run_writes_the_run_directory_contract(cli, tmp_path, env):
    run = tmp_path / "run"
    result = cli("run", "--env", env, "--run-dir", run, *SHORT)
    assert result.exit_code == 0, result.output
    assert "student before" in result.output and "teacher" in result.output
    assert "points of held-out success" in result.output
    for name in ("config.yaml", "metrics.jsonl", "trajectories.db", "tb", "checkpoints", "final"):
        assert (run / name).exists(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2]
    first = next(r for r in records if "loss" in r)  # the teacher's pre-flight self-test (agentopd.step.selftest)
    assert first["teacher/selftest_signal"] > 0 and first["teacher/selftest_repeat_max_diff"] == 0.0  # CPU: bit-exact
    assert first["teacher/selftest_entropy_share"] < 0.95 and first["teacher/selftest_tokens"] > 0
    for key in METRICS:
        assert key in records[-1], key
    assert "eval/success_rate" in records[0] and "eval/teacher_success_rate" in records[0]
    tools = {"sql_db": ["sql_query"], "calculator": ["calculate"]}[env]  # the sql_db preset offers sql_query only
    for tool in tools:
        assert f"tool/{tool}/calls" in records[-1] and f"tool/{tool}/error_rate" in records[-1]
    db = sqlite3.connect(run / "trajectories.db")
    cols = {r[1] for r in db.execute("pragma table_info(episodes)")}
    assert EPISODE_COLUMNS <= cols
    n_train = db.execute("select count(*) from episodes where split='train'").fetchone()[0]
    assert n_train == 2 * 3 * 2
    assert db.execute("select count(*) from episodes where split='train' and teacher_logprobs is null").fetchone()[0] == 0
    # the exported student reloads and evaluates
    result = cli("eval", "--env", env, "--model", run / "final", "--num-tasks", "3", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["num_tasks"] == 3
    result = cli("check-tokens", run)
    assert result.exit_code == 0 and " 0 drifted" in result.output


def _start_run(home: Path, run: Path, steps: int) -> tuple[subprocess.Popen, dict]:
    """`agentopd run --env calculator` on the tiny models in a subprocess (so it can be sent SIGINT)."""
    env = {**os.environ, "AGENTOPD_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "agentopd.cli", "run", "--env", "calculator", "--run-dir", str(run), *SHORT, f"steps={steps}"]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), env


def _wait_for_step(run: Path, step: int, timeout_s: float = 240) -> None:
    metrics, deadline = run / "metrics.jsonl", time.time() + timeout_s
    while time.time() < deadline and not (metrics.exists() and f'"step": {step}' in metrics.read_text()):
        time.sleep(0.1)


def _resume(run: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentopd.cli", "run", "--env", "calculator", "--run-dir", str(run), "--resume"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_interrupt_and_resume_lose_and_duplicate_nothing(home, tmp_path):
    run = tmp_path / "run"
    proc, env = _start_run(home, run, steps=6)
    _wait_for_step(run, 3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "continue with --resume" in out
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*") if (p / "DONE").exists())
    assert ckpts, out
    done = _resume(run, env)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    db = sqlite3.connect(run / "trajectories.db")
    ids = [r[0] for r in db.execute("select id from episodes where split='train'")]
    assert len(ids) == len(set(ids)) == 6 * 3 * 2
    steps = sorted({r[0] for r in db.execute("select step from episodes where split='train'")})
    assert steps == [1, 2, 3, 4, 5, 6]


def test_local_model_folders_as_student_and_teacher(cli, home, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(home / "tokenizer")
    folders = {}
    for role, hidden in (("student", 32), ("teacher", 48)):
        model = Qwen3ForCausalLM(TINY_SPEC.student.size.__class__(hidden=hidden, layers=1, heads=2, kv_heads=1).config(tok))
        model.save_pretrained(tmp_path / role)
        tok.save_pretrained(tmp_path / role)
        folders[role] = tmp_path / role
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, f"student={folders['student']}",
                 f"teacher={folders['teacher']}", *SHORT, "teacher.selftest=false")  # fmt: skip  # random init: a uniform teacher
    assert result.exit_code == 0, result.output
    AutoModelForCausalLM.from_pretrained(run / "final")
    result = cli("export", run / "checkpoints" / "step_000001", tmp_path / "exported")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "exported" / "chat_template.jinja").exists()


@pytest.mark.parametrize("objective", ["sft", "opd"])
def test_evals_play_the_trained_student(cli, tmp_path, objective):
    """The episodes of the last eval were generated by the trained student: their sampler logprobs
    equal the exported final/ model's (objective=sft trains while the teacher plays, so the
    student's engine must be synced before it plays the eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, f"objective={objective}", *SHORT, "trainer.lr=5e-2")
    assert result.exit_code == 0, result.output
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    db = sqlite3.connect(run / "trajectories.db")
    rows = db.execute("select token_ids, response_mask, logprobs, prompt_len from episodes where split='eval' and step=2").fetchall()
    assert rows
    worst = 0.0
    for ids, mask, logprobs, prompt_len in rows:
        ids, mask, logprobs = json.loads(ids), json.loads(mask), json.loads(logprobs)
        with torch.no_grad():
            lp = torch.log_softmax(final(torch.tensor([ids])).logits[0].float(), -1)  # greedy evals: T = 1
        for j, (m, reported) in enumerate(zip(mask, logprobs)):
            if m:
                worst = max(worst, abs(lp[prompt_len + j - 1, ids[prompt_len + j]].item() - reported))
    assert worst < 1e-4, worst


@pytest.mark.parametrize(
    "args, message",
    [
        (["student=/no/such/folder"], "no such file or folder"),
        (["trainer.lr=-1"], "trainer.lr must be > 0"),
        (["rollout.nn=2"], "unknown key rollout.nn"),
        (["--resume"], "--resume needs --run-dir"),
    ],
)
def test_bad_input_is_one_line_error(cli, tmp_path, args, message):
    result = cli("run", "--env", "calculator", *args)
    assert result.exit_code == 2 and message in result.output, result.output


QUICK = ["steps=1", "rollout.tasks_per_step=2", "rollout.max_new_tokens=8", "rollout.max_turns=2", "eval.num_tasks=2",
         "teacher.selftest_oracle=false"]  # the tiny_home teachers are random (conftest)


@pytest.mark.parametrize(
    "args, message",
    [
        (["objective=grpo", "rollout.n=1"], "objective=grpo with rollout.n=1"),
        (["rollout.temperature=-1"], "rollout.temperature must be >= 0"),
        (["async.enabled=true"], "async.enabled=true needs run.backend=ray"),
        (["log.wandb=true"], "wandb is not installed"),
        (["engine.kind=vllm"], "vLLM is not installed"),
    ],
)
def test_refused_runs_leave_no_folder_and_print_no_run_directory(cli, tmp_path, monkeypatch, args, message):
    """Issue 55, items 1, 4, 5: each of these started (a run folder made, "run directory: ..." printed) and then trained
    nothing, died with a traceback, or failed leaving the folder behind. Now: one line, exit 2, nothing on disk."""
    from importlib.util import find_spec

    if "wandb" in message and find_spec("wandb") or "vLLM" in message and find_spec("vllm"):
        pytest.skip("the package is installed here")
    monkeypatch.chdir(tmp_path)
    result = cli("run", "--env", "calculator", *QUICK, *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "run directory" not in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(cli, tmp_path, monkeypatch):
    """Issue 55, item 5: a run failing after its folder was made (here its first eval) left the folder behind; it is
    removed, and said so. A folder that holds a logged step is kept (what a crash later in a run leaves to look at)."""
    from agentopd.runner import Runner

    def fail(self, *args, **kwargs):
        raise ValueError("the eval failed")

    monkeypatch.setattr(Runner, "_eval", fail)
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, *QUICK)
    assert result.exit_code == 2 and "the eval failed" in result.output, result.output
    assert f"run directory: {run}" in result.output and f"removed {run}: the run stopped before its first step" in result.output
    assert not run.exists()


def test_second_ctrl_c_stops_at_once_and_resume_still_works(home, tmp_path):
    run = tmp_path / "run"
    proc, env = _start_run(home, run, steps=5)
    _wait_for_step(run, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    # 130 when the second Ctrl-C lands in the step or the checkpoint; death by SIGINT when these tiny steps
    # already finished and it lands on the way out (either way the checkpoint is written and resume works)
    assert proc.returncode in (130, -signal.SIGINT), out
    done = _resume(run, env)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    db = sqlite3.connect(run / "trajectories.db")
    ids = [r[0] for r in db.execute("select id from episodes where split='train'")]
    assert len(ids) == len(set(ids)) == 5 * 3 * 2


def test_gain_line():
    from agentopd.cli import gain_line

    assert gain_line(0.09, 0.58, 0.61) == "student: +49 points of held-out success (94% of the gap to the teacher)"
    assert gain_line(0.30, 0.25, 0.80) == "student: -5 points of held-out success (-10% of the gap to the teacher)"
    assert gain_line(0.50, 0.55, 0.40) == "student: +5 points of held-out success (it started level with or above the teacher)"


def test_held_out_title_names_the_preset_run():
    """A sql_db_explore run's closing table said "sql_db: held-out success" (the env under the preset); it names
    the preset, however the user selected it, and a mixed run its envs."""
    from agentopd.cli import held_out_title
    from agentopd.config import load_config

    assert held_out_title(load_config("sql_db_explore"), 90, False) == "sql_db_explore: held-out success (1.5 min)"
    assert held_out_title(load_config("sql_db", overrides=["env.difficulty=[explore]"]), 60, True).startswith(
        "sql_db_explore: held-out success (1.0 min since the resume")
    assert held_out_title(load_config("sql_db"), 60, False).startswith("sql_db: ")
    assert held_out_title(load_config("calculator,sql_db"), 60, False).startswith("calculator,sql_db: ")


def test_each_checkpoint_is_written_once(cli, tmp_path, monkeypatch):
    """run.checkpoint_every=1 writes the last step's checkpoint in the loop; the end of the run does not write it again."""
    from agentopd.backends.local import LocalBackend

    written = []
    save = LocalBackend.save_checkpoint
    monkeypatch.setattr(LocalBackend, "save_checkpoint", lambda self, path, extra: (written.append(path.name), save(self, path, extra))[1])
    result = cli("run", "--env", "calculator", "--run-dir", tmp_path / "run", *SHORT)
    assert result.exit_code == 0, result.output
    assert written == ["step_000001", "step_000002"]


def test_eval_says_when_episodes_timed_out(cli):
    """Episodes out of rollout.episode_timeout_s are graded 0: eval says so (a 1.5B model on this CPU lost 31 of 50
    math episodes at the default 300 s and reported 34% where the model makes ~50%)."""
    ok = cli("eval", "--env", "calculator", "--model", "builtin:teacher", "--num-tasks", "3")
    assert ok.exit_code == 0 and "timed out" not in ok.output
    slow = cli("eval", "--env", "calculator", "--model", "builtin:teacher", "--num-tasks", "3", "rollout.episode_timeout_s=0.0001")
    assert slow.exit_code == 0, slow.output
    assert "3 of 3 episodes timed out (rollout.episode_timeout_s=0.0001, 3 at once)" in " ".join(slow.output.split())


def test_a_run_says_when_its_episodes_timed_out(cli, tmp_path):
    """Eval episodes out of time are named (graded 0); a step none of whose episodes got to a token stops the run in one
    line (it used to die inside the trainer: 'min() arg is an empty sequence')."""
    result = cli("run", "--env", "calculator", "--run-dir", tmp_path / "r", *SHORT, "steps=1", "rollout.episode_timeout_s=0.0001")
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "warning: the student's eval: 4 of 4 episodes timed out" in out
    assert ("error: step 1: none of its 6 episodes got to its first token (6 timeout): raise rollout.episode_timeout_s "
            "(now 0.0001 s) or lower rollout.concurrency (now 64)") in out
