"""The estimators of an evaluation (ALGORITHMS.md §8): ``avg@k`` (mean over samples, then over
problems, as a percent) and the unbiased ``pass@k`` in product form."""

from __future__ import annotations

from collections.abc import Sequence


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Percent: mean over problems of the mean over that problem's samples."""
    if not correct:
        raise ValueError("avg_at_k: no problems")
    total = 0.0
    for i, flags in enumerate(correct):
        if not flags:
            raise ValueError(f"avg_at_k: problem {i} has no samples")
        total += sum(bool(f) for f in flags) / len(flags)
    return 100.0 * total / len(correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (a probability in [0, 1]): ``1 − C(n−c,k)/C(n,k)``.

    ``C(n−c,k)/C(n,k) = Π_{i=n−c+1..n} (1 − k/i)``, so no factorial is ever formed.
    """
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_table(correct: Sequence[Sequence[bool]]) -> dict[int, float]:
    """``{k: percent}`` for ``k = 1 .. min_n``, each the mean over problems of ``pass_at_k``."""
    if not correct:
        raise ValueError("pass_at_k_table: no problems")
    min_n = min(len(flags) for flags in correct)
    if min_n == 0:
        raise ValueError("pass_at_k_table: a problem has no samples")
    counts = [(len(flags), sum(bool(f) for f in flags)) for flags in correct]
    return {
        k: 100.0 * sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        for k in range(1, min_n + 1)
    }
