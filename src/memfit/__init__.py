"""memfit: make PyTorch training fit in GPU memory at the best speed, and explain why it doesn't.

``import memfit`` stays light: torch and the heavy parts load on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it. Grouped: entry points, results, configuration.
_EXPORTS: dict[str, str] = {
    # entry points
    "estimate": "memfit.estimate",
    "measure": "memfit.measure",
    "load_workload": "memfit.workload",
    "builtin_workload": "memfit.zoo",
    "TrainStep": "memfit.guard",
    "is_oom": "memfit.oom",
    "count_tokens": "memfit.microbatch",
    # results
    "Estimate": "memfit.estimate",
    "Measurement": "memfit.measure",
    "StepMetrics": "memfit.guard",
    # configuration
    "Workload": "memfit.workload",
    "AllocatorConfig": "memfit.allocator",
    "GpuSpec": "memfit.gpus",
    "GuardConfig": "memfit.guard",
    "BatchSplitter": "memfit.microbatch",
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
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from memfit.errors import *  # noqa: F403
