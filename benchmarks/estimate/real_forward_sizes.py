"""What the real forward that sizes a detector's outputs hands to the trace: every value-dependent op's output
shapes, in call order, and the estimate made with them.

Run once per source tree (``PYTHONPATH=<tree>/src``) and compare the files: the before/after of a change to the
real forward (memfit.estimate.data_dependent.ProductStandIns), e.g.

    PYTHONPATH=src python benchmarks/estimate/real_forward_sizes.py OUT.json \\
        torchvision_models:tv_fasterrcnn_resnet50_fpn torchvision_models:tv_maskrcnn_resnet50_fpn
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))


def main() -> None:
    from memfit import estimate
    from memfit.estimate import trace as trace_module
    from memfit.estimate.gpus import gpu_spec

    out = {}
    for spec in sys.argv[2:]:
        module, name = spec.split(":")
        workload = getattr(importlib.import_module(module), name)
        started = time.process_time()
        forward = trace_module._real_forward(workload, gpu_spec("h100"))
        forward_s = time.process_time() - started
        sizes = [(r.name, [None if o is None else list(o.shape) for o in r.outputs]) for r in forward.returned]
        started = time.process_time()
        e = estimate(workload, gpu="h100")
        nms = [shapes[0][0] for op, shapes in sizes if op == "nms"]
        out[name] = {"real_forward_cpu_s": round(forward_s, 2), "estimate_cpu_s": round(time.process_time() - started, 2),
                     "nms_kept_in_all": sum(nms), "peak_allocated": e.peak_allocated_bytes, "fits_in": e.fits_in_bytes,
                     "sizes": sizes}
        print(name, {k: v for k, v in out[name].items() if k != "sizes"}, flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
