#!/usr/bin/env bash
# Build SGLang's CPU kernel wheel (`sglang-kernel-cpu`, imported as `sgl_kernel`) from source, for
# `make sglang-cpu` (docs/sglang.md). PyPI has no CPU build of it.
#
#   SGLANG_SRC=<sglang checkout> scripts/build_sglang_kernel.sh    # or `make sglang-kernel`
#   scripts/build_sglang_kernel.sh                                  # online: downloads the pinned source
#
# The source is `python/sglang/kernels/aot` of an SGLang checkout: SGLANG_SRC (a checkout, or that
# folder itself), else the archive of SGLANG_REPO at SGLANG_COMMIT from GitHub (default: the fork
# ZailiWang/sglang at 7f8f0300, kernel 0.4.6.post1, the source of the wheel the tier was run with).
# It is built as SGLang's own CPU instructions say: pyproject_cpu.toml copied to pyproject.toml,
# then `pip wheel --no-build-isolation --no-deps` (isolation would pull a CUDA torch) in a build
# venv holding TORCH_SPEC (the torch of requirements-sglang-cpu.txt: the wheel is tied to it),
# with the source's own compiler flags (x86-64: -march=x86-64-v4 -mavx512bf16 -mavx512vnni
# -mamx-tile -mamx-bf16 -mamx-int8). The checkout given is not modified (a copy is built).
#
# Variables: SGLANG_SRC, SGLANG_REPO, SGLANG_COMMIT, SGLANG_SRC_URL (the archive), MAX_JOBS
# (parallel compile jobs, default nproc), SGLANG_KERNEL_OUT (default build/sglang-kernel: the
# wheel lands in its dist/), BUILD_PYTHON (makes the build venv; its version is the wheel's,
# default python3), TORCH_SPEC (default torch==2.13.0), TORCH_INDEX_URL (e.g.
# https://download.pytorch.org/whl/cpu). Needs gcc/g++ and libnuma-dev (numa.h).
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
  echo "build_sglang_kernel: error: $*" >&2
  exit 2
}

SGLANG_REPO="${SGLANG_REPO:-ZailiWang/sglang}"
SGLANG_COMMIT="${SGLANG_COMMIT:-7f8f030000b628ea2cb033e7457a13dd0ac80f99}"
SGLANG_SRC_URL="${SGLANG_SRC_URL:-https://github.com/$SGLANG_REPO/archive/$SGLANG_COMMIT.tar.gz}"
OUT="${SGLANG_KERNEL_OUT:-build/sglang-kernel}"
MAX_JOBS="${MAX_JOBS:-$(nproc)}"
BUILD_PYTHON="${BUILD_PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
AOT=python/sglang/kernels/aot

[[ "$MAX_JOBS" =~ ^[1-9][0-9]*$ ]] || die "MAX_JOBS=$MAX_JOBS is not a positive integer"
[[ "$(uname -m)" == x86_64 || "$(uname -m)" == aarch64 ]] \
  || die "SGLang's CPU kernel builds for x86_64 and aarch64; this machine is $(uname -m)"
command -v g++ >/dev/null || die "no C++ compiler (g++): install gcc and g++"
echo '#include <numa.h>' | g++ -E -x c++ - >/dev/null 2>&1 \
  || die "numa.h not found: install libnuma-dev (Debian/Ubuntu: apt-get install libnuma-dev)"
command -v "$BUILD_PYTHON" >/dev/null || die "BUILD_PYTHON=$BUILD_PYTHON not found"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SRC="$OUT/src"
rm -rf "$SRC"
mkdir -p "$SRC"

# 1. the source: a copy of the aot folder (pyproject.toml is replaced in the copy only)
if [[ -n "${SGLANG_SRC:-}" ]]; then
  if [[ -f "$SGLANG_SRC/$AOT/pyproject_cpu.toml" ]]; then
    from="$SGLANG_SRC/$AOT"
  elif [[ -f "$SGLANG_SRC/pyproject_cpu.toml" ]]; then
    from="$SGLANG_SRC"
  else
    die "SGLANG_SRC=$SGLANG_SRC holds neither $AOT/pyproject_cpu.toml nor pyproject_cpu.toml"
  fi
  echo "build_sglang_kernel: source $from"
  cp -R "$from/." "$SRC/"
else
  echo "build_sglang_kernel: no SGLANG_SRC; downloading $SGLANG_SRC_URL (only $AOT is kept)"
  "$BUILD_PYTHON" - "$SGLANG_SRC_URL" "$SRC" "$AOT" <<'PY' || die "could not download $SGLANG_SRC_URL: set SGLANG_SRC to an SGLang checkout"
import shutil, sys, tarfile, tempfile, urllib.request
url, dest, aot = sys.argv[1:]
with tempfile.TemporaryFile() as tmp:
    with urllib.request.urlopen(url, timeout=120) as resp:
        shutil.copyfileobj(resp, tmp)
    tmp.seek(0)
    with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
        root = tar.getmembers()[0].name.split("/")[0] + "/" + aot + "/"
        members = []
        for m in tar.getmembers():
            if m.name.startswith(root):
                m.name = m.name[len(root):]
                members.append(m)
        if not members:
            sys.exit(f"{aot} not in the archive")
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python before 3.11.4 has no extraction filters
            tar.extractall(dest, members=members)
PY
fi
[[ -f "$SRC/pyproject_cpu.toml" && -d "$SRC/csrc/cpu" ]] || die "$SRC lacks pyproject_cpu.toml or csrc/cpu"
cp "$SRC/pyproject_cpu.toml" "$SRC/pyproject.toml"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$SRC/pyproject.toml" | head -n 1)"
echo "build_sglang_kernel: sglang-kernel-cpu $version; compiler flags from its CMakeLists.txt:"
grep -A10 'add_compile_options(' "$SRC/csrc/cpu/CMakeLists.txt" | sed -n '2,10p' | tr -s ' \n' ' '
echo

# 2. the build venv: torch (the one the wheel is for) and the build backend
VENV="$OUT/venv"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$BUILD_PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
"$PY" -m pip install -q "scikit-build-core>=0.10" wheel cmake ninja
echo "build_sglang_kernel: build venv $("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda})")')"

# 3. the wheel
mkdir -p "$OUT/dist"
rm -f "$OUT"/dist/sglang_kernel_cpu-*.whl
LOG="$OUT/build.log"
echo "build_sglang_kernel: building with MAX_JOBS=$MAX_JOBS (log: $LOG); about 11 min on 2 cores"
start=$SECONDS
if ! MAX_JOBS="$MAX_JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$MAX_JOBS" \
  "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$OUT/dist" "$SRC" >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  die "the build failed (last lines above; whole log: $LOG)"
fi
wheel="$(ls "$OUT"/dist/sglang_kernel_cpu-*.whl)"
echo "build_sglang_kernel: built $wheel in $((SECONDS - start)) s"
echo "build_sglang_kernel: now \`make sglang-cpu\` (it takes this wheel when SGLANG_KERNEL_WHEEL is unset and ../shared has none)"
