"""The built-in "calculator" tool: arithmetic by walking the expression's syntax tree, never `eval`.

Accepted: int and float literals, `+ - * / // % **`, unary `+ -`, parentheses, and the functions
`abs, round, min, max, sqrt, exp, log, log10, sin, cos, tan, floor, ceil` and constants `pi, e`.
Anything else (names, attributes, calls of other functions, strings, comprehensions) is refused
with a message naming it. Sizes are bounded so no expression can take the worker down: at most
`MAX_CHARS` characters, exponents up to `MAX_EXPONENT`, integers up to `MAX_DIGITS` digits.
Results: an int as its decimal digits, a float that is a whole number below 1e15 as an int
("6/2" -> "3"), other floats as Python's shortest repr ("7/2" -> "3.5").
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Union

from megatron_bapo.rollout.tools import ToolError

MAX_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_DIGITS = 4_300
Number = Union[int, float]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "exp": math.exp,
              "log": math.log, "log10": math.log10, "sin": math.sin, "cos": math.cos, "tan": math.tan,
              "floor": math.floor, "ceil": math.ceil}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def calculator(expression: str) -> str:
    """The value of an arithmetic `expression` ("482*37" -> "17834"); ToolError names what is refused."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError) as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None
    return format_number(value)


def format_number(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _check(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError(f"not a number: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is not finite ({value})")
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * math.log10(abs(left)) > MAX_DIGITS:
            raise ToolError(f"result has more than {MAX_DIGITS} digits")
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _check(_FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        what = f"calling {node.func.id}"
    else:
        what = f"name {node.id}" if isinstance(node, ast.Name) else type(node).__name__
    raise ToolError(f"{what} is not allowed (numbers, + - * / // % **, parentheses and "
                    f"{', '.join(sorted(_FUNCTIONS))} only)")
