"""The calibration ``plan(calibration="auto")`` fits on this GPU for each sweep workload, written whole (GPU).

    python benchmarks/plan/calibration_dump.py --out $OUT/calibrations.json [--workloads gpt2,vit_b16]

The speed model's fitted constants and the timings they were fitted to (``Calibration.to_dict``), as
``choose_speed_model`` makes them for a plan of the sweep's effective batch; with them, plans and predictions can be
made again on a CPU (``plan(..., calibration=Calibration.from_dict(...))``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sweep_device import WORKLOADS, _workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    import torch

    from memfit.estimate.gpus import detect_gpu
    from memfit.speed.model_choice import choose_speed_model

    gpu = detect_gpu()
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": dt.date.today().isoformat(),
           "calibrations": {}}
    for name in args.workloads.split(","):
        started = time.perf_counter()
        speed = choose_speed_model(_workload(name), gpu, "auto", effective_batch=WORKLOADS[name][2])
        out["calibrations"][name] = {"reason": speed.reason, "seconds": time.perf_counter() - started,
                                     "calibration": speed.calibration.to_dict() if speed.calibration else None}
        print(name, speed.reason, flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
