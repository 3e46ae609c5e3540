"""linrope.torch.distributed: causal linear attention over a sequence split across processes.

    linear_attention(q, k, v, feature_map, *, group=None,
                     **options of linrope.torch.linear_attention)
    halo(x, rows, *, group=None): the rows of the sequence just before this rank's slice
    record_exchanges() -> ExchangeLog: joins, after a failed backward, what the backward skipped

Each rank of the torch.distributed group holds a contiguous slice of every sequence, q, k, v of
shape [B, H, n_local, d] (n_local may differ between ranks; rank r's tokens follow rank r - 1's,
and positions continue: rank r's first token sits at q_offset + the tokens of ranks 0..r-1).
Causal linear attention only needs, from the tokens before a slice, their state: the sums of
their key features times values, S [m x d_v], and of their key features, z [m], with the
stabiliser's log scale (linrope.torch.LinearState; include/linrope/attention.hpp, "State in,
state out"). So each rank

  1. exchanges a few integers describing its call (all_gather), so that when a rank's input is
     unusable (not [B, H, n, d], non-finite, lengths given, causal=False, a bad decay) or
     differs from rank 0's (heads, widths, dtype, feature map kind, width and seed, placement,
     rope width, offsets, decay), every rank raises the same ValueError instead of waiting for
     the others forever;
  2. sums the state of its own keys (a keys-only call: no queries);
  3. gathers every rank's state (all_gather, list form: gloo has no all_gather_into_tensor);
  4. merges the states of the ranks before it into its prefix state, and runs its slice from it.
     With a decay g, rank p's state is the decayed sum at its last position e_p, and the prefix
     of rank r must be the state at e_{r-1}: rank p's log scale is raised by
     (e_{r-1} - e_p) log g (per head) as it merges, the initial state's by
     (e_{r-1} - (q_offset - 1)) log g, and the final state is the same merge at the sequence's
     last position.

The backward runs the exchange the other way: each rank's gradient with respect to every gathered
state is summed over the ranks (all_reduce), and each rank takes its own state's, which the
keys-only call turns into gradients of its k and v. Every rank must call backward (the
all_reduce waits for all), as with DistributedDataParallel.

What travels, per call (one layer), for P ranks, B x H heads, m features, d_v value width and w
bytes per element (4 for float32, 8 for float64), whatever the sequence length:

  state bytes    s = B H (m (d_v + 1) w + 8)        (S and z, plus the float64 log scale)
  forward        all_gather of s from every rank: each rank receives (P - 1) s
                 + all_gather of 20 int64 (the call's description): 160 (P - 1) bytes
  backward       all_reduce of P (s - 8 B H) (the gradients of every gathered S and z; no scales)

Four collectives per call and layer (three all_gathers in the forward: the description, the
states, the scales; one all_reduce in the backward), each of O(P s) bytes or less: for B = 1,
H = 8, m = 256, d_v = 64, float32, s = 532 kB. Exact softmax attention would need every earlier
rank's keys and values instead: O(n) bytes.

A short convolution of width k (MultiheadAttention(short_conv=k)) needs, besides, the k - 1
projected inputs of q, k and v before each rank's slice: halo(x, rows = k - 1) on x [B, n_local,
C = 3 embed_dim], (k - 1) x 3 x embed_dim values per sequence per rank, so h = B (k - 1) C w
bytes per rank (a rank whose slice is shorter sends its rows with zeros in front: always h):

  forward        all_gather of 6 int64 (the call's description, with n_local): 48 (P - 1) bytes
                 + all_gather of h from every rank: each rank receives (P - 1) h
  backward       all_reduce of P h (the gradients of every rank's rows)

(for B = 1, k = 4, embed_dim = 512, float32, h = 18 kB), recorded by record_exchanges() as the
states' exchange is.

A backward that fails on one rank (an error in some layer's backward, out of memory) leaves the
other ranks blocked in the all_reduces that rank never reached. record_exchanges() notes the calls
of a forward, and ExchangeLog.join_pending() makes the all_reduces their backward skipped, with
NaN, so that the other ranks finish their backward (with NaN gradients, or NonFiniteError)
instead of hanging. Every rank runs its backward so:

    with linrope.torch.distributed.record_exchanges() as exchanges:
        loss = model(x)
    try:
        loss.backward()
    except Exception:
        exchanges.join_pending()
        raise
"""
import contextvars
import struct
import zlib

import torch
import torch.distributed as dist

import linrope
from linrope import NonFiniteError
from linrope.torch import functional
from linrope.torch.states import LinearState, merge_states

