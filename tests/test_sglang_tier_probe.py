"""The gate of the real-SGLang tier (``tests/sglang_real.py``): it skips only with the probe's
own reason, and only tp > 1 needs AMX. Stand-in interpreters play the SGLang environment."""

from __future__ import annotations

import json
import sys

import pytest
import sglang_real
from sglang_real import ALL_REDUCE_REASON, Probe, run_probe


def interpreter(tmp_path, body: str, name: str = "python") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_kernel_built_for_a_missing_instruction_skips_naming_the_signal(tmp_path):
    python = interpreter(
        tmp_path, 'echo "Fatal Python error: Illegal instruction" >&2\nkill -ILL $$'
    )
    reason = run_probe(python)
    assert reason == (
        f"SGLang's CPU kernel died of SIGILL (an instruction this CPU lacks) in {python}: "
        "Fatal Python error: Illegal instruction"
    )


def test_an_environment_without_the_kernel_skips_quoting_the_import_error():
    # sat's own interpreter has torch but not SGLang's kernel
    reason = run_probe(sys.executable)
    assert reason == (
        f"SGLang cannot run in {sys.executable} (exit 1): "
        "ModuleNotFoundError: No module named 'sgl_kernel'"
    )


def test_a_hanging_probe_is_stopped_and_named(tmp_path):
    python = interpreter(tmp_path, "exec sleep 60")
    assert run_probe(python, timeout_s=1) == f"the SGLang probe in {python} did not finish in 1 s"


def test_what_the_probe_prints_is_what_the_tier_reads(tmp_path):
    found = {"sglang": "0.5.23", "torch": "2.13.0+cpu", "capability": "AVX512"}
    found |= {"amx": False, "all_reduce": False}
    python = interpreter(tmp_path, f"echo 'noise'\necho 'PROBE {json.dumps(found)}'")
    assert run_probe(python) == Probe(python=python, **found)
    # a probe that exits 0 without its line is a failure, not a pass
    silent = interpreter(tmp_path, "echo 'warning: something' >&2", "silent")
    assert run_probe(silent) == f"SGLang cannot run in {silent} (exit 0): warning: something"


@pytest.mark.parametrize("all_reduce", [False, True])
def test_only_tp_above_one_needs_the_all_reduce(monkeypatch, all_reduce):
    found = Probe("py", "0.5.23", "2.13.0+cpu", "AVX512", amx=all_reduce, all_reduce=all_reduce)
    monkeypatch.setattr(sglang_real, "probe", lambda: found)
    assert sglang_real.sglang_python() == "py"  # tp 1 runs on either CPU
    if all_reduce:
        sglang_real.require_cpu_all_reduce()  # does not skip
    else:
        with pytest.raises(pytest.skip.Exception, match=r"needs AMX for SGLang's CPU all-reduce"):
            sglang_real.require_cpu_all_reduce()
        assert ALL_REDUCE_REASON == "needs AMX for SGLang's CPU all-reduce (tp > 1)"
