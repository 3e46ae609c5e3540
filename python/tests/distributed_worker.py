"""One rank of test_distributed.py: python3 distributed_worker.py RANK WORLD PORT SCENARIO OUT.

Joins a gloo group of WORLD processes on 127.0.0.1:PORT, runs the scenario's calls of
linrope.torch.distributed.linear_attention on its slice of each sequence, and saves what it got
(outputs, gradients, or the error message it raised) to OUT with torch.save. The inputs of every
case are drawn from fixed seeds (cases()), so the parent test can compute the single-process call
on the whole sequence and compare."""
import datetime
import sys
import traceback

import torch
import torch.distributed as dist

import linrope
import linrope.torch as lt
import linrope.torch.distributed as ltd
from cases import make_map
from linrope.torch.native.dispatch import core_built

MAP_KINDS = ["elu+1", "favor+", "favor-hyp", "relu"]
PLACEMENTS = ["none", "before_map", "numerator_only", "full"]


def slices(n, world, uneven):
    """Slice lengths: equal, or uneven (rank 0 the longest, one rank a single token)."""
    if not uneven:
        return [n // world + (r < n % world) for r in range(world)]
    lengths = [1] * world
    lengths[0] = n - (world - 1) - (world - 2) * 2
    for r in range(1, world - 1):
        lengths[r] = 3
    return lengths


def case_inputs(kind, placement, seed, decay=None, d=4, d_v=3, n=23):
    """The whole sequence's inputs, the map, and the options of one case."""
    fm = make_map(kind, d, seed=seed)
    width = d if placement == "before_map" else fm.output_dim
    rope = None if placement == "none" else linrope.Rope(width, rotary_dim=width - width % 2)
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = [0.5 * torch.randn(2, 2, n, w, generator=g, dtype=torch.float64)
                      for w in (d, d, d_v, d_v)]
    options = dict(causal=True, placement=placement, rope=rope, q_offset=5, k_offset=5,
                   eps=1.0 if placement == "full" else 1e-6, decay=decay)
    return fm, q, k, v, d_out, options


# No decay, one for every head, one per head (H = 2): 0.6^22 ~ 1e-5, so the earliest ranks'
# states still count at the last rank's tokens.
DECAYS = [None, 0.8, (0.6, 0.95)]


def cases():
    """(kind, placement, uneven, with_state, decay): every map x placement, equal and uneven
    slices; one initial/final-state case per map; each decay in turn."""
    for i, kind in enumerate(MAP_KINDS):
        for j, placement in enumerate(PLACEMENTS):
            yield (kind, placement, bool((i + j) % 2), placement == "numerator_only",
                   DECAYS[(i + j) % 3])


def initial_state(fm, seed):
    g = torch.Generator().manual_seed(seed + 100)
    m = fm.output_dim
    S = torch.randn(2, 2, m, 3, generator=g, dtype=torch.float64)
    z = torch.rand(2, 2, m, generator=g, dtype=torch.float64) + 0.5
    return lt.LinearState(S, z, torch.full((2, 2), 0.25, dtype=torch.float64))


def whole(index, kind, placement, with_state, decay):
    """The single-process call on the whole sequence: outputs and gradients, the losses those
    of run_case (the outputs, and the final state's sums once)."""
    fm, q, k, v, d_out, options = case_inputs(kind, placement, seed=index, decay=decay)
    q, k, v = [x.clone().requires_grad_() for x in (q, k, v)]
    state = None
    if with_state:
        S0, z0, l0 = initial_state(fm, index)
        state = lt.LinearState(S0.requires_grad_(), z0.requires_grad_(), l0)
    result = lt.linear_attention(q, k, v, fm, initial_state=state, return_state=with_state,
                                 **options)
    out, final = result if with_state else (result, None)
    loss = (out * d_out).sum()
    if with_state:
        scale = torch.exp(final.log_scale)
        loss = loss + (final.S * scale[..., None, None]).sum() + (final.z * scale[..., None]).sum()
    loss.backward()
    want = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    if with_state:
        want.update(final=[t.detach() for t in final], dS0=state.S.grad, dz0=state.z.grad)
    return want


def run_case(rank, world, index, kind, placement, uneven, with_state, decay):
    fm, q, k, v, d_out, options = case_inputs(kind, placement, seed=index, decay=decay)
    lengths = slices(q.shape[2], world, uneven)
    begin = sum(lengths[:rank])
    part = [x[:, :, begin:begin + lengths[rank]].clone().requires_grad_() for x in (q, k, v)]
    state = None
    if with_state:
        state = lt.LinearState(*[t.clone().requires_grad_() if t.dtype == torch.float64
                                 and t.dim() > 2 else t for t in initial_state(fm, index)])
    result = ltd.linear_attention(*part, fm, initial_state=state, return_state=with_state,
                                  **options)
    out, final = result if with_state else (result, None)
    loss = (out * d_out[:, :, begin:begin + lengths[rank]]).sum()
    if with_state and rank == 0:
        # The final state's sums enter rank 0's loss (every rank holds the same final state; the
        # whole-sequence loss has it once): its gradient reaches every rank's keys.
        scale = torch.exp(final.log_scale)
        loss = loss + (final.S * scale[..., None, None]).sum() + (final.z * scale[..., None]).sum()
    loss.backward()
    got = dict(out=out.detach(), dq=part[0].grad, dk=part[1].grad, dv=part[2].grad,
               lengths=lengths)
    if with_state:
        got.update(final=[t.detach() for t in final], dS0=state.S.grad, dz0=state.z.grad)
    return got


def layer_inputs(seed=11, batch=2, n=21, embed=16, **options):
    torch.manual_seed(seed)
    layer = lt.MultiheadAttention(embed, 2, attention="linear", feature_map="favor+", causal=True,
                                  seed=seed, **options).double()
    g = torch.Generator().manual_seed(seed)
    x, d_out = [torch.randn(batch, n, embed, generator=g, dtype=torch.float64) for _ in range(2)]
    return layer, x, d_out


def run_layer(rank, world, lengths=None, **options):
    """The layer on this rank's slice, sequence-parallel: its output rows and its parameters'
    gradients (this rank's share: summed over ranks, they are the whole's), and how many
    exchanges record_exchanges() saw."""
    layer, x, d_out = layer_inputs(**options)
    lengths = lengths or slices(x.shape[1], world, uneven=True)
    begin = sum(lengths[:rank])
    part = x[:, begin:begin + lengths[rank]].clone().requires_grad_()
    layer.sequence_parallel = True
    with ltd.record_exchanges() as exchanges:
        out = layer(part)
    (out * d_out[:, begin:begin + lengths[rank]]).sum().backward()
    return dict(out=out.detach(), dx=part.grad, recorded=len(exchanges),
                pending=exchanges.pending(),
                grads={name: p.grad for name, p in layer.named_parameters()})


# (layer options, slice lengths) for 2 and 3 ranks, n = 11: short convolutions on slices
# shorter than k - 1 (the halo then comes from several ranks, or reaches the sequence's start)
# and longer, and decays.
SPLIT_LAYERS = {2: [(dict(short_conv=4), [2, 9]), (dict(short_conv=2, decay="retnet"), [9, 2])],
                3: [(dict(short_conv=4), [1, 1, 9]), (dict(short_conv=4), [5, 1, 5]),
                    (dict(short_conv=3, decay=0.7), [4, 4, 3]),
                    (dict(decay=(0.5, 0.9)), [3, 1, 7])]}


def run_split_layers(rank, world):
    return [run_layer(rank, world, lengths, n=11, **options)
            for options, lengths in SPLIT_LAYERS[world]]


def bad_input(rank, world):
    """Rank 1 passes 3 heads where the others pass 2, then (a second call) values of width 4
    where the others pass 3, then (a third) a NaN in v: every rank must raise the same error for
    each. The (exception type, message) of each call, in order."""
    fm = linrope.FeatureMap("elu+1", 4)
    raised = []
    for heads, d_v, spoil in ((3 if rank == 1 else 2, 3, False), (2, 4 if rank == 1 else 3, False),
                              (2, 3, rank == 1)):
        q = torch.randn(1, heads, 5, 4, dtype=torch.float64)
        v = torch.randn(1, heads, 5, d_v, dtype=torch.float64)
        if spoil:
            v[0, 1, 2, 0] = torch.nan
        try:
            ltd.linear_attention(q, q, v, fm, placement="none")
            raised.append(None)
        except ValueError as e:
            raised.append((type(e).__name__, str(e)))
    # A halo whose rows have 7 channels on rank 1, 6 on the others; a decay of 0.9 on rank 1,
    # 0.8 on the others; a decay out of (0, 1] on rank 1.
    q, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    calls = [lambda: ltd.halo(torch.randn(1, 4, 7 if rank == 1 else 6), 2)]
    for decay in (0.9 if rank == 1 else 0.8, 1.5 if rank == 1 else 0.8):
        calls.append(lambda decay=decay: ltd.linear_attention(q, q, v, fm, placement="none",
                                                              decay=decay))
    for call in calls:
        try:
            call()
            raised.append(None)
        except ValueError as e:
            raised.append((type(e).__name__, str(e)))
    return raised


class FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises when `fail` is set: a layer's backward failing on one
    rank (out of memory, a bug) while the others' succeed."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("injected failure in a layer's backward")
        return grad, None


def failed_backward(rank, world, short_conv=0):
    """Two sequence parallel layers, x -> first -> second -> loss, and a backward that raises on
    rank 1 (FailingBackward) above both layers ("above"), between them ("between") or nowhere
    (None). Every rank whose backward raises joins what it skipped (ExchangeLog.join_pending), as
    a trainer would: rank 1 first, then the others, whose linrope backward refuses the NaN rank 1
    sends. Last, a forward without grad. Per case: the calls recorded, the error (type: message)
    and the exchanges pending after it, before and after joining; whether x's gradient holds NaN
    (when no error). short_conv=k: layers with a short convolution, whose halo exchange's
    backward is joined as well."""
    torch.manual_seed(5)
    layers = [lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1", causal=True,
                                    rope=False, short_conv=short_conv).double() for _ in range(2)]
    for layer in layers:
        layer.sequence_parallel = True
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    results = {}
    for fault in (None, "above", "between"):
        part = x.clone().requires_grad_()
        with ltd.record_exchanges() as exchanges:
            h = layers[0](part)
            if fault == "between":
                h = FailingBackward.apply(h, rank == 1)
            out = layers[1](h)
            if fault == "above":
                out = FailingBackward.apply(out, rank == 1)
        got = dict(recorded=len(exchanges), pending_before_backward=exchanges.pending(),
                   error=None, pending=0)
        try:
            out.sum().backward()
        except Exception as e:
            got.update(error=f"{type(e).__name__}: {e}", pending=exchanges.pending())
            exchanges.join_pending()
        got.update(pending_after=exchanges.pending(),
                   nan_gradient=part.grad is not None and bool(part.grad.isnan().any()))
        results[fault] = got
    with torch.no_grad(), ltd.record_exchanges() as exchanges:
        layers[0](x)
    results["no_grad"] = dict(recorded=len(exchanges))
    return results


def main():
    rank, world, port, scenario, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                        sys.argv[4], sys.argv[5])
    torch.set_num_threads(1)
    if core_built():  # without the C++ module (linrope._pure) there are no kernel threads
        linrope.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        if scenario == "cases":
            result = [run_case(rank, world, i, *case) for i, case in enumerate(cases())]
        elif scenario == "layer":
            result = run_layer(rank, world)
        elif scenario == "split_layers":
            result = run_split_layers(rank, world)
        elif scenario == "failed_backward":
            result = failed_backward(rank, world)
        elif scenario == "failed_backward_short_conv":
            result = failed_backward(rank, world, short_conv=3)
        else:
            result = bad_input(rank, world)
        torch.save(result, out)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
