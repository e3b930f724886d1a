"""The suite's xdist groups hold. Under ``make test`` (``--dist loadgroup``) a test marked
``xdist_group`` carries its group in its node id, which is how pytest-xdist sends the whole group
to one worker: the tests that share an engine, an SGLang server or the Ray cluster then build it
once. pytest 9.2 with pytest-xdist 3.8 drops the suffix without a word
(pytest-dev/pytest-xdist#1386; pyproject.toml pins pytest below 9.2): this test fails then."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("xdist_guard")


def test_loadgroup_keeps_the_group_in_the_node_id(request):
    if not getattr(request.config.option, "loadgroup", False):
        return  # not under --dist loadgroup (plain pytest, -n0): no grouping to check
    assert request.node.nodeid.endswith("@xdist_guard"), (
        f"node id {request.node.nodeid!r} lost its xdist group: this pytest/pytest-xdist pair "
        "does not group tests (pytest-dev/pytest-xdist#1386); install pytest<9.2"
    )
