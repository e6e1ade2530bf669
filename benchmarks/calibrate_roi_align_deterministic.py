"""Measure what torchvision's ``roi_align`` allocates on CUDA under deterministic algorithms, where it runs its
Python implementation through ``torch.compile`` (torchvision/ops/roi_align.py: ``_roi_align`` under
``lazy_compile(dynamic=True)``) instead of its kernel: what the call keeps for its backward, and what its forward
and backward take beyond that for the call's length. Over a grid of RoI counts, channels, pooled sizes, sampling
ratios, feature-map sizes and input dtypes (the one op alone: no detection step is in it). Data for a rule, not a
rule.

Session 38 saw, at the peak of two detection steps, the compiled forward's blocks held for the backward: int64 and
fp32 blocks the size of the gathered ``(K, C, PH, PW, IY, IX)`` samples
(``results/estimate/peak_blocks_rcnn_deterministic_h200_torch2.11_20261130_s38.json``). This grid sizes them.

    python benchmarks/calibrate_roi_align_deterministic.py --out $OUT [--budget-s 300]   # on a CUDA machine

Writes ``roi_align_deterministic_<card>_torch<X.Y>_<yyyymmdd>.json`` into ``--out``, one row per case (written after
each, so a call that runs out of time keeps what it measured): ``samples`` is K·C·PH·PW·s² (s the sampling ratio),
``saved_bytes`` what is allocated after the forward beyond the inputs and the output, ``forward_extra_bytes`` the
forward's peak above that, ``backward_extra_bytes`` the backward's peak above what was allocated before it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import RESULTS, card, stem  # noqa: E402

SEED = 20261139
MAX_SAMPLES = 200_000_000
"""Cases with more gathered samples are left out: at ~64 B a sample (session 38's blocks) they would take over 12 GB
beside the GPU tests."""


def _samples(case: dict) -> int:
    return case["rois"] * case["channels"] * case["pooled"] ** 2 * case["sampling"] ** 2


def _grid() -> list[dict]:
    """A seeded sample of the cases, the zoo's detection heads (7 x 7 and 14 x 14 bins, sampling ratio 2,
    256 channels) always in it."""
    cases = [dict(rois=rois, channels=c, pooled=p, sampling=s, size=size, dtype=dtype, autocast=autocast)
             for rois in (64, 256, 1024, 2048) for c in (64, 256) for p in (7, 14) for s in (1, 2, 3)
             for size in (25, 100, 200) for dtype, autocast in (("float32", False), ("float16", False),
                                                                ("float16", True))]
    heads = [c for c in cases if c["channels"] == 256 and c["sampling"] == 2 and c["dtype"] == "float32"
             and c["size"] == 100 and c["rois"] in (256, 2048)]
    rest = [c for c in cases if c not in heads and _samples(c) <= MAX_SAMPLES]
    return heads + random.Random(SEED).sample(rest, 40)


def _measure(case: dict) -> dict:
    from torchvision.ops import roi_align

    dtype = getattr(torch, case["dtype"])
    k, c, p, s, size = case["rois"], case["channels"], case["pooled"], case["sampling"], case["size"]
    gen = torch.Generator().manual_seed(k + c + size)
    x = torch.randn(2, c, size, size, generator=gen).to("cuda", dtype).requires_grad_()
    corner = torch.rand(k, 2, generator=gen) * (size * 0.7)
    extent = 1 + torch.rand(k, 2, generator=gen) * (size * 0.3)
    rois = torch.cat([torch.randint(0, 2, (k, 1), generator=gen).float(), corner, corner + extent], 1).cuda()

    def run() -> tuple[int, int, int, int]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", enabled=case["autocast"]):
            out = roi_align(x, rois, (p, p), spatial_scale=1.0, sampling_ratio=s, aligned=False)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        forward_peak = torch.cuda.max_memory_allocated()
        grad = torch.ones_like(out)
        torch.cuda.synchronize()
        before_backward = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad)
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated()
        out_bytes = out.untyped_storage().nbytes()
        del out, grad
        x.grad = None
        return (after_forward - before - out_bytes, forward_peak - after_forward, backward_peak - before_backward,
                out_bytes)

    run()  # compiles (or recompiles for a new specialisation)
    saved, forward_extra, backward_extra, out_bytes = run()
    return dict(case, samples=_samples(case), input_bytes=x.nbytes, output_bytes=out_bytes,
                saved_bytes=saved, forward_extra_bytes=forward_extra, backward_extra_bytes=backward_extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "estimate"))
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    # every specialisation compiled, none left to eager (dynamo's default stops recompiling after 8)
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 1024)
    props = torch.cuda.get_device_properties(0)
    path = Path(args.out) / f"{stem('roi_align_deterministic', card(props.name), torch.__version__)}.json"
    result = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": dt.date.today().isoformat(), "rows": []}
    start = time.monotonic()
    for case in _grid():
        if time.monotonic() - start > args.budget_s:
            break
        try:
            row = _measure(case)
        except torch.OutOfMemoryError as e:
            row = dict(case, error=str(e).splitlines()[0])
        torch.cuda.empty_cache()
        result["rows"].append(row)
        path.write_text(json.dumps(result, indent=0))
        if "samples" in row:
            print(case, f"saved {row['saved_bytes'] / row['samples']:.2f} B/sample, forward +"
                  f"{row['forward_extra_bytes'] / row['samples']:.2f}, backward +"
                  f"{row['backward_extra_bytes'] / row['samples']:.2f}", flush=True)
    print(f"{len(result['rows'])} rows -> {path}")


if __name__ == "__main__":
    main()
