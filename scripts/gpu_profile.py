"""Where the native layer's time goes on a device: MultiheadAttention(512, 8) (causal FAVOR+ eq. 19
with RoPE, chunk 256, batch 1, float32), forward + backward at n = 1024 and 8192, timed (median of
10 after 3 warm-ups), then one step under torch.profiler: the device's busy time, the kernel
launches, the operators by count and by CPU time. Run from the repository's root:

    python3 scripts/gpu_profile.py [--device cuda] > profile.txt
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, "python")
import linrope.torch as lt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    device = torch.device(parser.parse_args().device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for n in (1024, 8192):
        layer = lt.MultiheadAttention(512, 8, "linear", causal=True, rope=True, device=device)
        layer.chunk_size = 256
        x = torch.randn(1, n, 512, device=device, requires_grad=True)

        def step():
            y = layer(x)
            y.backward(torch.ones_like(y))
        with lt.backend("native"):
            for _ in range(3):
                step()
            synchronize()
            times = []
            for _ in range(10):
                start = time.perf_counter()
                step()
                synchronize()
                times.append(time.perf_counter() - start)
            with torch.profiler.profile(activities=activities) as profile:
                step()
                synchronize()
        events = profile.key_averages()
        launches = sum(e.count for e in events if e.key.startswith("cuda") and "Launch" in e.key)
        operators = sum(e.count for e in events if e.key.startswith("aten::"))
        print(f"n={n} forward+backward median {statistics.median(times) * 1e3:.2f} ms; "
              f"kernel launches {launches}, aten operators {operators}")
        print(events.table(sort_by="count", row_limit=25))
        print(events.table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
