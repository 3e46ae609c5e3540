#!/usr/bin/env bash
# The main job: install dependencies, build (Release), and run every experiment with fast defaults.
# Results (CSV, JSON, PNG plots, REPORT.md) go to results/. Extra arguments go to the program, e.g.
#   bash scripts/experiments.sh --full        bash scripts/experiments.sh scaling --quick
# The training experiment (Python, experiments/training) runs first, with --quick, --full and
# --resume taken from the arguments; on its own:
#   bash scripts/experiments.sh training --full [--resume] [--out DIR]   (see --help)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
build_tree "$ROOT/build/release" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
  -DLINROPE_BUILD_BENCHMARKS=ON -DLINROPE_BUILD_PYTHON=ON
link_python_package "$ROOT/build/release"
cd "$ROOT"

training() {
  (cd "$ROOT/experiments" &&
   PYTHONPATH="$ROOT/build/release/python:$ROOT/experiments${PYTHONPATH:+:$PYTHONPATH}" \
   /usr/bin/python3 -m training --out "$ROOT/results/training" "$@")
}

if [ $# -eq 0 ]; then set -- all --quick; fi
# Only global options (e.g. --full): every experiment.
if [ "${1#-}" != "$1" ]; then set -- all "$@"; fi
if [ "$1" = training ]; then
  shift
  training "$@"
  exit
fi
if [ "$1" = all ]; then
  shared=()
  for a in "$@"; do
    case "$a" in --quick|--full|--resume) shared+=("$a") ;; esac
  done
  training "${shared[@]}"
fi
exec "$ROOT/build/release/experiments/linrope-experiments" "$@" --out "$ROOT/results"
