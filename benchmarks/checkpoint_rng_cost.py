"""Why checkpointing a ResNet costs more than its recompute: time one micro-batch of ResNet-50 (fp32, batch 16)
with all 16 bottlenecks checkpointed, with and without preserving the RNG state (which reads and restores the
CUDA generator for every checkpointed block), against no checkpointing.

    python benchmarks/checkpoint_rng_cost.py    # GPU; prints JSON: median ms per mode, the card and torch

Committed results go to ``benchmarks/results/speed/checkpoint_rng_cost_<card>_torch<X.Y>_<yyyymmdd>.json``.
"""

from __future__ import annotations

import functools
import json
import statistics

import torch
from torch.utils.checkpoint import checkpoint

from memfit.workload.knobs import checkpoint_candidates
from memfit.workload.models import ResNet


def run(mode: str, batch: int = 16, repeats: int = 10) -> float:
    model = ResNet().cuda()
    if mode != "none":
        for name in checkpoint_candidates(model):
            m = model.get_submodule(name)
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False,
                                          preserve_rng_state=mode == "ckpt-rng")
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


if __name__ == "__main__":
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      **{mode: run(mode) for mode in ("none", "ckpt-rng", "ckpt-no-rng")}}))
