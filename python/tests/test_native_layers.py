"""The native path (backend("native")) under the layers and across processes: MultiheadAttention
with every attention kind, short convolutions, decays, no denominator and padding equals the same
layer on the C++ kernels (outputs, input and parameter gradients, float64 to 1e-12 of each
result's largest entry), decoding token by token equals the parallel forward, the sequence-parallel
path on gloo with the native backend on every rank equals one process on the kernels, and the
native causal linear attention's memory at n = 16384 is far below one n x n matrix.

LINROPE_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the native side on that device. Where the
C++ module is not built, the expected side is the native path on the CPU (as test_native.py)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import linrope.torch as lt
from cases import true_sums
from distributed_worker import SPLIT_LAYERS, cases, layer_inputs, whole
from linrope.torch.launch import environment, free_port, run_group
from linrope.torch.native.dispatch import core_built

DEVICE = torch.device(os.environ.get("LINROPE_TEST_DEVICE", "cpu"))
TOLERANCE64 = 1e-12  # as test_native.py: float64 sums in other orders, ~1e-15 at these sizes
TESTS = os.path.dirname(os.path.abspath(__file__))
EXPECTED = "auto" if core_built() else "native"  # the C++ kernels on CPU tensors, where built


def assert_close(got, want, what, tolerance=TOLERANCE64):
    """Within tolerance of max(1, want's largest |entry|): the inputs and weights here are of
    order 1, and a gradient that is 0 in exact arithmetic (a key bias under softmax) is rounding
    on both sides."""
    scale = max(1.0, float(want.abs().max()) if want.numel() else 0.0)
    error = float((got.cpu() - want.cpu()).abs().max()) if want.numel() else 0.0
    assert error <= tolerance * scale, f"{what}: error {error:.3g} of {scale:.3g}"


def layer_run(layer, x, backend, device, **call):
    """The layer's output and the gradients of sum(G * out) with respect to x and its
    parameters, run under `backend` on `device` (a copy of the layer moved there)."""
    moved = copy.deepcopy(layer).to(device)
    x = x.detach().to(device).requires_grad_()
    with lt.backend(backend):
        out = moved(x, **call)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    params = [p for p in moved.parameters()]
    grads = torch.autograd.grad(out, [x] + params, g.to(device))
    return out.detach().cpu(), [gx.cpu() for gx in grads]


LAYERS = [
    dict(attention="softmax"),
    dict(attention="softmax", rope=False, causal=False),
    dict(attention="softmax", short_conv=3),
    dict(attention="linear", feature_map="favor+", num_features=8),
    dict(attention="linear", feature_map="favor+", num_features=8, causal=False),
    dict(attention="linear", feature_map="elu+1", placement="full", eps=1.0),
    dict(attention="linear", feature_map="1+cos", placement="before_map"),
    dict(attention="linear", feature_map="relu", rope=False),
    dict(attention="linear", feature_map="favor-hyp", num_features=4, placement="none"),
    dict(attention="linear", feature_map="favor-trig", num_features=4, eps=1.0),
    dict(attention="linear", feature_map="elu+1", denominator=False, decay="retnet"),
    dict(attention="linear", feature_map="favor+", num_features=8, decay=0.7, short_conv=4,
         method="chunked", chunk_size=3),
]


@pytest.mark.parametrize("options", LAYERS, ids=str)
def test_the_layer_on_the_native_path_equals_the_kernels(options):
    options = dict(dict(causal=True), **options)
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, **options).double()
    x = torch.randn(3, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for call in (dict(), dict(lengths=[9, 4, 1], first_position=2)):
        want, want_grads = layer_run(layer, x, EXPECTED, torch.device("cpu"), **call)
        got, got_grads = layer_run(layer, x, "native", DEVICE, **call)
        assert_close(got, want, f"{options} {call}: out")
        names = ["x"] + [name for name, _ in layer.named_parameters()]
        for name, a, b in zip(names, got_grads, want_grads):
            assert_close(a, b, f"{options} {call}: d{name}")


@pytest.mark.parametrize("options", [o for o in LAYERS if o.get("causal", True)], ids=str)
def test_decoding_on_the_native_path_equals_the_parallel_forward(options):
    # A prompt of 5 tokens, then one token at a time, then a block of 3, through the cache (the
    # LinearState, or softmax's keys and values, with a short convolution's past).
    torch.manual_seed(3)
    layer = lt.MultiheadAttention(16, 2, causal=True, **options).double().eval().to(DEVICE)
    x = torch.randn(2, 12, 16, dtype=torch.float64).to(DEVICE)
    with lt.backend("native"), torch.no_grad():
        whole = layer(x)
        outs, cache, start = [], None, 0
        for stop in (5, 6, 7, 8, 9, 12):
            out, cache = layer(x[:, start:stop], first_position=start, cache=cache,
                               return_cache=True)
            outs.append(out)
            start = stop
    assert_close(torch.cat(outs, 1), whole, f"{options}: decoded")


# ---- Sequence parallelism on gloo, the native path on every rank -------------------------------

TIMEOUT = 180
# Each rank runs distributed_worker.py (test_distributed.py's) with backend("native") entered
# for its whole run.
NATIVE_WORKER = ("import runpy, sys\n"
                 "import linrope.torch as lt\n"
                 "lt.backend('native').__enter__()\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def launch_native(world, scenario, tmp_path):
    port = free_port()
    outs = [tmp_path / f"{scenario}-{world}-rank{r}.pt" for r in range(world)]
    worker = os.path.join(TESTS, "distributed_worker.py")
    exits = run_group([[sys.executable, "-c", NATIVE_WORKER, worker, r, world, port, scenario,
                        outs[r]] for r in range(world)], timeout=TIMEOUT,
                      env=environment(pythonpath=[TESTS]))
    for r, e in enumerate(exits):
        assert e.returncode == 0, f"rank {r} exited with {e.returncode}:\n{e.output}"
    return [torch.load(o) for o in outs]


def test_sequence_parallel_on_the_native_path_equals_one_process(tmp_path):
    # 3 ranks, every map x placement (equal and uneven slices, a decay, one per head, initial and
    # final states), against the whole sequence on the kernels; float64 (both within ~1e-13 of
    # the exact result at these sizes).
    ranks = launch_native(3, "cases", tmp_path)
    for index, (kind, placement, _, with_state, decay) in enumerate(cases()):
        with lt.backend(EXPECTED):  # the C++ kernels, where built
            want = whole(index, kind, placement, with_state, decay)
        what = f"{kind} {placement} decay {decay}"
        for name in ("out", "dq", "dk", "dv"):
            got = torch.cat([r[index][name] for r in ranks], 2)
            assert_close(got, want[name], f"{what}: {name}", 1e-10)
        if with_state:
            for r in ranks:
                for a, b in zip(true_sums(r[index]["final"]), true_sums(want["final"])):
                    assert_close(a, b, f"{what}: final state", 1e-10)
            for name in ("dS0", "dz0"):
                assert_close(sum(r[index][name] for r in ranks), want[name], f"{what}: {name}",
                             1e-10)


def test_sequence_parallel_layers_on_the_native_path_equal_one_process(tmp_path):
    # Short convolutions (the halo from one or several ranks) and decays on 3 ranks.
    ranks = launch_native(3, "split_layers", tmp_path)
    for index, (options, lengths) in enumerate(SPLIT_LAYERS[3]):
        layer, x, d_out = layer_inputs(n=11, **options)
        x = x.clone().requires_grad_()
        with lt.backend(EXPECTED):
            out = layer(x)
        (out * d_out).sum().backward()
        got = [r[index] for r in ranks]
        assert [g["out"].shape[1] for g in got] == lengths
        assert_close(torch.cat([g["out"] for g in got], 1), out.detach(), f"{options}", 1e-10)
        assert_close(torch.cat([g["dx"] for g in got], 1), x.grad, f"{options}: dx", 1e-10)
        for name, p in layer.named_parameters():
            assert_close(sum(g["grads"][name] for g in got), p.grad, f"{options}: {name}", 1e-10)


# ---- Memory --------------------------------------------------------------------------------------

MEASURE = """
import resource, sys, torch, linrope, linrope.torch as lt
n, device = int(sys.argv[1]), torch.device(sys.argv[2])
fm = linrope.FeatureMap("favor+", 16, num_features=64, seed=1)
q, k, v = [torch.randn(1, 1, n, 16, device=device, requires_grad=True) for _ in range(3)]
if device.type == "cuda":
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
else:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with lt.backend("native"):
    out = lt.linear_attention(q, k, v, fm, causal=True, rope=linrope.Rope(64), decay=0.99)
out.sum().backward()
if device.type == "cuda":
    peak = torch.cuda.max_memory_allocated() - before
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(peak)
"""


def test_causal_linear_attention_memory_is_far_below_an_n_by_n_matrix():
    # Forward and backward of causal eq. 19 at n = 16384, m = 64, with a decay, in a fresh
    # process. On the CPU the growth of the peak resident set (ru_maxrss) bounds everything the
    # call held at once: one n x n float32 matrix alone would be 1 GiB, and the call must stay
    # under a quarter of that. It holds the features, O(n m), per chunk of 64 its products and
    # the state it read, O(n / 64 m d_v), and autograd's copies of them (test_native.py's
    # module, linear.py, counts them): tens of MiB. On CUDA, torch.cuda.max_memory_allocated.
    n = 16384
    result = subprocess.run([sys.executable, "-c", MEASURE, str(n), str(DEVICE)],
                            capture_output=True, text=True, timeout=600, env=environment())
    assert result.returncode == 0, result.stderr
    peak = int(result.stdout.split()[-1])
    matrix = n * n * 4
    assert peak < matrix / 4, f"peak {peak / 2 ** 20:.0f} MiB against {matrix / 2 ** 20:.0f} MiB"
