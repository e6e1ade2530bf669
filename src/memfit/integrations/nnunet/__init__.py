"""nnU-Net v2: a plans file whose 3d_fullres patch and batch memfit chose for a GPU memory budget.

nnU-Net's planner (``ExperimentPlanner.get_plans_for_configuration``) walks the patch down from the median image
shape, re-deriving the network's topology at every patch (``get_pool_and_conv_props``: stages, strides, kernel
sizes), until a proxy of memory (``static_estimate_VRAM_usage``: conv output elements) is under a reference
scaled from 8 GB; the batch is then extrapolated from the proxy, at least 2 and at most a share of the dataset.

``memfit_planner`` subclasses that planner and replaces only the proxy: each patch on nnU-Net's own ladder is
decided by memfit's estimate of exactly the network that patch gets, trained as ``nnUNetTrainer`` trains it
(fp16 autocast with a GradScaler, SGD with Nesterov momentum, Dice + cross-entropy on every deep-supervision
output); the batch is the largest that fits, within nnU-Net's two rules. ``plan_nnunet`` runs it on a
preprocessed dataset and writes a new plans file beside the user's, so that
``nnUNetv2_train DATASET 3d_fullres FOLD -p <identifier>`` trains the memfit plan unchanged.

Example (needs ``nnunetv2`` and a dataset preprocessed by ``nnUNetv2_plan_and_preprocess``)::

    from memfit.integrations.nnunet import plan_nnunet
    result = plan_nnunet(4, budget="24GiB", gpu="h100")
    print(result.train_command)   # nnUNetv2_train 4 3d_fullres FOLD -p nnUNetPlans_memfit_24GiB
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "plan_nnunet": "memfit.integrations.nnunet.plan",
    "NnunetPlan": "memfit.integrations.nnunet.plan",
    "memfit_planner": "memfit.integrations.nnunet.planner",
    "budget_label": "memfit.integrations.nnunet.planner",
    "LadderStep": "memfit.integrations.nnunet.planner",
    "PatchChoice": "memfit.integrations.nnunet.planner",
    "nnunet_workload": "memfit.integrations.nnunet.trainer_step",
    "trainer_workload": "memfit.integrations.nnunet.trainer_step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.integrations.nnunet.plan import NnunetPlan as NnunetPlan
    from memfit.integrations.nnunet.plan import plan_nnunet as plan_nnunet
    from memfit.integrations.nnunet.planner import LadderStep as LadderStep
    from memfit.integrations.nnunet.planner import PatchChoice as PatchChoice
    from memfit.integrations.nnunet.planner import budget_label as budget_label
    from memfit.integrations.nnunet.planner import memfit_planner as memfit_planner
    from memfit.integrations.nnunet.trainer_step import nnunet_workload as nnunet_workload
    from memfit.integrations.nnunet.trainer_step import trainer_workload as trainer_workload
