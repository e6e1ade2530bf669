"""Where a checkpoint mode's time goes on a GPU: the kernels' own time against the host's, beside the speed model.

``checkpoint_modes_device.py`` found selective checkpointing slower than full checkpointing on all three models
and the speed model far under it on ResNet-50 (+8.6 ms predicted over full, +31.3 measured on an H100). Wall time
alone cannot say whether the GPU or the host is the cause. Here each (model, mode) of that benchmark runs a few
optimizer steps under ``torch.profiler`` after two warm-up steps: per step, the wall time (CUDA-synchronised), the
summed time of the CUDA kernels (the GPU's work, however it overlaps), the kernel count, and the host's time in
the CPU-side ops; beside them the speed model's ``gpu_busy_s`` and ``cpu_s`` for the same configuration (from
``checkpoint_modes_device.py --predict``'s CPU estimates, made before this ran). The ten kernels whose summed time
grows most from full to selective are listed per model.

    python benchmarks/plan/checkpoint_profile.py --predict --out benchmarks/results/plan          # CPU, first
    python benchmarks/plan/checkpoint_profile.py --out $OUT                                       # GPU
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import checkpoint_modes_device as modes  # noqa: E402

from _results import card, latest, stem  # noqa: E402


def predict() -> dict[str, Any]:
    """The speed model's GPU-busy and CPU seconds per step of every (model, mode), roofline, H100 and H200."""
    from memfit import estimate
    from memfit.speed.step_time import predict_step_time

    out: dict[str, Any] = {}
    for name in modes.MODELS:
        for mode in modes.MODES:
            cost = estimate(modes.workload(name, mode, False), gpu="h100").cost
            out[f"{name}/{mode}"] = {
                g: {k: getattr(p, k) * 1e3 for k in ("step_time_s", "gpu_busy_s", "cpu_s", "recompute_s")}
                for g in ("h100", "h200") for p in [predict_step_time(cost, g)]}
            print(name, mode, out[f"{name}/{mode}"]["h100"], flush=True)
    return out


def profile(name: str, steps: int) -> dict[str, Any]:
    """Per mode of ``name``: wall, kernel and host time per step under torch.profiler, and kernel totals."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from memfit.workload.protocol import build, run_steps

    result: dict[str, Any] = {}
    for mode in modes.MODES:
        w = modes.workload(name, mode, False)
        model, optimizer, batch = build(w, "cuda")
        run_steps(w, model, optimizer, batch, autocast_device="cuda", scaler=None, steps=2)  # state, warm-up
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            run_steps(w, model, optimizer, batch, autocast_device="cuda", scaler=None, steps=steps)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        kernels: collections.Counter[str] = collections.Counter()
        counts: collections.Counter[str] = collections.Counter()
        host_ops = 0
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] += event.device_time  # us
                counts[event.name] += 1
            elif event.name.startswith("aten::"):
                host_ops += 1
        result[mode] = {
            "wall_ms": wall / steps * 1e3,  # profiled: the profiler's own host cost is in it
            "kernel_ms": sum(kernels.values()) / steps / 1e3,
            "kernels": sum(counts.values()) // steps,
            "aten_ops": host_ops // steps,
            "by_kernel_ms": {k: v / steps / 1e3 for k, v in kernels.most_common(40)},
        }
        print(name, mode, {k: v for k, v in result[mode].items() if k != "by_kernel_ms"}, flush=True)
        del model, optimizer, batch, prof
        torch.cuda.empty_cache()
    full, sel = result["full"]["by_kernel_ms"], result["selective"]["by_kernel_ms"]
    grows = sorted(((sel.get(k, 0.0) - full.get(k, 0.0), k) for k in set(full) | set(sel)), reverse=True)
    result["selective_minus_full_top"] = [{"kernel": k[:160], "ms": round(d, 3)} for d, k in grows[:10]]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--predict", action="store_true", help="CPU: the speed model's predictions, written first")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default=",".join(modes.MODELS))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if args.predict:
        path = args.out / f"{stem('checkpoint_profile_predictions', 'cpu', torch.__version__)}.json"
        path.write_text(json.dumps({"torch": torch.__version__, "rows": predict()}, indent=1))
        print(path)
        return
    predictions = latest("plan", "checkpoint_profile_predictions_cpu_")
    rows = {name: profile(name, args.steps) for name in args.models.split(",")}
    path = args.out / f"{stem('checkpoint_profile', card(torch.cuda.get_device_name(0)), torch.__version__)}.json"
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps,
        "predictions_file": predictions.name if predictions.exists() else None,
        "predictions": json.loads(predictions.read_text())["rows"] if predictions.exists() else None, "rows": rows,
    }, indent=1))
    print(path)


if __name__ == "__main__":
    main()
