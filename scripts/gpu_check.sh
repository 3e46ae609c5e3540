#!/usr/bin/env bash
# linrope.torch's native path on a device (docs/DESIGN.md, "Any device"), in under 5 minutes:
#   1. its tests (python/tests/test_native*.py) with the native side on that device
#      (LINROPE_TEST_DEVICE), the expected side on the CPU;
#   2. the timing of forward and forward + backward of MultiheadAttention (causal linear, and
#      softmax) against softmax + RoPE through scaled_dot_product_attention, n = 1k..32k
#      (scripts/gpu_timing.py), written to <out>/timing.csv.
#
#   scripts/gpu_check.sh [--device cuda] [--out DIR] [--sizes 1024,...,32768] [--dtype float32]
#   scripts/gpu_check.sh --device cpu --sizes 256,512     # the same steps on the CPU, small
#
# Needs Python with PyTorch (>= 2.0 for scaled_dot_product_attention; older runs the rest),
# NumPy and pytest; no C++ compiler and no Eigen. linrope is imported from this source tree as it
# is: where its C++ module is not built (the usual case on a GPU machine), linrope._pure stands in
# for it and the tests' expected side is the native path on the CPU, which the same tests prove
# equal to the C++ kernels wherever the module is built. PYTHON picks the interpreter.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
device=cuda
out=gpu_check
sizes=1024,2048,4096,8192,16384,32768
dtype=float32
python=${PYTHON:-python3}
while (($#)); do
  case $1 in
    --device) device=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --device, --out, --sizes, --dtype)" >&2
       exit 2 ;;
  esac
done

mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"

"$python" - "$device" <<'EOF'
import sys
import torch
import linrope
from linrope.torch.native.dispatch import core_built
device = torch.device(sys.argv[1])
if device.type == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: --device cuda but torch.cuda.is_available() is False")
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, linrope "
      f"{linrope.__version__} from {linrope.__file__}, C++ module built: {core_built()}, "
      f"device {device} ({name})")
EOF

echo "== 1. the native path's tests on $device"
status=0
# -p no:cacheprovider: nothing written into the source tree. The limit keeps the check short.
(cd "$out" && LINROPE_TEST_DEVICE=$device timeout 200 "$python" -m pytest -q -p no:cacheprovider \
  --junitxml="$out/tests.xml" "$repo"/python/tests/test_native*.py) || status=$?

echo "== 2. timing on $device ($dtype, n = $sizes)"
timeout 90 "$python" "$repo/scripts/gpu_timing.py" --device "$device" --dtype "$dtype" \
  --sizes "$sizes" --out "$out/timing.csv" || status=$((status ? status : $?))

echo "gpu_check.sh: results in $out (tests.xml, timing.csv); exit status $status"
exit "$status"
