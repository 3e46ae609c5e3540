"""linrope.matmul (NumPy) and linrope.torch.linear / Linear (F.linear on it): against the explicit
float64 sum, gradcheck in float64, the fall-back to F.linear where linrope's kernels do not run,
and the refusals. The reference is an explicit sum over k in NumPy float64 (no BLAS of linrope's).
"""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt
from bounds import assert_within, unit_roundoff
from linrope.torch import functional


@pytest.fixture
def every_size(monkeypatch):
    """linrope.torch.linear on linrope's products at any size (it gives calls below
    LINEAR_MIN_WORK multiply-adds to F.linear, which would leave the small cases untested)."""
    monkeypatch.setattr(functional, "LINEAR_MIN_WORK", 0)


def ours(y):
    """Whether y came out of linrope's autograd Function (not F.linear)."""
    return y.grad_fn is not None and type(y.grad_fn).__name__ == "_LinearBackward"


def naive_product(a, b):
    """a @ b in float64 as the sum over k of outer products: c_ij = sum_p a_ip b_pj."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    c = np.zeros((a.shape[0], b.shape[1]))
    for p in range(a.shape[1]):
        c += np.outer(a[:, p], b[p, :])
    return c


def product_bound(a, b, dtype, c0=None):
    """|op(a) op(b) (+ c0) in dtype - exact|: float32 inputs and products are exact in float64,
    so only the k (+ 1) float32 sums round, each within u of the running sum of magnitudes
    (Higham 3.1): 1.01 (k + 1) u (|a| |b| + |c0|); for float64 the reference rounds as much: 2x."""
    k = a.shape[1]
    scale = naive_product(np.abs(a), np.abs(b)) + (0 if c0 is None else np.abs(c0))
    u = unit_roundoff(torch.float32 if dtype == np.float32 else torch.float64)
    return 1.01 * (1 if dtype == np.float32 else 2) * (k + 1) * u * scale


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 5, 3), (257, 33, 19), (600, 17, 130), (3, 4, 0)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False), (False, True),
                                                     (True, True)])
def test_matmul_matches_the_explicit_sum(rng, dtype, m, n, k, transpose_a, transpose_b):
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    stored_a = np.ascontiguousarray(a.T) if transpose_a else a
    stored_b = np.ascontiguousarray(b.T) if transpose_b else b
    c = linrope.matmul(stored_a, stored_b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert c.dtype == dtype and c.shape == (m, n)
    assert_within(c, naive_product(a, b), product_bound(a, b, dtype), "matmul")


def test_matmul_writes_and_adds_into_out_in_place(rng):
    a = rng.standard_normal((300, 20)).astype(np.float32)
    b = rng.standard_normal((20, 9)).astype(np.float32)
    c0 = rng.standard_normal((300, 9)).astype(np.float32)
    out = c0.copy()
    result = linrope.matmul(a, b, out=out, accumulate=True)
    assert np.shares_memory(result, out)
    assert_within(out, naive_product(a, b) + c0, product_bound(a, b, np.float32, c0), "c0 + a b")
    linrope.matmul(a, b, out=out)
    assert_within(out, naive_product(a, b), product_bound(a, b, np.float32), "a b")


def test_matmul_reads_strided_inputs(rng):
    """A non-contiguous view (a column slice) is read through a copy: the same numbers."""
    wide = rng.standard_normal((40, 30)).astype(np.float32)
    b = rng.standard_normal((10, 6)).astype(np.float32)
    c = linrope.matmul(wide[:, ::3], b)
    assert np.array_equal(c, linrope.matmul(np.ascontiguousarray(wide[:, ::3]), b))


def test_matmul_refuses_an_out_sharing_an_input():
    square = np.ones((3, 3), np.float32)
    with pytest.raises(ValueError, match="^matmul: out overlaps a; expected separate storage$"):
        linrope.matmul(square, np.ones((3, 3), np.float32), out=square)
    with pytest.raises(ValueError, match="^matmul: out overlaps b; expected separate storage$"):
        linrope.matmul(np.ones((3, 3), np.float32), square, out=square)
    read_only = np.zeros((3, 3), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="C-contiguous, aligned, writeable"):
        linrope.matmul(np.ones((3, 3), np.float32), np.ones((3, 3), np.float32), out=read_only)


@pytest.mark.parametrize("call,message", [
    (lambda a, b: linrope.matmul(a, b), "matmul: b is [4 x 3] but a is [5 x 3], so op(b) must "
                                        "have k = 3 rows; it has 4"),
    (lambda a, b: linrope.matmul(a, b, transpose_b=True, out=np.zeros((5, 5), np.float32)),
     "matmul: out has shape (5, 5) but expected (5, 4)"),
    (lambda a, b: linrope.matmul(a, b, accumulate=True),
     "matmul: accumulate is true but no out is given to add to"),
    (lambda a, b: linrope.matmul(a, b.astype(np.float64), transpose_b=True),
     "matmul: b has dtype float64 but a has dtype float32"),
    (lambda a, b: linrope.matmul(a, b, transpose_b=True, out=np.zeros((4, 5), np.float32).T),
     "matmul: out must be a C-contiguous, aligned, writeable array (it is written in place)"),
    (lambda a, b: linrope.matmul(a[None], b), "matmul: a has 3 dimensions but expected 2"),
    (lambda a, b: linrope.matmul(a, a[:3], out=a[2:5, :3].copy()),
     "matmul: out has shape (3, 3) but expected (5, 3)"),
])
def test_matmul_refuses_bad_calls(call, message):
    a, b = np.ones((5, 3), np.float32), np.ones((4, 3), np.float32)
    with pytest.raises(ValueError) as e:
        call(a, b)
    assert str(e.value) == message


@pytest.mark.parametrize("shape,out", [((5, 7), 6), ((3, 4, 7), 6), ((2, 3, 1, 7), 6), ((7,), 6),
                                       ((0, 7), 6), ((5, 0), 6), ((5, 7), 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck(every_size, shape, out, bias):
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(out, shape[-1], dtype=torch.float64, requires_grad=True)
    b = torch.randn(out, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    assert ours(lt.linear(*inputs))
    assert torch.autograd.gradcheck(lambda *t: lt.linear(*t), inputs)


def test_linear_float32_matches_the_explicit_sum_forward_and_backward(every_size, rng):
    """y = x W^T + b, dx = dy W, dW = dy^T x, db = sum dy, each within its product's bound."""
    x = torch.from_numpy(rng.standard_normal((4, 75, 24)).astype(np.float32)).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((40, 24)).astype(np.float32)).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(40).astype(np.float32)).requires_grad_()
    d_y = rng.standard_normal((4, 75, 40)).astype(np.float32)
    y = lt.linear(x, w, b)
    assert ours(y)
    # d_y as autograd may hand it over: a non-contiguous view (here its transpose's transpose).
    y.backward(torch.from_numpy(np.ascontiguousarray(d_y.transpose(2, 1, 0))).permute(2, 1, 0))
    rows, dy_rows = x.detach().numpy().reshape(-1, 24), d_y.reshape(-1, 40)
    w_np, b_np = w.detach().numpy(), b.detach().numpy()
    bias_rows = np.broadcast_to(b_np, (300, 40))
    assert_within(y.detach().reshape(-1, 40), naive_product(rows, w_np.T) + bias_rows,
                  product_bound(rows, w_np.T, np.float32, bias_rows), "y")
    assert_within(x.grad.reshape(-1, 24), naive_product(dy_rows, w_np),
                  product_bound(dy_rows, w_np, np.float32), "dx")
    assert_within(w.grad, naive_product(dy_rows.T, rows),
                  product_bound(dy_rows.T, rows, np.float32), "dW")
    ones = np.ones((1, 300))
    assert_within(b.grad[None], naive_product(ones, dy_rows),
                  product_bound(ones, dy_rows, np.float32), "db")


