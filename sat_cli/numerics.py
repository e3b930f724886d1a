"""Portable numerics (``run.portable_numerics=true``): pin the CPU code paths that decide the
order of floating-point reductions, so that a seed should give the same numbers on x86-64 CPUs
of different kinds (Intel with or without AMX, AMD), not only on the kind that made a run. What
was measured (per kind, and the op classes that differed: ``scripts/numerics_fingerprint.py``):
bench/README.md, "Portable numerics across CPU kinds".

By default torch picks its code paths from the CPU: ATen's vectorised kernels use the widest
instruction set present (``AVX512`` or ``AVX2``), oneDNN its JIT kernels up to AMX, and MKL its
BLAS kernels per CPU (a different branch, blocking and cache-size tuning on Intel and AMD). Each
choice sums in another order, so the same run drifts apart after a few dozen steps. The pins:

* ``ATEN_CPU_CAPABILITY=avx2`` — ATen's AVX2 kernels (no reciprocal approximations);
* ``ONEDNN_MAX_CPU_ISA=AVX2`` (and its older name ``DNNL_MAX_CPU_ISA``) — no AVX-512/AMX JIT;
* ``MKL_CBWR=COMPATIBLE`` — MKL's conditional numerical reproducibility on its SSE2 branch, the
  one MKL documents as giving the same results on Intel and non-Intel CPUs (its ``AVX2`` branch
  falls back to ``AUTO`` on AMD), with fixed cache sizes and deterministic reductions;
* ``MKL_DYNAMIC=FALSE``, ``OMP_DYNAMIC=FALSE`` and ``OMP_NUM_THREADS`` = ``MKL_NUM_THREADS`` =
  the trainer's thread count — a fixed number of threads in every process, also in those that
  never call ``torch.set_num_threads`` (the Megatron ranks), instead of the machine's core count.

One choice is not an environment variable: **the trainer's AdamW takes torch's fused CPU
kernel** (``StepSettings.portable_numerics``, ``trainers/step.py``). torch's default AdamW calls
``torch.sqrt``, which goes to MKL's vector math (VML); VML picks its branch by the CPU, not by
``MKL_CBWR``, and the branch it takes on AMD refines ``rsqrtps``, an approximation whose bits
differ between Intel and AMD (about one root in five is one ulp off, and which ones depends on
the vendor). The fused kernel uses the processor's exact square root. The other VML functions
the run calls (exp, log, tanh, sin, cos) use no approximate instruction on those branches.

The variables are read when torch (and its libraries) load, so :func:`pin` must run before torch
is imported; the ``sat`` command calls it right after composing the config, and every process
of the run (the local engine worker, torchrun and the Megatron ranks, a sweep's children)
inherits them. Torch-free, so that it can run first.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping

PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
}
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# every variable that changes torch's CPU numerics: recorded with each run whether set by the
# portable mode or by the user
NUMERIC_VARS = (
    *PORTABLE_ENV,
    *THREAD_VARS,
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "KMP_DETERMINISTIC_REDUCTION",
)


# the CPU flags that decide torch's code paths, as /proc/cpuinfo spells them
ISA_FLAGS = (
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
)


def cpu_info(path: str | None = None) -> dict:
    """``{"model": name, "vendor": vendor id, "flags": set}`` of the first CPU in ``path``
    (default ``$SAT_CPUINFO``, else ``/proc/cpuinfo``: Linux); where it cannot be read, the
    model from ``platform``, vendor ``"unknown"`` and no flags."""
    if path is None:  # $SAT_CPUINFO's spec (util.options.ENV) is checked where it is parsed;
        # here, a layer below util, a path that cannot be read is a CPU of unknown kind
        path = os.environ.get("SAT_CPUINFO") or "/proc/cpuinfo"
    model, vendor, flags = "", "", set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = " ".join(value.split())
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and vendor and flags:
                    break
    except (OSError, ValueError):  # ValueError: a NUL in $SAT_CPUINFO
        pass
    return {
        "model": model or platform.processor() or platform.machine() or "unknown",
        "vendor": vendor or "unknown",
        "flags": flags,
    }


def isa_summary(flags: set[str]) -> dict[str, str]:
    """Whether AMX, AVX-512 and AVX2 are present (``"true"``/``"false"``; ``"unknown"`` without
    flags) and the ISA flags of :data:`ISA_FLAGS` present, space-separated."""
    if not flags:
        return {"amx": "unknown", "avx512": "unknown", "avx2": "unknown", "flags": "unknown"}
    yes = lambda present: "true" if present else "false"  # noqa: E731
    return {
        "amx": yes("amx_tile" in flags),
        "avx512": yes("avx512f" in flags),
        "avx2": yes("avx2" in flags),
        "flags": " ".join(f for f in ISA_FLAGS if f in flags) or "none",
    }


class PortableError(Exception):
    """The portable mode cannot hold on this machine or in this process."""


def required_flags(cpu_flags: set[str]) -> list[str]:
    """The CPU flags the pinned AVX2 path needs that ``cpu_flags`` lacks."""
    return [f for f in ("avx2", "fma") if f not in cpu_flags]


def pin(
    threads: int, environ: MutableMapping[str, str] | None = None, cpu_flags: set[str] | None = None
) -> dict[str, str]:
    """Set the pins (module docstring) in ``environ`` (default ``os.environ``); return them.

    Raises :class:`PortableError` when torch is already imported in this process (the pins would
    be read too late), on a CPU that is not x86-64 or lacks AVX2/FMA (the pinned path)."""
    env = os.environ if environ is None else environ
    if environ is None and "torch" in sys.modules:
        raise PortableError(
            "run.portable_numerics=true must be set before torch is imported; start the run "
            "with the `sat` command"
        )
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise PortableError(
            f"run.portable_numerics=true pins x86-64 code paths (AVX2); this machine is {machine}"
        )
    if cpu_flags is None:
        cpu_flags = cpu_info()["flags"]
    missing = required_flags(cpu_flags)
    if cpu_flags and missing:
        raise PortableError(
            "run.portable_numerics=true pins the AVX2 code paths; this CPU lacks "
            + ", ".join(missing)
        )
    pins = dict(PORTABLE_ENV)
    pins.update({k: str(int(threads)) for k in THREAD_VARS})
    env.update(pins)
    return pins


def numeric_env(environ: MutableMapping[str, str] | None = None) -> str:
    """``NAME=value`` of every variable of :data:`NUMERIC_VARS` that is set, space-separated and
    sorted (``"none"`` when none is)."""
    env = os.environ if environ is None else environ
    items = sorted(f"{k}={env[k]}" for k in NUMERIC_VARS if k in env)
    return " ".join(items) or "none"
