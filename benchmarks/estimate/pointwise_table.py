"""Write ``src/memfit/estimate/pointwise_wgrad.py``: which workspace cuDNN's filter gradient took for each measured
2-D stride-1 1x1 half-precision convolution below 28 x 28 pixels (the H100 and H200 grids agree call for call where
they overlap: 44 of 44 shapes within 0.7 MiB).

    python benchmarks/estimate/pointwise_table.py          # any machine; rewrites the module from the grids
    python benchmarks/estimate/pointwise_table.py --check  # the bound with each call's batch, then its width at its
                                                           # side, then its width at every side left out of the table

Each call is classed as ``P`` (the fp32 partial sums, batch x Cin x Cout x 4 bytes, within 2 % or 1 MiB), ``I``
(the layout conversion, input + output, within 5 % or 1 MiB), ``X`` (a conversion block with more: up to
3 x input + output at small sizes) or ``0`` (under 64 KiB).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "estimate"
GRIDS = [
    "cudnn_calibration_conv_pointwise_small_half_h100_torch2.11_20261127.json",
    "cudnn_calibration_conv_pointwise_half_h200_torch2.11_20261126.json",
    "cudnn_calibration_conv_odd_channels_half_h200_torch2.11_20261127.json",
]
TARGET = ROOT / "src" / "memfit" / "estimate" / "pointwise_wgrad.py"
MIN_PIXELS = 28 * 28
TOLERANCE = 1 << 20  # a call within this of the bound counts as covered: the bound's 5 % base margin covers it  # workspaces.POINTWISE_MIN_PIXELS: from here on the partial sums are the rule


def classify(row: dict) -> str:
    partial = row["n"] * row["cin"] * row["cout"] * 4
    io = row["in_bytes"] + row["out_bytes"]
    taken = row["wgrad_ws"]
    if taken < 1 << 16:
        return "0"
    if abs(taken - partial) <= max(0.02 * partial, 1 << 20):
        return "P"
    if abs(taken - io) <= max(0.05 * io, 1 << 20):
        return "I"
    return "X"


def _rows() -> list[dict]:
    return [r for name in GRIDS for r in json.loads((RESULTS / name).read_text())["rows"]
            if r.get("kind") == "conv" and r["dims"] == 2 and r["k"] == 1 and r["stride"] == 1 and r["groups"] == 1
            and not r["transposed"] and r["dtype"] in ("fp16", "bf16") and "wgrad_ws" in r
            and 1 < r["size"] ** 2 < MIN_PIXELS]


def check() -> None:
    """Each call's estimate and bound with its batch, then its whole width, left out of the table."""
    sys.path.insert(0, str(ROOT / "src"))
    from memfit.estimate import pointwise_wgrad
    from memfit.estimate.workspaces import conv_workspace_bytes, conv_workspace_unsure_bytes

    full = dict(pointwise_wgrad.CHOICES)
    rows = _rows()
    result: dict = {"grids": GRIDS, "calls": len(rows), "tolerance_bytes": TOLERANCE}
    for mode in ("batch", "width", "width_every_side"):
        missed = []
        for r in rows:
            key = (r["cin"], r["cout"], r["size"])
            table = dict(full)
            kept = {b: c for b, c in full[key].items() if b != r["n"]} if mode == "batch" else {}
            if kept:
                table[key] = kept
            elif mode == "width_every_side":
                table = {k: v for k, v in full.items() if k[:2] != key[:2]}
            else:
                del table[key]
            pointwise_wgrad.CHOICES = table
            n, side = r["n"], r["size"]
            shapes = ((n, r["cin"], side, side), (r["cout"], r["cin"], 1, 1), (n, r["cout"], side, side))
            call = dict(itemsize=2, stride=(1, 1), groups=1, transposed=False, half=True, backward=True,
                        fp16=r["dtype"] == "fp16")
            bound = conv_workspace_bytes(*shapes, **call) + conv_workspace_unsure_bytes(*shapes, **call)
            if r["wgrad_ws"] > bound + TOLERANCE:
                missed.append({"cin": r["cin"], "cout": r["cout"], "size": side, "n": n, "dtype": r["dtype"],
                               "under_bytes": r["wgrad_ws"] - bound})
        pointwise_wgrad.CHOICES = full
        result[f"{mode}_left_out"] = {"missed": len(missed), "max_under_bytes": max(
            (m["under_bytes"] for m in missed), default=0), "calls_missed": missed}
        print(f"{mode} left out: the bound more than 1 MiB under what was taken on {len(missed)} of {len(rows)} calls")
    out = RESULTS / "cudnn_pointwise_wgrad_leave_out_torch2.11_20261127.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"-> {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="the leave-out test instead of writing the module")
    if parser.parse_args().check:
        check()
        return
    table: dict[tuple[int, int, int], dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for r in _rows():
        table[(r["cin"], r["cout"], r["size"])][r["n"]].setdefault(r["dtype"], classify(r))
    lines = [
        '"""Generated by benchmarks/estimate/pointwise_table.py from the committed cuDNN grids (do not edit by hand):',
        "which workspace cuDNN 9.19's filter gradient took for each measured 2-D stride-1 1x1 half-precision",
        "convolution below 28 x 28 pixels, on an H100 and an H200 (torch 2.11, benchmark=False).",
        "",
        "Key: (input channels, output channels, image side). Value: batch -> classes for fp16 then bf16 ('-' where not",
        "measured): P the fp32 partial sums (batch x Cin x Cout x 4 bytes), I the layout conversion (input + output),",
        'X a conversion block with more (up to 3 x input + output), 0 none. Sources:',
        *[f"benchmarks/results/estimate/{name}" for name in GRIDS],
        '"""',
        "",
        "CHOICES: dict[tuple[int, int, int], dict[int, str]] = {",
    ]
    for key in sorted(table):
        by_batch = ", ".join(f"{n}: \"{d.get('fp16', '-')}{d.get('bf16', '-')}\"" for n, d in sorted(table[key].items()))
        lines.append(f"    {key}: {{{by_batch}}},")
    lines.append("}")
    TARGET.write_text("\n".join(lines) + "\n")
    print(f"{len(table)} shapes -> {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
