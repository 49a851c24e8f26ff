from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ropescale.runs.windows import Window, WindowError, cap_windows, chunk_windows, make_windows, sliding_windows


def test_chunk_gold():
    assert chunk_windows([10, 3, 8], 4) == [
        Window(0, 0, 4, 1), Window(0, 4, 8, 5), Window(2, 0, 4, 1), Window(2, 4, 8, 5)]


def test_chunk_gold_with_bos():
    # BOS takes one slot: 3 document tokens per window, the first one scored too
    assert chunk_windows([7], 4, bos=True) == [Window(0, 0, 3, 0), Window(0, 3, 6, 3)]


def test_sliding_gold_hf_guide():
    # window 4, stride 2 over 9 tokens: each new window scores only the new tokens
    assert sliding_windows([9], 4, 2) == [
        Window(0, 0, 4, 1), Window(0, 2, 6, 4), Window(0, 4, 8, 6), Window(0, 6, 9, 8)]


def test_sliding_short_document_is_one_window():
    assert sliding_windows([3], 8, 4) == [Window(0, 0, 3, 1)]


def scored(windows):
    return Counter((w.doc, t) for w in windows for t in range(w.score_from, w.end))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=5), st.integers(2, 16), st.data(), st.booleans())
def test_sliding_scores_every_token_exactly_once(doc_lengths, length, data, bos):
    stride = data.draw(st.integers(1, length - int(bos)))
    windows = sliding_windows(doc_lengths, length, stride, bos)
    expected = Counter((d, t) for d, n in enumerate(doc_lengths) for t in range(0 if bos else 1, n))
    assert scored(windows) == expected
    assert all(w.end - w.start <= length - int(bos) and w.start <= w.score_from < w.end for w in windows)
    # every scored token has context inside its window (BOS counts as context)
    assert all(bos or w.start < w.score_from for w in windows)


def test_sliding_with_stride_equal_to_length_scores_window_boundaries():
    # stride = length without BOS: windows step back one token so the boundary token is scored
    assert sliding_windows([10], 4, 4) == [Window(0, 0, 4, 1), Window(0, 3, 7, 4), Window(0, 6, 10, 7)]
    assert sliding_windows([8], 5, 4, bos=True) == [Window(0, 0, 4, 0), Window(0, 4, 8, 4)]


def test_sliding_refuses_a_length_no_document_fills():
    with pytest.raises(WindowError, match="dataset too short for length 16: the longest document has 11 tokens"):
        make_windows([11, 5], 16, "sliding", stride=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=5), st.integers(2, 16), st.booleans())
def test_chunk_windows_are_exact_and_disjoint(doc_lengths, length, bos):
    windows = chunk_windows(doc_lengths, length, bos)
    assert all(w.end - w.start == length - int(bos) for w in windows)
    counts = scored(windows)
    assert max(counts.values(), default=1) == 1
    # every token of each full window is scored except the first when there is no BOS
    assert sum(counts.values()) == len(windows) * (length - 1)
    assert len(windows) == sum(n // (length - int(bos)) for n in doc_lengths)


def test_cap_is_even_and_deterministic():
    ws = chunk_windows([100], 2)
    capped = cap_windows(ws, 5)
    assert [w.start for w in capped] == [0, 20, 40, 60, 80]
    assert cap_windows(ws, None) == ws and cap_windows(ws, 1000) == ws


def test_too_short_data_is_a_clear_error():
    with pytest.raises(WindowError, match="dataset too short for length 512.*longest document has 100 tokens"):
        make_windows([100, 50], 512)
    with pytest.raises(WindowError, match="stride"):
        make_windows([100], 8, "sliding", stride=9)
    with pytest.raises(WindowError, match="unknown mode"):
        make_windows([100], 8, "strided")
