"""The calculator environment (issue 43, item 6's first environment; the logic only).

A problem multiplies (or adds) two integers with ``digits`` digits each, too large for the model
to do in its head: ``make_problem(seed, digits)`` → a row ``{"question", "answer", "a", "b",
"op"}``. The model may call the tool ``calculator`` with ``{"expression": "<integer
arithmetic>"}`` (Hermes format, ``toolcalls.py``); the environment answers with a ``tool``
message holding the value, or ``error: …``. A turn without a tool call is the final answer: its
last integer (commas allowed) is compared with the gold answer: reward 1.0 if equal, else 0.0,
and the trajectory ends. A turn that still calls a tool at ``max_turns`` ends it with reward 0.

The calculator runs in this process, not in the sandbox (``sandbox.py``): it is a pure function
over Python integers that parses the expression with ``ast`` and evaluates only integer
literals, ``+ - * // %``, unary minus and ``**`` with a small exponent, each bounded in size
before it is computed (``MAX_EXPR_CHARS``, ``MAX_RESULT_DIGITS``), so it runs no code, cannot
hang and cannot allocate much; the sandbox would add ~0.09 s per call (the median of a Python
one-liner there, measured on the 2-core CPU machine) for nothing.
Its calls are still counted in ``stats`` (a ``ToolStats``) like sandboxed ones.

With ``parser=compact`` (for the embedded character-level model) the whole exchange is compact
and has no system prompt: the prompt is ``123*456=``, the call ``[calc:123*456]``, the tool's
answer ``56088=`` (any error: ``error=``) and the final answer ``\\boxed{56088}``, so each turn
reads like the toy task the model was warm-started on (``a+b=`` → ``\\boxed{sum}``) and the
only new skill is copying.

Rows: ``rows(split, n, start)`` (``base.split_rows``), problems with ``DIGITS``-digit operands;
the held-out split is 1 seed in 10.
"""

from __future__ import annotations

import ast
import random
import re
from typing import Any

from sat_cli.envs.base import EnvSettings, Message, Step, TurnBasedEnv, split_rows
from sat_cli.envs.sandbox import ToolResult, ToolStats
from sat_cli.envs.toolcalls import get_parser

MAX_EXPR_CHARS = 200
MAX_RESULT_DIGITS = 200
MAX_EXPONENT = 64
DIGITS = 3  # the shipped rows: 3-digit operands (the warm-started model reads 3-digit numbers)
TOOL_NAMES = ("calculator", "calc")  # calc: the compact format's short name
OPS = {"*": lambda a, b: a * b, "+": lambda a, b: a + b}
SYSTEM = (
    "You can call the tool calculator. To call it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call> '
    "and wait for its result. When you know the answer, reply with the number only."
)


class CalcError(ValueError):
    pass


def _digits(n: int) -> int:
    return len(str(abs(n))) if abs(n) < 10**MAX_RESULT_DIGITS else MAX_RESULT_DIGITS + 1


def _bounded(n: int) -> int:
    if _digits(n) > MAX_RESULT_DIGITS:
        raise CalcError(f"result over {MAX_RESULT_DIGITS} digits")
    return n


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        op = node.op
        if isinstance(op, ast.Add):
            return _bounded(a + b)
        if isinstance(op, ast.Sub):
            return _bounded(a - b)
        if isinstance(op, ast.Mult):
            if _digits(a) + _digits(b) > MAX_RESULT_DIGITS + 1:
                raise CalcError(f"result over {MAX_RESULT_DIGITS} digits")
            return _bounded(a * b)
        if isinstance(op, ast.FloorDiv | ast.Mod):
            if b == 0:
                raise CalcError("division by zero")
            return a // b if isinstance(op, ast.FloorDiv) else a % b
        if isinstance(op, ast.Pow):
            if not 0 <= b <= MAX_EXPONENT or _digits(a) * b > MAX_RESULT_DIGITS:
                raise CalcError(f"exponent must be in [0, {MAX_EXPONENT}] with a small result")
            return a**b
    raise CalcError("only integers and + - * // % ** are allowed")


