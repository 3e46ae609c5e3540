"""What a variant is: one record (Variant) per attention variant the trainer can train, its name,
and the catalogue (CATALOGUE) the plans draw from.

A name is written from a record by Variant.name and read back by from_name, the one place that
reads a name; plans, tables, plots and the report read the record's fields. Names:

    softmax-rope, softmax-nopos    softmax attention, RoPE on q and k or no positions
    <map>-<placement>              linear attention, RoPE placement none, before_map,
                                   numerator_only (RoFormer eq. 19) or full
    <map>-nodenom                  linear attention without a denominator: RoPE on the features
                                   (numerator_only), an RMSNorm per head instead
  then, each only when set, in this order:
    -m<f>x                         FAVOR+ with f x head dim random features (default 2)
    -redraw<k>                     FAVOR+ with a new W every k training steps
    -decay<gamma> or -retnet       linear attention whose state decays by gamma per step, or by
                                   RetNet's gamma_h = 1 - 2^(-5-h) per head h
    -conv<w>                       a causal depthwise convolution of width w (then SiLU) on the
                                   projected q, k and v

<map> is a short name of FEATURE_MAPS: elu (elu+1), favor (FAVOR+), cos (1+cos)."""
import dataclasses
import re
from typing import NamedTuple, Optional, Union


class MapNames(NamedTuple):
    short: str   # in variant names
    label: str   # in the report's sentences and the plots' titles


# linrope's feature-map kind -> its names here: the one table of them.
FEATURE_MAPS = {"elu+1": MapNames("elu", "elu+1"), "favor+": MapNames("favor", "FAVOR+"),
                "1+cos": MapNames("cos", "1+cos")}
PLACEMENTS = ("none", "before_map", "numerator_only", "full")
DEFAULT_FEATURE_FACTOR = 2


@dataclasses.dataclass(frozen=True)
class Variant:
    """One attention variant of the decoder (model.Decoder builds its layers from it).

    attention        "softmax" or "linear"
    feature_map      linear: a key of FEATURE_MAPS (linrope's kind); None for softmax
    placement        linear: where RoPE goes, one of PLACEMENTS; None for softmax
    rope             softmax: RoPE on q and k; linear: placement != "none" (set from it)
    denominator      linear: False for the numerator alone with an RMSNorm per head (placement
                     numerator_only: without a denominator it equals full)
    feature_factor   FAVOR+: m = feature_factor x head dim random features
    redraw_interval  FAVOR+: a new W every k training steps (0: never)
    decay            linear: None, a gamma in (0, 1) (the state times gamma per step), or
                     "retnet" (RetNet's gamma per head)
    short_conv       the width of a causal depthwise convolution on q, k and v (0: none)

    Raises ValueError, naming the field, for a combination the layer cannot build or a name
    could not say."""
    attention: str
    feature_map: Optional[str] = None
    placement: Optional[str] = None
    rope: bool = True
    denominator: bool = True
    feature_factor: int = DEFAULT_FEATURE_FACTOR
    redraw_interval: int = 0
    decay: Union[None, float, str] = None
    short_conv: int = 0

    def __post_init__(self):
        if self.attention == "linear":
            object.__setattr__(self, "rope", self.placement != "none")
        for problem in _problems(self):
            raise ValueError("Variant: %s (%r)" % (problem, self))

    @property
    def linear(self):
        return self.attention == "linear"

    @property
    def base(self):
        """The variant without its decay and short convolution: the one whose learning rate a
        variant with them takes when it has no grid of its own (plans.chosen_lr)."""
        return self.replace(decay=None, short_conv=0)

    @property
    def extras(self):
        """Whether the variant adds a decay or a short convolution to its base."""
        return self != self.base

    @property
    def name(self):
        """The variant's name (the module's docstring); from_name reads it back."""
        if self.linear:
            parts = [FEATURE_MAPS[self.feature_map].short,
                     self.placement if self.denominator else "nodenom"]
        else:
            parts = ["softmax", "rope" if self.rope else "nopos"]
        if self.feature_factor != DEFAULT_FEATURE_FACTOR:
            parts.append("m%dx" % self.feature_factor)
        if self.redraw_interval:
            parts.append("redraw%d" % self.redraw_interval)
        if self.decay == "retnet":
            parts.append("retnet")
        elif self.decay is not None:
            parts.append("decay%r" % self.decay)  # repr: the shortest text that reads back exact
        if self.short_conv:
            parts.append("conv%d" % self.short_conv)
        return "-".join(parts)

    def describe(self):
        """In words, for --list-variants, tables and legends: 'favor+, numerator_only'."""
        if not self.linear:
            text = "softmax, " + ("RoPE" if self.rope else "no positions")
        elif not self.denominator:
            text = "%s, no denominator (RoPE on the features, RMSNorm per head)" % self.feature_map
        else:
            text = "%s, %s" % (self.feature_map, self.placement)
        return text + self.describe_extras()

    def describe_extras(self):
        """What the variant adds to its catalogue variant, in words (', RetNet's decay'), or ''."""
        text = ""
        if self.feature_factor != DEFAULT_FEATURE_FACTOR:
            text += ", m = %d x head dim" % self.feature_factor
        if self.redraw_interval:
            text += ", W redrawn every %d steps" % self.redraw_interval
        if self.decay == "retnet":
            text += ", RetNet's decay"
        elif self.decay is not None:
            text += ", decay %r" % self.decay
        if self.short_conv:
            text += ", short convolution %d" % self.short_conv
        return text

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _problems(v):
    """What is wrong with v, if anything (the first problem is raised)."""
    if v.attention not in ("softmax", "linear"):
        yield "attention is %r but expected softmax or linear" % (v.attention,)
    elif v.linear:
        if v.feature_map not in FEATURE_MAPS:
            yield "feature_map is %r but expected one of %s" % (v.feature_map,
                                                                ", ".join(FEATURE_MAPS))
        if v.placement not in PLACEMENTS:
            yield "placement is %r but expected one of %s" % (v.placement, ", ".join(PLACEMENTS))
        if not v.denominator and v.placement != "numerator_only":
            yield ("denominator=False takes placement numerator_only (RoPE on the features), "
                   "not %r" % (v.placement,))
    elif v.feature_map is not None or v.placement is not None or not v.denominator:
        yield "softmax attention has no feature_map, placement or denominator option"
    random_features = v.feature_map == "favor+"
    if not isinstance(v.feature_factor, int) or v.feature_factor < 1 or (
            v.feature_factor != DEFAULT_FEATURE_FACTOR and not random_features):
        yield ("feature_factor is %r but expected an integer >= 1, and %d for maps other than "
               "FAVOR+ (their m is fixed by the head dim)" % (
                   v.feature_factor, DEFAULT_FEATURE_FACTOR))
    if not isinstance(v.redraw_interval, int) or v.redraw_interval < 0 or (
            v.redraw_interval and not random_features):
        yield ("redraw_interval is %r but expected an integer >= 0, and 0 for maps other than "
               "FAVOR+ (they have no W to redraw)" % (v.redraw_interval,))
    if v.decay is not None:
        if not v.linear:
            yield "decay applies to linear attention (a state to decay), not softmax"
        elif v.decay != "retnet" and not (isinstance(v.decay, float) and 0 < v.decay < 1):
            yield "decay is %r but expected None, \"retnet\" or a float in (0, 1)" % (v.decay,)
    if not isinstance(v.short_conv, int) or v.short_conv < 0:
        yield "short_conv is %r but expected an integer >= 0 (0: none)" % (v.short_conv,)


