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
    "predict_step_time": "memfit.speed.step_time",
    "calibrate": "memfit.speed.step_time",
    "measure": "memfit.estimate.measure",
    "explain": "memfit.explain",
    "plan": "memfit.plan",
    "plan_patch": "memfit.plan.patch",
    "parse_oom_message": "memfit.explain.oom_message",
    "diagnose_oom": "memfit.explain.oom_diagnosis",
    "load_workload": "memfit.workload.loading",
    "builtin_workload": "memfit.workload.zoo",
    "TrainStep": "memfit.guard.step",
    "is_oom": "memfit.guard.oom",
    "count_tokens": "memfit.guard.microbatch",
    "collect_rank_memory": "memfit.distributed.ranks",
    "gather_rank_memory": "memfit.distributed.ranks",
    "diagnose": "memfit.distributed.ranks",
    "shard_model": "memfit.distributed.shard",
    "model_state_memory": "memfit.distributed.shard",
    "compare_sharding": "memfit.distributed.shard",
    "suggest_loader_settings": "memfit.data.loader",
    "check_dataset_containers": "memfit.data.storage",
    # results
    "Estimate": "memfit.estimate.predict",
    "Measurement": "memfit.estimate.measure",
    "Explanation": "memfit.explain.explanation",
    "Fix": "memfit.explain.fixes",
    "Plan": "memfit.plan.records",
    "Candidate": "memfit.plan.records",
    "OomMessage": "memfit.explain.oom_message",
    "OomDiagnosis": "memfit.explain.oom_diagnosis",
    "StepCost": "memfit.estimate.op_costs",
    "SpeedPrediction": "memfit.speed.step_time",
    "Calibration": "memfit.speed.step_time",
    "StepMetrics": "memfit.guard.step",
    "RankMemory": "memfit.distributed.ranks",
    "RankReport": "memfit.distributed.ranks",
    "Finding": "memfit.distributed.ranks",
    "ModelStateMemory": "memfit.distributed.shard",
    "ShardingComparison": "memfit.distributed.shard",
    "Sharding": "memfit.distributed.shard",
    "LoaderSettings": "memfit.data.loader",
    "CacheFill": "memfit.data.cache",
    # configuration
    "Workload": "memfit.workload.spec",
    "AllocatorConfig": "memfit.estimate.allocator_config",
    "GpuSpec": "memfit.estimate.gpus",
    "SpeedParams": "memfit.speed.step_time",
    "GuardConfig": "memfit.guard.step",
    "BatchSplitter": "memfit.guard.microbatch",
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
    "DataError": "memfit.errors",
    "UserCodeError": "memfit.errors",
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
    """``memfit.estimate``, ``memfit.explain`` and ``memfit.plan`` stay the functions after their feature packages
    (folders of the same names) are imported. Python's import binds a subpackage to its parent's attribute when it
    first loads; that binding is skipped here, so the name resolves lazily through ``__getattr__`` to the function
    (without loading torch before the function is used)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see; at run time the names load lazily
    from memfit.data.balance import BalancedBatchSampler as BalancedBatchSampler
    from memfit.data.cache import CacheFill as CacheFill
    from memfit.data.cache import PreprocessCache as PreprocessCache
    from memfit.data.loader import (
        LoaderSettings as LoaderSettings,
    )
    from memfit.data.loader import (
        suggest_loader_settings as suggest_loader_settings,
    )
    from memfit.data.patches import PatchDataset as PatchDataset
    from memfit.data.patches import PatchSampler as PatchSampler
    from memfit.data.rasters import RandomTileDataset as RandomTileDataset
    from memfit.data.rasters import TileDataset as TileDataset
    from memfit.data.storage import (
        SampleTable as SampleTable,
    )
    from memfit.data.storage import (
        check_dataset_containers as check_dataset_containers,
    )
    from memfit.distributed.ranks import (
        Finding as Finding,
    )
    from memfit.distributed.ranks import (
        RankMemory as RankMemory,
    )
    from memfit.distributed.ranks import (
        RankReport as RankReport,
    )
    from memfit.distributed.ranks import (
        collect_rank_memory as collect_rank_memory,
    )
    from memfit.distributed.ranks import (
        diagnose as diagnose,
    )
    from memfit.distributed.ranks import (
        gather_rank_memory as gather_rank_memory,
    )
    from memfit.distributed.shard import (
        ModelStateMemory as ModelStateMemory,
    )
    from memfit.distributed.shard import (
        Sharding as Sharding,
    )
    from memfit.distributed.shard import (
        ShardingComparison as ShardingComparison,
    )
    from memfit.distributed.shard import (
        compare_sharding as compare_sharding,
    )
    from memfit.distributed.shard import (
        model_state_memory as model_state_memory,
    )
    from memfit.distributed.shard import (
        shard_model as shard_model,
    )
    from memfit.errors import (
        BudgetTooSmallError as BudgetTooSmallError,
    )
    from memfit.errors import (
        DataError as DataError,
    )
    from memfit.errors import (
        DataLoaderMemoryWarning as DataLoaderMemoryWarning,
    )
    from memfit.errors import (
        DeviceError as DeviceError,
    )
    from memfit.errors import (
        MemfitError as MemfitError,
    )
    from memfit.errors import (
        MissingExtraError as MissingExtraError,
    )
    from memfit.errors import (
        NumericsError as NumericsError,
    )
    from memfit.errors import (
        OptimizerStepOOMError as OptimizerStepOOMError,
    )
    from memfit.errors import (
        RankAgreementError as RankAgreementError,
    )
    from memfit.errors import (
        StepOOMError as StepOOMError,
    )
    from memfit.errors import (
        TraceError as TraceError,
    )
    from memfit.errors import (
        UsageError as UsageError,
    )
    from memfit.errors import (
        UserCodeError as UserCodeError,
    )
    from memfit.errors import (
        WorkloadError as WorkloadError,
    )
    from memfit.estimate.allocator_config import AllocatorConfig as AllocatorConfig
    from memfit.estimate.gpus import GpuSpec as GpuSpec
    from memfit.estimate.measure import Measurement as Measurement
    from memfit.estimate.measure import measure as measure
    from memfit.estimate.op_costs import StepCost as StepCost
    from memfit.estimate.predict import Estimate as Estimate
    from memfit.estimate.predict import estimate as estimate
    from memfit.explain.explanation import Explanation as Explanation
    from memfit.explain.explanation import explain as explain
    from memfit.explain.fixes import Fix as Fix
    from memfit.explain.oom_diagnosis import OomDiagnosis as OomDiagnosis
    from memfit.explain.oom_diagnosis import diagnose_oom as diagnose_oom
    from memfit.explain.oom_message import OomMessage as OomMessage
    from memfit.explain.oom_message import parse_oom_message as parse_oom_message
    from memfit.guard.microbatch import BatchSplitter as BatchSplitter
    from memfit.guard.microbatch import count_tokens as count_tokens
    from memfit.guard.oom import is_oom as is_oom
    from memfit.guard.step import (
        GuardConfig as GuardConfig,
    )
    from memfit.guard.step import (
        StepMetrics as StepMetrics,
    )
    from memfit.guard.step import (
        TrainStep as TrainStep,
    )
    from memfit.plan.patch import plan_patch as plan_patch
    from memfit.plan.records import Candidate as Candidate
    from memfit.plan.records import Plan as Plan
    from memfit.plan.search import plan as plan
    from memfit.speed.step_time import (
        Calibration as Calibration,
    )
    from memfit.speed.step_time import (
        SpeedParams as SpeedParams,
    )
    from memfit.speed.step_time import (
        SpeedPrediction as SpeedPrediction,
    )
    from memfit.speed.step_time import (
        calibrate as calibrate,
    )
    from memfit.speed.step_time import (
        predict_step_time as predict_step_time,
    )
    from memfit.workload.loading import load_workload as load_workload
    from memfit.workload.spec import Workload as Workload
    from memfit.workload.zoo import builtin_workload as builtin_workload
