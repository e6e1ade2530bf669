"""``memfit_planner``: nnU-Net's experiment planner with memfit's estimate in place of its memory proxy.

nnU-Net's planner (``ExperimentPlanner.get_plans_for_configuration``) walks the patch down from the median image
shape, re-deriving the network's topology at every patch (``get_pool_and_conv_props``: stages, strides, kernel
sizes), until a proxy of memory (``static_estimate_VRAM_usage``: conv output elements) is under a reference
scaled from 8 GB; the batch is then extrapolated from the proxy, at least 2 and at most a share of the dataset.
The subclass keeps the walk and the rules and replaces the proxy with memfit's estimate of exactly the step
nnUNetTrainer runs at each patch.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit._io import write_atomic
from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.predict import Estimate, estimate
from memfit.integrations.nnunet.trainer_step import (
    TrainerTrial,
    require_nnunet,
    trainer_workload,
    trials_on_this_gpu,
)
from memfit.plan.search import check_budget
from memfit.units import format_bytes

logger = logging.getLogger(__name__)

MEMFIT_KEY = "memfit"
"""Top-level key of a plans file memfit wrote (nnU-Net reads only the keys it knows): what it was planned for."""

NNUNET_MARGIN = 0.02
"""The share of the budget an nnU-Net plan keeps free on top of memfit's upper bound (``memfit.plan.search`` keeps
none): nnU-Net turns ``cudnn.benchmark`` on, whose trial algorithms take workspaces from the same allocator, which
the estimate does not count (users report runs failing there near the limit: MIC-DKFZ/nnUNet#2294). The search takes
what memory it is given; measured with it on (H200, 14 steps, two of them nnU-Net's 3-D networks), the smallest caps
were within -1.1 ... +3.3 % of those without it (nnU-Net's: +2.3 % and -0.1 %), each below memfit's upper bound
(benchmarks/results/estimate/cudnn_benchmark_draw_h200_torch2.11_20261130_s37.md)."""


@dataclass(frozen=True)
class LadderStep:
    """One patch on nnU-Net's ladder, with the network nnU-Net builds for it, decided by memfit."""

    patch_size: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    """The network's pooling per stage at this patch (``get_pool_and_conv_props``)."""
    device_bytes: int
    """memfit's ``device_upper_bytes`` at the smallest batch nnU-Net allows (2)."""
    fits: bool
    """``device_bytes <= budget × (1 - margin)``, or the step ran under the cap on this GPU (``ran_under_cap``)."""
    ran_under_cap: bool | None = None
    """Where only the upper bound kept the patch out (its best estimate fits) and the plan settles on the GPU:
    whether nnUNetTrainer's step ran under the cap there. None: not tried."""


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
    ran_under_cap: bool | None = None
    """The step ran under the plan's cap on this GPU (``LadderStep.ran_under_cap``); None: not tried."""

    @property
    def voxels_per_step(self) -> int:
        """Patch voxels × batch: how much of the images one optimizer step sees."""
        return math.prod(self.patch_size) * self.batch_size


class PlanEstimates:
    """memfit's estimates of nnUNetTrainer's step during one planning run, each network and patch once."""

    def __init__(self, gpu: GpuSpec, allocator: AllocatorConfig, budget_bytes: int, margin: float,
                 label_manager: Any, settle: TrainerTrial | None = None) -> None:
        check_budget(budget_bytes, margin)
        self.gpu, self.allocator, self.label_manager, self.settle = gpu, allocator, label_manager, settle
        self.budget_bytes, self.margin = budget_bytes, margin
        self.limit_bytes = int(budget_bytes * (1 - margin))
        context = gpu.context_bytes(uses_cublas=False)
        if self.limit_bytes <= context:
            raise BudgetTooSmallError(
                f"the budget {format_bytes(budget_bytes)} (less the {margin:.0%} margin) is not more than the CUDA "
                f"context alone on {gpu.name} ({format_bytes(context)}): no nnU-Net network fits. Give the memory "
                "this process may use, e.g. --budget 24GiB.")
        self.known: dict[str, Estimate] = {}
        self.ran: dict[str, bool] = {}
        """Trials under the cap (``settle``), by the estimate's key."""
        self.ladder: list[LadderStep] = []
        self.runs = 0

    @staticmethod
    def _key(architecture: Mapping[str, Any], patch: Sequence[int], batch: int,
             input_channels: int) -> tuple[str, dict[str, Any]]:
        from nnunetv2.utilities.json_export import recursive_fix_for_json_export

        arch = copy.deepcopy(dict(architecture))
        recursive_fix_for_json_export(arch)  # numpy integers and tuples as nnU-Net writes them: one key per network
        return json.dumps([arch, [int(p) for p in patch], int(batch), int(input_channels)], sort_keys=True), arch

    def estimate(self, architecture: Mapping[str, Any], patch: Sequence[int], batch: int,
                 input_channels: int) -> Estimate:
        key, arch = self._key(architecture, patch, batch, input_channels)
        patch_size = tuple(int(p) for p in patch)
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
        """What nnU-Net's ladder compares with its reference: memfit's upper bound of device bytes at this patch,
        or the limit itself where only that bound is over the limit and the step ran under the cap (``settled``)."""
        est = self.estimate(architecture, patch, batch, input_channels)
        ran = self.settled(architecture, patch, batch, input_channels, est)
        step = LadderStep(patch_size=tuple(int(p) for p in patch),
                          strides=tuple(tuple(int(s) for s in row) for row in architecture["arch_kwargs"]["strides"]),
                          device_bytes=est.device_upper_bytes, fits=self.fits(est) or bool(ran), ran_under_cap=ran)
        self.ladder.append(step)
        if not step.fits and all(p <= smallest_edge for p in step.patch_size):
            # nnU-Net's loop would go on below the network's smallest feature map (and crash at a 0-voxel axis)
            raise BudgetTooSmallError(
                f"no patch on nnU-Net's ladder fits {format_bytes(self.budget_bytes)} at batch {batch}: the smallest, "
                f"{'×'.join(map(str, step.patch_size))}, needs {format_bytes(step.device_bytes)}. "
                "Try a larger budget or a GPU with more memory.")
        return min(est.device_upper_bytes, self.limit_bytes) if ran else est.device_upper_bytes

    def settled(self, architecture: Mapping[str, Any], patch: Sequence[int], batch: int, input_channels: int,
                est: Estimate) -> bool | None:
        """Whether the step ran under the cap on this GPU, where only the upper bound keeps it out (its best
        estimate fits the limit) and there is a ``settle``; None where nothing was tried. The cap is the limit
        less the CUDA context the estimate assumes; each network, patch and batch is tried once."""
        if self.settle is None or self.fits(est) or est.device_bytes > self.limit_bytes:
            return None
        key, arch = self._key(architecture, patch, batch, input_channels)
        if key not in self.ran:
            cap = self.limit_bytes - (est.device_bytes - est.fits_in_bytes)
            # the JSON-ready copy: nnU-Net's own holds numpy integers, which a trial writes to a file
            self.ran[key] = self.settle(arch, patch, batch, input_channels, cap)
            logger.info("patch %s batch %d under a %s cap: %s", "×".join(map(str, patch)), batch,
                        format_bytes(cap), "ran" if self.ran[key] else "did not run")
        return self.ran[key]

    def largest_batch(self, architecture: Mapping[str, Any], patch: Sequence[int], smallest: int, cap: int,
                      input_channels: int) -> int:
        """The largest batch in ``[smallest, cap]`` that fits (``smallest`` fits: the ladder stopped there).

        Memory is close to linear in the batch: the line through the two bounds guesses, an estimate of exactly
        the guess decides, and its neighbour closes the bracket when the line was right.
        """

        def need(b: int) -> int:
            return self.estimate(architecture, patch, b, input_channels).device_upper_bytes

        if self.ran.get(self._key(architecture, patch, smallest, input_channels)[0]):
            return smallest  # the patch fits by a run on the GPU; its bound is over the limit already
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
                           fits_budget=est.device_upper_bytes <= self.budget_bytes,
                           ran_under_cap=self.ran.get(self._key(architecture, patch, batch, input_channels)[0]))


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
    margin: float = NNUNET_MARGIN,
    allocator: AllocatorConfig | None = None,
    settle: bool | TrainerTrial = False,
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

    ``settle`` (on the GPU planned for): a patch that only the upper bound keeps out, its best estimate under the
    limit, is run for three steps of nnUNetTrainer's step in a fresh process under the cap (the limit less the
    CUDA context) and taken if it runs, as ``memfit plan --patch --settle`` does (``trials_on_this_gpu``); a
    callable ``TrainerTrial`` is used as it is.
    """
    require_nnunet()
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
            trial = settle if callable(settle) else trials_on_this_gpu(
                self.dataset_json["labels"], self.dataset_json.get("regions_class_order")) if settle else None
            self.memfit = PlanEstimates(spec, config, budget, margin, labels, trial)
            # nnU-Net shrinks the patch while estimate > UNet_reference_val × vram_target / reference_GB: make that
            # right side the limit in bytes, the unit static_estimate_VRAM_usage returns here
            self.UNet_reference_val_3d = self.UNet_reference_val_2d = self.memfit.limit_bytes
            self.UNet_reference_val_corresp_GB = self.UNet_vram_target_GB
            # what static_estimate_VRAM_usage is told; set here too for a configuration whose every patch nnU-Net
            # finds in its own cache (plan_experiment shares one across configurations)
            channels = self.dataset_json.get("channel_names") or self.dataset_json.get("modality") or {}
            self._memfit_input_channels = len(channels)
            self.memfit_max_batch_size = self.UNet_min_batch_size

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
