"""The nnU-Net question: the largest patch that fits a GPU, chosen by memfit and by nnU-Net's rule.

nnU-Net's experiment planner (nnunetv2 ``ExperimentPlanner``, documented in
../shared/research/estimation.md §4) does not estimate memory: it counts conv output elements of the network at
the patch (``compute_conv_feature_map_size``) and compares that with a reference, 560e6 elements for 8 GB at
batch 2 (``UNet_reference_val_3d``, ``UNet_reference_val_corresp_GB``, ``UNet_reference_val_corresp_bs_3d``),
scaled linearly with the GPU memory target. While ``proxy / 2 * 2 > reference`` it shrinks the axis that is
largest relative to the median shape by one divisibility step; the batch is then ``round(reference / proxy * 2)``,
at least 2. This script reproduces that rule (nnunetv2 itself is not installed; the proxy is computed with
forward hooks over the same PlainConvUNet layout, every Conv/ConvTranspose output counted) and runs memfit's
``plan_patch`` on the same network, same start, same budgets. Then the GPU says whether each choice runs under
a cap of budget - CUDA context.

    python benchmarks/patch_vs_nnunet.py predict --out benchmarks/results/plan/patch_predictions_cpu_<date>  # CPU
    python benchmarks/patch_vs_nnunet.py measure --out $OUT      # GPU; --predictions: default the newest

``measure`` writes ``patch_vs_nnunet_<card>_torch<X.Y>_<yyyymmdd>.json``; committed results go to
``benchmarks/results/plan/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import card, latest, stem  # noqa: E402

MEDIAN_SHAPE = (192, 224, 192)  # a BraTS-like median shape after cropping, isotropic spacing
MULTIPLE = (32, 32, 32)  # 5 stride-2 poolings: nnU-Net's divisibility for 6 stages
BUDGETS_GB = (8, 12, 16, 24)  # GPU memory targets in 10^9 bytes, as nnU-Net's -gpu_memory_target takes them
REFERENCE_3D = 560_000_000  # nnunetv2 default_experiment_planner.py: UNet_reference_val_3d
REFERENCE_GB = 8  # UNet_reference_val_corresp_GB
REFERENCE_BS = 2  # UNet_reference_val_corresp_bs_3d


def _workload(patch: tuple[int, ...], batch: int):  # noqa: ANN202
    from memfit.workload.zoo import builtin_workload

    return builtin_workload("unet3d").replace(patch_size=patch, patch_multiple=MULTIPLE, batch_size=batch)


def conv_output_elements(patch: tuple[int, ...]) -> int:
    """nnU-Net's VRAM proxy: conv (and transposed-conv) output elements of one sample at ``patch``."""
    import torch

    from memfit.workload.models import UNet

    total = 0

    def count(_module, _inputs, output) -> None:  # noqa: ANN001
        nonlocal total
        total += output.numel()

    with torch.device("meta"):
        net = UNet(dims=3, in_channels=4, classes=4)
        hooks = [m.register_forward_hook(count) for m in net.modules()
                 if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d))]
        net(torch.empty(1, 4, *patch))
    for h in hooks:
        h.remove()
    return total


def nnunet_rule(budget_gb: float) -> dict:
    from memfit.plan.patch import patch_ladder

    reference = REFERENCE_3D * budget_gb / REFERENCE_GB
    for patch in patch_ladder(MEDIAN_SHAPE, MULTIPLE):
        proxy = conv_output_elements(patch)
        if proxy / REFERENCE_BS * 2 <= reference:
            batch = max(2, round(reference / proxy * REFERENCE_BS))
            return {"patch": list(patch), "batch": batch, "proxy": proxy, "reference": reference}
    return {"patch": None, "batch": None}


def predict(args: argparse.Namespace) -> None:
    from memfit.plan.patch import plan_patch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for gb in BUDGETS_GB:
        budget = int(gb * 1e9)
        started = time.perf_counter()
        p = plan_patch(_workload(MEDIAN_SHAPE, 2), budget_bytes=budget, gpu=args.gpu)
        rows.append({
            "budget_gb": gb,
            "memfit": {"patch": list(p.chosen.config.patch_size), "batch": p.chosen.config.micro_batch,
                       "predicted_device_bytes": p.chosen.device_bytes, "planning_s": time.perf_counter() - started,
                       "estimates": p.estimates},
            "nnunet": nnunet_rule(gb),
        })
        print(json.dumps(rows[-1]), flush=True)
    (out / "patch_vs_nnunet.json").write_text(json.dumps({"median_shape": MEDIAN_SHAPE, "rows": rows}, indent=1))


def measure(args: argparse.Namespace) -> None:
    import torch

    from memfit.estimate.measure import run_trial

    pred = json.loads((Path(args.predictions) / "patch_vs_nnunet.json").read_text())
    # the allocator's share of a budget: less the CUDA context memfit assumes for a conv-only step (measured on
    # an H200 in a fresh process: 639-641 MiB, memfit.estimate.gpus); measuring it here would count this process too
    from memfit.estimate.gpus import gpu_spec

    context = gpu_spec("h200").context_bytes(uses_cublas=False)
    rows = []
    for row in pred["rows"]:
        cap = int(row["budget_gb"] * 1e9) - context
        for who in ("memfit", "nnunet"):
            choice = row[who]
            if choice["patch"] is None:
                continue
            changes = {"patch_size": choice["patch"], "batch_size": choice["batch"]}
            uncapped = run_trial("unet3d", changes=changes)
            capped = run_trial("unet3d", changes=changes, cap_bytes=cap)
            choice["measured"] = {"uncapped": dataclasses.asdict(uncapped), "under_cap": dataclasses.asdict(capped)}
            print(f"{row['budget_gb']} GB {who}: patch {choice['patch']} batch {choice['batch']}: "
                  f"peak {uncapped.peak_allocated_bytes / 2**30:.2f} GiB, under cap ok={capped.ok}", flush=True)
        rows.append(row)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": dt.date.today().isoformat(),
              "context_bytes": context, "median_shape": pred["median_shape"], "rows": rows,
              "voxels": {str(r["budget_gb"]): {w: math.prod(r[w]["patch"]) for w in ("memfit", "nnunet")
                                               if r[w]["patch"]} for r in rows}}
    name = stem("patch_vs_nnunet", card(result["gpu"]), torch.__version__)
    (Path(args.out) / f"{name}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=("predict", "measure"))
    parser.add_argument("--out", default="out")
    parser.add_argument("--predictions", default=str(latest("plan", "patch_predictions_")))
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    predict(args) if args.stage == "predict" else measure(args)


if __name__ == "__main__":
    main()
