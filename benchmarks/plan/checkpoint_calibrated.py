"""Checkpoint modes against the *calibrated* speed model: what ``plan`` ranks them by on a machine with the GPU.

``plan`` calibrates on the GPU when the machine has the card it plans for (``memfit.speed.model_choice``): a few
micro-batches of the step without checkpointing, timed, fit the host's and the GPU's constants. The constants of
checkpointing's host work (``recompute_dispatch_s``, ``reentrant_recompute_dispatch_s``, ``selective_dispatch_s``)
are not in those timings. This runs, per model of ``checkpoint_modes_device.py`` (GPT-2, ViT-B/16, ResNet-50, every
block checkpointed), the calibration ``plan`` would run (micro-batches 1, 2, 4, 8), then times the four modes in
interleaved rounds in one process, and writes the calibration and the times; the predictions are made afterwards
on a CPU from the calibration (``--report``), so any change to how the calibrated model treats checkpointing is
judged on timings taken before it.

    python benchmarks/plan/checkpoint_calibrated.py --out $OUT                                     # GPU
    python benchmarks/plan/checkpoint_calibrated.py --sizes 1,2,4,8,16,32,64 --tag _wide --out $OUT  # GPU
    PYTHONPATH=src python benchmarks/plan/checkpoint_calibrated.py --report FILE.json --out FILE.md  # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import checkpoint_modes_device as modes  # noqa: E402

from _results import card, write_gpu_json  # noqa: E402


def measure(rounds: int, steps: int, sizes: tuple[int, ...] | None) -> dict[str, Any]:
    import torch

    from memfit.speed.model_choice import CALIBRATION_SIZES
    from memfit.speed.step_time import calibrate

    out: dict[str, Any] = {}
    for name, micro in modes.MODELS.items():
        timed = tuple(m for m in (sizes or CALIBRATION_SIZES) if m <= micro)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            calibration = calibrate(modes.workload(name, "none", False), micro_batches=timed)
        torch.cuda.empty_cache()
        out[name] = {"calibration": calibration.to_dict(),
                     "step_ms": modes.measure_speed(name, False, rounds, steps)}
        print(name, calibration.params.forward_dispatch_s, calibration.rms_log_error,
              {m: round(v["median_ms"], 1) for m, v in out[name]["step_ms"].items()}, flush=True)
    return out


def timed_samples(calibration: Any, spec: Any, workload_at: Callable[[int], Any]) -> dict[int, Any]:
    """``calibration``'s own timings as ``CalibrationSample``s by micro-batch, each traced once on this CPU
    (``workload_at(b)``: the workload at micro-batch ``b``): fitted again on a subset (``fit_calibration``), they
    say what calibrating on fewer micro-batches would have given, judged on the same run's step times."""
    from memfit.speed.step_time import CalibrationSample, _trace_cost

    return {b: CalibrationSample(cost=_trace_cost(workload_at(b), spec), forward_s=f, backward_s=bw, optimizer_s=o)
            for b, (f, bw, o) in zip(calibration.micro_batches, calibration.measured, strict=True)}


def _order(times: dict[str, float]) -> str:
    return " < ".join(sorted(times, key=times.__getitem__))


def report(path: Path, subsets: list[tuple[int, ...]] | None = None) -> str:
    """Predicted (calibrated) against measured step ms per model and mode, and the order of the modes; with
    ``subsets``, a column per subset of the timed micro-batches, each a calibration fitted on those alone."""
    from memfit import estimate
    from memfit.estimate.gpus import gpu_spec
    from memfit.speed.step_time import Calibration, fit_calibration, predict_step_time

    data = json.loads(path.read_text())
    subsets = subsets or []
    heads = "".join(f" calibrated on {','.join(map(str, s))}: ms | error |" for s in subsets)
    lines = [f"# Checkpoint modes, calibrated speed model against measured ({data['device']}, torch {data['torch']})",
             "", f"From `{path.name}`; predictions on this CPU from each model's calibration (`--report`).", "",
             f"| model | mode | measured ms | predicted ms | error |{heads}",
             "|---|---|---|---|---|" + "---|---|" * len(subsets)]
    spec = gpu_spec(card(data["device"]))
    for name, row in data["rows"].items():
        calibration = Calibration.from_dict(row["calibration"])
        measured = {m: v["median_ms"] for m, v in row["step_ms"].items()}
        samples = timed_samples(calibration, spec,
                                lambda b, n=name: modes.workload(n, "none", False).replace(batch_size=b)) \
            if subsets else {}
        others = [fit_calibration([v for b, v in samples.items() if b in s], spec, workload=name) for s in subsets]
        predicted: dict[str, float] = {}
        alternatives: list[dict[str, float]] = [{} for _ in subsets]
        for mode in modes.MODES:
            cost = estimate(modes.workload(name, mode, False), gpu=spec).cost
            predicted[mode] = predict_step_time(cost, spec, calibration=calibration).step_time_s * 1e3
            cells = ""
            for other, alt in zip(others, alternatives, strict=True):
                alt[mode] = predict_step_time(cost, spec, calibration=other).step_time_s * 1e3
                cells += f" {alt[mode]:.1f} | {(alt[mode] - measured[mode]) / measured[mode]:+.0%} |"
            lines.append(f"| {name} | {mode} | {measured[mode]:.1f} | {predicted[mode]:.1f} | "
                         f"{(predicted[mode] - measured[mode]) / measured[mode]:+.0%} |{cells}")
        truth = _order(measured)
        lines.append(f"| {name} | order | {truth} | {_order(predicted)} | "
                     f"{'same' if _order(predicted) == truth else 'differs'} |"
                     + "".join(f" {_order(a)} | {'same' if _order(a) == truth else 'differs'} |" for a in alternatives))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", type=Path, help="CPU: a GPU run's JSON to predict against")
    ap.add_argument("--subsets", nargs="*", default=[], help="with --report: micro-batch subsets to refit on (1,2,4,8)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sizes", help="micro-batches to calibrate on, comma-separated (default: plan's, 1,2,4,8)")
    ap.add_argument("--tag", default="", help="appended to the result's name")
    args = ap.parse_args()
    if args.report:
        args.out.write_text(report(args.report, [tuple(map(int, x.split(","))) for x in args.subsets]))
        print(args.out.read_text())
        return
    rows = measure(args.rounds, args.steps, tuple(map(int, args.sizes.split(","))) if args.sizes else None)
    print(write_gpu_json(args.out, "checkpoint_calibrated", {"rounds": args.rounds, "steps": args.steps, "rows": rows},
                         args.tag))


if __name__ == "__main__":
    main()
