"""Seeded multi-step arithmetic word problems for the calculator env.

Each template draws its numbers from the generator and returns a `Problem`: the question,
the plan (1-3 `calculate` expressions; `{r0}`, `{r1}` stand for earlier tool results, so a
step really feeds the next), and the exact answer computed here with `Fraction` —
independently of the calculator tool, so an oracle earning reward 1 checks both.

    problems = generate(seed=0, split=Split.TRAIN, num=1000)

Train and eval are disjoint: every candidate question is assigned to a split by a stable
hash of its text (1 in `EVAL_EVERY` goes to eval), whatever the seed, so an eval question
never appears in any training set. Numbers are chosen so intermediate results are
terminating decimals (the chain of printed tool results stays exact).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction as F

import numpy as np

from agentopd.env import Split, seeded_rng

EVAL_EVERY = 10  # 1 in 10 candidate questions is held out for eval


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[str, ...]  # calculate() expressions; "{r0}" is the first step's printed result
    answer: F
    template: str
    split: Split  # TRAIN or EVAL


class _Draw:
    """Scalar draws from a numpy Generator (the one rng kind envs use)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def int(self, lo: int, hi: int, step: int = 1) -> int:
        """A uniform integer in {lo, lo+step, ..., <= hi}."""
        return lo + step * int(self.rng.integers((hi - lo) // step + 1))

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]


def money(x: F) -> str:
    """Dollars as written in a question and its expressions: 80, 2.50."""
    assert x >= 0 and (x * 100).denominator == 1, x
    cents = int(x * 100)
    return str(cents // 100) if cents % 100 == 0 else f"{cents // 100}.{cents % 100:02d}"


def num(x: F) -> str:
    """A non-money quantity: 3, 2.5."""
    assert (x * 1000).denominator == 1, x
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):g}"


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Maya",
         "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Vera", "Wen", "Yusuf", "Zoe")
ITEMS = ("notebooks", "pens", "apples", "mugs", "batteries", "candles", "socks", "tickets", "plates", "towels")
GOODS = ("jacket", "lamp", "bike helmet", "backpack", "kettle", "chair", "camera bag", "pair of boots")
VEHICLES = ("car", "bus", "truck", "train", "motorbike")
FOODS = ("flour", "sugar", "rice", "butter", "oats")


