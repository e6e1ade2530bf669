"""nnU-Net's own trainer on memfit's plans for 8, 12 and 24 GiB, each under a memory cap equal to its budget.

1. A synthetic dataset in nnU-Net's raw format (8 cases of 224³ random images with two label blobs, NIfTI).
2. nnU-Net's own fingerprint extraction, planning (``ExperimentPlanner``) and 3d_fullres preprocessing.
3. ``memfit nnunet plan`` for each target: a plans file ``nnUNetPlans_memfit_<N>GiB`` beside nnUNetPlans.json,
   with nnU-Net's default planner at the same ``gpu_memory_target_in_gb`` beside it (patch voxels per step).
4. For each target, in a fresh process: the caching allocator is capped at the target less the CUDA context memfit
   assumes (``set_per_process_memory_fraction``), and ``nnUNetTrainer`` - loaded as ``nnUNetv2_train DATASET
   3d_fullres all -p <identifier>`` loads it - runs ``--iterations`` training iterations (eager, nnUNet_compile=f:
   the step memfit predicts). Recorded: OOM or not, peak allocated and reserved, the process's device memory
   (NVML), seconds per iteration. ``--train-default`` also trains nnU-Net's default plan for each target.

    python benchmarks/integrations/nnunet_device.py --out $OUT             # GPU: about 5-6 minutes on an H100
    python benchmarks/integrations/nnunet_device.py --out /tmp/nn --smoke  # CPU: a 4-case 32×40×48 dataset

Writes ``nnunet_plans_<card>_torch<X.Y>_<yyyymmdd>.json`` under ``--out``; committed results go to
``benchmarks/results/integrations/``. The device has no nnunetv2: carry the wheels that
``benchmarks/integrations/nnunet_wheels.sh`` downloads (see there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import card, stem  # noqa: E402

DATASET_ID = 902
DATASET = "Dataset902_MemfitDevice"
TARGETS_GIB = (8, 12, 24)
# nnU-Net's default planner picks 224³ as its first patch here (256³ volume clipped to the median shape), which
# memfit predicts near 30 GiB at batch 2: every target binds
SHAPE = (224, 224, 224)
CASES = 8
SMOKE_SHAPE, SMOKE_CASES = (32, 40, 48), 4

SIMPLEITK_STUB = '''"""Stand-in for SimpleITK (its 53 MB wheel is over what travels to the device): nnU-Net imports it at module
level, and this benchmark reads NIfTI through nnU-Net's NibabelIO, so nothing here is ever called."""


def __getattr__(name):
    raise ImportError(f"SimpleITK.{name}: SimpleITK is not installed (a stand-in from nnunet_device.py)")
