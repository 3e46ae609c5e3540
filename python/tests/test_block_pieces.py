"""linrope.gelu / gelu_backward / rms_norm / rms_norm_backward (NumPy) and linrope.torch.gelu /
rms_norm / GELU / RMSNorm (the rest of a pre-norm block on them): against explicit float64
formulas within derived rounding bounds, gradcheck in float64, the fall-backs to PyTorch's own
computation where linrope's kernels do not run, the modules, the same bits on one thread and
on two, and the refusals. The references are written here in NumPy float64 (math.erf for GELU,
mpmath for its far tail) and share nothing with linrope.
"""
import math
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linrope
import linrope.torch as lt
from bounds import assert_within, unit_roundoff

U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)  # 2^-24, 2^-53


def within(actual, expected, bound, what):
    """bounds.assert_within, which needs at least one entry, and the shapes equal."""
    assert tuple(actual.shape) == tuple(expected.shape), what
    if expected.size:
        assert_within(actual, expected, bound, what)


def u_of(dtype):
    return U32 if np.dtype(dtype) == np.float32 else U64


@pytest.fixture
def restore_threads():
    before = linrope.get_num_threads()
    yield
    linrope.set_num_threads(before)


@pytest.fixture
def quick_failure(monkeypatch):
    """A failing fast_mode gradcheck reports without computing the full Jacobian for its message
    (which on ~16k elements takes minutes)."""
    monkeypatch.setattr(sys.modules["torch.autograd.gradcheck"], "_run_slow_mode_and_get_error",
                        lambda *args, **kwargs: " (full Jacobians not computed here)",
                        raising=False)


def ours_gelu(y):
    """Whether y came out of linrope's autograd Function (not F.gelu)."""
    return y.grad_fn is not None and type(y.grad_fn).__name__ == "_GELUBackward"


def ours_norm(y):
    """Whether y came out of linrope's autograd Function (not PyTorch's expression)."""
    return y.grad_fn is not None and type(y.grad_fn).__name__ == "_RMSNormBackward"


# ------------------------------------------------------------------------------------- GELU --

_erf = np.vectorize(math.erf, otypes=[np.float64])


def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2 in float64 from math.erf (the kernels use Abramowitz
    and Stegun 7.1.26 in float32 and erfc in float64: another formula)."""
    return 0.5 * (1 + _erf(np.asarray(x, np.float64) / math.sqrt(2)))


def normal_density(x):
    x = np.asarray(x, np.float64)
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def gelu_exact(x):
    return np.asarray(x, np.float64) * normal_cdf(x)


def gelu_derivative_exact(x):
    """GELU'(x) = Phi(x) + x phi(x)."""
    return normal_cdf(x) + np.asarray(x, np.float64) * normal_density(x)


# Tiny values and the tails first (|x| > 13.2: exp(-x^2 / 2) below float32's normal range), then
# the grid [-12, 12] in steps of 1/64 (0 among them), then N(0, 4^2) samples.
_SPECIAL = [0.0] + [s * a for a in (1e-30, 1e-3, 0.5, 12.9, 13.0, 13.2, 13.3) for s in (1, -1)]
_GRID = np.arange(-12 * 64, 12 * 64 + 1) / 64.0


def gelu_values(shape, rng, dtype):
    n = math.prod(shape)
    head = np.concatenate([_SPECIAL, _GRID])
    tail = 4 * rng.standard_normal(max(0, n - head.size))
    return np.concatenate([head, tail])[:n].reshape(shape).astype(dtype)


