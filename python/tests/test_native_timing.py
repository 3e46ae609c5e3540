"""scripts/gpu_timing.py (gpu_check.sh's timing part) at small sizes on the CPU: every case at every
size and pass, timed, in a complete CSV that replaced the file atomically."""
import csv
import importlib.util
import os

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "scripts", "gpu_timing.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_timing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timing_writes_every_case_size_and_pass(tmp_path):
    timing = load_script()
    out = tmp_path / "timing.csv"
    timing.main(["--device", "cpu", "--sizes", "16,33", "--repeats", "2", "--heads", "2",
                 "--head-dim", "8", "--out", str(out)])
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    cases = ["layer-linear", "layer-linear-c256", "layer-softmax"]
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        cases.append("sdpa+rope")
    assert sorted((r["case"], int(r["n"]), r["pass"]) for r in rows) == sorted(
        (c, n, p) for c in cases for n in (16, 33) for p in ("forward", "forward+backward"))
    for r in rows:
        assert r["status"] == "ok" and r["repeats"] == "2" and r["device"] == "cpu", r
        assert 0 < float(r["min_ms"]) <= float(r["median_ms"]), r
    assert os.listdir(tmp_path) == ["timing.csv"]  # no temporary file left beside it
