"""nnU-Net v2 plans (memfit.integrations.nnunet) on a tiny synthetic dataset that nnU-Net itself fingerprinted,
planned and preprocessed: the new plans file loads and trains in nnU-Net, and its patch is the largest on
nnU-Net's ladder that memfit says fits."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.predict import estimate
from memfit.integrations.nnunet import (
    budget_label,
    memfit_planner,
    nnunet_workload,
    plan_nnunet,
    trainer_workload,
)

HAVE_NNUNET = all(importlib.util.find_spec(m) is not None for m in ("nnunetv2", "SimpleITK"))
if os.environ.get("MEMFIT_REQUIRE_NNUNET") and not HAVE_NNUNET:  # CI's nnU-Net environment (.ci/run)
    raise RuntimeError("MEMFIT_REQUIRE_NNUNET is set but nnunetv2 or SimpleITK is missing: pip install -e '.[nnunet]'")
needs_nnunet = pytest.mark.skipif(not HAVE_NNUNET, reason="needs nnunetv2 (pip install 'memfit[nnunet]')")

DATASET_ID = 901
DATASET = "Dataset901_Memfit"
SHAPE = (32, 40, 48)  # small enough for CPU; three poolings per axis in nnU-Net's topology
CASES = 4
MARGIN = 0.02


def write_raw_dataset(raw: Path) -> None:
    """nnU-Net's raw format: imagesTr/<case>_0000.nii.gz, labelsTr/<case>.nii.gz and dataset.json."""
    import SimpleITK as sitk

    folder = raw / DATASET
    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    rng = np.random.default_rng(0)
    for i in range(CASES):
        image = rng.normal(size=SHAPE).astype(np.float32)
        label = np.zeros(SHAPE, np.uint8)
        label[8:20, 10:30, 12:36] = 1
        label[20:26, 15:25, 20 + i:30 + i] = 2
        for array, path in ((image, folder / "imagesTr" / f"case{i:03d}_0000.nii.gz"),
                            (label, folder / "labelsTr" / f"case{i:03d}.nii.gz")):
            itk = sitk.GetImageFromArray(array)
            itk.SetSpacing((1.0, 1.0, 1.0))
            sitk.WriteImage(itk, str(path))
    (folder / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "MRI"}, "labels": {"background": 0, "a": 1, "b": 2}, "numTraining": CASES,
        "file_ending": ".nii.gz"}))