def gelu_bound(scale, exact, dtype):
    """|kernel - exact| for gelu (scale = x) and gelu_backward (scale = d_y), as tests/
    test_gelu.cpp derives it. float32: Phi by Abramowitz-Stegun 7.1.26, |erfc error| <= 1.5e-7,
    so Phi within 0.75e-7; its ~12 roundings (z, t, the five Horner steps and their rounded
    coefficients, exp, 1 - E / 2), t's error amplified at most 3.5x (t in (0, 1]): ~16-20 u, 32 u
    with margin (x phi in the backward adds < 2 u, x phi <= 0.25); the final
    product(s) 2 u |exact|. float64: the kernel's erfc and this file's math.erf (and 1 + erf) are
    each within a few ulp (<= 2 u below 2) of Phi, x / sqrt 2's rounding moves them < u: 16 u
    |scale| for both sides, the products 4 u |exact|. (Not a relative bound: in the far negative
    tail math.erf's 1 + erf cancels to 0, the reference is only accurate absolutely there;
    test_gelu_float64_is_relatively_accurate_in_the_tail checks the kernel there against mpmath.)
    """
    scale, exact = np.abs(np.asarray(scale, np.float64)), np.abs(exact)
    u = u_of(dtype)
    if np.dtype(dtype) == np.float32:
        return scale * (0.75e-7 + 32 * u) + 2 * u * exact
    return scale * 16 * u + 4 * u * exact


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (17,), (3, 5, 16), (2, 16385)])
def test_gelu_and_backward_match_the_explicit_formula(rng, dtype, shape):
    """Element-wise over any shape: one element, a packet tail, three dimensions, two rows that
    straddle the 16384-element blocks (1 << 14)."""
    x = gelu_values(shape, rng, dtype)
    d_y = rng.standard_normal(shape).astype(dtype)
    y = linrope.gelu(x)
    d_x = linrope.gelu_backward(x, d_y)
    for result in (y, d_x):
        assert result.dtype == dtype and result.shape == shape
        assert not np.shares_memory(result, x) and not np.shares_memory(result, d_y)
    want_y = gelu_exact(x)
    want_d_x = d_y.astype(np.float64) * gelu_derivative_exact(x)
    within(y, want_y, gelu_bound(x, want_y, dtype), "gelu")
    within(d_x, want_d_x, gelu_bound(d_y, want_d_x, dtype), "gelu_backward")


def test_gelu_float64_is_relatively_accurate_in_the_tail():
    """float64 against mpmath (50 digits) over [-13.3, 13.3], where math.erf's 1 + erf cancels:
    the kernel's Phi(x) = erfc(-x / sqrt 2) / 2 is relatively accurate. Its argument z = |x| /
    sqrt 2 carries 2 u (the rounded constant, the product), which erfc turns into a relative
    error of at most (2 z^2 + 1) 2 u = (2 x^2 + 2) u (|d ln erfc / d ln z| <= 2 z^2 + 1 for z >= 0,
    from erfc(z) >= 2 exp(-z^2) / (sqrt pi (z + sqrt(z^2 + 2)))); erfc's own error <= 5 ulp
    (10 u), the products 2 u: (2 x^2 + 16) u relative. The backward adds phi = exp(-x^2 / 2)
    (x^2 / 2 + 2) u relative, less than that: the same bound, relative to Phi + |x| phi."""
    mpmath = pytest.importorskip("mpmath")
    x = np.concatenate([_SPECIAL, _GRID[::4]])
    d_y = np.linspace(-2, 2, x.size)
    with mpmath.workdps(50):
        cdf = [mpmath.erfc(-mpmath.mpf(v) / mpmath.sqrt(2)) / 2 for v in x]
        density = [mpmath.exp(-mpmath.mpf(v) ** 2 / 2) / mpmath.sqrt(2 * mpmath.pi) for v in x]
        want_y = np.array([float(mpmath.mpf(v) * c) for v, c in zip(x, cdf)])
        want_d = np.array([float(c + mpmath.mpf(v) * p) for v, c, p in zip(x, cdf, density)])
        magnitude = np.array([float(c + abs(mpmath.mpf(v)) * p)
                              for v, c, p in zip(x, cdf, density)])
    relative = (2 * x * x + 16) * U64
    within(linrope.gelu(x), want_y, relative * np.abs(want_y) + 1e-300, "gelu")
    within(linrope.gelu_backward(x, d_y), d_y * want_d,
           relative * np.abs(d_y) * magnitude + 1e-300, "gelu_backward")
    assert linrope.gelu(np.array([-13.0]))[0] < 0  # not flushed to 0 as 1 + erf would


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_reads_non_contiguous_inputs(rng, dtype):
    """A transposed view is read through a copy: the same numbers as its contiguous copy, in the
    view's shape."""
    x = gelu_values((40, 30), rng, dtype).T
    d_y = rng.standard_normal((40, 30)).astype(dtype).T
    assert not x.flags.c_contiguous
    y = linrope.gelu(x)
    assert y.shape == (30, 40) and np.array_equal(y, linrope.gelu(np.ascontiguousarray(x)))
    assert np.array_equal(linrope.gelu_backward(x, d_y),
                          linrope.gelu_backward(np.ascontiguousarray(x), np.ascontiguousarray(d_y)))
    assert np.array_equal(linrope.gelu_backward(x, d_y)[3], linrope.gelu_backward(x[3], d_y[3]))


