"""linrope.torch.distributed.linear_attention with 2 and 4 processes on 127.0.0.1 (gloo), each a
separate Python (distributed_worker.py), against the single-process linrope.torch.linear_attention
on the whole sequence: outputs and gradients of q, k, v (and of the initial state, and the final
state) for every map x placement, equal and uneven slices; and bad input raising the same error on
every rank. Each launch is bounded: a rank still running after TIMEOUT seconds fails the test and
every rank is killed."""
import os
import sys

import pytest
import torch

import linrope.torch as lt
from cases import true_sums
from distributed_worker import SPLIT_LAYERS, cases, layer_inputs, whole
from linrope.torch.launch import environment, free_port, run_group

TIMEOUT = 120
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")


def launch(world, scenario, tmp_path):
    """Runs `world` workers; returns each rank's saved result. Fails on a non-zero exit, or
    (GroupTimeout, every rank killed) when a rank is still running after TIMEOUT seconds."""
    port = free_port()
    outs = [tmp_path / f"{scenario}-{world}-rank{r}.pt" for r in range(world)]
    exits = run_group([[sys.executable, WORKER, r, world, port, scenario, outs[r]]
                       for r in range(world)], timeout=TIMEOUT, env=environment())
    for r, e in enumerate(exits):
        assert e.returncode == 0, f"rank {r} exited with {e.returncode}:\n{e.output}"
    return [torch.load(o) for o in outs]


def close(a, b):
    # Both in float64, each within the kernels' derived bounds (tests/test_linear_state.cpp) of
    # the exact result, which are ~1e-13 relative at these sizes; 1e-9 of the largest entry is
    # far above both and far below a missing or misplaced term.
    return (a - b).abs().max().item() <= 1e-9 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("world", [2, 4])
def test_split_sequence_equals_one_process(world, tmp_path):
    ranks = launch(world, "cases", tmp_path)
    for index, (kind, placement, uneven, with_state, decay) in enumerate(cases()):
        want = whole(index, kind, placement, with_state, decay)
        lengths = ranks[0][index]["lengths"]
        assert len(lengths) == world and sum(lengths) == want["out"].shape[2]
        assert min(lengths) == 1 if uneven else max(lengths) - min(lengths) <= 1
        what = f"{kind} {placement} decay {decay} slices {lengths}"
        for name in ("out", "dq", "dk", "dv"):
            got = torch.cat([r[index][name] for r in ranks], 2)
            assert close(got, want[name]), f"{what}: {name}"
        if with_state:
            for r in ranks:
                # The sums the state holds, exp(log_scale) (S, z); without a decay the log scale
                # is the largest key shift on either side, bit for bit, and so are S and z to
                # rounding. With one, the merge and the kernel may choose other log scales.
                for a, b in zip(true_sums(r[index]["final"]), true_sums(want["final"])):
                    assert close(a, b), f"{what}: final state"
                if decay is None:
                    assert torch.equal(r[index]["final"][2], want["final"][2]), what
            # Every rank's gradient of the initial state: rank 0's slice reads it, the final
            # state (on every rank) holds it; summed over ranks as a data-parallel step would.
            for name in ("dS0", "dz0"):
                got = sum(r[index][name] for r in ranks)
                assert close(got, want[name]), f"{what}: {name}"


def test_a_sequence_parallel_layer_equals_one_process(tmp_path):
    # MultiheadAttention with sequence_parallel=True on 3 ranks (uneven slices) against the layer
    # on the whole sequence: outputs, input gradients, and the parameters' gradients summed over
    # the ranks (what a data-parallel all-reduce of the gradients would give).
    ranks = launch(3, "layer", tmp_path)
    assert_layer_equals_one_process(ranks, {})
    assert all(r["recorded"] == 1 for r in ranks)  # the state exchange


def assert_layer_equals_one_process(ranks, options, what=""):
    layer, x, d_out = layer_inputs(**options)
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * d_out).sum().backward()
    assert close(torch.cat([r["out"] for r in ranks], 1), out.detach()), what
    assert close(torch.cat([r["dx"] for r in ranks], 1), x.grad), what
    for name, p in layer.named_parameters():
        assert close(sum(r["grads"][name] for r in ranks), p.grad), f"{what}: {name}"


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_layers_with_short_convolutions_and_decays_equal_one_process(
        world, tmp_path):
    # Each rank's convolution reads the k - 1 rows before its slice (the halo), from the rank
    # before or from several when their slices are shorter, or zeros at the sequence's start;
    # its backward sends their gradients back. A decay moves each earlier rank's state to this
    # rank's start. Outputs, input gradients and the parameters' (the convolutions' included)
    # summed over the ranks equal the layer on the whole sequence.
    ranks = launch(world, "split_layers", tmp_path)
    for index, (options, lengths) in enumerate(SPLIT_LAYERS[world]):
        what = f"{options}, slices {lengths}"
        got = [r[index] for r in ranks]
        assert [g["out"].shape[1] for g in got] == lengths
        assert_layer_equals_one_process(got, dict(n=11, **options), what)
        # The exchanges recorded per call (a short convolution's halo, then the states), each
        # joined by the backward.
        exchanges = 2 if options.get("short_conv") else 1
        assert all(g["recorded"] == exchanges and g["pending"] == 0 for g in got), what


