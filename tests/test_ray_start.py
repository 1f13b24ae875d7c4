"""How a run starts its own local Ray cluster (agentopd.backends.ray.start_ray): what it prints."""

import os
import subprocess
import sys

import pytest

START = """
import ray
from agentopd.backends.ray import start_ray
start_ray(ray, None, num_cpus=1, num_gpus=0)
ray.shutdown()
"""


@pytest.mark.ray
def test_a_local_cluster_starts_without_the_token_auth_warning(tmp_path):
    """Issue 55, item 7: every backend=ray run printed Ray's 'Token authentication is enabled for this Ray cluster'
    warning (Ray's default for a cluster it starts; a newcomer has no RAY_AUTH_MODE set). A fresh HOME: the token
    Ray writes stays in it."""
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")} | {"HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Token authentication is enabled" not in done.stderr, done.stderr[-2000:]
