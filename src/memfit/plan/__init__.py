"""What is the fastest configuration that fits? ``plan()`` searches micro-batch, accumulation, checkpointing and the optimizer; ``plan_patch()`` the largest input patch.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "plan": "memfit.plan.search",
    "Plan": "memfit.plan.records",
    "Candidate": "memfit.plan.records",
    "Config": "memfit.plan.records",
    "plan_patch": "memfit.plan.patch",
    "patch_ladder": "memfit.plan.patch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.plan.patch import patch_ladder as patch_ladder
    from memfit.plan.patch import plan_patch as plan_patch
    from memfit.plan.records import Candidate as Candidate
    from memfit.plan.records import Config as Config
    from memfit.plan.records import Plan as Plan
    from memfit.plan.search import plan as plan
