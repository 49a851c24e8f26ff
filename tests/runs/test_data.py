import json

import pytest

from ropescale.runs.data import DataError, DataSpec, load_documents, tokenize_documents


def test_kjv_heldout_is_seven_books_disjoint_from_train():
    held = load_documents(DataSpec("kjv-heldout"))
    train = load_documents(DataSpec("kjv-train"))
    assert len(held) == 7 and len(train) == 59
    assert not set(held) & set(train)
    assert held[0].startswith("Now it came to pass in the days when the judges ruled")  # Ruth 1:1


def test_local_sources_keep_documents_separate(tmp_path):
    (tmp_path / "a.txt").write_text("first doc")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second doc")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    assert load_documents(DataSpec(str(tmp_path))) == ["first doc", "second doc"]
    assert load_documents(DataSpec(str(tmp_path / "a.txt"))) == ["first doc"]
    rows = [{"text": "row one", "id": 1}, {"text": "", "id": 2}, {"text": "row three", "id": 3}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_documents(DataSpec(str(tmp_path / "d.jsonl"))) == ["row one", "row three"]
    assert load_documents(DataSpec(str(tmp_path / "d.jsonl"), max_documents=1)) == ["row one"]


def test_parquet_and_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x y", "z"]}), tmp_path / "d.parquet")
    assert load_documents(DataSpec(str(tmp_path / "d.parquet"), text_column="body")) == ["x y", "z"]
    with pytest.raises(DataError, match="no column 'text'; columns: body"):
        load_documents(DataSpec(str(tmp_path / "d.parquet")))


def test_unreadable_sources_are_clear(tmp_path):
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(DataError, match="cannot read .pdf"):
        load_documents(DataSpec(str(tmp_path / "x.pdf")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.txt"):
        load_documents(DataSpec(str(tmp_path / "empty")))
    with pytest.raises(DataError, match="not a bundled name"):  # hub id, but offline
        load_documents(DataSpec("no-such-user/no-such-dataset"))


def test_tokenize_once_without_special_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenize_documents(tok, ["In the beginning", "God"])
    assert [t.tolist() for t in ids] == [tok("In the beginning", add_special_tokens=False)["input_ids"],
                                         tok("God", add_special_tokens=False)["input_ids"]]
    assert tok.bos_token_id not in ids[0].tolist()


def test_a_jsonl_file_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text("this is plain text\nnot json at all\n")
    with pytest.raises(DataError, match=r"d.jsonl: not a readable JSON lines file") as e:
        load_documents(DataSpec(str(tmp_path / "d.jsonl")))
    assert "\n" not in str(e.value) and e.value.__cause__ is None


@pytest.mark.parametrize("where", ["u16.txt", "."])
def test_utf16_text_is_refused_naming_the_file(tmp_path, where):
    (tmp_path / "u16.txt").write_text("In the beginning God created the heaven", encoding="utf-16")
    with pytest.raises(DataError, match=r"u16.txt: the text has NUL characters.*UTF-16.*iconv"):
        load_documents(DataSpec(str(tmp_path / where)))


def test_join_reads_the_documents_as_one_text_in_order(tmp_path):
    """``data.join``: one document, the others in their order, separated by a blank line (windows longer
    than any one book); named apart, so its runs are other experiments; off, nothing changes."""
    from ropescale.runs.config import DataConfig

    books = load_documents(DataSpec("kjv-heldout"))
    joined = load_documents(DataConfig(source="kjv-heldout", join=True).spec())
    assert joined == [books[0] + "\n\n" + "\n\n".join(books[1:])]
    assert len(joined[0]) == sum(map(len, books)) + 2 * (len(books) - 1)
    assert DataSpec("kjv-heldout", join=True).describe() == "kjv-heldout joined"
    assert DataConfig(source="kjv-heldout").spec().describe() == "kjv-heldout"
    two = load_documents(DataSpec("kjv-heldout", max_documents=2, join=True))
    assert two == [books[0] + "\n\n" + books[1]]