__all__ = ["ExchangeLog", "halo", "linear_attention", "record_exchanges",
           "sequence_parallel_problem", "state_bytes"]

# Defaults from the default-constructed C++ structs, so that each lives in the C++ header alone.
_LINEAR = linrope.LinearOptions()
_STATS = linrope.DenominatorStats()

_PLACEMENTS = ("none", "before_map", "numerator_only", "full")
_DTYPES = (torch.float32, torch.float64)

# The fields of a call's description, in the order exchanged: each must agree on every rank
# (but the slice lengths, which may differ, and the local checks' outcome, reported per rank).
_FIELDS = ("dimensions", "batch", "heads", "n_q", "n_k", "d", "d_v", "dtype", "map output_dim",
           "map seed", "map kind", "placement", "rope dim", "q_offset", "k_offset", "causal",
           "lengths given", "initial_state given", "finite", "decay")
_MUST_AGREE = ("dimensions", "batch", "heads", "d", "d_v", "dtype", "map output_dim", "map seed",
               "map kind", "placement", "rope dim", "q_offset", "k_offset", "causal",
               "initial_state given", "decay")


def state_bytes(batch, heads, m, d_v, dtype=torch.float32):
    """Bytes of one state as exchanged: S and z in dtype, and the float64 log scale."""
    width = torch.finfo(dtype).bits // 8
    return batch * heads * (m * (d_v + 1) * width + 8)


def sequence_parallel_problem(causal, lengths_given=False):
    """None when causal linear attention with these options can run over a sequence split across
    ranks, else the reason (a sentence): it must be causal (a rank's tokens see only the earlier
    ranks' states) and take no lengths (a split sequence has no padding). linear_attention below
    and MultiheadAttention.sequence_parallel_problem refuse with it."""
    if not causal:
        return ("sequence_parallel needs causal=True: a rank's tokens see the earlier ranks' "
                "states, never a later rank's keys")
    if lengths_given:
        return ("sequence_parallel takes no lengths (q_lengths, k_lengths): a split sequence has "
                "no padding, each rank's slice is all tokens")
    return None


def _describe(q, k, v, feature_map, options, offsets, lengths_given, initial_given, decay):
    """The call's description as int64 values (unusable input: -1), checked after the exchange
    (_check_descriptions) so that every rank raises together. The decay is a checksum of its
    per-head values."""
    tensors = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    four_dimensional = tensors and all(t.dim() == 4 for t in (q, k, v))

    def size(t, i):
        return int(t.shape[i]) if four_dimensional else -1
    dtype = q.dtype if tensors and q.dtype == k.dtype == v.dtype else None
    finite = four_dimensional and dtype in _DTYPES and all(bool(torch.isfinite(t).all())
                                                           for t in (q, k, v))
    rope = options["rope"]
    try:
        decays = functional.head_decays(decay, size(q, 1), "") if four_dimensional else None
    except ValueError:  # refused on every rank together, after the exchange
        decays = None
    return [4 if four_dimensional else -1, size(q, 0), size(q, 1), size(q, 2), size(k, 2),
            size(q, 3), size(v, 3), _DTYPES.index(dtype) if dtype in _DTYPES else -1,
            int(feature_map.output_dim), int(feature_map.seed) % (1 << 62),
            zlib.crc32(feature_map.kind.encode()),
            _PLACEMENTS.index(options["placement"]) if options["placement"] in _PLACEMENTS else -1,
            int(rope.dim) if rope is not None else -1, int(offsets[0]), int(offsets[1]),
            int(bool(options["causal"])), int(lengths_given), int(initial_given), int(finite),
            -1 if decays is None else zlib.crc32(struct.pack(f"{len(decays)}d", *decays))]


def _check_descriptions(rows):
    """The same message on every rank for the first problem among the ranks' descriptions."""
    first = dict(zip(_FIELDS, rows[0]))
    for rank, row in enumerate(rows):
        described = dict(zip(_FIELDS, row))
        where = f"linrope.torch.distributed.linear_attention: rank {rank}"
        if described["dimensions"] != 4:
            raise ValueError(f"{where}: q, k and v must be [B, H, n_local, d] tensors (4 "
                             f"dimensions each)")
        if described["dtype"] < 0:
            raise ValueError(f"{where}: q, k and v must share one dtype, torch.float32 or "
                             f"torch.float64")
        problem = sequence_parallel_problem(described["causal"], described["lengths given"])
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        if not described["finite"]:
            raise NonFiniteError(f"{where}: q, k or v holds a non-finite value")
        if described["decay"] < 0:
            raise ValueError(f"{where}: decay must be a float in (0, 1] or a sequence of H = "
                             f"{described['heads']} of them, one per head")
        if described["q_offset"] != described["k_offset"]:
            raise ValueError(f"{where}: q_offset is {described['q_offset']} but k_offset is "
                             f"{described['k_offset']}; a split sequence's q and k are the same "
                             f"tokens")
        if described["n_q"] != described["n_k"]:
            raise ValueError(f"{where}: q has n_local = {described['n_q']} but k has "
                             f"{described['n_k']}: a rank's q, k and v are the same tokens")
        _check_agreement(described, first, _MUST_AGREE, where)


