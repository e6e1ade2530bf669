"""The patch search under caps: the chosen patch runs, and no larger patch on the search's ladder does.

For each 3-D network and budget, ``plan_patch`` (on the CPU; the patch search decides by memory alone, so no speed
model is involved) picks the largest patch on nnU-Net's ladder down from the median shape whose training step fits
at batch 2. On the GPU, the chosen patch and every rung above it on the ladder run the workload's own protocol
(3 steps; ``memfit.estimate.measure.run_trial``: a fresh process each, so no allocator cache or cuDNN state
carries over) under an allocator cap of budget - the CUDA context the plan assumed
(``torch.cuda.set_per_process_memory_fraction``). Every rung above the chosen one has more voxels (each rung lies
inside the one above it: ``memfit.plan.patch.patch_ladder``). A cell is right when the chosen patch ran and every
larger rung ran out of memory: the largest patch that fits, not merely one that fits.

    python benchmarks/plan/patch_caps_device.py plan --out benchmarks/results/plan/patch_caps_predictions_cpu_<date>
    python benchmarks/plan/patch_caps_device.py run --predictions <that folder> --out $OUT     # on the GPU

``plan --settle`` (on the GPU the trials run on) plans as ``memfit plan --patch`` does there: a rung that only the
upper bound keeps out (its best estimate fits) is run under the cap first, and chosen if it ran.

Networks: the built-in ``unet3d`` (nnU-Net's PlainConvUNet layout in memfit's own code, 4 modalities, 4 classes)
and nnU-Net's ResEnc M (``dynamic_network_architectures.ResidualEncoderUNet``, 1 modality, 14 classes), both with
deep supervision, fp16 + GradScaler and SGD nesterov, as nnU-Net trains them. The device has no
``dynamic_network_architectures``: carry ``.whl`` (``benchmarks/integrations/nnunet_wheels.sh`` fills it) and install
``.whl/dynamic_network_architectures-*.whl`` with ``pip --target``, then put that folder on ``PYTHONPATH``.

Trials run ``--workers`` at a time. Each is its own process with its own cap, and the workers are limited so that
the caps plus a CUDA context each stay under 90 % of the card's memory: a trial's allocator never meets another's
memory, so its verdict is the one it would have alone. (Its ``outside_allocator_bytes`` then counts the other
processes too: not a context measurement.) Trials are started cell by cell in rounds, the chosen patch and the
next larger rung first, so ``--deadline-s`` leaves out the largest rungs, and says which. ``run --dry-run`` (CPU)
walks the same schedule with a stand-in verdict (memory linear in voxels from the chosen rung's need); its output
is for checking the script, never a result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as dt
import json
import math
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import card, stem  # noqa: E402

# a BraTS-like median shape after cropping at isotropic spacing (as benchmarks/patch_vs_nnunet.py); 5 stride-2
# downsamplings of the 6-stage networks: nnU-Net's divisibility of 32
MEDIAN_SHAPE = (192, 224, 192)
MULTIPLE = (32, 32, 32)
BATCH = 2  # nnU-Net's minimum batch (nnunetv2 ExperimentPlanner: batch_size >= 2)
BUDGETS_GB = (8, 12, 16)  # GPU memory in 10^9 bytes, as nnU-Net's gpu_memory_target takes it (8 GB: its default)
NETWORKS = ("unet3d", "resenc_m")
STEPS = 3  # memfit.workload.protocol.DEFAULT_STEPS: what run_trial runs
MEMORY_SHARE = 0.9  # of the card's memory the concurrent trials' caps and contexts may add up to
TRIAL_TIMEOUT_S = 90  # a trial is 3 steps of a 3-D U-Net after importing torch: seconds, not minutes


def resenc_m():  # noqa: ANN201 - a memfit.Workload (loaded by the trial processes as FILE:resenc_m)
    """nnU-Net ResEnc M (Isensee et al. 2024): residual encoder, blocks per stage 1, 3, 4, 6, 6, 6, features
    32..320, instance norm, leaky ReLU, 1 modality and 14 classes (an abdominal CT label set)."""
    import torch
    from torch import nn

    from memfit import Workload
    from memfit.workload.models import deep_supervision_loss

    def model() -> nn.Module:
        from dynamic_network_architectures.architectures.unet import ResidualEncoderUNet

        n = 6
        return ResidualEncoderUNet(
            input_channels=1, n_stages=n, features_per_stage=[32, 64, 128, 256, 320, 320], conv_op=nn.Conv3d,
            kernel_sizes=[[3, 3, 3]] * n, strides=[[1, 1, 1]] + [[2, 2, 2]] * (n - 1),
            n_blocks_per_stage=[1, 3, 4, 6, 6, 6], num_classes=14, n_conv_per_stage_decoder=[1] * (n - 1),
            conv_bias=True, norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
            nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True}, deep_supervision=True,
        )

    return Workload(
        name="resenc_m",
        description="nnU-Net ResEnc M (dynamic_network_architectures), 1 modality, 14 classes, deep supervision, "
        "SGD nesterov 0.99, fp16 + GradScaler",
        model=model,
        batch=lambda n, patch: (torch.randn(n, 1, *patch), torch.randint(0, 14, (n, *patch))),
        patch_size=MEDIAN_SHAPE,
        patch_multiple=MULTIPLE,
        loss=lambda out, batch: deep_supervision_loss(out, batch[1]),
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5),
        batch_size=BATCH,
        precision="fp16",
        tags=("cnn", "segmentation", "3d", "unet", "dynamic_network_architectures"),
    )


def _spec(network: str) -> str:
    """What ``run_trial`` loads: a built-in name, or this file and the factory's name."""
    return "unet3d" if network == "unet3d" else f"{Path(__file__).resolve()}:{network}"


