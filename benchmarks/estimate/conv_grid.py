"""What cuDNN convolutions take, forward and each backward call, on grids the calibration had left out: beyond 2^31 - 1
elements (32-bit indexing; sets "first" and "second"), against the same convolutions just below that limit, strided
1x1 convolutions (a ResNet's downsampling shortcut; set "strided"), which the second set found taking the input in
fp32 below the limit too, 3x3 convolutions over 8-32² images at batch 64-1024 (set "small_wgrad"), fp16 NCHW 3x3
convolutions of a U-Net over 128-2048² at batch 2-4 (set "half_large"), and half-precision 1x1 convolutions over odd
and even image sides of 9-65 (set "pointwise_odd").

Session 33's probe (conv_int32_probe.py) found an fp32 1x1 convolution over 8 x 256 x 1024² (2^31 input elements)
taking input + output channels-last, and the input NCHW, in forward, where nothing was taken up to 7 images. This
grid asks which tensor's size starts it (the input, the output or the gradient), whether backward takes it, what the
precision and the kernel change, and what a single sample beyond the limit (which PyTorch cannot split by batch)
does. Every call is alone on an empty allocator; a call that runs out of memory is recorded as such.

    python benchmarks/estimate/conv_grid.py --cases first --out $OUT   # on a GPU: $OUT/conv_grid_first.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

INT_MAX = 2**31 - 1
MiB = 1 << 20

# (name, dims, cin, cout, kernel, spatial side, batches, stride): each batch list straddles 2^31 elements of the
# tensor the name says (the input, or the output where cout > cin). "first": session 34's first call; "second": what
# the first left open about 1x1 convolutions (strided, odd channel counts, one sample, 3-D, 1-D) and a 3x3 beside it
CASES = {
    "first": [
        ("1x1 input", 2, 256, 64, 1, 1024, (7, 8), 1),
        ("1x1 output", 2, 64, 256, 1, 1024, (7, 8), 1),
        ("3x3 both", 2, 64, 64, 3, 1024, (31, 32), 1),
        ("3x3x3 both", 3, 32, 32, 3, 256, (3, 4), 1),
        ("3x3x3 one sample", 3, 16, 16, 3, 512, (1,), 1),
    ],
    "second": [
        ("1x1 stride 2", 2, 256, 512, 1, 1024, (7, 8), 2),
        ("1x1 odd channels", 2, 96, 40, 1, 1024, (21, 22), 1),
        ("1x1 one sample", 2, 2048, 64, 1, 1024, (1,), 1),
        ("1x1x1", 3, 256, 64, 1, 128, (3, 4), 1),
        ("1-D 1x1", 1, 512, 256, 1, 2**20, (3, 4), 1),
        ("3x3 input", 2, 256, 64, 3, 1024, (7, 8), 1),
    ],
    "strided": [  # ResNet shortcuts (stage 2-4 of ResNet-18/50 at 224², and at 512-1024² under a segmentation head)
        ("1x1 s2 64-128", 2, 64, 128, 1, 56, (8, 32, 128), 2),
        ("1x1 s2 256-512", 2, 256, 512, 1, 56, (8, 32, 64), 2),
        ("1x1 s2 512-1024", 2, 512, 1024, 1, 28, (8, 32, 64), 2),
        ("1x1 s2 1024-2048", 2, 1024, 2048, 1, 14, (8, 64), 2),
        ("1x1 s2 256-512 128", 2, 256, 512, 1, 128, (2, 8), 2),
        ("1x1 s2 256-512 256", 2, 256, 512, 1, 256, (2, 8), 2),
        ("1x1 s2 64-256 512", 2, 64, 256, 1, 512, (1, 4), 2),
        ("1x1 s2 256-512 1024", 2, 256, 512, 1, 1024, (1, 4), 2),
        ("1x1x1 s2 64-128", 3, 64, 128, 1, 32, (2, 8), 2),
        ("1x1x1 s2 128-256", 3, 128, 256, 1, 16, (2, 8), 2),
    ],
    "small_wgrad": [  # 3x3 convolutions over small images at large batches (a CIFAR ResNet at batch 512: the
        # seventh draw's ResNet-56 took 152-560 MiB filter-gradient workspaces on an H200 where 2 x input was charged)
        (f"3x3 {c} at {side}", 2, c, c, 3, side, (64, 128, 256, 512, 1024), 1)
        for side in (8, 16, 32) for c in (16, 32, 64, 128)
    ],
    "half_large": [  # fp16 NCHW 3x3 convolutions of smp's U-Net(ResNet-34) over 2048² tiles (decoder: concatenated
        # skip to its width, then width to width; encoder stages), the sizes the ninth draw's U-Net and U-Net++ took
        # workspaces at that no rule charges (holdout9_misses_h200_torch2.11_20261129_s35.md)
        ("3x3 768-256", 2, 768, 256, 3, 128, (2, 4), 1),
        ("3x3 256-256", 2, 256, 256, 3, 128, (2, 4), 1),
        ("3x3 384-128", 2, 384, 128, 3, 256, (2, 4), 1),
        ("3x3 128-128", 2, 128, 128, 3, 256, (2, 4), 1),
        ("3x3 192-64", 2, 192, 64, 3, 512, (2, 4), 1),
        ("3x3 64-64", 2, 64, 64, 3, 512, (2, 4), 1),
        ("3x3 64-64 768", 2, 64, 64, 3, 768, (2, 4), 1),
        ("3x3 128-32", 2, 128, 32, 3, 1024, (2, 4), 1),
        ("3x3 32-32", 2, 32, 32, 3, 1024, (2, 4), 1),
        ("3x3 32-16", 2, 32, 16, 3, 2048, (2, 4), 1),
        ("3x3 16-16", 2, 16, 16, 3, 2048, (2, 4), 1),
    ],
    "pointwise_odd": [  # half-precision 1x1 stride-1 convolutions over odd and even image sides: the third draw's
        # DeepLabV3-MobileNetV3 took input + output in forward at 33 x 33, batch 16, where the rule charges none
        # (upsample_rule_h200_torch2.11_20261130_s36.md); the 2026-11-26 grid had such blocks mostly at 7 x 7
        (f"1x1 {cin}-{cout} at {side}", 2, cin, cout, 1, side, (2, 8, 16, 32), 1)
        for side in (9, 16, 17, 32, 33, 64, 65)
        for cin, cout in ((80, 184), (480, 112), (672, 160), (960, 160), (960, 256), (1280, 256), (256, 64),
                          (64, 256), (2048, 512), (512, 2048), (256, 256))
    ],
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SETS = {"pointwise_odd": (("fp16", "bf16"), ("nchw",))}
"""Sets from session 36 on: the precisions and layouts each runs (the older sets' skips are in ``main``)."""


def _took(run) -> tuple[float, int]:
    """Bytes a call took above what it returns (MiB), and what it returns (bytes)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
    returned = sum(t.untyped_storage().nbytes() for t in outs)
    took = torch.cuda.max_memory_allocated() - before - returned
    del out, outs
    return round(took / MiB, 1), returned


def _row(name: str, dims: int, cin: int, cout: int, k: int, side: int, n: int, stride: int, dtype: str,
         layout: str) -> dict:
    fmt = {(2, "channels_last"): torch.channels_last, (3, "channels_last"): torch.channels_last_3d}.get(
        (dims, layout), torch.contiguous_format)
    shape = (n, cin) + (side,) * dims
    t = dict(x=torch.randn(shape, device="cuda", dtype=DTYPES[dtype]).contiguous(memory_format=fmt),
             w=torch.randn((cout, cin) + (k,) * dims, device="cuda", dtype=DTYPES[dtype]).contiguous(memory_format=fmt))
    geometry = ([stride] * dims, [k // 2] * dims, [1] * dims, False, [0] * dims, 1)  # stride, padding, dilation, ...
    row = dict(case=name, dims=dims, cin=cin, cout=cout, kernel=k, stride=stride, side=side, batch=n, dtype=dtype,
               layout=layout,
               input_elements=t["x"].numel())
    try:
        row["forward_MiB"], _ = _took(partial(torch.ops.aten.convolution, t["x"], t["w"], None, *geometry))
        t["g"] = torch.randn_like(torch.ops.aten.convolution(t["x"], t["w"], None, *geometry))
        row["output_elements"] = t["g"].numel()
        for call, mask in (("dgrad", [True, False, False]), ("wgrad", [False, True, False]),
                           ("both", [True, True, False])):
            row[f"{call}_MiB"], _ = _took(partial(torch.ops.aten.convolution_backward, t["g"], t["x"], t["w"], None,
                                                  *geometry, mask))
    except torch.OutOfMemoryError as error:
        row["oom"] = str(error).splitlines()[0][:200]
    t.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--cases", choices=sorted(CASES), default="first")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False
    start = time.monotonic()
    rows = []
    meta = dict(card=torch.cuda.get_device_name(0), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                date=time.strftime("%Y-%m-%d"), benchmark=False, int_max=INT_MAX, cases=args.cases)
    dtypes, layouts = SETS.get(args.cases, (("fp32", "bf16", "fp16"), ("channels_last", "nchw")))
    for name, dims, cin, cout, k, side, batches, stride in CASES[args.cases]:
        for dtype in dtypes:
            if (args.cases not in SETS and dtype == "fp16" and args.cases != "half_large"
                    and name not in ("1x1 input", "3x3 both")):
                continue
            if dtype == "bf16" and args.cases == "strided" and dims == 3:
                continue
            if args.cases == "small_wgrad" and dtype == "fp16":
                continue
            if args.cases == "half_large" and dtype != "fp16":
                continue
            for layout in layouts if dims > 1 else ("nchw",):
                if args.cases in ("strided", "small_wgrad") and dtype != "fp32" and layout == "channels_last":
                    continue
                if args.cases == "small_wgrad" and layout == "channels_last" and side != 16:
                    continue
                if args.cases == "half_large" and layout == "channels_last":
                    continue
                for n in batches:
                    if time.monotonic() - start > args.budget_s:
                        break
                    t0 = time.monotonic()
                    row = _row(name, dims, cin, cout, k, side, n, stride, dtype, layout)
                    row["seconds"] = round(time.monotonic() - t0, 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    (args.out / f"conv_grid_{args.cases}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
