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

import contextlib
import copy
import inspect
import io
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit._io import write_atomic
from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.predict import Estimate, estimate
from memfit.plan.search import DEFAULT_MARGIN, check_budget
from memfit.records import JsonRecord
from memfit.units import format_bytes, parse_bytes
from memfit.workload.spec import Workload

logger = logging.getLogger(__name__)

CONFIGURATION = "3d_fullres"
"""The configuration memfit plans; the others are copied from the source plans unchanged."""
MEMFIT_KEY = "memfit"
"""Top-level key of a plans file memfit wrote (nnU-Net reads only the keys it knows): what it was planned for."""

# nnUNetTrainer's optimizer (nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py: __init__ and configure_optimizers)
NNUNET_LR = 1e-2
NNUNET_WEIGHT_DECAY = 3e-5
NNUNET_MOMENTUM = 0.99
# nnUNetTrainer._build_loss: Dice smoothing
NNUNET_DICE_SMOOTH = 1e-5


def _nnunet() -> None:
    """Fail with one line when nnU-Net v2 is not installed."""
    try:
        import nnunetv2  # noqa: F401
    except ImportError:
        raise UsageError("memfit's nnU-Net integration needs nnunetv2: pip install 'memfit[nnunet]' "
                         "(or pip install nnunetv2).") from None


# -- the training step nnUNetTrainer runs ----------------------------------------------------------------------


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
    _nnunet()
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    plans_dict = _read_json(plans, "plans") if not isinstance(plans, Mapping) else dict(plans)
    dataset = _read_json(dataset_json, "dataset.json") if not isinstance(dataset_json, Mapping) else dict(dataset_json)
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


def _read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{what} file not found: {path}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the {what} file {path}: {exc}.") from None
    if not isinstance(data, dict):
        raise UsageError(f"the {what} file {path} is not a JSON object.")
    return data


# -- memfit's estimates in nnU-Net's planner ---------------------------------------------------------------------


@dataclass(frozen=True)
class LadderStep:
    """One patch on nnU-Net's ladder, with the network nnU-Net builds for it, decided by memfit."""

    patch_size: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    """The network's pooling per stage at this patch (``get_pool_and_conv_props``)."""
    device_bytes: int
    """memfit's ``device_upper_bytes`` at the smallest batch nnU-Net allows (2)."""
    fits: bool
    """``device_bytes <= budget × (1 - margin)``."""


@dataclass(frozen=True)
class PatchChoice:
    """A patch and batch for 3d_fullres, with memfit's prediction of the step nnUNetTrainer runs at them."""

    patch_size: tuple[int, ...]
    batch_size: int
    device_bytes: int
    """memfit's ``device_upper_bytes``: the GPU memory its "fits" verdict promises is enough (CUDA context
    included)."""
    peak_allocated_bytes: int
    """What ``torch.cuda.max_memory_allocated()`` would report."""
    fits_budget: bool
    """``device_bytes <= budget``."""

    @property
    def voxels_per_step(self) -> int:
        """Patch voxels × batch: how much of the images one optimizer step sees."""
        return math.prod(self.patch_size) * self.batch_size


