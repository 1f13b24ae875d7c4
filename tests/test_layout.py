"""The dependency direction of docs/design.md 4, checked on the source: a forbidden import anywhere in a
module (top level or inside a function; `if TYPE_CHECKING:` blocks excepted, they never run),
directly or through the modules it imports, fails here with the chain that reaches it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agentopd", "envs", "tools")

# (importer prefix, forbidden prefix, why)
RULES = [
    ("agentopd.backends", "agentopd.bootstrap", "backends know no bootstrap (the runner resolves models)"),
    ("agentopd.engines", "agentopd.rollout", "engines know no agent loop"),
    ("agentopd.trainer", "agentopd.rollout", "the trainer knows no agent loop (it sees batches)"),
    ("agentopd.trainer", "agentopd.env", "the trainer knows no environment"),
    ("agentopd.trainer", "envs", "the trainer knows no environment"),
    ("envs", "agentopd.engines", "environments know no engine"),
    ("envs", "agentopd.trainer", "environments know no trainer"),
    ("envs", "torch", "environments know no model"),
    ("tools", "agentopd.engines", "tools know no engine"),
    ("tools", "torch", "tools know no model"),
    ("agentopd.viewer", "torch", "the viewer loads no model"),
    ("agentopd.viewer", "agentopd.trainer", "the viewer loads no model"),
    ("agentopd.types", "agentopd.", "types depend on nothing above them"),
    ("agentopd.backends", "agentopd.runner", "backends do not call back into the runner"),
    ("agentopd.teacher", "agentopd.trainer", "the teacher knows no trainer (shared compute sits below both: agentopd.attention, agentopd.prefix)"),
    ("agentopd.recipes", "agentopd.backends", "recipes know no backend (a backend builds them from the run's settings)"),
    ("agentopd.teacher", "agentopd.engines", "the teacher knows no engine (what both need sits below them: agentopd.kinds)"),
    ("agentopd.trainer", "agentopd.engines", "the trainer knows no engine (sampled_vocab: agentopd.kinds)"),
    ("agentopd.config", "agentopd.backends", "the config tree knows no backend (the enums it needs: agentopd.kinds)"),
    ("agentopd.policy", "agentopd.config", "the run policy reads a Config it is given, it imports no config module (no cycle)"),
    ("agentopd.routing", "agentopd.bootstrap", "routing looks teachers up, it builds none (the bootstrap stage: agentopd.run_models)"),
    ("agentopd.routing", "agentopd.models", "routing looks teachers up, it loads no model"),
    ("agentopd.kinds", "agentopd.", "the shared modes depend on nothing above them"),
    ("agentopd.shape", "agentopd.", "a model's shape depends on nothing above it"),
    ("agentopd.step", "agentopd.runner", "the stages do not call back into the runner"),
    ("agentopd.recipes", "agentopd.runner", "recipes do not call back into the runner"),
    ("agentopd.recipes", "agentopd.step", "recipes change stages through their hooks, they import no stage"),
]
# the parts below the runner take typed settings from it: none reads the config tree (agentopd.config) or the run
# policy (agentopd.policy: trainer_config, loss_temperature, check_run)
BELOW_RUNNER = (
    "agentopd.engines", "agentopd.teacher", "agentopd.trainer", "agentopd.losses", "agentopd.batch",
    "agentopd.rollout", "agentopd.backends", "envs", "tools",
)  # fmt: skip
RULES += [(m, "agentopd.config", "below the runner nothing reads the config tree") for m in BELOW_RUNNER]
RULES += [(m, "agentopd.policy", "below the runner nothing reads the run policy") for m in BELOW_RUNNER]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, name: str, known: set[str] | None = None) -> set[str]:
    """Every module `path` imports when it runs (absolute names; TYPE_CHECKING blocks skipped). With
    `known` (the package's modules), `from pkg import module` counts as importing pkg.module alone."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import module` imports pkg.module; `from module import name` imports module
                names = {f"{base}.{a.name}" for a in child.names}
                subs = names & (known or set())
                out.update(subs if subs == names else subs | {base})
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    return {name: imports_of(path, name, known) for name, path in files.items()}, known


def _matches(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def reaches(graph: dict[str, set[str]], known: set[str], start: str, forbidden: str) -> list[str] | None:
    """The import chain from `start` to a module matching `forbidden`, or None."""
    seen, stack = {start}, [(start, [start])]
    while stack:
        mod, chain = stack.pop()
        for dep in graph.get(mod, ()):
            if _matches(dep, forbidden):
                return [*chain, dep]
            if dep in known and dep not in seen:
                seen.add(dep)
                stack.append((dep, [*chain, dep]))
    return None


@pytest.mark.parametrize("importer, forbidden, why", RULES, ids=[f"{a}-x-{b}" for a, b, _ in RULES])
def test_dependency_direction(graph, importer, forbidden, why):
    g, known = graph
    for module in sorted(m for m in known if _matches(m, importer)):
        chain = reaches(g, known, module, forbidden)
        assert chain is None, f"{why}: {' -> '.join(chain)}"


def test_the_rule_checker_sees_a_forbidden_edge(tmp_path):
    """The checker itself: a synthetic chain a -> b -> forbidden is reported with its path."""
    g = {"agentopd.backends.x": {"agentopd.models"}, "agentopd.models": {"agentopd.bootstrap"}}
    assert reaches(g, set(g), "agentopd.backends.x", "agentopd.bootstrap") == ["agentopd.backends.x", "agentopd.models", "agentopd.bootstrap"]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\ndef f():\n    from agentopd import rollout\n")
    assert imports_of(src, "agentopd.m", {"agentopd", "agentopd.rollout"}) == {"typing", "agentopd.rollout"}


def test_tests_import_their_helpers_as_ci_runs_them():
    """CI runs the README's bare `pytest` (no `python -m`): the checkout's root is not on sys.path there and tests/ is no
    package, so `from tests.x import y` works under `python -m pytest` and fails in CI (it did: test_overlap.py,
    2026-11-30). Helpers are imported by module name (`from _tiny import ...`), as pytest puts tests/ on the path."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
                offenders.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "tests"]
    assert not offenders, "imports that fail under CI's bare pytest:\n" + "\n".join(offenders)