def _workload(network: str):  # noqa: ANN202
    from memfit.workload.loading import load_workload

    return load_workload(_spec(network)).replace(patch_size=MEDIAN_SHAPE, patch_multiple=MULTIPLE,
                                                 batch_size=BATCH)


# ------------------------------------------------------------------------------------------------ CPU


def _settle(network: str):  # noqa: ANN202 - a memfit.plan.patch.Settle
    """``plan_patch``'s settle on this GPU: the rung's step under the cap in a fresh process, as the run stage's
    trials run it (``_run_under_cap``)."""
    def settle(config, cap_bytes: int) -> bool:  # noqa: ANN001
        result = _run_under_cap(network, tuple(config.patch_size), cap_bytes)
        print(f"  settle {network} {'x'.join(map(str, config.patch_size))} under {cap_bytes / 2**30:.2f} GiB: "
              f"{'ran' if result['ok'] else result['error'][:80]}", flush=True)
        return bool(result["ok"])

    return settle


def plan_network(network: str, gpu: str, settle: bool = False) -> dict:
    from memfit.plan.patch import patch_ladder, plan_patch

    sys.path.insert(0, str(HERE))
    from sweep_device import _provenance

    w = _workload(network)
    ladder = patch_ladder(MEDIAN_SHAPE, MULTIPLE)
    cells = []
    for gb in BUDGETS_GB:
        started = time.perf_counter()
        p = plan_patch(w, budget_bytes=int(gb * 1e9), gpu=gpu, calibration=None,
                       settle=_settle(network) if settle else None)
        chosen = p.chosen
        patch = tuple(chosen.config.patch_size)
        cells.append({
            "budget_gb": gb, "budget_bytes": p.budget_bytes, "patch": list(patch), "batch": chosen.config.micro_batch,
            "rung": ladder.index(patch), "voxels": math.prod(patch),
            # a Candidate's memory is the upper bound the search decides with (Estimate.fits_in_upper_bytes)
            "predicted_device_upper_bytes": chosen.device_bytes, "predicted_fits_in_upper_bytes": chosen.fits_in_bytes,
            "context_bytes": chosen.device_bytes - chosen.fits_in_bytes, "speed_model": p.speed_model,
            "estimated": [{"patch": list(c.config.patch_size), "device_upper_bytes": c.device_bytes, "fits": c.fits}
                          for c in p.frontier],
            "estimates": p.estimates, "planning_s": time.perf_counter() - started, "notes": p.notes,
        })
        print(f"{network} {gb} GB: patch {'x'.join(map(str, patch))} (rung {cells[-1]['rung']} of {len(ladder)}), "
              f"predicted {chosen.device_bytes / 2**30:.2f} GiB, {cells[-1]['planning_s']:.1f} s", flush=True)
    return {"network": network, "spec": _spec(network).rsplit("/", 1)[-1], "gpu": gpu, "median_shape": MEDIAN_SHAPE,
            "multiple": MULTIPLE, "batch": BATCH, "ladder": [list(r) for r in ladder], "cells": cells,
            "settled_on_gpu": settle, "provenance": _provenance("gpu" if settle else "cpu")}


