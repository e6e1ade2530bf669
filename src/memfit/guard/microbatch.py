"""Split a batch into micro-batches along the batch dimension, and count what each one's loss averages over.

A batch is a tensor, or a tuple/list/dict (nested freely) whose tensor leaves share their first dimension, the
batch dimension. Leaves without a batch dimension (0-dim tensors, ints, strings) are given to every
micro-batch unchanged. Anything else needs a ``splitter`` (:class:`BatchSplitter`).

Splitting uses ``Tensor.split``, which returns views: no micro-batch is copied, so splitting costs no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from memfit.errors import UsageError

__all__ = [
    "BatchSplitter",
    "CountFn",
    "TensorSplitter",
    "batch_size",
    "count_samples",
    "count_tokens",
    "shape_key",
    "split_batch",
    "to_device",
]

CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch) -> n``: how many units (samples, tokens) the loss of that micro-batch is a mean over."""


def _leaves(batch: Any) -> list[torch.Tensor]:
    """Tensor leaves with a batch dimension, in a fixed traversal order."""
    if isinstance(batch, torch.Tensor):
        return [batch] if batch.dim() > 0 else []
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _leaves(v)]
    return []


def batch_size(batch: Any) -> int:
    """Return the size of the batch dimension shared by every tensor leaf.

    Raises:
        UsageError: No tensor leaf has a batch dimension, or two leaves disagree.

    Example:
        >>> batch_size((torch.zeros(8, 3), torch.zeros(8)))
        8
    """
    leaves = _leaves(batch)
    if not leaves:
        raise UsageError(
            f"Cannot find a batch dimension in a batch of type {type(batch).__name__}: no tensor with a first "
            "dimension. Pass splitter= (a memfit.guard.microbatch.BatchSplitter) and count_fn= to TrainStep for "
            "custom batches."
        )
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise UsageError(
            f"Tensors in the batch disagree on the batch dimension (first dimension sizes {sorted(sizes)}). "
            "Every tensor with a first dimension is split along it; pass splitter= to TrainStep for other layouts."
        )
    return sizes.pop()


def _split(batch: Any, size: int, count: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * count
        return list(batch.split(size))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, size, count) for k, v in batch.items()}
        return [type(batch)({k: parts[k][i] for k in parts}) for i in range(count)]  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        parts_seq = [_split(v, size, count) for v in batch]
        rebuilt = [[p[i] for p in parts_seq] for i in range(count)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple: positional constructor
            return [type(batch)(*r) for r in rebuilt]
        return [type(batch)(r) for r in rebuilt]
    return [batch] * count  # no batch dimension: every micro-batch sees it


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a batch into consecutive micro-batches of ``micro_batch_size`` samples (the last may be smaller).

    Args:
        batch: A tensor or a nest of tuples/lists/dicts of tensors sharing their first dimension.
        micro_batch_size: Samples per micro-batch, at least 1.

    Returns:
        The micro-batches, as views of the batch (no copy).

    Example:
        >>> [mb["x"].shape[0] for mb in split_batch({"x": torch.zeros(10, 2)}, 4)]
        [4, 4, 2]
    """
    if micro_batch_size < 1:
        raise UsageError(f"micro_batch_size must be at least 1, got {micro_batch_size}.")
    n = batch_size(batch)
    count = -(-n // micro_batch_size)  # ceil division
    return _split(batch, micro_batch_size, count)


def count_samples(micro_batch: Any) -> int:
    """The default ``count_fn``: the loss is a mean over samples."""
    return batch_size(micro_batch)


def count_tokens(key: str | int, *, ignore_index: int = -100) -> CountFn:
    """Make a ``count_fn`` for a loss that is a mean over tokens (``cross_entropy`` with ``ignore_index``).

    Args:
        key: Where the labels are in each micro-batch: a dict key or a tuple/list position.
        ignore_index: Label value that the loss ignores (padding).

    Returns:
        A function giving the number of counted tokens as a 0-dim tensor. TrainStep reads the counts of all
        micro-batches with one host sync per attempt, before the first forward.

    Example:
        >>> count_tokens("labels")({"labels": torch.tensor([[1, 2, -100]])})
        tensor(2)
    """

    def count(micro_batch: Any) -> torch.Tensor:
        return (micro_batch[key] != ignore_index).sum()

    return count


def shape_key(batch: Any) -> tuple[tuple[int, ...], ...]:
    """Identify the input shape apart from the batch dimension (sequence length, image size...).

    Two batches with the same key need the same memory per sample, so a micro-batch size that ran out of memory
    for one will run out for the other.
    """
    return tuple(tuple(t.shape[1:]) for t in _leaves(batch))


@runtime_checkable
class BatchSplitter(Protocol):
    """The hook for custom batches: how big a batch is and how to cut it.

    ``split`` must return consecutive micro-batches of at most ``micro_batch_size`` samples that together hold
    every sample exactly once. An optional ``shape_key(batch)`` method names the per-sample shape (sequence
    length...), so that a size that ran out of memory is remembered per shape.
    """

    def size(self, batch: Any) -> int:
        """Number of samples in ``batch``."""
        ...

    def split(self, batch: Any, micro_batch_size: int) -> Sequence[Any]:
        """Cut ``batch`` into micro-batches of at most ``micro_batch_size`` samples."""
        ...


class TensorSplitter:
    """The default splitter: tensors and nests of tuples/lists/dicts, split along the first dimension."""

    def size(self, batch: Any) -> int:
        return batch_size(batch)

    def split(self, batch: Any, micro_batch_size: int) -> Sequence[Any]:
        return split_batch(batch, micro_batch_size)

    def shape_key(self, batch: Any) -> tuple[tuple[int, ...], ...]:
        return shape_key(batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor leaf to ``device``; non-blocking so a pinned host batch overlaps the copy."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
