"""Tile windows: coverage, bounds, determinism; lazy reading of npy/TIFF/Zarr; flat host memory."""

from __future__ import annotations

import builtins
import gc

import numpy as np
import pytest
import torch

from memfit.data.rasters import WINDOW_DTYPE, RandomTileDataset, TileDataset, grid_windows, open_raster
from memfit.errors import MissingExtraError, UsageError


def _coverage(windows: np.ndarray, height: int, width: int) -> np.ndarray:
    hits = np.zeros((height, width), dtype=np.int32)
    for w in windows:
        hits[max(w["row"], 0) : w["row"] + w["height"], max(w["col"], 0) : w["col"] + w["width"]] += 1
    return hits


@pytest.mark.parametrize("height,width,size,overlap", [(100, 120, 32, 0), (100, 120, 32, 7), (31, 200, 32, 4)])
def test_shift_and_pad_cover_every_pixel(height: int, width: int, size: int, overlap: int) -> None:
    for edge in ("shift", "pad"):
        windows = grid_windows(height, width, size=size, overlap=overlap, edge=edge)
        assert windows.dtype == WINDOW_DTYPE
        assert (_coverage(windows, height, width) >= 1).all(), edge


def test_shift_windows_stay_inside_and_keep_stride() -> None:
    windows = grid_windows(100, 120, size=32, overlap=8, edge="shift")
    assert (windows["row"] >= 0).all() and (windows["row"] + 32 <= 100).all()
    assert (windows["col"] >= 0).all() and (windows["col"] + 32 <= 120).all()
    rows = np.unique(windows["row"])
    assert list(rows[:-1]) == [0, 24, 48] and rows[-1] == 100 - 32


def test_drop_keeps_only_whole_windows_and_pad_overhangs() -> None:
    dropped = grid_windows(100, 100, size=32, edge="drop")
    assert len(dropped) == 9 and (dropped["row"] + 32 <= 100).all()
    padded = grid_windows(100, 100, size=32, edge="pad")
    assert len(padded) == 16 and padded["row"].max() + 32 > 100


def test_bad_grid_arguments_raise_usage_errors() -> None:
    with pytest.raises(UsageError, match="overlap"):
        grid_windows(10, 10, size=4, overlap=4)
    with pytest.raises(UsageError, match="edge"):
        grid_windows(10, 10, size=4, edge="wrap")  # type: ignore[arg-type]


def _scene(rng: np.random.Generator, bands: int = 3, height: int = 300, width: int = 260) -> np.ndarray:
    return rng.integers(0, 60000, size=(bands, height, width), dtype=np.uint16)


