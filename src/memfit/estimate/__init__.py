"""Will it fit? ``estimate()`` traces a training step on fake tensors and replays it through a model of PyTorch's caching allocator; ``measure`` runs the same step on a GPU.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "estimate": "memfit.estimate.predict",
    "Estimate": "memfit.estimate.predict",
    "TensorAtPeak": "memfit.estimate.predict",
    "TimelinePoint": "memfit.estimate.predict",
    "AllocatorConfig": "memfit.estimate.allocator_config",
    "GpuSpec": "memfit.estimate.gpus",
    "gpu_spec": "memfit.estimate.gpus",
    "StepCost": "memfit.estimate.op_costs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.estimate.allocator_config import AllocatorConfig as AllocatorConfig
    from memfit.estimate.gpus import GpuSpec as GpuSpec
    from memfit.estimate.gpus import gpu_spec as gpu_spec
    from memfit.estimate.op_costs import StepCost as StepCost
    from memfit.estimate.predict import Estimate as Estimate
    from memfit.estimate.predict import TensorAtPeak as TensorAtPeak
    from memfit.estimate.predict import TimelinePoint as TimelinePoint
    from memfit.estimate.predict import estimate as estimate
