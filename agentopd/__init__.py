"""agentopd: on-policy distillation of multi-turn, tool-using LLM agents.

    import agentopd
    env = agentopd.make_env("sql_db")      # any env registered under the `agentopd.envs` entry points
"""

from agentopd.registry import make_env

__all__ = ["make_env"]
__version__ = "0.1.0"
