#!/usr/bin/env bash
# Every gptkiln benchmark, one after the other, each printing its figures and ratios; the output
# is what bench/README.md's tables are copied from. About an hour on a quiet 2-core machine.
#
#   bash bench/run_all.sh [OUTPUT_FILE]       (default: bench/results-$(date +%F).txt)
#
# prepare and time_to_quality are measured on tiny Shakespeare (nanoGPT's input.txt), which the
# project does not ship: TINY_SHAKESPEARE names it (default ../shared/data/tinyshakespeare.txt).
# Without it, prepare repeats the bundled plays and time_to_quality is skipped.
#
# Run it on an otherwise idle machine: two threads on two cores leave no room for a neighbour,
# and every multi-threaded op waits for the slower core. Each worker first waits (up to
# BENCH_MAX_WAIT s, default 120) for other processes to go quiet, and the tables report the
# cores that others kept busy meanwhile ("others' cores"); distrust a row where that is not ~0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-bench/results-$(date +%F).txt}
SHAKESPEARE=${TINY_SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
export OMP_NUM_THREADS=2
{
  echo "## train_step";       "$PY" bench/train_step.py --malloc-keep --bf16
  echo; echo "## train_step, compiled"; "$PY" bench/train_step.py --sizes baby --compile --bf16
  echo; echo "## adamw";      "$PY" bench/adamw.py
  echo; echo "## padded_vocab"; "$PY" bench/padded_vocab.py
  echo; echo "## generate";   "$PY" bench/generate.py --rounds 2
  echo; echo "## sampling";   "$PY" bench/sampling.py --generate
  echo; echo "## families (Llama 3, Qwen3)"; "$PY" bench/families.py --rounds 2
  if [ -f "$SHAKESPEARE" ]; then
    echo; echo "## prepare";    "$PY" bench/prepare.py --corpus "$SHAKESPEARE"
    echo; echo "## time_to_quality"; "$PY" bench/time_to_quality.py --data "$SHAKESPEARE"
  else
    echo; echo "## prepare (the bundled plays: no tiny Shakespeare at $SHAKESPEARE)"
    "$PY" bench/prepare.py
    echo; echo "## time_to_quality: skipped, no tiny Shakespeare at $SHAKESPEARE (set TINY_SHAKESPEARE)"
  fi
  echo; echo "## load_memory"; "$PY" bench/load_memory.py
  echo; echo "## ddp_scaling"; "$PY" bench/ddp_scaling.py
  echo; echo "## serve";      "$PY" bench/serve.py
  echo; echo "## startup";    "$PY" bench/startup.py
  if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo; echo "## gpu";      "$PY" bench/gpu.py
  fi
} 2>&1 | tee "$OUT"
echo "written to $OUT"
