"""Preprocessing cache: hits, atomic writes, resume, invalidation on parameter change, augmentation fresh."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.data.cache import CachedDataset, PreprocessCache
from memfit.errors import UsageError


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample, *, scale: float, clip: float):
        self.calls += 1
        return {"image": np.clip(sample * scale, -clip, clip).astype(np.float32), "mask": (sample > 0)}


def _raw(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((8, 8))


def test_second_read_is_a_hit_and_equal(tmp_path) -> None:
    t = Counter()
    cache = PreprocessCache(tmp_path, t, params={"scale": 2.0, "clip": 1.0})
    first = cache.get(3, lambda: _raw(3))
    second = cache.get(3, lambda: pytest.fail("a hit must not load the raw sample"))
    assert t.calls == 1
    np.testing.assert_array_equal(first["image"], second["image"])
    np.testing.assert_array_equal(second["mask"], _raw(3) > 0)


def test_parameter_change_invalidates_and_prune_removes_stale(tmp_path) -> None:
    t = Counter()
    a = PreprocessCache(tmp_path, t, params={"scale": 2.0, "clip": 1.0})
    a.get(0, lambda: _raw(0))
    b = PreprocessCache(tmp_path, t, params={"scale": 3.0, "clip": 1.0})
    assert b.directory != a.directory and 0 not in b
    out = b.get(0, lambda: _raw(0))
    assert t.calls == 2
    np.testing.assert_allclose(out["image"], np.clip(_raw(0) * 3.0, -1, 1).astype(np.float32))
    assert b.prune() == [a.directory] and not a.directory.exists()


def test_crash_mid_write_leaves_no_item_and_fill_resumes(tmp_path, monkeypatch) -> None:
    t = Counter()
    cache = PreprocessCache(tmp_path, t, params={"scale": 1.0, "clip": 5.0})
    real_savez = np.savez
    writes = {"n": 0}

    def crashing_savez(f, **arrays):
        writes["n"] += 1
        if writes["n"] == 4:
            f.write(b"partial")  # bytes hit the temp file, then the process "dies"
            raise KeyboardInterrupt
        real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", crashing_savez)
    with pytest.raises(KeyboardInterrupt):
        cache.fill(range(10), _raw)
    monkeypatch.setattr(np, "savez", real_savez)
    done = sorted(p.name for p in cache.directory.glob("*.npz"))
    assert done == [f"{i:08d}.npz" for i in range(3)]  # item 3 was never renamed into place
    assert not list(cache.directory.glob(".*"))  # no temporary file left behind, whatever its name
    result = cache.fill(range(10), _raw)
    assert (result.written, result.skipped) == (7, 3) and result.bytes_on_disk > 0
    for i in range(10):
        np.testing.assert_array_equal(cache.get(i, lambda: None)["mask"], _raw(i) > 0)


def test_a_full_disk_fails_the_item_not_the_cache(tmp_path, monkeypatch) -> None:
    cache = PreprocessCache(tmp_path, Counter(), params={"scale": 1.0, "clip": 5.0})
    cache.get(0, lambda: _raw(0))

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full_disk)
    with pytest.raises(UsageError, match="No space left on device"):
        cache.get(1, lambda: _raw(1))
    monkeypatch.undo()
    assert sorted(p.name for p in cache.directory.iterdir()) == ["00000000.npz", "manifest.json"]


def test_augmentation_runs_fresh_on_cached_output(tmp_path) -> None:
    rng = np.random.default_rng(0)
    ds = CachedDataset([_raw(i) for i in range(4)], PreprocessCache(tmp_path, Counter(), params={"scale": 1.0,
                                                                                                "clip": 9.0}),
                       augment=lambda x: x["image"] + rng.standard_normal(x["image"].shape))
    a, b = ds[1], ds[1]
    assert not np.array_equal(a, b) and len(ds) == 4


def test_tuple_and_tensor_outputs_round_trip(tmp_path) -> None:
    import torch

    cache = PreprocessCache(tmp_path, lambda x, k: (torch.as_tensor(x) * k, np.arange(3)), params={"k": 2})
    out = cache.get(0, lambda: np.ones(2))
    assert isinstance(out, tuple) and out[0].tolist() == [2.0, 2.0] and out[1].tolist() == [0, 1, 2]
