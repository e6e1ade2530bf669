"""memfit: make PyTorch training fit in GPU memory at the best speed, and explain why it doesn't.

``import memfit`` stays light: torch and the heavy parts load on first use of a name below.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

__version__ = "0.1.0"

# name -> module that defines it. Grouped: entry points, results, configuration.
_EXPORTS: dict[str, str] = {
    # entry points: will it fit, why, keep it running, feed it
    "estimate": "memfit.estimate",
    "predict_step_time": "memfit.speed",
    "calibrate": "memfit.speed",
    "measure": "memfit.measure",
    "explain": "memfit.explain",
    "plan": "memfit.plan",
    "plan_patch": "memfit.patch",
    "parse_oom_message": "memfit.oom_message",
    "diagnose_oom": "memfit.oom_message",
    "load_workload": "memfit.workload",
    "builtin_workload": "memfit.zoo",
    "TrainStep": "memfit.guard",
    "is_oom": "memfit.oom",
    "count_tokens": "memfit.microbatch",
    "collect_rank_memory": "memfit.ranks",
    "gather_rank_memory": "memfit.ranks",
    "diagnose": "memfit.ranks",
    "shard_model": "memfit.shard",
    "model_state_memory": "memfit.shard",
    "compare_sharding": "memfit.shard",
    "suggest_loader_settings": "memfit.data.loader",
    "check_dataset_containers": "memfit.data.storage",
    # results
    "Estimate": "memfit.estimate",
    "Measurement": "memfit.measure",
    "Explanation": "memfit.explain",
    "Fix": "memfit.fixes",
    "Plan": "memfit.plan",
    "Candidate": "memfit.plan",
    "OomMessage": "memfit.oom_message",
    "OomDiagnosis": "memfit.oom_message",
    "StepCost": "memfit.costs",
    "SpeedPrediction": "memfit.speed",
    "Calibration": "memfit.speed",
    "StepMetrics": "memfit.guard",
    "RankMemory": "memfit.ranks",
    "RankReport": "memfit.ranks",
    "Finding": "memfit.ranks",
    "ModelStateMemory": "memfit.shard",
    "ShardingComparison": "memfit.shard",
    "Sharding": "memfit.shard",
    "LoaderSettings": "memfit.data.loader",
    "CacheFill": "memfit.data.cache",
    # configuration
    "Workload": "memfit.workload",
    "AllocatorConfig": "memfit.allocator",
    "GpuSpec": "memfit.gpus",
    "SpeedParams": "memfit.speed",
    "GuardConfig": "memfit.guard",
    "BatchSplitter": "memfit.microbatch",
    # data (memfit.data holds the rest)
    "TileDataset": "memfit.data.rasters",
    "RandomTileDataset": "memfit.data.rasters",
    "PatchSampler": "memfit.data.patches",
    "PatchDataset": "memfit.data.patches",
    "SampleTable": "memfit.data.storage",
    "PreprocessCache": "memfit.data.cache",
    "BalancedBatchSampler": "memfit.data.balance",
    # errors
    "MemfitError": "memfit.errors",
    "UsageError": "memfit.errors",
    "WorkloadError": "memfit.errors",
    "TraceError": "memfit.errors",
    "DeviceError": "memfit.errors",
    "BudgetTooSmallError": "memfit.errors",
    "StepOOMError": "memfit.errors",
    "OptimizerStepOOMError": "memfit.errors",
    "RankAgreementError": "memfit.errors",
    "NumericsError": "memfit.errors",
    "MissingExtraError": "memfit.errors",
    "DataLoaderMemoryWarning": "memfit.errors",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """``memfit.estimate`` is the function even after ``import memfit.estimate`` (the submodule of that name):
    Python's import sets the package attribute to the submodule when it is first loaded, and this puts the
    exported function there instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__ and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover
    from memfit.errors import *  # noqa: F403
