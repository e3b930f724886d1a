"""An engine started on this machine must be able to run on its CPU (``check_host``): SGLang's
CPU kernel is compiled for x86-64-v4, so ``engine=sglang engine.device=cpu`` on a CPU without
AVX-512 is refused before anything starts (it used to start the server and end with "exited with
code -4 before ready": SIGILL). The CPU is faked with ``$SAT_CPUINFO`` (a file in
/proc/cpuinfo's format, read by ``sat_cli.numerics.cpu_info``)."""

from __future__ import annotations

import pytest
from cli_helpers import run_sat
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_cli.engines.sglang.settings import SGLangEngineSettings
from sat_cli.errors import UserError
from sat_cli.numerics import cpu_info

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse sse2 avx f16c fma bmi1 avx2 bmi2 sha_ni vaes
"""
ZEN4 = ZEN3.replace("7763 64-Core", "9654 96-Core").replace(
    "vaes", "vaes avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"
)
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
V4 = ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]


def _fake(tmp_path, text, monkeypatch=None):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    if monkeypatch is not None:
        monkeypatch.setenv("SAT_CPUINFO", str(path))
    return path


def test_sglang_on_a_cpu_without_avx512_is_refused_before_anything_starts(tmp_path, monkeypatch):
    _fake(tmp_path, ZEN3, monkeypatch)
    run_dir = tmp_path / "runs"
    args = ["train", "engine=sglang", "engine.device=cpu", f"run.dir={run_dir}"]
    out = run_sat(*args, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("sat: error: engine=sglang engine.device=cpu needs AVX-512")
    assert "AMD EPYC 7763" in line and f"lacks {', '.join(V4)};" in line
    assert "use engine=local" in line
    assert not run_dir.exists()  # nothing written, no server started


def test_check_host_follows_the_cpu_flags(tmp_path, monkeypatch):
    cpu = SGLangEngineSettings(device="cpu")
    _fake(tmp_path, ZEN3, monkeypatch)
    with pytest.raises(UserError, match="lacks avx512f, avx512bw, avx512cd, avx512dq, avx512vl;"):
        cpu.check_host()
    # servers started elsewhere, or SGLang on a GPU: this CPU does not run the kernel
    SGLangEngineSettings(device="cpu", urls=["http://10.0.0.5:30000"]).check_host()
    SGLangEngineSettings(device="cuda").check_host()
    _fake(tmp_path, ZEN4, monkeypatch)
    cpu.check_host()  # AVX-512 without AMX serves (docs/sglang.md, "CPUs tried")
    _fake(tmp_path, ZEN4.replace(" avx512dq", ""), monkeypatch)
    with pytest.raises(
        UserError, match=r"\(AMD EPYC 9654 96-Core Processor\), which lacks avx512dq;"
    ):
        cpu.check_host()
    _fake(tmp_path, ARM, monkeypatch)  # no x86 flags line: not known, not refused
    assert cpu_info()["flags"] == set()
    cpu.check_host()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_cpu_info_of_any_text(tmp_path_factory, text):
    """Whatever the file holds, cpu_info returns a model string and a set of flags."""
    path = tmp_path_factory.getbasetemp() / "fuzzed_cpuinfo"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    got = cpu_info(str(path))
    assert isinstance(got["model"], str) and got["model"]
    assert isinstance(got["flags"], set) and all(isinstance(f, str) for f in got["flags"])
    assert isinstance(got["vendor"], str) and got["vendor"]
