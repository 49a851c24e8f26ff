"""``ropescale.models.loading``: an empty model name is refused as empty, not read as the working folder."""

import pytest

from ropescale.models import ModelLoadError, resolve_model


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused_as_empty(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" was Path(""), the working folder: ": folder has no config.json"
    with pytest.raises(ModelLoadError, match=r"^model name '\s*' is empty; give a bundled name \(reference"):
        resolve_model(name)
