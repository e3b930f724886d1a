"""The hardware and numeric environment of a run, recorded as MLflow params ``machine.*``, and
the check `sat report` makes with them.

The prefix is ``machine.`` because no config key can start with it (no config group or option is
named ``machine``: tests/test_environment.py checks the composed config of a multi-turn run), so
the record can never collide with the config's own params, the ``env`` group's
(``env.name``, ``env.max_turns``, an environment plug-in's options) included. Runs recorded before
this had the prefix ``env.``; :func:`current_names` reads them under today's names.

The same seed gives the same numbers only on the same kind of CPU (``sat_cli.numerics``), so a
run records what produced it (:func:`environment_params`, in the process that trains):

* ``machine.cpu.model``, ``machine.cpu.amx`` / ``machine.cpu.avx512`` / ``machine.cpu.avx2`` (``true``/``false``),
  ``machine.cpu.flags`` (the ISA flags that decide torch's paths), ``machine.cpu.count`` (CPUs usable);
* ``machine.torch.version``, ``machine.torch.cpu_capability`` (``torch.backends.cpu.get_cpu_capability()``:
  the ATen kernels in use), ``machine.torch.num_threads`` (``torch.get_num_threads()`` of this
  process, after the run set it), ``machine.torch.cuda`` (the CUDA version torch was built with);
* ``machine.mkl.version`` and ``machine.onednn.version`` (parsed from ``torch.__config__.show()``),
  ``machine.mkl.cbwr`` (MKL's reproducibility branch in effect, asked from MKL itself: ``OFF`` by
  default, ``COMPATIBLE`` in portable mode) and ``machine.mkl.auto_branch`` (the branch MKL picks on
  this CPU);
* ``machine.numeric_env``: the numeric environment variables that are set (``sat_cli.numerics``);
* ``machine.gpu``: the CUDA device's name, or ``none``; ``machine.sglang.version`` with engine=sglang
  (asked from the SGLang interpreter in a subprocess; sglang is never imported here).

A worker process reports its own view with :func:`process_numerics` (the local engine's worker
in its ready message, logged as tags ``machine.engine.*``; each Megatron rank in its start-up line).
Anything that cannot be read is ``"unknown"``. torch is imported inside the functions.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from sat_cli.numerics import cpu_info, isa_summary, numeric_env

UNKNOWN = "unknown"
# mkl_cbwr.h: MKL_CBWR_* branch codes (MKL_CBWR_STRICT is a bit on top)
MKL_BRANCHES = {
    0: "OFF",
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    5: "SSE3",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
    15: "AVX10",
}
_MKL_STRICT = 0x10000
_MKL_CBWR_BRANCH = 1


def parse_library_versions(config_text: str) -> dict[str, str]:
    """``{"mkl": …, "onednn": …}`` from ``torch.__config__.show()``: the version, ``"none"``
    when torch was built without the library, ``"unknown"`` when the text does not say."""
    out = {}
    patterns = {
        "mkl": (
            r"Math Kernel Library Version\s+v?([0-9][0-9.]*)",
            r"\bMKL Version\s+v?([0-9][0-9.]*)",
        ),
        "onednn": (r"(?:MKL-DNN|oneDNN|DNNL)\s+v?([0-9]+(?:\.[0-9]+)+)",),
    }
    flags = {"mkl": "USE_MKL=OFF", "onednn": "USE_MKLDNN=OFF"}
    for lib, pats in patterns.items():
        found = next((m.group(1) for p in pats if (m := re.search(p, config_text))), None)
        if found is None:
            found = "none" if flags[lib] in config_text else UNKNOWN
        out[lib] = found.rstrip(".")
    return out


def _mkl_name(code: int) -> str:
    name = MKL_BRANCHES.get(code & ~_MKL_STRICT, f"branch {code & ~_MKL_STRICT}")
    return name + (",STRICT" if code & _MKL_STRICT and code > 0 else "")


def mkl_branches() -> dict[str, str]:
    """``{"cbwr": branch in effect, "auto_branch": branch MKL picks on this CPU}``, asked from the
    MKL linked into torch (``unknown`` where torch has no MKL or does not export it)."""
    import ctypes

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get, auto = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_get_auto_branch
    except (OSError, AttributeError):
        return {"cbwr": UNKNOWN, "auto_branch": UNKNOWN}
    get.restype, get.argtypes, auto.restype = ctypes.c_int, [ctypes.c_int], ctypes.c_int
    return {"cbwr": _mkl_name(int(get(_MKL_CBWR_BRANCH))), "auto_branch": _mkl_name(int(auto()))}


def process_numerics() -> dict[str, str]:
    """This process's own numeric paths: ATen's CPU capability, torch's thread count, MKL's
    reproducibility branch (what a worker process reports about itself)."""
    import torch

    return {
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "num_threads": str(torch.get_num_threads()),
        "mkl_cbwr": mkl_branches()["cbwr"],
    }


def sglang_version(python: str, timeout_s: float = 30.0) -> str:
    """The sglang version installed for the interpreter ``python`` (a subprocess with a time
    limit; sglang is not imported: ``importlib.metadata`` reads its metadata)."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    text = out.stdout.strip()
    return text if out.returncode == 0 and text and len(text) < 100 else UNKNOWN


def _gpu_name(torch) -> str:
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except (RuntimeError, AssertionError):
        return UNKNOWN


