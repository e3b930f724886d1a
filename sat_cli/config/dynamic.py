"""``algo.dynamic_sampling``: DAPO's dynamic sampling (docs/algorithms.md §2, "Dynamic sampling"), torch-free.

Off by default (``enabled: false``: the run is the one without it, bit for bit). On, a group
whose rewards have a population standard deviation ``<= std_tol`` is never trained on, and a
step whose first generation batch keeps fewer than ``task.prompts_per_step`` groups draws up to
``max_gen_batches - 1`` more (the loop's side: ``sat_cli.loop.dynamic``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sat_cli.validate import check_range

# the most generation batches one step may draw: its refill prompts are reserved in the data
# order per step (as sat_cli.loop.dynamic.REFILL_SLOTS, tested equal): part of the data order
MAX_GEN_BATCHES = 64
MAX_STD_TOL = 1e6  # a tolerance this large drops every group: refused above it


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False
    # a group is dropped when the population std of its rewards is <= std_tol (0: equal rewards)
    std_tol: float = 0.0
    # generation batches (each task.prompts_per_step prompts) one step may draw, the first one
    # included; at the bound the step trains on the groups it kept (dynamic/groups_short > 0)
    max_gen_batches: int = 3

    def __post_init__(self) -> None:
        check_range("algo.dynamic_sampling.std_tol", self.std_tol, 0, MAX_STD_TOL)
        check_range(
            "algo.dynamic_sampling.max_gen_batches", self.max_gen_batches, 1, MAX_GEN_BATCHES
        )


def plan_line(task, d: DynamicSamplingConfig) -> str | None:
    """`sat plan`'s line of dynamic sampling (None: off): the batch it refills and its bound."""
    if not d.enabled:
        return None
    p, n = task.prompts_per_step, task.samples_per_prompt
    return (
        f"batch     {p} groups of {n} per step, dynamic sampling: groups with reward std <= "
        f"{d.std_tol:g} dropped, refilled with up to {d.max_gen_batches - 1} more generation "
        f"batches of {p} prompts ({d.max_gen_batches * p * n} samples at most per step)"
    )
