#!/usr/bin/env bash
# Run a command with MKL's vector math (VML) forced onto one code branch, to see whether a
# result depends on the branch MKL picks for the CPU (issue 58; bench/README.md, "Portable
# numerics across CPU kinds"). VML picks its branch through mkl_serv_vml_cpu_detect (0: the
# generic branch MKL takes on AMD, 1 and 2: SSE branches, 3: AVX2, 5: AVX-512); torch links MKL
# into libtorch_cpu.so and calls that function through its PLT, so a preloaded library that
# defines it decides the branch. Needs a C compiler; a diagnostic, never used by sat itself.
#
#   bench/vml_branch.sh 1 .venv/bin/sat train run.portable_numerics=true run.name=branch1
set -euo pipefail
if [[ $# -lt 2 || ! "$1" =~ ^[0-5]$ || "$1" == 4 ]]; then
  echo "usage: bench/vml_branch.sh BRANCH(0,1,2,3,5) COMMAND [ARGS...]" >&2
  exit 2
fi
branch=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf 'int mkl_serv_vml_cpu_detect(void) { return %d; }\nint mkl_vml_serv_cpu_detect(void) { return %d; }\n' \
  "$branch" "$branch" >"$dir/branch.c"
"${CC:-cc}" -shared -fPIC -O2 -o "$dir/branch.so" "$dir/branch.c"
LD_PRELOAD="$dir/branch.so${LD_PRELOAD:+:$LD_PRELOAD}" "$@"
