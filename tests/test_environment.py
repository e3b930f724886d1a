"""The hardware and numeric environment a run records (sat_cli/tracking/environment.py), the
portable-numerics pins (sat_cli/numerics.py) reaching every process of a run, and `sat report`'s
warning when it compares runs of different machines or settings.

The expected values are read here independently of the code under test: the CPU model and flags
from /proc/cpuinfo by this file's own parser, ATen's capability from a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import MEGATRON_SMOKE, run_sat, seeded_store

from sat_cli.numerics import (
    PORTABLE_ENV,
    PortableError,
    cpu_info,
    isa_summary,
    numeric_env,
    pin,
)
from sat_cli.tracking.environment import (
    compare_environments,
    current_names,
    environment_params,
    parse_library_versions,
)

SMOKE = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.n=1",
    "eval.every=0",
    "max_steps=1",
    "run.dir=runs",
]

SPR = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: another model (not read)
"""
ZEN4 = """processor : 0
vendor_id : AuthenticAMD
model name : AMD EPYC 9654 96-Core Processor
flags : fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16
"""


def _proc_cpuinfo() -> tuple[str, set[str]]:
    """This machine's first CPU model and flags, parsed here (not by sat_cli)."""
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split())
    return " ".join(model.split()), flags


def _native_capability() -> str:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()


def _client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def _only_run(root: Path, experiment: str):
    client = _client(root)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


# ----------------------------------------------------------------------------- pure parts


def test_library_versions_from_torch_config_text():
    text = (
        "PyTorch built with:\n  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product "
        "Build 20240605 for Intel(R) 64 architecture applications\n  - Intel(R) MKL-DNN v3.12.0 "
        "(Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)\n  - OpenMP 201511"
    )
    assert parse_library_versions(text) == {"mkl": "2024.2", "onednn": "3.12.0"}
    old = (
        "  - Intel(R) Math Kernel Library Version 2020.0.0 Product\n  - oneDNN v2.7.3 (Git Hash x)"
    )
    assert parse_library_versions(old) == {"mkl": "2020.0.0", "onednn": "2.7.3"}
    arm = "  - LAPACK is enabled\n  - Build settings: USE_MKL=OFF, USE_MKLDNN=OFF, "
    assert parse_library_versions(arm) == {"mkl": "none", "onednn": "none"}
    assert parse_library_versions("garbled") == {"mkl": "unknown", "onednn": "unknown"}


