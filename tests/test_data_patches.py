"""3D patch sampling: foreground share, bounds, determinism, compact index, lazy dataset."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.data.patches import PatchDataset, PatchSampler, index_foreground, read_patch
from memfit.errors import UsageError


def _labels() -> list[np.ndarray]:
    a = np.zeros((60, 50, 40), dtype=np.uint8)
    a[50:53, 3:6, 30:34] = 1  # a small lesion near a corner
    b = np.zeros((20, 30, 30), dtype=np.uint8)  # smaller than the patch along z: padded
    c = np.zeros((64, 64, 64), dtype=np.uint8)  # no foreground at all
    c[0, 0, 0] = 0
    return [a, b, c]


def test_foreground_share_bounds_and_centres() -> None:
    labels = _labels()
    shapes = [lbl.shape for lbl in labels]
    sampler = PatchSampler(patch_size=(32, 24, 24), seed=1)
    patches = sampler.sample(shapes, index_foreground(labels), count=300)
    assert patches["foreground"].sum() == round(300 * 0.33)
    for p in patches:
        shape = shapes[p["volume"]]
        for corner, size, extent in zip((p["z"], p["y"], p["x"]), (32, 24, 24), shape, strict=True):
            assert 0 <= corner and (corner + size <= extent or corner == 0)
        if p["foreground"]:
            assert p["volume"] == 0
            window = labels[0][p["z"] : p["z"] + 32, p["y"] : p["y"] + 24, p["x"] : p["x"] + 24]
            assert window.any()
    # uniform patches almost never hit the 36-voxel lesion: oversampling is what brings it in
    uniform_hits = sum(labels[0][p["z"]:p["z"] + 32, p["y"]:p["y"] + 24, p["x"]:p["x"] + 24].any()
                       for p in patches if not p["foreground"] and p["volume"] == 0)
    assert uniform_hits < patches["foreground"].sum()


def test_deterministic_per_seed_and_epoch() -> None:
    labels = _labels()
    fg = index_foreground(labels)
    s = PatchSampler(patch_size=(16, 16, 16), seed=4)
    a = s.sample([lbl.shape for lbl in labels], fg, count=50, epoch=2)
    np.testing.assert_array_equal(a, s.sample([lbl.shape for lbl in labels], fg, count=50, epoch=2))
    assert not np.array_equal(a, s.sample([lbl.shape for lbl in labels], fg, count=50, epoch=3))


def test_index_is_compact_and_capped() -> None:
    big = np.ones((40, 40, 40), dtype=np.uint8)
    fg = index_foreground([big, np.zeros((4, 4, 4))], max_points=1000)
    assert fg.flat.dtype == np.uint32 and len(fg.of(0)) == 1000 and len(fg.of(1)) == 0
    assert fg.nbytes < 5000


def test_no_foreground_anywhere_means_uniform_patches() -> None:
    patches = PatchSampler(patch_size=(8, 8, 8)).sample([(16, 16, 16)], index_foreground([np.zeros((16,) * 3)]),
                                                         count=10)
    assert not patches["foreground"].any()


def test_read_patch_pads_and_bad_config_raises() -> None:
    vol = np.arange(2 * 4 * 5 * 6).reshape(2, 4, 5, 6)
    patch = read_patch(vol, (2, 0, 0), (4, 5, 6), fill=-1)
    assert patch.shape == (2, 4, 5, 6) and (patch[:, 2:] == -1).all()
    np.testing.assert_array_equal(patch[:, :2], vol[:, 2:4])
    with pytest.raises(UsageError):
        PatchSampler(patch_size=(8, 8), foreground_fraction=0.3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="foreground_fraction"):
        PatchSampler(patch_size=(8, 8, 8), foreground_fraction=1.5)


def test_patch_dataset_reads_matching_image_and_label(tmp_path) -> None:
    labels = _labels()
    images, label_paths = [], []
    for i, lbl in enumerate(labels):
        img = np.random.default_rng(i).standard_normal((1,) + lbl.shape).astype(np.float32)
        np.save(tmp_path / f"img{i}.npy", img)
        np.save(tmp_path / f"lbl{i}.npy", lbl)
        images.append(tmp_path / f"img{i}.npy")
        label_paths.append(tmp_path / f"lbl{i}.npy")
    ds = PatchDataset(images, label_paths, sampler=PatchSampler(patch_size=(16, 16, 16)), samples_per_epoch=12)
    for i in range(len(ds)):
        image, label = ds[i]
        assert tuple(image.shape) == (1, 16, 16, 16) and tuple(label.shape) == (16, 16, 16)
        p = ds.patches[i]
        if p["foreground"]:
            assert label.any()
    before = ds.patches.copy()
    ds.set_epoch(1)
    assert not np.array_equal(before, ds.patches)
