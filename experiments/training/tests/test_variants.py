"""training.variants: a variant is a record; its name is written by Variant.name and read back by
from_name, each the other's inverse, over every variant of every plan and the extras (more
features, redraws, decay, short convolution); bad records and names are refused, naming what is
wrong; the layer built from a record has the record's options."""
import pytest

from training import plans
from training.model import Decoder, attention_arguments
from training.variants import (CATALOGUE, FEATURE_MAPS, Variant, from_name,
                               in_catalogue_order)


def every_planned_variant():
    """Every variant some stage of some mode trains, as the plans make them."""
    found = {}
    for mode in plans.MODES:
        plan = plans.Plan(mode)
        for v in list(plan.all_variants()) + [c.variant for c in plan.preview()]:
            found[v.name] = v
    return list(found.values())


EXTRAS = [from_name("favor-numerator_only").replace(feature_factor=4, redraw_interval=100),
          Variant("linear", "elu+1", "full", decay=0.9),
          Variant("linear", "favor+", "numerator_only", denominator=False, decay="retnet",
                  short_conv=4),
          Variant("linear", "1+cos", "before_map", decay=1e-05),  # "1e-05": a '-' in the name
          Variant("softmax", short_conv=3), Variant("softmax", rope=False)]


@pytest.mark.parametrize("variant", every_planned_variant() + list(CATALOGUE) + EXTRAS,
                         ids=lambda v: v.name)
def test_the_name_reads_back_as_the_record(variant):
    assert from_name(variant.name) == variant
    assert from_name(variant.name).name == variant.name


def test_the_names_say_what_the_fields_are():
    """The names of the study (the committed tables and plots use them) and their extras."""
    assert [v.name for v in CATALOGUE] == [
        "softmax-rope", "softmax-nopos", "elu-none", "elu-before_map", "elu-numerator_only",
        "elu-full", "favor-none", "favor-before_map", "favor-numerator_only", "favor-full",
        "cos-numerator_only", "cos-full", "elu-nodenom", "favor-nodenom"]
    assert [v.name for v in EXTRAS] == [
        "favor-numerator_only-m4x-redraw100", "elu-full-decay0.9", "favor-nodenom-retnet-conv4",
        "cos-before_map-decay1e-05", "softmax-rope-conv3", "softmax-nopos"]
    assert from_name("elu-none").rope is False and from_name("elu-full").rope is True
    assert [names.short for names in FEATURE_MAPS.values()] == ["elu", "favor", "cos"]


@pytest.mark.parametrize("name, message", [
    ("softmax-alibi", "starts with neither"),
    ("favor", "not of the form"),
    ("elu-full-m2x", "its record's name is elu-full"),           # the default is not written
    ("favor-full-decay0.90", "its record's name is favor-full-decay0.9"),
    ("favor-full-conv4-m4x", "not of the form"),                 # parts in their order only
    ("elu-full-m4x", "feature_factor is 4"),
    ("cos-full-redraw10", "redraw_interval is 10"),
    ("softmax-rope-retnet", "decay applies to linear attention"),
    ("elu-full-decay1.0", "decay is 1.0"),
    ("elu-sideways", "placement is 'sideways'")])
def test_bad_names_are_refused_saying_why(name, message):
    with pytest.raises(ValueError) as refused:
        from_name(name)
    assert str(refused.value).startswith("unknown variant %r: " % name)
    assert message in str(refused.value)


@pytest.mark.parametrize("fields, message", [
    (dict(attention="recurrent"), "attention is 'recurrent'"),
    (dict(attention="linear", feature_map="relu", placement="full"), "feature_map is 'relu'"),
    (dict(attention="linear", feature_map="elu+1", placement="full", denominator=False),
     "denominator=False takes placement numerator_only"),
    (dict(attention="softmax", placement="full"), "softmax attention has no"),
    (dict(attention="linear", feature_map="favor+", placement="full", feature_factor=0),
     "feature_factor is 0"),
    (dict(attention="linear", feature_map="favor+", placement="full", decay=0.0), "decay is 0.0"),
    (dict(attention="softmax", short_conv=-1), "short_conv is -1")])
def test_bad_records_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match="^Variant: ") as refused:
        Variant(**fields)
    assert message in str(refused.value)


def test_the_decoder_builds_its_layers_from_the_record():
    """The attention layers get the record's options: FAVOR+'s m = feature_factor x head dim,
    the placement, the denominator, the redraw interval (decay and short convolution are passed
    only when set: the layer's options for them arrive with linrope's decay)."""
    model = Decoder(40, from_name("favor-numerator_only-m4x-redraw3"), 16, 2, 2, seed=0)
    for block in model.blocks:
        layer = block.attention
        assert (layer.attention, layer.placement, layer.denominator, layer.redraw_interval) == (
            "linear", "numerator_only", True, 3)
        assert layer.feature_map.output_dim == 4 * 8
    softmax = Decoder(40, from_name("softmax-nopos"), 16, 1, 2, seed=0).blocks[0].attention
    assert softmax.attention == "softmax" and softmax.rope is None
    nodenom = Decoder(40, from_name("elu-nodenom"), 16, 1, 2, seed=0).blocks[0].attention
    assert nodenom.denominator is False and nodenom.placement == "numerator_only"


def test_decay_and_short_convolution_reach_the_layer_only_when_set():
    """The layer's arguments carry decay and short_conv exactly when the record sets them (the
    layer's options for them are linrope's decay work: until then the catalogue never asks)."""
    for variant in CATALOGUE:
        assert not {"decay", "short_conv"} & set(attention_arguments(variant, 16, 2))
    args = attention_arguments(from_name("elu-nodenom-decay0.9-conv4"), 16, 2)
    assert (args["decay"], args["short_conv"]) == (0.9, 4)
    assert attention_arguments(from_name("softmax-rope-conv3"), 16, 2)["short_conv"] == 3
    assert attention_arguments(from_name("favor-full-retnet"), 16, 2)["decay"] == "retnet"


def test_favor_layers_keep_their_features_and_train_the_same_bits():
    """FAVOR+ layers keep each forward's features for the backward (save_features), the other
    maps' do not; and a step's gradients are the same bits either way."""
    import torch
    for variant in CATALOGUE:
        if variant.linear:
            expected = variant.feature_map == "favor+"
            assert attention_arguments(variant, 16, 2)["save_features"] is expected
    tokens = torch.randint(0, 40, (2, 33), generator=torch.Generator().manual_seed(1))
    # eq. 19 keeps rotated numerator and plain denominator features; full, the plain ones only
    for name in ("favor-numerator_only", "favor-full"):
        gradients = []
        for save in (True, False):
            model = Decoder(40, from_name(name), 16, 2, 2, seed=0)
            for block in model.blocks:
                assert block.attention.save_features
                block.attention.save_features = save
            model(tokens[:, :-1]).logsumexp(-1).sum().backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*gradients)), name


def test_tables_list_variants_in_catalogue_order():
    """By the catalogue variant under the extras, then the extras: the committed study's tables
    keep their row order whatever order the runs were trained in."""
    names = ["favor-nodenom", "favor-numerator_only-m4x", "elu-full-conv4", "softmax-rope",
             "favor-numerator_only", "cos-none", "elu-full"]
    assert [v.name for v in in_catalogue_order(map(from_name, names))] == [
        "softmax-rope", "elu-full", "elu-full-conv4", "favor-numerator_only",
        "favor-numerator_only-m4x", "favor-nodenom", "cos-none"]