def test_cpu_info_and_isa_summary_of_hand_written_cpuinfo(tmp_path):
    (tmp_path / "spr").write_text(SPR)
    (tmp_path / "zen4").write_text(ZEN4)
    spr, zen = cpu_info(str(tmp_path / "spr")), cpu_info(str(tmp_path / "zen4"))
    assert spr["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert zen["model"] == "AMD EPYC 9654 96-Core Processor"
    assert spr["vendor"] == "GenuineIntel" and zen["vendor"] == "AuthenticAMD"
    assert cpu_info(str(tmp_path / "absent"))["vendor"] == "unknown"
    assert isa_summary(spr["flags"]) == {
        "amx": "true",
        "avx512": "true",
        "avx2": "true",
        "flags": "avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 "
        "amx_int8",
    }
    assert isa_summary(zen["flags"])["amx"] == "false"
    assert isa_summary(zen["flags"])["avx512"] == "true"
    assert isa_summary({"sse2"}) == {
        "amx": "false",
        "avx512": "false",
        "avx2": "false",
        "flags": "none",
    }
    assert isa_summary(set())["avx2"] == "unknown"


def test_pins_are_set_in_the_environment_given():
    env: dict[str, str] = {"PATH": "/bin", "MKL_CBWR": "AUTO"}
    pins = pin(3, env, cpu_flags={"avx2", "fma"})
    assert pins == {**PORTABLE_ENV, "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_CBWR"] == "COMPATIBLE" and env["MKL_DYNAMIC"] == "FALSE"
    assert env["PATH"] == "/bin"
    assert numeric_env(env) == (
        "ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE MKL_DYNAMIC=FALSE "
        "MKL_NUM_THREADS=3 OMP_DYNAMIC=FALSE OMP_NUM_THREADS=3 ONEDNN_MAX_CPU_ISA=AVX2"
    )
    assert numeric_env({"PATH": "/bin"}) == "none"


def test_pins_refuse_a_cpu_without_the_pinned_path_and_a_late_call():
    env: dict[str, str] = {}
    with pytest.raises(PortableError, match="this CPU lacks avx2, fma"):
        pin(1, env, cpu_flags={"sse2", "avx"})
    assert env == {}  # nothing set
    import torch  # noqa: F401 - imported: the pins would come too late for this process

    with pytest.raises(PortableError, match="before torch is imported"):
        pin(1)


def test_environment_comparison_hand_cases():
    a = {
        "machine.cpu.model": "Intel A",
        "machine.cpu.flags": "avx2",
        "machine.torch.version": "2.13.0",
    }
    b = {**a, "machine.cpu.model": "AMD B"}
    c = {**a, "machine.torch.version": "2.14.1", "run.portable_numerics": "true"}
    assert compare_environments([("r1", a), ("r2", dict(a))]) == []
    assert compare_environments([("r1", a)]) == []
    (hw,) = compare_environments([("r1", a), ("r2", a), ("r3", b)])
    assert hw.startswith("WARNING: the runs compared here were made on different hardware")
    assert "machine.cpu.model: 'Intel A' (2 runs), 'AMD B' (1 run)" in hw
    (num,) = compare_environments([("r1", a), ("r3", c)])
    assert "different numeric settings" in num
    assert "machine.torch.version: '2.13.0' (1 run), '2.14.1' (1 run)" in num
    assert "run.portable_numerics: 'unknown' (1 run), 'true' (1 run)" in num
    # the config's env section (multi-turn rollouts) and run.portable_numerics are no record
    old = {"algo.name": "grpo", "env.name": "none", "run.portable_numerics": "false"}
    hw, unknown = compare_environments([("r1", a), ("r3", b), ("old", old)])
    assert unknown.startswith("WARNING: hardware and numeric settings unknown for 1 of 3 runs")
    assert "(not recorded: old)" in unknown
    (none,) = compare_environments([("o1", {}), ("o2", {})])
    assert none.startswith("hardware and numeric settings unknown for all runs")


def test_runs_recorded_with_the_old_env_prefix_are_compared_under_todays_names():
    old = {"env.cpu.model": "Intel A", "env.gpu": "none", "env.name": "guess", "env.gpu_count": "2"}
    assert current_names(old) == {
        "machine.cpu.model": "Intel A",
        "machine.gpu": "none",
        "env.name": "guess",  # the config's env group stays where it is
        "env.gpu_count": "2",
    }
    new = {"machine.cpu.model": "AMD B", "env.cpu.model": "an environment's own option"}
    assert current_names(new) == new  # a run with the record under machine.* is not renamed
    (hw,) = compare_environments([("old", old), ("new", new)])
    assert "machine.cpu.model: 'Intel A' (1 run), 'AMD B' (1 run)" in hw


@pytest.mark.parametrize("env", ["none", "guess", "calculator"])
def test_the_machine_record_cannot_collide_with_a_config_param(env):
    """No config key starts with ``machine.`` (no group or option has that name), so the
    record (``environment_params``) and the config's params (the ``env`` group of a multi-turn
    run included) are disjoint by construction, not by luck."""
    from omegaconf import OmegaConf

    from sat_cli.config import compose
    from sat_cli.tracking.params import flatten_config

    config = flatten_config(OmegaConf.to_container(compose([f"env={env}"]), resolve=True))
    record = environment_params()
    assert config and all(k.startswith("machine.") for k in record)
    assert not [k for k in config if k.split(".")[0] == "machine"]
    if env != "none":
        assert any(k.startswith("env.") for k in config)  # the env group's own params
    assert not set(config) & set(record)


def test_sglang_version_is_asked_from_its_interpreter(tmp_path, repo):
    from sat_cli.tracking.environment import sglang_version

    assert sglang_version(sys.executable) == "unknown"  # sat's own env has no sglang
    assert sglang_version(str(tmp_path / "no-python")) == "unknown"
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    assert sglang_version(str(slow), timeout_s=0.5) == "unknown"
    sglang_python = repo / ".venv-sglang" / "bin" / "python"
    if sglang_python.exists():  # `make sglang-cpu` builds it
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        want = subprocess.run(
            [str(sglang_python), "-c", code], capture_output=True, text=True, timeout=60
        )
        assert sglang_version(str(sglang_python)) == want.stdout.strip() != ""


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow  # ~30 s; the in-process env tests stay
def test_sat_train_records_this_machines_environment(tmp_path):
    out = run_sat("train", *SMOKE, "run.name=env", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = _only_run(tmp_path / "runs", "sat")
    p, t = run.data.params, run.data.tags
    model, flags = _proc_cpuinfo()
    assert p["machine.cpu.model"] == model
    assert p["machine.cpu.amx"] == str("amx_tile" in flags).lower()
    assert p["machine.cpu.avx512"] == str("avx512f" in flags).lower()
    assert p["machine.cpu.avx2"] == str("avx2" in flags).lower()
    assert set(p["machine.cpu.flags"].split()) == flags & {
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    }
    assert p["machine.cpu.count"] == str(len(os.sched_getaffinity(0)))
    import torch

    native = _native_capability()
    assert p["machine.torch.cpu_capability"] == native
    assert p["machine.torch.version"] == torch.__version__
    assert p["machine.torch.num_threads"] == "1"  # trainer.num_threads, set before it is read
    config = torch.__config__.show()
    for key in ("machine.mkl.version", "machine.onednn.version"):
        assert p[key] in config, (key, p[key])
    assert p["machine.mkl.cbwr"] == (
        "OFF" if "MKL_CBWR" not in os.environ else p["machine.mkl.cbwr"]
    )
    assert p["machine.gpu"] == ("none" if not torch.cuda.is_available() else p["machine.gpu"])
    assert p["machine.numeric_env"] == numeric_env(os.environ)
    assert p["run.portable_numerics"] == "false" and p["trainer.device"] == "cpu"
    assert "machine.sglang.version" not in p
    # the engine worker's own view, as tags
    assert t["machine.engine.cpu_capability"] == native and t["machine.engine.num_threads"] == "1"


@pytest.mark.slow  # ~25 s; the in-process env tests stay
def test_sat_eval_records_the_environment(tmp_path):
    out = run_sat("eval", "toy", "eval.n=1", "eval.limit=4", "run.dir=runs", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    p = _only_run(tmp_path / "runs", "eval").data.params
    model, flags = _proc_cpuinfo()
    assert (
        p["machine.cpu.model"] == model
        and p["machine.cpu.avx512"] == str("avx512f" in flags).lower()
    )
    native = _native_capability()
    assert p["machine.torch.cpu_capability"] == native
    assert p["machine.engine.cpu_capability"] == native and p["machine.engine.num_threads"] == "1"


@pytest.mark.slow  # ~37 s; the pins are checked in process in this file
@pytest.mark.skipif("avx2" not in _proc_cpuinfo()[1], reason="portable mode pins AVX2")
def test_portable_pins_reach_the_cli_the_engine_worker_and_the_megatron_rank(tmp_path):
    """One run with portable numerics: the orchestrator (params), the local engine's worker
    (tags) and the Megatron rank (its start-up line) all run ATen's AVX2 kernels and MKL's
    COMPATIBLE branch — not what this CPU would pick on its own."""
    args = [*MEGATRON_SMOKE, "max_steps=1", "run.name=portable", "run.portable_numerics=true"]
    out = run_sat("train", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = _only_run(tmp_path / "runs", "sat")
    p, t = run.data.params, run.data.tags
    assert p["run.portable_numerics"] == "true"
    assert (p["machine.torch.cpu_capability"], p["machine.mkl.cbwr"]) == ("AVX2", "COMPATIBLE")
    assert "ATEN_CPU_CAPABILITY=avx2" in p["machine.numeric_env"]
    assert "OMP_NUM_THREADS=1" in p["machine.numeric_env"]
    assert (t["machine.engine.cpu_capability"], t["machine.engine.mkl_cbwr"]) == (
        "AVX2",
        "COMPATIBLE",
    )
    assert t["machine.engine.num_threads"] == "1"
    log = (tmp_path / "runs/sat/portable/logs/megatron_trainer.log").read_text()
    assert "ready (pid" in log, log[-2000:]
    assert "cpu_capability=AVX2 num_threads=1 mkl_cbwr=COMPATIBLE" in log, log[-2000:]
    # without the mode this machine would run other paths (where it has more than AVX2)
    if "avx512f" in _proc_cpuinfo()[1]:
        assert _native_capability() == "AVX512"


def test_portable_mode_refusals(tmp_path):
    for args, needle in [
        (["engine=sglang", "engine.device=cpu", "engine.dtype=bfloat16"], "needs engine=local"),
        (["engine.device=cuda"], "CUDA devices are not pinned"),
        (["trainer.device=cuda"], "CUDA devices are not pinned"),
    ]:
        out = run_sat("config", "run.portable_numerics=true", *args, cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- sat report


def _logged_run(client, exp_id, name, params):
    from mlflow.entities import Metric, Param

    rid = client.create_run(exp_id, run_name=name).info.run_id
    base = {
        "eval.name": "toy",
        "eval.n": "4",
        "algo.name": "grpo",
        "clip.name": "sat",
        "lag.n": "1",
        "seed": name[-1],
    }
    metrics = [
        Metric("eval/toy/avg_at_4", v, 1000 + i, s)
        for i, (s, v) in enumerate([(0, 20.0), (10, 30.0)])
    ]
    client.log_batch(
        rid, metrics=metrics, params=[Param(k, v) for k, v in {**base, **params}.items()]
    )
    client.set_terminated(rid, "FINISHED")


def test_report_warns_about_runs_of_different_machines(tmp_path, capsys):
    from mlflow import MlflowClient

    from sat_cli.report import run_report

    uri = f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    intel = {
        "machine.cpu.model": "Intel X",
        "machine.cpu.flags": "avx2 amx_tile",
        "machine.torch.cpu_capability": "AVX512",
        "run.portable_numerics": "false",
    }
    amd = {**intel, "machine.cpu.model": "AMD Y", "machine.cpu.flags": "avx2"}
    same = client.create_experiment("same", artifact_location=str(tmp_path / "a1"))
    _logged_run(client, same, "s0", intel)
    _logged_run(client, same, "s1", intel)
    mixed = client.create_experiment("mixed", artifact_location=str(tmp_path / "a2"))
    _logged_run(client, mixed, "m0", intel)
    _logged_run(client, mixed, "m1", amd)
    _logged_run(client, mixed, "m2", {})  # made before sat recorded its environment
    run_report("same", out=str(tmp_path / "r_same"), tracking_uri=uri)
    assert "WARNING" not in (tmp_path / "r_same/report.md").read_text()
    assert "different hardware" not in capsys.readouterr().out
    run_report("mixed", out=str(tmp_path / "r_mixed"), tracking_uri=uri)
    md = (tmp_path / "r_mixed/report.md").read_text()
    printed = capsys.readouterr().out
    for text in (md, printed):
        assert "> WARNING: the runs compared here were made on different hardware" in text
        assert "machine.cpu.model: 'Intel X' (1 run), 'AMD Y' (1 run)" in text
        assert "machine.cpu.flags: 'avx2 amx_tile' (1 run), 'avx2' (1 run)" in text
        assert "> WARNING: hardware and numeric settings unknown for 1 of 3 runs" in text
        assert "(not recorded: m2)" in text
    assert "different numeric settings" not in md  # same torch paths and mode
