"""The one reward module: extract a model's final answer and grade it against the gold answer.

ALGORITHMS.md §8: the final answer is the *last* ``\\boxed{…}`` (or ``\\fbox{…}``, or the
brace-less ``\\boxed 5``), else the last ``Answer:`` line, else there is none and the response
is wrong. Equivalence is decided by math-verify (``from math_verify import parse, verify``) with
both sides wrapped in ``$…$`` before parsing (a bare ``\\sqrt{12}`` parses to nothing).

Two cheap checks run first and settle most answers without sympy: normalized string equality
(spaces, ``$``, ``\\left``/``\\right``, a trailing period removed) and plain-number comparison
(``033`` equals ``33``, ``1,000`` equals ``1000``; two different integers are unequal). Everything
else goes to math-verify.

Time limits. math-verify bounds its own work with ``signal.alarm``, which raises outside the main
thread. We call it with ``parsing_timeout=None`` / ``timeout_seconds=None`` and bound time
ourselves, per answer:

* in the main thread: a ``SIGALRM`` interval timer (``setitimer``, fractional seconds) raising a
  ``BaseException`` subclass, so sympy's ``except Exception`` blocks cannot swallow it;
* in any other thread: the comparison runs in a small shared process pool (``spawn`` context;
  each worker grades in its own main thread with the timer above), and the caller waits at most
  ``timeout_s`` plus a grace period, after which the pool is replaced;
* ``timeout_s=None`` disables the limit and grades in the calling thread (fast, unbounded).

A timer cannot stop one C-level computation (handlers run between bytecodes): sympy building an
exact number such as ``2^{-2^{2001}}`` would run, and grow in memory, without end. So before
math-verify runs, every power, factorial and binomial of the parsed answers is bounded in size
(``number_bound.MAX_EXACT_LOG10`` digits); an answer over it counts as wrong.

A timed-out answer counts as wrong. ``grade_many`` grades a batch, in a process pool of
``workers`` processes when the batch is large enough to pay for starting one.

Usage::

    from sat_cli.tasks.reward import grade, reward, extract_answer
    grade("... so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5")   # True
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

from math_verify import parse, verify

from sat_cli.tasks.answer import extract_answer
from sat_cli.tasks.number_bound import MAX_EXACT_LOG10, too_large

logger = logging.getLogger(__name__)

# We disable math-verify's own (signal-based) timeouts on purpose and bound time here; its
# warning about that would otherwise print once per process, workers included.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

DEFAULT_TIMEOUT_S = 5.0
"""Per-answer time limit of the symbolic comparison (parse of both sides + verify)."""

_POOL_GRACE_S = 10.0  # extra wait for a pool round trip (worker start-up, pickling)
_MIN_BATCH_FOR_POOL = 256  # grade_many(workers=None): below this, grade in-process

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "answers_equal",
    "extract_answer",
    "grade",
    "grade_many",
    "reward",
]


# --------------------------------------------------------------------------------------------
# Fast path
# --------------------------------------------------------------------------------------------

_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
# LaTeX that math-verify silently drops while parsing, so a symbolic "match" would be spurious.
_UNSUPPORTED_RE = re.compile(r"\\(?:aleph|beth|gimel)(?![A-Za-z])")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\s+")


def _normalize(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = _SPACING_RE.sub("", s)
    s = s.rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    if not _NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def _fast_compare(pred: str, gold: str) -> bool | None:
    """True/False when settled without sympy; None when math-verify must decide."""
    p, g = _normalize(pred), _normalize(gold)
    if not p:
        return False
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        if pn == gn:
            return True
        if pn.denominator == 1 and gn.denominator == 1 and "." not in p + g:
            return False  # two different integers
        return None  # decimals that differ are left to math-verify's rounding rules
    if _UNSUPPORTED_RE.search(p) or _UNSUPPORTED_RE.search(g):
        return False  # math-verify drops these symbols (2^{\aleph_1} parses to 2): strings only
    return None


# --------------------------------------------------------------------------------------------
# math-verify, unbounded (called under one of the time limits below)
# --------------------------------------------------------------------------------------------


def _wrap(s: str) -> str:
    return "$" + s.strip().strip("$").strip() + "$"


@lru_cache(maxsize=4096)
def _parse_cached(text: str) -> tuple:
    return tuple(parse(_wrap(text), parsing_timeout=None))


def _verify_unbounded(pred: str, gold: str) -> bool:
    gold_parsed = _parse_cached(gold)
    pred_parsed = _parse_cached(pred)
    if not gold_parsed or not pred_parsed:
        return False
    if gold_parsed == pred_parsed:  # structurally identical (no evaluation): equal
        return True
    if too_large(gold_parsed) or too_large(pred_parsed):
        logger.warning(
            "grading: a number over 10^%d counts as wrong: %.80r vs %.80r",
            MAX_EXACT_LOG10,
            pred,
            gold,
        )
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


# --------------------------------------------------------------------------------------------
# Time limits
# --------------------------------------------------------------------------------------------


class _GradeTimeout(BaseException):
    """Raised by our SIGALRM handler; a BaseException so library ``except Exception`` misses it."""


def _alarm_available() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _verify_with_alarm(pred: str, gold: str, timeout_s: float) -> bool:
    """math-verify under a SIGALRM interval timer; main thread only. Timeout → False."""

    def _handler(signum, frame):
        raise _GradeTimeout

    old_handler = signal.getsignal(signal.SIGALRM)
    old_delay, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    try:
        try:
            signal.signal(signal.SIGALRM, _handler)
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return _verify_unbounded(pred, gold)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # somebody else's timer was running: give it back what is left
                left = old_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
    except _GradeTimeout:
        signal.signal(signal.SIGALRM, old_handler)
        logger.warning(
            "grading timed out after %.1fs: pred=%.80r gold=%.80r", timeout_s, pred, gold
        )
        return False


def _verify_chunk(pairs: list[tuple[str, str]], timeout_s: float) -> list[bool]:
    """Pool worker entry: each pair graded under the alarm (pool workers run in their main thread)."""
    return [_verify_with_alarm(p, g, timeout_s) for p, g in pairs]


def _warm_up() -> None:
    """First parse builds math-verify's regexes and ANTLR parser (~0.3 s); do it outside a limit."""
    verify(
        parse("$1$", parsing_timeout=None),
        parse("$x+1$", parsing_timeout=None),
        timeout_seconds=None,
    )


