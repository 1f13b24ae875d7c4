"""Env kwargs checked against the env's own signature: `env.<key>=...` overrides, `envs.<source>.<key>`.

    resolve_kwargs(SqlDbEnv, {"max_turns": "4"})   # {"max_turns": 4, "db_path": None, ...}: defaults filled in

An env's kwargs are free-form in the config tree; its `__init__` (or factory) signature is their schema.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

YAML_SCALARS = (str, int, float, bool, type(None))


def resolve_kwargs(factory: Any, kwargs: dict[str, Any], prefix: str = "env") -> dict[str, Any]:
    """Check `kwargs` against `factory`'s signature and fill in its YAML-able defaults.

    Unknown keys raise ValueError listing the accepted ones; values that do not validate
    against the parameter's annotation raise ValueError naming `<prefix>.<key>` and the value.
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return dict(kwargs)
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = sorted(set(kwargs) - set(params))
    if unknown and not takes_any:
        raise ValueError(
            f"unknown key {prefix}.{unknown[0]} (value {kwargs[unknown[0]]!r}); "
            f"{_name(factory)} accepts: {', '.join(f'{prefix}.{n}' for n in params) or 'nothing'}"
        )
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # unresolvable annotations (forward refs to absent modules): check names only
        hints = {}
    out = dict(kwargs)
    for name, value in kwargs.items():
        if name in hints:
            try:
                checked = TypeAdapter(hints[name]).validate_python(value)
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"bad value for {prefix}.{name}: {value!r} ({err['msg']}; expected {_type_name(hints[name])})") from None
            if isinstance(checked, YAML_SCALARS):  # e.g. "1e-6" for a float becomes 1e-06
                out[name] = checked
    for name, p in params.items():
        if name not in out and p.default is not p.empty and _yaml_able(p.default):
            out[name] = p.default
    return out


def _yaml_able(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_yaml_able(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _yaml_able(v) for k, v in value.items())
    return isinstance(value, YAML_SCALARS)


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
