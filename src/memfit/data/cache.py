"""An on-disk cache of the deterministic part of preprocessing; random augmentation stays on the fly.

Resampling, cropping to the body and normalising a CT volume can take seconds per sample, every epoch. Their
output is the same every epoch, so it is computed once and stored; random flips, crops and noise must still run
fresh each time, or the model sees fewer distinct samples and the maths changes.

* Keyed by a hash of the transform's name and parameters: change a parameter and a new cache directory is used,
  so stale results are never read (old directories can be removed with :meth:`PreprocessCache.prune`).
* Written atomically: each item goes to a temporary file in the same directory, then ``os.replace`` renames it
  into place, so a crash leaves either the whole item or nothing; a resumed fill skips finished items.
* Stored as ``.npz`` with ``allow_pickle=False``: arrays only, never unpickled.

Example:
    >>> import numpy as np, tempfile
    >>> def scale(x, factor): return x * factor
    >>> cache = PreprocessCache(tempfile.mkdtemp(), scale, params={"factor": 2.0})
    >>> float(cache.get(0, lambda: np.ones(3)).sum())
    6.0
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit._io import atomic_open, write_atomic
from memfit.errors import UsageError
from memfit.records import JsonRecord

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when the on-disk layout changes: it is part of the key


def transform_key(transform: Callable[..., Any], params: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the transform's qualified name and its parameters as canonical JSON."""
    name = f"{getattr(transform, '__module__', '?')}.{getattr(transform, '__qualname__', type(transform).__name__)}"
    try:
        text = json.dumps({"format": _FORMAT, "transform": name, "params": params}, sort_keys=True,
                          default=_json_default)
    except TypeError as exc:
        raise UsageError(f"Cache parameters must be JSON-like (numbers, strings, lists, dicts): {exc}") from exc
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


@dataclass(frozen=True, kw_only=True)
class CacheFill(JsonRecord):
    """Result of :meth:`PreprocessCache.fill`."""

    written: int
    """Items computed and stored by this call."""
    skipped: int
    """Items already present (a resumed fill)."""
    bytes_on_disk: int
    """Size of the cache directory after the fill."""


