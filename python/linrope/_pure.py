"""What `import linrope` offers where its C++ module is not built (a machine without Eigen, say a
GPU node with PyTorch alone): Rope, FeatureMap, the options structs and NonFiniteError, in pure
Python and NumPy, so that linrope.torch runs there on its native path (docs/DESIGN.md, "Any
device"). The NumPy functions and the C++ kernels are absent.

Each mirrors its C++ twin: Rope's frequencies and magnitude by the formulas of
include/linrope/rope.hpp (the same libm calls, so the same bits); FeatureMap's W by
include/linrope/random.hpp's stream (xoshiro256** seeded through splitmix64, Box-Muller) and
src/feature_maps/projection.cpp's blocks, with NumPy's QR for Eigen's (Q with the signs of R's
diagonal folded in is unique, so the two W agree to rounding, ~1e-15); the structs' defaults are
the C++ headers' (python/tests/test_native_pure.py checks all three against the C++ module where
it is built).
"""
import math
import re
from pathlib import Path

import numpy as np

__all__ = ["DenominatorStats", "FeatureMap", "FeatureMapConfig", "LinearOptions",
           "NonFiniteError", "Rope", "RopeConfig", "SoftmaxOptions", "version"]


class NonFiniteError(ValueError):
    """Input data holding NaN or inf."""


def version():
    """The project's version from CMakeLists.txt beside the source tree, else "unknown"."""
    cmake = Path(__file__).resolve().parents[2] / "CMakeLists.txt"
    found = cmake.is_file() and re.search(r"project\(\s*linrope\s+VERSION\s+([0-9.]+)",
                                          cmake.read_text())
    return found.group(1) if found else "unknown"


class _Struct:
    """A record with the fields and defaults of `_fields` (name, default), as the bound C++
    structs are."""
    _fields = ()

    def __init__(self):
        for name, default in self._fields:
            setattr(self, name, default)

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__,
                           ", ".join("%s=%r" % (n, getattr(self, n)) for n, _ in self._fields))


class SoftmaxOptions(_Struct):
    _fields = (("causal", False), ("scale", 0.0), ("q_offset", 0), ("k_offset", 0),
               ("block_size", 0))


class LinearOptions(_Struct):
    _fields = (("causal", False), ("placement", "numerator_only"), ("eps", 1e-06),
               ("q_offset", 0), ("k_offset", 0), ("method", "scan"), ("chunk_size", 64),
               ("denominator", True), ("decay", 1.0))


class DenominatorStats(_Struct):
    _fields = (("min", 0.0), ("nonpositive", 0), ("below_threshold", 0), ("threshold", 0.001),
               ("count", 0), ("no_keys", 0), ("zero_divisor", 0))


class RopeConfig(_Struct):
    _fields = (("dim", 0), ("rotary_dim", 0), ("base", 10000.0), ("layout", "interleaved"),
               ("scaling", "none"), ("factor", 1.0), ("original_max_position", 0),
               ("beta_fast", 32.0), ("beta_slow", 1.0))


class FeatureMapConfig(_Struct):
    _fields = (("kind", "elu+1"), ("input_dim", 0), ("num_features", 0), ("orthogonal", True),
               ("seed", 0), ("regularized", False))


_ROPE, _MAP = RopeConfig(), FeatureMapConfig()
_LAYOUTS = ("interleaved", "half")
_SCALINGS = ("none", "linear", "ntk", "yarn")
_KINDS = ("elu+1", "relu", "favor+", "favor-trig", "1+cos", "favor-hyp")


