"""memfit where people already train: Lightning, the Hugging Face Trainer, Accelerate and nnU-Net v2's plans.

Each framework's module imports that framework (``pip install 'memfit[integrations]'``); this package imports
none of them, and its names load on first use (``memfit._lazy``)::

    from memfit.integrations.lightning import MemfitCallback
    from memfit.integrations.huggingface import MemfitTrainer, plan_training_arguments
    from memfit.integrations.accelerate import find_executable_batch_size
    from memfit.integrations.nnunet import plan_nnunet

docs/integrations.md and docs/nnunet.md say what each does and does not promise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "WindowGuard": "memfit.integrations.window",
    "oom_report": "memfit.integrations.oom_report",
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
    from memfit.integrations.oom_report import oom_report as oom_report
    from memfit.integrations.window import WindowGuard as WindowGuard