def test_tiles_match_the_array_for_each_format(tmp_path) -> None:
    tifffile = pytest.importorskip("tifffile")
    zarr = pytest.importorskip("zarr")
    scene = _scene(np.random.default_rng(0))
    npy = tmp_path / "scene.npy"
    np.save(npy, scene)
    plain_tif = tmp_path / "plain.tif"
    tifffile.imwrite(plain_tif, np.moveaxis(scene, 0, -1))  # contiguous YXS: memory-mapped
    tiled_tif = tmp_path / "tiled.tif"
    tifffile.imwrite(tiled_tif, scene, tile=(64, 64), compression="zlib", planarconfig="separate", photometric="minisblack")
    zpath = tmp_path / "scene.zarr"
    z = zarr.open_array(str(zpath), mode="w", shape=scene.shape, chunks=(1, 64, 64), dtype=scene.dtype)
    z[:] = scene
    for path in (npy, plain_tif, tiled_tif, zpath):
        tiles = TileDataset.grid([path], size=64, overlap=16)
        assert len(tiles) == len(grid_windows(300, 260, size=64, overlap=16))
        for i in (0, len(tiles) // 2, len(tiles) - 1):
            w = tiles.windows[i]
            expected = scene[:, w["row"] : w["row"] + 64, w["col"] : w["col"] + 64]
            np.testing.assert_array_equal(tiles[i].numpy(), expected, err_msg=str(path))


def test_pad_windows_are_filled_outside(tmp_path) -> None:
    path = tmp_path / "gray.npy"
    np.save(path, np.ones((50, 50), dtype=np.float32))
    tiles = TileDataset.grid([path], size=32, edge="pad", fill=-1.0)
    last = tiles[len(tiles) - 1]
    assert tuple(last.shape) == (1, 32, 32)
    assert (last[:, :18, :18] == 1).all() and (last[:, 18:, :] == -1).all()


def test_random_tiles_deterministic_in_bounds_and_change_with_epoch(tmp_path) -> None:
    paths = []
    for i, (h, w) in enumerate([(40, 50), (400, 300)]):
        path = tmp_path / f"r{i}.npy"
        np.save(path, np.arange(h * w, dtype=np.int64).reshape(h, w))
        paths.append(path)
    a = RandomTileDataset(paths, size=32, length=200, seed=3)
    b = RandomTileDataset(paths, size=32, length=200, seed=3)
    windows_a = [a._window(i) for i in range(200)]
    assert windows_a == [b._window(i) for i in range(200)]
    heights, widths = [40, 400], [50, 300]
    for w in windows_a:
        assert 0 <= w["row"] <= heights[w["source"]] - 32 and 0 <= w["col"] <= widths[w["source"]] - 32
    # the big raster has ~300x more positions, so it must get nearly all the tiles
    assert sum(w["source"] == 1 for w in windows_a) > 190
    torch.testing.assert_close(a[5], b[5])
    a.set_epoch(1)
    assert [a._window(i) for i in range(200)] != windows_a


def test_tiles_through_forked_workers(tmp_path) -> None:
    path = tmp_path / "scene.npy"
    np.save(path, _scene(np.random.default_rng(1)))
    tiles = TileDataset.grid([path], size=64)
    loader = torch.utils.data.DataLoader(tiles, batch_size=4, num_workers=2)
    total = sum(int(batch.shape[0]) for batch in loader)
    assert total == len(tiles)


def test_missing_extra_names_the_install_command(tmp_path, monkeypatch) -> None:
    real_import = builtins.__import__

    def no_tifffile(name: str, *args, **kwargs):
        if name == "tifffile":
            raise ImportError("no tifffile")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "tifffile", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_tifffile)
    with pytest.raises(MissingExtraError, match=r"memfit\[data\]"):
        open_raster(tmp_path / "x.tif")


def _anon_rss() -> int:
    """Resident memory that is not file-backed (memmapped pages of the raster count as shared, not anonymous)."""
    psutil = pytest.importorskip("psutil")
    info = psutil.Process().memory_info()
    return int(info.rss - info.shared)


def test_host_memory_flat_with_10x_more_data(tmp_path) -> None:
    tifffile = pytest.importorskip("tifffile")
    growth = {}
    for scale, side in (("1x", 1024), ("10x", 3238)):  # 10x the pixels: 3238**2 ~ 10 * 1024**2
        path = tmp_path / f"scene_{scale}.tif"
        data = np.random.default_rng(0).integers(0, 255, size=(side, side, 4), dtype=np.uint8)
        tifffile.imwrite(path, data, tile=(256, 256), compression="zlib")
        file_pixels_bytes = data.nbytes
        del data
        gc.collect()
        tiles = RandomTileDataset([path], size=128, length=300, seed=0)
        tiles[0]  # open the file and warm caches before measuring
        before = _anon_rss()
        for i in range(300):
            tiles[i]
        gc.collect()
        growth[scale] = _anon_rss() - before
        # reading 300 windows must cost far less than the decoded raster (40 MiB at 10x)
        assert growth[scale] < file_pixels_bytes / 4, (scale, growth)
    # resident memory can also shrink during a loop (the allocator handing back what an earlier test left): a
    # negative growth at 1x is no allowance against 10x (seen in CI: -32 MiB at 1x, +76 KiB at 10x)
    assert growth["10x"] < max(growth["1x"], 0) + 16 * 2**20, growth