def _exchange_description(description, group):
    """Every rank's description (a list of ints of one length), in rank order."""
    rows = [torch.empty(len(description), dtype=torch.int64)
            for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, torch.tensor(description, dtype=torch.int64), group=group)
    return [r.tolist() for r in rows]


def _check_agreement(described, first, fields, where):
    """ValueError for the first of `fields` in which a rank's description differs from rank 0's."""
    for field in fields:
        if described[field] != first[field] and field == "decay":  # exchanged as a checksum
            raise ValueError(f"{where}: decay differs from rank 0's; every rank must make the "
                             f"same call on its own slice")
        if described[field] != first[field]:
            shown = _PLACEMENTS if field == "placement" else _DTYPES if field == "dtype" else None
            a, b = first[field], described[field]
            if shown is not None:
                a, b = shown[a] if a >= 0 else "?", shown[b] if b >= 0 else "?"
            raise ValueError(f"{where}: {field} is {b} but rank 0's is {a}; every rank must "
                             f"make the same call on its own slice")


class _Exchange:
    """One call's backward all_reduce: its group, element count and dtype, and whether it ran."""

    def __init__(self, group, count, dtype):
        self.group, self.count, self.dtype, self.ran = group, count, dtype, False


class ExchangeLog:
    """The state exchanges of the sequence parallel calls made while it records (a context
    manager: record_exchanges()), each waiting for the all_reduce of its backward.

    Every rank must join the backward all_reduce of every call, in the same order. When a rank's
    backward raises before it reached some of them (an error in a layer's backward, out of
    memory), the other ranks block in the first one it missed, for ever or until the process
    group's timeout. join_pending() on the failed rank joins each missed all_reduce with NaN
    instead, so the other ranks go on: they end their backward with NaN gradients, or with
    linrope.NonFiniteError where a linrope backward meets the NaN, and a rank that raises joins
    its own pending exchanges the same way. Every rank thus ends with an error or NaN gradients,
    which a trainer treats as a diverged step, instead of a hang. Run the backward of every rank
    under the same try/except (the module's docstring).

    Calls made without grad (torch.no_grad, a forward whose inputs need no gradient) have no
    backward and are not recorded. One backward per recorded forward."""

    def __init__(self):
        self._exchanges = []
        self._active = None

    def __enter__(self):
        if self._active is not None:
            raise RuntimeError("ExchangeLog: already recording")
        self._active = _recording.set(_recording.get() + (self,))
        return self

    def __exit__(self, *exc_info):
        _recording.reset(self._active)
        self._active = None
        return False

    def __len__(self):
        """The calls recorded."""
        return len(self._exchanges)

    def pending(self):
        """How many recorded calls have not run their backward all_reduce yet."""
        return sum(not e.ran for e in self._exchanges)

    def join_pending(self):
        """Runs the backward all_reduce of every recorded call whose backward did not run it, in
        the order a backward runs them (the last recorded first), each with NaN in place of the
        gradients (the group, element count and dtype the backward would use). Call it on every
        rank whose backward raised, before passing the error on: see the class."""
        for exchange in reversed(self._exchanges):
            if not exchange.ran:
                exchange.ran = True
                dist.all_reduce(torch.full((exchange.count,), torch.nan, dtype=exchange.dtype),
                                op=dist.ReduceOp.SUM, group=exchange.group)


# The logs recording now, innermost last: a call is noted in each.
_recording = contextvars.ContextVar("linrope_exchange_logs", default=())


def record_exchanges():
    """An ExchangeLog that records the sequence parallel calls made inside `with`: see ExchangeLog
    and the module's docstring."""
    return ExchangeLog()


