"""Text from a remote peer made safe to print and store (issue 53, class 12).

A reward server's answer (its HTTP reason phrase, its error text), an SGLang server's error body
or log, a reward plug-in's error string: each can hold terminal control sequences (``ESC [``
…, ``ESC ]`` titles, a C1 ``CSI`` ``\\x9b``), carriage returns that overwrite the line before,
bidirectional overrides (``U+202E``) or NULs. :func:`escape_controls` writes every character
that is not printable as its Python escape (``\\x1b``, ``\\u202e``), so the text reaches the
terminal, a log and the MLflow store as visible characters. It is idempotent (an escaped text is
printable) and leaves printable text, including non-ASCII letters, unchanged. It is used where
such text enters a message: ``rewards.error_text`` (every failed reward's one line, printed and
stored in the samples tables), the HTTP reward client's messages, ``engines.sglang.wire``'s
``wire_excerpt`` (every SGLang body quoted in an error) and the server's log tail, and every
``sat: error:`` paragraph (``cli.guard.fail``) as the last line of defence.
"""

from __future__ import annotations


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every character that is not printable (C0 and C1 controls, DEL, format and
    separator characters, lone surrogates) written as its escape; the characters of ``keep``
    (``"\\n"`` for a multi-line paragraph) are left as they are."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else _escape(ch) for ch in text)
