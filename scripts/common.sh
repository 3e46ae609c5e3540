# Shared by scripts/experiments.sh and scripts/test.sh: install what is missing, then configure and
# build one build tree. Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="$(nproc)"

# Debian 12 packages: compiler and build tools, the libraries, what the plots need, and the Python
# package's build and tests (pybind11, the headers, PyTorch, pytest; OpenBLAS's OpenMP build, without
# which Debian's torch runs its matrix products on the reference BLAS, ~20x slower), and Jane
# Austen's novels, the training experiment's text (r-cran-janeaustenr, with R to extract them).
PACKAGES=(g++ cmake make git libeigen3-dev doctest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev python3 python3-matplotlib python3-numpy
          python3-dev pybind11-dev python3-pybind11 python3-torch python3-pytest
          libopenblas0-openmp r-cran-janeaustenr)

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
# may lack them.
build_tree() {
  local dir="$1"; shift
  cmake -S "$ROOT" -B "$dir" -DPython_EXECUTABLE=/usr/bin/python3 "$@"
  cmake --build "$dir" -j "$JOBS"
}

# link_python_package DIR: makes `/usr/bin/python3 -c "import linrope"` work from any directory
# (and in a venv made with --system-site-packages) by writing linrope.pth, one line naming
# DIR/python, into a site-packages directory: as root, /usr/local/lib/python3.X/dist-packages (the
# place Debian leaves to packages it did not install; pip's refusal, PEP 668, is about Debian's
# own), otherwise the user's own site-packages, so that no user's build tree lands on root's path.
# The build tree is the package, so a rebuild is seen at once; the newest build that ran this
# wins. Undo: delete the file.
link_python_package() {
  local package="$1/python" site
  [ -f "$package/linrope/__init__.py" ] || return 0  # built without the Python package
  if [ "$(id -u)" -eq 0 ]; then
    site="$(/usr/bin/python3 -c 'import site
print(next(p for p in site.getsitepackages() if p.startswith("/usr/local/")))' || true)"
  else
    site="$(/usr/bin/python3 -m site --user-site || true)"
  fi
  if [ -n "$site" ] && mkdir -p "$site" && echo "$package" > "$site/linrope.pth"; then
    echo "linrope: Python package linked: $site/linrope.pth -> $package" >&2
  else
    echo "linrope: could not link the Python package; use PYTHONPATH=$package" >&2
  fi
}
