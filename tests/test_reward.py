"""The math grader: extraction, equivalence, thread safety, time limits, and oracle checks on the
data (gold answers boxed score 100%; a shuffled-answer control scores near 0%): the shipped
evaluation sets in the default suite, the external training sets in slow tests."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from sat_cli.tasks import reward as R
from sat_cli.tasks.reward import answers_equal, extract_answer, grade, grade_many

DATA_FILES = ["aime24.jsonl", "aime25.jsonl", "math500.jsonl", "gsm8k_test.jsonl"]  # shipped
LARGE = {"gsm8k_train.jsonl", "deepmath_subset.jsonl"}  # external training sets

# (response, gold, expected)
GRADE_CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{033}", "33", True),
    ("\\boxed{33}", "033", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True),  # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", False),
    ("first \\boxed{7}, then corrected: \\boxed{9}", "9", True),  # last box wins
    ("first \\boxed{9}, then corrected: \\boxed{7}", "9", False),
    ("\\boxed{336}", "336^\\circ", True),
    ("\\boxed{336^\\circ}", "336", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True),
    ("\\boxed{\\sqrt{13}}", "2\\sqrt{3}", False),
    ("I do not know.", "5", False),  # no answer at all
    ("", "5", False),
    ("The answer is 5", "5", False),  # neither a box nor an Answer: line
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True),
    ("\\boxed{Evelyn}", "\\text{Evelyn}", True),
    ("\\boxed{\\text{Bob}}", "\\text{Evelyn}", False),
    ("\\boxed{33}", "336", False),  # wrong answer that is a substring of the gold
    ("\\boxed{336}", "33", False),
    ("\\boxed{3}", "336", False),
    ("Work...\nAnswer: 42", "42", True),
    ("Work...\nAnswer: $\\frac{14}{3}$", "\\frac{14}{3}", True),
    ("Answer: 41\nno wait\nAnswer: 42", "42", True),  # last Answer: line wins
    ("Answer: 4", "42", False),
    ("\\boxed{10}\nAnswer: 12", "10", True),  # a box beats an Answer: line
    ("\\fbox{12}", "12", True),
    ("so \\boxed 5.", "5", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "(3,\\frac{\\pi}{2})", True),
    (
        "\\boxed{\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]}",
        "[\\pi^2/8, 5\\pi^2/4]",
        True,
    ),
    ("\\boxed{x^2+1}", "1+x^2", True),
    ("\\boxed{2}", "2^{\\aleph_1}", False),  # math-verify parses 2^{\aleph_1} as 2
    ("\\boxed{12", "12", False),  # truncated box is no answer
    ("\\boxed{579}", "579", True),  # the toy task's format
]


@pytest.mark.parametrize(("response", "gold", "expected"), GRADE_CASES)
def test_grade_table(response: str, gold: str, expected: bool) -> None:
    assert grade(response, gold) is expected
    assert R.reward(response, gold) == (1.0 if expected else 0.0)


EXTRACT_CASES = [
    ("a \\boxed{\\frac{a}{b}} b", "\\frac{a}{b}"),
    ("\\boxed{1} and \\boxed{2}", "2"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed 7 apples", "7"),
    ("\\fbox{x}", "x"),
    ("\\boxed{}", None),
    ("\\boxed{3", None),
    ("\\boxed{5} then, cut off: \\boxed{12", None),  # the last box decides, even when broken
    ("Answer: $42$", "42"),
    ("**Final Answer:** 7.", "7"),
    ("Answer:\n  12", "12"),
    ("Final Answer: The final answer is $5$. I hope it is correct.", "5"),
    ("answer: y=2", "y=2"),
    ("no answer here", None),
]


@pytest.mark.parametrize(("response", "expected"), EXTRACT_CASES)
def test_extract_answer(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


def test_fast_path_settles_integers_without_sympy() -> None:
    # Pure-string / integer decisions never reach math-verify.
    assert R._fast_compare("033", "33") is True
    assert R._fast_compare("1,000", "1000") is True
    assert R._fast_compare("33", "336") is False
    assert R._fast_compare("0.5", "0.50") is True
    assert R._fast_compare("\\sqrt{12}", "2\\sqrt{3}") is None


def _run_in_thread(fn):
    out: list = []
    err: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # surfaced to the test thread below
            err.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "grading thread hung"
    if err:
        raise err[0]
    return out[0]


def test_grade_from_worker_thread() -> None:
    # Needs math-verify (not the fast path): bounded through the process pool from a thread.
    cases = [
        ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\sqrt{13}}", "2\\sqrt{3}", False),
        ("\\boxed{33}", "336", False),
    ]
    got = _run_in_thread(lambda: [grade(r, g) for r, g, _ in cases])
    assert got == [c[2] for c in cases]
    # Without a time limit the comparison runs in the calling thread itself.
    got = _run_in_thread(lambda: [grade(r, g, timeout_s=None) for r, g, _ in cases])
    assert got == [c[2] for c in cases]


def test_grade_from_many_threads_at_once() -> None:
    # Four threads share the fallback process pool; each gets its own answers back.
    cases = [c for c in GRADE_CASES if R._fast_compare(extract_answer(c[0]) or "", c[1]) is None]
    assert len(cases) >= 8  # these really reach math-verify
    results: dict[int, list[bool]] = {}

    def work(k: int) -> None:
        results[k] = [grade(r, g) for r, g, _ in cases[k::4]]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a grading thread hung"
    for k in range(4):
        assert results[k] == [e for _, _, e in cases[k::4]]


def test_timeout_counts_as_wrong_and_returns() -> None:
    # sympy tries to evaluate 2^(2^2001); unbounded this ran past a 60 s kill here.
    gold = "(1 + i)\\left(1 - 2^{-2^{2001}}\\right)"
    handler_before = R.signal.getsignal(R.signal.SIGALRM)
    t0 = time.monotonic()
    assert answers_equal("\\dfrac{4}{3}", gold, timeout_s=0.5) is False
    assert time.monotonic() - t0 < 5.0
    # our timer is cancelled and the previous SIGALRM handler is back
    assert R.signal.getitimer(R.signal.ITIMER_REAL) == (0.0, 0.0)
    assert R.signal.getsignal(R.signal.SIGALRM) == handler_before


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\dfrac{4}{3}", "(1 + i)\\left(1 - 2^{-2^{2001}}\\right)"),
        ("1", "10^{10^{8}}"),
        ("1", "(10^{6})!"),
        ("1", "\\binom{10^{9}}{5 \\cdot 10^{8}}"),
        ("2^{-10^{30}}", "0"),
        ("\\frac{3}{7^{9^{12}}}", "1"),
    ],
)
def test_a_number_no_time_limit_can_stop_counts_as_wrong_at_once(pred: str, gold: str) -> None:
    """Each makes sympy build one exact number of 10^8+ digits in C code, which no SIGALRM
    interrupts (one grew a test worker to 18 GB): refused before math-verify runs, both ways."""
    for a, b in ((pred, gold), (gold, pred)):
        t0 = time.monotonic()
        assert answers_equal(a, b, timeout_s=60.0) is False
        assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("2^{2^{3}}", "256"),
        ("\\frac{1}{2^{100}}", "2^{-100}"),
        ("10!", "3628800"),
        ("3^{3^{3}}", "7625597484987"),
        ("2^{330000}", "2^{330000}\\cdot 1"),
        ("(101!)^{100}", "(101!)^{100}"),
    ],
)
def test_numbers_under_the_bound_still_grade(pred: str, gold: str) -> None:
    # 2^330000 has 99,340 digits: just under the bound (number_bound.MAX_EXACT_LOG10)
    assert answers_equal(pred, gold, timeout_s=30.0) is True


def test_grade_many_matches_grade_and_checks_lengths() -> None:
    responses = [c[0] for c in GRADE_CASES]
    golds = [c[1] for c in GRADE_CASES]
    expected = [c[2] for c in GRADE_CASES]
    assert grade_many(responses, golds, workers=1) == expected
    assert grade_many(responses, golds, workers=2, chunk_size=4) == expected
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        grade_many(["a", "b"], ["a"])


# --------------------------------------------------------------------------------------------
# Oracle checks on the shared data
# --------------------------------------------------------------------------------------------


def _rows(folder, name: str) -> list[dict]:
    text = (folder / name).read_text("utf-8")
    # not splitlines(): U+2028 occurs in strings
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def _oracle(folder, name: str) -> None:
    rows = _rows(folder, name)
    golds = [r["answer"] for r in rows]
    responses = [f"Reasoning ... so the final answer is \\boxed{{{g}}}." for g in golds]
    # 1) the public grader: every boxed gold answer is correct
    failures = [
        (r["id"], g)
        for r, g, ok in zip(rows, golds, grade_many(responses, golds), strict=True)
        if not ok
    ]
    assert failures == [], f"{name}: {len(failures)} gold answers fail grade(): {failures[:10]}"
    # 2) math-verify alone (the fast path bypassed) self-matches every gold answer
    mv_fail = [
        (r["id"], g)
        for r, g in zip(rows, golds, strict=True)
        if not R._verify_with_alarm(extract_answer(f"\\boxed{{{g}}}"), g, R.DEFAULT_TIMEOUT_S)
    ]
    assert mv_fail == [], f"{name}: math-verify fails to self-match {mv_fail[:10]}"


def _shuffled_control(folder, name: str) -> None:
    rows = _rows(folder, name)
    golds = [r["answer"] for r in rows]
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    # each row gets the gold answer of the next row in a shuffled cycle: no row keeps its own
    wrong = [""] * len(rows)
    for j, i in enumerate(order):
        wrong[i] = golds[order[(j + 1) % len(order)]]
    ok = grade_many([f"\\boxed{{{w}}}" for w in wrong], golds, timeout_s=2.0)
    rate = sum(ok) / len(rows)
    # Chance collisions (GSM8K has many repeated integers, DeepMath many 0/1) are real matches;
    # anything the grader accepts beyond identical strings must stay rare.
    same_text = sum(R._normalize(w) == R._normalize(g) for w, g in zip(wrong, golds, strict=True))
    assert rate < 0.05, f"{name}: shuffled answers score {100 * rate:.1f}%"
    assert sum(ok) - same_text <= 0.01 * len(rows) + 1, (
        f"{name}: {sum(ok) - same_text} shuffled answers accepted beyond identical strings"
    )


@pytest.mark.parametrize("name", DATA_FILES)
def test_oracle_gold_scores_100(benchmark_data, name: str) -> None:
    _oracle(benchmark_data, name)


@pytest.mark.parametrize("name", ["aime24.jsonl", "aime25.jsonl", "math500.jsonl"])
def test_shuffled_control_scores_near_zero(benchmark_data, name: str) -> None:
    _shuffled_control(benchmark_data, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGE))
def test_oracle_training_sets(training_data, name: str) -> None:
    _oracle(training_data, name)


@pytest.mark.slow
def test_shuffled_control_gsm8k_test(benchmark_data) -> None:
    _shuffled_control(benchmark_data, "gsm8k_test.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGE))
def test_shuffled_control_training_sets(training_data, name: str) -> None:
    _shuffled_control(training_data, name)
