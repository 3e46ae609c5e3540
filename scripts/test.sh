#!/usr/bin/env bash
# The whole test suite: install dependencies, then build and test twice —
#   Release with warnings as errors (benchmarks built too, so they keep compiling), and
#   AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo, so the sanitized run stays fast).
# Set LINROPE_SKIP_SANITIZERS=1 to run only the Release pass.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
build_tree "$ROOT/build/release" -DCMAKE_BUILD_TYPE=Release -DLINROPE_WERROR=ON \
  -DLINROPE_BUILD_BENCHMARKS=ON
ctest --test-dir "$ROOT/build/release" -j "$JOBS" --output-on-failure
if [ "${LINROPE_SKIP_SANITIZERS:-0}" != 1 ]; then
  build_tree "$ROOT/build/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINROPE_WERROR=ON \
    -DLINROPE_SANITIZE=ON -DLINROPE_BUILD_BENCHMARKS=OFF
  # The install check links a separate project; the Release pass covers it.
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$ROOT/build/sanitize" -j "$JOBS" \
    --output-on-failure -LE install
fi
