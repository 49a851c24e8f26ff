import pytest

from ropescale.reference import kjv


def test_split_by_book_matches_the_recipe():
    held, train = kjv.split("heldout"), kjv.split("train")
    assert [name for name, _ in held] == ["Ruth", "Esther", "Ezekiel", "Habakkuk", "Acts",
                                          "2 Thessalonians", "1 John"]
    assert len(train) == 59 and not {n for n, _ in held} & {n for n, _ in train}
    genesis = train[0][1]
    assert genesis.startswith("In the beginning God created the heaven and the earth.\nAnd the earth")
    assert "Genesis" not in genesis[:100] and " 2 " not in genesis[:200]  # no headings, no verse numbers
    assert held[0][1].endswith("And Obed begat Jesse, and Jesse begat David.")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(kjv.shutil, "which", lambda _: None)
    kjv.books.cache_clear()
    try:
        with pytest.raises(kjv.KjvNotInstalledError, match="apt-get install -y bible-kjv"):
            kjv.books()
    finally:
        monkeypatch.undo()
        kjv.books.cache_clear()


def test_unknown_split():
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        kjv.split("test")