def test_linear_reads_non_contiguous_input_and_weight(every_size):
    """Column-major x and W: gradcheck through them, and the same numbers as contiguous copies."""
    torch.manual_seed(2)
    x = torch.randn(9, 5, dtype=torch.float64).t().requires_grad_()  # [5 x 9], column-major
    w = torch.randn(9, 4, dtype=torch.float64).t().requires_grad_()  # [4 x 9]
    assert torch.equal(lt.linear(x, w), lt.linear(x.contiguous(), w.contiguous()))
    assert torch.autograd.gradcheck(lambda a, b: lt.linear(a, b), (x, w))


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_linear_computes_only_the_gradients_asked_for(every_size, monkeypatch, frozen):
    """One product in the backward when only one of dx and dW is wanted."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return matmul(*args, **kwargs)
    matmul = linrope.matmul
    torch.manual_seed(3)
    layer = lt.Linear(5, 3)
    x = torch.randn(6, 5, requires_grad=frozen != "input")
    layer.weight.requires_grad_(frozen != "weight")
    y = layer(x)
    monkeypatch.setattr(linrope, "matmul", counted)
    y.sum().backward()
    assert len(calls) == 1
    assert (layer.weight.grad is None) == (frozen == "weight") and layer.bias.grad is not None
    assert (x.grad is None) == (frozen == "input")


def test_Linear_is_nn_Linear_with_the_same_parameters_and_state_dict():
    torch.manual_seed(4)
    ours = lt.Linear(8, 3)
    torch.manual_seed(4)
    theirs = torch.nn.Linear(8, 3)
    assert isinstance(ours, torch.nn.Linear)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in theirs.state_dict().items())
    theirs.load_state_dict(ours.state_dict())
    assert lt.MultiheadAttention(8, 2).q_proj.__class__ is lt.Linear


@pytest.mark.parametrize("where", ["native", "bfloat16", "autocast", "small"])
def test_linear_is_F_linear_where_linrope_kernels_do_not_run_or_pay(monkeypatch, where):
    torch.manual_seed(5)
    if where != "small":
        monkeypatch.setattr(functional, "LINEAR_MIN_WORK", 0)
    dtype = torch.bfloat16 if where == "bfloat16" else torch.float32
    x, w, b = (torch.randn(*s).to(dtype).requires_grad_() for s in ((3, 4), (2, 4), (2,)))
    if where == "native":
        with lt.backend("native"):
            y = lt.linear(x, w, b)
    elif where == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lt.linear(x, w, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    else:
        y = lt.linear(x, w, b)
    assert not ours(y)
    if where != "autocast":
        assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(functional, "LINEAR_MIN_WORK", 0)
    assert ours(lt.linear(x.float(), w.float(), b.float()))  # the same call, linrope's otherwise


def test_linear_refuses_mixed_dtypes_and_shapes():
    x, w = torch.ones(3, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match="linear: input, weight have dtypes "
                                         "torch.float32, torch.float64; expected one"):
        lt.linear(x, w.double())
    with pytest.raises(ValueError, match="linear: input, weight, bias have dtypes "
                                         "torch.float32, torch.float32, torch.float64"):
        lt.linear(x, w, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"linear: input has shape \(3, 4\) and weight \(2, 5\); "
                                         r"expected input \(..., in\) and weight \(out, in\)"):
        lt.linear(x, torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"linear: bias has shape \(3,\) but weight has 2 rows"):
        lt.linear(x, w, torch.ones(3))
