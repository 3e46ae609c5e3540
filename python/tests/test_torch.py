"""linrope.torch: torch.autograd.gradcheck in float64 on every differentiable function (their
backward is the C++ backward), the functions against the pure-PyTorch reference, the layers
(RotaryEmbedding, MultiheadAttention) in a small transformer, denominator statistics, feature
redraws, memory sharing and bad input."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import linrope
import linrope.torch as lt
import bounds
import reference as ref
from cases import CAUSAL_OR_NOT, PLACEMENTS, inputs, linear_case, make_map, rope_for


# ---- gradcheck: the C++ backward against finite differences, float64 ----------------------------

@CAUSAL_OR_NOT
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("batched", [False, True], ids=["n,d", "B,H,n,d"])
def test_softmax_attention_gradcheck(causal, rope, batched):
    lead = (2, 2) if batched else ()
    q, k, v = inputs((*lead, 6, 4), (*lead, 5, 4), (*lead, 5, 3))
    r = linrope.Rope(4) if rope else None
    assert torch.autograd.gradcheck(
        lambda q, k, v: lt.softmax_attention(q, k, v, causal=causal, rope=r, q_offset=2), (q, k, v))


@pytest.mark.parametrize("kind", ["elu+1", "favor+", "1+cos", "favor-trig"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@CAUSAL_OR_NOT
def test_linear_attention_gradcheck(kind, placement, causal):
    fm, rope, _, q, k, v = linear_case(kind, placement, 6, map_seed=2)
    # eps = 1: a signed denominator (full, favor-trig) near 0 would make finite differences of
    # the ratio meaningless; the kernels' handling of eps is the same for any value.
    eps = 1.0 if kind == "favor-trig" or placement == "full" else 1e-6
    assert torch.autograd.gradcheck(
        lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=causal, placement=placement,
                                            rope=rope, eps=eps), (q, k, v))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_padded_and_chunked_attention_gradcheck(attention):
    # Padding (rows past the lengths get zero gradients, which finite differences confirm: the
    # output does not depend on them) and the chunked causal forward, chunk 2 over n = 7.
    q, k, v = inputs((3, 1, 7, 4), (3, 1, 7, 4), (3, 1, 7, 3))
    lengths = dict(q_lengths=torch.tensor([7, 3, 0]), k_lengths=[5, 7, 2])
    if attention == "softmax":
        def call(q, k, v):
            return lt.softmax_attention(q, k, v, causal=True, rope=linrope.Rope(4), **lengths)
    else:
        fm = linrope.FeatureMap("favor+", 4, num_features=6, seed=2)
        rope = linrope.Rope(6)

        def call(q, k, v):
            return lt.linear_attention(q, k, v, fm, causal=True, rope=rope, method="chunked",
                                       chunk_size=2, **lengths)
    assert torch.autograd.gradcheck(call, (q, k, v))


def test_rope_position_lists_gradcheck():
    (x,) = inputs((2, 3, 5, 8))
    rope = lt.RotaryEmbedding(8, layout="half")
    positions = torch.tensor([4, 0, -1, 4, 900])
    assert torch.autograd.gradcheck(lambda x: rope(x, positions=positions), (x,))
    torch.testing.assert_close(rope(x, positions=positions),
                               ref.rotate(x, positions=positions.tolist(), layout="half"),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_and_feature_map_gradcheck(layout):
    (x,) = inputs((2, 3, 5, 8))
    rope = lt.RotaryEmbedding(8, rotary_dim=6, layout=layout, scaling="yarn", factor=2.0,
                              original_max_position=16)
    assert torch.autograd.gradcheck(lambda x: rope(x, 3), (x,))
    for kind in ["elu+1", "favor+", "favor-hyp", "1+cos"]:
        fm = make_map(kind, 8, m=5)
        assert torch.autograd.gradcheck(lambda x: lt.feature_map_apply(x, fm), (x,))


# ---- The functions against the reference --------------------------------------------------------

@pytest.mark.parametrize("placement", PLACEMENTS)
@CAUSAL_OR_NOT
def test_linear_attention_matches_the_reference_in_value_and_gradient(placement, causal):
    d = 8
    fm = linrope.FeatureMap("favor+", d, num_features=16, seed=4)
    rope, rope_ref = rope_for(placement, fm, d)
    q, k, v = inputs((2, 3, 10, d), (2, 3, 10, d), (2, 3, 10, 5))
    out, stats = lt.linear_attention(q, k, v, fm, causal=causal, placement=placement, rope=rope,
                                     return_stats=True)
    expected, den = ref.linear_attention(q, k, v, "favor+", torch.from_numpy(fm.projection),
                                         causal=causal, placement=placement, rope=rope_ref)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    assert stats["min"] == pytest.approx(float(den.min()), rel=1e-9)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_softmax_attention_matches_the_reference_in_float32_and_float64():
    q, k, v = inputs((2, 2, 12, 8), (2, 2, 12, 8), (2, 2, 12, 8), scale=1.0)
    rope = linrope.Rope(8)
    expected = ref.softmax_attention(q, k, v, causal=True, rope={})
    torch.testing.assert_close(lt.softmax_attention(q, k, v, causal=True, rope=rope), expected,
                               rtol=0, atol=1e-12)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out32 = lt.softmax_attention(q32, k32, v32, causal=True, rope=rope)
    assert out32.dtype == torch.float32
    exact = [x.detach() for x in (q, k, v)]
    bounds.assert_within(out32, expected, bounds.softmax_bound(
        *exact, torch.float32, causal=True, rope={}), "out")
    g = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (out32 * g.float()).sum().backward()
    wanted = torch.autograd.grad(expected, (q, k, v), g)
    within = bounds.softmax_gradient_bounds(*exact, g, torch.float32, causal=True, rope={})
    for name, x, want, bound in zip(("dq", "dk", "dv"), (q32, k32, v32), wanted, within):
        bounds.assert_within(x.grad, want, bound, name)


# ---- Memory --------------------------------------------------------------------------------------

def test_tensors_reach_the_kernels_without_a_copy():
    # linrope.torch hands the kernels x.detach().numpy(), the tensor's own memory, which the
    # module reads in place (_kernel_view: the address a kernel reads, the module's hook for this
    # test).
    (x,) = inputs((2, 3, 8, 4))
    assert linrope._core._kernel_view(x.detach().numpy()) == x.data_ptr()
    q, k, v = inputs((2, 3, 8, 4), (2, 3, 8, 4), (2, 3, 8, 4))
    out = lt.softmax_attention(q, k, v)
    assert out.data_ptr() not in (q.data_ptr(), k.data_ptr(), v.data_ptr())
    # Non-contiguous tensors (a transposed projection) work: copied on the way in.
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(lt.softmax_attention(qt, k, v), out, rtol=0, atol=0)


# ---- Layers --------------------------------------------------------------------------------------

class Block(nn.Module):
    """A pre-norm transformer block: the attention layer as a drop-in."""

    def __init__(self, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


LAYERS = [
    dict(attention="softmax"),
    dict(attention="softmax", rope=False),
    dict(attention="linear", feature_map="favor+", num_features=16),
    dict(attention="linear", feature_map="elu+1", placement="full"),
    dict(attention="linear", feature_map="1+cos", placement="before_map"),
    dict(attention="linear", feature_map="relu", rope=False),
]


@pytest.mark.parametrize("options", LAYERS, ids=str)
def test_a_small_transformer_learns_with_each_attention(options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 32),
                          *[Block(lt.MultiheadAttention(32, 4, causal=True, **options))
                            for _ in range(2)],
                          nn.Linear(32, 11))
    # Predict the previous token: needs attention to another position.
    tokens = torch.randint(0, 11, (8, 24), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(tokens)[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, :-1].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses


def test_multihead_attention_matches_a_plain_pytorch_layer():
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, "linear", feature_map="favor+", num_features=8,
                                  causal=True, dtype=torch.float64)
    x = torch.randn(2, 7, 16, dtype=torch.float64)

    def plain(x):
        def heads(t):
            return t.view(2, 7, 2, 8).transpose(1, 2)
        q, k, v = heads(layer.q_proj(x)), heads(layer.k_proj(x)), heads(layer.v_proj(x))
        rope = dict(rotary_dim=layer.rope.rotary_dim)
        out, _ = ref.linear_attention(q, k, v, "favor+",
                                      torch.from_numpy(layer.feature_map.projection),
                                      causal=True, placement="numerator_only", rope=rope)
        return layer.out_proj(out.transpose(1, 2).reshape(2, 7, 16))

    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=1e-10)
    g = torch.randn(2, 7, 16, dtype=torch.float64)
    params = list(layer.parameters())
    for a, b in zip(torch.autograd.grad(layer(x), params, g),
                    torch.autograd.grad(plain(x), params, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_a_padded_batch_equals_each_sequence_alone(attention):
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, attention, causal=True, num_features=8,
                                  method="chunked", chunk_size=4, dtype=torch.float64)
    lengths = [9, 5, 1]
    x = torch.randn(3, 9, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x, lengths=torch.tensor(lengths))
    g = torch.randn_like(out)
    for b, n in enumerate(lengths):
        g[b, n:] = 0  # the loss reads the real tokens only
    (dx,) = torch.autograd.grad(out, x, g)
    for b, n in enumerate(lengths):
        alone = x[b:b + 1, :n].detach().requires_grad_()
        out_alone = layer(alone)
        torch.testing.assert_close(out[b:b + 1, :n], out_alone, rtol=0, atol=1e-12)
        (dx_alone,) = torch.autograd.grad(out_alone, alone, g[b:b + 1, :n])
        torch.testing.assert_close(dx[b:b + 1, :n], dx_alone, rtol=0, atol=1e-12)
        assert not dx[b, n:].any()  # padding is never read


def test_stats_redraws_and_state_dict():
    layer = lt.MultiheadAttention(16, 2, "linear", feature_map="favor+", num_features=8,
                                  causal=True, track_stats=True, stats_threshold=0.5,
                                  redraw_interval=2, seed=7)
    x = torch.randn(3, 10, 16)
    seeds = []
    for _ in range(5):
        layer(x).sum().backward()
        seeds.append(layer.feature_map.seed)
        assert layer.last_stats["count"] == 3 * 2 * 10 and layer.last_stats["nonpositive"] == 0
        assert layer.last_stats["threshold"] == 0.5
    assert seeds == [7, 7, 8, 8, 9]
    # The redraw schedule survives a state_dict: a copy made after 5 forwards redraws on the 7th.
    resumed = lt.MultiheadAttention(16, 2, "linear", feature_map="favor+", num_features=8,
                                    causal=True, redraw_interval=2)
    resumed.load_state_dict(layer.state_dict())
    for module in (layer, resumed):
        module(x)
        module(x)
    assert layer.feature_map.seed == resumed.feature_map.seed == 10
    # Two forwards, then one backward across a redraw: each keeps the W it used, so the gradients
    # are those of the two forwards run again, each on a copy made after it (a redraw comes at the
    # start of a forward: the copy holds the W the forward used) that never redraws.
    used, outs = [], []
    for _ in range(2):
        outs.append(layer(x))
        frozen = copy.deepcopy(layer)
        frozen.redraw_interval = 0
        used.append(frozen)
    a, b = outs
    assert not np.array_equal(used[0].feature_map.projection, used[1].feature_map.projection)
    layer.zero_grad()
    (a.sum() + b.sum()).backward()
    for u in used:
        u.zero_grad()
        u(x).sum().backward()
    for name, p in layer.named_parameters():
        want = sum(dict(u.named_parameters())[name].grad for u in used)
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
    # state_dict carries the seed, so W comes back.
    loaded = lt.MultiheadAttention(16, 2, "linear", feature_map="favor+", num_features=8,
                                   causal=True, seed=0)
    loaded.load_state_dict(layer.state_dict())
    loaded.eval()
    layer.eval()
    torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)
    np.testing.assert_array_equal(loaded.feature_map.projection, layer.feature_map.projection)


def test_the_package_re_exports_its_modules_names():
    from linrope.torch import convolution, functional, layers, states
    from linrope.torch.native import dispatch
    assert set(lt.__all__) == {
        "softmax_attention", "linear_attention", "LinearState", "merge_states", "rope_apply",
        "feature_map_apply", "head_decays", "linear", "RotaryEmbedding", "MultiheadAttention",
        "KeyValueCache", "HeadRMSNorm", "RedrawSchedule", "Linear", "ShortConvolution",
        "ShortConvCache", "backend", "gelu", "rms_norm", "GELU", "RMSNorm"}
    assert lt.backend is dispatch.backend
    for module in (convolution, functional, layers, states):
        for name in module.__all__:
            assert getattr(lt, name) is getattr(module, name), name


def test_head_rms_norm_and_the_redraw_schedule():
    norm = lt.HeadRMSNorm(2, 4, eps=0.0).double()
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(norm(x).pow(2).mean(-1), torch.ones(3, 2, 5, dtype=torch.float64))
    with torch.no_grad():
        norm.weight[4:] = 3.0  # head 1's gain
    nine = torch.full((3, 5), 9.0, dtype=torch.float64)
    torch.testing.assert_close(norm(x)[:, 1].pow(2).mean(-1), nine)
    schedule = lt.RedrawSchedule(3)
    assert [schedule.due(done) for done in range(8)] == [False, False, False, True, False, False,
                                                         True, False]
    assert not any(lt.RedrawSchedule(0).due(done) for done in range(5))
    with pytest.raises(ValueError, match="interval is -1 but expected >= 0"):
        lt.MultiheadAttention(16, 2, "linear", redraw_interval=-1)


def test_layers_deep_copy_and_save_whole():
    import copy
    import io
    for layer in (lt.MultiheadAttention(16, 2, "linear", num_features=8, causal=True, seed=3),
                  lt.MultiheadAttention(16, 2, "softmax", causal=True)):
        x = torch.randn(2, 5, 16)
        clone = copy.deepcopy(layer)  # an EMA copy, say
        torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        torch.testing.assert_close(torch.load(buffer)(x), layer(x), rtol=0, atol=0)


def test_a_redraw_between_forward_and_backward_is_refused():
    fm = linrope.FeatureMap("favor+", 4, num_features=8, seed=1)
    q, k, v = inputs((5, 4), (5, 4), (5, 4))
    out = lt.linear_attention(q, k, v, fm, placement="none")
    fm.redraw(2)
    with pytest.raises(RuntimeError, match="redrawn"):
        out.sum().backward()


def test_bad_input():
    (x,) = inputs((4, 8))
    with pytest.raises(ValueError, match="q has dtype torch.bfloat16"):
        lt.softmax_attention(x.bfloat16(), x, x)
    with pytest.raises(ValueError, match="k has dtype float32 but q has dtype float64"):
        lt.softmax_attention(x, x.float(), x)
    with pytest.raises(TypeError, match="q is a ndarray"):
        lt.softmax_attention(x.detach().numpy(), x, x)
    fm = linrope.FeatureMap("elu+1", 8)
    with pytest.raises(ValueError, match="expected one of none, before_map, numerator_only, full"):
        lt.linear_attention(x, x, x, fm, placement="numerator-only")
    with pytest.raises(ValueError, match="expected one of softmax, linear"):
        lt.MultiheadAttention(16, 2, "performer")
    with pytest.raises(ValueError, match="feature map is .* but expected one of"):
        lt.MultiheadAttention(16, 2, "linear", feature_map="favor")


# ---- Defaults: one place, the C++ structs -------------------------------------------------------

def _python_defaults(f):
    import inspect
    return {name: p.default for name, p in inspect.signature(f).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _core_defaults(f):
    """The keyword defaults pybind11 writes into the signature line of f's docstring."""
    import ast
    import re
    signature = f.__doc__.splitlines()[0]
    return {m.group(1): ast.literal_eval(m.group(2))
            for m in re.finditer(r"(\w+): [\w.\[\], ]+? = ('[^']*'|[-+\w.]+)", signature)}