class PreprocessCache:
    """Cache ``transform(sample, **params)`` per sample index under ``root/<key>/``.

    Args:
        root: Directory for all caches; each parameter set gets a subdirectory named by its key.
        transform: Deterministic function ``(sample, **params) -> array | tuple of arrays | dict of arrays``.
        params: Everything the output depends on. Anything left out will not invalidate the cache when it
            changes, so include e.g. target spacing, clip range and a version string of your code.
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[..., Any], *,
                 params: Mapping[str, Any]) -> None:
        self.transform = transform
        self.params = dict(params)
        self.key = transform_key(transform, self.params)
        self.root = Path(root)
        self.directory = self.root / self.key[:16]
        self.unwritable: str | None = None
        """Why the cache cannot store items (a read-only folder, a full disk), once ``get`` found out: it then
        computes every item, uncached, rather than fail the epoch."""
        try:
            self._prepare()
        except OSError as exc:
            self._give_up_writing(exc)

    def _prepare(self) -> None:
        """The cache directory and its manifest, made again if someone deleted them while it was in use."""
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = self.directory / "manifest.json"
        if not manifest.exists():
            write_atomic(manifest, json.dumps(
                {"key": self.key, "params": self.params, "format": _FORMAT}, default=_json_default, indent=1
            ), what="the cache manifest")

    def _give_up_writing(self, exc: OSError) -> None:
        if self.unwritable is None:
            self.unwritable = exc.strerror or str(exc)
            logger.warning("the preprocessing cache %s cannot be written (%s): items are computed without "
                           "caching, every epoch. Give PreprocessCache a writable folder.", self.directory,
                           self.unwritable)

    def path(self, index: int) -> Path:
        return self.directory / f"{int(index):08d}.npz"

    def __contains__(self, index: int) -> bool:
        return self.path(index).exists()

    def get(self, index: int, load: Callable[[], Any]) -> Any:
        """The cached output for ``index``, computing it from ``load()`` and storing it on a miss.

        A damaged item (a truncated file, say) is computed again and replaced; a cache that cannot be written
        (read-only, deleted and not re-creatable, full) computes the item uncached, with one warning.
        """
        path = self.path(index)
        if path.exists():
            try:
                return _read(path)
            except Exception as exc:  # damaged on disk: recompute it below, overwriting the file
                logger.warning("cache item %s is damaged (%s: %s); computing it again", path,
                               type(exc).__name__, exc)
        value = self.transform(load(), **self.params)
        if self.unwritable is not None:
            return _read_back(value)
        try:
            self._prepare()  # the folder may have been deleted since
            _write(path, value)
        except OSError as exc:
            self._give_up_writing(exc)
            return _read_back(value)
        return _read(path)  # return what later epochs will see, so the first epoch is not subtly different

    def fill(self, indices: Iterable[int], load: Callable[[int], Any]) -> CacheFill:
        """Compute and store every missing index; safe to interrupt and call again (it resumes)."""
        written = skipped = 0
        try:
            self._prepare()
        except OSError as exc:
            raise UsageError(f"cannot fill the preprocessing cache {self.directory}: {exc.strerror or exc}. Give "
                             "PreprocessCache a folder you can write to.") from None
        for index in indices:
            if index in self:
                skipped += 1
                continue
            try:
                _write(self.path(index), self.transform(load(index), **self.params))
            except OSError as exc:
                raise UsageError(f"cannot write item {index} of the preprocessing cache {self.directory}: "
                                 f"{exc.strerror or exc}. {written} items were written; free space (or give a "
                                 "writable folder) and call fill again: it resumes.") from None
            written += 1
        size = sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file())
        logger.info("cache %s: %d written, %d already present", self.directory, written, skipped)
        return CacheFill(written=written, skipped=skipped, bytes_on_disk=size)

    def prune(self) -> list[Path]:
        """Delete cache directories under ``root`` made with other parameters; returns what was removed."""
        removed = []
        for child in self.root.iterdir():
            if child.is_dir() and child != self.directory and (child / "manifest.json").exists():
                shutil.rmtree(child)
                removed.append(child)
        return removed


class CachedDataset:
    """Wrap a dataset: the deterministic transform is cached, ``augment`` runs fresh on every read.

    Args:
        dataset: Anything indexable with ``len``; ``dataset[i]`` is the raw sample.
        cache: The :class:`PreprocessCache` for the deterministic part.
        augment: Random augmentation applied to the cached output on every read.
    """

    def __init__(self, dataset: Any, cache: PreprocessCache, augment: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.cache, self.augment = dataset, cache, augment

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        value = self.cache.get(index, lambda: self.dataset[index])
        return self.augment(value) if self.augment is not None else value


def _to_arrays(value: Any) -> tuple[str, dict[str, np.ndarray]]:
    def array(v: Any) -> np.ndarray:
        if hasattr(v, "detach"):  # a torch tensor: store its data, not a pickle
            v = v.detach().cpu().numpy()
        a = np.asarray(v)
        if a.dtype == object:
            raise UsageError("Cached outputs must be numeric arrays (or tuples/dicts of them), not Python objects.")
        return a

    if isinstance(value, Mapping):
        return "dict", {f"d_{k}": array(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return "tuple", {f"t_{i:04d}": array(v) for i, v in enumerate(value)}
    return "array", {"a": array(value)}


def _write(path: Path, value: Any) -> None:
    kind, arrays = _to_arrays(value)
    arrays["__kind__"] = np.frombuffer(kind.encode(), dtype=np.uint8)
    with atomic_open(path, what="a cached item") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle


def _read(path: Path) -> Any:
    with np.load(path, allow_pickle=False) as data:
        kind = data["__kind__"].tobytes().decode()
        if kind == "dict":
            return {k[2:]: data[k] for k in data.files if k.startswith("d_")}
        if kind == "tuple":
            # by number: "t_10000" sorts before "t_1001" as text
            return tuple(data[k] for k in sorted((k for k in data.files if k.startswith("t_")),
                                                 key=lambda k: int(k[2:])))
        return data["a"]


def _read_back(value: Any) -> Any:
    """What ``_read`` would return for ``value`` once written: the same kinds and arrays, without a file."""
    kind, arrays = _to_arrays(value)
    if kind == "dict":
        return {k[2:]: v for k, v in arrays.items()}
    if kind == "tuple":
        return tuple(arrays[k] for k in sorted(arrays, key=lambda k: int(k[2:])))
    return arrays["a"]