class Rope:
    """RoPE's description (include/linrope/rope.hpp): its configuration, frequencies() and
    magnitude. The rotation itself is linrope.torch's (rope_apply)."""

    def __init__(self, dim, rotary_dim=_ROPE.rotary_dim, base=_ROPE.base, layout=_ROPE.layout,
                 scaling=_ROPE.scaling, factor=_ROPE.factor,
                 original_max_position=_ROPE.original_max_position, beta_fast=_ROPE.beta_fast,
                 beta_slow=_ROPE.beta_slow):
        r = rotary_dim or dim
        problem = (
            f"dim is {dim} but expected dim >= 1" if dim < 1 else
            f"rotary_dim is {r} but expected an even number >= 2" if r < 2 or r % 2 else
            f"rotary_dim is {r} but expected rotary_dim <= dim = {dim}" if r > dim else
            f"layout is {layout!r} but expected one of {', '.join(_LAYOUTS)}"
            if layout not in _LAYOUTS else
            f"scaling is {scaling!r} but expected one of {', '.join(_SCALINGS)}"
            if scaling not in _SCALINGS else
            f"base is {base} but expected a finite base > 0"
            if not (math.isfinite(base) and base > 0) else
            f"scaling.factor is {factor} but expected a finite factor > 0"
            if scaling != "none" and not (math.isfinite(factor) and factor > 0) else
            f"rotary_dim is {r} but Ntk scaling needs rotary_dim > 2"
            if scaling == "ntk" and r <= 2 else
            f"scaling.original_max_position is {original_max_position} but Yarn needs "
            f"original_max_position > 0" if scaling == "yarn" and original_max_position <= 0 else
            f"scaling.beta_fast is {beta_fast} and beta_slow is {beta_slow} but Yarn needs "
            f"finite beta_fast > beta_slow" if scaling == "yarn" and not beta_fast > beta_slow
            else None)
        if problem:
            raise ValueError("Rope: " + problem)
        self.dim, self.rotary_dim, self.base, self.layout = dim, r, base, layout
        self.scaling, self.factor = scaling, factor
        self._config = (dim, rotary_dim, base, layout, scaling, factor, original_max_position,
                        beta_fast, beta_slow)
        if scaling == "ntk":
            base *= math.pow(factor, r / (r - 2))
        theta = [math.pow(base, -2.0 * i / r) for i in range(r // 2)]
        self.magnitude = 1.0
        if scaling == "linear":
            theta = [t / factor for t in theta]
        elif scaling == "yarn":
            def ramp(t):
                turns = original_max_position * t / (2 * math.pi)
                gamma = min(max((turns - beta_slow) / (beta_fast - beta_slow), 0.0), 1.0)
                return (1 - gamma) * t / factor + gamma * t
            theta = [ramp(t) for t in theta]
            if factor > 1:
                self.magnitude = 0.1 * math.log(factor) + 1.0
        self._theta = np.array(theta, dtype=np.float64)

    def frequencies(self):
        return self._theta.copy()

    def __reduce__(self):
        return Rope, self._config


class _Random:
    """include/linrope/random.hpp: xoshiro256** seeded through splitmix64, Box-Muller."""
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        s, self.state = seed & self.MASK, []
        for _ in range(4):
            s = (s + 0x9E3779B97F4A7C15) & self.MASK
            z = s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
            self.state.append(z ^ (z >> 31))
        self.spare = None

    @classmethod
    def _rotl(cls, x, k):
        return ((x << k) | (x >> (64 - k))) & cls.MASK

    def next(self):
        s = self.state
        result = (self._rotl((s[1] * 5) & self.MASK, 7) * 9) & self.MASK
        t = (s[1] << 17) & self.MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self._rotl(s[3], 45)
        return result

    def gaussian(self):
        if self.spare is not None:
            spare, self.spare = self.spare, None
            return spare
        u1 = float((self.next() >> 11) + 1) * 2.0 ** -53
        u2 = float(self.next() >> 11) * 2.0 ** -53
        radius = math.sqrt(-2.0 * math.log(u1))
        angle = (2.0 * math.pi) * u2
        self.spare = radius * math.sin(angle)
        return radius * math.cos(angle)


def orthogonal_draws(d, f, regularized, seed):
    """For each block of an orthogonal W, in the order drawn: the Gaussian d x d matrix G whose QR
    gives the block's rows, and the rows' norms (sqrt(d) when regularized)."""
    random = _Random(seed)
    for first in range(0, f, d):
        g = np.array([[random.gaussian() for _ in range(d)] for _ in range(d)])
        rows = min(d, f - first)
        norms = [math.sqrt(d) if regularized else
                 math.sqrt(sum(z * z for z in (random.gaussian() for _ in range(d))))
                 for _ in range(rows)]
        yield g, norms


def _projection(d, f, orthogonal, regularized, seed):
    """src/feature_maps/projection.cpp's W [f x d]."""
    if not orthogonal:
        random = _Random(seed)
        return np.array([[random.gaussian() for _ in range(d)] for _ in range(f)])
    blocks = []
    for g, norms in orthogonal_draws(d, f, regularized, seed):
        q, r = np.linalg.qr(g)
        q = q * np.where(np.diag(r) < 0, -1.0, 1.0)[None, :]  # Haar: R's signs folded into Q
        blocks.append(q[:len(norms)] * np.array(norms)[:, None])
    return np.concatenate(blocks) if blocks else np.empty((0, d))


class FeatureMap:
    """A feature map's description (include/linrope/feature_maps.hpp): kind, widths, seed and
    its W (projection, for the favor maps). The map itself is linrope.torch's
    (feature_map_apply)."""

    def __init__(self, kind, input_dim, num_features=_MAP.num_features,
                 orthogonal=_MAP.orthogonal, seed=_MAP.seed, regularized=_MAP.regularized):
        if kind not in _KINDS:
            raise ValueError(f"FeatureMap: feature map is {kind!r} but expected one of "
                             f"{', '.join(_KINDS)}")
        if input_dim < 1:
            raise ValueError(f"FeatureMap: input_dim is {input_dim} but expected >= 1")
        if kind.startswith("favor") and num_features < 1:
            raise ValueError(f"FeatureMap: num_features is {num_features} but the {kind} map "
                             f"needs >= 1")
        self.kind, self.input_dim, self.num_features = kind, input_dim, num_features
        self.orthogonal, self.regularized = orthogonal, regularized
        self.nonnegative = kind != "favor-trig"
        self.output_dim = {"1+cos": input_dim + 1, "favor+": num_features,
                           "favor-trig": 2 * num_features,
                           "favor-hyp": 2 * num_features}.get(kind, input_dim)
        self.redraw(seed)

    def redraw(self, seed):
        self.seed = seed
        self._w = (_projection(self.input_dim, self.num_features, self.orthogonal,
                               self.regularized, seed) if self.kind.startswith("favor")
                   else np.empty((0, 0)))

    @property
    def projection(self):
        return self._w.copy()

    def __getstate__(self):
        return (self.kind, self.input_dim, self.num_features, self.orthogonal, self.seed,
                self.regularized)

    def __setstate__(self, state):
        self.__init__(*state)
