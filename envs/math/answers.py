r"""Final-answer extraction and matching for the math env.

    last_boxed(r"so x = \boxed{\frac{1}{2}}.")   # '\\frac{1}{2}'
    answers_match(r"\dfrac{1}{2}", "0.5")         # True
    answers_match(r"\text{(B)}", "(B)")           # True

Extraction: the content of the last `\boxed{...}` (or `\fbox{...}`; nested braces handled;
`\boxed 5` without braces also read), or, for a custom format, group 1 of the last match
of a regex with exactly one group (e.g. `r"Answer:\s*(\S+)"`).

Normalisation (`normalize`): drop `$`, `\left`/`\right`, spacing commands (`\!`, `\,`,
`\;`, `\:`), `\displaystyle`, degrees (`^\circ`), percent signs, all whitespace, a trailing
period and a leading `x =`; unwrap `\text{..}`, `\textbf{..}`, `\mathrm{..}`, `\mbox{..}`;
`\dfrac`/`\tfrac` -> `\frac`; `\frac{a}{b}` -> `(a)/(b)`, `\frac12` -> `(1)/(2)`;
`\sqrt{x}` -> `sqrt(x)`; `\cdot`/`\times` -> `*`; thousands separators (`1,000`, `1{,}000`).

Match: the normalised strings are equal, or both evaluate (with the safe evaluator of
`tools.calculator`, `^` read as `**`, braces as parentheses) to numbers within
1e-6 * max(1, |expected|). An extracted answer over `MAX_ANSWER_CHARS` never matches.
"""

from __future__ import annotations

import re
from fractions import Fraction

from agentopd.tool import ToolError
from tools.calculator import evaluate

TOLERANCE = Fraction(1, 10**6)
BOXED = "boxed"
MAX_ANSWER_CHARS = 1000  # a longer extracted answer never matches (keeps grading linear-time)

_UNWRAP = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[!,;:]|\^\s*\{?\s*\\circ\s*\}?|\\%|%|\$|\s+")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\d+)")
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))")
_LEADING_VAR = re.compile(r"^[a-zA-Z]=(?=[^=])")


def _group(s: str, start: int) -> int | None:
    """Index just past the brace group opening at s[start] == '{', or None if unbalanced."""
    depth = 0
    for i in range(start, len(s)):
        c = s[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` / `\fbox{...}` in `text`, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = start + (6 if text.startswith("\\boxed", start) else 5)
    i = after
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _group(text, i)
        return text[i + 1 : end - 1] if end is not None else None
    token = re.match(r"[^\s$]+", text[i:]) if i > after else None  # "\boxed 5"
    return token.group(0) if token else None


def extract(text: str, pattern: re.Pattern[str] | None) -> str | None:
    """The final answer stated in `text`: the last boxed content, or the regex's group 1."""
    if pattern is None:
        return last_boxed(text)
    found = None
    for found in pattern.finditer(text):
        pass
    return found.group(1) if found is not None else None


def _replace_command(s: str, command: str, fmt: str, groups: int) -> str:
    """Rewrite `\\command{a}{b}` (brace groups matched properly) with fmt.format(a, b)."""
    while (start := s.find(command + "{")) >= 0:
        args, i = [], start + len(command)
        for _ in range(groups):
            if i >= len(s) or s[i] != "{" or (end := _group(s, i)) is None:
                return s  # malformed: leave as is
            args.append(s[i + 1 : end - 1])
            i = end
        s = s[:start] + fmt.format(*args) + s[i:]
    return s


def normalize(answer: str) -> str:
    s = str(answer).strip()
    for _ in range(3):
        s = _UNWRAP.sub(r"\1", s)
    s = _DROP.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"(\1)/(\2)", s)
    s = _SQRT_SHORT.sub(r"sqrt(\1)", s)
    s = _replace_command(s, "\\frac", "({0})/({1})", 2)
    s = _replace_command(s, "\\sqrt", "sqrt({0})", 1)
    s = s.replace("\\cdot", "*").replace("\\times", "*")
    s = _THOUSANDS.sub("", s).rstrip(".")
    return _LEADING_VAR.sub("", s)


def numeric(normalized: str) -> Fraction | None:
    """The value of a normalised answer if it is plain arithmetic, else None."""
    if not normalized or len(normalized) > 200:
        return None
    try:
        value, _ = evaluate(normalized.replace("{", "(").replace("}", ")").replace("^", "**"))
    except ToolError:
        return None
    return Fraction(value)


def answers_match(given: str | None, expected: str) -> bool:
    if given is None or len(given) > MAX_ANSWER_CHARS:
        return False
    g, e = normalize(given), normalize(expected)
    if g == e:
        return bool(g)
    vg, ve = numeric(g), numeric(e)
    return vg is not None and ve is not None and abs(vg - ve) <= TOLERANCE * max(1, abs(ve))
