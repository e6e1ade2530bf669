"""Fit the speed model's costs of torchao's 8-bit and CPU-offloaded Adam on one workload, judge them on the other.

Reads ``optimizer_state_<card>_torch<X.Y>_<date>.json`` (``optimizer_state_device.py``: the three optimizers of
GPT-2 and the 2-D U-Net timed in interleaved rounds on one GPU) and estimates each configuration here. Two
constants, each fitted on GPT-2 alone (the *fit* workload) to the measured step time it adds over the full-state
AdamW, then judged on the 2-D U-Net (*validation*: it tuned nothing):

* ``memfit.estimate.optimizer_twins.COMPILED_CALL_DISPATCHES``: CPU dispatches one ``torch.compile``'d 8-bit update
  costs (one call per quantized parameter);
* ``memfit.speed.step_time.OFFLOAD_S_PER_TENSOR``: host seconds per offloaded parameter (torchao steps one host
  optimizer per parameter and waits on its copies).

    PYTHONPATH=src python benchmarks/plan/optimizer_state_fit.py benchmarks/results/plan/optimizer_state_h200_torch2.11_20261127.json

Prints the fitted values and each workload's measured and predicted steps, before (the installed constants) and
after the fit; writes ``<input stem>_fit.json`` beside it. The committed file's "before" is the placeholders the
fit replaced (4 dispatches, 0 s per tensor).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

FIT, VALIDATION = "gpt2", "unet2d"
STATES = ("full", "8bit", "cpu_offload")


def _predicted_ms(name: str, state: str, gpu: str) -> float:
    from memfit import estimate
    from memfit.speed.step_time import predict_step_time
    from memfit.workload.zoo import builtin_workload

    e = estimate(builtin_workload(name).replace(optimizer_state=state), gpu=gpu)
    assert e.cost is not None
    return predict_step_time(e.cost, gpu).step_time_s * 1e3


def _solve(f: Any, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = target, f increasing (bisection on a few estimates)."""
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    import importlib

    # by module path: ``memfit.estimate`` is also the package's estimate function
    twins = importlib.import_module("memfit.estimate.optimizer_twins")
    step_time = importlib.import_module("memfit.speed.step_time")

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path)
    args = ap.parse_args()
    d = json.loads(args.measured.read_text())
    gpu = "h200" if "H200" in d["device"] else "h100"
    measured = {w: {s: d["timing"][w][s]["median_ms"] for s in STATES} for w in (FIT, VALIDATION)}

    def extra(name: str, state: str) -> float:
        return _predicted_ms(name, state, gpu) - _predicted_ms(name, "full", gpu)

    def with_dispatches(x: float) -> float:
        twins.COMPILED_CALL_DISPATCHES = x
        return extra(FIT, "8bit")

    def with_tensor_s(x: float) -> float:
        step_time.OFFLOAD_S_PER_TENSOR = x
        return extra(FIT, "cpu_offload")

    before = {w: {s: _predicted_ms(w, s, gpu) for s in STATES} for w in (FIT, VALIDATION)}
    dispatches = _solve(with_dispatches, measured[FIT]["8bit"] - measured[FIT]["full"], 0.0, 400.0)
    twins.COMPILED_CALL_DISPATCHES = dispatches
    tensor_s = _solve(with_tensor_s, measured[FIT]["cpu_offload"] - measured[FIT]["full"], 0.0, 0.02)
    step_time.OFFLOAD_S_PER_TENSOR = tensor_s
    after = {w: {s: _predicted_ms(w, s, gpu) for s in STATES} for w in (FIT, VALIDATION)}
    rows = []
    for w in (FIT, VALIDATION):
        for s in STATES[1:]:
            row = {"workload": w, "set": "fit" if w == FIT else "validation", "state": s,
                   "measured_ratio": measured[w][s] / measured[w]["full"],
                   "predicted_ratio_before": before[w][s] / before[w]["full"],
                   "predicted_ratio_after": after[w][s] / after[w]["full"],
                   "measured_extra_ms": measured[w][s] - measured[w]["full"],
                   "predicted_extra_ms_before": before[w][s] - before[w]["full"],
                   "predicted_extra_ms_after": after[w][s] - after[w]["full"]}
            rows.append(row)
            print(f"{w:7s} {s:12s} [{row['set']}] step / full-state step: measured {row['measured_ratio']:.2f}, "
                  f"predicted {row['predicted_ratio_before']:.2f} -> {row['predicted_ratio_after']:.2f}; extra ms "
                  f"measured {row['measured_extra_ms']:.1f}, predicted {row['predicted_extra_ms_before']:.1f} -> "
                  f"{row['predicted_extra_ms_after']:.1f}")
    print(f"COMPILED_CALL_DISPATCHES = {dispatches:.1f}, OFFLOAD_S_PER_TENSOR = {tensor_s * 1e3:.3f} ms")
    out = args.measured.with_name(args.measured.stem + "_fit.json")
    out.write_text(json.dumps({"measured": args.measured.name, "gpu": d["device"], "fit_workload": FIT,
                               "validation_workload": VALIDATION, "compiled_call_dispatches": dispatches,
                               "offload_s_per_tensor": tensor_s, "measured_ms": measured, "predicted_ms_before": before,
                               "predicted_ms_after": after, "rows": rows}, indent=1))
    print("->", out, file=sys.stderr)
    assert math.isfinite(dispatches) and math.isfinite(tensor_s)


if __name__ == "__main__":
    main()