class _Estimates:
    """memfit's estimates of nnUNetTrainer's step during one planning run, each network and patch once."""

    def __init__(self, gpu: GpuSpec, allocator: AllocatorConfig, budget_bytes: int, margin: float,
                 label_manager: Any) -> None:
        check_budget(budget_bytes, margin)
        self.gpu, self.allocator, self.label_manager = gpu, allocator, label_manager
        self.budget_bytes, self.margin = budget_bytes, margin
        self.limit_bytes = int(budget_bytes * (1 - margin))
        context = gpu.context_bytes(uses_cublas=False)
        if self.limit_bytes <= context:
            raise BudgetTooSmallError(
                f"the budget {format_bytes(budget_bytes)} (less the {margin:.0%} margin) is not more than the CUDA "
                f"context alone on {gpu.name} ({format_bytes(context)}): no nnU-Net network fits. Give the memory "
                "this process may use, e.g. --budget 24GiB.")
        self.known: dict[str, Estimate] = {}
        self.ladder: list[LadderStep] = []
        self.runs = 0

    def estimate(self, architecture: Mapping[str, Any], patch: Sequence[int], batch: int,
                 input_channels: int) -> Estimate:
        from nnunetv2.utilities.json_export import recursive_fix_for_json_export

        arch = copy.deepcopy(dict(architecture))
        recursive_fix_for_json_export(arch)  # numpy integers and tuples as nnU-Net writes them: one key per network
        patch_size = tuple(int(p) for p in patch)
        key = json.dumps([arch, patch_size, batch, input_channels], sort_keys=True)
        if key not in self.known:
            w = trainer_workload(arch, patch_size, batch, num_input_channels=input_channels,
                                 label_manager=self.label_manager)
            self.known[key] = estimate(w, gpu=self.gpu, allocator=self.allocator)
            self.runs += 1
            logger.info("patch %s batch %d: %s", "×".join(map(str, patch_size)), batch,
                        format_bytes(self.known[key].device_upper_bytes))
        return self.known[key]

    def fits(self, est: Estimate) -> bool:
        return est.device_upper_bytes <= self.limit_bytes

    def rung(self, architecture: Mapping[str, Any], patch: Sequence[int], batch: int, input_channels: int,
             smallest_edge: int) -> int:
        """What nnU-Net's ladder compares with its reference: memfit's device bytes at this patch."""
        est = self.estimate(architecture, patch, batch, input_channels)
        step = LadderStep(patch_size=tuple(int(p) for p in patch),
                          strides=tuple(tuple(int(s) for s in row) for row in architecture["arch_kwargs"]["strides"]),
                          device_bytes=est.device_upper_bytes, fits=self.fits(est))
        self.ladder.append(step)
        if not step.fits and all(p <= smallest_edge for p in step.patch_size):
            # nnU-Net's loop would go on below the network's smallest feature map (and crash at a 0-voxel axis)
            raise BudgetTooSmallError(
                f"no patch on nnU-Net's ladder fits {format_bytes(self.budget_bytes)} at batch {batch}: the smallest, "
                f"{'×'.join(map(str, step.patch_size))}, needs {format_bytes(step.device_bytes)}. "
                "Try a larger budget or a GPU with more memory.")
        return est.device_upper_bytes

    def largest_batch(self, architecture: Mapping[str, Any], patch: Sequence[int], smallest: int, cap: int,
                      input_channels: int) -> int:
        """The largest batch in ``[smallest, cap]`` that fits (``smallest`` fits: the ladder stopped there).

        Memory is close to linear in the batch: the line through the two bounds guesses, an estimate of exactly
        the guess decides, and its neighbour closes the bracket when the line was right.
        """

        def need(b: int) -> int:
            return self.estimate(architecture, patch, b, input_channels).device_upper_bytes

        lo, hi = smallest, cap
        if hi <= lo or need(hi) <= self.limit_bytes:
            return max(lo, hi)
        while hi - lo > 1:
            slope = (need(hi) - need(lo)) / (hi - lo)
            guess = lo + int((self.limit_bytes - need(lo)) / slope) if slope > 0 else lo + 1
            guess = min(max(guess, lo + 1), hi - 1)
            if need(guess) <= self.limit_bytes:
                lo = guess
                if guess + 1 < hi and need(guess + 1) > self.limit_bytes:
                    hi = guess + 1
            else:
                hi = guess
                if guess - 1 > lo and need(guess - 1) <= self.limit_bytes:
                    lo = guess - 1
        return lo

    def choice(self, architecture: Mapping[str, Any], patch: Sequence[int], batch: int,
               input_channels: int) -> PatchChoice:
        est = self.estimate(architecture, patch, batch, input_channels)
        return PatchChoice(patch_size=tuple(int(p) for p in patch), batch_size=int(batch),
                           device_bytes=est.device_upper_bytes, peak_allocated_bytes=est.peak_allocated_bytes,
                           fits_budget=est.device_upper_bytes <= self.budget_bytes)


