#!/usr/bin/env bash
# The whole test suite: install dependencies, then build and test three times —
#   Release with warnings as errors (benchmarks built too, so they keep compiling),
#   portable Release (no -march=native): on an AVX-512 machine the native passes take only the
#     AVX-512 float kernels (gemm's micro-kernel, RoPE's rotate_block_avx512); this one runs the
#     float fallbacks (Eigen's product, the generic RoPE kernel) that other x86-64 CPUs get, and
#   the library and tests without OpenMP (LINROPE_OPENMP=OFF: the serial fallbacks compile, warn
#     nothing and pass), and
#   AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo, so the sanitized run stays fast).
# Set LINROPE_SKIP_PORTABLE=1, LINROPE_SKIP_NO_OPENMP=1 or LINROPE_SKIP_SANITIZERS=1 to leave out
# those passes.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
build_tree "$ROOT/build/release" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
  -DLINROPE_BUILD_BENCHMARKS=ON
link_python_package "$ROOT/build/release"
ctest --test-dir "$ROOT/build/release" -j "$JOBS" --output-on-failure
if [ "${LINROPE_SKIP_PORTABLE:-0}" != 1 ]; then
  # The experiments have no kernels of their own; the install check is the Release pass's. The
  # Python package has none either: its tests (~1 min) run in the Release and no-OpenMP passes.
  build_tree "$ROOT/build/portable" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
    -DLINROPE_NATIVE=OFF -DLINROPE_BUILD_BENCHMARKS=OFF -DLINROPE_BUILD_EXPERIMENTS=OFF \
    -DLINROPE_BUILD_PYTHON=OFF
  ctest --test-dir "$ROOT/build/portable" -j "$JOBS" --output-on-failure -LE install
fi
if [ "${LINROPE_SKIP_NO_OPENMP:-0}" != 1 ]; then
  build_tree "$ROOT/build/no-openmp" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
    -DLINROPE_OPENMP=OFF -DLINROPE_BUILD_BENCHMARKS=OFF -DLINROPE_BUILD_EXPERIMENTS=OFF
  ctest --test-dir "$ROOT/build/no-openmp" -j "$JOBS" --output-on-failure -LE install
fi
if [ "${LINROPE_SKIP_SANITIZERS:-0}" != 1 ]; then
  # -g1: line tables for the sanitizers' backtraces, without the full debug information of -g,
  # which made this pass's build ~20% slower (test_linear_backward.cpp alone: 118 s against 96 s).
  build_tree "$ROOT/build/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINROPE_WERROR=ON \
    -DLINROPE_SANITIZE=ON -DLINROPE_BUILD_BENCHMARKS=OFF \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
  # The install check links a separate project; the Release pass covers it.
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$ROOT/build/sanitize" -j "$JOBS" \
    --output-on-failure -LE install
fi