def _note_exchange(packed, group, world):
    """The _Exchange of a call whose backward will all_reduce the gradients of every rank's
    packed state, noted in every recording log; None when nothing records or no backward will
    run."""
    logs = _recording.get()
    if not logs or not (torch.is_grad_enabled() and packed.requires_grad):
        return None
    exchange = _Exchange(group, world * packed.numel(), packed.dtype)
    for log in logs:
        log._exchanges.append(exchange)
    return exchange


class _Gather(torch.autograd.Function):
    """Every rank's piece (one shape on every rank: a packed state (S, z) [B, H, m (d_v + 1)], a
    halo's rows [B, rows, C]) -> [P, *the piece's shape]; the backward sums the gradients of the
    gathered pieces over the ranks and returns this rank's own, and marks `exchange` (if any) as
    run."""

    @staticmethod
    def forward(ctx, packed, group, exchange):
        ctx.group, ctx.exchange = group, exchange
        ctx.rank = dist.get_rank(group)
        pieces = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, packed.contiguous(), group=group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.exchange is not None:
            # Marked before the call: a second all_reduce after this one failed would pair with
            # the peers' next collective.
            ctx.exchange.ran = True
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None, None


def _gather_scales(log_scale, group):
    pieces = [torch.empty_like(log_scale) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, log_scale.contiguous(), group=group)
    return torch.stack(pieces)


def _merge_ranks(S_all, z_all, scales, ranks, initial, moved):
    """The state holding `initial` (if any) and the gathered states of `ranks`, each with its log
    scale moved(log_scale, p) (p None: the initial state's). Every gathered state enters
    merge_states, those of the other ranks at log scale -inf (weight 0), so that the result
    depends on the whole gathered tensor and every rank's backward reaches the all_reduce."""
    left_out = torch.full_like(scales[0], -torch.inf)
    states = [LinearState(S_all[p], z_all[p], moved(scales[p], p) if p in ranks else left_out)
              for p in range(len(scales))]
    if initial is not None:
        initial = LinearState(initial.S, initial.z, moved(initial.log_scale, None))
    return merge_states(([] if initial is None else [initial]) + states)


def _moved_to(at, ends, log_decay):
    """log_scale, p -> the log scale of rank p's state (p None: the initial state's) moved on to
    position `at`. A state is the decayed sum at its last key's position, ends[p] (the initial
    state's: ends[None]); at `at` every key's weight has gained g^(at - end), which the log scale
    carries: log_scale + (at - end) log g, per head [H]. Without a decay, log_scale itself."""
    def moved(log_scale, p):
        return log_scale if log_decay is None else log_scale + (at - ends[p]) * log_decay
    return moved


