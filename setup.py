"""pip's way in: `pip install .` (or `-e .`, or `python3 -m build --wheel`) builds linrope._core
with the project's own CMake, the same build `cmake -S . -B build/...` gives, restricted to the
Python module and the library it links.

The build directory persists, build/python-<interpreter>-<native|portable>-<openmp|serial>, so a
second install recompiles only what changed. Options, read from the environment at install time
and recorded in linrope/_build_info.py (`python3 -m linrope` prints them):
  LINROPE_NATIVE=ON|OFF   -march=native (default ON; OFF: a portable build, for a wheel that
                          other x86-64 machines can import)
  LINROPE_OPENMP=ON|OFF   OpenMP (default ON)
  LINROPE_BUILD_DIR=DIR   build in DIR instead; an already configured DIR (e.g. build/release) is
                          built as it is configured, options and all, and not reconfigured
  LINROPE_CMAKE_ARGS="…"  more arguments for the configure step
  CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default: every core)
Bad input gets one line: a missing tool names the Debian package that provides it.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
# Built by CMake: the module and the record of how (linrope/__init__.py reads it).
BUILT_FILES = ("_core" + sysconfig.get_config_var("EXT_SUFFIX"), "_build_info.py")


def cmake_version():
    """The version in project(linrope VERSION x.y.z): the one place it is written."""
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*linrope\s+VERSION\s+([0-9]+(?:\.[0-9]+)*)", text)
    if not match:
        raise SetupError("linrope: no project(linrope VERSION ...) in CMakeLists.txt")
    return match.group(1)


def on_off(name, default):
    value = os.environ.get(name, default).strip().upper()
    if value in ("ON", "1", "TRUE", "YES"):
        return True
    if value in ("OFF", "0", "FALSE", "NO"):
        return False
    raise SetupError("linrope: %s=%s: expected ON or OFF" % (name, os.environ[name]))


def require_tools():
    """One line naming the Debian package for each thing the build cannot start without."""
    if not shutil.which("cmake"):
        raise SetupError("linrope: cmake not found; on Debian: apt-get install cmake")
    cxx = os.environ.get("CXX")
    if cxx and not shutil.which(shlex.split(cxx)[0]):
        raise SetupError("linrope: the C++ compiler CXX=%s not found; on Debian: "
                         "apt-get install g++ (or unset CXX)" % cxx)
    if not cxx and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise SetupError("linrope: no C++ compiler (c++, g++, clang++) found; on Debian: "
                         "apt-get install g++")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise SetupError("linrope: Python.h not found for %s; on Debian: apt-get install "
                         "python3-dev" % sys.executable)


# What a failed configure step most likely lacks, by the package CMake names in its error.
CONFIGURE_HINTS = (("pybind11", "pybind11-dev"), ("Eigen3", "libeigen3-dev"),
                   ("OpenMP", "libgomp1 (with g++), or install with LINROPE_OPENMP=OFF"),
                   ("Development.Module", "python3-dev"))


def cmake_errors(output):
    """The "CMake Error" blocks of CMake's output (not its status lines, which name everything it
    found)."""
    blocks, inside = [], False
    for line in output.splitlines():
        if line.startswith("CMake Error"):
            inside = True
        elif line.startswith(("-- ", "CMake Warning")):
            inside = False
        if inside:
            blocks.append(line)
    return "\n".join(blocks)


def run(command, what):
    """Runs a command; on failure, its output then one line saying what failed."""
    print("linrope: " + " ".join(shlex.quote(str(c)) for c in command), flush=True)
    process = subprocess.run([str(c) for c in command], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(process.stdout)
    sys.stdout.flush()
    if process.returncode != 0:
        hint = ""
        if what == "configure":
            errors = cmake_errors(process.stdout)
            missing = [pkg for key, pkg in CONFIGURE_HINTS if key in errors]
            if missing:
                hint = "; on Debian: apt-get install " + " ".join(missing)
        raise SetupError("linrope: the CMake %s step failed (exit %d, output above)%s"
                         % (what, process.returncode, hint))


class CMakeBuild(build_ext):
    """build_ext for linrope._core: configure and build the CMake project, then take the module
    and _build_info.py from <build dir>/python/linrope/."""

    def build_extension(self, ext):
        require_tools()
        build_dir = self.cmake_build_dir()
        cache = build_dir / "CMakeCache.txt"
        if not cache.exists() or "LINROPE_BUILD_DIR" not in os.environ:
            self.configure(build_dir)
        elif "LINROPE_BUILD_PYTHON:BOOL=ON" not in cache.read_text():
            raise SetupError("linrope: LINROPE_BUILD_DIR=%s is configured without the Python "
                             "module; reconfigure it with -DLINROPE_BUILD_PYTHON=ON" % build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        run(["cmake", "--build", build_dir, "--target", "linrope_python", "-j", jobs], "build")
        package = build_dir / "python" / "linrope"
        for name in BUILT_FILES:
            if not (package / name).exists():
                raise SetupError("linrope: %s has no %s: it was configured for another Python "
                                 "than %s; remove it or set LINROPE_BUILD_DIR"
                                 % (build_dir, name, sys.executable))
        target = Path(self.get_ext_fullpath(ext.name)).parent
        target.mkdir(parents=True, exist_ok=True)
        for name in BUILT_FILES:
            shutil.copyfile(package / name, target / name)
        self._package = package

    def cmake_build_dir(self):
        if os.environ.get("LINROPE_BUILD_DIR"):
            return Path(os.environ["LINROPE_BUILD_DIR"]).resolve()
        native, openmp = on_off("LINROPE_NATIVE", "ON"), on_off("LINROPE_OPENMP", "ON")
        return ROOT / "build" / ("python-%s-%s-%s" % (sys.implementation.cache_tag,
                                                      "native" if native else "portable",
                                                      "openmp" if openmp else "serial"))

    def configure(self, build_dir):
        native, openmp = on_off("LINROPE_NATIVE", "ON"), on_off("LINROPE_OPENMP", "ON")
        command = ["cmake", "-S", ROOT, "-B", build_dir, "-DPython_EXECUTABLE=" + sys.executable,
                   "-DCMAKE_BUILD_TYPE=Release", "-DLINROPE_BUILD_PYTHON=ON",
                   "-DLINROPE_BUILD_TESTS=OFF", "-DLINROPE_BUILD_BENCHMARKS=OFF",
                   "-DLINROPE_BUILD_EXPERIMENTS=OFF",
                   "-DLINROPE_NATIVE=" + ("ON" if native else "OFF"),
                   "-DLINROPE_OPENMP=" + ("ON" if openmp else "OFF")]
        try:  # pip's pybind11 (python3-pybind11) knows where its CMake files are
            import pybind11
            command.append("-Dpybind11_DIR=" + pybind11.get_cmake_dir())
        except (ImportError, AttributeError, RuntimeError):
            pass
        command += shlex.split(os.environ.get("LINROPE_CMAKE_ARGS", ""))
        run(command, "configure")

    def copy_extensions_to_source(self):
        # pip install -e: link python/linrope/<file> to the CMake build's own, instead of copying,
        # so that a rebuild there (cmake --build <build dir> --target linrope_python, or pip
        # install -e . again) is what the next import loads.
        source = ROOT / "python" / "linrope"
        for name in BUILT_FILES:
            link = source / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(self._package / name)


setup(
    version=cmake_version(),
    package_dir={"": "python"},
    packages=find_packages("python"),  # every package under python/, subpackages included
    ext_modules=[Extension("linrope._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
