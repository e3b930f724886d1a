"""The hostile probe (``tests/hostile_probe.py``) under pytest: every case through the real
command line, ``slow`` (each is a `sat` subprocess; ``make test-full``). The default suite keeps
the cases of the classes this round added (a model folder's files, the weight-sync address);
the other classes have their representatives there already (``tests/test_bad_input.py``'s
default catalogue cases, ``tests/test_input_surfaces.py``'s refusals through the command line)."""

from __future__ import annotations

import pytest
from hostile_probe import CASES, run_case

DEFAULT = {"model-layers-1e5", "sync-address-unresolvable"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[] if c.name in DEFAULT else [pytest.mark.slow]) for c in CASES],
    ids=[c.name for c in CASES],
)
def test_a_hostile_case_is_one_line_exit_2_and_writes_nothing(case, tmp_path):
    held, why, _ = run_case(case, tmp_path)
    assert held, why


def test_the_probe_covers_every_class_of_the_issue():
    classes = {c.cls for c in CASES}
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
    assert classes >= {
        "group grammar",
        "ignored settings",
        "user files",
        "model folder",
        "command options",
        "derived settings",
        "environment",
        "refusals leave nothing",
        "reports on nothing",
    }
