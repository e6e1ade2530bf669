"""Splitting batches along the batch dimension, and counting what a loss averages over."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from memfit.errors import UsageError
from memfit.guard.microbatch import batch_size, count_tokens, shape_key, split_batch, to_device

Pair = namedtuple("Pair", ["x", "y"])


def test_nested_batches_split_into_views_and_keep_their_types() -> None:
    batch = {"inputs": (torch.arange(10.0).reshape(5, 2), [torch.arange(5)]), "scale": torch.tensor(2.0),
             "name": "run-1", "pair": Pair(torch.zeros(5, 3), torch.ones(5))}
    parts = split_batch(batch, 2)
    assert [batch_size(p) for p in parts] == [2, 2, 1]
    assert isinstance(parts[0]["inputs"], tuple) and isinstance(parts[0]["inputs"][1], list)
    assert isinstance(parts[0]["pair"], Pair)
    assert parts[2]["scale"] is batch["scale"] and parts[1]["name"] == "run-1"  # no batch dimension: shared
    torch.testing.assert_close(torch.cat([p["inputs"][0] for p in parts]), batch["inputs"][0])
    assert parts[1]["inputs"][0].data_ptr() == batch["inputs"][0][2].data_ptr()  # a view, not a copy


def test_every_sample_lands_in_exactly_one_micro_batch() -> None:
    ids = torch.arange(37)
    for size in (1, 5, 36, 37, 100):
        assert torch.equal(torch.cat(split_batch(ids, size)), ids)


def test_disagreeing_or_missing_batch_dimensions_are_refused() -> None:
    with pytest.raises(UsageError, match="disagree"):
        batch_size((torch.zeros(4, 2), torch.zeros(5)))
    with pytest.raises(UsageError, match="splitter"):
        batch_size({"name": "x"})
    with pytest.raises(UsageError, match="at least 1"):
        split_batch(torch.zeros(3), 0)


def test_count_tokens_ignores_padding() -> None:
    counter = count_tokens("labels")
    assert int(counter({"labels": torch.tensor([[1, 2, -100], [-100, -100, -100]])})) == 2
    assert int(count_tokens(1, ignore_index=0)((None, torch.tensor([0, 3, 4])))) == 2


def test_shape_key_ignores_the_batch_dimension() -> None:
    assert shape_key({"x": torch.zeros(4, 128), "y": torch.zeros(4)}) == ((128,), ())
    assert shape_key({"x": torch.zeros(9, 128), "y": torch.zeros(9)}) == shape_key({"x": torch.zeros(4, 128),
                                                                                     "y": torch.zeros(4)})


def test_to_device_moves_every_leaf() -> None:
    batch = {"a": torch.zeros(2, dtype=torch.float64), "b": (torch.ones(2),), "c": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["c"] == 3 and isinstance(moved["b"], tuple) and moved["a"].device.type == "cpu"
