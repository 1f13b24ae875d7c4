r"""Seeded arithmetic/algebra problems for the math env's default task set.

Each template draws its numbers and returns the problem, a short worked solution ending in
`\boxed{answer}` (the oracle's reply), and the answer in LaTeX (`5`, `-\frac{3}{4}`).

    problems = generate(seed=0, split=Split.EVAL, num=200)

Train and eval are disjoint by a stable hash of the problem text (1 in `EVAL_EVERY` is
eval), whatever the seed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from agentopd.env import Split, seeded_rng

EVAL_EVERY = 10


@dataclass(frozen=True)
class Problem:
    problem: str
    solution: str  # ends with \boxed{answer}
    answer: str
    template: str
    split: Split


def latex(x: Fraction | int) -> str:
    """A rational number in LaTeX: 5, -3, \\frac{23}{12}, -\\frac{3}{4}."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _signed(b: int) -> str:
    """' + 7' or ' - 7' for writing a term after another."""
    return f" + {b}" if b >= 0 else f" - {-b}"


Result = tuple[str, str, str]  # problem, solution (without the box), answer


def linear_equation(r: np.random.Generator) -> Result:
    a, x, b = int(r.integers(2, 13)), int(r.integers(-20, 21)), int(r.integers(-50, 51))
    c = a * x + b
    move = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    return (f"Solve for $x$: ${a}x{_signed(b)} = {c}$.", f"{move}: ${a}x = {c - b}$. Divide by {a}: $x = {x}$.", str(x))


def fraction_sum(r: np.random.Generator) -> Result:
    a, b, c, d = (int(v) for v in (r.integers(1, 10), r.integers(2, 13), r.integers(1, 10), r.integers(2, 13)))
    total, lcd = Fraction(a, b) + Fraction(c, d), math.lcm(b, d)
    return (
        f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ and simplify.",
        f"Over the common denominator {lcd}: $\\frac{{{a * lcd // b} + {c * lcd // d}}}{{{lcd}}} = {latex(total)}$.",
        latex(total),
    )


def order_of_operations(r: np.random.Generator) -> Result:
    a, b, c = int(r.integers(1, 50)), int(r.integers(2, 13)), int(r.integers(5, 30))
    d = int(r.integers(1, c))
    inner, prod = c - d, b * (c - d)
    return (
        f"Evaluate ${a} + {b} \\times ({c} - {d})$.",
        f"${c} - {d} = {inner}$, ${b} \\times {inner} = {prod}$, ${a} + {prod} = {a + prod}$.",
        str(a + prod),
    )


def percent_of(r: np.random.Generator) -> Result:
    p, n = 5 * int(r.integers(1, 40)), 20 * int(r.integers(1, 50))
    value = p * n // 100
    return f"What is ${p}\\%$ of ${n}$?", f"${p}\\%$ of ${n}$ is $\\frac{{{p}}}{{100}} \\times {n} = {value}$.", str(value)


def arithmetic_series(r: np.random.Generator) -> Result:
    a = int(r.integers(1, 30))
    b = a + int(r.integers(5, 80))
    k, total = b - a + 1, (a + b) * (b - a + 1) // 2
    return (
        f"What is the sum of the integers from ${a}$ to ${b}$ inclusive?",
        f"There are {k} terms, so the sum is $\\frac{{({a} + {b}) \\times {k}}}{{2}} = {total}$.",
        str(total),
    )


def least_common_multiple(r: np.random.Generator) -> Result:
    a, b = int(r.integers(4, 40)), int(r.integers(4, 40))
    g, lcm = math.gcd(a, b), math.lcm(a, b)
    return (
        f"What is the least common multiple of ${a}$ and ${b}$?",
        f"$\\gcd({a}, {b}) = {g}$, so the least common multiple is $\\frac{{{a} \\times {b}}}{{{g}}} = {lcm}$.",
        str(lcm),
    )


def difference_of_squares(r: np.random.Generator) -> Result:
    a = int(r.integers(10, 100))
    b = int(r.integers(1, a))
    return (
        f"Compute ${a}^2 - {b}^2$.",
        f"${a}^2 - {b}^2 = ({a} - {b})({a} + {b}) = {a - b} \\times {a + b} = {(a - b) * (a + b)}$.",
        str((a - b) * (a + b)),
    )


def two_equations(r: np.random.Generator) -> Result:
    x, y = int(r.integers(-30, 31)), int(r.integers(-30, 31))
    return (
        f"If $x + y = {x + y}$ and $x - y = {x - y}$, what is $x$?",
        f"Adding the equations gives $2x = {2 * x}$, so $x = {x}$.",
        str(x),
    )


TEMPLATES: dict[str, Callable[[np.random.Generator], Result]] = {
    f.__name__: f
    for f in (linear_equation, fraction_sum, order_of_operations, percent_of, arithmetic_series,
              least_common_multiple, difference_of_squares, two_equations)
}
_NAMES = tuple(TEMPLATES)


def split_of(problem: str) -> Split:
    return Split.EVAL if zlib.crc32(problem.encode()) % EVAL_EVERY == 0 else Split.TRAIN


def generate(seed: int, split: Split, num: int) -> list[Problem]:
    """`num` distinct problems of `split`; one candidate stream per seed (see calculator's)."""
    assert num >= 1, num
    rng, seen, out = seeded_rng(seed), set(), []
    for _ in range(200 * num + 10_000):
        template = _NAMES[int(rng.integers(len(_NAMES)))]
        problem, solution, answer = TEMPLATES[template](rng)
        which = split_of(problem)
        if problem in seen or (split != Split.ALL and which != split):
            continue
        seen.add(problem)
        out.append(Problem(problem, f"{solution} The answer is $\\boxed{{{answer}}}$.", answer, template, which))
        if len(out) == num:
            return out
    raise AssertionError(f"could not draw {num} distinct {split} problems")
