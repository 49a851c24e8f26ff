"""Training windows: a seeded order that visits every span once per epoch, examples that are pure
functions of their index, and PoSE examples read from their own span."""

import numpy as np
import pytest
import torch

from ropescale.training.data import TrainingWindows, token_stream
from ropescale.training.pose import PoseSampler, sample_pose

STREAM = torch.arange(1000, 1000 + 10 * 16 + 7)  # 10 spans of 16 and a remainder


def test_token_stream_joins_documents_with_eos():
    docs = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10])]
    assert token_stream(docs, 0).tolist() == [5, 6, 0, 7, 0, 8, 9, 10, 0]
    assert token_stream(docs, None).tolist() == [5, 6, 7, 8, 9, 10]


def test_each_epoch_visits_every_span_once_in_a_seeded_order():
    ds = TrainingWindows(STREAM, 16, total=35, seed=3)
    assert ds.n == 10 and len(ds) == 35
    epochs = [[ds.span_of(i) for i in range(e * 10, e * 10 + 10)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert epochs[0] != epochs[1]
    assert ([TrainingWindows(STREAM, 16, 35, seed=3).span_of(i) for i in range(30)]
            == [s for epoch in epochs for s in epoch])
    assert [TrainingWindows(STREAM, 16, 35, seed=4).span_of(i) for i in range(10)] != epochs[0]


def test_example_is_its_span_of_the_stream():
    ds = TrainingWindows(STREAM, 16, total=20, seed=0)
    for i in (0, 7, 13):
        k = ds.span_of(i)
        assert ds[i]["input_ids"].tolist() == list(range(1000 + 16 * k, 1000 + 16 * (k + 1)))
        assert "position_ids" not in ds[i]


@pytest.mark.parametrize("sampling", ["authors", "paper"])
def test_pose_examples_are_pure_functions_of_the_index(sampling):
    pose = PoseSampler(6, 16, 2, "random", sampling)
    span = pose.span
    assert span == (30 if sampling == "authors" else 16)  # authors: 5T tokens of text per example
    a = TrainingWindows(STREAM, span, total=20, seed=1, pose=pose)
    b = TrainingWindows(STREAM, span, total=20, seed=1, pose=pose)
    late = b[17]  # read out of order in b
    for i in range(20):
        ex = a[i]
        assert ex["input_ids"].shape == ex["position_ids"].shape == (6,)
        base = 1000 + span * a.span_of(i)
        expected = sample_pose(6, 16, np.random.default_rng((1, 1, i)), chunks=2, content="random", span=span,
                               sampling=sampling)
        assert ex["position_ids"].tolist() == expected.position_ids.tolist()
        assert ex["input_ids"].tolist() == [base + j for j in expected.content_index.tolist()]
    assert (torch.equal(a[17]["input_ids"], late["input_ids"])
            and torch.equal(a[17]["position_ids"], late["position_ids"]))
