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
