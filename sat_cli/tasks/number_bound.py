"""The size bound on exact numbers in grading (``sat_cli.tasks.reward``).

A time limit cannot bound one C-level computation: sympy evaluates ``2^{-2^{2001}}`` as one
Python ``int`` power, which no ``SIGALRM`` handler interrupts (handlers run between bytecodes), and
it grows in memory until the machine runs out (seen: a test worker at 18 GB after 5 minutes).
``too_large`` bounds, without evaluating anything, the size of every power and factorial in a
parsed answer; the grader counts an answer over the bound as wrong.
"""

from __future__ import annotations

import math

MAX_EXACT_LOG10 = 100_000.0
"""The largest exact number (in decimal digits) a comparison may make sympy build. A power or a
product of 10^5 digits takes about 10 ms; gold answers such as ``(101!)^{100}`` (16,000 digits)
stay gradable."""


class _TooLarge(Exception):
    pass


def _log10_int(n: int) -> float:
    n = abs(n)
    if n < 2:
        return 0.0
    return math.log10(n) if n.bit_length() < 1000 else n.bit_length() * math.log10(2)


def _digits_bound(e) -> float | None:
    """An upper bound of log10|value| of the exact number ``e`` (a parsed sympy expression) would
    evaluate to, or None where it is not an exact number (symbols, floats: mpmath's floats carry
    any exponent cheaply). Raises ``_TooLarge`` as soon as a power, factorial or binomial in ``e``
    would exceed ``MAX_EXACT_LOG10``."""
    import sympy

    if isinstance(e, sympy.Rational):  # Integer included
        return max(_log10_int(int(e.p)), _log10_int(int(e.q)))
    bounds = [_digits_bound(a) for a in e.args]  # every subexpression is checked
    if any(b is None for b in bounds):
        return None
    if isinstance(e, sympy.Pow):
        base, expo = bounds
        size = base * (10.0**expo if expo < 300 else math.inf)  # |b^e| <= |b|^(10^log10|e|)
    elif isinstance(e, sympy.factorial):
        n = 10.0 ** bounds[0] if bounds[0] < 300 else math.inf
        size = n * math.log10(max(n, 2.0))
    elif isinstance(e, sympy.binomial):  # C(n, k) <= 2^n
        size = (10.0 ** bounds[0] if bounds[0] < 300 else math.inf) * math.log10(2)
    elif isinstance(e, sympy.Mul):
        size = sum(bounds)
    elif isinstance(e, sympy.Add):
        size = max(bounds, default=0.0) + math.log10(max(len(bounds), 1))
    else:
        return None
    if size > MAX_EXACT_LOG10:
        raise _TooLarge
    return size


def too_large(parsed: tuple) -> bool:
    """Whether evaluating any parsed answer in ``parsed`` would build an exact number over
    ``MAX_EXACT_LOG10`` digits."""
    import sympy

    try:
        for e in parsed:
            if isinstance(e, sympy.Basic):
                _digits_bound(e)
    except _TooLarge:
        return True
    except RecursionError:  # a nesting deeper than the interpreter's stack: not a number to build
        return True
    return False
