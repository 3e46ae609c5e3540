"""The check that keeps a build off a CPU it cannot run on (no import of linrope._core here).

A build made with -march=native (LINROPE_NATIVE=ON, the default) uses every instruction set of the
machine it was built on; a wheel of it copied to a CPU without, say, AVX-512 would die of an
illegal instruction at the first kernel call, or at import. ``linrope/__init__.py`` calls
``check`` with the instruction sets recorded at build time before it loads the module.

The refusal is one line, not a traceback: the frames would only show linrope's own import.
"""
import sys


class UnsupportedCPUError(ImportError):
    """This build uses instruction sets this CPU lacks."""


def _one_line(hook):
    """sys.excepthook that prints an uncaught UnsupportedCPUError as its message alone."""
    def excepthook(kind, value, traceback):
        if issubclass(kind, UnsupportedCPUError):
            sys.stderr.write("%s\n" % value)
        else:
            hook(kind, value, traceback)
    excepthook.linrope_one_line = True
    return excepthook


def cpu_flags(path="/proc/cpuinfo"):
    """The set of instruction-set flags of the first CPU in ``path``, or None if unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                # x86 says "flags", ARM "Features".
                if line.startswith(("flags", "Features")) and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


# Flags a kernel may leave out of /proc/cpuinfo although the CPU has them, and a flag that every
# CPU having it also has. "abm" is LZCNT, which gcc's -march=native turns on from CPUID: a
# Firecracker guest on an AMD EPYC (Zen 5, Linux 6.18) has the ABM bit in CPUID (leaf 0x80000001,
# ECX bit 5) but no "abm" in its flags, so a build made on it refused to import on it. Every x86
# CPU with BMI2 has LZCNT (Intel since Haswell, which brought both; AMD since Excavator, which had
# ABM since K10).
IMPLIED = {"abm": "bmi2"}


def missing(required, flags):
    """The entries of ``required`` absent from ``flags`` (and not implied by one present, IMPLIED),
    in order."""
    return [name for name in required
            if name not in flags and IMPLIED.get(name, name) not in flags]


def check(required, native, path="/proc/cpuinfo"):
    """Raises UnsupportedCPUError (an ImportError) if this CPU lacks an instruction set the build
    uses; uncaught, it prints its one line and nothing else. Where the CPU's flags cannot be read
    (not Linux), nothing is checked."""
    flags = cpu_flags(path)
    if flags is None:
        return
    lacking = missing(required, flags)
    if lacking:
        how = ("it was built with -march=native (LINROPE_NATIVE=ON) on another CPU"
               if native else "its compiler flags require them")
        if not getattr(sys.excepthook, "linrope_one_line", False):
            sys.excepthook = _one_line(sys.excepthook)
        raise UnsupportedCPUError(
            "linrope: this build uses %s, which this CPU lacks (%s); reinstall linrope from "
            "source on this machine, or with LINROPE_NATIVE=OFF for a portable build"
            % (", ".join(lacking), how))