@pytest.mark.parametrize("call,message", [
    (lambda: linrope.gelu(np.arange(4)), "gelu: x has dtype int64 but expected float32 or float64"),
    (lambda: linrope.gelu_backward(np.arange(4), np.arange(4)), "gelu_backward: x has dtype int64"),
    (lambda: linrope.gelu_backward(np.ones(3, np.float32), np.ones(3)),
     "gelu_backward: d_y has dtype float64 but x has dtype float32"),
    (lambda: linrope.gelu_backward(np.ones(3, np.float32), np.ones(4, np.float32)),
     "gelu_backward: d_y has shape (4,) but x has shape (3,)"),
    (lambda: linrope.gelu_backward(np.ones((2, 3)), np.ones((3, 2))),
     "gelu_backward: d_y has shape (3, 2) but x has shape (2, 3)"),
])
def test_gelu_refuses_bad_calls(call, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        call()


# ---------------------------------------------------------------------------------- RMSNorm --

def rms_norm_exact(x, w, eps):
    """y = x / sqrt(mean(x^2, -1) + eps) * w and r = 1 / sqrt(mean(x^2, -1) + eps), float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    r = 1 / np.sqrt((x * x).mean(-1) + eps)
    return x * r[..., None] * w, r


def rms_norm_backward_exact(x, w, r, d_y):
    """The gradients of sum(d_y * y) for the given r, g = d_y w, and the magnitudes their
    rounding errors are relative to:
        d_x_j = r g_j - r^3 x_j / d sum_l g_l x_l,  scale r |g_j| + r^3 |x_j| / d sum_l |g_l x_l|
        d_weight_j = sum over all rows of d_y_j x_j r,  scale sum |d_y_j x_j r|."""
    x, w, d_y = (np.asarray(a, np.float64) for a in (x, w, d_y))
    r = np.asarray(r, np.float64)[..., None]
    d = x.shape[-1]
    g = d_y * w
    dot = (g * x).sum(-1, keepdims=True)
    abs_dot = np.abs(g * x).sum(-1, keepdims=True)
    d_x = r * g - r ** 3 * x / d * dot
    d_x_scale = r * np.abs(g) + r ** 3 * np.abs(x) / d * abs_dot
    terms = (d_y * x * r).reshape(-1, d)
    return d_x, d_x_scale, terms.sum(0), np.abs(terms).sum(0)


def norm_inputs(rng, shape, dtype):
    """x gaussian with its rows scaled by 1e-3, 1 and 1e3 in turn (eps then dominates, matters
    or vanishes), weight and d_y gaussian."""
    x = rng.standard_normal(shape)
    x *= np.array([1e-3, 1.0, 1e3])[np.arange(math.prod(shape[:-1])) % 3].reshape(
        shape[:-1] + (1,))
    w = rng.standard_normal(shape[-1])
    d_y = rng.standard_normal(shape)
    return x.astype(dtype), w.astype(dtype), d_y.astype(dtype)


# Rounding errors (tests/test_rms_norm.cpp), row of d values, n rows:
#  - the sum of d squares (positive terms) errs by d u relatively; / d, + eps, sqrt (which halves
#    it) and 1 / add 4 u: r within (d + 4) u r, y = x r w two products more, (d + 6) u |y|;
#    with margin (d + 16) u |y| and (d + 16) u r.
#  - d_x = r g - c x, c = r^3 / d sum_l g_l x_l: g = d_y w rounds once, the d-term dot (d + 1) u
#    of sum_l |g_l x_l|, r^3 / d three roundings, c x, r g and the difference one each:
#    (d + 16) u (r |g| + r^3 |x| / d sum_l |g_l x_l|), for the r the backward is given.
#  - d_weight_j: two products per term, n terms added in order (in each 256-row block, then the
#    blocks): (n + d + 16) u sum_i |d_y_ij x_ij r_i|.
# The inputs (eps too) are rounded to the dtype before the reference sees them; in float64 the
# reference rounds as much as the kernel: the bounds double.
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (5, 128), (2, 3, 130), (600, 64)])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm_and_backward_match_the_explicit_formula(rng, dtype, shape, eps):
    x, w, d_y = norm_inputs(rng, shape, dtype)
    d, rows = shape[-1], math.prod(shape[:-1])
    u = u_of(dtype) * (1 if dtype == np.float32 else 2)
    y, inv_rms = linrope.rms_norm(x, w, eps)
    assert y.dtype == dtype and y.shape == shape
    assert inv_rms.dtype == dtype and inv_rms.shape == shape[:-1]
    want_y, want_r = rms_norm_exact(x, w, float(dtype(eps)))
    within(y, want_y, (d + 16) * u * np.abs(want_y), "y")
    within(inv_rms, want_r, (d + 16) * u * want_r, "inv_rms")
    # The backward from the forward's own inv_rms, which the reference takes as given.
    d_x, d_weight = linrope.rms_norm_backward(x, w, inv_rms, d_y)
    assert d_x.dtype == dtype and d_x.shape == shape
    assert d_weight.dtype == dtype and d_weight.shape == (d,)
    want_d_x, d_x_scale, want_d_w, d_w_scale = rms_norm_backward_exact(x, w, inv_rms, d_y)
    within(d_x, want_d_x, (d + 16) * u * d_x_scale, "d_x")
    within(d_weight, want_d_w, (rows + d + 16) * u * d_w_scale, "d_weight")


def test_rms_norm_reads_non_contiguous_inputs(rng):
    """A transposed x and a strided weight are read through copies: the same numbers."""
    x = rng.standard_normal((24, 9)).astype(np.float32).T  # [9 x 24], column-major
    w = rng.standard_normal(48).astype(np.float32)[::2]
    d_y = rng.standard_normal((24, 9)).astype(np.float32).T
    x_c, w_c, d_y_c = (np.ascontiguousarray(a) for a in (x, w, d_y))
    y, inv_rms = linrope.rms_norm(x, w, 1e-6)
    y_c, inv_rms_c = linrope.rms_norm(x_c, w_c, 1e-6)
    assert np.array_equal(y, y_c) and np.array_equal(inv_rms, inv_rms_c)
    for got, want in zip(linrope.rms_norm_backward(x, w, inv_rms, d_y),
                         linrope.rms_norm_backward(x_c, w_c, inv_rms_c, d_y_c)):
        assert np.array_equal(got, want)


def _norm_call(fn, **changes):
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    args = dict(x=x, weight=w, eps=1e-6) if fn == "rms_norm" else dict(
        x=x, weight=w, inv_rms=np.ones(4, np.float32), d_y=x.copy())
    args.update(changes)
    return lambda: getattr(linrope, fn)(**args)


@pytest.mark.parametrize("call,message", [
    (_norm_call("rms_norm", weight=np.ones(7, np.float32)),
     "rms_norm: weight has 7 elements but x is [4 x 8] (expected d = 8)"),
    (_norm_call("rms_norm", weight=np.ones((1, 8), np.float32)),
     "rms_norm: weight has 2 dimensions but expected 1"),
    (_norm_call("rms_norm", eps=0.0), "rms_norm: eps is 0 but expected > 0"),
    (_norm_call("rms_norm", eps=-1.0), "rms_norm: eps is -1 but expected > 0"),
    (_norm_call("rms_norm", eps=float("nan")), "rms_norm: eps is nan but expected > 0"),
    # Reported as given, not as float32 rounds it.
    (_norm_call("rms_norm", eps=-1e-6), "rms_norm: eps is -1e-06 but expected > 0"),
    (_norm_call("rms_norm", eps=1e-50),
     "rms_norm: eps is 1e-50, which float32 rounds to 0; expected > 0"),
    (_norm_call("rms_norm", weight=np.ones(8)),
     "rms_norm: weight has dtype float64 but x has dtype float32"),
    (_norm_call("rms_norm", x=np.ones((4, 8), np.int32)), "rms_norm: x has dtype int32"),
    (_norm_call("rms_norm", x=np.array(1.0, np.float32), weight=np.ones(1, np.float32)),
     "rms_norm: x has 0 dimensions but expected at least 1 (..., d)"),
    (_norm_call("rms_norm_backward", weight=np.ones(9, np.float32)),
     "rms_norm_backward: weight has 9 elements but x is [4 x 8] (expected d = 8)"),
    (_norm_call("rms_norm_backward", weight=np.ones((8, 1), np.float32)),
     "rms_norm_backward: weight has 2 dimensions but expected 1"),
    (_norm_call("rms_norm_backward", inv_rms=np.ones(3, np.float32)),
     "rms_norm_backward: inv_rms has shape (3,) but x has shape (4, 8); expected x's shape "
     "without its last dimension"),
    (_norm_call("rms_norm_backward", inv_rms=np.ones((4, 1), np.float32)),
     "rms_norm_backward: inv_rms has shape (4, 1) but x has shape (4, 8)"),
    (_norm_call("rms_norm_backward", d_y=np.ones((4, 7), np.float32)),
     "rms_norm_backward: d_y has shape (4, 7) but x has shape (4, 8)"),
    (_norm_call("rms_norm_backward", d_y=np.ones(32, np.float32)),
     "rms_norm_backward: d_y has shape (32,) but x has shape (4, 8)"),
    (_norm_call("rms_norm_backward", inv_rms=np.ones(4)),
     "rms_norm_backward: inv_rms has dtype float64 but x has dtype float32"),
    (_norm_call("rms_norm_backward", d_y=np.ones((4, 8))),
     "rms_norm_backward: d_y has dtype float64 but x has dtype float32"),
    (_norm_call("rms_norm_backward", weight=np.ones(8)),
     "rms_norm_backward: weight has dtype float64 but x has dtype float32"),
])
def test_rms_norm_refuses_bad_calls(call, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        call()


def test_rms_norm_refuses_empty_rows_and_takes_no_rows():
    """d = 0 has no mean square: refused. No rows (n = 0) is an empty result, d_weight zeros."""
    empty_rows = np.ones((3, 0), np.float32)
    with pytest.raises(ValueError, match=re.escape(
            "rms_norm: x has shape (3, 0); expected a last dimension d >= 1")):
        linrope.rms_norm(empty_rows, np.ones(0, np.float32), 1e-6)
    with pytest.raises(ValueError, match=re.escape(
            "rms_norm_backward: x has shape (3, 0); expected a last dimension d >= 1")):
        linrope.rms_norm_backward(empty_rows, np.ones(0, np.float32), np.ones(3, np.float32),
                                  empty_rows)
    x = np.ones((2, 0, 3))
    y, inv_rms = linrope.rms_norm(x, np.ones(3), 1e-6)
    assert y.shape == (2, 0, 3) and inv_rms.shape == (2, 0)
    d_x, d_weight = linrope.rms_norm_backward(x, np.ones(3), inv_rms, x)
    assert d_x.shape == (2, 0, 3) and np.array_equal(d_weight, np.zeros(3))


# ------------------------------------------------------------------------- linrope.torch --

def test_gelu_gradcheck_on_a_large_tensor(quick_failure):
    """(3, 64, 100): 19200 elements, two of the kernel's 2^14-element blocks (fast_mode:
    one random projection of the Jacobian, the full one would take 19200 forwards)."""
    torch.manual_seed(1)
    x = (3 * torch.randn(3, 64, 100, dtype=torch.float64)).requires_grad_()
    assert ours_gelu(lt.gelu(x))
    assert torch.autograd.gradcheck(lt.gelu, (x,), fast_mode=True)


@pytest.mark.parametrize("shape", [(1,), (5, 7), (2, 3, 17)])
def test_gelu_full_gradcheck_at_small_sizes(shape):
    torch.manual_seed(2)
    x = (3 * torch.randn(*shape, dtype=torch.float64)).requires_grad_()
    assert ours_gelu(lt.gelu(x))
    assert torch.autograd.gradcheck(lt.gelu, (x,))


@pytest.mark.parametrize("wrt", ["both", "input", "weight"])
def test_rms_norm_gradcheck_on_linrope(quick_failure, wrt):
    """(2, 64, 128) = 16384 elements at the study's width (fast_mode: ~10 ms, where the full
    Jacobian would take ~16k forwards); with respect to x and weight, or each alone (then the
    other's gradient is not computed)."""
    torch.manual_seed(3)
    x = torch.randn(2, 64, 128, dtype=torch.float64, requires_grad=wrt != "weight")
    w = torch.randn(128, dtype=torch.float64, requires_grad=wrt != "input")
    assert ours_norm(lt.rms_norm(x, w, 1e-2))
    assert torch.autograd.gradcheck(lambda a, b: lt.rms_norm(a, b, 1e-2), (x, w), fast_mode=True)
    y = lt.rms_norm(x, w)
    y.sum().backward()
    assert (x.grad is None) == (wrt == "weight") and (w.grad is None) == (wrt == "input")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 3, 4), (7,)])