def calculate(expression: str) -> int:
    """The value of an integer expression; ``CalcError`` (one line) when it is not allowed."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"expression must be a string of at most {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        msg = e.msg if isinstance(e, SyntaxError) else e
        raise CalcError(f"cannot parse the expression: {msg}") from None
    return _eval(tree.body)


def make_problem(seed: int, digits: int = 6, op: str = "*") -> dict[str, Any]:
    """A problem with two ``digits``-digit operands, the same for the same seed."""
    if op not in OPS or not 1 <= digits <= 40:
        raise ValueError(f"op must be one of {sorted(OPS)} and digits in [1, 40]")
    rng = random.Random(seed)
    a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
    answer = OPS[op](a, b)
    return {
        "question": f"What is {a} {op} {b}?",
        "compact": f"{a}{op}{b}=",
        "answer": str(answer),
        "a": a,
        "b": b,
        "op": op,
    }


def rows(split: str, n: int, start: int = 0, digits: int = DIGITS) -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (``train``/``heldout``) from seed ``start`` on."""
    return split_rows("calculator", lambda seed: make_problem(seed, digits), split, n, start)


FINAL = re.compile(r"-?\d[\d,]*")


MAX_NUMBER_DIGITS = 4000  # under Python's int conversion limit (4300); far past any answer


def final_number(text: str) -> int | None:
    """The last integer in ``text`` (``1,234`` reads as 1234), or None; None too for one of
    more than ``MAX_NUMBER_DIGITS`` digits (a model's turn of 5000 nines raised ValueError)."""
    found = FINAL.findall(text)
    digits = found[-1].replace(",", "") if found else ""
    return int(digits) if found and len(digits.lstrip("-")) <= MAX_NUMBER_DIGITS else None


def teach(row: dict[str, Any], observations: list[Message], rng) -> str:
    """The format warm start's teacher: the tool call with the problem's operands, then the
    tool's value as the answer."""
    if not observations:
        return f"[calc:{row['a']}{row['op']}{row['b']}]"
    return "\\boxed{" + observations[-1]["content"].rstrip("=") + "}"


class CalculatorEnv(TurnBasedEnv):
    needs = ("question", "answer")
    rows = staticmethod(rows)  # the environment's own rows: rows(split, n, start)
    teacher = staticmethod(teach)  # the format warm start's turns (envs/plain.py)
    # its format warm start (models/env_warmstart.EnvWarmStart): until a fifth of the held-out
    # trajectories succeed
    warm_start = {"target": 0.2, "eval_every": 5}

    def __init__(self, settings: EnvSettings):
        super().__init__(settings)
        self.parse = get_parser(settings.parser)
        self.stats = ToolStats()

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.start(row)
        row = self.row
        self.trajectory_stats = ToolStats()
        if self.compact:
            return [{"role": "user", "content": row.get("compact", row["question"])}]
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["question"]}]

    def _call(self, name: str, arguments: dict) -> ToolResult:
        if name not in TOOL_NAMES:
            return ToolResult("bad_call", f"error: unknown tool {name!r}; the tool is calculator")
        try:
            value = calculate(arguments.get("expression", arguments.get("input")))
            return ToolResult("ok", f"{value}=" if self.compact else str(value))
        except CalcError as e:
            return ToolResult("bad_call", f"error: {e}")

    def _totals(self, correct: bool) -> dict[str, Any]:
        """The last step's info: the outcome and the trajectory's tool calls and errors (what
        ``env/tool_error_frac`` sums: the loop and ``sat eval`` see the last step's info)."""
        t = self.trajectory_stats
        return {"correct": correct, "tool_calls_total": t.calls, "tool_errors_total": t.failed}

    def step(self, action_text: str) -> Step:
        self.begin(action_text)
        parsed = self.parse(action_text)
        info = {"turn": self.turn.turns, "tool_calls": len(parsed.calls)}
        info["parse_errors"] = len(parsed.errors)
        if not parsed.calls and not parsed.errors:
            got = final_number(parsed.content)
            correct = got is not None and str(got) == self.row["answer"]
            self.turn.done = True
            return Step([], 1.0 if correct else 0.0, True, {**info, **self._totals(correct)})
        results = [self._call(c.name, c.arguments) for c in parsed.calls]
        for r in results:
            self.stats.add(r)
            self.trajectory_stats.add(r)
        info["tool_errors"] = sum(not r.ok for r in results)
        if self.turn.last:
            self.turn.done = True
            return Step([], 0.0, True, {**info, **self._totals(False)})
        if self.compact:  # an error is one short word: observations are tokens of the sequence
            texts = [r.text if r.ok else "error=" for r in results] + ["error="] * len(
                parsed.errors
            )
        else:
            texts = [r.text for r in results] + [f"error: {e}" for e in parsed.errors]
        return Step([{"role": "tool", "content": t} for t in texts], 0.0, False, info)