@pytest.fixture(scope="session")
def nnunet_env(tmp_path_factory):  # noqa: ANN001, ANN201
    """nnU-Net's own fingerprint, default and ResEnc-M planning, and 3d_fullres preprocessing, once per session."""
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprints,
        plan_experiments,
        preprocess,
    )

    root = tmp_path_factory.mktemp("nnunet")
    env = {"nnUNet_raw": str(root / "raw"), "nnUNet_preprocessed": str(root / "preprocessed"),
           "nnUNet_results": str(root / "results")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        write_raw_dataset(root / "raw")
        extract_fingerprints([DATASET_ID], num_processes=1, check_dataset_integrity=False, verbose=False,
                             show_progress_bar=False)
        plan_experiments([DATASET_ID])
        plan_experiments([DATASET_ID], "nnUNetPlannerResEncM")
        preprocess([DATASET_ID], configurations=("3d_fullres",), num_processes=(1,), show_progress_bar=False)
        yield root / "preprocessed" / DATASET
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def binding(nnunet_env):  # noqa: ANN001, ANN201
    """memfit's plan for a budget one byte short of the source plans' own patch: the ladder must step down."""
    full = _need(nnunet_workload(_load(nnunet_env / "nnUNetPlans.json"), _load(nnunet_env / "dataset.json")))
    budget = _budget_for_limit(full - 1)
    source_bytes = (nnunet_env / "nnUNetPlans.json").read_bytes()
    result = plan_nnunet(DATASET_ID, budget=budget, gpu="h100", margin=MARGIN)
    return result, budget, source_bytes, full


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _need(workload) -> int:  # noqa: ANN001
    return estimate(workload, gpu="h100").device_upper_bytes


def _budget_for_limit(limit: int) -> int:
    """The largest budget whose planning limit, int(budget × (1 - margin)), is at most ``limit``."""
    budget = math.floor(limit / (1 - MARGIN))
    while int(budget * (1 - MARGIN)) > limit:
        budget -= 1
    return budget


def test_without_nnunetv2_the_cli_says_how_to_install_it(tmp_path):  # noqa: ANN001
    shadow = tmp_path / "nnunetv2"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named nnunetv2')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "memfit.cli", "nnunet", "plan", "4", "--budget", "12GiB"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "needs nnunetv2: pip install 'memfit[nnunet]'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_budget_label_is_exact():
    assert budget_label(24 * 2**30) == "24GiB"
    assert budget_label(25 * 10**9) == "25GB"
    assert budget_label(850 * 2**20) == "850MiB"
    assert budget_label(1234567) == "1234567B"


@needs_nnunet
def test_binding_budget_gives_the_largest_patch_on_nnunets_ladder_that_fits(nnunet_env, binding):  # noqa: ANN001
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
    from nnunetv2.utilities.label_handling.label_handling import LabelManager
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    result, budget, source_bytes, full = binding
    limit = int(budget * (1 - MARGIN))
    source_file = nnunet_env / "nnUNetPlans.json"
    dataset_json = _load(nnunet_env / "dataset.json")

    new_file = Path(result.plans_file)
    assert new_file.parent == nnunet_env and new_file.name == f"nnUNetPlans_memfit_{budget}B.json"
    assert source_file.read_bytes() == source_bytes  # the user's plans untouched
    plans = _load(new_file)
    manager = PlansManager(str(new_file))
    config = manager.get_configuration("3d_fullres")
    patch = tuple(config.patch_size)
    assert patch == result.chosen.patch_size and config.batch_size == result.chosen.batch_size == 2
    assert math.prod(patch) < math.prod(_load(source_file)["configurations"]["3d_fullres"]["patch_size"])
    # the preprocessed data is reused: same data identifier, spacing and normalization as the source
    source_config = _load(source_file)["configurations"]["3d_fullres"]
    for key in ("data_identifier", "spacing", "normalization_schemes", "median_image_size_in_voxels"):
        assert plans["configurations"]["3d_fullres"][key] == source_config[key]
    # nnU-Net builds the network, and the patch is divisible by its total stride on every axis
    network = get_network_from_plans(config.network_arch_class_name, config.network_arch_init_kwargs,
                                     config.network_arch_init_kwargs_req_import, 1, 3, deep_supervision=True)
    assert network is not None
    total_stride = np.prod(np.array(config.network_arch_init_kwargs["strides"]), axis=0)
    assert all(p % s == 0 for p, s in zip(patch, total_stride, strict=True))
    # not larger than the median shape (nnU-Net clips its first patch to it)
    assert all(p <= m for p, m in zip(patch, source_config["median_image_size_in_voxels"], strict=True))

    # memfit's estimate of the written configuration fits; the next larger patch on the ladder does not
    assert _need(nnunet_workload(plans, dataset_json)) <= limit
    assert result.ladder[-1].patch_size == patch and result.ladder[-1].fits
    assert len(result.ladder) >= 2 and not any(step.fits for step in result.ladder[:-1])
    larger = result.ladder[-2]
    assert math.prod(larger.patch_size) > math.prod(patch)
    arch = json.loads(json.dumps(source_config["architecture"]))
    arch["arch_kwargs"]["strides"] = [list(s) for s in larger.strides]
    bigger = trainer_workload(arch, larger.patch_size, 2, num_input_channels=1,
                              label_manager=LabelManager(dataset_json["labels"], None))
    assert _need(bigger) > limit
    # nnU-Net's default planner at the same target, and what memfit says of it
    assert result.nnunet_default.patch_size == tuple(source_config["patch_size"])
    assert result.nnunet_default.device_bytes == full > limit
    assert result.train_command == f"nnUNetv2_train {DATASET_ID} 3d_fullres FOLD -p {result.plans_identifier}"
    assert result.preprocess_command is None


@needs_nnunet
def test_slack_budget_keeps_the_median_patch_and_nnunets_batch_cap(nnunet_env):  # noqa: ANN001
    source = _load(nnunet_env / "nnUNetPlans.json")["configurations"]["3d_fullres"]
    result = plan_nnunet(DATASET_ID, budget="40GiB", gpu="h100", name="nnUNetPlans_memfit_test_slack")
    assert result.chosen.patch_size == tuple(source["patch_size"])
    assert len(result.ladder) == 1 and result.ladder[0].fits
    # 5 % of 4 cases' voxels is a fifth of a patch: nnU-Net's floor of 2 wins, however much memory is left
    assert result.max_batch_size == 2 and result.chosen.batch_size == 2


@needs_nnunet
def test_batch_grows_to_the_largest_that_fits_under_a_resenc_preset(nnunet_env):  # noqa: ANN001
    """nnUNetPlannerResEncM lets a step see the whole dataset (max_dataset_covered = 1): up to 4 patches here."""
    plans = _load(nnunet_env / "nnUNetResEncUNetMPlans.json")
    dataset_json = _load(nnunet_env / "dataset.json")
    patch = tuple(plans["configurations"]["3d_fullres"]["patch_size"])

    def need(batch: int) -> int:
        return _need(nnunet_workload(plans, dataset_json, batch_size=batch))

    slack = plan_nnunet(DATASET_ID, budget="40GiB", source_plans="nnUNetResEncUNetMPlans", name="resenc_slack")
    cap = round(CASES * math.prod(SHAPE) / math.prod(patch))
    assert slack.planner == "nnUNetPlannerResEncM" and slack.chosen.patch_size == patch
    assert slack.max_batch_size == cap >= 4 and slack.chosen.batch_size == cap
    written = _load(Path(slack.plans_file))
    assert written["configurations"]["3d_fullres"]["architecture"]["network_class_name"].endswith(
        "ResidualEncoderUNet")
    assert written["configurations"]["3d_fullres"]["batch_size"] == cap

    # the patch fits at batch 2 exactly, the cap does not: the batch is bracketed between them
    limit = need(2)
    assert need(cap) > limit
    binds = plan_nnunet(DATASET_ID, budget=math.ceil(limit / (1 - MARGIN)), source_plans="nnUNetResEncUNetMPlans",
                        margin=MARGIN, name="resenc_binds")
    batch = binds.chosen.batch_size
    assert binds.chosen.patch_size == patch and 2 <= batch < cap
    assert binds.chosen.device_bytes == need(batch) <= limit < need(batch + 1)


@needs_nnunet
def test_budget_below_the_cuda_context_raises(nnunet_env):  # noqa: ANN001
    before = set(os.listdir(nnunet_env))
    with pytest.raises(BudgetTooSmallError, match="CUDA context"):
        plan_nnunet(DATASET_ID, budget="100MiB")
    assert set(os.listdir(nnunet_env)) == before


@needs_nnunet
def test_budget_no_patch_fits_raises_at_the_bottom_of_the_ladder(nnunet_env):  # noqa: ANN001
    from memfit.estimate.gpus import gpu_spec

    # just above the context: the network's parameters, gradients and momentum alone do not fit
    budget = _budget_for_limit(gpu_spec("h100").context_bytes(uses_cublas=False) + 2**20) + 1
    with pytest.raises(BudgetTooSmallError, match="no patch on nnU-Net's ladder fits"):
        plan_nnunet(DATASET_ID, budget=budget)


@needs_nnunet
def test_never_overwrites_a_plans_file_memfit_did_not_write(nnunet_env):  # noqa: ANN001
    custom = nnunet_env / "myPlans.json"
    custom.write_text('{"configurations": {}}')
    with pytest.raises(UsageError, match="memfit did not write it"):
        plan_nnunet(DATASET_ID, budget="40GiB", name="myPlans")
    assert custom.read_text() == '{"configurations": {}}'
    with pytest.raises(UsageError, match="new file name"):
        plan_nnunet(DATASET_ID, budget="40GiB", name="nnUNetPlans")
    # memfit's own file is planned again in place
    first = plan_nnunet(DATASET_ID, budget="40GiB", name="nnUNetPlans_memfit_again")
    again = plan_nnunet(DATASET_ID, budget="40GiB", name="nnUNetPlans_memfit_again")
    assert again.plans_file == first.plans_file and again.chosen == first.chosen


@needs_nnunet
def test_nnunets_own_entry_point_runs_the_memfit_planner(nnunet_env, binding):  # noqa: ANN001
    """plan_experiment_dataset (what nnUNetv2_plan_experiment calls) with the class: the same 3d_fullres patch."""
    from nnunetv2.experiment_planning.plan_and_preprocess_api import plan_experiment_dataset

    ours, budget, _, _ = binding
    planner = memfit_planner(budget_bytes=budget)
    plans, identifier = plan_experiment_dataset(DATASET_ID, planner, overwrite_plans_name="nnUNetPlans_memfit_entry")

    written = _load(nnunet_env / f"{identifier}.json")
    assert identifier == "nnUNetPlans_memfit_entry" and "memfit" in written
    assert written["experiment_planner_used"] == "MemfitExperimentPlanner"
    assert tuple(written["configurations"]["3d_fullres"]["patch_size"]) == ours.chosen.patch_size
    assert set(written["configurations"]) >= {"2d", "3d_fullres"}


@pytest.mark.slow  # 10 s on an idle 2-core CPU, 22 s on a busy one
@needs_nnunet
def test_nnunet_trainer_trains_the_new_plans_on_cpu(binding, monkeypatch):  # noqa: ANN001
    """nnU-Net's own trainer, loaded as nnUNetv2_train loads it (-p <identifier>), runs two iterations."""
    import torch
    from nnunetv2.run.run_training import get_trainer_from_args

    result = binding[0]
    monkeypatch.setenv("nnUNet_n_proc_DA", "0")  # data augmentation in this process: no worker start-up
    started = time.perf_counter()
    trainer = get_trainer_from_args(str(DATASET_ID), "3d_fullres", "all", "nnUNetTrainer", result.plans_identifier,
                                    device=torch.device("cpu"))
    trainer.num_iterations_per_epoch, trainer.num_val_iterations_per_epoch, trainer.num_epochs = 2, 1, 1
    trainer.run_training()
    print(f"nnUNetTrainer, 2 iterations on CPU: {time.perf_counter() - started:.1f} s")
    assert list(trainer.configuration_manager.patch_size) == list(result.chosen.patch_size)
    assert (Path(trainer.output_folder) / "checkpoint_final.pth").is_file()


@needs_nnunet
def test_cli_prints_the_train_command_and_fails_in_one_line(nnunet_env):  # noqa: ANN001
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "memfit.cli", "nnunet", "plan", *args], capture_output=True,
                              text=True, timeout=240, env=dict(os.environ))

    out = run(str(DATASET_ID), "--budget", "40GiB", "--name", "nnUNetPlans_memfit_cli", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["schema"] == 1 and data["plans_identifier"] == "nnUNetPlans_memfit_cli"
    assert data["train_command"].endswith("3d_fullres FOLD -p nnUNetPlans_memfit_cli")
    assert (nnunet_env / "nnUNetPlans_memfit_cli.json").is_file()
    bad = run(str(DATASET_ID + 1), "--budget", "24GiB")
    assert bad.returncode == 2 and "no nnU-Net dataset" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


@needs_nnunet
def test_settle_takes_a_patch_only_the_bound_keeps_out_when_its_step_runs(nnunet_env):  # noqa: ANN001
    # a limit between the first rung's best estimate and its upper bound: the bound alone steps down the ladder;
    # a trial that runs keeps the rung, one that does not changes nothing
    plans, dataset = _load(nnunet_env / "nnUNetPlans.json"), _load(nnunet_env / "dataset.json")
    first = estimate(nnunet_workload(plans, dataset, batch_size=2), gpu="h100")
    assert first.device_bytes < first.device_upper_bytes
    budget = _budget_for_limit((first.device_bytes + first.device_upper_bytes) // 2)
    limit = int(budget * (1 - MARGIN))
    source_patch = tuple(plans["configurations"]["3d_fullres"]["patch_size"])
    calls = []

    def runs(architecture, patch, batch, channels, cap) -> bool:  # noqa: ANN001
        json.dumps(architecture)  # what trials_on_this_gpu writes for the trial's process
        calls.append((tuple(patch), batch, channels, cap))
        return True

    settled = plan_nnunet(DATASET_ID, budget=budget, gpu="h100", margin=MARGIN, name="settled", settle=runs)
    assert settled.chosen.patch_size == source_patch and settled.chosen.batch_size == 2
    assert settled.chosen.ran_under_cap and settled.chosen.device_bytes > limit  # the bound alone: over
    assert calls == [(source_patch, 2, 1, limit - (first.device_bytes - first.fits_in_bytes))]
    assert settled.ladder[0].ran_under_cap and settled.ladder[0].fits
    assert any("ran under the cap here" in line for line in settled.summary())

    refused = plan_nnunet(DATASET_ID, budget=budget, gpu="h100", margin=MARGIN, name="refused",
                          settle=lambda *args: False)
    plain = plan_nnunet(DATASET_ID, budget=budget, gpu="h100", margin=MARGIN, name="plain")
    assert refused.chosen.patch_size == plain.chosen.patch_size != source_patch
    assert refused.ladder[0].ran_under_cap is False and not refused.ladder[0].fits
    assert all(step.ran_under_cap is None for step in plain.ladder)


def test_cli_settle_without_a_gpu_fails_in_one_line():
    out = subprocess.run([sys.executable, "-m", "memfit.cli", "nnunet", "plan", "4", "--budget", "12GiB",
                          "--settle"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2 and "no CUDA GPU here" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@needs_nnunet
def test_missing_plans_or_dataset_is_a_usage_error(nnunet_env, monkeypatch):  # noqa: ANN001
    with pytest.raises(UsageError, match="no plans .*nope.json"):
        plan_nnunet(DATASET_ID, budget="24GiB", source_plans="nope")
    with pytest.raises(UsageError, match="no nnU-Net dataset 'Dataset999'"):
        plan_nnunet("Dataset999", budget="24GiB")
    monkeypatch.delenv("nnUNet_preprocessed")
    with pytest.raises(UsageError, match="nnUNet_preprocessed is not set"):
        plan_nnunet(DATASET_ID, budget="24GiB")