def _spawn_pool(processes: int):
    # spawn, not fork: the parent may hold torch/engine threads. Like any spawn pool, the calling
    # script's top level must be guarded by `if __name__ == "__main__":`.
    return multiprocessing.get_context("spawn").Pool(processes=processes, initializer=_warm_up)


class _FallbackPool:
    """Process pool used when a non-main thread needs a time-bounded symbolic comparison."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = None

    def _get(self):
        with self._lock:
            if self._pool is None:
                self._pool = _spawn_pool(max(1, min(4, os.cpu_count() or 1)))
            return self._pool

    def _discard(self, pool) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.terminate()

    def verify(self, pred: str, gold: str, timeout_s: float) -> bool:
        pool = self._get()
        job = pool.apply_async(_verify_chunk, ([(pred, gold)], timeout_s))
        try:
            return job.get(timeout=timeout_s + _POOL_GRACE_S)[0]
        except multiprocessing.TimeoutError:
            logger.warning("grading worker hung past %.1fs; restarting the pool", timeout_s)
            self._discard(pool)
            return False

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()


_FALLBACK_POOL = _FallbackPool()
atexit.register(_FALLBACK_POOL.close)


def answers_equal(pred: str, gold: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Whether an extracted answer ``pred`` equals ``gold`` (fast path, then math-verify)."""
    fast = _fast_compare(pred, gold)
    if fast is not None:
        return fast
    if timeout_s is None:
        return _verify_unbounded(pred, gold)
    if _alarm_available():
        return _verify_with_alarm(pred, gold, timeout_s)
    return _FALLBACK_POOL.verify(pred, gold, timeout_s)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def grade(response: str, gold: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """True when the final answer of ``response`` is equivalent to ``gold``.

    Safe from any thread or process; see the module docstring for how time is bounded.
    """
    pred = extract_answer(response)
    if pred is None:
        return False
    return answers_equal(pred, str(gold), timeout_s=timeout_s)


def reward(response: str, gold: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when ``grade`` says correct, else 0.0."""
    return 1.0 if grade(response, gold, timeout_s=timeout_s) else 0.0


def grade_many(
    responses: Sequence[str],
    golds: Sequence[str],
    *,
    workers: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    chunk_size: int = 32,
) -> list[bool]:
    """Grade ``responses[i]`` against ``golds[i]`` for every ``i``.

    Extraction and the fast path run in the caller. The rest go to math-verify: in-process when
    ``workers`` is 0 or 1 (or, with ``workers=None``, when fewer than 256 remain), else in a
    ``spawn`` process pool of ``workers`` processes (``None``: up to 8, one per CPU), in chunks
    of ``chunk_size``, each answer bounded by ``timeout_s``.
    """
    if len(responses) != len(golds):
        raise ValueError(f"grade_many: {len(responses)} responses but {len(golds)} gold answers")
    results: list[bool] = [False] * len(responses)
    pending: list[tuple[int, str, str]] = []
    for i, (resp, gold) in enumerate(zip(responses, golds, strict=True)):
        pred = extract_answer(resp)
        if pred is None:
            continue
        gold = str(gold)
        fast = _fast_compare(pred, gold)
        if fast is None:
            pending.append((i, pred, gold))
        else:
            results[i] = fast
    if not pending:
        return results

    if workers is None:
        workers = 1 if len(pending) < _MIN_BATCH_FOR_POOL else min(8, os.cpu_count() or 1)
    if workers <= 1:
        for i, pred, gold in pending:
            results[i] = answers_equal(pred, gold, timeout_s=timeout_s)
        return results

    chunks = [pending[s : s + chunk_size] for s in range(0, len(pending), chunk_size)]
    pool = _spawn_pool(workers)
    try:
        jobs = [
            pool.apply_async(_verify_chunk, ([(p, g) for _, p, g in chunk], timeout_s))
            for chunk in chunks
        ]
        deadline_per_chunk = timeout_s * chunk_size + _POOL_GRACE_S
        for chunk, job in zip(chunks, jobs, strict=True):
            try:
                oks = job.get(timeout=deadline_per_chunk)
            except multiprocessing.TimeoutError:
                logger.warning("a grading chunk hung; its %d answers count as wrong", len(chunk))
                continue
            for (i, _, _), ok in zip(chunk, oks, strict=True):
                results[i] = ok
    finally:
        pool.terminate()
    return results
