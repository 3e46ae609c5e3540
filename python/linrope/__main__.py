"""python3 -m linrope [--version] [--json]: what this linrope is, for a bug report.

Prints the version, the commit it was built from, the build options, the instruction sets the
build uses (and whether this CPU has them), OpenMP and the thread count, and where it was loaded
from. --json prints the same as one JSON object. Also installed as the `linrope` command.
"""
import argparse
import json
import os
import platform
import sys


def _cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _report(argv=None):
    parser = argparse.ArgumentParser(
        prog="linrope", description="Print how this linrope was built (for a bug report).")
    parser.add_argument("--version", action="store_true",
                        help="the same report (the version is its first line)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead")
    args = parser.parse_args(argv)
    # A build for instruction sets this CPU lacks stopped already, with one line (linrope/_isa.py).
    import linrope
    from linrope import _isa

    where = dict(location=os.path.dirname(os.path.abspath(linrope.__file__)),
                 python="%s (%s)" % (platform.python_version(), sys.executable),
                 cpu=_cpu_model())
    if linrope._build_info is None:
        return _report_sources_only(linrope.__version__, where, args.json)
    info = dict(linrope.build_info(), built=True, **where)
    flags = _isa.cpu_flags()
    info["cpu_lacks"] = None if flags is None else _isa.missing(info["isa"], flags)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    dirty = {True: " (with local changes)", False: "", None: ""}[info["git_dirty"]]
    lacks = ("unknown (no /proc/cpuinfo)" if info["cpu_lacks"] is None
             else "lacks " + ", ".join(info["cpu_lacks"]) if info["cpu_lacks"] else "has them all")
    print("linrope %s" % info["version"])
    print("commit    %s%s" % (info["git_commit"], dirty))
    print("build     %s, %s, %s" % (info["build_type"], info["compiler"],
                                    "-march=native" if info["native"] else "portable"))
    print("built in  %s" % info["build_dir"])
    print("isa       %s" % (" ".join(info["isa"]) or "(none recorded)"))
    print("cpu       %s: %s" % (info["cpu"], lacks))
    print("openmp    %s" % ("on, %d threads" % info["threads"] if info["openmp"]
                            else "off (serial)"))
    print("python    %s" % info["python"])
    print("location  %s" % info["location"])
    return 0


def _report_sources_only(version, where, as_json):
    # The package's sources without its C++ module (a machine without Eigen, docs/DESIGN.md "Any
    # device"): no build to describe, and only linrope.torch's native path to run.
    if as_json:
        print(json.dumps(dict(version=version, built=False, **where), indent=2))
        return 0
    print("linrope %s" % version)
    print("built     no: the C++ module is not built here (linrope.torch runs its native path "
          "only)")
    print("cpu       %s" % where["cpu"])
    print("python    %s" % where["python"])
    print("location  %s" % where["location"])
    return 0


def main(argv=None):
    try:
        return _report(argv)
    except BrokenPipeError:
        # `python3 -m linrope | head`: the reader has gone, which is not an error of ours. Point
        # stdout at /dev/null so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
