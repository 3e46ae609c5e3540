#!/usr/bin/env bash
# The whole test suite: install dependencies, check the Python sources' style (flake8), then build
# and test three times —
#   Release with warnings as errors (benchmarks built too, so they keep compiling); then the Python
#     package installed with pip (from that build) into a fresh venv, build/venv, and its pytest
#     suites (python/tests, experiments/training/tests) and the README's example run from outside
#     the source tree against that install,
#   portable and serial: no -march=native and no OpenMP (LINROPE_NATIVE=OFF, LINROPE_OPENMP=OFF).
#     On an AVX-512 machine the native passes take only the AVX-512 float kernels (gemm's
#     micro-kernel, RoPE's rotate_block_avx512); this pass runs the float fallbacks (Eigen's
#     product, the generic RoPE kernel) that other x86-64 CPUs get, and the serial fallbacks of
#     every parallel loop. One pass for both: which kernel runs and how the work is spread over
#     threads are independent (every loop goes through parallel_for, whatever kernel it runs), and
#     two passes cost CI ~5 more minutes.
#   AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo, so the sanitized run stays fast)
#     on the library and the experiments' programs; the tests' references and harness are linked
#     with the runtimes but not instrumented (CMakeLists.txt, LINROPE_SANITIZE).
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
  # -LE python: the Python package's tests run in the next pass, against the pip install.
  ctest --test-dir "$ROOT/build/release" -j "$JOBS" --output-on-failure -LE python
}

# pytest_suite DIR: one pytest run, its tests spread over JOBS processes (pytest-xdist; the
# multi-process tests take free ports, and each worker runs them whole); exit 5 (no test
# collected: a renamed function, an import turned into a skip) fails, saying why, as it would
# otherwise pass unseen.
pytest_suite() {
  local status=0
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "$JOBS" "$1" || status=$?
  if [ "$status" -eq 5 ]; then
    echo "linrope: pytest collected no tests from $1" >&2
  fi
  return "$status"
}

python_package() {
  # A fresh venv each run: the test is of `pip install .` into an environment that had no linrope.
  rm -rf "$VENV"
  install_python_package "$ROOT/build/release"
  # From a directory outside the source tree, so that only the installed package can be imported;
  # python/tests/conftest.py stops at once if the linrope found is not the venv's. Passive OpenMP
  # waiting: gradcheck makes thousands of small calls, each of which would otherwise spin a
  # timeslice for a descheduled thread on a loaded machine (16 ms instead of 0.03 ms per call).
  local work="$ROOT/build/python-tests"
  rm -rf "$work" && mkdir -p "$work"
  (
    cd "$work"
    export LINROPE_EXPECT_PREFIX="$VENV" OMP_WAIT_POLICY=PASSIVE
    "$VENV/bin/python" -m linrope
    pytest_suite "$ROOT/python/tests"
    pytest_suite "$ROOT/experiments/training/tests"
    # The README's example (it fails if eq. 19's denominators were not all positive).
    "$VENV/bin/python" "$ROOT/examples/torch_layer.py" > /dev/null
  )
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

# The Python sources' style (pycodestyle's and pyflakes' checks, lines up to 100 characters, as
# .clang-format's ColumnLimit): seconds, so first.
python_style() {
  flake8 --max-line-length 100 "$ROOT/python" "$ROOT/experiments" "$ROOT/bench" "$ROOT/examples" \
    "$ROOT/scripts" "$ROOT/setup.py"
}

install_dependencies
pass "Python style" python_style
pass Release release
pass "Python package" python_package
[ "${LINROPE_SKIP_PORTABLE:-0}" = 1 ] || pass "portable serial" portable_serial
[ "${LINROPE_SKIP_SANITIZERS:-0}" = 1 ] || pass sanitizer sanitizers
