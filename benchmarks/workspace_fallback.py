"""fits_in with cuDNN workspaces optional (memfit's model: PyTorch falls back to an algorithm with less workspace
when one does not fit) versus mandatory, against the measured smallest cap.

    python benchmarks/workspace_fallback.py [names]   # CPU; prints a markdown table

The measured column is the newest ``benchmarks/results/estimate/measurements_h200_*`` run of the accuracy suite
(``estimate_accuracy.py measure``), the card whose workspace rules the trace uses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import latest  # noqa: E402
from memfit.estimate.allocator import smallest_fitting_capacity  # noqa: E402
from memfit.estimate.gpus import gpu_spec  # noqa: E402
from memfit.estimate.trace import trace_workload  # noqa: E402

MiB = 1 << 20


def main() -> None:
    import workloads

    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["smp_unet_r34", "unet2d_tiles", "monai_unet3d"]
    print("| workload | optional workspaces | mandatory workspaces | measured |")
    print("|---|---|---|---|")
    for name in names:
        events = trace_workload(getattr(workloads, name), gpu_spec("h200")).events()
        soft = smallest_fitting_capacity(events)
        hard = smallest_fitting_capacity([(1 if op == 2 else op, key, n) for op, key, n in events])
        measured = json.loads((latest("estimate", "measurements_h200_") / f"measured_{name}.json").read_text())
        m = measured["fits_in_bytes"]
        print(f"| {name} | {soft / MiB:,.0f} MiB ({(soft - m) / m:+.1%}) | {hard / MiB:,.0f} MiB "
              f"({(hard - m) / m:+.1%}) | {m / MiB:,.0f} MiB |")


if __name__ == "__main__":
    main()
