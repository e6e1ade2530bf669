"""SampleTable round-trips and stays compact; the container check finds large Python containers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from memfit.data.storage import SampleTable, check_dataset_containers
from memfit.errors import DataLoaderMemoryWarning, UsageError


def test_table_round_trips_rows_and_packs_text() -> None:
    records = [{"path": f"tiles/scene_{i}_é.tif", "height": 100 + i, "valid": i % 2 == 0} for i in range(1000)]
    table = SampleTable.from_records(records)
    assert len(table) == 1000 and table.names == ("path", "height", "valid")
    for i in (0, 1, 517, 999, -1):
        assert table[i] == records[i]
    assert table.column("height").dtype.kind == "i"
    # two arrays for the text column, not 1000 str objects: a few dozen bytes per row at most
    assert table.nbytes < 40 * 1000
    with pytest.raises(UsageError, match="text"):
        table.column("path")
    with pytest.raises(IndexError):
        table[1000]


def test_table_rejects_ragged_and_nested_columns() -> None:
    with pytest.raises(UsageError, match="rows"):
        SampleTable({"a": [1, 2], "b": [1]})
    with pytest.raises(UsageError, match="nested"):
        SampleTable({"a": [{"x": 1}, {"x": 2}]})


class _ListDataset:
    def __init__(self, n: int) -> None:
        self.samples = [{"path": f"img_{i}.png", "label": i % 10} for i in range(n)]
        self.labels = np.arange(n)  # a NumPy array is fine and must not be reported


class _Wrapper:
    def __init__(self, inner: object) -> None:
        self.dataset = inner
        self.indices = list(range(10))


def test_check_warns_on_large_list_inside_a_wrapper() -> None:
    with pytest.warns(DataLoaderMemoryWarning, match="dataset.dataset.samples"):
        findings = check_dataset_containers(_Wrapper(_ListDataset(20_000)), min_items=10_000)
    assert [f.attribute for f in findings] == ["dataset.dataset.samples"]
    assert findings[0].items == 20_000
    # each item is a dict with two entries: at least a few hundred bytes per item as Python objects
    assert findings[0].estimated_bytes > 20_000 * 200
    assert findings[0].to_dict()["schema"] == 1


def test_check_is_quiet_for_table_backed_dataset() -> None:
    class TableDataset:
        def __init__(self) -> None:
            self.table = SampleTable({"path": [f"img_{i}.png" for i in range(50_000)], "label": np.arange(50_000)})

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_dataset_containers(TableDataset(), min_items=10_000) == ()
