"""linrope._pure, what `import linrope` offers where the C++ module is not built (so that
linrope.torch's native path runs on a machine without Eigen): its Rope, FeatureMap and options
structs against the C++ module's (the same frequencies bit for bit, the same W to the rounding of
two QR factorisations, the same defaults), the native path with them equal to the native path with
the C++ ones, and a copy of the package without a build: linrope.torch imports, runs its native
path, and refuses CPU tensors on "auto" with a message that says why."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import linrope
import linrope.torch as lt
from cases import inputs
from linrope import _pure
from linrope.torch.native.dispatch import core_built

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
U64 = np.finfo(np.float64).eps / 2
NEEDS_CORE = pytest.mark.skipif(not core_built(),
                                reason="compares with the C++ module, not built here")

ROPES = [dict(dim=64), dict(dim=64, scaling="linear", factor=2.0),
         dict(dim=64, scaling="ntk", factor=3.0),
         dict(dim=64, scaling="yarn", factor=4.0, original_max_position=64),
         dict(dim=8, rotary_dim=6, base=500.0, layout="half")]
MAPS = [("favor+", 64, 256, True, False), ("favor+", 5, 7, False, False),
        ("favor-hyp", 16, 40, True, True), ("favor-trig", 3, 8, True, False),
        ("elu+1", 4, 0, True, False), ("1+cos", 4, 0, True, False)]


@NEEDS_CORE
@pytest.mark.parametrize("options", ROPES, ids=str)
def test_the_pure_rope_has_the_frequencies_of_the_cpp_rope(options):
    cpp, pure = linrope.Rope(**options), _pure.Rope(**options)
    # The same formulas through the same libm calls (pow, log): the same bits.
    assert np.array_equal(pure.frequencies(), cpp.frequencies())
    for name in ("dim", "rotary_dim", "base", "layout", "scaling", "factor", "magnitude"):
        assert getattr(pure, name) == getattr(cpp, name), name


@NEEDS_CORE
@pytest.mark.parametrize("kind, d, f, orthogonal, regularized", MAPS)
def test_the_pure_map_draws_the_w_of_the_cpp_map(kind, d, f, orthogonal, regularized):
    options = dict(num_features=f, orthogonal=orthogonal, seed=123, regularized=regularized)
    cpp, pure = linrope.FeatureMap(kind, d, **options), _pure.FeatureMap(kind, d, **options)
    for name in ("kind", "input_dim", "num_features", "orthogonal", "seed", "output_dim",
                 "nonnegative"):
        assert getattr(pure, name) == getattr(cpp, name), name
    assert pure.__getstate__() == cpp.__getstate__()
    if not kind.startswith("favor"):
        return
    if not orthogonal:  # the Gaussians themselves: the same integer stream and libm calls
        assert np.array_equal(pure.projection, cpp.projection)
        return
    # Each block is the Q of a QR of the same Gaussian G (Eigen's Householder there, LAPACK's
    # here), with R's signs folded in, which makes it unique; both are backward stable (Higham,
    # Thm. 19.4: G + dG, |dG| <= d^2 u |G|), and Q moves by at most kappa(G) times that
    # (its condition), so the two differ by 2 d^2 u kappa(G) of the rows' norms at most.
    want = 0.0
    for g, norms in _pure.orthogonal_draws(d, f, regularized, 123):
        want = max(want, 2 * d * d * U64 * np.linalg.cond(g) * max(norms))
    assert np.abs(pure.projection - cpp.projection).max() <= want


@NEEDS_CORE
def test_the_pure_structs_hold_the_cpp_defaults():
    for name in ("SoftmaxOptions", "LinearOptions", "DenominatorStats", "RopeConfig",
                 "FeatureMapConfig"):
        cpp, pure = getattr(linrope, name)(), getattr(_pure, name)()
        for field, default in type(pure)._fields:
            assert getattr(cpp, field) == default, (name, field)
            assert type(getattr(cpp, field)) is type(default), (name, field)
    assert issubclass(_pure.NonFiniteError, ValueError)


@NEEDS_CORE
def test_the_native_path_with_the_pure_rope_and_map_equals_it_with_the_cpp_ones():
    q, k, v = (x.detach() for x in inputs((2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 3), seed=1))
    results = []
    for module in (linrope, _pure):
        fm = module.FeatureMap("favor+", 8, num_features=16, seed=4)
        with lt.backend("native"):
            results.append(lt.linear_attention(q, k, v, fm, causal=True, rope=module.Rope(16)))
    scale = float(results[0].abs().max())
    assert float((results[1] - results[0]).abs().max()) <= 1e-12 * scale


NO_BUILD = """
import torch, linrope, linrope.torch as lt
assert not hasattr(linrope, "linear_attention") and linrope.Rope is linrope._pure.Rope
layer = lt.MultiheadAttention(16, 2, "linear", causal=True, short_conv=3, decay="retnet")
x = torch.randn(2, 7, 16)
try:
    layer(x)
except ValueError as e:
    print("refused:", e)
with lt.backend("native"):
    out = layer(x)
    out.sum().backward()
print("native:", tuple(out.shape), bool(torch.isfinite(layer.q_proj.weight.grad).all()))
"""


def test_without_a_build_linrope_torch_runs_natively_and_refuses_cpu_on_auto(tmp_path):
    # The package's sources alone (no _core, no _build_info), as a GPU machine without Eigen has
    # them: linrope imports with the stand-ins, linrope.torch runs the layer natively.
    copy = tmp_path / "python" / "linrope"
    shutil.copytree(os.path.join(SOURCE, "python", "linrope"), copy,
                    ignore=shutil.ignore_patterns("_core*", "_build_info.py", "__pycache__"))
    shutil.copy(os.path.join(SOURCE, "CMakeLists.txt"), tmp_path / "CMakeLists.txt")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "python"))
    result = subprocess.run([sys.executable, "-c", NO_BUILD], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "refused: linear_attention: q is a CPU tensor, which runs on linrope's C++ module, " \
           "and the module is not built here" in result.stdout
    assert "native: (2, 7, 16) True" in result.stdout
    version = subprocess.run([sys.executable, "-c", "import linrope; print(linrope.__version__)"],
                             capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert version.stdout.strip() == linrope.__version__
    # `python3 -m linrope` (the bug report) says what is there instead of failing.
    report = subprocess.run([sys.executable, "-m", "linrope"], capture_output=True, text=True,
                            timeout=60, env=env, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0] == "linrope " + linrope.__version__
    assert lines[1].startswith("built     no: the C++ module is not built here")
    assert [line.split()[0] for line in lines[2:]] == ["cpu", "python", "location"]
    as_json = json.loads(subprocess.run([sys.executable, "-m", "linrope", "--json"],
                                        capture_output=True, text=True, timeout=60, env=env,
                                        cwd=tmp_path).stdout)
    assert as_json["built"] is False and as_json["location"] == str(copy)
