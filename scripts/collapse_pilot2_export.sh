#!/usr/bin/env bash
# Export pilot 2's FINISHED runs so far (docs/results/collapse_cpu.md, "Pilot 2"), while the pilot
# may still be running:
#
#   scripts/collapse_pilot2_export.sh RUNS_DIR [OUT_DIR]     # OUT_DIR: docs/results/collapse_cpu
#
# For each pilot-2 sweep that has runs in RUNS_DIR, in the design's order: `sat report <sweep>
# --collapse` (per-run rows and per-step curves), then the rows whose status is FINISHED, and the
# curves of those runs, concatenated under one header into OUT_DIR/pilot2.csv and
# OUT_DIR/pilot2_curves.csv (written whole, then moved into place). The table is then
# `sat report OUT_DIR/pilot2.csv`. Reads the MLflow store only; starts and stops nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="$(cd "${1:?usage: scripts/collapse_pilot2_export.sh RUNS_DIR [OUT_DIR]}" && pwd)"
OUT="${2:-docs/results/collapse_cpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SAT="${SAT:-$PWD/.venv/bin/sat}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
rows="$TMP/rows.csv" curves="$TMP/curves.csv"
for name in start d1 d2 d3 d4 d1_r2 d2_r2 d3_r2 d4_r2; do
  sweep="collapse_pilot2_${name}_cpu"
  [ -d "$RUNS/$sweep" ] || continue
  "$SAT" report "$sweep" --collapse --tracking-uri "sqlite:///$RUNS/mlflow.db" --out "$TMP/$sweep" \
    > /dev/null
  for kind in collapse collapse_curves; do  # one header, from the first sweep
    dest="$rows"; [ "$kind" = collapse ] || dest="$curves"
    [ -s "$dest" ] || head -n 1 "$TMP/$sweep/$kind.csv" > "$dest"
  done
  # status is column 5 of collapse.csv (no field before it holds a comma); run is column 4
  awk -F, 'NR > 1 && $5 == "FINISHED"' "$TMP/$sweep/collapse.csv" >> "$rows"
  awk -F, 'NR == FNR { if (FNR > 1 && $5 == "FINISHED") keep[$4] = 1; next }
           FNR > 1 && ($1 in keep)' "$TMP/$sweep/collapse.csv" "$TMP/$sweep/collapse_curves.csv" \
    >> "$curves"
done
mkdir -p "$OUT"
cp "$rows" "$OUT/.pilot2.csv.tmp" && mv "$OUT/.pilot2.csv.tmp" "$OUT/pilot2.csv"
cp "$curves" "$OUT/.pilot2_curves.csv.tmp" && mv "$OUT/.pilot2_curves.csv.tmp" "$OUT/pilot2_curves.csv"
echo "collapse_pilot2_export: $(($(wc -l < "$OUT/pilot2.csv") - 1)) finished runs -> $OUT/pilot2.csv, pilot2_curves.csv"