def plan_stage(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for network in args.networks.split(","):
        (out / f"{network}.json").write_text(json.dumps(plan_network(network, args.gpu, args.settle), indent=1))


# ------------------------------------------------------------------------------------------------ GPU


@dataclasses.dataclass
class _Job:
    network: str
    cell: int
    rung: int
    patch: tuple[int, ...]
    cap_bytes: int
    result: dict | None = None


def schedule(preds: list[dict]) -> list[_Job]:
    """Every cell's chosen rung and the rungs above it, in rounds: each cell's chosen patch, then each cell's
    next larger rung, and so on, so a deadline cuts the largest rungs first."""
    per_cell: list[list[_Job]] = []
    for pred in preds:
        for i, cell in enumerate(pred["cells"]):
            cap = cell["budget_bytes"] - cell["context_bytes"]
            rungs = range(cell["rung"], -1, -1)  # the chosen one, then up the ladder (more voxels each)
            per_cell.append([_Job(pred["network"], i, r, tuple(pred["ladder"][r]), cap) for r in rungs])
    return [jobs[k] for k in range(max(map(len, per_cell), default=0)) for jobs in per_cell if k < len(jobs)]


def _is_oom(error: str) -> bool:
    return "out of memory" in error.lower()


def _trial(job: _Job, dry_run: dict | None) -> dict:
    if dry_run is not None:  # the stand-in verdict: memory linear in voxels from the chosen rung's need
        per_voxel = dry_run[(job.network, job.cell)]
        need = int(per_voxel * math.prod(job.patch))
        ok = need <= job.cap_bytes
        return {"ok": ok, "cap_bytes": job.cap_bytes, "peak_allocated_bytes": min(need, job.cap_bytes),
                "peak_reserved_bytes": 0, "outside_allocator_bytes": 0, "num_alloc_retries": 0, "elapsed_s": 0.0,
                "error": "" if ok else "stand-in: out of memory"}
    return _run_under_cap(job.network, job.patch, job.cap_bytes)


def _run_under_cap(network: str, patch: tuple[int, ...], cap_bytes: int) -> dict:
    """The protocol of ``network`` at ``patch`` and batch ``BATCH`` under ``cap_bytes``, in a fresh process."""
    import subprocess

    from memfit.estimate.measure import run_trial

    try:
        trial = run_trial(_spec(network), cap_bytes=cap_bytes, timeout_s=TRIAL_TIMEOUT_S,
                          changes={"patch_size": list(patch), "patch_multiple": list(MULTIPLE), "batch_size": BATCH})
    except subprocess.TimeoutExpired:  # a verdict of neither kind: the cell says inconclusive
        return {"ok": False, "cap_bytes": cap_bytes, "error": f"no result in {TRIAL_TIMEOUT_S} s"}
    return dataclasses.asdict(trial)


def _workers(requested: int, jobs: list[_Job], dry_run: bool) -> int:
    if dry_run or not jobs:
        return max(1, requested)
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    per_trial = max(j.cap_bytes for j in jobs) + (1 << 30)  # the cap and a CUDA context (at most 0.8 GiB, gpus.py)
    return max(1, min(requested, int(MEMORY_SHARE * total // per_trial)))


def run_stage(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preds = [json.loads((Path(args.predictions) / f"{n}.json").read_text()) for n in args.networks.split(",")]
    jobs = schedule(preds)
    stand_in = None
    if args.dry_run:
        # the need per voxel of each chosen patch: its upper bound less the bound's median over-ask on the corpus's
        # validation half (13.5 %, README), so that some larger rungs "run" and every verdict path is walked
        stand_in = {(p["network"], i): c["predicted_fits_in_upper_bytes"] / 1.135 / c["voxels"]
                    for p in preds for i, c in enumerate(p["cells"])}
    workers = _workers(args.workers, jobs, args.dry_run)
    print(f"{len(jobs)} trials, {workers} at a time", flush=True)
    started = time.perf_counter()
    lock = threading.Lock()

    def run(job: _Job) -> None:
        if time.perf_counter() - started > args.deadline_s:
            return  # not started: the result says so
        job.result = _trial(job, stand_in)
        with lock:
            print(f"{job.network} cell {job.cell} rung {job.rung} {'x'.join(map(str, job.patch))}: "
                  f"{'ran' if job.result['ok'] else job.result['error'][:80]} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)

    # the pool takes jobs in schedule order, so the rounds (chosen patches first) hold under the deadline
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, jobs))
    result = {"dry_run": bool(args.dry_run), "workers": workers, "run_s": time.perf_counter() - started,
              "networks": [_verdicts(p, [j for j in jobs if j.network == p["network"]]) for p in preds]}
    if args.dry_run:
        result.update(gpu=None, torch=None, date=dt.date.today().isoformat())
        name = "patch_caps_dry_run"
    else:
        import torch

        result.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, date=dt.date.today().isoformat())
        name = stem("patch_caps", card(result["gpu"]), torch.__version__)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / f'{name}.json'}", flush=True)


def _verdicts(pred: dict, jobs: list[_Job]) -> dict:
    cells = []
    for i, cell in enumerate(pred["cells"]):
        mine = sorted((j for j in jobs if j.cell == i), key=lambda j: -j.rung)  # chosen first, then larger
        chosen, larger = mine[0], mine[1:]
        tried = [j for j in larger if j.result is not None]
        ran = [j for j in tried if j.result["ok"]]
        failed = [j for j in tried if not j.result["ok"] and not _is_oom(j.result["error"])]
        chosen_ran = chosen.result is not None and chosen.result["ok"]
        if chosen.result is None or failed or (chosen.result is not None and not chosen_ran
                                                and not _is_oom(chosen.result["error"])):
            verdict = "inconclusive"  # not run, or a failure that is not an OOM
        elif not chosen_ran:
            verdict = "chosen patch ran out of memory"
        elif ran:
            verdict = "a larger rung ran"
        elif len(tried) < len(larger):
            verdict = "chosen ran; larger rungs tried all ran out of memory, some not tried"
        else:
            verdict = "largest that fits"
        cells.append({
            **{k: cell[k] for k in ("budget_gb", "budget_bytes", "patch", "batch", "rung", "voxels",
                                    "predicted_device_upper_bytes", "context_bytes")},
            "cap_bytes": chosen.cap_bytes, "verdict": verdict, "chosen_ran": chosen_ran,
            "chosen_trial": chosen.result,
            "larger": [{"rung": j.rung, "patch": list(j.patch), "voxels": math.prod(j.patch),
                        "voxels_vs_chosen": math.prod(j.patch) / cell["voxels"],
                        "trial": j.result} for j in larger],
            "larger_tried": len(tried), "larger_ran": len(ran), "plan_notes": cell.get("notes", []),
        })
    return {"network": pred["network"], "plans_gpu": pred["gpu"], "plans_provenance": pred.get("provenance"),
            "settled_on_gpu": pred.get("settled_on_gpu", False),
            "median_shape": pred["median_shape"], "ladder_rungs": len(pred["ladder"]), "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("plan", help="plan_patch for each network and budget, on the CPU")
    p.add_argument("--out", required=True)
    p.add_argument("--networks", default=",".join(NETWORKS))
    p.add_argument("--gpu", default="h100", help="the GPU the trials will run on (h100, h200)")
    p.add_argument("--settle", action="store_true",
                   help="on the GPU: rungs only the upper bound keeps out are run under the cap (plan_patch's settle)")
    p.set_defaults(func=plan_stage)
    r = sub.add_parser("run", help="the chosen patches and every larger rung under the caps, on the GPU")
    r.add_argument("--out", required=True)
    r.add_argument("--predictions", required=True, help="the plan stage's folder")
    r.add_argument("--networks", default=",".join(NETWORKS))
    r.add_argument("--workers", type=int, default=4, help="trials at a time (fewer if the caps need it)")
    r.add_argument("--deadline-s", type=float, default=110.0, help="start no trial after this long")
    r.add_argument("--dry-run", action="store_true", help="on the CPU: the schedule with a stand-in verdict")
    r.set_defaults(func=run_stage)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
