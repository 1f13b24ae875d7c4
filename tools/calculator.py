"""The `calculate` tool: exact, safe arithmetic for agents.

    from tools.calculator import calculate
    calculate("3 * 2.50 + 2 * 1.25")    # '10'
    calculate("80 * (1 - 15/100)")      # '68'
    calculate("1/8")                    # '0.125'
    calculate("2/3")                    # '0.666666666667'
    calculate("sqrt(2)")                # '1.41421356237'
    calculate("9**9**9")                # raises ToolError: result too large

How it works. The expression is parsed with `ast.parse(mode="eval")` and evaluated by
walking the tree; nothing is ever passed to eval/exec, and only these nodes are allowed:
numbers (int and decimal literals, `1e3`, `1_000`), `+ - * / // % **` with Python's
precedence, unary `+`/`-`, parentheses, and the functions `abs(x)`, `round(x[, n])`
(half away from zero), `floor(x)`, `ceil(x)`, `min(...)`, `max(...)`, `sqrt(x)`.

Numbers are exact: integers stay integers and every other value is a `fractions.Fraction`
(decimal literals are read from their text, so 0.1 is 1/10). Only `sqrt` and fractional
powers of non-perfect powers are approximated (with floats); such a result is marked
inexact. Output: an exact integer as an integer; an exact terminating decimal with at most
`MAX_PLACES` places exactly (`0.125`); anything else rounded to `SIG_DIGITS` significant
digits (fixed-point, or scientific notation below 1e-6 and from 1e15).

Refusals (a `ToolError` whose message the model sees) — the tool never hangs and never
raises anything else: empty input, more than `MAX_CHARS` characters, non-ASCII, syntax
errors, nesting deeper than `MAX_DEPTH`, names/attributes/calls outside the whitelist,
division or modulo by zero, fractional powers (and sqrt) of negative numbers, and any
value (intermediate or final) whose magnitude or exact denominator reaches `10**MAX_DIGITS`. Powers are sized *before* computing, so
`9**9**9`, `2**(2**30)` and `10**-10**10` are refused instantly.
"""

from __future__ import annotations

import ast
import math
from decimal import ROUND_HALF_EVEN, Context, Decimal
from fractions import Fraction

from agentopd.tool import ToolError

MAX_CHARS = 500  # longest accepted expression
MAX_DEPTH = 100  # deepest accepted expression tree (a sum of 100 terms is 100 deep)
MAX_DIGITS = 100  # every value's |numerator| and denominator stay below 10**MAX_DIGITS
MAX_PLACES = 20  # exact terminating decimals up to this many places are printed exactly
SIG_DIGITS = 12  # everything else is rounded to this many significant digits
MAX_ARGS = 50  # most arguments to min/max

LIMIT = 10**MAX_DIGITS
_LIMIT_BITS = LIMIT.bit_length()
_LIMIT_LOG10 = float(MAX_DIGITS)
_CTX = Context(prec=SIG_DIGITS, rounding=ROUND_HALF_EVEN)
FUNCTIONS = ("abs", "round", "floor", "ceil", "min", "max", "sqrt")

Num = int | Fraction


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Supports numbers, + - * / // % ** and parentheses, and the functions abs, round, floor, ceil, min, max and sqrt.

    Args:
        expression: The arithmetic to evaluate, e.g. "(12.50 * 3) * (1 - 0.15)".
    """
    value, inexact = evaluate(expression)
    return format_number(value, inexact)


def evaluate(expression: str) -> tuple[Num, bool]:
    """The exact value of `expression` and whether an approximation (sqrt, x**0.3) was involved.

    Raises ToolError, and nothing else, for anything it refuses (see the module docstring)."""
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ToolError("the expression is empty; write arithmetic such as 3 * (4 + 5)")
    if len(text) > MAX_CHARS:
        raise ToolError(f"the expression has {len(text)} characters; the limit is {MAX_CHARS}")
    if not text.isascii():
        pos, ch = next((i, c) for i, c in enumerate(text) if not c.isascii())
        raise ToolError(f"unsupported character {ch!r} at position {pos}; use ASCII digits and + - * / ( )")
    if "^" in text:
        raise ToolError("'^' is not supported; write powers with **, e.g. 2**10")
    text = " ".join(text.split())  # one line, so literal offsets index `text`
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {text!r:.80}: {e.msg}") from None
    except (ValueError, MemoryError, RecursionError) as e:
        raise ToolError(f"cannot parse the expression: {e}") from None
    ev = _Evaluator(text)
    try:
        value = ev.eval(tree.body, 0)
    except ToolError:
        raise
    except RecursionError:
        raise ToolError(f"the expression is nested too deeply (limit {MAX_DEPTH} levels)") from None
    except (ArithmeticError, ValueError, TypeError, MemoryError) as e:  # defensive: report, never raise
        raise ToolError(f"cannot evaluate: {type(e).__name__}: {e}") from None
    return value, ev.inexact


def format_number(value: Num, inexact: bool = False) -> str:
    """Print a value as described in the module docstring."""
    if isinstance(value, int) and not inexact:
        return str(value)
    num, den = value.numerator, value.denominator
    if not inexact:
        places = _decimal_places(den)
        if places is not None and places <= MAX_PLACES:
            sign = "-" if num < 0 else ""
            digits = str(abs(num) * 10**places // den).rjust(places + 1, "0")
            return f"{sign}{digits[:-places]}.{digits[-places:]}" if places else f"{sign}{digits}"
    d = _CTX.divide(Decimal(num), Decimal(den))
    if d == 0:
        return "0"
    d = d.normalize(_CTX)
    if -6 <= d.adjusted() < 15:
        return format(d, "f")
    return f"{d:e}".replace("e+", "e")


def _decimal_places(den: int) -> int | None:
    """Places of 1/den's decimal expansion if it terminates (den = 2^a 5^b), else None."""
    twos = (den & -den).bit_length() - 1
    rest = den >> twos
    fives = 0
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    return max(twos, fives) if rest == 1 else None


