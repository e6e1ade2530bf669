"""cuDNN's deterministic algorithms on calibrate_cudnn.py's grids against the trace's convolution rules, on the CPU:
for each shape of the eight grids run with the setting (sessions 38 and 39), what it took with and without it (the
same call's run for session 39's four, earlier days' for session 38's), and what the trace charges (``kernel_scratch.conv_workspace`` for the forward; its
larger with ``narrow_dgrad_workspace`` for the backward, one block for the two calls, as the recorder charges it).
The rows where the setting moved a workspace by more than 1 MiB, then how many of those the trace charges more than
1 MiB below.

    PYTHONPATH=src python benchmarks/estimate/deterministic_grid_check.py > \\
        benchmarks/results/estimate/deterministic_grid_check_h200_torch2.11_20261130_s39.md
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memfit.estimate.kernel_scratch import conv_workspace, narrow_dgrad_workspace
from memfit.estimate.trace_record import Trace

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "results" / "estimate"
FAMILIES = {"conv_narrow": "conv_narrow_h200_torch2.11_20261130", "conv_head_half": "conv_head_half_h200_torch2.11_20261130",
            "conv_large": "conv_large_h200_torch2.11_20261130",
            "conv_pointwise_half": "conv_pointwise_half_h200_torch2.11_20261130",
            "conv": "h200_torch2.11_20261126", "conv_3d_half": "conv_3d_half_h200_torch2.11_20261127",
            "conv_channels_last": "conv_channels_last_h200_torch2.11_20261129",
            "conv_fp32_channels": "conv_fp32_channels_h200_torch2.11_20261129"}
"""Family -> the grid run without the setting it is set beside: the same call's for session 39's four, earlier days'
for session 38's (``cudnn_calibration_<this>.json``)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def charged(r: dict) -> tuple[int, int]:
    """What the trace charges the forward and the backward of the grid's call ``r``."""
    dims, k, stride, transposed, groups = r["dims"], r["k"], r["stride"], r["transposed"], r["groups"]
    pad = 0 if (transposed or k == 1 or k == stride) else k // 2  # calibrate_cudnn.py's _conv_case
    side = (r["size"] - 1) * stride + k if transposed else (r["size"] + 2 * pad - k) // stride + 1
    weight = (r["cin"], r["cout"] // groups) if transposed else (r["cout"], r["cin"] // groups)
    layout = r.get("channels_last")  # "both" (input and weight) or "input", as calibrate_cudnn.py laid them out
    formats = [torch.channels_last if layout else torch.contiguous_format,
               torch.channels_last if layout == "both" else torch.contiguous_format,
               torch.channels_last if layout else torch.contiguous_format]
    shapes = ((r["n"], r["cin"]) + (r["size"],) * dims, weight + (k,) * dims, (r["n"], r["cout"]) + (side,) * dims)
    x, w, y = (torch.empty(shape, dtype=DTYPES[r["dtype"]], device="meta").contiguous(memory_format=fmt)
               for shape, fmt in zip(shapes, formats, strict=True))
    forward = conv_workspace(Trace(), "grid", x, w, y, (stride,) * dims, transposed, groups)
    backward = max(conv_workspace(Trace(), "grid", x, w, y, (stride,) * dims, transposed, groups, backward=True),
                   narrow_dgrad_workspace(Trace(), "grid", x, w, (stride,) * dims, (1,) * dims, transposed, groups))
    return forward, backward


def main() -> None:
    print("# cuDNN's deterministic algorithms against the trace's convolution rules (H200 grids, 2026-11-30)\n")
    print(__doc__.split("\n\n")[0].replace("\n", " ") + "\n")
    print("| family | shape (n, cin -> cout, kernel, size, dtype) | forward default / deterministic / charged (MiB) "
          "| backward default / deterministic / charged (MiB) |")
    print("|---|---|---|---|")
    total = moved = under = worst = 0
    for family, without in FAMILIES.items():
        det = json.loads((RESULTS / f"cudnn_calibration_{family}_deterministic_h200_torch2.11_20261130.json")
                         .read_text())["rows"]
        default = json.loads((RESULTS / f"cudnn_calibration_{without}.json").read_text())["rows"]
        default = [r for r in default if r["kind"] == "conv"] if family == "conv" else default
        for a, b in zip(default, det, strict=True):
            if a["kind"] != "conv":
                continue
            assert all(a[f] == b[f] for f in ("dims", "n", "cin", "cout", "k", "stride", "size", "dtype")), (a, b)
            total += 1
            fwd, bwd = charged(b)
            shifts = [(b.get(f) or 0) - (a.get(f) or 0) for f in ("fwd_ws", "bwd_ws")]
            if max(abs(s) for s in shifts) <= MiB:
                continue
            moved += 1
            short = max((b.get("fwd_ws") or 0) - fwd, (b.get("bwd_ws") or 0) - bwd)
            worst = max(worst, short)
            low = short > MiB
            under += low
            kind = f"{b['k']}" + (" transposed" if b["transposed"] else "") + (
                f" stride {b['stride']}" if b["stride"] > 1 else "")
            print(f"| {family} | {b['n']}, {b['cin']} -> {b['cout']}, {kind}, {b['size']}^{b['dims']}, {b['dtype']} "
                  f"| {(a.get('fwd_ws') or 0) / MiB:.1f} / {(b.get('fwd_ws') or 0) / MiB:.1f} / {fwd / MiB:.1f} "
                  f"| {(a.get('bwd_ws') or 0) / MiB:.1f} / {(b.get('bwd_ws') or 0) / MiB:.1f} / {bwd / MiB:.1f}"
                  f"{' (under)' if low else ''} |")
    print(f"\n{total} convolutions; the setting moved {moved} by more than 1 MiB; the trace charges {under} of those "
          f"more than 1 MiB below what they took under it (the most: {worst / MiB:.2f} MiB).")


if __name__ == "__main__":
    main()
