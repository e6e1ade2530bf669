"""The training step ``nnUNetTrainer.train_step`` runs, as a memfit ``Workload``: the network nnU-Net builds from a
plans ``architecture``, its deep-supervision loss, its optimizer, fp16 autocast with a GradScaler.

Example (needs ``nnunetv2``)::

    import memfit
    from memfit.integrations.nnunet import nnunet_workload
    est = memfit.estimate(nnunet_workload("nnUNetPlans.json", "dataset.json"), gpu="h100")
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.workload.spec import Workload

CONFIGURATION = "3d_fullres"
"""The configuration memfit plans; the others are copied from the source plans unchanged."""

# nnUNetTrainer's optimizer (nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py: __init__ and configure_optimizers)
NNUNET_LR = 1e-2
NNUNET_WEIGHT_DECAY = 3e-5
NNUNET_MOMENTUM = 0.99
# nnUNetTrainer._build_loss: Dice smoothing
NNUNET_DICE_SMOOTH = 1e-5


def require_nnunet() -> None:
    """Fail with one line when nnU-Net v2 is not installed."""
    try:
        import nnunetv2  # noqa: F401
    except ImportError:
        raise UsageError("memfit's nnU-Net integration needs nnunetv2: pip install 'memfit[nnunet]' "
                         "(or pip install nnunetv2).") from None


def trainer_workload(
    architecture: Mapping[str, Any],
    patch_size: Sequence[int],
    batch_size: int,
    *,
    num_input_channels: int,
    label_manager: Any,
    batch_dice: bool = False,
    name: str = "nnU-Net",
) -> Workload:
    """The training step ``nnUNetTrainer.train_step`` runs for a plans ``architecture`` at ``patch_size``.

    The network is built by nnU-Net's ``get_network_from_plans`` with deep supervision on; the loss is nnU-Net's
    own (``DC_and_CE_loss``, or ``DC_and_BCE_loss`` for region labels, with ``MemoryEfficientSoftDiceLoss``)
    wrapped in ``DeepSupervisionWrapper`` with the trainer's weights; the batch is ``batch_size`` patches of fp32
    data and one int16 target per deep-supervision scale (bool per region), as nnU-Net's data loader and its
    ``DownsampleSegForDSTransform`` deliver them; SGD with Nesterov momentum under fp16 autocast and a GradScaler.
    The output stays alive through backward and the optimizer step, as in ``train_step``. Not modelled:
    ``clip_grad_norm_`` (per-tensor norms, a few KiB) and ``torch.compile``, which nnU-Net turns on by default on
    CUDA (``nnUNet_compile``) and which usually needs less activation memory than the eager step predicted here.

    Args:
        architecture: a configuration's ``architecture`` entry (``network_class_name``, ``arch_kwargs``,
            ``_kw_requires_import``).
        patch_size: spatial size of one sample; must be divisible by the product of the strides on each axis.
        batch_size: patches per step.
        num_input_channels: image channels (``determine_num_input_channels``).
        label_manager: nnU-Net's ``LabelManager`` for the dataset's labels.
        batch_dice: the configuration's ``batch_dice`` (where the Dice sums; no memory difference to speak of).
        name: a name for reports.
    """
    import numpy as np
    import torch
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss, DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    arch = copy.deepcopy(dict(architecture))
    strides = np.array(arch["arch_kwargs"]["strides"], dtype=np.int64)
    # one output per decoder stage, at the resolution after each encoder stage but the deepest
    # (nnUNetTrainer._get_deep_supervision_scales)
    downsampling = [tuple(int(s) for s in row) for row in np.cumprod(strides, axis=0)[:-1]]
    heads = int(label_manager.num_segmentation_heads)
    regions = bool(label_manager.has_regions)
    ignore_label = label_manager.ignore_label

    def model() -> torch.nn.Module:
        # allow_init=False: the weights' values do not change memory, and the estimator builds on fake tensors
        return get_network_from_plans(arch["network_class_name"], arch["arch_kwargs"], arch["_kw_requires_import"],
                                      num_input_channels, heads, allow_init=False, deep_supervision=True)

    def batch(n: int, patch: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        data = torch.randn(n, num_input_channels, *patch)
        targets = []
        for scale in downsampling:
            shape = [p // s for p, s in zip(patch, scale, strict=True)]
            if regions:
                targets.append(torch.zeros(n, heads, *shape, dtype=torch.bool))
            else:
                targets.append(torch.randint(0, heads, (n, 1, *shape), dtype=torch.int16))
        return data, targets

    if regions:
        base_loss: Any = DC_and_BCE_loss({}, {"batch_dice": batch_dice, "do_bg": True, "smooth": NNUNET_DICE_SMOOTH,
                                              "ddp": False},
                                         use_ignore_label=ignore_label is not None,
                                         dice_class=MemoryEfficientSoftDiceLoss)
    else:
        base_loss = DC_and_CE_loss({"batch_dice": batch_dice, "smooth": NNUNET_DICE_SMOOTH, "do_bg": False,
                                    "ddp": False}, {}, weight_ce=1, weight_dice=1, ignore_label=ignore_label,
                                   dice_class=MemoryEfficientSoftDiceLoss)
    # nnUNetTrainer._build_loss: weights halve with each coarser output, the coarsest gets none, they sum to 1
    weights = np.array([0.5**i for i in range(len(downsampling))])
    weights[-1] = 0
    if weights.sum() == 0:  # a two-stage network has one output: nnU-Net's weight is NaN, the loss still computed
        weights[-1] = 1
    loss = DeepSupervisionWrapper(base_loss, weights / weights.sum())

    return Workload(
        model=model,
        batch=batch,
        loss=lambda out, b: loss(out, b[1]),
        optimizer=lambda params: torch.optim.SGD(params, NNUNET_LR, weight_decay=NNUNET_WEIGHT_DECAY,
                                                 momentum=NNUNET_MOMENTUM, nesterov=True),
        batch_size=batch_size,
        precision="fp16",
        patch_size=tuple(int(p) for p in patch_size),
        patch_multiple=tuple(int(m) for m in np.prod(strides, axis=0)),
        name=name,
        description=f"nnUNetTrainer step: {arch['network_class_name'].rsplit('.', 1)[-1]}, "
                    f"{arch['arch_kwargs']['n_stages']} stages, deep supervision, fp16",
        tags=("nnunet", "segmentation"),
    )


TrainerTrial = Callable[[Mapping[str, Any], Sequence[int], int, int, int], bool]
"""``trial(architecture, patch_size, batch_size, input_channels, cap_bytes)``: does nnUNetTrainer's step for that
network, patch and batch run under an allocator cap of ``cap_bytes`` (the CUDA context not included)?"""

_TRIAL_MODULE = '''"""nnUNetTrainer's step at one patch, written by memfit for a trial under a memory cap (see its .json)."""
from pathlib import Path