def test_defaults_are_the_cpp_structs():
    # Every Python default that mirrors a field of a C++ options struct equals the field of the
    # default-constructed struct, read through its binding: a literal copied into the binding or
    # into linrope.torch that drifts from the C++ header fails here.
    softmax, linear = linrope.SoftmaxOptions(), linrope.LinearOptions()
    threshold = linrope.DenominatorStats().threshold
    rope, fmap = linrope.RopeConfig(), linrope.FeatureMapConfig()
    assert softmax.scale == 0  # the C++ spelling of scale=None (1/sqrt(d))
    expected_softmax = dict(causal=softmax.causal, scale=None, q_offset=softmax.q_offset,
                            k_offset=softmax.k_offset)
    expected_linear = dict(causal=linear.causal, placement=linear.placement, eps=linear.eps,
                           q_offset=linear.q_offset, k_offset=linear.k_offset,
                           stats_threshold=threshold, method=linear.method,
                           chunk_size=linear.chunk_size)
    expected_rope = dict(rotary_dim=rope.rotary_dim, base=rope.base, layout=rope.layout,
                         scaling=rope.scaling, factor=rope.factor,
                         original_max_position=rope.original_max_position)
    expected_layer = dict(rope_base=rope.base, rope_layout=rope.layout,
                          orthogonal=fmap.orthogonal, seed=fmap.seed, eps=linear.eps,
                          method=linear.method, chunk_size=linear.chunk_size,
                          stats_threshold=threshold)
    cases = [
        (_core_defaults(linrope.softmax_attention), expected_softmax),
        (_core_defaults(linrope.softmax_attention_backward), expected_softmax),
        (_python_defaults(lt.softmax_attention), expected_softmax),
        (_core_defaults(linrope.linear_attention), expected_linear),
        (_core_defaults(linrope.linear_attention_backward),
         {k: v for k, v in expected_linear.items() if k != "stats_threshold"}),
        (_python_defaults(lt.linear_attention), expected_linear),
        (_core_defaults(linrope.LinearAttentionStream.__init__),
         dict(placement=linear.placement, eps=linear.eps, offset=linear.q_offset)),
        (_core_defaults(linrope.LinearAttentionStream.step), dict(stats_threshold=threshold)),
        (_core_defaults(linrope.Rope.__init__),
         dict(expected_rope, beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)),
        (_python_defaults(lt.RotaryEmbedding.__init__), expected_rope),
        (_core_defaults(linrope.FeatureMap.__init__),
         dict(num_features=fmap.num_features, orthogonal=fmap.orthogonal, seed=fmap.seed,
              regularized=fmap.regularized)),
        (_python_defaults(lt.MultiheadAttention.__init__), expected_layer),
    ]
    for defaults, expected in cases:
        for name, value in expected.items():
            assert name in defaults, (name, defaults)
            assert defaults[name] == value and type(defaults[name]) is type(value), (
                name, defaults[name], value)
    # The layer's placement when rope=True is the C++ default placement.
    layer = lt.MultiheadAttention(8, 2, "linear", feature_map="elu+1")
    assert layer.placement == linear.placement