def shopping_total(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    name, (i1, i2) = d.pick(NAMES), d.rng.choice(len(ITEMS), 2, replace=False)
    a, b = d.int(2, 9), d.int(2, 9)
    p1, p2 = F(d.int(25, 1500, 25), 100), F(d.int(25, 1500, 25), 100)
    q = f"{name} buys {a} {ITEMS[i1]} at ${money(p1)} each and {b} {ITEMS[i2]} at ${money(p2)} each. How much is spent in total?"
    return q, (f"{a} * {money(p1)} + {b} * {money(p2)}",), a * p1 + b * p2


def make_change(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    name, item, note = d.pick(NAMES), d.pick(ITEMS), d.pick((20, 50, 100))
    a = d.int(2, 8)
    p = F(d.int(25, note * 100 // a - 25, 25), 100)
    q = f"{name} pays for {a} {item} at ${money(p)} each with a ${note} note. How much change is given?"
    return q, (f"{note} - {a} * {money(p)}",), note - a * p


def trip_distance(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    v = d.pick(VEHICLES)
    v1, v2 = d.int(30, 120), d.int(30, 120)
    t1, t2 = F(d.int(1, 12), 2), F(d.int(1, 12), 2)
    q = (f"A {v} travels at {v1} km/h for {num(t1)} hours and then at {v2} km/h for {num(t2)} hours. "
         "How many kilometers does it travel in total?")
    return q, (f"{v1} * {num(t1)} + {v2} * {num(t2)}",), v1 * t1 + v2 * t2


def recipe_scale(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    food, s1, s2 = d.pick(FOODS), d.int(2, 8), d.int(3, 30)
    per = d.int(10, 120, 5)
    g = per * s1
    q = f"A recipe for {s1} servings needs {g} grams of {food}. How many grams are needed for {s2} servings?"
    return q, (f"{g} / {s1} * {s2}",), F(g, s1) * s2


def savings_left(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    name, thing = d.pick(NAMES), d.pick(GOODS)
    s, m = d.int(20, 400, 5), d.int(2, 12)
    x = d.int(10, s * m - 5, 5)
    q = f"{name} saves ${s} every month for {m} months and then spends ${x} on a {thing}. How much money is left?"
    return q, (f"{s} * {m} - {x}",), F(s * m - x)


def discount_coupon(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    thing, price, pct = d.pick(GOODS), d.int(20, 400), d.pick((10, 15, 20, 25, 30, 40, 50))
    sale = price * F(100 - pct, 100)
    coupon = d.int(2, min(15, int(sale) - 1))
    q = (f"A {thing} costs ${price}. It is {pct}% off, and then a ${coupon} coupon is taken off the sale price. "
         "What is the final price?")
    return q, (f"{price} * (1 - {pct}/100)", f"{{r0}} - {coupon}"), sale - coupon


def split_bill(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    n, m, tip = d.int(2, 8), d.int(12, 60), d.pick((10, 15, 20, 25))
    bill = n * m
    q = (f"{n} friends share a dinner bill of ${bill} and add a {tip}% tip. They split the total equally. "
         "How much does each person pay?")
    return q, (f"{bill} * (1 + {tip}/100)", f"{{r0}} / {n}"), bill * F(100 + tip, 100) / n


def savings_growth(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    p, r1, r2 = d.int(100, 5000, 100), d.int(1, 9), d.int(1, 9)
    q = (f"A savings account holds ${p}. It earns {r1}% interest in the first year and {r2}% in the second year. "
         "How much is in the account after two years?")
    return q, (f"{p} * (1 + {r1}/100)", f"{{r0}} * (1 + {r2}/100)"), p * F(100 + r1, 100) * F(100 + r2, 100)


def fuel_cost(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    km, use, price = d.int(50, 900, 10), F(d.int(9, 19), 2), F(d.int(120, 240, 5), 100)
    q = (f"A trip is {km} km long. The car uses {num(use)} liters of fuel per 100 km and fuel costs "
         f"${money(price)} per liter. How much does the fuel for the trip cost?")
    return q, (f"{km} / 100 * {num(use)}", f"{{r0}} * {money(price)}"), F(km, 100) * use * price


def overtime_pay(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    name, h1, h2, wage = d.pick(NAMES), d.int(20, 40), d.int(1, 10), F(d.int(24, 80), 2)
    q = (f"{name} works {h1} hours at ${money(wage)} per hour and {h2} overtime hours at 1.5 times that rate. "
         "What are the total earnings?")
    return q, (f"{money(wage)} * 1.5", f"{h1} * {money(wage)} + {h2} * {{r0}}"), h1 * wage + h2 * wage * F(3, 2)


def unit_price(d: _Draw) -> tuple[str, tuple[str, ...], F]:
    item = d.pick(ITEMS)
    n1, n2 = sorted(int(x) for x in d.rng.choice((2, 3, 4, 5, 6, 8, 10, 12), 2, replace=False))
    u1 = d.int(30, 200)
    u2 = u1 - d.int(5, u1 - 20)
    p1, p2 = F(n1 * u1, 100), F(n2 * u2, 100)
    q = (f"A pack of {n1} {item} costs ${money(p1)} and a pack of {n2} costs ${money(p2)}. "
         "How many dollars cheaper per item is the bigger pack?")
    return q, (f"{money(p1)} / {n1}", f"{money(p2)} / {n2}", "{r0} - {r1}"), p1 / n1 - p2 / n2


TEMPLATES: dict[str, Callable[[_Draw], tuple[str, tuple[str, ...], F]]] = {
    f.__name__: f
    for f in (shopping_total, make_change, trip_distance, recipe_scale, savings_left, discount_coupon, split_bill,
              savings_growth, fuel_cost, overtime_pay, unit_price)
}
_NAMES = tuple(TEMPLATES)


def split_of(question: str) -> Split:
    """The split a question belongs to, fixed by its text (not by the seed)."""
    return Split.EVAL if zlib.crc32(question.encode()) % EVAL_EVERY == 0 else Split.TRAIN


def generate(seed: int, split: Split, num: int) -> list[Problem]:
    """`num` distinct problems of `split` (TRAIN, EVAL or ALL), in a seed-determined order.

    One candidate stream per seed: TRAIN keeps its train-split candidates, EVAL its eval
    ones, ALL both, so a problem has the same position (and id) whichever split is asked."""
    assert num >= 1, num
    draw, seen, out = _Draw(seeded_rng(seed)), set(), []
    for _ in range(200 * num + 10_000):  # generous; distinct questions are plentiful
        template = _NAMES[int(draw.rng.integers(len(_NAMES)))]
        question, steps, answer = TEMPLATES[template](draw)
        which = split_of(question)
        if question in seen or (split != Split.ALL and which != split):
            continue
        seen.add(question)
        out.append(Problem(question, steps, answer, template, which))
        if len(out) == num:
            return out
    raise AssertionError(f"could not draw {num} distinct {split} problems")
