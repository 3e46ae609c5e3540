"""The package itself: its version is CMake's, `python3 -m linrope` reports the build, and a build
for instruction sets this CPU lacks refuses to import with one line instead of an illegal
instruction."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import linrope
from linrope import _isa

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(*args, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          **kwargs)


def test_version_is_the_cmake_project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        version = re.search(r"project\(linrope VERSION ([0-9.]+)", f.read()).group(1)
    assert linrope.__version__ == version


def test_build_info_says_what_was_built():
    info = linrope.build_info()
    assert info["version"] == linrope.__version__
    assert info["git_commit"] == "unknown" or re.fullmatch("[0-9a-f]{40}", info["git_commit"])
    assert info["git_dirty"] in (True, False, None)
    assert info["openmp"] == linrope.openmp
    assert info["threads"] == linrope.get_num_threads() >= 1
    assert all(isinstance(name, str) and name for name in info["isa"])
    if info["native"] and os.uname().machine == "x86_64":
        assert "sse2" in info["isa"]  # every x86-64 compiler predefines __SSE2__


def test_main_prints_the_report():
    result = run_python("-m", "linrope")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "linrope " + linrope.__version__
    keys = [line.split()[0] for line in lines[1:]]
    assert keys == ["commit", "build", "built", "isa", "cpu", "openmp", "python", "location"]
    assert linrope.build_info()["git_commit"] in lines[1]
    as_json = json.loads(run_python("-m", "linrope", "--json").stdout)
    assert as_json["version"] == linrope.__version__ and as_json["cpu_lacks"] in ([], None)
    assert as_json["built"] is True


def test_main_into_a_reader_that_has_left_is_not_an_error():
    # `python3 -m linrope | head -1`, at its worst: the reader has gone before the first write.
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, "-m", "linrope"], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert result.returncode == 0 and result.stderr == ""


def fake_cpuinfo(tmp_path, flags):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Fake CPU\nflags\t\t: %s\n" % " ".join(flags))
    return str(path)


def test_isa_check_names_what_the_cpu_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # check() wraps it before raising
    required = ("sse2", "avx2", "avx512f", "avx512bw")
    everything = ["fpu", "sse2", "avx2", "avx512f", "avx512bw"]
    _isa.check(required, True, fake_cpuinfo(tmp_path, everything))
    with pytest.raises(_isa.UnsupportedCPUError) as e:
        _isa.check(required, True, fake_cpuinfo(tmp_path, ["fpu", "sse2", "avx2"]))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("linrope: this build uses avx512f, avx512bw, which this CPU lacks")
    assert "LINROPE_NATIVE=OFF" in message
    # Unreadable (not Linux): nothing to check against, the import goes on.
    _isa.check(required, True, str(tmp_path / "no-such-file"))


def test_lzcnt_counts_as_present_with_bmi2():
    # "abm" (LZCNT) is left out of /proc/cpuinfo by some guests whose CPUID has it; BMI2 implies it.
    assert _isa.missing(("bmi2", "abm"), {"bmi1", "bmi2"}) == []
    assert _isa.missing(("bmi1", "abm"), {"bmi1"}) == ["abm"]
    assert _isa.missing(("abm",), {"abm"}) == []


@pytest.mark.skipif(_isa.cpu_flags() is None, reason="no /proc/cpuinfo to check against")
def test_a_build_for_a_missing_isa_refuses_to_import(tmp_path):
    # A copy of the package whose record claims an instruction set no CPU has: the import must
    # stop before the module is loaded, with one line, and `python3 -m linrope` too.
    package = os.path.dirname(linrope.__file__)
    copy = tmp_path / "linrope"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    info = copy / "_build_info.py"
    text = info.read_text()
    info.unlink()  # a symlink in an editable install: replace it, never write through it
    info.write_text(text + "isa = isa + ('linrope_fake_isa',)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for command in (["-c", "import linrope"], ["-m", "linrope"]):
        result = run_python(*command, cwd=str(tmp_path), env=env)
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("linrope: this build uses linrope_fake_isa, which this "
                                        "CPU lacks"), result.stderr