@pytest.mark.parametrize("options", [
    dict(attention="softmax"), dict(attention="softmax", rope=False),
    dict(attention="linear", feature_map="favor+", placement="numerator_only"),
    dict(attention="linear", feature_map="elu+1", placement="full"),
    dict(attention="linear", feature_map="favor+", placement="before_map"),
    dict(attention="linear", feature_map="elu+1", placement="numerator_only", denominator=False),
], ids=str)
def test_decoding_token_by_token_equals_the_parallel_forward(options):
    # A prompt of 5 tokens at once, then 7 tokens one at a time through the cache (a key-value
    # cache for softmax, the linear state otherwise): the outputs of the parallel forward on all
    # 12, to rounding (float64: the same sums in another order).
    torch.manual_seed(3)
    layer = lt.MultiheadAttention(16, 2, causal=True, **options).double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    whole = layer(x)
    out, cache = layer(x[:, :5], return_cache=True)
    outs = [out]
    for t in range(5, 12):
        out, cache = layer(x[:, t:t + 1], first_position=t, cache=cache)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-10, atol=1e-12)
    if options["attention"] == "linear":  # O(1) memory: the state's size never grew
        assert isinstance(cache, lt.LinearState)
        assert cache.S.shape == (2, 2, layer.feature_map.output_dim, 8)
    else:
        assert isinstance(cache, lt.KeyValueCache) and cache.k is cache[0]
        assert cache.k.shape == cache.v.shape == (2, 2, 12, 8)
    with pytest.raises(ValueError, match="take no lengths"):
        layer(x[:, :2], return_cache=True, lengths=[2, 1])
