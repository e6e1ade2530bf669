"""Keep it running: ``TrainStep`` survives a CUDA out-of-memory error with the same gradients, every rank in agreement.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "TrainStep": "memfit.guard.step",
    "StepMetrics": "memfit.guard.step",
    "GuardConfig": "memfit.guard.step",
    "is_oom": "memfit.guard.oom",
    "BatchSplitter": "memfit.guard.microbatch",
    "count_tokens": "memfit.guard.microbatch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.guard.microbatch import BatchSplitter as BatchSplitter
    from memfit.guard.microbatch import count_tokens as count_tokens
    from memfit.guard.oom import is_oom as is_oom
    from memfit.guard.step import GuardConfig as GuardConfig
    from memfit.guard.step import StepMetrics as StepMetrics
    from memfit.guard.step import TrainStep as TrainStep
