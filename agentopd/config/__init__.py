"""The config tree: typed sections (schema.py), presets and dotted overrides (load.py), env kwargs checked
against the env's signature (envargs.py). One scheme for every command. A config is resolved in three layers:

    1. the preset `configs/<env>.yaml` (or the file given with `--config`, which replaces it);
       an env without a preset (a plugin's) starts from `configs/defaults/embedded.yaml`; overrides that
       select a variant of the env (VARIANTS: `env.difficulty=[explore]` on sql_db) start from its preset,
    2. dotted overrides `a.b=c` on top, each value parsed as a YAML scalar
       (`env.max_turns=4` -> 4, `env.tasks=my.jsonl` -> "my.jsonl", `x=null` -> None,
       `lr=1e-6` -> 1e-06: YAML 1.2 numbers, which PyYAML alone would leave as strings),
    3. validation against the typed tree: unknown keys and bad values raise ValueError
       naming the full dotted key and the bad value; then the run policy (agentopd.policy) judges
       the sections together.

    cfg = load_config("sql_db", overrides=["env.max_turns=4", "run.seed=1"])
    cfg.env.name, cfg.env.kwargs        # "sql_db", {"max_turns": 4, ...}
    cfg.to_yaml("runs/x/config.yaml")   # the fully resolved config

What the settings imply together (the trainer's loss and temperature, which recipes combine) is the run
policy, agentopd.policy, not this package.
"""

from agentopd.config.envargs import resolve_kwargs
from agentopd.config.load import (
    VARIANTS,
    apply_overrides,
    load_config,
    mixed_preset,
    parse_override,
    parse_value,
    preset_dir,
    presets,
    read_yaml,
    validate,
    variant_of,
)
from agentopd.config.schema import (
    AsyncConfig,
    Config,
    EmbeddedConfig,
    EmbeddedSize,
    EngineConfig,
    EnvConfig,
    EnvEntry,
    EvalConfig,
    LogConfig,
    MixConfig,
    RayConfig,
    RecipeConfig,
    RunConfig,
    Section,
    StudentConfig,
    TeacherConfig,
    VLLMOptions,
)

__all__ = [
    "VARIANTS", "AsyncConfig", "Config", "EmbeddedConfig", "EmbeddedSize", "EngineConfig", "EnvConfig", "EnvEntry", "EvalConfig", "LogConfig", "MixConfig",
    "RayConfig", "RecipeConfig", "RunConfig", "Section", "StudentConfig", "TeacherConfig", "VLLMOptions",
    "apply_overrides", "load_config", "mixed_preset", "parse_override", "parse_value", "preset_dir", "presets",
    "read_yaml", "resolve_kwargs", "validate", "variant_of",
]  # fmt: skip