def linear_attention(q, k, v, feature_map, *, group=None, causal=True,
                     placement=_LINEAR.placement, rope=None, eps=_LINEAR.eps,
                     q_offset=_LINEAR.q_offset, k_offset=_LINEAR.k_offset, return_stats=False,
                     stats_threshold=_STATS.threshold, method=_LINEAR.method,
                     chunk_size=_LINEAR.chunk_size, q_lengths=None, k_lengths=None,
                     initial_state=None, return_state=False, denominator=_LINEAR.denominator,
                     decay=None):
    """Causal linear attention over a sequence split across the ranks of `group` (default: the
    whole world), each holding a contiguous slice [B, H, n_local, d] of q, k, v; returns this
    rank's outputs [B, H, n_local, d_v], equal (to rounding) to the matching rows of
    linrope.torch.linear_attention on the whole sequence, in value and gradient. The options are
    linrope.torch.linear_attention's: q_offset and k_offset give the whole sequence's first
    position (the same on every rank), initial_state the state before the whole sequence (given
    on every rank: used by rank 0's slice), return_state=True also returns the state after the
    whole sequence (the same on every rank). causal must be True and lengths None. With a decay,
    the states of the ranks before are decayed to the position before this rank's first token
    as they merge (_moved_to). See the module's docstring for what travels between ranks and how
    much."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    options = dict(causal=causal, placement=placement, rope=rope, eps=eps, method=method,
                   chunk_size=chunk_size, denominator=denominator, decay=decay)
    description = _describe(q, k, v, feature_map, options, (q_offset, k_offset),
                            q_lengths is not None or k_lengths is not None,
                            initial_state is not None, decay)
    rows = _exchange_description(description, group)
    _check_descriptions(rows)
    lengths = [row[_FIELDS.index("n_q")] for row in rows]
    offset = q_offset + sum(lengths[:rank])
    log_decay = None if decay is None else torch.log(torch.tensor(
        functional.head_decays(decay, q.shape[1], "linear_attention"), dtype=torch.float64))
    # Each state's last key position: rank p's last token, the initial state's q_offset - 1.
    ends = {p: q_offset + sum(lengths[:p + 1]) - 1 for p in range(world)}
    ends[None] = q_offset - 1
    # 2. This rank's keys alone: a call without queries leaves their state.
    _, local = functional.linear_attention(q[:, :, :0], k, v, feature_map, q_offset=offset,
                                           k_offset=offset, return_state=True, **options)
    batch, heads, m, d_v = local.S.shape
    # 3. Every rank's state: S and z packed in q's dtype (differentiable), the scales apart.
    packed = torch.cat([local.S.reshape(batch, heads, m * d_v), local.z], -1)
    gathered = _Gather.apply(packed, group, _note_exchange(packed, group, world))
    scales = _gather_scales(local.log_scale, group)
    S_all = gathered[..., :m * d_v].reshape(world, batch, heads, m, d_v)
    z_all = gathered[..., m * d_v:]
    initial = None if initial_state is None else LinearState(*initial_state)
    # 4. The ranks before this one, then this rank's slice from their state.
    prefix = _merge_ranks(S_all, z_all, scales, range(rank), initial,
                          _moved_to(offset - 1, ends, log_decay))
    result = functional.linear_attention(q, k, v, feature_map, q_offset=offset, k_offset=offset,
                                         initial_state=prefix, return_stats=return_stats,
                                         stats_threshold=stats_threshold, **options)
    if not return_state:
        return result
    final = _merge_ranks(S_all, z_all, scales, range(world), initial,
                         _moved_to(ends[world - 1], ends, log_decay))
    return (*result, final) if return_stats else (result, final)


# The fields of a halo call's description, in the order exchanged.
_HALO_FIELDS = ("dimensions", "batch", "n_local", "channels", "rows", "dtype")
_HALO_MUST_AGREE = ("batch", "channels", "rows", "dtype")


def _describe_halo(x, rows):
    usable = isinstance(x, torch.Tensor) and x.dim() == 3
    return [3 if usable else -1, *(int(x.shape[i]) if usable else -1 for i in range(3)),
            int(rows), _DTYPES.index(x.dtype) if usable and x.dtype in _DTYPES else -1]


def _check_halo_descriptions(descriptions):
    first = dict(zip(_HALO_FIELDS, descriptions[0]))
    for rank, row in enumerate(descriptions):
        described = dict(zip(_HALO_FIELDS, row))
        where = f"linrope.torch.distributed.halo: rank {rank}"
        if described["dimensions"] != 3 or described["dtype"] < 0:
            raise ValueError(f"{where}: x must be a [B, n_local, C] tensor of torch.float32 or "
                             f"torch.float64")
        if described["rows"] < 0:
            raise ValueError(f"{where}: rows is {described['rows']} but expected >= 0")
        _check_agreement(described, first, _HALO_MUST_AGREE, where)


def halo(x, rows, *, group=None):
    """The `rows` rows of the sequence just before this rank's slice: x [B, n_local, C], this
    rank's contiguous slice of every sequence (rank order = sequence order, any n_local) ->
    [B, rows, C], oldest first, zeros where the sequence starts fewer than `rows` rows before.
    The rows come from the rank before, or from several when their slices are shorter than
    `rows`. Differentiable: the backward sends each row's gradient back to the rank holding it.
    Each rank gathers every rank's last `rows` rows (zeros in front where its slice is shorter)
    and its n_local, and takes the last `rows` real rows before its own slice; see the module's
    docstring for the bytes. MultiheadAttention(short_conv=k) takes its convolution's k - 1 rows
    of q, k and v so when sequence parallel."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    descriptions = _exchange_description(_describe_halo(x, rows), group)
    _check_halo_descriptions(descriptions)
    lengths = [row[_HALO_FIELDS.index("n_local")] for row in descriptions]
    if rows == 0:
        return x[:, :0]
    zeros = x.new_zeros(x.shape[0], rows, x.shape[2])
    tail = torch.cat([zeros, x], 1)[:, -rows:]
    gathered = _Gather.apply(tail, group, _note_exchange(tail, group, world))
    # Every rank's real rows among its tail, in sequence order: the last `rows` rows before a
    # rank's slice are the last `rows` of those before it, since no rank gives more than `rows`.
    real = [min(rows, n) for n in lengths]
    ordered = torch.cat([zeros] + [gathered[p, :, rows - real[p]:] for p in range(world)], 1)
    start = sum(real[:rank])
    return ordered[:, start:start + rows]
