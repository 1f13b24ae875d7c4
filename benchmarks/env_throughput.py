"""Environment throughput: steps/s of each env driven by its oracle, on one CPU core.

    python benchmarks/env_throughput.py                   # sql_db, calculator, math + installed plugin envs
    python benchmarks/env_throughput.py --envs sql_db --seconds 5
    python benchmarks/env_throughput.py --write           # also writes benchmarks/results/env_throughput.md

A step is one `env.step(action)` call; every episode is `reset(seed=i)` then the oracle's
actions for that task (the oracle is computed before the clock starts for that episode,
since it is the policy's work, not the env's). Reported: steps/s counting step() time
only, steps/s including reset() time, episodes/s, and the ratio against the targets of
issue 2 (sql_db >= 2,000 steps/s, calculator >= 20,000 steps/s, counting reset time).
The process is pinned to one CPU (`os.sched_setaffinity`) where the OS allows it.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentopd import registry

TARGETS = {"sql_db": 2_000.0, "calculator": 20_000.0}  # steps/s on one core, oracle actions
BUILTINS = ("sql_db", "calculator", "math")
RESULTS = Path(__file__).parent / "results" / "env_throughput.md"


@dataclass
class Result:
    env: str
    episodes: int
    steps: int
    step_s: float  # time inside step()
    total_s: float  # step() + reset()

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.total_s

    @property
    def step_only_per_s(self) -> float:
        return self.steps / self.step_s

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.total_s


def pin_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity on this OS)"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def measure(name: str, seconds: float, warmup_episodes: int = 20, **env_kwargs: Any) -> Result:
    """Steps/s of env `name` driven by its oracle; ValueError for an env without one (it cannot be driven)."""
    env = registry.make_env(name, **env_kwargs)
    try:
        return _measure(name, env, seconds, warmup_episodes)
    finally:
        env.close()


def _measure(name: str, env: Any, seconds: float, warmup_episodes: int) -> Result:
    u = env.unwrapped
    if not callable(getattr(u, "oracle", None)) or not hasattr(u, "task"):
        raise ValueError(f"{name}: not a ToolEnv with an oracle(task) method; this benchmark plays each env's oracle")
    clock = time.perf_counter
    episodes = steps = 0
    step_s = total_s = 0.0
    seed = 0
    while total_s < seconds or episodes < 10:
        t0 = clock()
        env.reset(seed=seed)
        t_reset = clock() - t0
        try:
            actions = u.oracle(u.task)
        except NotImplementedError:  # ToolEnv's default: the env has no reference solutions
            raise ValueError(f"{name}: has no oracle (its oracle(task) raises NotImplementedError); this benchmark plays each env's oracle") from None
        reward, t_steps, n = 0.0, 0.0, 0
        for action in actions:
            t0 = clock()
            _, reward, terminated, truncated, _ = env.step(action)
            t_steps += clock() - t0
            n += 1
            if terminated or truncated:
                break
        if reward != 1.0:
            raise ValueError(f"{name}: the oracle failed on seed {seed} (reward {reward}); run `agentopd check-env {name}`")
        seed += 1
        if seed <= warmup_episodes:  # first episodes warm caches (schemas, SQLite pages)
            continue
        episodes, steps, step_s, total_s = episodes + 1, steps + n, step_s + t_steps, total_s + t_steps + t_reset
    return Result(name, episodes, steps, step_s, total_s)


def table(results: list[Result]) -> Table:
    t = Table(title="env throughput (oracle actions, one core)", title_justify="left")
    for col in ("env", "episodes", "steps/ep", "steps/s", "step()-only/s", "episodes/s", "target", "ratio"):
        t.add_column(col, justify="left" if col == "env" else "right")
    for r in results:
        target = TARGETS.get(r.env)
        ratio = f"{r.steps_per_s / target:.2f}x" if target else "-"
        t.add_row(
            r.env, f"{r.episodes:,}", f"{r.steps / r.episodes:.2f}", f"{r.steps_per_s:,.0f}",
            f"{r.step_only_per_s:,.0f}", f"{r.episodes_per_s:,.0f}", f"{target:,.0f}" if target else "-", ratio,
        )
    return t


def markdown(results: list[Result], pinning: str, seconds: float) -> str:
    lines = [
        "# Environment throughput",
        "",
        f"`python benchmarks/env_throughput.py --seconds {seconds:g} --write` on {platform.processor() or platform.machine()},"
        f" Python {platform.python_version()}, {pinning}, {os.cpu_count()} CPUs with load average {_load()}"
        " (a shared machine reads low). Oracle actions; steps/s counts step() and reset() time.",
        "",
        "| env | episodes | steps/ep | steps/s | step()-only/s | episodes/s | target | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        target = TARGETS.get(r.env)
        lines.append(
            f"| {r.env} | {r.episodes:,} | {r.steps / r.episodes:.2f} | {r.steps_per_s:,.0f} | {r.step_only_per_s:,.0f} |"
            f" {r.episodes_per_s:,.0f} | {f'{target:,.0f}' if target else '-'} | {f'{r.steps_per_s / target:.2f}x' if target else '-'} |"
        )
    return "\n".join(lines) + "\n"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="*", help="env names (default: sql_db, calculator, math and installed plugin envs)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per env")
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 110))  # the table needs ~105 columns
    pinning = pin_one_core()
    names = args.envs or [*[b for b in BUILTINS if b in registry.envs()], *sorted(set(registry.envs()) - set(BUILTINS))]
    for p in registry.errors():
        if p.group == registry.ENV_GROUP:
            console.print(f"[yellow]skipped {p.name} ({p.package}): {escape(p.error or '')}[/]")
    results = []
    for name in names:
        try:
            results.append(measure(name, args.seconds))
        except ValueError as e:  # an env whose oracle fails, or bad kwargs: say so, measure the rest
            console.print(f"[yellow]skipped {escape(str(e))}[/]")
            continue
        console.print(f"{name}: {results[-1].steps_per_s:,.0f} steps/s")
    console.print(table(results))
    console.print(pinning)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(markdown(results, pinning, args.seconds))
        console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