@pytest.mark.parametrize("wrt", ["both", "input", "weight"])
def test_rms_norm_full_gradcheck_at_small_sizes(shape, wrt):
    torch.manual_seed(4)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=wrt != "weight")
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=wrt != "input")
    assert ours_norm(lt.rms_norm(x, w, 0.1))
    assert torch.autograd.gradcheck(lambda a, b: lt.rms_norm(a, b, 0.1), (x, w))


def test_GELU_float32_matches_the_explicit_formula_forward_and_backward(rng):
    """linrope.torch.GELU on (4, 64, 80) = 20480 elements: y and dx within gelu_bound."""
    x_np = gelu_values((4, 64, 80), rng, np.float32)
    d_y = rng.standard_normal((4, 64, 80)).astype(np.float32)
    x = torch.from_numpy(x_np).requires_grad_()
    y = lt.GELU()(x)
    assert ours_gelu(y) and y.dtype == torch.float32
    # d_y as autograd may hand it over: a non-contiguous view (its transpose's transpose).
    y.backward(torch.from_numpy(np.ascontiguousarray(d_y.transpose(2, 1, 0))).permute(2, 1, 0))
    want_y = gelu_exact(x_np)
    want_d_x = d_y.astype(np.float64) * gelu_derivative_exact(x_np)
    within(y.detach(), want_y, gelu_bound(x_np, want_y, np.float32), "y")
    within(x.grad, want_d_x, gelu_bound(d_y, want_d_x, np.float32), "dx")


