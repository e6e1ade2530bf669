"""The channels-last rule against the 72-call H200 grid at 512 and 1024 per axis (beyond the calibrated 384), on the
CPU: what each call took beside what the trace charges (``conv_workspace_bytes``) and the most its bound allows
(``channels_last_unsure_bytes`` added; the bound's 10 % ``conv_workspace_extrapolated`` widening of the whole step
not counted). Rows where the two part by more than 19 MiB, or the call took more than the bound's block.

    PYTHONPATH=src python benchmarks/estimate/channels_last_large_check.py > \\
        benchmarks/results/estimate/cudnn_calibration_conv_channels_last_large_h200_torch2.11_20261129.md
"""

from __future__ import annotations

import json
from pathlib import Path

from memfit.estimate.workspaces import channels_last_unsure_bytes, conv_workspace_bytes

MiB = 1 << 20
GRID = "cudnn_calibration_conv_channels_last_large_h200_torch2.11_20261129.json"


def main() -> None:
    rows = json.loads((Path(__file__).resolve().parents[1] / "results" / "estimate" / GRID).read_text())["rows"]
    print(f"# Channels-last convolutions at 512 and 1024 per axis against the rule (H200, {len(rows)} calls)\n")
    print(f"Grid: `{GRID}` (`calibrate_cudnn.py --only conv_channels_last_large`). Rule: session 33's code. MiB.\n")
    print("| dtype | cin → cout | k, stride | batch × side | call | took | charged | bound's block | input |")
    print("|---|---|---|---|---|---|---|---|---|")
    above = 0
    for r in rows:
        n, item = r["n"], 4 if r["dtype"] == "fp32" else 2
        side = round((r["out_bytes"] // item / (n * r["cout"])) ** 0.5)
        shapes = ((n, r["cin"], r["size"], r["size"]), (r["cout"], r["cin"], r["k"], r["k"]), (n, r["cout"], side, side))
        for took, backward in ((r["fwd_ws"], False), (max(r["dgrad_ws"], r["wgrad_ws"], r["bwd_ws"]), True)):
            rule = conv_workspace_bytes(*shapes, itemsize=item, stride=(r["stride"],) * 2, groups=1, transposed=False,
                                        half=item == 2, backward=backward, channels_last=True)
            largest = rule + channels_last_unsure_bytes(shapes[0], shapes[2], shapes[1][2:], itemsize=item,
                                                        half=item == 2, backward=backward)
            over = took > largest
            above += over
            if over or abs(took - rule) > 19 * MiB:
                print(f"| {r['dtype']} | {r['cin']} → {r['cout']} | {r['k']}, {r['stride']} | {n} × {r['size']}² | "
                      f"{'backward' if backward else 'forward'} | {took / MiB:.1f} | {rule / MiB:.1f} | "
                      f"{largest / MiB:.1f}{' (took more)' if over else ''} | {r['in_bytes'] / MiB:.0f} |")
    print(f"\n{above} of {2 * len(rows)} calls took more than the bound's block for the call.")


if __name__ == "__main__":
    main()