'''


def _environment(root: Path) -> None:
    """nnU-Net's folders, eager training, and SimpleITK's stand-in where the real one is missing; spawned workers
    (nnU-Net's fingerprint, preprocessing and data-augmentation pools) inherit all of it."""
    os.environ.update(nnUNet_raw=str(root / "raw"), nnUNet_preprocessed=str(root / "preprocessed"),
                      nnUNet_results=str(root / "results"), nnUNet_compile="f")
    try:
        import SimpleITK  # noqa: F401
    except ImportError:
        stubs = root / "stubs"
        stubs.mkdir(parents=True, exist_ok=True)
        (stubs / "SimpleITK.py").write_text(SIMPLEITK_STUB)
        sys.path.insert(0, str(stubs))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH")) if p)


def write_dataset(raw: Path, shape: tuple[int, ...], cases: int) -> None:
    """nnU-Net's raw format, read by its NibabelIO: imagesTr/<case>_0000.nii, labelsTr/<case>.nii, dataset.json."""
    import nibabel
    import numpy as np

    folder = raw / DATASET
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(cases):
        image = rng.normal(size=shape).astype(np.float32)
        label = np.zeros(shape, np.uint8)
        a, b = [s // 4 for s in shape], [s // 2 for s in shape]
        label[a[0]:b[0], a[1]:b[1], a[2]:b[2]] = 1
        label[b[0]:b[0] + shape[0] // 8, a[1]:b[1], a[2] + i:b[2] + i] = 2
        for array, path in ((image, folder / "imagesTr" / f"case{i:03d}_0000.nii"),
                            (label, folder / "labelsTr" / f"case{i:03d}.nii")):
            nibabel.save(nibabel.Nifti1Image(array, np.eye(4)), str(path))
    (folder / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "MRI"}, "labels": {"background": 0, "a": 1, "b": 2}, "numTraining": cases,
        "file_ending": ".nii", "overwrite_image_reader_writer": "NibabelIO"}))


def prepare(root: Path, shape: tuple[int, ...], cases: int, processes: int, preprocessing: bool = True) -> dict:
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprints,
        plan_experiments,
        preprocess,
    )

    started = time.perf_counter()
    write_dataset(root / "raw", shape, cases)
    written = time.perf_counter()
    extract_fingerprints([DATASET_ID], num_processes=processes, check_dataset_integrity=False, verbose=False,
                         show_progress_bar=False)
    plan_experiments([DATASET_ID])
    planned = time.perf_counter()
    if preprocessing:  # memfit's planning needs the fingerprint and nnUNetPlans.json only
        preprocess([DATASET_ID], configurations=("3d_fullres",), num_processes=(processes,), show_progress_bar=False)
    return {"shape": list(shape), "cases": cases, "write_s": written - started, "fingerprint_and_plan_s":
            planned - written, "preprocess_s": time.perf_counter() - planned}


def plan_targets(targets: list[int], gpu: str, settle: bool = False) -> list[dict]:
    from memfit.integrations.nnunet import plan_nnunet

    rows = []
    for gib in targets:
        started = time.perf_counter()
        result = plan_nnunet(DATASET_ID, budget=f"{gib}GiB", gpu=gpu, settle=settle)
        row = result.to_dict()
        row["target_gib"] = gib
        row["planning_s"] = time.perf_counter() - started
        row["voxels_per_step"] = {"memfit": result.chosen.voxels_per_step,
                                  "nnunet_default": result.nnunet_default.voxels_per_step,
                                  "ratio": result.chosen.voxels_per_step / result.nnunet_default.voxels_per_step}
        print("\n".join(result.summary()), flush=True)
        rows.append(row)
    return rows


def write_default_plans(gib: int) -> str:
    """nnU-Net's default planner at ``gpu_memory_target_in_gb = gib``, as a plans file that reuses the data."""
    import copy

    import numpy as np
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
    from nnunetv2.utilities.json_export import recursive_fix_for_json_export

    folder = Path(os.environ["nnUNet_preprocessed"]) / DATASET
    source = json.loads((folder / "nnUNetPlans.json").read_text())
    config = source["configurations"]["3d_fullres"]
    median = np.array(config["median_image_size_in_voxels"])
    planner = ExperimentPlanner(DATASET_ID, gib)
    entry = planner.get_plans_for_configuration(np.array(config["spacing"]), median, config["data_identifier"],
                                                float(np.prod(median) * planner.dataset_json["numTraining"]), {})
    identifier = f"nnUNetPlans_default_{gib}GiB"
    plans = copy.deepcopy(source)
    plans["plans_name"] = identifier
    plans["configurations"]["3d_fullres"].update(patch_size=entry["patch_size"], batch_size=entry["batch_size"],
                                                 architecture=entry["architecture"])
    recursive_fix_for_json_export(plans)
    (folder / f"{identifier}.json").write_text(json.dumps(plans, indent=2))
    return identifier


def train(args: argparse.Namespace) -> None:
    """One nnUNetTrainer run in this process (started fresh by ``main`` for each plan); prints one JSON line."""
    import torch
    from nnunetv2.run.run_training import get_trainer_from_args

    cuda = torch.cuda.is_available()
    if cuda and args.cap_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_bytes / total, 0)
    row: dict = {"identifier": args.train, "cap_bytes": args.cap_bytes, "iterations": args.iterations}
    trainer = get_trainer_from_args(str(DATASET_ID), "3d_fullres", "all", "nnUNetTrainer", args.train,
                                    device=torch.device("cuda" if cuda else "cpu"))
    trainer.num_iterations_per_epoch, trainer.num_val_iterations_per_epoch, trainer.num_epochs = args.iterations, 2, 1
    row["patch_size"] = list(trainer.configuration_manager.patch_size)
    row["batch_size"] = trainer.configuration_manager.batch_size
    started = time.perf_counter()
    try:
        trainer.run_training()
        row["oom"] = False
    except torch.OutOfMemoryError as exc:
        row["oom"], row["error"] = True, str(exc).splitlines()[0]
    row["train_s"] = time.perf_counter() - started
    if cuda:
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row["reserved_bytes_at_end"] = torch.cuda.memory_reserved()
        row["process_device_bytes_at_end"] = _nvml_process_bytes()
        row["gpu"] = torch.cuda.get_device_name(0)
    print("RESULT " + json.dumps(row), flush=True)
    os._exit(0)  # nnU-Net's data-augmentation workers can keep the interpreter from exiting


def _nvml_process_bytes() -> int | None:
    """This process's device memory as NVML sees it (context + reserved), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - NVML missing or not permitted in a container: the number is optional
        return None
    return None


def _gpu_name() -> str | None:
    """The GPU's name from NVML, without creating a CUDA context in this (the planning) process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no NVML: a CPU run
        return None


def run_training(identifier: str, cap_bytes: int | None, iterations: int, root: Path, timeout_s: int) -> dict:
    cmd = [sys.executable, __file__, "--root", str(root), "--train", identifier, "--iterations", str(iterations)]
    if cap_bytes:
        cmd += ["--cap-bytes", str(cap_bytes)]
    started = time.perf_counter()
    # a session of its own: on a timeout the trainer and its data-augmentation workers go together
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return {"identifier": identifier, "failed": True, "timeout_s": timeout_s, "tail": output[-3000:]}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"identifier": identifier, "failed": True, "returncode": proc.returncode, "tail": output[-3000:]}
    row = json.loads(lines[-1][len("RESULT "):])
    row["wall_s"] = time.perf_counter() - started
    print(f"{identifier}: patch {row['patch_size']} batch {row['batch_size']} oom={row['oom']} "
          f"peak reserved {row.get('peak_reserved_bytes', 0) / 2**30:.2f} GiB, {row['train_s']:.0f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the result JSON")
    parser.add_argument("--root", help="nnU-Net's folders (default: a fresh folder in /tmp)")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS_GIB)), help="GiB, comma-separated")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--processes", type=int, default=8, help="nnU-Net's fingerprint/preprocessing workers")
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny dataset, 2 iterations, no cap")
    parser.add_argument("--train-default", action="store_true", help="also train nnU-Net's default plans")
    parser.add_argument("--plan-only", action="store_true", help="plan without preprocessing or training (CPU)")
    parser.add_argument("--no-settle", action="store_true",
                        help="plan by the estimate alone (default on a GPU: a patch only the upper bound keeps out "
                             "runs under the cap here and is taken if it runs, as `memfit nnunet plan` does)")
    parser.add_argument("--deadline-s", type=float, default=480, help="stop starting trainings after this long")
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--cap-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = Path(args.root or f"/tmp/memfit_nnunet_{os.getpid()}")
    _environment(root)
    if args.train:
        train(args)
        return
    if not args.out:
        parser.error("--out is required")
    import torch

    from memfit.estimate.gpus import gpu_spec

    device_name = _gpu_name()
    # memfit plans for the card that trains (its CUDA context and workspaces); H100 when it has no spec of it
    gpu = card(device_name) if card(device_name) in ("h100", "h200", "a100", "rtx4090") else "h100"
    spec = gpu_spec(gpu)
    shape, cases = (SMOKE_SHAPE, SMOKE_CASES) if args.smoke else (SHAPE, CASES)
    iterations = 2 if args.smoke else args.iterations
    targets = [int(t) for t in args.targets.split(",")]
    started = time.perf_counter()
    result: dict = {"gpu": device_name, "torch": torch.__version__, "date": dt.date.today().isoformat(),
                    "dataset": prepare(root, shape, cases, args.processes, not args.plan_only),
                    "iterations": 0 if args.plan_only else iterations}
    settle = not (args.no_settle or args.smoke or args.plan_only)
    result["settle"] = settle
    result["plans"] = plan_targets(targets, gpu, settle)
    # the allocator's share of a budget: less the CUDA context memfit assumes for a conv-only step
    # (memfit.estimate.gpus: measured on an H200 in a fresh process), as benchmarks/patch_vs_nnunet.py caps it
    context = spec.context_bytes(uses_cublas=False)
    jobs = []
    for row in [] if args.plan_only else result["plans"]:
        cap = None if args.smoke else row["budget_bytes"] - context
        jobs.append((row["target_gib"], "memfit", row["plans_identifier"], cap))
        if args.train_default:
            jobs.append((row["target_gib"], "nnunet_default", write_default_plans(row["target_gib"]), cap))
    runs = []
    for i, (gib, planner, identifier, cap) in enumerate(jobs):
        # what is left of the deadline, shared by the trainings still to run
        timeout = max(60, int((args.deadline_s - (time.perf_counter() - started)) / (len(jobs) - i)))
        runs.append({"target_gib": gib, "planner": planner, **run_training(identifier, cap, iterations, root, timeout)})
    result["context_bytes_assumed"] = context
    result["runs"] = runs
    result["total_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem('nnunet_plans', card(device_name), torch.__version__)}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} in {result['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