def test_RMSNorm_float32_matches_the_explicit_formula_forward_and_backward(rng):
    """linrope.torch.RMSNorm(40, eps=1e-2) on (4, 128, 40) = 20480 elements, 512 rows (two row
    blocks), d = 40 (a packet tail). The forward within (d + 16) u |y| as above. The gradients
    against the exact r here (the module's backward uses its forward's r, within (d + 4) u r):
    r's error enters r g once and r^3 thrice, 3 (d + 4) u of d_x's scale more, (4 d + 28) u in
    all; d_weight's terms once, (n + 2 d + 20) u."""
    shape, d, rows, eps = (4, 128, 40), 40, 512, 1e-2
    x_np, w_np, d_y = norm_inputs(rng, shape, np.float32)
    norm = lt.RMSNorm(d, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w_np))
    x = torch.from_numpy(x_np).requires_grad_()
    y = norm(x)
    assert ours_norm(y) and y.dtype == torch.float32
    y.backward(torch.from_numpy(d_y))
    eps32 = float(np.float32(eps))
    want_y, want_r = rms_norm_exact(x_np, w_np, eps32)
    want_d_x, d_x_scale, want_d_w, d_w_scale = rms_norm_backward_exact(x_np, w_np, want_r, d_y)
    within(y.detach(), want_y, (d + 16) * U32 * np.abs(want_y), "y")
    within(x.grad, want_d_x, (4 * d + 28) * U32 * d_x_scale, "dx")
    within(norm.weight.grad, want_d_w, (rows + 2 * d + 20) * U32 * d_w_scale, "dweight")


