"""Plugin discovery: environments and tools registered under entry points (docs/design.md 3.3).

Groups: `agentopd.envs` (a gymnasium.Env subclass or a factory returning one) and
`agentopd.tools` (a typed tool function, or a class whose methods are tools: those named
in its `TOOLS` attribute, else its public documented methods; e.g. `tools.sql:SqlDatabase`
-> sql_query, list_tables, describe_table). The built-ins register through the same entry
points as third-party packages. A plugin that fails to load is recorded in `errors()` by
name with its error and skipped; it never breaks the others or the CLI.

    from agentopd.registry import envs, make_env, errors
    sorted(envs())                 # ['calculator', 'math', 'sql_db', ...]
    env = make_env("sql_db", db_path="my.db")
    [(t.name, t.package) for t in tool_entries()]   # every tool, classes expanded to methods
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gymnasium

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
            obj = ep.load()
            if group == TOOL_GROUP:
                tool_functions(obj)  # a class with a bad TOOLS list fails here, as a plugin error
            found.append(Plugin(ep.name, group, ep.value, package, obj=obj))
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


def env_factory(name: str) -> Callable[..., gymnasium.Env]:
    """The class or factory registered as env `name`. Unknown or broken names raise ValueError saying why."""
    found = plugins(ENV_GROUP)
    if name not in found:
        raise ValueError(f"unknown env {name!r}; installed: {', '.join(sorted(envs())) or 'none'}")
    plugin = found[name]
    if plugin.error is not None:
        raise ValueError(f"env {name!r} from package {plugin.package} failed to load: {plugin.error}")
    return plugin.obj


def make_env(name: str, **kwargs: Any) -> gymnasium.Env:
    """Instantiate a registered environment. Unknown or broken names raise ValueError saying why; an
    env whose constructor raises is an EnvError (a ValueError) naming the env and the error."""
    from agentopd.env import EnvError

    factory = env_factory(name)
    try:
        return factory(**kwargs)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(name, f"{getattr(factory, '__qualname__', name)}({_kwargs_text(kwargs)})", e) from e


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return text if len(text) <= 120 else text[:117] + "..."


def describe(obj: Any) -> str:
    """The first line of an object's own docstring, else of its module's ('' when neither has one)."""
    doc = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)  # a class: not its base's docstring
    if not (doc or "").strip():
        doc = getattr(sys.modules.get(getattr(obj, "__module__", "") or ""), "__doc__", None)
    doc = inspect.cleandoc(doc or "")
    return doc.splitlines()[0] if doc else ""


def tool_functions(obj: Any) -> list[Callable[..., Any]]:
    """The tools an `agentopd.tools` entry point provides: the function itself, or for a class
    the methods named in its `TOOLS` attribute when it has one, else its public methods with
    docstrings (in definition order, base classes first)."""
    if not inspect.isclass(obj):
        return [obj]
    if hasattr(obj, "TOOLS"):
        missing = [n for n in obj.TOOLS if not callable(getattr(obj, n, None))]
        if missing:
            raise ValueError(f"{obj.__qualname__}.TOOLS names methods it does not have: {missing}")
        return [getattr(obj, n) for n in obj.TOOLS]
    seen: dict[str, Callable[..., Any]] = {}
    for klass in reversed(obj.__mro__[:-1]):
        for name, member in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(member) and inspect.getdoc(member):
                seen[name] = member
    return list(seen.values())


@dataclass(frozen=True)
class ToolEntry:
    """One tool as `agentopd tools` lists it."""

    name: str
    plugin: Plugin  # the entry point that provided it
    fn: Callable[..., Any]

    @property
    def package(self) -> str:
        return self.plugin.package

    @property
    def description(self) -> str:
        return describe(self.fn)


def tool_entries() -> list[ToolEntry]:
    """Every tool from the loaded `agentopd.tools` plugins, classes expanded to their methods."""
    return [ToolEntry(fn.__name__, p, fn) for p in tools().values() for fn in tool_functions(p.obj)]


def refresh() -> None:
    """Forget what was discovered (after installing a plugin in the same process)."""
    _load.cache_clear()