def budget_label(budget_bytes: int) -> str:
    """A budget as it goes into a plans identifier: ``24GiB``, ``25GB``, ``512MiB`` (exact, or in bytes)."""
    for unit, size in (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6)):
        if budget_bytes % size == 0:
            return f"{budget_bytes // size}{unit}"
    return f"{budget_bytes}B"


def memfit_planner(
    base: type | None = None,
    *,
    budget_bytes: int | None = None,
    gpu: str | GpuSpec | None = "h100",
    margin: float = DEFAULT_MARGIN,
    allocator: AllocatorConfig | None = None,
) -> type:
    """A subclass of nnU-Net's planner ``base`` (default ``ExperimentPlanner``; ``ResEncUNetPlanner`` and the
    ResEnc presets work the same) whose memory decisions are memfit's.

    It overrides three things: ``static_estimate_VRAM_usage`` returns memfit's predicted device bytes of
    nnUNetTrainer's step at batch 2 for the network nnU-Net built for that patch, and the reference it is compared
    with is the budget less the margin, so nnU-Net's own loop walks its own ladder (topology re-derived at each
    patch) and stops at the largest patch memfit says fits; ``get_plans_for_configuration`` then sets the batch to
    the largest that fits within nnU-Net's rules (at least ``UNet_min_batch_size``, at most ``max_dataset_covered``
    of the dataset's voxels per step); ``save_plans`` writes atomically and never over a plans file memfit did not
    write. nnU-Net's ``-pl`` finds planners only inside its own package, so call its entry point with the class::

        from nnunetv2.experiment_planning.plan_and_preprocess_api import plan_experiment_dataset
        plan_experiment_dataset(4, memfit_planner(), gpu_memory_target_in_gb=24)  # plans every configuration

    Without ``budget_bytes``, nnU-Net's ``gpu_memory_target_in_gb`` is the budget, in GiB (a card sold as "24 GB"
    has 24 GiB). Without ``plans_name``, the plans identifier is the base's with ``_memfit_<budget>`` appended.
    """
    _nnunet()
    import warnings

    from nnunetv2.paths import nnUNet_preprocessed
    from nnunetv2.utilities.json_export import recursive_fix_for_json_export
    from nnunetv2.utilities.label_handling.label_handling import LabelManager

    if base is None:
        from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import (
            ExperimentPlanner,
        )

        base = ExperimentPlanner
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    base_name = inspect.signature(base).parameters["plans_name"].default

    class MemfitPlanner(base):  # type: ignore[misc, valid-type]
        def __init__(self, dataset_name_or_id: str | int, gpu_memory_target_in_gb: float = 8,
                     preprocessor_name: str = "DefaultPreprocessor", plans_name: str | None = None,
                     overwrite_target_spacing: Sequence[float] | None = None,
                     suppress_transpose: bool = False) -> None:
            budget = budget_bytes if budget_bytes is not None else round(gpu_memory_target_in_gb * 2**30)
            name = plans_name or f"{base_name}_memfit_{budget_label(budget)}"
            with warnings.catch_warnings():  # the ResEnc presets warn about a target that is not theirs
                warnings.simplefilter("ignore")
                super().__init__(dataset_name_or_id, gpu_memory_target_in_gb, preprocessor_name, name,
                                 overwrite_target_spacing, suppress_transpose)
            labels = LabelManager(self.dataset_json["labels"], self.dataset_json.get("regions_class_order"))
            self.memfit = _Estimates(spec, config, budget, margin, labels)
            # nnU-Net shrinks the patch while estimate > UNet_reference_val × vram_target / reference_GB: make that
            # right side the limit in bytes, the unit static_estimate_VRAM_usage returns here
            self.UNet_reference_val_3d = self.UNet_reference_val_2d = self.memfit.limit_bytes
            self.UNet_reference_val_corresp_GB = self.UNet_vram_target_GB

        def static_estimate_VRAM_usage(self, patch_size: Sequence[int], input_channels: int,  # noqa: N802
                                       output_channels: int, arch_class_name: str, arch_kwargs: dict,
                                       arch_kwargs_req_import: Sequence[str]) -> int:
            # output_channels: nnU-Net passes the label count; the trainer builds one head per label manager's
            # segmentation head (they differ for region labels), so the label manager decides
            architecture = {"network_class_name": arch_class_name, "arch_kwargs": arch_kwargs,
                            "_kw_requires_import": arch_kwargs_req_import}
            self._memfit_input_channels = input_channels
            return self.memfit.rung(architecture, patch_size, self.UNet_min_batch_size, input_channels,
                                    2 * self.UNet_featuremap_min_edge_length)

        def get_plans_for_configuration(self, spacing: Any, median_shape: Any, data_identifier: str,
                                        approximate_n_voxels_dataset: float, _cache: dict) -> dict:
            self.memfit.ladder = []
            plan = super().get_plans_for_configuration(spacing, median_shape, data_identifier,
                                                       approximate_n_voxels_dataset, _cache)
            patch = [int(p) for p in plan["patch_size"]]
            # nnU-Net's batch rules: a step sees at most max_dataset_covered of the dataset's voxels, and at least
            # UNet_min_batch_size patches
            covered = round(approximate_n_voxels_dataset * self.max_dataset_covered / math.prod(patch))
            cap = max(covered, self.UNet_min_batch_size)
            plan["batch_size"] = self.memfit.largest_batch(plan["architecture"], patch, self.UNet_min_batch_size,
                                                           cap, self._memfit_input_channels)
            self.memfit_max_batch_size = cap
            return plan

        def save_plans(self, plans: dict) -> None:
            recursive_fix_for_json_export(plans)
            plans[MEMFIT_KEY] = {"budget_bytes": self.memfit.budget_bytes, "margin": self.memfit.margin,
                                 "gpu": spec.name}
            write_plans(Path(os.fspath(nnUNet_preprocessed)) / self.dataset_name / f"{self.plans_identifier}.json",
                        plans)

    MemfitPlanner.__name__ = MemfitPlanner.__qualname__ = f"Memfit{base.__name__}"
    return MemfitPlanner


