"""The numerics fingerprint (scripts/numerics_fingerprint.py) as a cross-machine check.

The script runs once per session (a subprocess: the portable pins must be set before torch
loads). On a CPU kind recorded in tests/data/numerics_fingerprint.json with the same torch
version, every op class must give the recorded bits. On a kind not recorded, the comparison
with the nearest recorded kind is reported in the skip reason (``-ra`` prints it: which op
classes differ there) and the test does not fail: nothing says what such a kind should give
until someone records it (``--record``). Repeatability and the torch-only imports are checked
on every kind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sat_cli.numerics import NUMERIC_VARS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "numerics_fingerprint.py"
RECORDED = ROOT / "tests" / "data" / "numerics_fingerprint.json"


@pytest.fixture(scope="module")
def fingerprint(tmp_path_factory):
    out = tmp_path_factory.mktemp("fingerprint") / "fp.json"
    env = {k: v for k, v in os.environ.items() if k not in NUMERIC_VARS}
    args = [sys.executable, str(SCRIPT), "--out", str(out), "--compare", str(RECORDED)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 2:  # not x86-64 with AVX2: the portable pins do not apply
        pytest.skip(proc.stderr.strip())
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def _load_script():
    spec = importlib.util.spec_from_file_location("numerics_fingerprint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fingerprint_is_repeatable_pinned_and_needs_torch_only(fingerprint):
    _, fp, _ = fingerprint
    recorded = json.loads(RECORDED.read_text())["entries"]
    assert all(set(e["ops"]) <= set(fp["ops"]) for e in recorded)  # no class recorded but gone
    portable = [e for e in recorded if e["mode"] == "portable"]
    assert set().union(*(e["ops"] for e in portable)) == set(fp["ops"])  # each class on a kind
    assert [n for n, op in fp["ops"].items() if not op["repeatable"]] == []
    assert fp["machine"]["cpu_capability"] == "AVX2" and fp["machine"]["num_threads"] == 1
    assert "MKL_CBWR=COMPATIBLE" in fp["machine"]["numeric_env"]
    assert all(m.startswith("sat_cli") for m in fp["imports_before_torch"])


def test_fingerprint_matches_the_recorded_cpu_kind(fingerprint):
    status, fp, stdout = fingerprint
    cmp = fp["comparison"]
    if not cmp["matched"]:
        differs = [n for n, v in cmp["classes"].items() if v != "equal"]
        a = cmp["against"]
        pytest.skip(
            f"CPU kind not recorded ({fp['machine']['cpu_model']}, torch "
            f"{fp['machine']['torch']}); against the nearest ({a['cpu_model']}, torch "
            f"{a['torch']}) these op classes differ: {', '.join(differs) or 'none'}"
        )
    assert cmp["parts_differing"] == {}, stdout
    assert set(cmp["classes"].values()) == {"equal"} and status == 0


def test_compare_matches_the_kind_and_names_what_differs():
    mod = _load_script()
    machine = {"cpu_vendor": "V", "cpu_model": "M", "isa_flags": "avx2 fma", "torch": "2.0"}
    ops = {
        "a": {"hash": "1", "parts": {"x": "1"}},
        "b": {"hash": "2", "parts": {"y": "2", "z": "3"}},
    }
    this = {"mode": "portable", "machine": machine, "ops": ops}
    other_ops = {
        "a": {"hash": "1", "parts": {"x": "1"}},
        "b": {"hash": "9", "parts": {"y": "2", "z": "8"}},
    }
    other = {"mode": "portable", "machine": {**machine, "cpu_model": "N"}, "ops": other_ops}
    old_torch = {"mode": "portable", "machine": {**machine, "torch": "1.0"}, "ops": ops}
    default = {"mode": "default", "machine": machine, "ops": ops}
    # the same kind recorded: matched, equal
    got = mod.compare(this, [other, {"mode": "portable", "machine": machine, "ops": ops}, default])
    assert got["matched"] and got["classes"] == {"a": "equal", "b": "equal"}
    # a kind not recorded: the nearest is the same torch version and mode, and b's part z differs
    got = mod.compare(this, [old_torch, default, other])
    assert not got["matched"] and got["against"]["cpu_model"] == "N"
    assert got["classes"] == {"a": "equal", "b": "differs"} and got["parts_differing"] == {
        "b": ["z"]
    }
    assert mod.compare(this, [])["against"] is None


def test_recorded_portable_kinds_agree_class_by_class():
    """The portable mode's claim, in the recorded data: every class two recorded kinds (of one
    torch version) both hold gives the same bits on both. Two vendors are recorded (the kinds
    in bench/README.md); a kind recorded later that disagrees fails here."""
    recorded = json.loads(RECORDED.read_text())["entries"]
    portable = [e for e in recorded if e["mode"] == "portable"]
    assert len({e["machine"]["cpu_vendor"] for e in portable}) >= 2
    disagree = []
    for a in portable:
        for b in portable:
            if a is b or a["machine"]["torch"] != b["machine"]["torch"]:
                continue
            for name in set(a["ops"]) & set(b["ops"]):
                if a["ops"][name]["hash"] != b["ops"][name]["hash"]:
                    disagree.append((a["machine"]["cpu_model"], b["machine"]["cpu_model"], name))
    assert disagree == []


def test_compare_borrows_a_class_the_kind_lacks_from_the_agreeing_kinds():
    """A class added or redefined after a kind was recorded is compared, in portable mode, with
    the value the other kinds agree on; with no agreement (or in default mode) it is missing."""
    mod = _load_script()
    m = {"cpu_vendor": "V", "cpu_model": "M", "isa_flags": "avx2 fma", "torch": "2.0"}
    op = lambda h: {"hash": h, "parts": {"x": h}}  # noqa: E731
    this = {"mode": "portable", "machine": m, "ops": {"a": op("1"), "new": op("5")}}
    mine = {"mode": "portable", "machine": m, "ops": {"a": op("1")}}
    amd = {"mode": "portable", "machine": {**m, "cpu_model": "A"}, "ops": {"new": op("5")}}
    zen = {"mode": "portable", "machine": {**m, "cpu_model": "Z"}, "ops": {"new": op("5")}}
    got = mod.compare(this, [mine, amd, zen])
    assert got["matched"] and got["classes"] == {"a": "equal", "new": "equal"}
    assert got["borrowed"] == {"new": ["A", "Z"]}
    other = {**this, "ops": {"a": op("1"), "new": op("6")}}
    got = mod.compare(other, [mine, amd])
    assert got["classes"]["new"] == "differs" and got["parts_differing"] == {"new": ["x"]}
    odd = {**zen, "ops": {"new": op("7")}}  # the other kinds disagree: nothing to compare with
    assert mod.compare(this, [mine, amd, odd])["classes"]["new"] == "missing"
    default = {**this, "mode": "default"}
    got = mod.compare(default, [{**mine, "mode": "default"}, amd])
    assert got["classes"]["new"] == "missing" and got["borrowed"] == {}
