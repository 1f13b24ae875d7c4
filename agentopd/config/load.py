"""Presets and dotted overrides: where a config's values come from, before validation.

    data = read_yaml(preset_dir() / "sql_db.yaml")
    data = apply_overrides(data, ["env.max_turns=4", "lr=1e-6"])   # YAML 1.2 values; shorthands expanded
    cfg = validate(data)                                            # agentopd.config.schema.Config
    cfg = load_config("sql_db", overrides=[...])                    # all three

A preset is `configs/<env>.yaml`; `--config FILE` replaces it; an env without one (a plugin's) starts from
`configs/defaults/embedded.yaml`; overrides that select a variant of an env (VARIANTS) start from its preset.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agentopd.config.schema import KEY_RE, Config

# YAML 1.2 floats PyYAML (YAML 1.1) reads as strings: "1e-6", "2E3", "1.e5".
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


# --- dotted overrides -------------------------------------------------------------------------
def parse_value(raw: str) -> Any:
    """A command-line value as a YAML scalar (or flow list/map), YAML 1.2 style for exponent floats."""
    if _FLOAT_RE.fullmatch(raw.strip()):
        return float(raw)
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"cannot parse value {raw!r}: {str(e).splitlines()[0]}") from None


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`"a.b=c"` -> `(("a", "b"), value)`; a shorthand key (`env=x`) expands per `Config.SHORTHANDS`."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form key=value (e.g. env.max_turns=4)")
    key = Config.SHORTHANDS.get(key, key)
    parts = tuple(key.split("."))
    if not all(KEY_RE.fullmatch(p) for p in parts):
        raise ValueError(f"override {text!r}: {key!r} is not a dotted key (e.g. trainer.lr)")
    try:
        return parts, parse_value(raw)
    except ValueError as e:
        raise ValueError(f"override {key}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply dotted overrides to a nested dict (a copy is returned; intermediate maps are created)."""
    out = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"cannot set {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    return {k: _deep_copy(v) for k, v in d.items()} if isinstance(d, dict) else d


# --- presets and loading ----------------------------------------------------------------------
# presets of a built-in env other than its own (configs/<name>.yaml): name -> (env, the env kwargs that select it).
# `--env sql_db env.difficulty=[explore]` starts from configs/sql_db_explore.yaml as `--env sql_db_explore` does:
# the embedded models it gets (agentopd.bootstrap) were built for that preset's tools, turns and lengths
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"sql_db_explore": ("sql_db", {"difficulty": ["explore"]})}


def variant_of(env_name: str, env_kwargs: dict[str, Any] | None) -> str:
    """The preset of a run of `env_name` with these env kwargs: a variant's (VARIANTS) when they select it,
    else the env's own name."""
    for name, (env, selects) in VARIANTS.items():
        if env == env_name and env_kwargs is not None and all(env_kwargs.get(k) in (v, *v) for k, v in selects.items()):
            return name
    return env_name


def preset_dir() -> Path:
    """Where the shipped presets live (the `configs` package)."""
    return Path(str(files("configs")))


def presets() -> list[str]:
    """Names of the shipped presets (`configs/<name>.yaml`)."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def mixed_preset(env_names: str) -> dict[str, Any]:
    """`sql_db,calculator`: each env's preset `env` section becomes a source of `envs` (weight 1);
    the other sections come from the presets merged in order (a later one fills what is unset). Each env's
    episodes are scored by its own teacher; the full-vocabulary losses apply each sample's teacher's lm_head."""
    names = [n.strip() for n in env_names.split(",")]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--env {env_names!r}: give distinct env names separated by commas, e.g. sql_db,calculator")
    data: dict[str, Any] = {"envs": {}}
    for name in names:
        preset = read_yaml(preset_dir() / f"{name}.yaml") if (preset_dir() / f"{name}.yaml").is_file() else {}
        env = dict(preset.pop("env", None) or {})
        env.pop("name", None)
        data["envs"][name] = {"name": name, "weight": 1.0, **env}
        for section, values in preset.items():
            if isinstance(values, dict):
                data[section] = {**values, **data.get(section, {})}
            else:
                data.setdefault(section, values)
    data["env"] = {"name": ",".join(names)}
    return data


def validate(data: dict[str, Any]) -> Config:
    """Build a Config from a nested dict; every problem becomes one ValueError naming its dotted key."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ValueError("; ".join(_describe(err) for err in e.errors())) from None


def load_config(env_name: str | None, config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve a config: preset for `env_name` (or `config_file`), then `overrides`, then validation."""
    if config_file is not None:
        data = read_yaml(config_file)
        file_env = (data.get("env") or {}).get("name") if isinstance(data.get("env"), dict) else None
        if env_name is not None and file_env is not None and file_env != env_name:
            raise ValueError(f"config file {str(config_file)!r} is for env {file_env!r}, but the env asked for is {env_name!r}")
    elif env_name is not None and "," in env_name:
        data = mixed_preset(env_name)
    elif env_name is not None and (preset_dir() / f"{env_name}.yaml").is_file():
        data = read_yaml(preset_dir() / f"{env_name}.yaml")
        env = apply_overrides(data, overrides).get("env")
        if (variant := variant_of(env_name, env if isinstance(env, dict) else None)) != env_name:
            data = read_yaml(preset_dir() / f"{variant}.yaml")  # the overrides select a variant: its preset
    elif env_name is not None:  # an env without a preset of its own (a plugin's): the embedded-default recipe
        data = read_yaml(preset_dir() / "defaults" / "embedded.yaml")
    else:
        raise ValueError("no env given: pass an env name or a config file with env.name")
    if env_name is not None and not (isinstance(data.get("envs"), dict) and data["envs"] and "env" not in data):
        data.setdefault("env", {})
        if isinstance(data["env"], dict):
            data["env"].setdefault("name", env_name)
    return validate(apply_overrides(data, overrides))


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "value_error":  # our own validators already name the key and value
        return str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(err["loc"][:-1])
        return f"unknown key {key} (value {err['input']!r}); {'.'.join(map(str, err['loc'][:-1])) or 'the config'} accepts: {allowed}"
    if err["type"] == "missing":
        return f"missing key {key}"
    return f"bad value for {key}: {err['input']!r} ({err['msg']})"


def _fields_at(loc: tuple[Any, ...]) -> str:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return "?"
        model = field.annotation
    prefix = "".join(f"{p}." for p in loc)
    return ", ".join(prefix + n for n in model.model_fields)