def write_plans(path: Path, plans: Mapping[str, Any]) -> Path:
    """Write a plans file atomically, never over one memfit did not write (the user's own plans)."""
    write_plans_check(path)
    return write_atomic(path, json.dumps(plans, indent=4) + "\n", what="the plans")


def write_plans_check(path: Path) -> None:
    """Raise unless ``path`` is free for memfit's plans: missing, or a plans file memfit wrote."""
    if path.exists():
        try:
            ours = MEMFIT_KEY in json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ours = False
        if not ours:
            raise UsageError(f"{path} exists and memfit did not write it: memfit never overwrites a plans file it "
                             "did not write. Choose another plans identifier (--name).")


# -- plan a preprocessed dataset ---------------------------------------------------------------------------------

SCHEMA = 1


@dataclass(frozen=True)
class NnunetPlan(JsonRecord):
    """What ``plan_nnunet`` chose and wrote, with nnU-Net's own choices at the same GPU target beside it."""

    dataset: str
    source_plans: str
    """The plans identifier the new one is derived from (``nnUNetPlans``)."""
    plans_identifier: str
    """The new plans identifier: pass it to ``nnUNetv2_train ... -p``."""
    plans_file: str
    planner: str
    """nnU-Net's planner class that made the source plans, whose ladder and rules memfit followed."""
    gpu: str
    budget_bytes: int
    margin: float
    chosen: PatchChoice
    """memfit's 3d_fullres patch and batch: the largest patch on nnU-Net's ladder that fits at batch 2, then the
    largest batch that fits up to ``max_batch_size``."""
    max_batch_size: int
    """nnU-Net's cap on the batch: ``max_dataset_covered`` of the dataset's voxels per step, at least 2."""
    nnunet_default: PatchChoice
    """What nnU-Net's planner (the same class) chooses with ``gpu_memory_target_in_gb = nnunet_target_gb``, and
    memfit's prediction of it."""
    nnunet_target_gb: float
    """The budget in GiB: what a user would pass to nnU-Net's ``-gpu_memory_target``."""
    source: PatchChoice
    """The 3d_fullres configuration of the source plans, and memfit's prediction of it."""
    ladder: list[LadderStep]
    """The patches nnU-Net's loop visited, largest first; the last is the chosen one."""
    train_command: str
    preprocess_command: str | None
    """Set when the preprocessed data the plans point to is missing."""
    estimates: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    schema: int = SCHEMA

    def summary(self) -> list[str]:
        """The result in a few lines, for a terminal."""
        c, d = self.chosen, self.nnunet_default

        def line(label: str, p: PatchChoice) -> str:
            verdict = "fits" if p.fits_budget else "OVER budget"
            return (f"  {label:<30} patch {'×'.join(map(str, p.patch_size)):<13} batch {p.batch_size:<3} "
                    f"{p.voxels_per_step / 1e6:6.2f} M voxels/step  memfit predicts {format_bytes(p.device_bytes)} "
                    f"({verdict})")

        lines = [
            f"{self.dataset}: 3d_fullres for {format_bytes(self.budget_bytes)} on {self.gpu} "
            f"({self.planner} ladder, {len(self.ladder)} patches, {self.estimates} estimates, {self.elapsed_s:.1f} s)",
            line("memfit", c),
            line(f"nnU-Net's planner, target {self.nnunet_target_gb:g}", d),
            line(f"{self.source_plans} (as it is)", self.source),
            f"  voxels per step vs nnU-Net default: {c.voxels_per_step / d.voxels_per_step:.2f}×",
            f"wrote {self.plans_file}",
        ]
        if self.preprocess_command:
            lines.append(f"preprocess first: {self.preprocess_command}")
        lines.append(f"train: {self.train_command}")
        lines.extend(f"note: {n}" for n in self.notes)
        return lines