def _reference_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# If linrope.torch.gelu / rms_norm dropped a fall-back, the call would reach linrope's Function:
# `not ours_...(y)` below fails (and for bfloat16, _array raises "has dtype torch.bfloat16"). The
# bit equality alone would not always tell: linrope's float32 erf is the Abramowitz-Stegun form of
# PyTorch's vectorised erf, so about half of its gelu values equal F.gelu's bits. Each case then
# makes the same call where linrope's kernels run (float32, no backend("native"), no autocast,
# approximate "none") and checks that it is linrope's, so the case is the fall-back's alone.
FALL_BACKS = ["native", "bfloat16", "autocast"]


def _called(where, module, x):
    """module(x) under backend("native") or CPU autocast when `where` says so, else plainly."""
    if where == "native":
        with lt.backend("native"):
            return module(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "autocast"):
        return module(x)


@pytest.mark.parametrize("where", FALL_BACKS + ["tanh"])
def test_gelu_is_F_gelu_where_linrope_kernels_do_not_run(where):
    torch.manual_seed(5)
    dtype = torch.bfloat16 if where == "bfloat16" else torch.float32
    approximate = "tanh" if where == "tanh" else "none"
    x = (3 * torch.randn(6, 50)).to(dtype).requires_grad_()
    layer = lt.GELU(approximate)
    y = _called(where, layer, x)
    assert not ours_gelu(y)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "autocast"):
        want = F.gelu(x, approximate=approximate)
    assert y.dtype == want.dtype and torch.equal(y, want)
    d_y = torch.randn(6, 50).to(y.dtype)
    assert torch.equal(torch.autograd.grad(y, x, d_y)[0], torch.autograd.grad(want, x, d_y)[0])
    assert ours_gelu(lt.GELU()(x.detach().float().requires_grad_()))  # linrope's otherwise


