"""Windows of large rasters (satellite scenes, slides), read lazily so host memory does not grow with the data.

A scene of 50,000 x 50,000 pixels x 4 bands is 10 GB; loading it whole for every tile is how host RAM runs out.
Here a file is opened as a lazy array (NumPy memmap for ``.npy`` and uncompressed TIFF, a Zarr store over TIFF tiles
for compressed or tiled TIFF/GeoTIFF, Zarr arrays) and only the pixels of one window are copied out.

Tiles are described by a structured NumPy array of windows (source, row, col, height, width): one object, whatever
the number of tiles, so forked DataLoader workers do not copy it on read (see :mod:`memfit.data.storage`).

Example:
    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "scene.npy")
    >>> np.save(path, np.zeros((3, 100, 120), dtype=np.uint8))
    >>> tiles = TileDataset.grid([path], size=64, overlap=8)
    >>> len(tiles), tuple(tiles[0].shape)
    (4, (3, 64, 64))
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from memfit.data._optional import require
from memfit.data.storage import PackedStrings
from memfit.errors import DataError, MissingExtraError, UsageError

logger = logging.getLogger(__name__)

Edge = Literal["shift", "pad", "drop"]

WINDOW_DTYPE = np.dtype(
    [("source", np.int32), ("row", np.int64), ("col", np.int64), ("height", np.int32), ("width", np.int32)]
)
"""One window: index of the source file, top-left pixel, and size in pixels."""


class RasterSource:
    """A lazily read 2D raster with optional bands, returning windows as ``(bands, height, width)`` arrays.

    Args:
        array: Any array-like that supports slicing and has ``shape`` and ``dtype`` (memmap, Zarr array).
        channel_axis: ``None`` for a single-band ``(H, W)`` raster, ``0`` for ``(C, H, W)``, ``-1`` for
            ``(H, W, C)``, or ``"auto"``: a 3D array whose last axis is short (<= 16) and shorter than its first
            is band-last (the TIFF ``YXS`` layout), otherwise band-first (planar GeoTIFF).
        closer: Called by :meth:`close` (a file handle behind a Zarr store).
    """

    def __init__(
        self,
        array: Any,
        *,
        channel_axis: int | None | Literal["auto"] = "auto",
        closer: Callable[[], None] | None = None,
    ) -> None:
        ndim = len(array.shape)
        if channel_axis == "auto":
            if ndim == 2:
                channel_axis = None
            elif ndim == 3:
                channel_axis = -1 if array.shape[-1] <= 16 and array.shape[-1] < array.shape[0] else 0
            else:
                raise UsageError(
                    f"Raster has {ndim} dimensions {tuple(array.shape)}; expected (H, W), (C, H, W) or (H, W, C). "
                    "Select one image first, or use memfit.data.PatchDataset for 3D volumes."
                )
        if channel_axis not in (None, 0, -1):
            raise UsageError(f"channel_axis must be None, 0, -1 or 'auto', got {channel_axis!r}.")
        if (channel_axis is None) != (ndim == 2):
            raise UsageError(f"channel_axis={channel_axis!r} does not fit an array of shape {tuple(array.shape)}.")
        self.array = array
        self.channel_axis = channel_axis
        self._closer = closer
        shape = tuple(int(s) for s in array.shape)
        if channel_axis is None:
            self.bands, self.height, self.width = 1, shape[0], shape[1]
        elif channel_axis == 0:
            self.bands, self.height, self.width = shape
        else:
            self.height, self.width, self.bands = shape
        self.dtype = np.dtype(array.dtype)
        if 0 in (self.bands, self.height, self.width):
            raise DataError(f"the raster is empty: shape {shape} has {self.height} rows, {self.width} columns and "
                            f"{self.bands} bands. Remove it from the list, or check how it was written.")

    def read(self, row: int, col: int, height: int, width: int, *, fill: float = 0) -> np.ndarray:
        """Copy one window out as a ``(bands, height, width)`` array; parts outside the raster are ``fill``."""
        r0, c0 = max(row, 0), max(col, 0)
        r1, c1 = min(row + height, self.height), min(col + width, self.width)
        out = np.full((self.bands, height, width), fill, dtype=self.dtype)
        if r1 <= r0 or c1 <= c0:
            return out
        if self.channel_axis is None:
            block = np.asarray(self.array[r0:r1, c0:c1])[None]
        elif self.channel_axis == 0:
            block = np.asarray(self.array[:, r0:r1, c0:c1])
        else:
            block = np.moveaxis(np.asarray(self.array[r0:r1, c0:c1, :]), -1, 0)
        # copy into a fresh array: a view would keep memmap pages (and the file) referenced by the batch
        out[:, r0 - row : r1 - row, c0 - col : c1 - col] = block
        return out

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None


def open_raster(path: str | os.PathLike[str], *, channel_axis: int | None | Literal["auto"] = "auto") -> RasterSource:
    """Open a raster file lazily: ``.npy`` (memmap), ``.tif``/``.tiff`` (memmap or Zarr over tiles), ``.zarr``.

    Uncompressed contiguous TIFFs are memory-mapped; compressed or tiled ones (most GeoTIFFs) are read through
    tifffile's Zarr store so that only the tiles under a window are decoded. Pyramids are read at full resolution.

    Raises:
        DataError: the file is missing, unreadable, corrupt or empty (the message names it).
    """
    path = os.fspath(path)
    try:
        return _open_raster(path, channel_axis)
    except (UsageError, MissingExtraError):
        raise
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    except Exception as exc:  # a corrupt, truncated or unreadable file: say which
        raise DataError(f"cannot open the raster {path}: {_one_line(exc)}. Check the file (re-export or "
                        "re-download it), or remove it from the list.") from exc


def _one_line(exc: BaseException) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _open_raster(path: str, channel_axis: int | None | Literal["auto"]) -> RasterSource:
    lower = path.lower().rstrip("/")
    if lower.endswith(".npy"):
        return RasterSource(np.load(path, mmap_mode="r"), channel_axis=channel_axis)
    if lower.endswith((".tif", ".tiff")):
        tifffile = require("tifffile", "Reading TIFF/GeoTIFF rasters")
        try:
            return RasterSource(tifffile.memmap(path, mode="r"), channel_axis=channel_axis)
        except ValueError:  # compressed or tiled: not memory-mappable, decode tile by tile instead
            zarr = require("zarr", "Reading compressed or tiled TIFF rasters")
            store = tifffile.imread(path, aszarr=True, series=0, level=0)
            return RasterSource(zarr.open(store, mode="r"), channel_axis=channel_axis, closer=store.close)
    if lower.endswith(".zarr"):
        zarr = require("zarr", "Reading Zarr rasters")
        return RasterSource(zarr.open_array(path, mode="r"), channel_axis=channel_axis)
    raise UsageError(f"Cannot open raster {path!r}: expected a .npy, .tif, .tiff or .zarr path.")


def _starts(length: int, size: int, stride: int, edge: Edge) -> np.ndarray:
    """Window starts along one axis of ``length`` pixels."""
    if length <= size:
        # one window; "drop" keeps nothing unless the raster is at least one window long
        return np.zeros(0 if (edge == "drop" and length < size) else 1, dtype=np.int64)
    starts = np.arange(0, length - size + 1, stride, dtype=np.int64)
    last_end = int(starts[-1]) + size
    if last_end < length:
        if edge == "shift":  # move the last window back so it ends at the edge: full coverage, no padding
            starts = np.append(starts, length - size)
        elif edge == "pad":  # one more window hanging over the edge, read with fill
            starts = np.append(starts, int(starts[-1]) + stride)
    return starts


def grid_windows(
    height: int, width: int, *, size: int | tuple[int, int], overlap: int = 0, edge: Edge = "shift", source: int = 0
) -> np.ndarray:
    """Windows on a regular grid over a ``height x width`` raster.

    Args:
        height: Raster height in pixels.
        width: Raster width in pixels.
        size: Window size, one int or ``(height, width)``.
        overlap: Pixels shared by neighbouring windows; the stride is ``size - overlap``.
        edge: What to do where the grid does not divide the raster. ``"shift"`` moves the last window back to end
            at the edge (every pixel covered, no padding, a little extra overlap); ``"pad"`` adds a window that
            hangs over the edge and is filled (every pixel covered, some padded pixels); ``"drop"`` keeps only
            whole windows (edge pixels may be left out).
        source: Source index written into every window.

    Returns:
        A structured array of dtype :data:`WINDOW_DTYPE`, row-major.
    """
    size_hw = _window_size(size)
    if not _is_int(overlap):
        raise UsageError(f"overlap must be a whole number of pixels, got {overlap!r}.")
    if not 0 <= overlap < min(size_hw):
        raise UsageError(f"overlap must be in [0, {min(size_hw)}) for size {size!r}, got {overlap}.")
    if edge not in ("shift", "pad", "drop"):
        raise UsageError(f"edge must be 'shift', 'pad' or 'drop', got {edge!r}.")
    rows = _starts(height, size_hw[0], size_hw[0] - overlap, edge)
    cols = _starts(width, size_hw[1], size_hw[1] - overlap, edge)
    windows = np.zeros(len(rows) * len(cols), dtype=WINDOW_DTYPE)
    grid_r, grid_c = np.meshgrid(rows, cols, indexing="ij")
    windows["source"] = source
    windows["row"] = grid_r.ravel()
    windows["col"] = grid_c.ravel()
    windows["height"] = size_hw[0]
    windows["width"] = size_hw[1]
    return windows


def _is_int(value: Any) -> bool:
    return not isinstance(value, (bool, np.bool_)) and hasattr(type(value), "__index__")


def _window_size(size: Any) -> tuple[int, int]:
    """``size`` (one int or two) as ``(height, width)`` in whole pixels; 1.5 is an error, not 1."""
    size_hw = (size, size) if not isinstance(size, (tuple, list, np.ndarray)) else tuple(size)
    if len(size_hw) != 2 or not all(_is_int(v) and int(v) > 0 for v in size_hw):
        raise UsageError(f"Window size must be one positive whole number of pixels or two (height, width), "
                         f"got {size!r}.")
    return int(size_hw[0]), int(size_hw[1])


class _OpenRasters:
    """Per-process cache of open rasters (file handles must not be shared across a fork), at most ``limit``."""

    def __init__(self, paths: PackedStrings, channel_axis: Any, limit: int) -> None:
        self.paths, self.channel_axis, self.limit = paths, channel_axis, limit
        self._pid = os.getpid()
        self._open: OrderedDict[int, RasterSource] = OrderedDict()

    def get(self, index: int) -> RasterSource:
        if os.getpid() != self._pid:  # we are in a freshly forked worker: drop the parent's handles
            self._open = OrderedDict()
            self._pid = os.getpid()
        source = self._open.get(index)
        if source is None:
            source = open_raster(self.paths[index], channel_axis=self.channel_axis)
            self._open[index] = source
            if len(self._open) > self.limit:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(index)
        return source

    def __getstate__(self) -> dict[str, Any]:  # spawn-started workers: send paths, not handles
        return {"paths": self.paths, "channel_axis": self.channel_axis, "limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["paths"], state["channel_axis"], state["limit"])  # type: ignore[misc]


def _torch_dataset_base() -> type:
    import torch.utils.data

    return torch.utils.data.Dataset


class TileDataset(_torch_dataset_base()):  # type: ignore[misc]
    """A Dataset of raster windows; each item is a ``(bands, height, width)`` tensor read on demand.

    Args:
        paths: Raster files (see :func:`open_raster`).
        windows: Structured array of :data:`WINDOW_DTYPE` (e.g. from :func:`grid_windows`).
        channel_axis: Passed to :func:`open_raster`.
        fill: Value of pixels outside the raster (``edge="pad"`` windows).
        transform: Optional callable applied to each tile tensor (e.g. normalisation, random flips).
        max_open: Files kept open per process; each open TIFF holds a file handle and its tile index.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        windows: np.ndarray,
        *,
        channel_axis: int | None | Literal["auto"] = "auto",
        fill: float = 0,
        transform: Callable[[Any], Any] | None = None,
        max_open: int = 16,
    ) -> None:
        if windows.dtype != WINDOW_DTYPE:
            raise UsageError("windows must be a structured array of memfit.data.rasters.WINDOW_DTYPE.")
        if len(windows) and (windows["source"].min() < 0 or windows["source"].max() >= len(paths)):
            raise UsageError(f"windows refer to source indices outside the {len(paths)} paths given.")
        self.windows = windows
        self.fill = fill
        self.transform = transform
        self._rasters = _OpenRasters(PackedStrings([os.fspath(p) for p in paths]), channel_axis, max_open)

    @classmethod
    def grid(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        *,
        size: int | tuple[int, int],
        overlap: int = 0,
        edge: Edge = "shift",
        **kwargs: Any,
    ) -> TileDataset:
        """Tile every raster on a grid (see :func:`grid_windows`); headers are read once to learn the sizes."""
        parts = []
        for i, path in enumerate(paths):
            source = open_raster(path, channel_axis=kwargs.get("channel_axis", "auto"))
            parts.append(grid_windows(source.height, source.width, size=size, overlap=overlap, edge=edge, source=i))
            source.close()
        windows = np.concatenate(parts) if parts else np.zeros(0, dtype=WINDOW_DTYPE)
        return cls(paths, windows, **kwargs)

    def __len__(self) -> int:
        return len(self.windows)

    def _window(self, index: int) -> np.void:
        return self.windows[index]

    def __getitem__(self, index: int) -> Any:
        import torch

        w = self._window(index)
        source, row, col, height, width = (int(w[k]) for k in ("source", "row", "col", "height", "width"))
        try:
            tile = self._rasters.get(source).read(row, col, height, width, fill=self.fill)
        except DataError:
            raise
        except Exception as exc:  # a truncated or corrupt tile: name the file and the window, mid-epoch too
            raise DataError(
                f"cannot read tile {index} (rows {row}-{row + height}, columns {col}-{col + width}) of "
                f"{self._rasters.paths[source]}: {_one_line(exc)}. The file is damaged there: re-export or "
                "re-download it, or remove it from the list."
            ) from exc
        tensor = torch.from_numpy(tile)
        return self.transform(tensor) if self.transform is not None else tensor


