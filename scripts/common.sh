# Shared by scripts/experiments.sh and scripts/test.sh: install what is missing, then configure and
# build one build tree. Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="$(nproc)"

# Debian 12 packages: compiler and build tools, the libraries, what the plots need, and the Python
# package's build and tests (pybind11, the headers, PyTorch, pytest; OpenBLAS's OpenMP build, without
# which Debian's torch runs its matrix products on the reference BLAS, ~20x slower), and Jane
# Austen's novels, the training experiment's text (r-cran-janeaustenr, with R to extract them),
# and flake8, the Python style check of the test command. Ninja builds the trees (it starts a
# target's compiles before the libraries it links are built, where make waits), and pytest-xdist
# runs the Python suites on every core.
# The Python package is installed with pip into a venv, offline: python3-venv (with pip), and
# Debian's setuptools and wheel, which pip uses as they are (--no-build-isolation).
PACKAGES=(g++ cmake make git libeigen3-dev doctest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev python3 python3-matplotlib python3-numpy
          python3-dev pybind11-dev python3-pybind11 python3-torch python3-pytest
          python3-venv python3-pip python3-setuptools python3-wheel python3-mpmath
          libopenblas0-openmp r-cran-janeaustenr flake8 ninja-build python3-pytest-xdist)

install_dependencies() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "linrope: installing ${missing[*]}" >&2
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
}

# build_tree DIR [cmake options...]: configure (first time) and build everything in DIR.
# Debian's interpreter, where the packages above are: a python3 earlier on PATH (pyenv, a venv)
# may lack them. A new tree is Ninja's; one configured before keeps its generator (CMake refuses
# to change it).
build_tree() {
  local dir="$1"; shift
  local generator=()
  [ -f "$dir/CMakeCache.txt" ] || ! command -v ninja > /dev/null || generator=(-G Ninja)
  cmake -S "$ROOT" -B "$dir" "${generator[@]}" -DPython_EXECUTABLE=/usr/bin/python3 "$@"
  cmake --build "$dir" -j "$JOBS"
}

# VENV: where both scripts install the Python package, the way a user does (README, "Python"): a
# venv of Debian's python3 with --system-site-packages (so numpy, torch and pytest are Debian's),
# and `pip install .` into it, offline. Undo: rm -r build/venv.
VENV="$ROOT/build/venv"

# install_python_package BUILD_DIR: pip install . into VENV, its module taken from BUILD_DIR, a
# build tree configured with LINROPE_BUILD_PYTHON=ON that build_tree just built (setup.py's
# LINROPE_BUILD_DIR: built as it is configured, so the install compiles nothing more). Without it
# setup.py would configure and compile a build of its own, build/python-<interpreter>-native-openmp.
install_python_package() {
  [ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$VENV"
  LINROPE_BUILD_DIR="$1" \
    "$VENV/bin/pip" install --quiet --no-build-isolation --no-index --no-deps "$ROOT"
  echo "linrope: Python package installed into $VENV (pip, from $1); $VENV/bin/python -m" \
       "linrope says which build" >&2
  link_python_package "$1/python"
}

# link_python_package DIR: the one exception to the install above, a convenience kept from before
# it: makes `/usr/bin/python3 -c "import linrope"` work from any directory (and in any venv made
# with --system-site-packages) by writing linrope.pth, one line naming DIR, the package in the
# build tree pip installed from (a rebuild there is seen at once), into a site-packages directory:
# as root, /usr/local/lib/python3.X/dist-packages (the place Debian leaves to packages it did not
# install; pip's refusal, PEP 668, is about Debian's own), otherwise the user's own site-packages,
# so that no user's build tree lands on root's path. A venv's own install comes first on its
# sys.path. Set LINROPE_NO_LINK=1 to leave it out; undo: delete the file.
link_python_package() {
  [ "${LINROPE_NO_LINK:-0}" = 1 ] && return 0
  local package="$1" site
  [ -f "$package/linrope/__init__.py" ] || return 0
  if [ "$(id -u)" -eq 0 ]; then
    site="$(/usr/bin/python3 -c 'import site
print(next(p for p in site.getsitepackages() if p.startswith("/usr/local/")))' || true)"
  else
    site="$(/usr/bin/python3 -m site --user-site || true)"
  fi
  if [ -n "$site" ] && mkdir -p "$site" && echo "$package" > "$site/linrope.pth"; then
    echo "linrope: convenience link for /usr/bin/python3: $site/linrope.pth -> $package" >&2
  else
    echo "linrope: could not link the Python package; use $VENV/bin/python" >&2
  fi
}
