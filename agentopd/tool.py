"""Tools: typed Python functions the model can call.

A tool is a plain function (or a bound method) with type hints and a Google-style
docstring; its OpenAI-style JSON schema is generated from them by
`transformers.utils.get_json_schema`, never written by hand. A tool signals a problem the
model should see by raising `ToolError`; `invoke` turns that — and wrong arguments, and
any other exception — into an error string, so a bad call never escapes the agent loop.

    def calculate(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "(3 + 4) * 2".
        '''
    schema = tool_schema(calculate)
    result = invoke(calculate, {"expression": "1+1"})   # ToolResult(content="2", error=False)
"""

from __future__ import annotations

import copy
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from transformers.utils import get_json_schema

Tool = Callable[..., Any]


class ToolError(Exception):
    """Raised by a tool for a mistake the model made; the message is shown to the model."""


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool


def tool_name(tool: Tool) -> str:
    return tool.__name__


def _function(tool: Tool) -> Callable[..., Any]:
    """The plain function behind a tool (a bound method's schema is its function's, minus self)."""
    return getattr(tool, "__func__", tool)


@cache
def _schema(fn: Callable[..., Any], bound: bool) -> dict[str, Any]:
    schema = get_json_schema(fn)
    if bound:  # get_json_schema on the function sees `self`; drop it
        params = schema["function"].get("parameters", {})
        params.get("properties", {}).pop("self", None)
        if "required" in params:
            params["required"] = [r for r in params["required"] if r != "self"]
    return schema


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style schema `{"type": "function", "function": {...}}` of a tool (cached)."""
    return copy.deepcopy(_schema(_function(tool), hasattr(tool, "__func__")))


@cache
def _signature(fn: Callable[..., Any], bound: bool) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    params = dict(inspect.signature(fn).parameters)
    if bound:
        params.pop(next(iter(params)))
    return params, typing.get_type_hints(fn)


_JSON_TYPES: dict[type, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
}


def _check_arguments(tool: Tool, arguments: Any) -> dict[str, Any]:
    """Validate `arguments` against the tool's signature; raise ToolError naming the problem."""
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    params, hints = _signature(_function(tool), hasattr(tool, "__func__"))
    unknown = sorted(set(arguments) - set(params))
    if unknown:
        raise ToolError(f"unknown argument(s) {unknown}; {tool_name(tool)} takes {sorted(params) or 'no arguments'}")
    checked: dict[str, Any] = {}
    for name, p in params.items():
        if name not in arguments:
            if p.default is inspect.Parameter.empty:
                raise ToolError(f"missing required argument '{name}'")
            continue
        value = arguments[name]
        want = hints.get(name)
        allowed = _JSON_TYPES.get(want) if isinstance(want, type) else None
        if allowed is not None and (not isinstance(value, allowed) or (want is not bool and isinstance(value, bool))):
            raise ToolError(f"argument '{name}' must be {want.__name__}, got {type(value).__name__} {value!r:.80}")
        checked[name] = float(value) if want is float else value
    return checked


def invoke(tool: Tool, arguments: Any) -> ToolResult:
    """Call a tool with JSON arguments. Never raises: every failure is a ToolResult(error=True)."""
    try:
        kwargs = _check_arguments(tool, arguments)
        out = tool(**kwargs)
    except ToolError as e:
        return ToolResult(f"Error: {e}", error=True)
    except RecursionError:
        return ToolResult("Error: input is nested too deeply", error=True)
    except Exception as e:  # a tool bug must not end the episode; the model sees what happened
        return ToolResult(f"Error: {type(e).__name__}: {e}", error=True)
    return ToolResult(out if isinstance(out, str) else str(out), error=False)
