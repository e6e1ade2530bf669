"""Does calibrating at the effective batch too (``model_choice.calibration_sizes``) predict step times better, on
models that decision was not made on?

``calibration_sizes`` was chosen on ResNet-50 and ViT-B/16 (``checkpoint_calibrated.py``). This checks it on other
built-in workloads with an effective batch above 8: each is calibrated on micro-batches 1, 2, 4, 8 and the
effective batch (timings of each kept), then its step is timed at a few micro-batches (accumulation 1) in
interleaved rounds. ``--report`` (CPU) refits the calibration on 1-8 alone and on 1-8 plus the effective batch from
those same timings, and sets both predictions beside the measured step times.

    python benchmarks/plan/calibration_sizes_check.py --out $OUT                                       # GPU
    PYTHONPATH=src python benchmarks/plan/calibration_sizes_check.py --report FILE.json --out FILE.md    # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from checkpoint_calibrated import timed_samples  # noqa: E402

from _results import card, write_gpu_json  # noqa: E402

# built-in workload -> (changes, effective batch, micro-batches to time); none of them decided calibration_sizes
MODELS: dict[str, tuple[dict[str, Any], int, tuple[int, ...]]] = {
    "unet2d": ({"patch_size": (256, 256)}, 32, (8, 16, 32)),
    "lstm": ({}, 64, (8, 32, 64)),
    "mlp": ({}, 1024, (64, 256, 1024)),
}


def _workload(name: str, batch: int) -> Any:
    from memfit.workload.zoo import builtin_workload

    return builtin_workload(name).replace(keep_output=False, batch_size=batch, accumulation_steps=1,
                                          **MODELS[name][0])


def measure(rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from memfit.speed.model_choice import calibration_sizes
    from memfit.speed.step_time import calibrate
    from memfit.workload.protocol import build, run_steps

    out: dict[str, Any] = {}
    for name, (_, eff, timed) in MODELS.items():
        calibration = calibrate(_workload(name, 1), micro_batches=calibration_sizes(eff))
        built = {m: (_workload(name, m), *build(_workload(name, m), "cuda")) for m in timed}
        for w, *state in built.values():
            run_steps(w, *state, autocast_device="cuda", scaler=None, steps=2)
        times: dict[int, list[float]] = {m: [] for m in timed}
        for _ in range(rounds):
            for m, (w, *state) in built.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                run_steps(w, *state, autocast_device="cuda", scaler=None, steps=steps)
                torch.cuda.synchronize()
                times[m].append((time.perf_counter() - start) / steps * 1e3)
        out[name] = {"calibration": calibration.to_dict(),
                     "step_ms": {str(m): statistics.median(t) for m, t in times.items()}}
        print(name, calibration.micro_batches, out[name]["step_ms"], flush=True)
        del built
        torch.cuda.empty_cache()
    return out


def report(path: Path) -> str:
    from memfit import estimate
    from memfit.estimate.gpus import gpu_spec
    from memfit.speed.model_choice import CALIBRATION_SIZES
    from memfit.speed.step_time import Calibration, fit_calibration, predict_step_time

    data = json.loads(path.read_text())
    spec = gpu_spec(card(data["device"]))
    lines = [f"# Calibration sizes on models they were not chosen on ({data['device']}, torch {data['torch']})", "",
             f"From `{path.name}` (`benchmarks/plan/calibration_sizes_check.py`); both calibrations refitted on this "
             "CPU from the same run's timings. Step: one micro-batch, no accumulation, loss-only loop.", "",
             "| model | micro-batch | measured ms | calibrated on 1-8 ms | error | with the effective batch ms | error |",
             "|---|---|---|---|---|---|---|"]
    errors: dict[str, list[float]] = {"small": [], "wide": []}
    for name, row in data["rows"].items():
        samples = timed_samples(Calibration.from_dict(row["calibration"]), spec,
                                lambda b, n=name: _workload(n, b))
        fits = {"small": fit_calibration([s for b, s in samples.items() if b in CALIBRATION_SIZES], spec),
                "wide": fit_calibration(list(samples.values()), spec)}
        for m, measured in row["step_ms"].items():
            cost = estimate(_workload(name, int(m)), gpu=spec).cost
            cells = ""
            for key, fit in fits.items():
                predicted = predict_step_time(cost, spec, calibration=fit).step_time_s * 1e3
                errors[key].append((predicted - measured) / measured)
                cells += f" {predicted:.1f} | {errors[key][-1]:+.0%} |"
            lines.append(f"| {name} | {m} | {measured:.1f} |{cells}")
    lines.append("")
    for key, label in (("small", "1-8"), ("wide", "1-8 and the effective batch")):
        e = errors[key]
        lines.append(f"Calibrated on {label}: median |error| {statistics.median(abs(v) for v in e):.1%}, "
                     f"range {min(e):+.1%} … {max(e):+.1%} ({len(e)} steps).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.report:
        args.out.write_text(report(args.report))
        print(args.out.read_text())
        return
    rows = measure(args.rounds, args.steps)
    print(write_gpu_json(args.out, "calibration_sizes_check", {"rounds": args.rounds, "steps": args.steps,
                                                               "rows": rows}))


if __name__ == "__main__":
    main()
