# Shared by scripts/experiments.sh and scripts/test.sh: install what is missing, then configure and
# build one build tree. Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="$(nproc)"

# Debian 12 packages: compiler and build tools, the libraries, and what the plots need.
PACKAGES=(g++ cmake make git libeigen3-dev doctest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev python3 python3-matplotlib python3-numpy)

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
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# build_tree DIR [cmake options...]: configure (first time) and build everything in DIR.
build_tree() {
  local dir="$1"; shift
  cmake -S "$ROOT" -B "$dir" "$@"
  cmake --build "$dir" -j "$JOBS"
}
