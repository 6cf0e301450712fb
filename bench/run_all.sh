#!/usr/bin/env bash
# Every gptkiln benchmark, one after the other, each printing its figures and ratios; the output
# is what bench/README.md's table is copied from. About 10-15 minutes on a quiet 2-core machine.
#
#   bash bench/run_all.sh [OUTPUT_FILE]       (default: bench/results-$(date +%F).txt)
#
# Run it on an otherwise idle machine: every worker waits (up to BENCH_MAX_WAIT s, default 120)
# for other processes to go quiet, and each table reports the cores others kept busy meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-bench/results-$(date +%F).txt}
export OMP_NUM_THREADS=2
{
  echo "## train_step";      "$PY" bench/train_step.py
  echo; echo "## generate";  "$PY" bench/generate.py
  echo; echo "## prepare";   "$PY" bench/prepare.py
  echo; echo "## time_to_quality"; "$PY" bench/time_to_quality.py
} 2>&1 | tee "$OUT"
echo "written to $OUT"
