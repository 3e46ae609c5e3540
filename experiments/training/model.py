"""The model every variant shares: a small pre-norm decoder (token embedding, RMSNorm, causal
multi-head attention from linrope.torch, GELU MLP, an output layer of its own), with no position
information but what the attention variant brings (RoPE or none)."""
import contextlib
import math

import torch
from torch import nn

from linrope.torch import GELU, Linear, MultiheadAttention, RMSNorm


def attention_arguments(variant, d_model, heads, seed=0, stats_threshold=1e-3):
    """The linrope.torch.MultiheadAttention arguments (beyond d_model and heads) of a variant's
    causal layer: a linear one with num_features = feature_factor x head dim (FAVOR+'s m; the
    other maps' m follows the head dim), its denominator statistics tracked, and for FAVOR+ each
    forward's features kept for its backward (save_features: the same gradients, bit for bit,
    without the backward mapping q and k again: 1.05-1.06x the attention's forward + backward at
    the study's shape, bench/RESULTS.md); the decay and the short convolution passed only when the
    variant has them."""
    args = dict(attention=variant.attention, rope=variant.rope)
    if variant.linear:
        args.update(feature_map=variant.feature_map, placement=variant.placement,
                    denominator=variant.denominator,
                    num_features=variant.feature_factor * (d_model // heads), seed=seed,
                    redraw_interval=variant.redraw_interval, track_stats=True,
                    stats_threshold=stats_threshold,
                    save_features=variant.feature_map == "favor+")
    if variant.decay is not None:
        args["decay"] = variant.decay
    if variant.short_conv:
        args["short_conv"] = variant.short_conv
    return args


def sequence_parallel_problem(variant, d_model, heads):
    """None if the variant's attention layer can run sequence parallel, else the layer's reason
    (linrope.torch.MultiheadAttention.sequence_parallel_problem)."""
    layer = MultiheadAttention(d_model, heads, causal=True,
                               **attention_arguments(variant, d_model, heads))
    return layer.sequence_parallel_problem()


def combine_stats(per_layer_lists):
    """Denominator statistics (as Decoder.denominator_stats gives them: per layer a dict, or None
    for softmax) of several batches or shares combined into those of all of them, per layer: the
    smallest minimum and the summed counts."""
    combined = []
    for layer in zip(*per_layer_lists):
        if layer[0] is None:
            combined.append(None)
            continue
        combined.append(dict(min=min(s["min"] for s in layer),
                             **{key: sum(s[key] for s in layer)
                                for key in ("nonpositive", "below_threshold", "count")}))
    return combined


class Block(nn.Module):
    def __init__(self, d_model, heads, attention_args):
        super().__init__()
        self.attention_norm = RMSNorm(d_model)
        self.attention = MultiheadAttention(d_model, heads, causal=True, **attention_args)
        self.mlp_norm = RMSNorm(d_model)
        # linrope.torch.Linear: nn.Linear on linrope's GEMM, 1.4-1.8x PyTorch's OpenBLAS as this
        # machine runs it; these products are most of a step (bench/RESULTS.md, "The study's
        # linear maps on linrope's GEMM"). GELU and RMSNorm are linrope.torch's too: nn.GELU and
        # the norm's PyTorch expression cost a step more than all of attention ("GELU and RMSNorm
        # on linrope's kernels").
        self.mlp = nn.Sequential(Linear(d_model, 4 * d_model), GELU(),
                                 Linear(4 * d_model, d_model))

    def forward(self, x, first_position=0, cache=None, decoding=False):
        """x + attention, + MLP; decoding: through the attention's cache, returning (x, cache)."""
        if not decoding:
            x = x + self.attention(self.attention_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        h, cache = self.attention(self.attention_norm(x), first_position=first_position,
                                  cache=cache, return_cache=True)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nn.Module):
    """vocab_size -> logits, [B, n] token ids -> [B, n, vocab_size].

    The output layer is its own (not the embedding, transposed): with the two tied, softmax + RoPE
    did not learn MQAR (64 tokens, 4 pairs, 1000 steps at lr 1e-3: 0.25 accuracy tied, 0.90
    untied), while a plain PyTorch decoder with an untied output layer did."""

    def __init__(self, vocab_size, variant, d_model, layers, heads, seed, stats_threshold=1e-3):
        """variant: a variants.Variant. Every layer's FAVOR+ W is its own, all fixed by the seed:
        layer l's seed is (1000 seed + l) 10^6, and a redraw adds 1 to it, so that the layers'
        seeds never meet."""
        super().__init__()
        torch.manual_seed(seed)
        self.variant = variant
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, attention_arguments(variant, d_model, heads,
                                                      (1000 * seed + layer) * 1_000_000,
                                                      stats_threshold))
            for layer in range(layers))
        self.final_norm = RMSNorm(d_model)
        self.output = Linear(d_model, vocab_size, bias=False)
        self._initialise(layers)

    def _initialise(self, layers):
        # GPT-2's: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 layers).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                residual = name.endswith("out_proj.weight") or name.endswith("mlp.2.weight")
                nn.init.normal_(p, 0.0, 0.02 / (math.sqrt(2 * layers) if residual else 1.0))

    def forward(self, tokens, at=None):
        """The logits [B, n, vocab_size], or with `at` (a boolean [B, n]) those of the positions
        it marks only, [at.sum(), vocab_size]: MQAR scores a few positions of a sequence (16 of
        256), and the output layer's product and the loss's softmax at every other one were up
        to 40% of its training step (bench/RESULTS.md, "The study's training step")."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        if at is not None:
            x = x[at]
        return self.output(self.final_norm(x))

    def decode(self, tokens, first_position=0, caches=None):
        """The logits of tokens [B, t] that continue a sequence of first_position tokens whose
        per-layer caches are `caches` (None: the start), and the caches after them: (logits,
        caches). A linear layer's cache is its attention state, of one size whatever the position
        (O(1) memory and time per token); a softmax layer's its keys and values, a row per token.
        Token by token, the logits are those of forward() on the whole sequence, to rounding."""
        x = self.embedding(tokens)
        caches = caches if caches is not None else [None] * len(self.blocks)
        after = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, first_position, cache, decoding=True)
            after.append(cache)
        return self.output(self.final_norm(x)), after

    def sequence_parallel(self, group=None):
        """Every attention layer sequence parallel over group (None: the whole world): each
        process then holds a contiguous slice of every sequence, and the layers exchange their
        states (parallel.py). ValueError with the layer's reason if it cannot."""
        problem = self.blocks[0].attention.sequence_parallel_problem()
        if problem is not None:
            raise ValueError("sequence parallelism: %s" % problem)
        for block in self.blocks:
            block.attention.sequence_parallel, block.attention.sequence_group = True, group

    @contextlib.contextmanager
    def alone(self):
        """Sequence parallelism off inside, restored after: for one process computing whole
        sequences by itself (rank 0 evaluating), which would otherwise wait in the layers'
        collectives for ranks that never join them."""
        saved = [(b.attention.sequence_parallel, b.attention.sequence_group) for b in self.blocks]
        for block in self.blocks:
            block.attention.sequence_parallel, block.attention.sequence_group = False, None
        try:
            yield self
        finally:
            for block, (on, group) in zip(self.blocks, saved):
                block.attention.sequence_parallel, block.attention.sequence_group = on, group

    def denominator_stats(self):
        """Per layer, the last forward's denominator statistics (None for softmax)."""
        return [block.attention.last_stats for block in self.blocks]
