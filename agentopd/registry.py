"""Plugin discovery: environments and tools registered under entry points (DESIGN 3.3).

Groups: `agentopd.envs` (a gymnasium.Env subclass or a factory returning one) and
`agentopd.tools` (a typed tool function). The built-ins register through the same entry
points as third-party packages. A plugin that fails to load is recorded in `errors()` by
name with its error and skipped; it never breaks the others or the CLI.

    from agentopd.registry import envs, make_env, errors
    sorted(envs())                 # ['calculator', 'math', 'sql_db', ...]
    env = make_env("sql_db", db_path="my.db")
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

ENV_GROUP = "agentopd.envs"
TOOL_GROUP = "agentopd.tools"


@dataclass(frozen=True)
class Plugin:
    name: str
    group: str
    value: str  # "module:attr"
    package: str  # the distribution that declared it
    obj: Any = None  # the loaded object, or None when loading failed
    error: str | None = None


@cache
def _load(group: str) -> tuple[Plugin, ...]:
    found = []
    for ep in entry_points(group=group):
        package = ep.dist.name if ep.dist is not None else "?"
        try:
            found.append(Plugin(ep.name, group, ep.value, package, obj=ep.load()))
        except Exception as e:  # any import-time failure of a plugin is reported, not raised
            found.append(Plugin(ep.name, group, ep.value, package, error=f"{type(e).__name__}: {e}"))
    return tuple(found)


def plugins(group: str) -> dict[str, Plugin]:
    """Every plugin of a group, loaded or not, by name (first registration wins)."""
    out: dict[str, Plugin] = {}
    for p in _load(group):
        out.setdefault(p.name, p)
    return out


def envs() -> dict[str, Plugin]:
    return {n: p for n, p in plugins(ENV_GROUP).items() if p.error is None}


def tools() -> dict[str, Plugin]:
    return {n: p for n, p in plugins(TOOL_GROUP).items() if p.error is None}


def errors() -> list[Plugin]:
    """Plugins that failed to load, with their errors."""
    return [p for g in (ENV_GROUP, TOOL_GROUP) for p in plugins(g).values() if p.error is not None]


def make_env(name: str, **kwargs: Any):
    """Instantiate a registered environment. Unknown or broken names raise ValueError saying why."""
    found = plugins(ENV_GROUP)
    if name not in found:
        raise ValueError(f"unknown env {name!r}; installed: {sorted(envs())}")
    plugin = found[name]
    if plugin.error is not None:
        raise ValueError(f"env {name!r} from package {plugin.package} failed to load: {plugin.error}")
    return plugin.obj(**kwargs)


def refresh() -> None:
    """Forget what was discovered (after installing a plugin in the same process)."""
    _load.cache_clear()