class RandomTileDataset(TileDataset):
    """``length`` random windows per epoch, drawn uniformly over all pixel positions of all rasters.

    Window ``i`` of epoch ``e`` depends only on ``(seed, e, i)``, so it is the same in every worker and rank and
    nothing per tile is stored. Call :meth:`set_epoch` each epoch for new windows.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        size: int | tuple[int, int],
        length: int,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        size_hw = _window_size(size)
        if not _is_int(length) or length < 0 or not paths:
            raise UsageError(f"RandomTileDataset needs paths and length >= 0, got {len(paths)} paths, {length}.")
        self._heights = np.zeros(len(paths), dtype=np.int64)
        self._widths = np.zeros(len(paths), dtype=np.int64)
        for i, path in enumerate(paths):
            source = open_raster(path, channel_axis=kwargs.get("channel_axis", "auto"))
            self._heights[i], self._widths[i] = source.height, source.width
            source.close()
        super().__init__(paths, np.zeros(0, dtype=WINDOW_DTYPE), **kwargs)
        self.size_hw = size_hw
        self.length = int(length)
        self.seed = int(seed)
        self.epoch = 0
        # sources weighted by their number of valid window positions, so every position is equally likely
        positions = np.maximum(self._heights - size_hw[0] + 1, 1) * np.maximum(self._widths - size_hw[1] + 1, 1)
        self._cumulative = np.cumsum(positions / positions.sum())

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.length

    def _window(self, index: int) -> np.void:
        if not 0 <= index < self.length:
            raise IndexError(f"tile {index} out of range for {self.length} tiles per epoch")
        rng = np.random.default_rng((self.seed, self.epoch, index))
        source = min(int(np.searchsorted(self._cumulative, rng.random(), side="right")), len(self._cumulative) - 1)
        height, width = int(self._heights[source]), int(self._widths[source])
        window = np.zeros((), dtype=WINDOW_DTYPE)
        window["source"] = source
        window["row"] = rng.integers(0, max(height - self.size_hw[0], 0) + 1)
        window["col"] = rng.integers(0, max(width - self.size_hw[1], 0) + 1)
        window["height"], window["width"] = self.size_hw
        return window[()]  # type: ignore[return-value]  # one record of a 0-d structured array is an np.void