from memfit.integrations.nnunet.trainer_step import workload_from_trial_file

workload = workload_from_trial_file(Path(__file__).with_suffix(".json"))
'''


def trials_on_this_gpu(labels: Mapping[str, Any], regions_class_order: Sequence[int] | None = None, *,
                       timeout_s: float = 600) -> TrainerTrial:
    """A ``TrainerTrial`` that runs the step in a fresh process on this machine's GPU, the protocol of ``memfit
    measure`` (three steps, ``memfit.estimate.measure.run_trial``) under the cap; it ran if no step ran out of
    memory (a failure for another reason counts as not run). ``labels`` and ``regions_class_order`` are the
    dataset.json's, which make nnU-Net's label manager."""
    from memfit.estimate.measure import run_trial

    def trial(architecture: Mapping[str, Any], patch_size: Sequence[int], batch_size: int, input_channels: int,
              cap_bytes: int) -> bool:
        with tempfile.TemporaryDirectory(prefix="memfit-nnunet-trial-") as folder:
            spec = Path(folder) / "nnunet_step.py"
            spec.with_suffix(".json").write_text(json.dumps({
                "architecture": architecture, "patch_size": [int(p) for p in patch_size],
                "batch_size": int(batch_size), "input_channels": int(input_channels), "labels": dict(labels),
                "regions_class_order": list(regions_class_order) if regions_class_order is not None else None}))
            spec.write_text(_TRIAL_MODULE)
            return run_trial(f"{spec}:workload", cap_bytes=cap_bytes, timeout_s=timeout_s).ok

    return trial


def workload_from_trial_file(path: str | os.PathLike[str]) -> Workload:
    """The step a ``trials_on_this_gpu`` trial runs, from the JSON it wrote."""
    from nnunetv2.utilities.label_handling.label_handling import LabelManager

    args = read_json(path, "trial")
    return trainer_workload(args["architecture"], args["patch_size"], args["batch_size"],
                            num_input_channels=args["input_channels"],
                            label_manager=LabelManager(args["labels"], args["regions_class_order"]))


def nnunet_workload(
    plans: str | os.PathLike[str] | Mapping[str, Any],
    dataset_json: str | os.PathLike[str] | Mapping[str, Any],
    configuration: str = CONFIGURATION,
    *,
    patch_size: Sequence[int] | None = None,
    architecture: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
) -> Workload:
    """The training step ``nnUNetv2_train`` runs for ``configuration`` of a plans file (or with its patch,
    architecture or batch replaced), for ``memfit.estimate``.

    Example::

        est = memfit.estimate(nnunet_workload("nnUNetPlans.json", "dataset.json"), gpu="h100")
    """
    require_nnunet()
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    plans_dict = read_json(plans, "plans") if not isinstance(plans, Mapping) else dict(plans)
    dataset = read_json(dataset_json, "dataset.json") if not isinstance(dataset_json, Mapping) else dict(dataset_json)
    manager = PlansManager(plans_dict)
    if configuration not in manager.available_configurations:
        raise UsageError(f"the plans have no configuration {configuration!r}: they have "
                         f"{', '.join(manager.available_configurations)}.")
    config = manager.get_configuration(configuration)
    if architecture is None:
        architecture = {"network_class_name": config.network_arch_class_name,
                        "arch_kwargs": config.network_arch_init_kwargs,
                        "_kw_requires_import": config.network_arch_init_kwargs_req_import}
    return trainer_workload(
        architecture,
        patch_size if patch_size is not None else config.patch_size,
        batch_size if batch_size is not None else config.batch_size,
        num_input_channels=determine_num_input_channels(manager, config, dataset),
        label_manager=manager.get_label_manager(dataset),
        batch_dice=bool(config.batch_dice),
        name=f"nnU-Net {plans_dict.get('dataset_name', '')} {configuration}".strip(),
    )


def read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{what} file not found: {path}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the {what} file {path}: {exc}.") from None
    if not isinstance(data, dict):
        raise UsageError(f"the {what} file {path} is not a JSON object.")
    return data