@contextlib.contextmanager
def _nnunet_output_to_log() -> Iterator[None]:
    """nnU-Net prints as it plans; the library does not print, so it goes to the debug log."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        if out.getvalue().strip():
            logger.debug("nnU-Net: %s", out.getvalue().strip())


def _planner_class(name: str) -> type:
    """nnU-Net's planner class by name, found where nnU-Net's ``-pl`` looks (``nnunetv2.experiment_planning``)."""
    import nnunetv2
    from nnunetv2.utilities.find_class_by_name import recursive_find_python_class

    base_name = name.removeprefix("Memfit") if name.startswith("Memfit") else name
    with _nnunet_output_to_log():
        found = recursive_find_python_class(os.path.join(nnunetv2.__path__[0], "experiment_planning"), base_name,
                                            "nnunetv2.experiment_planning")
    if found is None:
        raise UsageError(f"the plans were made by the planner {name!r}, which is not in nnunetv2.experiment_planning: "
                         "memfit follows that planner's ladder and rules. Plan from nnU-Net's own plans "
                         "(--plans nnUNetPlans) or a ResEnc preset's.")
    return found


def _dataset_name(dataset: int | str) -> str:
    for var in ("nnUNet_raw", "nnUNet_preprocessed"):
        if not os.environ.get(var):
            raise UsageError(f"{var} is not set: nnU-Net finds datasets through it. Export it as for "
                             "nnUNetv2_plan_and_preprocess (nnU-Net's planner reads the raw dataset.json too).")
    from nnunetv2.utilities.dataset_name_id_conversion import maybe_convert_to_dataset_name

    try:
        return str(maybe_convert_to_dataset_name(dataset))
    except (RuntimeError, ValueError):
        raise UsageError(f"no nnU-Net dataset {dataset!r} under nnUNet_raw={os.environ['nnUNet_raw']} and "
                         f"nnUNet_preprocessed={os.environ['nnUNet_preprocessed']} (or more than one with that id). "
                         "Give its id (e.g. 4) or folder name (Dataset004_Hippocampus).") from None


def plan_nnunet(
    dataset: int | str,
    *,
    budget: str | int,
    gpu: str | GpuSpec | None = "h100",
    source_plans: str = "nnUNetPlans",
    name: str | None = None,
    margin: float = DEFAULT_MARGIN,
    allocator: AllocatorConfig | None = None,
) -> NnunetPlan:
    """Write a plans file beside ``source_plans`` whose 3d_fullres patch and batch fit ``budget``, as memfit
    predicts nnUNetTrainer's step, and return what was chosen.

    The patch walks nnU-Net's own ladder from the source plans' median shape and spacing, with the network
    topology nnU-Net derives for each patch, through the source planner's ``get_plans_for_configuration`` (see
    ``memfit_planner``). Everything but 3d_fullres's ``patch_size``, ``batch_size`` and ``architecture`` is
    copied from the source plans, including its ``data_identifier``: the preprocessed data is reused, since
    preprocessing does not depend on the patch. The source plans file is only read.

    Args:
        dataset: nnU-Net dataset id (``4``) or folder name (``Dataset004_Hippocampus``); ``nnUNet_raw`` and
            ``nnUNet_preprocessed`` must be set, as for ``nnUNetv2_plan_and_preprocess``.
        budget: GPU memory for the training process, e.g. ``"24GiB"`` (2^30) or ``"24GB"`` (10^9), or bytes.
        gpu: the GPU to predict for (its CUDA context and library workspaces).
        source_plans: the plans identifier to start from.
        name: the new plans identifier; default ``<source_plans>_memfit_<budget>``.
        margin: keep memfit's predicted device memory under ``budget × (1 - margin)``.
        allocator: the caching allocator's settings; default from ``PYTORCH_CUDA_ALLOC_CONF``.

    Raises:
        UsageError: nnunetv2 missing, the dataset or its plans not found, or the new plans file exists and memfit
            did not write it.
        BudgetTooSmallError: not even nnU-Net's smallest patch fits at batch 2.
    """
    started = time.perf_counter()
    _nnunet()
    import numpy as np
    from nnunetv2.utilities.dataset_name_id_conversion import convert_dataset_name_to_id
    from nnunetv2.utilities.json_export import recursive_fix_for_json_export
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    budget_bytes = parse_bytes(budget)
    check_budget(budget_bytes, margin)
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    dataset_name = _dataset_name(dataset)
    folder = Path(os.environ["nnUNet_preprocessed"]) / dataset_name
    if not folder.is_dir():
        raise UsageError(f"no nnU-Net dataset {dataset_name!r} under nnUNet_preprocessed={folder.parent}: run "
                         f"nnUNetv2_plan_and_preprocess -d {dataset} first.")
    source_file = folder / f"{source_plans}.json"
    if not source_file.is_file():
        raise UsageError(f"no plans {source_file}: run nnUNetv2_plan_and_preprocess -d {dataset} first, or name the "
                         "plans to start from (--plans).")
    source = _read_json(source_file, "plans")
    manager = PlansManager(copy.deepcopy(source))
    if CONFIGURATION not in manager.available_configurations:
        raise UsageError(f"{source_file} has no {CONFIGURATION} configuration (it has "
                         f"{', '.join(manager.available_configurations)}): memfit plans 3-D full-resolution training.")
    source_config = manager.get_configuration(CONFIGURATION).configuration
    identifier = name or f"{source_plans}_memfit_{budget_label(budget_bytes)}"
    if identifier == source_plans or not identifier or any(c in identifier for c in "/\\"):
        raise UsageError(f"the new plans identifier must be a new file name beside {source_plans}.json, "
                         f"got {identifier!r}.")
    target = folder / f"{identifier}.json"
    write_plans_check(target)

    base = _planner_class(str(source.get("experiment_planner_used", "ExperimentPlanner")))
    target_gb = budget_bytes / 2**30
    spacing = np.array(source_config["spacing"], dtype=np.float64)
    median = np.array(source_config["median_image_size_in_voxels"], dtype=np.float64)
    data_identifier = source_config["data_identifier"]
    preprocessor = source_config.get("preprocessor_name", "DefaultPreprocessor")
    with _nnunet_output_to_log():
        planner = memfit_planner(base, budget_bytes=budget_bytes, gpu=spec, margin=margin, allocator=allocator)(
            dataset_name, target_gb, preprocessor, identifier)
        # as ExperimentPlanner.plan_experiment: the median shape's voxels times the number of training cases
        n_voxels = float(np.prod(median, dtype=np.float64) * planner.dataset_json["numTraining"])
        entry = planner.get_plans_for_configuration(spacing, median, data_identifier, n_voxels, {})
        import warnings

        with warnings.catch_warnings():  # the ResEnc presets warn about a target that is not theirs
            warnings.simplefilter("ignore")
            default = base(dataset_name, target_gb, preprocessor).get_plans_for_configuration(
                spacing, median, data_identifier, n_voxels, {})
    channels = determine_num_input_channels(manager, CONFIGURATION, planner.dataset_json)
    est = planner.memfit
    chosen = est.choice(entry["architecture"], entry["patch_size"], entry["batch_size"], channels)
    source_architecture = {"network_class_name": source_config["architecture"]["network_class_name"],
                           "arch_kwargs": source_config["architecture"]["arch_kwargs"],
                           "_kw_requires_import": source_config["architecture"]["_kw_requires_import"]}

    config = copy.deepcopy(source_config)
    config.update(patch_size=entry["patch_size"], batch_size=entry["batch_size"], architecture=entry["architecture"])
    plans = copy.deepcopy(source)
    plans["plans_name"] = identifier
    plans["configurations"][CONFIGURATION] = config
    plans[MEMFIT_KEY] = {"budget_bytes": budget_bytes, "margin": margin, "gpu": spec.name,
                         "source_plans": source_plans, "predicted_device_bytes": chosen.device_bytes}
    recursive_fix_for_json_export(plans)
    write_plans(target, plans)

    dataset_id = convert_dataset_name_to_id(dataset_name)
    preprocess = None
    if not (folder / data_identifier).is_dir():
        preprocess = f"nnUNetv2_preprocess -d {dataset_id} -plans_name {identifier} -c {CONFIGURATION}"
    notes = ["memfit predicts the eager step; nnU-Net compiles the network by default on CUDA (nnUNet_compile), "
             "which usually needs less memory. nnUNet_compile=f trains exactly the predicted step."]
    if "3d_cascade_fullres" in plans["configurations"]:
        notes.append("3d_cascade_fullres inherits this patch and network with the low-res segmentation as extra "
                     "input channels: a little more memory than predicted here.")
    return NnunetPlan(
        dataset=dataset_name, source_plans=source_plans, plans_identifier=identifier, plans_file=str(target),
        planner=base.__name__, gpu=spec.name, budget_bytes=budget_bytes, margin=margin, chosen=chosen,
        max_batch_size=planner.memfit_max_batch_size,
        nnunet_default=est.choice(default["architecture"], default["patch_size"], default["batch_size"], channels),
        nnunet_target_gb=round(target_gb, 3),
        source=est.choice(source_architecture, source_config["patch_size"], source_config["batch_size"], channels),
        ladder=list(est.ladder), train_command=f"nnUNetv2_train {dataset_id} {CONFIGURATION} FOLD -p {identifier}",
        preprocess_command=preprocess, estimates=est.runs, elapsed_s=time.perf_counter() - started, notes=notes,
    )
