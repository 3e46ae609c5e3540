#!/usr/bin/env bash
# The main job: install dependencies, build (Release), and run every experiment with fast defaults.
# Results (CSV, JSON, PNG plots, REPORT.md) go to results/. Extra arguments go to the program, e.g.
#   bash scripts/experiments.sh --full        bash scripts/experiments.sh scaling --quick
# The training experiment (Python, experiments/training) runs first, with --quick, --full and
# --resume taken from the arguments; on its own:
#   bash scripts/experiments.sh training --full [--resume] [--out DIR]   (see --help)
# The data flow one way: the experiments (the training, then linrope-experiments) write CSV and
# JSON only; then experiments/analysis/report.py reads them all and writes every summary, the plots
# and results/REPORT.md. --no-plots, wherever it is given, is the analysis's.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
build_tree "$ROOT/build/release" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
  -DLINROPE_BUILD_BENCHMARKS=ON -DLINROPE_BUILD_PYTHON=ON
# The Python package, pip-installed from that build into build/venv (common.sh), for the training.
install_python_package "$ROOT/build/release"
cd "$ROOT"
# The training (the installed linrope) and the analysis of its output import from experiments/.
export PYTHONPATH="$ROOT/experiments${PYTHONPATH:+:$PYTHONPATH}"

training() {
  (cd "$ROOT/experiments" && "$VENV/bin/python" -m training --out "$ROOT/results/training" "$@")
}
analysis() {
  /usr/bin/python3 -B "$ROOT/experiments/analysis/report.py" "$@" "${plots[@]}"
}
# Whether the arguments only ask for help (nothing is run, so nothing to analyse).
asks_help() {
  local a
  for a in "$@"; do
    case "$a" in -h|--help|--help-all|--list-variants|--plan) return 0 ;; esac
  done
  return 1
}

if [ $# -eq 0 ]; then set -- all --quick; fi
# Only global options (e.g. --full): every experiment.
if [ "${1#-}" != "$1" ]; then set -- all "$@"; fi
plots=()
args=()
for a in "$@"; do
  if [ "$a" = --no-plots ]; then plots=(--no-plots); else args+=("$a"); fi
done
set -- "${args[@]}"

if [ "$1" = training ]; then
  shift
  training "$@"
  asks_help "$@" && exit 0
  # With --out DIR the training's output and its analysis (no REPORT.md) stay in DIR.
  out="" previous=""
  for a in "$@"; do
    case "$a" in --out=*) out="${a#--out=}" ;; esac
    [ "$previous" = --out ] && out="$a"
    previous="$a"
  done
  if [ -n "$out" ]; then
    case "$out" in /*) ;; *) out="$ROOT/experiments/$out" ;; esac  # the training ran from there
    analysis --training "$out"
  else
    analysis "$ROOT/results"
  fi
  exit
fi
asks_help "$@" && exec "$ROOT/build/release/experiments/linrope-experiments" "$@"
if [ "$1" = all ]; then
  shared=()
  for a in "$@"; do
    case "$a" in --quick|--full|--resume) shared+=("$a") ;; esac
  done
  training "${shared[@]}"
fi
status=0
"$ROOT/build/release/experiments/linrope-experiments" "$@" --out "$ROOT/results" || status=$?
# 2: a bad command line, nothing run. After a failed experiment (1) or an interruption (130, 143)
# the analysis still runs: the other experiments' sections, and one saying which sweep is
# incomplete.
[ "$status" -eq 2 ] && exit 2
analysis_status=0
analysis "$ROOT/results" || analysis_status=$?
[ "$status" -ne 0 ] || status=$analysis_status
exit "$status"
