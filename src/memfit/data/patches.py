"""3D patches from large volumes, with foreground oversampling, read lazily.

A CT or microscopy volume of 512^3 voxels is 512 MiB in float32; training reads patches of e.g. 128^3. Random
patches mostly miss small structures, so a fraction of patches is centred on a foreground voxel: nnU-Net uses
``oversample_foreground_percent = 0.33`` (nnunetv2 default experiment planner), the default here.

Foreground locations are found once per volume and stored compactly: at most ``max_points`` flat voxel indices
per volume, in the smallest unsigned dtype that holds them, all volumes in one array plus offsets.

Example:
    >>> import numpy as np
    >>> labels = [np.zeros((40, 40, 40), dtype=np.uint8)]
    >>> labels[0][30:32, 5:7, 20:22] = 1
    >>> fg = index_foreground(labels)
    >>> sampler = PatchSampler(patch_size=(16, 16, 16), foreground_fraction=1.0)
    >>> p = sampler.sample([(40, 40, 40)], fg, count=4)[0]
    >>> bool(labels[0][p["z"]:p["z"]+16, p["y"]:p["y"]+16, p["x"]:p["x"]+16].any())
    True
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.errors import DataError, UsageError
from memfit.records import JsonRecord

logger = logging.getLogger(__name__)

# nnunetv2 experiment planner: oversample_foreground_percent = 0.33
NNUNET_FOREGROUND_FRACTION = 0.33

PATCH_DTYPE = np.dtype([("volume", np.int32), ("z", np.int64), ("y", np.int64), ("x", np.int64),
                        ("foreground", np.bool_)])
"""One patch: volume index, corner voxel, whether it was centred on foreground."""


@dataclass(frozen=True)
class ForegroundIndex:
    """Foreground voxel locations of many volumes: flat indices in one array, ``offsets[v]:offsets[v+1]`` each."""

    flat: np.ndarray
    offsets: np.ndarray

    def of(self, volume: int) -> np.ndarray:
        return self.flat[self.offsets[volume] : self.offsets[volume + 1]]

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes + self.offsets.nbytes)


def index_foreground(labels: Sequence[Any], *, max_points: int = 10_000, seed: int = 0) -> ForegroundIndex:
    """Find foreground (label > 0) voxels of each label volume and keep at most ``max_points`` of them.

    A random subset (seeded) is enough to centre patches uniformly over the foreground; keeping all voxels of a
    large organ would cost 8 bytes each for nothing. Label volumes are read one at a time, slab by slab.
    """
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    for label in labels:
        shape = tuple(int(s) for s in label.shape)
        if len(shape) != 3:
            raise UsageError(f"Label volumes must be 3D (z, y, x), got shape {shape}.")
        found = []
        slab = max(1, 2**24 // max(1, shape[1] * shape[2]))  # ~16 M voxels at a time: bounded host memory
        for z0 in range(0, shape[0], slab):
            block = np.asarray(label[z0 : z0 + slab])
            found.append(np.flatnonzero(block > 0) + z0 * shape[1] * shape[2])
        flat = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if len(flat) > max_points:
            flat = np.sort(rng.choice(flat, size=max_points, replace=False))
        parts.append(flat)
    total = int(np.prod(max((tuple(lbl.shape) for lbl in labels), key=np.prod))) if labels else 0
    dtype = np.uint32 if total < 2**32 else np.uint64
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    flat_all = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
    return ForegroundIndex(flat=flat_all, offsets=offsets)


@dataclass(frozen=True, kw_only=True)
class PatchSampler(JsonRecord):
    """Where patches come from: size, how many are centred on foreground, and the seed."""

    patch_size: tuple[int, int, int]
    """Patch size in voxels (z, y, x). Activation memory grows with its product."""
    foreground_fraction: float = NNUNET_FOREGROUND_FRACTION
    """Share of patches centred on a foreground voxel (nnU-Net: 0.33); the rest are uniform over the volume."""
    seed: int = 0

    def __post_init__(self) -> None:
        size = self.patch_size
        if isinstance(size, (str, bytes)) or not hasattr(size, "__len__") or len(size) != 3 or not all(
            _is_int(v) and int(v) >= 1 for v in size
        ):  # 1.5 is an error, not a patch of 1
            raise UsageError(f"patch_size must be three positive ints (z, y, x), got {self.patch_size!r}.")
        object.__setattr__(self, "patch_size", tuple(int(v) for v in size))
        if not _is_int(self.seed):
            raise UsageError(f"seed must be an integer, got {self.seed!r}.")
        if isinstance(self.foreground_fraction, (bool, str)) or not 0.0 <= self.foreground_fraction <= 1.0:
            raise UsageError(f"foreground_fraction must be in [0, 1], got {self.foreground_fraction}.")

    def sample(self, shapes: Sequence[tuple[int, int, int]], foreground: ForegroundIndex | None, *, count: int,
               epoch: int = 0) -> np.ndarray:
        """``count`` patches for ``epoch``, deterministic in ``(seed, epoch)``.

        Exactly ``round(count * foreground_fraction)`` patches are centred on foreground (on volumes that have
        any); the rest are uniform. A patch's corner keeps it inside the volume; a volume smaller than the patch
        along an axis gets corner 0 there and is padded when read.
        """
        rng = np.random.default_rng((self.seed, epoch))
        shapes_a = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        if not len(shapes_a) or (shapes_a <= 0).any():
            raise DataError(f"patches need volumes with at least one voxel along every axis, got shapes "
                            f"{[tuple(map(int, s)) for s in shapes_a]}. Remove the empty volumes.")
        patch = np.asarray(self.patch_size, dtype=np.int64)
        out = np.zeros(count, dtype=PATCH_DTYPE)
        forced = np.zeros(count, dtype=bool)
        has_fg = np.zeros(len(shapes_a), dtype=bool)
        if foreground is not None:
            has_fg = np.diff(foreground.offsets) > 0
        if has_fg.any():
            forced[rng.permutation(count)[: round(count * self.foreground_fraction)]] = True
        # volumes weighted by voxel count for uniform patches (each voxel equally likely), uniform for foreground
        weights = shapes_a.prod(axis=1) / shapes_a.prod(axis=1).sum()
        fg_volumes = np.flatnonzero(has_fg)
        high = np.maximum(shapes_a - patch, 0)
        for i in range(count):
            if forced[i]:
                v = int(fg_volumes[rng.integers(len(fg_volumes))])
                points = foreground.of(v)  # type: ignore[union-attr]
                centre = np.array(np.unravel_index(int(points[rng.integers(len(points))]), tuple(shapes_a[v])))
                corner = np.clip(centre - patch // 2, 0, high[v])
            else:
                v = int(rng.choice(len(shapes_a), p=weights))
                corner = np.array([rng.integers(0, h + 1) for h in high[v]])
            out[i] = (v, *corner, forced[i])
        return out


def read_patch(volume: Any, corner: Sequence[int], size: Sequence[int], *, fill: float = 0) -> np.ndarray:
    """Copy one patch out of a lazy array (memmap, Zarr), padding with ``fill`` where the volume is smaller."""
    z, y, x = (int(c) for c in corner)
    dz, dy, dx = (int(s) for s in size)
    lead = tuple(volume.shape[:-3])  # channels, if any, come first
    block = np.asarray(volume[..., z : z + dz, y : y + dy, x : x + dx])
    if block.shape[-3:] == (dz, dy, dx):
        return np.array(block)  # a copy: a memmap view would keep the file mapped through the batch
    out = np.full(lead + (dz, dy, dx), fill, dtype=block.dtype)
    out[..., : block.shape[-3], : block.shape[-2], : block.shape[-1]] = block
    return out


def _is_int(value: Any) -> bool:
    return not isinstance(value, (bool, np.bool_)) and hasattr(type(value), "__index__")


def _one_line(exc: BaseException) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _open_volume(path: str, what: str) -> Any:
    """A ``.npy`` volume as a read-only memmap, or a DataError naming the file."""
    try:
        return np.load(path, mmap_mode="r")
    except Exception as exc:
        raise DataError(f"cannot open the {what} {path}: {_one_line(exc)}. Volumes are .npy files "
                        "(numpy.save).") from exc


def _torch_dataset_base() -> type:
    import torch.utils.data

    return torch.utils.data.Dataset


class PatchDataset(_torch_dataset_base()):  # type: ignore[misc]
    """``samples_per_epoch`` patches per epoch from ``.npy`` volumes opened as memmaps, with their labels.

    Volume files are opened lazily in each worker (memmaps are cheap to reopen), and patches for the epoch are
    one structured array, so workers share them without copying. Call :meth:`set_epoch` each epoch.

    Args:
        images: ``.npy`` paths of image volumes, shape ``(z, y, x)`` or ``(c, z, y, x)``.
        labels: ``.npy`` paths of label volumes ``(z, y, x)``, same spatial shape.
        sampler: Patch size, foreground fraction and seed.
        samples_per_epoch: Patches per epoch.
        transform: Optional ``(image, label) -> (image, label)`` on tensors (random augmentation goes here).
    """

    def __init__(self, images: Sequence[str | os.PathLike[str]], labels: Sequence[str | os.PathLike[str]], *,
                 sampler: PatchSampler, samples_per_epoch: int,
                 transform: Callable[[Any, Any], tuple[Any, Any]] | None = None) -> None:
        if not _is_int(samples_per_epoch) or samples_per_epoch < 0:
            raise UsageError(f"samples_per_epoch must be a whole number of patches, got {samples_per_epoch!r}.")
        if len(images) != len(labels) or not images:
            raise UsageError(f"Need one label per image and at least one pair; got {len(images)} and {len(labels)}.")
        self.images = [os.fspath(p) for p in images]
        self.labels = [os.fspath(p) for p in labels]
        label_arrays = [_open_volume(p, "label volume") for p in self.labels]
        self.shapes = [tuple(int(s) for s in a.shape) for a in label_arrays]
        for image_path, label_path, shape in zip(self.images, self.labels, self.shapes):
            image_shape = tuple(int(s) for s in _open_volume(image_path, "image volume").shape)
            if len(shape) != 3 or 0 in shape:
                raise DataError(f"the label volume {label_path} has shape {shape}: labels must be (z, y, x) with "
                                "at least one voxel along every axis.")
            if len(image_shape) not in (3, 4) or image_shape[-3:] != shape:
                raise DataError(
                    f"the image {image_path} has shape {image_shape} but its label {label_path} has {shape}: the "
                    "spatial shapes (z, y, x) must be equal, or every patch would pair voxels that do not match. "
                    "Check the pairing of the two lists, or resample one of them."
                )
        self.foreground = index_foreground(label_arrays, seed=sampler.seed)
        del label_arrays
        self.sampler = sampler
        self.samples_per_epoch = samples_per_epoch
        self.transform = transform
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.patches = self.sampler.sample(
            self.shapes, self.foreground, count=self.samples_per_epoch, epoch=epoch  # type: ignore[arg-type]  # 3-D
        )

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        p = self.patches[index]
        v = int(p["volume"])
        corner = (p["z"], p["y"], p["x"])
        pair_arrays = []
        for path in (self.images[v], self.labels[v]):
            try:
                pair_arrays.append(read_patch(np.load(path, mmap_mode="r"), corner, self.sampler.patch_size))
            except Exception as exc:  # a file changed or damaged since the dataset was made: name it
                raise DataError(f"cannot read patch {index} at (z, y, x) = {tuple(int(c) for c in corner)} of "
                                f"{path}: {_one_line(exc)}.") from exc
        pair = torch.from_numpy(pair_arrays[0]), torch.from_numpy(pair_arrays[1])
        return self.transform(*pair) if self.transform is not None else pair
