"""Fit the speed model's cost of selective checkpointing on one model and judge it on two others.

Selective checkpointing (``Workload.checkpoint_mode="selective"``) runs every op of a checkpointed block through
torch's Python dispatch modes, in its forward and its recompute: ``SpeedParams.selective_dispatch_s`` per op. It was
measured on a 2-core CPU; the H100 timings of ``checkpoint_modes_device.py`` (every block checkpointed each way,
interleaved rounds) show what it costs on a GPU host. The constant is fitted on GPT-2 alone (*fit*) to the measured
step time selective adds over full (non-reentrant) checkpointing, then judged on ViT-B/16 and ResNet-50
(*validation*: they tuned nothing).

    PYTHONPATH=src python benchmarks/plan/selective_fit.py benchmarks/results/plan/checkpoint_modes_h100_torch2.11_20261126.json

Writes ``<input stem>_selective_fit.json`` beside the input; "before" is the installed constant (the committed
file's: 17 us, the value the fit replaced).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoint_modes_device import workload  # noqa: E402

FIT, VALIDATION = "gpt2", ("vit_b16", "resnet50")


def main() -> None:
    from memfit import estimate
    from memfit.speed.step_time import ROOFLINE, Calibration, SpeedParams, predict_step_time

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path)
    args = ap.parse_args()
    d = json.loads(args.measured.read_text())
    gpu = "h100" if "H100" in d["device"] else "h200"
    costs = {(name, mode): estimate(workload(name, mode, False), gpu=gpu).cost
             for name in (FIT, *VALIDATION) for mode in ("full", "selective")}

    def extra_ms(name: str, params: SpeedParams) -> float:
        calib = Calibration(params=params, gpu="", workload="", micro_batches=(), measured=(), rms_log_error=0.0)
        t = {m: predict_step_time(costs[(name, m)], gpu, calibration=calib).step_time_s for m in ("full", "selective")}
        return (t["selective"] - t["full"]) * 1e3

    measured = {name: d["rows"][f"{name}/selective"]["step_ms"]["median_ms"]
                - d["rows"][f"{name}/full"]["step_ms"]["median_ms"] for name in (FIT, *VALIDATION)}
    lo, hi = 1e-7, 1e-3
    for _ in range(40):  # bisection: the extra grows with the constant
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if extra_ms(FIT, dataclasses.replace(ROOFLINE, selective_dispatch_s=mid)) < measured[FIT] \
            else (lo, mid)
    fitted = (lo * hi) ** 0.5
    after = dataclasses.replace(ROOFLINE, selective_dispatch_s=fitted)
    rows: list[dict[str, Any]] = []
    for name in (FIT, *VALIDATION):
        row = {"workload": name, "set": "fit" if name == FIT else "validation", "measured_extra_ms": measured[name],
               "predicted_extra_ms_before": extra_ms(name, ROOFLINE), "predicted_extra_ms_after": extra_ms(name, after)}
        rows.append(row)
        print(f"{name:9s} [{row['set']}] selective - full: measured {row['measured_extra_ms']:.1f} ms, predicted "
              f"{row['predicted_extra_ms_before']:.1f} -> {row['predicted_extra_ms_after']:.1f} ms")
    print(f"selective_dispatch_s = {fitted * 1e6:.1f} us (was {ROOFLINE.selective_dispatch_s * 1e6:.1f})")
    out = args.measured.with_name(args.measured.stem + "_selective_fit.json")
    out.write_text(json.dumps({"measured": args.measured.name, "gpu": d["device"], "fit_workload": FIT,
                               "validation_workloads": list(VALIDATION), "selective_dispatch_s": fitted,
                               "before_s": ROOFLINE.selective_dispatch_s, "rows": rows}, indent=1))
    print("->", out, file=sys.stderr)


if __name__ == "__main__":
    main()
