"""``plan_nnunet``: a plans file beside the user's whose 3d_fullres patch and batch fit a GPU memory budget.

Example (needs ``nnunetv2`` and a dataset preprocessed by ``nnUNetv2_plan_and_preprocess``)::

    from memfit.integrations.nnunet import plan_nnunet
    result = plan_nnunet(4, budget="24GiB", gpu="h100")
    print(result.train_command)   # nnUNetv2_train 4 3d_fullres FOLD -p nnUNetPlans_memfit_24GiB
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from memfit.errors import UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.integrations.nnunet.planner import (
    MEMFIT_KEY,
    NNUNET_MARGIN,
    LadderStep,
    PatchChoice,
    budget_label,
    memfit_planner,
    write_plans,
    write_plans_check,
)
from memfit.integrations.nnunet.trainer_step import CONFIGURATION, TrainerTrial, read_json, require_nnunet
from memfit.plan.search import check_budget
from memfit.records import JsonRecord
from memfit.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

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
            verdict = "ran under the cap here" if p.ran_under_cap else "fits" if p.fits_budget else "OVER budget"
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

    base_name = name.removeprefix("Memfit")  # plans memfit wrote through plan_experiment_dataset
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
    margin: float = NNUNET_MARGIN,
    allocator: AllocatorConfig | None = None,
    settle: bool | TrainerTrial = False,
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
        settle: run a patch that only the upper bound keeps out under the cap on this machine's GPU, and take it
            if it runs (``memfit_planner``); needs the GPU planned for.

    Raises:
        UsageError: nnunetv2 missing, the dataset or its plans not found, or the new plans file exists and memfit
            did not write it.
        BudgetTooSmallError: not even nnU-Net's smallest patch fits at batch 2.
    """
    started = time.perf_counter()
    require_nnunet()
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
    source = read_json(source_file, "plans")
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
        planner = memfit_planner(base, budget_bytes=budget_bytes, gpu=spec, margin=margin, allocator=allocator,
                                 settle=settle)(
            dataset_name, target_gb, preprocessor, identifier)
        # as ExperimentPlanner.plan_experiment: the median shape's voxels times the number of training cases
        n_voxels = float(np.prod(median, dtype=np.float64) * planner.dataset_json["numTraining"])
        entry = planner.get_plans_for_configuration(spacing, median, data_identifier, n_voxels, {})
        with warnings.catch_warnings():  # the ResEnc presets warn about a target that is not theirs
            warnings.simplefilter("ignore")
            default = base(dataset_name, target_gb, preprocessor).get_plans_for_configuration(
                spacing, median, data_identifier, n_voxels, {})
    channels = determine_num_input_channels(manager, CONFIGURATION, planner.dataset_json)
    est = planner.memfit
    chosen = est.choice(entry["architecture"], entry["patch_size"], entry["batch_size"], channels)
    nnunet_default = est.choice(default["architecture"], default["patch_size"], default["batch_size"], channels)
    as_it_is = est.choice(source_config["architecture"], source_config["patch_size"], source_config["batch_size"],
                          channels)

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
        nnunet_default=nnunet_default, nnunet_target_gb=round(target_gb, 3), source=as_it_is,
        ladder=list(est.ladder), train_command=f"nnUNetv2_train {dataset_id} {CONFIGURATION} FOLD -p {identifier}",
        preprocess_command=preprocess, estimates=est.runs, elapsed_s=time.perf_counter() - started, notes=notes,
    )
