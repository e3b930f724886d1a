#!/usr/bin/env bash
# Pilot 2 of the pre-registered collapse study (design: docs/results/collapse_cpu.md, "Pilot 2").
#
#   nohup nice -n 19 scripts/collapse_pilot2.sh RUNS_DIR > RUNS_DIR.log 2>&1 &
#
# Runs, in the design's order and one run at a time (--jobs 1): the shared start of D1, then the
# candidates D1, D2, D3, D4 (sweeps/collapse_pilot2_*_cpu.yaml), then round 2's (`*_r2_cpu.yaml`), if committed. After each candidate it exports
# the per-run rows and per-step curves of every run so far (`sat report <sweep> --collapse`),
# concatenated in that order into RUNS_DIR/reports/pilot2.csv and pilot2_curves.csv, and prints
# the pilot table (`sat report RUNS_DIR/reports/pilot2.csv`). It stops at the first candidate the
# table selects: a later one could not be selected (the design's selection rule).
#
# Resumable: the same command again skips finished runs and resumes an interrupted one from its
# last checkpoint (every 20 steps). Every sweep file sets clean_tree: true, so it refuses (exit 2)
# to run from a tree with changes: run it from a clean checkout of the design's commit. Uses
# .venv/bin/sat of this checkout with this checkout's code first on the path (SAT=... to change).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:?usage: scripts/collapse_pilot2.sh RUNS_DIR (a folder outside the repository)}"
mkdir -p "$RUNS/reports"
RUNS="$(cd "$RUNS" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SAT="${SAT:-$PWD/.venv/bin/sat}"
URI="sqlite:///$RUNS/mlflow.db"
REP="$RUNS/reports"

echo "collapse_pilot2: code $(git rev-parse HEAD), runs in $RUNS, started $(date -u +%FT%TZ)"
done_sweeps=()
# round 2's files (`*_r2_cpu.yaml`) exist only once round 1 has ended without a selection and
# they were written from the design's round-2 rule and committed; finished sweeps are skipped fast
for name in start d1 d2 d3 d4 d1_r2 d2_r2 d3_r2 d4_r2; do
  sweep="collapse_pilot2_${name}_cpu"
  [[ -f "sweeps/$sweep.yaml" ]] || continue
  echo "collapse_pilot2: sweep $sweep from $(date -u +%FT%TZ)"
  "$SAT" sweep "sweeps/$sweep.yaml" --jobs 1 "run.dir=$RUNS"
  "$SAT" report "$sweep" --collapse --tracking-uri "$URI" --out "$REP/$sweep" > /dev/null
  done_sweeps+=("$sweep")
  # the rows and curves of every sweep so far, in order, under one header each
  for kind in collapse collapse_curves; do
    out="$REP/pilot2${kind#collapse}.csv"
    head -n 1 "$REP/${done_sweeps[0]}/$kind.csv" > "$out.tmp"
    for s in "${done_sweeps[@]}"; do tail -n +2 "$REP/$s/$kind.csv" >> "$out.tmp"; done
    mv "$out.tmp" "$out"
  done
  "$SAT" report "$REP/pilot2.csv" | tee "$REP/pilot2.md"
  if grep -q "^Selected:" "$REP/pilot2.md"; then
    echo "collapse_pilot2: a candidate qualified; no later candidate can be selected. Stop."
    break
  fi
done
echo "collapse_pilot2: finished $(date -u +%FT%TZ)"
