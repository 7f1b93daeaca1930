"""A calculator tool for verl's ToolAgentLoop: safe arithmetic on an `ast`, never `eval`.

Use it through a verl tool config (see `conf/tools/calculator.yaml`):

    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
    actor_rollout_ref.rollout.multi_turn.tool_config_path=conf/tools/calculator.yaml

The model calls it as `<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>`
and gets back the value as text (`84`), or a one-line `Error: ...` it can react to.

Owns: parsing an arithmetic expression with `ast.parse(mode="eval")` and evaluating a whitelist of
nodes: int/float literals, `+ - * / // % **`, unary `+ -`, parentheses, and the functions
`abs, round, min, max, sqrt`; bounds on expression length, exponent size and result magnitude so a
request cannot burn CPU or memory (`9**9**9` is refused before it is computed).
Must never: call `eval`/`exec`/`compile` on model text, look up names other than the whitelisted
functions, touch attributes, subscripts, strings or any I/O, or raise out of `execute` for a bad
expression (the model gets an error message and a reward of 0.0 instead).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

DEFAULT_MAX_LENGTH = 256  # characters of expression
DEFAULT_MAX_ABS = 1e18  # largest magnitude of any intermediate or final value
MAX_EXPONENT = 64  # |exponent| bound for ** (with DEFAULT_MAX_ABS this is plenty)
MAX_DEPTH = 32  # nesting depth of the expression tree
MAX_NODES = 200


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is shown to the model."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _round(x, ndigits=None):
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > 15):
        raise CalculatorError("round() takes an integer number of digits between -15 and 15")
    return round(x) if ndigits is None else round(x, ndigits)


def _sqrt(x):
    if x < 0:
        raise CalculatorError("sqrt() of a negative number")
    return math.sqrt(x)


# name -> (function, min args, max args)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, 16),
    "max": (max, 1, 16),
    "sqrt": (_sqrt, 1, 1),
}


def evaluate(expression: str, *, max_length: int = DEFAULT_MAX_LENGTH, max_abs: float = DEFAULT_MAX_ABS) -> int | float:
    """The value of an arithmetic expression, or CalculatorError saying why not."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid syntax: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return _Evaluator(max_abs).value(tree.body, 0)


class _Evaluator:
    def __init__(self, max_abs: float):
        self.max_abs = max_abs

    def check(self, x: int | float) -> int | float:
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            raise CalculatorError("result is not a finite number")
        if abs(x) > self.max_abs:
            raise CalculatorError(f"result magnitude exceeds {self.max_abs:g}")
        return x

    def value(self, node: ast.AST, depth: int) -> int | float:
        if depth > MAX_DEPTH:
            raise CalculatorError("expression nested too deeply")
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {v!r}")
            return self.check(v)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.value(node.operand, depth + 1)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left = self.value(node.left, depth + 1)
            right = self.value(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                result = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large") from None
            if isinstance(result, complex):
                raise CalculatorError("result is not a real number")
            return self.check(result)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
                allowed = ", ".join(sorted(_FUNCTIONS))
                raise CalculatorError(f"only these functions are allowed: {allowed}")
            fn, lo, hi = _FUNCTIONS[node.func.id]
            if not lo <= len(node.args) <= hi:
                raise CalculatorError(f"{node.func.id}() takes {lo}..{hi} arguments")
            args = [self.value(a, depth + 1) for a in node.args]
            try:
                return self.check(fn(*args))
            except (OverflowError, ValueError) as e:
                raise CalculatorError(str(e) or f"{node.func.id}() failed") from None
        raise CalculatorError(f"'{type(node).__name__}' is not allowed in an arithmetic expression")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(self.max_abs) + 1:
            raise CalculatorError(f"result magnitude exceeds {self.max_abs:g}")


def format_number(x: int | float) -> str:
    """Integers as integers; floats with up to 12 significant digits, integral floats without '.0'."""
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return format(x, ".12g")
    return str(x)


DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses, "
                       "and the functions abs, round, min, max, sqrt.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "the expression, e.g. 12 * (3 + 4)"},
            },
            "required": ["expression"],
        },
    },
}


class CalculatorTool(BaseTool):
    """verl BaseTool: `execute(instance_id, {"expression": ...})` -> (ToolResponse(text=value), 0.0, metrics).

    Config keys (the `config:` block of the tool YAML): `max_expression_length` (default 256) and
    `max_abs_value` (default 1e18). Per-trajectory state is only a call count, released with the instance.
    """

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(config or {}, schema)
        self.max_length = int(self.config.get("max_expression_length", DEFAULT_MAX_LENGTH))
        self.max_abs = float(self.config.get("max_abs_value", DEFAULT_MAX_ABS))
        self._calls: dict[str, int] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._calls[instance_id] = 0
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        self._calls[instance_id] = self._calls.get(instance_id, 0) + 1
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if expression is None:
            return ToolResponse(text="Error: missing argument 'expression'"), 0.0, {"ok": False}
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = str(expression)
        try:
            value = evaluate(expression, max_length=self.max_length, max_abs=self.max_abs)
        except CalculatorError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"ok": False}
        return ToolResponse(text=format_number(value)), 0.0, {"ok": True}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._calls.pop(instance_id, None)
