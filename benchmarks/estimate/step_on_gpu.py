"""One training step of zoo entries on the GPU, eagerly, outside memfit: where a step fails on the device for a
reason other than memory, the traceback of the user's own code (device script; session 25).

    python benchmarks/estimate/step_on_gpu.py h3_hf_deformable_detr,h3_hf_mask2former > $OUT/step_on_gpu.log 2>&1
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
from registry import entries  # noqa: E402

from memfit.workload.loading import load_workload  # noqa: E402
from memfit.workload.protocol import place_batch  # noqa: E402


def main(names: list[str]) -> None:
    for entry in entries(names):
        w = load_workload(entry.spec)
        try:
            torch.manual_seed(0)
            model = w.model().cuda().train()
            batch = place_batch(w.make_batch(w.batch_size), "cuda", False)
            w.loss(w.run_forward(model, batch), batch).backward()
            print(f"{entry.name}: ran", flush=True)
        except Exception:  # noqa: BLE001 - the traceback is the result
            print(f"{entry.name}: failed", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
