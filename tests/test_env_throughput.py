"""benchmarks/env_throughput.py on installed plugin envs: an env it cannot drive is skipped with a line, not a crash."""

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("env_throughput", Path(__file__).parents[1] / "benchmarks" / "env_throughput.py")
env_throughput = sys.modules["env_throughput"] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up
_spec.loader.exec_module(env_throughput)


def test_an_env_without_an_oracle_is_a_value_error_the_benchmark_skips(demo_plugin):
    """Issue 55, item 7: a plugin env whose oracle raises NotImplementedError (ToolEnv's default) crashed the benchmark
    with a traceback; the benchmark skips envs on ValueError."""
    with pytest.raises(ValueError, match=r"faulty_env: has no oracle"):
        env_throughput.measure("faulty_env", 0.01, warmup_episodes=0, fail_in="oracle")
    assert env_throughput.measure("faulty_env", 0.01, warmup_episodes=0).episodes >= 10
