"""linrope.NonFiniteError: every refusal of non-finite input data (q, k, v, d_out, a feature
map's x, a state's S and z), at the NumPy and the torch level, raises it; it is a ValueError with
the message the refusal always had; a non-finite option (eps, scale, a rope's base) raises a
plain ValueError. (linrope.torch.distributed's refusal: test_distributed.py.)"""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt

N, D, D_V = 5, 4, 3
ROW, COLUMN = 3, 1  # where the bad value sits
VALUES = [np.nan, np.inf, -np.inf]


def elu_map():
    return linrope.FeatureMap("elu+1", D)


def arrays(dtype, batched):
    """q, k [.., N, D], v and d_out [.., N, D_V], fixed values; (B, H) = (2, 3) when batched."""
    lead = (2, 3) if batched else ()
    rng = np.random.default_rng(5)
    return [rng.standard_normal(lead + (N, w)).astype(dtype) for w in (D, D, D_V, D_V)]


def spoil(a, value):
    """A copy of a with `value` at (ROW, COLUMN) of its last (B, H) slice."""
    a = a.copy()
    a[(-1,) * (a.ndim - 2) + (ROW, COLUMN)] = value
    return a


def message(function, name, batched, value):
    """The refusal's text, as src/common/check.hpp writes it: a batched call names the slice,
    here the last one, [1, 2]."""
    shown = {np.inf: "inf", -np.inf: "-inf"}.get(value, "nan")
    where = f"{name}[1, 2]" if batched else f"{name}[0, 0]"
    return (f"{function}: {where} has the non-finite value {shown} at row {ROW}, column "
            f"{COLUMN}; expected finite values")


def numpy_calls(fm):
    """(function, argument, call(q, k, v, d_out)) for each input of each NumPy-level call that
    refuses non-finite data."""
    linear = dict(placement="none")
    causal = dict(placement="none", causal=True)
    return [
        ("softmax_attention", "q", lambda q, k, v, g: linrope.softmax_attention(q, k, v)),
        ("softmax_attention", "k", lambda q, k, v, g: linrope.softmax_attention(q, k, v)),
        ("softmax_attention", "v", lambda q, k, v, g: linrope.softmax_attention(q, k, v)),
        ("softmax_attention_backward", "d_out",
         lambda q, k, v, g: linrope.softmax_attention_backward(q, k, v, g)),
        ("linear_attention", "q", lambda q, k, v, g: linrope.linear_attention(q, k, v, fm,
                                                                              **linear)),
        ("linear_attention", "k", lambda q, k, v, g: linrope.linear_attention(q, k, v, fm,
                                                                              **causal)),
        ("linear_attention", "v", lambda q, k, v, g: linrope.linear_attention(
            q, k, v, fm, method="chunked", chunk_size=2, **causal)),
        ("linear_attention_backward", "d_out",
         lambda q, k, v, g: linrope.linear_attention_backward(q, k, v, g, fm, **linear)),
        ("linear_attention_backward", "k",
         lambda q, k, v, g: linrope.linear_attention_backward(q, k, v, g, fm, **causal)),
    ]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("batched", [False, True], ids=["n,d", "B,H,n,d"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_numpy_call_raises_nonfinite_error_with_its_message(value, batched, dtype):
    fm = elu_map()
    names = ("q", "k", "v", "d_out")
    for function, name, call in numpy_calls(fm):
        args = arrays(dtype, batched)
        args[names.index(name)] = spoil(args[names.index(name)], value)
        with pytest.raises(linrope.NonFiniteError) as caught:
            call(*args)
        assert isinstance(caught.value, ValueError)
        assert str(caught.value) == message(function, name, batched, value), (function, name)


@pytest.mark.parametrize("value", VALUES)
def test_feature_map_stream_and_states_raise_nonfinite_error(value):
    fm = elu_map()
    q, k, v, d_out = arrays(np.float64, batched=True)
    with pytest.raises(linrope.NonFiniteError, match="FeatureMap::apply: x"):
        fm.apply(spoil(q, value))
    with pytest.raises(linrope.NonFiniteError, match="FeatureMap::backward: d_out"):
        fm.backward(q, spoil(fm.apply(q), value))
    stream = linrope.LinearAttentionStream(fm, D_V, placement="none", dtype="float64")
    with pytest.raises(linrope.NonFiniteError, match="v has the non-finite value"):
        stream.step(q[0, 0], k[0, 0], spoil(v[0, 0], value))
    assert stream.position == 0  # refused before the state took the token

    causal = dict(placement="none", causal=True)
    _, (S, z, log_scale) = linrope.linear_attention(q, k, v, fm, return_state=True, **causal)
    bad_z = z.copy()
    bad_z[1, 2, 0] = value
    for state, name in (((spoil(S, value), z, log_scale), "initial_state.S"),
                        ((S, bad_z, log_scale), "initial_state.z")):
        with pytest.raises(linrope.NonFiniteError, match=name.replace(".", r"\.")):
            linrope.linear_attention(q, k, v, fm, initial_state=state, **causal)
        with pytest.raises(linrope.NonFiniteError, match=name.replace(".", r"\.")):
            linrope.linear_attention_backward(q, k, v, d_out, fm, initial_state=state, **causal)
    with pytest.raises(linrope.NonFiniteError, match=r"d_final\.S has the non-finite"):
        linrope.linear_attention_backward(q, k, v, d_out, fm, d_final_state=(spoil(S, value), z),
                                          **causal)


@pytest.mark.parametrize("value", VALUES)
def test_torch_calls_raise_nonfinite_error(value):
    fm = elu_map()
    q, k, v, d_out = [torch.from_numpy(a) for a in arrays(np.float64, batched=True)]
    bad_v = torch.from_numpy(spoil(v.numpy(), value))
    with pytest.raises(linrope.NonFiniteError, match=r"softmax_attention: v\[1, 2\]"):
        lt.softmax_attention(q, k, bad_v)
    with pytest.raises(linrope.NonFiniteError, match=r"linear_attention: v\[1, 2\]"):
        lt.linear_attention(q, k, bad_v, fm, placement="none")
    with pytest.raises(linrope.NonFiniteError, match="FeatureMap::apply: x"):
        lt.feature_map_apply(torch.from_numpy(spoil(q.numpy(), value)), fm)
    # The backward's own input, d_out, reaches the C++ backward through autograd.
    q.requires_grad_()
    out = lt.linear_attention(q, k, v, fm, placement="none")
    with pytest.raises(linrope.NonFiniteError, match=r"linear_attention_backward: d_out\[1, 2\]"):
        out.backward(torch.from_numpy(spoil(d_out.numpy(), value)))


def test_a_nonfinite_option_raises_a_plain_value_error():
    fm = elu_map()
    q, k, v, _ = arrays(np.float64, batched=False)
    refusals = [
        lambda: linrope.linear_attention(q, k, v, fm, placement="none", eps=np.nan),
        lambda: linrope.softmax_attention(q, k, v, scale=np.inf),
        lambda: linrope.Rope(D, base=np.nan),
        lambda: lt.linear_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                    fm, placement="none", eps=np.inf),
    ]
    for refused in refusals:
        with pytest.raises(ValueError) as caught:
            refused()
        assert type(caught.value) is ValueError, caught.value


def test_nonfinite_error_is_exported_and_documented():
    assert linrope.NonFiniteError.__module__ == "linrope"
    assert issubclass(linrope.NonFiniteError, ValueError)
    assert "NonFiniteError" in linrope.__all__
    assert "not finite" in linrope.NonFiniteError.__doc__
