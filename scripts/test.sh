#!/usr/bin/env bash
# The whole test suite: install dependencies, then build and test three times —
#   Release with warnings as errors (benchmarks built too, so they keep compiling), and the Python
#     package's pytest suite,
#   portable and serial: no -march=native and no OpenMP (LINROPE_NATIVE=OFF, LINROPE_OPENMP=OFF).
#     On an AVX-512 machine the native passes take only the AVX-512 float kernels (gemm's
#     micro-kernel, RoPE's rotate_block_avx512); this pass runs the float fallbacks (Eigen's
#     product, the generic RoPE kernel) that other x86-64 CPUs get, and the serial fallbacks of
#     every parallel loop. One pass for both: which kernel runs and how the work is spread over
#     threads are independent (every loop goes through parallel_for, whatever kernel it runs), and
#     two passes cost CI ~5 more minutes.
#   AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo, so the sanitized run stays fast).
# Set LINROPE_SKIP_PORTABLE=1 or LINROPE_SKIP_SANITIZERS=1 to leave out those passes. Each pass
# prints how long it took.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# pass NAME COMMAND...: runs the command, then prints the pass's time.
pass() {
  local name="$1" start=$SECONDS; shift
  "$@"
  echo "linrope: $name pass took $((SECONDS - start)) s" >&2
}

release() {
  build_tree "$ROOT/build/release" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
    -DLINROPE_BUILD_BENCHMARKS=ON -DLINROPE_BUILD_PYTHON=ON
  link_python_package "$ROOT/build/release"
  ctest --test-dir "$ROOT/build/release" -j "$JOBS" --output-on-failure
}

portable_serial() {
  # The experiments have no kernels of their own, nor has the Python package; the install check
  # links a separate project: the Release pass covers all three.
  build_tree "$ROOT/build/portable-serial" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
    -DLINROPE_NATIVE=OFF -DLINROPE_OPENMP=OFF -DLINROPE_BUILD_BENCHMARKS=OFF \
    -DLINROPE_BUILD_EXPERIMENTS=OFF -DLINROPE_BUILD_PYTHON=OFF
  ctest --test-dir "$ROOT/build/portable-serial" -j "$JOBS" --output-on-failure -LE install
}

sanitizers() {
  # -O1 -g1: the optimisation ASan's authors advise, and line tables for the backtraces. The
  # instrumented build is this suite's largest cost: test_linear_backward.cpp alone compiles in
  # 65 s at -O1 -g1 against 120 s at -O2 -g1 (measured on this 2-core machine).
  build_tree "$ROOT/build/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINROPE_WERROR=ON \
    -DLINROPE_SANITIZE=ON -DLINROPE_BUILD_BENCHMARKS=OFF \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$ROOT/build/sanitize" -j "$JOBS" \
    --output-on-failure -LE install
}

install_dependencies
pass Release release
[ "${LINROPE_SKIP_PORTABLE:-0}" = 1 ] || pass "portable serial" portable_serial
[ "${LINROPE_SKIP_SANITIZERS:-0}" = 1 ] || pass sanitizer sanitizers
