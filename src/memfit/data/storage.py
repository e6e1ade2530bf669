"""Per-sample metadata that DataLoader workers can read without copying it.

Forked DataLoader workers share the parent's memory pages copy-on-write. Reading a Python object writes its
reference count, which dirties the page it lives on, so a list of a million dicts or strings is slowly copied into
every worker over an epoch; it looks like a leak (pytorch issue 13246, and Yuxin Wu's "Demystify RAM usage in
multi-process data loaders", 2022). A NumPy array is one object whose data pages are never written on read, so it
stays shared.

:class:`SampleTable` keeps columns as NumPy arrays; text columns are packed into one ``uint8`` buffer plus an
``int64`` offsets array. :func:`check_dataset_containers` warns when a Dataset holds large Python containers.

Example:
    >>> table = SampleTable.from_records([{"path": "a.tif", "height": 512}, {"path": "bb.tif", "height": 256}])
    >>> table[1]
    {'path': 'bb.tif', 'height': 256}
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.errors import DataLoaderMemoryWarning, UsageError
from memfit.records import JsonRecord

logger = logging.getLogger(__name__)

# A container below this many items costs little even when copied into every worker; above it the copies add up
# (at ~100 bytes per small Python object, 100k items is ~10 MB per worker, times workers times ranks).
DEFAULT_MIN_ITEMS = 100_000


class PackedStrings:
    """Variable-length strings as one UTF-8 byte buffer plus offsets: two objects, whatever the row count."""

    def __init__(self, values: Sequence[str]) -> None:
        encoded = [str(v).encode("utf-8") for v in values]
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        self.buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> str:
        start, stop = self.offsets[index], self.offsets[index + 1]
        return self.buffer[start:stop].tobytes().decode("utf-8")

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes + self.offsets.nbytes)


class SampleTable:
    """Columns of per-sample metadata held in NumPy arrays, safe to share with forked DataLoader workers.

    Numeric and boolean columns become NumPy arrays of their natural dtype; text columns become packed strings.
    Row access builds a small dict on demand, so nothing per-row lives as a Python object between reads.

    Args:
        columns: Column name to values. All columns must have the same length.
    """

    def __init__(self, columns: Mapping[str, Sequence[Any] | np.ndarray]) -> None:
        if not columns:
            raise UsageError("SampleTable needs at least one column; pass e.g. {'path': [...], 'height': [...]}.")
        self._columns: dict[str, np.ndarray | PackedStrings] = {}
        length: int | None = None
        for name, values in columns.items():
            column = _to_column(name, values)
            if length is not None and len(column) != length:
                raise UsageError(
                    f"Column {name!r} has {len(column)} rows but earlier columns have {length}; "
                    "every column needs one value per sample."
                )
            length = len(column)
            self._columns[name] = column
        self._length = int(length or 0)

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> SampleTable:
        """Build a table from an iterable of dicts that all have the same keys (e.g. parsed JSON annotations)."""
        rows = list(records)
        if not rows:
            raise UsageError("SampleTable.from_records got no records; it needs at least one.")
        keys = list(rows[0])
        columns = {k: [row[k] for row in rows] for k in keys}
        return cls(columns)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self._length <= index < self._length:
            raise IndexError(f"row {index} out of range for a table of {self._length} rows")
        index %= self._length
        row: dict[str, Any] = {}
        for name, column in self._columns.items():
            value = column[index]
            row[name] = value.item() if isinstance(value, np.generic) else value
        return row

    def column(self, name: str) -> np.ndarray:
        """Return a numeric column as its NumPy array (no copy). Text columns cannot be returned this way."""
        column = self._columns[name]
        if isinstance(column, PackedStrings):
            raise UsageError(f"Column {name!r} holds text; read it row by row with table[i][{name!r}].")
        return column

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._columns)

    @property
    def nbytes(self) -> int:
        """Bytes held by all columns together."""
        return sum(int(c.nbytes) for c in self._columns.values())


def _to_column(name: str, values: Sequence[Any] | np.ndarray) -> np.ndarray | PackedStrings:
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values
    values = list(values)
    if all(isinstance(v, str) for v in values):
        return PackedStrings(values)
    array = np.asarray(values)
    if array.dtype == object or array.dtype.kind in "US":
        raise UsageError(
            f"Column {name!r} mixes types or holds nested objects ({type(values[0]).__name__}); "
            "store one number, bool or string per sample, or split it into several columns."
        )
    return array


@dataclass(frozen=True, kw_only=True)
class ContainerFinding(JsonRecord):
    """A large Python container found on a Dataset."""

    attribute: str
    """Dotted path of the attribute, e.g. ``"dataset.samples"``."""
    type_name: str
    """``list``, ``dict``, ``tuple`` or ``set``."""
    items: int
    """Number of items in the container."""
    estimated_bytes: int
    """Rough size of the container and its items as Python objects (sampled), i.e. what each worker may copy."""


def check_dataset_containers(
    dataset: object, *, min_items: int = DEFAULT_MIN_ITEMS, warn: bool = True, max_depth: int = 2
) -> tuple[ContainerFinding, ...]:
    """Find Python lists/dicts/tuples/sets with at least ``min_items`` items among a Dataset's attributes.

    Looks through ``vars(dataset)`` and, up to ``max_depth`` levels, into attributes that are themselves objects
    with a ``__dict__`` (such as ``Subset.dataset`` or a wrapped dataset).

    Args:
        dataset: The Dataset (any object) to inspect.
        min_items: Containers shorter than this are ignored.
        warn: Emit a :class:`~memfit.errors.DataLoaderMemoryWarning` per finding.
        max_depth: How deep to follow nested objects.

    Returns:
        The findings, largest first.
    """
    findings: list[ContainerFinding] = []
    _scan(dataset, "dataset", min_items, max_depth, findings, seen=set())
    findings.sort(key=lambda f: f.estimated_bytes, reverse=True)
    for finding in findings:
        message = (
            f"{finding.attribute} is a Python {finding.type_name} of {finding.items:,} items "
            f"(~{finding.estimated_bytes / 2**20:.1f} MiB as Python objects). Every DataLoader worker copies it "
            "as it reads it (pytorch issue 13246). Store it in memfit.data.SampleTable or NumPy arrays instead."
        )
        logger.warning(message)
        if warn:
            warnings.warn(message, DataLoaderMemoryWarning, stacklevel=2)
    return tuple(findings)


def _scan(obj: object, path: str, min_items: int, depth: int, out: list[ContainerFinding], seen: set[int]) -> None:
    if id(obj) in seen or not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))
    for name, value in vars(obj).items():
        attribute = f"{path}.{name}"
        if isinstance(value, list | tuple | dict | set | frozenset):
            if len(value) >= min_items:
                out.append(
                    ContainerFinding(
                        attribute=attribute,
                        type_name=type(value).__name__,
                        items=len(value),
                        estimated_bytes=_estimate_bytes(value),
                    )
                )
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type | np.ndarray):
            _scan(value, attribute, min_items, depth - 1, out, seen)


def _estimate_bytes(container: Any, sample: int = 1000) -> int:
    """Container size plus the mean size of up to ``sample`` items (and dict values), scaled to all items."""
    items = list(container.items())[:sample] if isinstance(container, dict) else list(container)[:sample]
    if not items:
        return sys.getsizeof(container)
    per_item = sum(_deep_size(item) for item in items) / len(items)
    return int(sys.getsizeof(container) + per_item * len(container))


def _deep_size(obj: Any) -> int:
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in obj.items())
    elif isinstance(obj, list | tuple):
        size += sum(sys.getsizeof(v) for v in obj)
    return size