def git_commit() -> str:
    """The sat checkout's ``git rev-parse HEAD`` (the ``git_commit`` tag), ``unknown`` outside
    a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment_params(sglang: str | None = None) -> dict[str, str]:
    """The ``machine.*`` params of a run (module docstring), read in this process. ``sglang``: the
    SGLang version (with engine=sglang), else None (no such param)."""
    import torch

    cpu = cpu_info()
    isa = isa_summary(cpu["flags"])
    try:
        libs = parse_library_versions(torch.__config__.show())
    except (RuntimeError, AttributeError):
        libs = {"mkl": UNKNOWN, "onednn": UNKNOWN}
    mkl = mkl_branches()
    try:
        count = str(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        count = str(os.cpu_count() or UNKNOWN)
    params = {
        "machine.cpu.model": cpu["model"],
        "machine.cpu.amx": isa["amx"],
        "machine.cpu.avx512": isa["avx512"],
        "machine.cpu.avx2": isa["avx2"],
        "machine.cpu.flags": isa["flags"],
        "machine.cpu.count": count,
        "machine.torch.version": str(torch.__version__),
        "machine.torch.cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "machine.torch.num_threads": str(torch.get_num_threads()),
        "machine.torch.cuda": str(torch.version.cuda or "none"),
        "machine.mkl.version": libs["mkl"],
        "machine.mkl.cbwr": mkl["cbwr"],
        "machine.mkl.auto_branch": mkl["auto_branch"],
        "machine.onednn.version": libs["onednn"],
        "machine.numeric_env": numeric_env(),
        "machine.gpu": _gpu_name(torch),
    }
    if sglang is not None:
        params["machine.sglang.version"] = sglang
    return params


# ----------------------------------------------------------------------------- `sat report`

PREFIX = "machine."
# the record's names before the prefix was machine. (runs recorded until 2026-12-05)
LEGACY_PREFIX = "env."
LEGACY_GROUPS = ("cpu.", "torch.", "mkl.", "onednn.", "sglang.", "engine.")
LEGACY_KEYS = ("gpu", "numeric_env")


def engine_params(numerics: Mapping[str, str]) -> dict[str, str]:
    """The engine worker's own view of its numerics (``process_numerics``) as ``machine.engine.*``."""
    return {f"{PREFIX}engine.{k}": v for k, v in numerics.items()}


def current_names(params: Mapping[str, str]) -> dict[str, str]:
    """``params`` with a legacy record (``env.cpu.model``, ...; only in a run that has no
    ``machine.*`` param, i.e. one recorded before the rename) under today's names."""
    if any(k.startswith(PREFIX) for k in params):
        return dict(params)
    out = {}
    for k, v in params.items():
        rest = k[len(LEGACY_PREFIX) :] if k.startswith(LEGACY_PREFIX) else None
        if rest is not None and (rest in LEGACY_KEYS or rest.startswith(LEGACY_GROUPS)):
            k = PREFIX + rest
        out[k] = v
    return out


# what makes two runs' numbers comparable bit for bit: the machine, and the numeric settings
HARDWARE_KEYS = ("machine.cpu.model", "machine.cpu.flags", "machine.gpu")
NUMERIC_KEYS = (
    "machine.torch.version",
    "machine.torch.cpu_capability",
    "machine.torch.num_threads",
    "machine.mkl.version",
    "machine.mkl.cbwr",
    "machine.onednn.version",
    "machine.numeric_env",
    "machine.sglang.version",
    "machine.engine.cpu_capability",
    "machine.engine.num_threads",
    "run.portable_numerics",
)


def compare_environments(runs: Sequence[tuple[str, Mapping[str, str]]]) -> list[str]:
    """Warnings (one line each) when the runs, ``(name, params and tags)``, were made on
    different hardware or numeric settings; runs that recorded none of them count as
    ``unknown``. Empty when all runs recorded the same."""
    if len(runs) < 2:
        return []
    runs = [(n, current_names(d)) for n, d in runs]
    recorded = {k for k in (*HARDWARE_KEYS, *NUMERIC_KEYS) if k.startswith(PREFIX)}
    known = [(n, d) for n, d in runs if recorded.intersection(d)]
    unknown = [n for n, d in runs if not recorded.intersection(d)]
    notes = []
    for kind, keys in (("hardware", HARDWARE_KEYS), ("numeric settings", NUMERIC_KEYS)):
        diffs = []
        for key in keys:
            counts: dict[str, int] = {}
            for _, d in known:
                value = d.get(key, UNKNOWN)
                counts[value] = counts.get(value, 0) + 1
            if len(counts) > 1:
                vals = ", ".join(f"{v!r} ({n} run{'s' * (n > 1)})" for v, n in counts.items())
                diffs.append(f"{key}: {vals}")
        if diffs:
            notes.append(
                f"WARNING: the runs compared here were made on different {kind}, so their "
                "numbers can differ for that reason alone: " + "; ".join(diffs)
            )
    if unknown and known:
        notes.append(
            f"WARNING: hardware and numeric settings unknown for {len(unknown)} of {len(runs)} "
            f"runs (not recorded: {', '.join(unknown[:5])}{', …' if len(unknown) > 5 else ''}); "
            "they may have been made on another kind of machine"
        )
    elif unknown:
        notes.append(
            "hardware and numeric settings unknown for all runs (not recorded): whether they "
            "were made on the same kind of machine cannot be checked"
        )
    return notes
