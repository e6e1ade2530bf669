"""Memory-safe data loading: lazy rasters and patches, worker-safe metadata, loader settings, a preprocessing
cache, and a rank-balanced batch sampler.

Importing ``memfit.data`` is cheap; each submodule loads torch, numpy or tifffile only when used.
"""

from __future__ import annotations

from typing import Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "RasterSource": "memfit.data.rasters",
    "open_raster": "memfit.data.rasters",
    "grid_windows": "memfit.data.rasters",
    "TileDataset": "memfit.data.rasters",
    "RandomTileDataset": "memfit.data.rasters",
    "PatchSampler": "memfit.data.patches",
    "PatchDataset": "memfit.data.patches",
    "ForegroundIndex": "memfit.data.patches",
    "index_foreground": "memfit.data.patches",
    "SampleTable": "memfit.data.storage",
    "ContainerFinding": "memfit.data.storage",
    "check_dataset_containers": "memfit.data.storage",
    "LoaderSettings": "memfit.data.loader",
    "suggest_loader_settings": "memfit.data.loader",
    "PreprocessCache": "memfit.data.cache",
    "CachedDataset": "memfit.data.cache",
    "CacheFill": "memfit.data.cache",
    "BalancedBatchSampler": "memfit.data.balance",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)