@pytest.mark.parametrize("where", FALL_BACKS)
def test_rms_norm_is_the_pytorch_expression_where_linrope_kernels_do_not_run(where):
    torch.manual_seed(6)
    dtype = torch.bfloat16 if where == "bfloat16" else torch.float32
    x = torch.randn(6, 50).to(dtype).requires_grad_()
    norm = lt.RMSNorm(50, eps=1e-3, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(50))
    y = _called(where, norm, x)
    assert not ours_norm(y)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "autocast"):
        want = _reference_norm(x, norm.weight, 1e-3)
    assert y.dtype == want.dtype and torch.equal(y, want)
    d_y = torch.randn(6, 50).to(y.dtype)
    got_grads = torch.autograd.grad(y, (x, norm.weight), d_y)
    want_grads = torch.autograd.grad(want, (x, norm.weight), d_y)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    float_norm = lt.RMSNorm(50, eps=1e-3)
    assert ours_norm(float_norm(x.detach().float().requires_grad_()))  # linrope's otherwise


# ------------------------------------------------------------------------------- modules --

def test_GELU_is_nn_GELU():
    for approximate in ("none", "tanh"):
        layer = lt.GELU(approximate)
        assert isinstance(layer, nn.GELU) and layer.approximate == approximate
        assert repr(layer) == repr(nn.GELU(approximate)) == f"GELU(approximate={approximate!r})"
    assert repr(lt.GELU()) == "GELU(approximate='none')"


def test_RMSNorm_parameters_repr_and_state_dict():
    norm = lt.RMSNorm(48, eps=1e-5)
    assert isinstance(norm.weight, nn.Parameter) and norm.weight.requires_grad
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, torch.ones(48))
    assert norm.eps == 1e-5 and lt.RMSNorm(8).eps == 1e-6
    assert repr(norm) == "RMSNorm(48, eps=1e-05)"
    assert list(norm.state_dict()) == ["weight"]
    assert lt.RMSNorm(8, dtype=torch.float64).weight.dtype == torch.float64
    torch.manual_seed(7)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    fresh = lt.RMSNorm(48, eps=1e-5)
    fresh.load_state_dict(norm.state_dict())
    x = torch.randn(8, 64, 48)
    assert torch.equal(fresh.weight, norm.weight) and torch.equal(fresh(x), norm(x))
    assert ours_norm(fresh(x.requires_grad_()))


