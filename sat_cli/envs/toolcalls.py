"""Tool-call parsers, registered by name: ``parse(name, text) -> Parsed``.

``hermes`` (the Qwen / Hermes format, as Qwen's chat template writes it): each call is
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` in the model's text; the text outside the
tags is the reply's content. A call whose JSON does not parse, is not an object, lacks a string
``name`` or has ``arguments`` that are not an object is kept as an error (``Parsed.errors``) so
the environment can tell the model, instead of being dropped; an opening tag never closed is an
error too. A text over ``MAX_TEXT_CHARS`` or with more than ``MAX_CALLS`` calls is refused whole
(one error, no calls): hostile sizes never reach ``json.loads``.

``compact`` (for small character-level models, e.g. the embedded 1 M-parameter model, which
cannot learn JSON in tags): each call is ``[name:input]``, one line, no nesting: a name of
letters, digits, ``_`` or ``-`` and an input without brackets or newlines, e.g.
``[calc:123*456]``; it parses to ``ToolCall(name, {"input": input})``. Every other ``[`` in the
reply starts a malformed call (an error), so a reply in this format has no other brackets.

A new format is one function ``(text) -> Parsed`` decorated with ``@register_parser("name")``;
``get_parser`` refuses an unknown name listing the registered ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_TEXT_CHARS = 65536
MAX_CALLS = 16


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the calls, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call


Parser = Callable[[str], Parsed]
PARSERS: dict[str, Parser] = {}


def register_parser(name: str):
    def deco(fn: Parser) -> Parser:
        PARSERS[name] = fn
        return fn

    return deco


def get_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def parse(name: str, text: str) -> Parsed:
    return get_parser(name)(text)


def _one_call(body: str) -> ToolCall | str:
    """The call in one tag's body, or a one-line error."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return f"tool call is not valid JSON ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(obj, dict):
        return "tool call is not a JSON object"
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "tool call has no string 'name'"
    if not isinstance(args, dict):
        return f"tool call {name!r}: 'arguments' is not an object"
    return ToolCall(name, args)


def _refused(text: str, calls: int) -> Parsed | None:
    """The whole-reply refusal of hostile sizes (module docstring), or None."""
    if len(text) > MAX_TEXT_CHARS:
        return Parsed("", [], [f"reply over {MAX_TEXT_CHARS} characters: not parsed"])
    if calls > MAX_CALLS:
        return Parsed("", [], [f"{calls} tool calls, more than {MAX_CALLS}: not parsed"])
    return None


HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> Parsed:
    bodies = HERMES.findall(text[: MAX_TEXT_CHARS + 1])
    if refused := _refused(text, len(bodies)):
        return refused
    calls, errors = [], []
    for body in bodies:
        got = _one_call(body.strip())
        (calls if isinstance(got, ToolCall) else errors).append(got)
    rest = HERMES.sub("", text)
    if "<tool_call>" in rest:
        errors.append("a <tool_call> tag is never closed")
        rest = rest.split("<tool_call>", 1)[0]
    return Parsed(rest.strip(), calls, errors)


COMPACT = re.compile(r"\[([A-Za-z0-9_-]+):([^\[\]\n]*)\]")


@register_parser("compact")
def parse_compact(text: str) -> Parsed:
    found = COMPACT.findall(text[: MAX_TEXT_CHARS + 1])
    if refused := _refused(text, len(found)):
        return refused
    rest = COMPACT.sub("", text)
    errors = ["malformed tool call: write [name:input]"] * rest.count("[")
    rest = rest.split("[", 1)[0] if errors else rest
    return Parsed(rest.strip(), [ToolCall(n, {"input": a}) for n, a in found], errors)
