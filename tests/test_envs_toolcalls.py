"""Tool-call parsing (Hermes / Qwen format), hand cases."""

from __future__ import annotations

import pytest

from sat_cli.envs.toolcalls import MAX_CALLS, MAX_TEXT_CHARS, ToolCall, get_parser, parse


def call(name, args):
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_one_call_with_text_around_it():
    p = parse("hermes", "Let me compute.\n" + call("calculator", '{"expression": "2*3"}') + " ok")
    assert p.calls == [ToolCall("calculator", {"expression": "2*3"})]
    assert p.content == "Let me compute.\n ok" and p.errors == []


def test_several_calls_in_order_and_multiline_json():
    text = (
        call("a", "{}") + '\n<tool_call>\n{"name": "b",\n "arguments": {"x": [1, 2]}}\n'
        "</tool_call>" + call("c", '{"y": null}')
    )
    p = parse("hermes", text)
    assert p.calls == [ToolCall("a", {}), ToolCall("b", {"x": [1, 2]}), ToolCall("c", {"y": None})]
    assert p.content == "" and p.errors == []


def test_missing_arguments_mean_none():
    assert parse("hermes", '<tool_call>{"name": "now"}</tool_call>').calls == [ToolCall("now", {})]


def test_no_call_is_plain_content():
    p = parse("hermes", "  The answer is 42.  ")
    assert (p.content, p.calls, p.errors) == ("The answer is 42.", [], [])


@pytest.mark.parametrize(
    "body,error",
    [
        ('{"name": "a", "arguments": {', "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"arguments": {}}', "no string 'name'"),
        ('{"name": 5}', "no string 'name'"),
        ('{"name": "a", "arguments": "x=1"}', "'arguments' is not an object"),
        ("[" * 60000, "not valid JSON"),  # deep nesting under the size cap
    ],
    ids=["truncated", "array", "no-name", "int-name", "string-args", "deep"],
)
def test_malformed_calls_are_errors_and_good_ones_are_kept(body, error):
    p = parse("hermes", f"<tool_call>{body}</tool_call>" + call("ok", "{}"))
    assert p.calls == [ToolCall("ok", {})] and len(p.errors) == 1 and error in p.errors[0]


def test_unclosed_tag_is_an_error_and_its_text_dropped():
    p = parse("hermes", 'before <tool_call>{"name": "a"')
    assert (
        p.content == "before"
        and p.calls == []
        and p.errors == ["a <tool_call> tag is never closed"]
    )


def test_hostile_sizes_are_refused_whole():
    huge = parse("hermes", "x" * (MAX_TEXT_CHARS + 1))
    assert huge.calls == [] and "not parsed" in huge.errors[0]
    many = parse("hermes", call("a", "{}") * (MAX_CALLS + 1))
    assert many.calls == [] and f"{MAX_CALLS + 1} tool calls" in many.errors[0]
    assert len(parse("hermes", call("a", "{}") * MAX_CALLS).calls) == MAX_CALLS


def test_unknown_parser_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'; valid: compact, hermes"):
        get_parser("xml")


def test_compact_calls_with_text_around_them():
    p = parse("compact", r"let me [calc:123*456] then [x-1:] \boxed{5}")
    assert p.calls == [ToolCall("calc", {"input": "123*456"}), ToolCall("x-1", {"input": ""})]
    assert p.content == r"let me  then  \boxed{5}" and p.errors == []


@pytest.mark.parametrize(
    "text,content",
    [("[calc:12", ""), ("ok [:1]", "ok"), ("a [b c:1]", "a"), ("[c:[1]]", ""), ("[c:1\n]", "")],
    ids=["unclosed", "no-name", "space-in-name", "nested", "newline"],
)
def test_compact_malformed_calls_are_errors(text, content):
    p = parse("compact", text)
    assert p.calls == [] and p.content == content
    assert p.errors and set(p.errors) == {"malformed tool call: write [name:input]"}


def test_compact_hostile_sizes_are_refused_whole():
    assert "not parsed" in parse("compact", "[" * (MAX_TEXT_CHARS + 1)).errors[0]
    assert "17 tool calls" in parse("compact", "[a:1]" * (MAX_CALLS + 1)).errors[0]
