#!/usr/bin/python3
"""Two or more builds of a Google Benchmark program, compared one process at a time.

One process runs the same call at a steady speed, but two processes of the same binary can differ
by 20-45% on the machines we measure on, so a comparison inside one process each says little. On
the 2-vCPU machines, at least part of it is which vCPU a process runs on: the study's FAVOR+ call
pinned with taskset took 1.68-1.71 ms on vCPU 0 and 1.73-2.47 ms on vCPU 1 (2026-11-29). This
runs every binary --processes times, alternated (the order reversed every other round), each
process taking the median of --repetitions repetitions, and prints per benchmark each binary's
median over its processes and their range.

  OMP_NUM_THREADS=1 /usr/bin/python3 bench/ab_processes.py --processes 8 \\
      --filter 'softmax/(backward|streaming)/n:4096/d:(64|128)/causal:(0|1)/' \\
      <before>/bench/bench_softmax <after>/bench/bench_softmax
"""
import argparse
import collections
import os
import statistics
import subprocess


def medians_of_one_process(binary, benchmark_filter, repetitions):
    command = [binary, f"--benchmark_filter={benchmark_filter}",
               f"--benchmark_repetitions={repetitions}", "--benchmark_min_time=0.2",
               "--benchmark_report_aggregates_only=true"]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    for line in output.splitlines():
        fields = line.split()
        if not fields or "/" not in fields[0]:
            continue  # the header
        if repetitions == 1:
            yield fields[0], float(fields[1])
        elif fields[0].endswith("_median"):
            yield fields[0][: -len("_median")], float(fields[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binaries", nargs="+")
    parser.add_argument("--filter", required=True, help="--benchmark_filter")
    parser.add_argument("--processes", type=int, default=8, help="per binary")
    parser.add_argument("--repetitions", type=int, default=3, help="per process")
    args = parser.parse_args()
    times = collections.defaultdict(list)  # (benchmark, binary) -> one median per process
    for round_index in range(args.processes):
        order = args.binaries if round_index % 2 == 0 else args.binaries[::-1]
        for binary in order:
            for name, value in medians_of_one_process(binary, args.filter, args.repetitions):
                times[(name, binary)].append(value)
    print("benchmark | " + " | ".join(os.path.relpath(b) for b in args.binaries))
    for name in sorted({name for name, _ in times}):
        cells = []
        for binary in args.binaries:
            values = times[(name, binary)]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.1f}-{max(values):.1f})")
        print(name + " | " + " | ".join(cells))


if __name__ == "__main__":
    main()
