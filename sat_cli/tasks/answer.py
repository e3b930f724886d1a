"""Final-answer extraction of the reward (:mod:`sat_cli.tasks.reward`), torch- and sympy-free.

ALGORITHMS.md §8: the final answer is the *last* ``\\boxed{…}`` (or ``\\fbox{…}``, or the
brace-less ``\\boxed 5``), else the last ``Answer:`` line, else there is none and the response
is wrong. ``extract_answer`` is re-exported by :mod:`sat_cli.tasks.reward`.
"""

from __future__ import annotations

import re

# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE_RE = re.compile(
    r"^[ \t>#*_-]*(?:final[ \t]+)?answer[ \t]*[*_]*[ \t]*[:：][ \t]*[*_]*[ \t]*(.*?)[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)
_FINAL_ANSWER_IS_RE = re.compile(r"the final answer is\s*(.*)", re.IGNORECASE | re.DOTALL)
_DOLLAR_SPAN_RE = re.compile(r"\$+([^$]+?)\$+")


def _match_braces(text: str, open_pos: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``; escaped ``\\{``/``\\}`` are skipped."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_content(text: str, start: int) -> str | None:
    """Content of the box whose command ends at ``start``; None when it is unterminated/empty."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _match_braces(text, i)
        if close is None:
            return None  # truncated response: "\boxed{12" is not an answer
        content = text[i + 1 : close].strip()
    elif i > start:
        # "\boxed 5": the argument is the next whitespace/$-delimited token.
        m = re.match(r"[^\s$]+", text[i:])
        if m is None:
            return None
        content = m.group(0).rstrip(".,;")
    else:
        return None
    if not content:
        return None
    inner = _last_boxed(content)  # "\boxed{\boxed{5}}" -> "5"
    return inner if inner is not None else content


def _last_boxed(text: str) -> str | None:
    """Content of the last box; None when there is none or the last one is empty/unterminated.

    An earlier box is not used when the last one is broken: a response cut off while writing its
    final answer has no final answer (as in the MATH reference ``last_boxed_only_string``).
    """
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    return _box_content(text, starts[-1]) if starts else None


def _clean_answer_text(s: str) -> str | None:
    s = s.strip().strip("*_").strip()
    m = _FINAL_ANSWER_IS_RE.search(s)  # Minerva style: "The final answer is $5$. I hope ..."
    if m:
        s = m.group(1)
    spans = _DOLLAR_SPAN_RE.findall(s)
    if spans:
        s = spans[-1]
    s = s.strip().rstrip(".").strip()
    return s or None


def extract_answer(response: str) -> str | None:
    """The final answer of ``response``: last ``\\boxed{}``/``\\fbox{}``, else last ``Answer:`` line.

    Returns the answer text without the box or ``$`` delimiters, or None when there is none.
    """
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    lines_matches = list(_ANSWER_LINE_RE.finditer(response))
    for m in reversed(lines_matches):
        content = m.group(1)
        if not content.strip(" *_"):
            # "Answer:\n42": take the next non-empty line.
            rest = response[m.end() :].lstrip("\n")
            content = rest.split("\n", 1)[0] if rest.strip() else ""
        cleaned = _clean_answer_text(content)
        if cleaned is not None:
            return cleaned
    return None
