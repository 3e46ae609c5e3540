"""linrope.LinearSaved: the forward keeps its features, the backward reads them. The claim is exact
(tests/test_saved_features.cpp proves it in C++): the same outputs and gradients, bit for bit, as
the calls without it, here through the NumPy functions and linrope.torch (gradcheck in float64);
and a backward refuses features of another call."""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt
from cases import CAUSAL_OR_NOT, PLACEMENTS, linear_case


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("placement", PLACEMENTS)
@CAUSAL_OR_NOT
def test_numpy_calls_with_saved_features_give_the_same_bits(dtype, placement, causal):
    fm, rope, _, q, k, v = linear_case("favor+", placement, 70, map_seed=2)
    q, k, v = (x.detach().numpy().astype(dtype) for x in (q, k, v))
    d_out = np.random.default_rng(5).standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    options = dict(causal=causal, placement=placement, rope=rope, q_lengths=[70, 61])
    saved = linrope.LinearSaved()
    assert saved.empty and saved.nbytes == 0 and saved.dtype == "none"
    out = linrope.linear_attention(q, k, v, fm, saved=saved, **options)
    np.testing.assert_array_equal(out, linrope.linear_attention(q, k, v, fm, **options))
    assert not saved.empty and saved.nbytes > 0
    assert saved.dtype == np.dtype(dtype).name
    want = linrope.linear_attention_backward(q, k, v, d_out, fm, **options)
    got = linrope.linear_attention_backward(q, k, v, d_out, fm, saved=saved, **options)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_backward_refuses_features_of_another_call():
    fm, rope, _, q, k, v = linear_case("favor+", "numerator_only", 8, map_seed=2)
    q, k, v = (x.detach().numpy() for x in (q, k, v))
    d_out = np.ones(q.shape[:-1] + v.shape[-1:])
    saved = linrope.LinearSaved()
    with pytest.raises(ValueError, match="saved is empty"):
        linrope.linear_attention_backward(q, k, v, d_out, fm, rope=rope, saved=saved)
    linrope.linear_attention(q, k, v, fm, rope=rope, saved=saved)
    with pytest.raises(ValueError, match="its forward had options.causal = 0, this call has 1"):
        linrope.linear_attention_backward(q, k, v, d_out, fm, causal=True, rope=rope, saved=saved)
    # float32 features are not float64 ones: the float64 backward finds none.
    linrope.linear_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                             fm, rope=rope, saved=saved)
    with pytest.raises(ValueError, match="saved is empty"):
        linrope.linear_attention_backward(q, k, v, d_out, fm, rope=rope, saved=saved)
    saved.clear()
    assert saved.empty


def test_while_a_forward_fills_it_no_other_call_may_use_it():
    """The kernels run without the GIL: while a forward fills `saved` in one thread, another's
    reads of it (which would see blocks being laid out), clear() and a second forward are
    refused with RuntimeError, and all are allowed again once the forward has returned."""
    import threading
    import time
    rng = np.random.default_rng(5)
    fm = linrope.FeatureMap("favor+", 64, num_features=256, seed=1)
    saved = linrope.LinearSaved()
    copies = 1
    while True:  # inputs large enough that one forward lasts >= 60 ms on this machine
        q = rng.standard_normal((copies, 8, 1024, 64)).astype(np.float32)
        started = time.perf_counter()
        want = linrope.linear_attention(q, q, q, fm, causal=True, placement="none", saved=saved)
        if time.perf_counter() - started >= 0.06 or copies >= 64:
            break
        copies *= 2
    attempts = {
        "nbytes": lambda: saved.nbytes, "empty": lambda: saved.empty,
        "dtype": lambda: saved.dtype, "clear": saved.clear,
        "forward": lambda: linrope.linear_attention(q[:, :1], q[:, :1], q[:, :1], fm,
                                                    placement="none", saved=saved)}
    refused = {}
    for _ in range(3):  # in case a loaded machine never ran this thread during one forward
        results = []
        worker = threading.Thread(
            target=lambda: results.append(linrope.linear_attention(
                q, q, q, fm, causal=True, placement="none", saved=saved)))
        worker.start()
        while worker.is_alive():
            for name, attempt in attempts.items():
                try:
                    attempt()
                except RuntimeError as error:
                    refused.setdefault(name, str(error))
            time.sleep(0.001)
        worker.join()
        np.testing.assert_array_equal(results[0], want)
        if len(refused) == len(attempts):
            break
    assert set(refused) == set(attempts), refused
    for name in ("nbytes", "empty", "dtype"):
        assert refused[name] == f"LinearSaved.{name}: a linear_attention forward is filling it"
    assert refused["clear"] == "LinearSaved.clear: a linear_attention call is using it"
    assert "saved is in use by another call (a forward filling it)" in refused["forward"]
    assert saved.dtype == "float32" and not saved.empty and saved.nbytes > 0  # free again
    saved.clear()
    assert saved.empty and saved.nbytes == 0


@pytest.mark.parametrize("placement", ["numerator_only", "full"])
@CAUSAL_OR_NOT
def test_torch_save_features_gradcheck_and_bits(placement, causal):
    fm, rope, _, q, k, v = linear_case("favor+", placement, 6, map_seed=2)
    eps = 1.0 if placement == "full" else 1e-6

    def attention(save):
        return lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=causal, placement=placement,
                                                   rope=rope, eps=eps, save_features=save)

    assert torch.autograd.gradcheck(attention(True), (q, k, v))
    d_out = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=q.dtype,
                        generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(attention(True)(q, k, v), (q, k, v), d_out)
    want = torch.autograd.grad(attention(False)(q, k, v), (q, k, v), d_out)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_multihead_attention_save_features_gives_the_same_gradients():
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, "linear", causal=True, num_features=8, seed=3)
    x = torch.randn(2, 9, 16, requires_grad=True)

    def gradients(save):
        layer.save_features = save
        layer.zero_grad()
        x.grad = None
        layer(x).square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    for got, want in zip(gradients(True), gradients(False)):
        assert torch.equal(got, want)
