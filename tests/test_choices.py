"""The allowed names of the choice params, and the one auto|true|false type."""

import pytest

from pipeline.choices import BnMode, Switch
from pipeline.config import ParamsError, from_dict


def test_choice__a_member_equals_its_name():
    assert BnMode.split == "split" and str(BnMode.split) == "split" and f"{BnMode.split}" == "split"
    assert BnMode.names() == ("split", "shuffle", "sync", "none")


@pytest.mark.parametrize(("value", "auto", "on"), [
    ("auto", True, True), ("auto", False, False), ("true", False, True), (True, False, True),
    ("false", True, False), (False, True, False), (Switch.auto, True, True)])
def test_switch__parse_and_resolve(value, auto, on):
    assert Switch.parse(value, "k").on(auto=auto) is on


def test_switch__parse_names_the_key_of_an_unknown_value():
    with pytest.raises(ValueError, match="pretrain.compile must be one of auto, true, false"):
        Switch.parse("yes", "pretrain.compile")


@pytest.mark.parametrize("key", ["model.small_stem", "pretrain.channels_last", "pretrain.compile"])
def test_switch__params_take_auto_or_a_yaml_boolean(key):
    section, name = key.split(".")
    for value, want in (("auto", "auto"), (True, "true"), (False, "false")):
        tree = {section: {name: value}, "embed": {"pool_grid": 1}}  # ImageNet stem: 1 x 1 maps
        got = getattr(getattr(from_dict(tree), section), name)
        assert got is Switch(want)
    for value in ("true", "False", "Auto", "yes", 1, None):  # one value, one spelling
        with pytest.raises(ParamsError) as e:
            from_dict({section: {name: value}})
        assert e.value.key == key and "allowed: auto, or true or false" in str(e.value)