class _ExperimentsRMSNorm(nn.Module):
    """The RMSNorm experiments/training/model.py defined before linrope.torch.RMSNorm."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Norms(nn.Module):
    """The norms of a pre-norm block, of a given class."""

    def __init__(self, norm, dim):
        super().__init__()
        self.attn_norm, self.mlp_norm = norm(dim), norm(dim)

    def forward(self, x):
        return self.attn_norm(x), self.mlp_norm(x)


def test_RMSNorm_loads_the_experiments_norms_and_agrees_with_them(rng):
    """A model of the old norms, with trained gains, loads into one of linrope.torch.RMSNorm; the
    outputs agree within both sides' rounding: PyTorch's expression rounds the same operations
    (d squares summed, / d, + eps, rsqrt, two products), so each is within (d + 16) u |y| of
    the exact y: 2 (d + 16) u |y| between them."""
    d = 96
    torch.manual_seed(8)
    old = _Norms(_ExperimentsRMSNorm, d)
    with torch.no_grad():
        for p in old.parameters():
            p.copy_(torch.randn(d))
    new = _Norms(lt.RMSNorm, d)
    new.load_state_dict(old.state_dict())
    x_np = norm_inputs(rng, (256, d), np.float32)[0]
    x = torch.from_numpy(x_np).requires_grad_()
    for norm, got, want in zip(("attn_norm", "mlp_norm"), new(x), old(x)):
        assert ours_norm(got)
        exact = rms_norm_exact(x_np, getattr(old, norm).weight.detach().numpy(),
                               float(np.float32(1e-6)))[0]
        within(got.detach(), want.detach(), 2 * (d + 16) * U32 * np.abs(exact), norm)


def test_torch_rms_norm_refuses_a_wrong_weight_on_linrope_path():
    x = torch.ones(4, 64, 64)
    with pytest.raises(ValueError, match=re.escape(
            "rms_norm: input has dtype torch.float32 and weight torch.float64; expected one")):
        lt.rms_norm(x, torch.ones(64, dtype=torch.float64))
    for weight in (torch.ones(63), torch.ones(1, 64), torch.ones(())):
        with pytest.raises(ValueError, match=re.escape(
                f"rms_norm: input has shape (4, 64, 64) and weight {tuple(weight.shape)}; "
                f"expected input (..., d) and weight (d,)")):
            lt.rms_norm(x, weight)
    with pytest.raises(ValueError, match=re.escape("rms_norm: eps is 0 but expected > 0")):
        lt.RMSNorm(64, eps=0.0)(x)


# --------------------------------------------------------------------------- threads --

def test_the_same_bits_on_one_thread_and_on_two(restore_threads, rng):
    """rms_norm's rows and d_weight's per-block partial sums, and gelu's 16384-element blocks,
    are fixed by the shapes alone: (600, 64) is three row blocks, (40000,) three element
    blocks, split between two threads."""
    x, w, d_y = norm_inputs(rng, (600, 64), np.float32)
    g = gelu_values((40000,), rng, np.float32)
    g_dy = rng.standard_normal(40000).astype(np.float32)
    results = []
    for threads in (1, 2):
        linrope.set_num_threads(threads)
        assert linrope.get_num_threads() == threads
        y, inv_rms = linrope.rms_norm(x, w, 1e-6)
        results.append((y, inv_rms, *linrope.rms_norm_backward(x, w, inv_rms, d_y),
                        linrope.gelu(g), linrope.gelu_backward(g, g_dy)))
    names = ("y", "inv_rms", "d_x", "d_weight", "gelu", "gelu_backward")
    for name, one, two in zip(names, *results):
        assert np.array_equal(one, two), name
