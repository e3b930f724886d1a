"""Method labels and row order of `sat report`'s tables: the label a run's config gives
(``derive_method``: ``SAT-GSPO w/ TIS w/ R3``) and the order of the rows (``row_order``: the
sweep's method order, else the paper's Table 1 order, then the other axes' values)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sat_cli.report.regime import lag_key

if TYPE_CHECKING:
    from sat_cli.report.tables import RunData

# The rows of the paper's Table 1 (ALGORITHMS.md §9), then the baselines beyond the paper: the
# order used when a sweep gives none.
PAPER_ORDER = (
    "GRPO",
    "GSPO",
    "GRPO w/ R3",
    "GSPO w/ R3",
    "GRPO w/ TIS",
    "GSPO w/ TIS",
    "GRPO w/ TIS w/ R3",
    "GSPO w/ TIS w/ R3",
    "DPPO (TV)",
    "SAT-GRPO",
    "SAT-GSPO",
    "SAT-GRPO w/ R3",
    "SAT-GSPO w/ R3",
    "A-3PO",
    "VCPO",
)
_ALGO_NAMES = {
    "grpo": "GRPO",
    "gspo": "GSPO",
    "gspo_token": "GSPO-token",
    "dppo_tv": "DPPO (TV)",
    "ppo": "PPO",
    "decoupled_ppo": "Decoupled PPO",
    "m2po": "M2PO",
    "a3po": "A-3PO",
    "vcpo": "VCPO",
}


def derive_method(algo: str | None, clip: str | None, correction: str | None, r3: Any) -> str:
    """Method label from the config: ``SAT-GSPO w/ TIS w/ R3``, ``DPPO (TV)``, ``GRPO``."""
    name = _ALGO_NAMES.get(str(algo), str(algo or "?").upper())
    if clip == "sat":
        name = f"SAT-{name}"
    elif clip == "sat_anchored":
        name = f"SAT-{name} (anchored)"
    elif clip not in (None, "", "ppo"):
        name = f"{name} [clip={clip}]"
    if correction not in (None, "", "none"):
        name += f" w/ {str(correction).upper()}"
    if str(r3).lower() in ("true", "1"):
        name += " w/ R3"
    return name


# ----------------------------------------------------------------------------- data


def row_order(runs: list[RunData], methods: list[str] | None) -> list[str]:
    """Rows in the sweep's method order (else the paper's), then by the other axes' values
    (numbers numerically), then by first appearance."""
    order = list(methods or PAPER_ORDER)
    seen: list[str] = []
    for r in runs:
        if r.row not in seen:
            seen.append(r.row)

    def rank(row: str) -> tuple:
        method = next(
            (
                m
                for m in sorted(order, key=len, reverse=True)
                if row == m or row.startswith(m + " · ")
            ),
            None,
        )
        head, *rest = row.split(" · ")
        first = next(i for i, r in enumerate(seen) if r.split(" · ")[0] == head)
        axes = tuple(lag_key(v.partition("=")[2]) for v in rest)
        return (order.index(method) if method is not None else len(order), first, axes)

    return sorted(seen, key=rank)
