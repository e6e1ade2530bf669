"""One bilinear (2-D) or trilinear (3-D) upsampling step measured on CUDA phase by phase, with and without
deterministic algorithms: what is alive after the forward, the forward's peak and the backward's, above the model
and batch. The GPU test ``test_deterministic_upsampling_costs_on_cuda_what_the_estimate_adds`` compares the
setting's cost with the estimate's; this says where they part.

    python benchmarks/estimate/upsampling_probe.py > $OUT/upsampling_probe.json     # on a CUDA machine
"""

from __future__ import annotations

import json

import torch

SHAPES = {2: (4, 3, 96, 96), 3: (1, 3, 24, 24, 24)}


def probe(dims: int, deterministic: bool, scale: int = 4, channels: int = 5) -> dict[str, int]:
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.manual_seed(0)
    conv = (torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d)(3, channels, 3, padding=1).cuda()
    x = torch.randn(SHAPES[dims], device="cuda")
    mode = "bilinear" if dims == 2 else "trilinear"
    found: dict[str, int] = {}
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = torch.nn.functional.interpolate(conv(x), scale_factor=scale, mode=mode, align_corners=False)
        torch.cuda.synchronize()
        found["after_upsample"] = torch.cuda.memory_allocated() - base
        found["upsample_peak"] = torch.cuda.max_memory_allocated() - base
        loss = y.square().mean()
        torch.cuda.synchronize()
        found["after_forward"] = torch.cuda.memory_allocated() - base
        found["forward_peak"] = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        found["backward_peak"] = torch.cuda.max_memory_allocated() - base
        found["output_bytes"] = y.nbytes
        del y, loss
        conv.zero_grad(set_to_none=True)
    return found


if __name__ == "__main__":
    rows = [dict(dims=d, deterministic=det, **probe(d, det)) for d in (2, 3) for det in (False, True)]
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, indent=1))