_NAME = re.compile(r"(?P<map>[a-z]+)-(?P<kind>[a-z_]+)(?:-m(?P<factor>\d+)x)?"
                   r"(?:-redraw(?P<redraw>\d+))?"
                   r"(?:-decay(?P<gamma>[0-9.e+-]+?)|-(?P<retnet>retnet))?(?:-conv(?P<conv>\d+))?")
_SHORT = {names.short: kind for kind, names in FEATURE_MAPS.items()}


def from_name(name):
    """The Variant whose name is `name` (exactly: from_name(n).name == n). ValueError otherwise,
    saying what names look like."""
    match = _NAME.fullmatch(name)
    try:
        if match is None:
            raise ValueError("not of the form <map>-<placement>[-m<f>x][-redraw<k>]"
                             "[-decay<gamma>|-retnet][-conv<w>]")
        fields = dict(feature_factor=int(match["factor"] or DEFAULT_FEATURE_FACTOR),
                      redraw_interval=int(match["redraw"] or 0),
                      decay="retnet" if match["retnet"] else (
                          float(match["gamma"]) if match["gamma"] else None),
                      short_conv=int(match["conv"] or 0))
        if match["map"] == "softmax" and match["kind"] in ("rope", "nopos"):
            variant = Variant("softmax", rope=match["kind"] == "rope", **fields)
        elif match["map"] in _SHORT:
            denominator = match["kind"] != "nodenom"
            variant = Variant("linear", _SHORT[match["map"]],
                              match["kind"] if denominator else "numerator_only",
                              denominator=denominator, **fields)
        else:
            raise ValueError("it starts with neither softmax-rope, softmax-nopos nor a map's "
                             "short name (%s) and a placement" % ", ".join(_SHORT))
        if variant.name != name:
            raise ValueError("its record's name is %s" % variant.name)
    except ValueError as e:
        raise ValueError("unknown variant %r: %s; the catalogue's: %s" % (
            name, e, ", ".join(v.name for v in CATALOGUE))) from None
    return variant


def _catalogue():
    table = [Variant("softmax"), Variant("softmax", rope=False)]
    for kind in ("elu+1", "favor+"):
        table += [Variant("linear", kind, placement) for placement in PLACEMENTS]
    table += [Variant("linear", "1+cos", placement) for placement in ("numerator_only", "full")]
    table += [Variant("linear", kind, "numerator_only", denominator=False)
              for kind in ("elu+1", "favor+")]
    return tuple(table)


# The variants of the study, in the order of its tables: softmax with and without RoPE; elu+1
# and FAVOR+ at every placement; 1+cos with RoPE on its features; elu+1 and FAVOR+ without a
# denominator. Any other record (more features, redraws, decay, short convolution) is a variant
# too: the plans and --variants take them by name.
CATALOGUE = _catalogue()
SOFTMAX_ROPE = Variant("softmax")


def in_catalogue_order(variants):
    """variants sorted as the study's tables list them: by their catalogue variant (the record
    without its extras), then by the extras."""
    def key(v):
        base = v.replace(feature_factor=DEFAULT_FEATURE_FACTOR, redraw_interval=0, decay=None,
                         short_conv=0)
        return (CATALOGUE.index(base) if base in CATALOGUE else len(CATALOGUE), v.feature_factor,
                v.redraw_interval, str(v.decay), v.short_conv)
    return sorted(variants, key=key)