def test_bad_input_raises_the_same_error_on_every_rank(tmp_path):
    # Three calls in turn: after each error the ranks are still in step for the next.
    ranks = launch(2, "bad", tmp_path)
    assert ranks[0] == ranks[1] and None not in ranks[0]
    assert ranks[0][0] == ("ValueError", "linrope.torch.distributed.linear_attention: rank 1: "
                           "heads is 3 but rank 0's is 2; every rank must make the same call on "
                           "its own slice")
    assert ranks[0][1][0] == "ValueError" and "rank 1: d_v is 4 but rank 0's is 3" in ranks[0][1][1]
    assert ranks[0][2] == ("NonFiniteError", "linrope.torch.distributed.linear_attention: rank 1: "
                           "q, k or v holds a non-finite value")
    assert ranks[0][3] == ("ValueError", "linrope.torch.distributed.halo: rank 1: channels is 7 "
                           "but rank 0's is 6; every rank must make the same call on its own slice")
    assert ranks[0][4] == ("ValueError", "linrope.torch.distributed.linear_attention: rank 1: "
                           "decay differs from rank 0's; every rank must make the same call on "
                           "its own slice")
    assert ranks[0][5] == ("ValueError", "linrope.torch.distributed.linear_attention: rank 1: "
                           "decay must be a float in (0, 1] or a sequence of H = 2 of them, one "
                           "per head")


@pytest.mark.parametrize("scenario, per_layer",
                         [("failed_backward", 1), ("failed_backward_short_conv", 2)])
def test_a_failed_backward_joins_what_it_skipped_and_no_rank_hangs(scenario, per_layer, tmp_path):
    # 3 ranks, two sequence parallel layers; rank 1's backward raises above both layers, then
    # between them. Without join_pending ranks 0 and 2 would wait in the skipped all_reduces
    # until the group's timeout (60 s); with it every rank finishes: rank 1 with its error, the
    # others with NonFiniteError from the first linrope backward that meets rank 1's NaN (the
    # state exchange's, the last of a layer's forward), and they then join what that error made
    # them skip. A layer with a short convolution has two exchanges (per_layer): its halo's, then
    # its states'.
    ranks = launch(3, scenario, tmp_path)
    e = per_layer
    refused = "NonFiniteError: linear_attention_backward: d_final.S has the non-finite value nan"
    for r, got in enumerate(ranks):
        assert got["no_grad"]["recorded"] == 0, "a call without grad has no backward to join"
        normal = got[None]
        assert normal["recorded"] == normal["pending_before_backward"] == 2 * e
        assert normal["error"] is None and normal["pending_after"] == 0
        assert not normal["nan_gradient"]
        # (fault, exchanges skipped on rank 1, on the others)
        for fault, skipped_failed, skipped_others in (("above", 2 * e, 2 * e - 1),
                                                      ("between", e, e - 1)):
            case = got[fault]
            what = f"rank {r}, failure {fault}"
            assert case["recorded"] == case["pending_before_backward"] == 2 * e, what
            assert case["pending_after"] == 0, what
            if r == 1:
                assert case["error"] == "RuntimeError: injected failure in a layer's backward"
                assert case["pending"] == skipped_failed, what
            else:
                assert case["error"].startswith(refused), what
                assert case["pending"] == skipped_others, what


def test_sequence_parallel_layers_refuse_what_cannot_be_split():
    # Refused before any collective, so no process group is needed: a layer that can never run
    # split as soon as sequence_parallel is set, a call that cannot at the call.
    x = torch.randn(1, 4, 8)
    softmax = lt.MultiheadAttention(8, 2, attention="softmax", causal=True)
    noncausal = lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1")
    for layer, reason in ((softmax, "needs attention='linear'"), (noncausal, "needs causal=True")):
        assert reason in layer.sequence_parallel_problem()
        with pytest.raises(ValueError, match=reason):
            layer.sequence_parallel = True
        assert not layer.sequence_parallel
    causal = lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1", causal=True)
    assert causal.sequence_parallel_problem() is None
    causal.sequence_parallel = True
    assert "takes no lengths" in causal.sequence_parallel_problem(lengths=[4])
    with pytest.raises(ValueError, match="takes no lengths"):
        causal(x, lengths=[4])
    assert "needs self-attention" in causal.sequence_parallel_problem(key=x, value=x)
    with pytest.raises(ValueError, match="needs self-attention"):
        causal(x, x, x)
    with pytest.raises(ValueError, match="cache and return_cache are for one process"):
        causal(x, return_cache=True)
