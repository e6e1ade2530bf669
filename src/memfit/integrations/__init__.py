"""memfit where people already train: nnU-Net v2 plans (``plan_nnunet``).

Names load on first use (``memfit._lazy``), so importing the package stays light and the frameworks stay optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "plan_nnunet": "memfit.integrations.nnunet.plan",
    "NnunetPlan": "memfit.integrations.nnunet.plan",
    "memfit_planner": "memfit.integrations.nnunet.planner",
    "nnunet_workload": "memfit.integrations.nnunet.trainer_step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.integrations.nnunet.plan import NnunetPlan as NnunetPlan
    from memfit.integrations.nnunet.plan import plan_nnunet as plan_nnunet
    from memfit.integrations.nnunet.planner import memfit_planner as memfit_planner
    from memfit.integrations.nnunet.trainer_step import nnunet_workload as nnunet_workload
