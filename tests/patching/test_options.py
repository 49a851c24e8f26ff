"""``ropescale.patching.options``: a misspelled patch option is named as the option it is near, not only refused as
a parameter the strategy lacks."""

import pytest
from torch import nn

from ropescale import patch
from ropescale.errors import InvalidInput


@pytest.fixture
def model():
    return nn.Linear(1, 1)  # the keywords are checked before the model is read


def test_a_misspelled_option_is_named_as_the_option_it_is_near(model):
    with pytest.raises(InvalidInput, match=r"^dynamic_ntk has no parameter 'dynamic_cach' and patch has no option "
                                           r"'dynamic_cach' \(did you mean the option 'dynamic_cache'\?\)$"):
        patch(model, "dynamic_ntk", dynamic_cach="rerotate")
    with pytest.raises(InvalidInput, match=r"'atention_path' .*did you mean the option 'attention_path'"):
        patch(model, "dpe", atention_path="naive")


def test_a_misspelled_parameter_still_gets_the_strategys_hint(model):
    with pytest.raises(InvalidInput, match=r"^yarn has no parameter 'factr'; .*\(did you mean 'factor'\?\)$"):
        patch(model, "yarn", factr=2)
    with pytest.raises(InvalidInput, match=r"^yarn has no parameter 'zzz'; its parameters: "):
        patch(model, "yarn", factor=2, zzz=1)


@pytest.mark.parametrize(("options", "match"), [
    # a string was read as its characters: "layer_types ['f', 'u', 'l', ...] not in this model's rotary module"
    ({"layer_types": "full_attention"}, r"^layer_types='full_attention' must be a non-empty list of layer type names"),
    # an empty list patched no layer at all, without a word
    ({"layer_types": []}, r"^layer_types=\[\] must be a non-empty list"),
    ({"layer_types": [1]}, r"^layer_types=\[1\] must be a non-empty list"),
    ({"dynamic_block": True}, r"^dynamic_block=True must be a whole number >= 1$"),
    ({"block_size": True}, r"^block_size=True must be a whole number >= 1$"),
])
def test_options_of_the_wrong_type_are_refused(options, match):
    from ropescale.patching.options import PatchOptions

    with pytest.raises(InvalidInput, match=match):
        PatchOptions(**options).check()