def _norm(v: Num) -> Num:
    """Fractions that are whole become ints; every value is checked against the bounds."""
    if type(v) is not int:
        num, den = v.numerator, v.denominator
        if den >= LIMIT:
            raise ToolError(f"a value is too small or too precise (its denominator reaches 10**{MAX_DIGITS})")
        if den != 1:
            if -LIMIT * den < num < LIMIT * den:
                return v
            raise ToolError(f"a value is too large (limit 10**{MAX_DIGITS})")
        v = num
    if -LIMIT < v < LIMIT:
        return v
    raise ToolError(f"a value is too large (limit 10**{MAX_DIGITS})")


def _iroot(n: int, q: int) -> int | None:
    """The integer q-th root of n >= 0 if n is a perfect q-th power."""
    if q == 2:
        r = math.isqrt(n)
    elif n < 2:
        r = n
    else:  # integer Newton iteration from an upper bound; n < 10**MAX_DIGITS keeps it short
        r = 1 << -(-n.bit_length() // q)
        while (y := ((q - 1) * r + n // r ** (q - 1)) // q) < r:
            r = y
    return r if r**q == n else None


class _Evaluator:
    def __init__(self, text: str):
        self.text = text
        self.inexact = False

    def eval(self, node: ast.AST, depth: int) -> Num:
        if depth > MAX_DEPTH:
            raise ToolError(f"the expression is nested too deeply (limit {MAX_DEPTH} levels)")
        kind = type(node)
        if kind is ast.BinOp:
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise ToolError(f"operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)} is not supported")
            return _norm(op(self, self.eval(node.left, depth + 1), self.eval(node.right, depth + 1)))
        if kind is ast.Constant:
            return self.constant(node)
        if kind is ast.UnaryOp:
            if type(node.op) is ast.USub:
                return -self.eval(node.operand, depth + 1)
            if type(node.op) is ast.UAdd:
                return self.eval(node.operand, depth + 1)
            raise ToolError(f"operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)} is not supported")
        if kind is ast.Call:
            return self.call(node, depth)
        raise ToolError(_refusal(node))

    def constant(self, node: ast.Constant) -> Num:
        value = node.value
        if type(value) is int:
            return _norm(value)
        if type(value) is float:
            literal = self.text[node.col_offset : node.end_col_offset].replace("_", "")
            try:
                if "e" in literal or "E" in literal:
                    return _norm(Fraction(literal))
                whole, _, frac = literal.partition(".")  # the common case, without Fraction's regex
                return _norm(Fraction(int(whole + frac), 10 ** len(frac)))
            except (ValueError, ZeroDivisionError):
                raise ToolError(f"cannot read the number {literal!r:.40}") from None
        if type(value) is complex:
            raise ToolError("complex numbers are not supported")
        raise ToolError(f"only numbers are allowed, not {value!r:.40}")

    def call(self, node: ast.Call, depth: int) -> Num:
        func = node.func
        if type(func) is ast.Attribute:
            raise ToolError(_refusal(func))
        if type(func) is not ast.Name or func.id not in FUNCTIONS:
            name = repr(func.id[:40]) if type(func) is ast.Name else "(an expression)"
            raise ToolError(f"unknown function {name}; allowed: {', '.join(FUNCTIONS)}")
        if node.keywords or any(type(a) is ast.Starred for a in node.args):
            raise ToolError(f"{func.id}() takes plain positional arguments only")
        n = len(node.args)
        want = {"round": (1, 2), "min": (1, MAX_ARGS), "max": (1, MAX_ARGS)}.get(func.id, (1, 1))
        if not want[0] <= n <= want[1]:
            raise ToolError(f"{func.id}() takes {want[0]} to {want[1]} arguments, got {n}" if want[0] != want[1]
                            else f"{func.id}() takes exactly 1 argument, got {n}")
        args = [self.eval(a, depth + 1) for a in node.args]
        return _norm(self.function(func.id, args))

    def function(self, name: str, args: list[Num]) -> Num:
        x, n = args[0], len(args)
        if name == "abs":
            return abs(x)
        if name == "min":
            return min(args)
        if name == "max":
            return max(args)
        if name == "floor":
            return math.floor(x)
        if name == "ceil":
            return math.ceil(x)
        if name == "sqrt":
            if x < 0:
                raise ToolError("sqrt of a negative number is not a real number")
            return self.power(x, Fraction(1, 2))
        places = args[1] if n == 2 else 0
        if not isinstance(places, int) or abs(places) > MAX_PLACES:
            raise ToolError(f"round(x, n) needs a whole n between -{MAX_PLACES} and {MAX_PLACES}")
        scale = Fraction(10) ** places
        half_up = math.floor(abs(x) * scale + Fraction(1, 2)) / scale
        return half_up if x >= 0 else -half_up

    # --- operators (values already bounded; results bounded by _norm) ------------------
    def add(self, a: Num, b: Num) -> Num:
        return a + b

    def sub(self, a: Num, b: Num) -> Num:
        return a - b

    def mul(self, a: Num, b: Num) -> Num:
        return a * b

    def div(self, a: Num, b: Num) -> Num:
        if b == 0:
            raise ToolError("division by zero")
        return Fraction(a, b) if type(a) is int and type(b) is int else Fraction(a) / b

    def floordiv(self, a: Num, b: Num) -> Num:
        if b == 0:
            raise ToolError("division by zero (in //)")
        return a // b

    def mod(self, a: Num, b: Num) -> Num:
        if b == 0:
            raise ToolError("modulo by zero (in %)")
        return a % b

    def power(self, a: Num, e: Num) -> Num:
        if isinstance(e, Fraction):  # a fractional exponent p/q
            if a < 0:
                raise ToolError("fractional powers of negative numbers are not supported")
            if a == 0:
                if e < 0:
                    raise ToolError("division by zero (0 to a negative power)")
                return 0
            p, q = e.numerator, e.denominator
            a = Fraction(a)
            if q <= 64:
                rn, rd = _iroot(a.numerator, q), _iroot(a.denominator, q)
                if rn is not None and rd is not None:
                    return self.power(_norm(Fraction(rn, rd)), p)
            log10 = float(e) * math.log10(a)
            if not -_LIMIT_LOG10 < log10 < _LIMIT_LOG10:
                raise ToolError(f"the result of ** would be {'too large' if log10 > 0 else 'too small'} "
                                f"(limit 10**{MAX_DIGITS})")
            self.inexact = True
            return _norm(Fraction(float(a) ** float(e)))
        if a == 0 and e < 0:
            raise ToolError("division by zero (0 to a negative power)")
        if a in (0, 1):
            return a if e != 0 else 1
        if a == -1:
            return 1 if e % 2 == 0 else -1
        size = max(a.numerator.bit_length(), a.denominator.bit_length()) - 1
        if abs(e) * size > _LIMIT_BITS:
            raise ToolError(f"the result of ** would be {'too large' if (e > 0) == (abs(a) > 1) else 'too small'} "
                            f"(limit 10**{MAX_DIGITS})")
        return a**e if e >= 0 else Fraction(a) ** e


_BINOPS = {
    ast.Add: _Evaluator.add,
    ast.Sub: _Evaluator.sub,
    ast.Mult: _Evaluator.mul,
    ast.Div: _Evaluator.div,
    ast.FloorDiv: _Evaluator.floordiv,
    ast.Mod: _Evaluator.mod,
    ast.Pow: _Evaluator.power,
}
_OP_NAMES = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
             ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}


def _refusal(node: ast.AST) -> str:
    """Why a node outside the arithmetic whitelist is refused."""
    if isinstance(node, ast.Name):
        return f"unknown name {node.id!r:.40}; only numbers, operators and {', '.join(FUNCTIONS)}() are allowed"
    if isinstance(node, ast.Attribute):
        return "attribute access (a.b) is not allowed"
    if isinstance(node, ast.Tuple):
        return "commas are only allowed between function arguments; write 1000, not 1,000"
    if isinstance(node, ast.Compare):
        return "comparisons are not supported; write arithmetic only"
    if isinstance(node, ast.BoolOp):
        return "and/or are not supported; write arithmetic only"
    return f"{type(node).__name__} is not allowed; write arithmetic only"
