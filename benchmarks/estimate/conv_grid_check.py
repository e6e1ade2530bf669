"""Session 34's convolution grids (``conv_grid.py``: beyond 2^31 - 1 elements, and strided 1x1) against the trace's
rule, on the CPU: what each call took beside what the trace charges (``kernel_scratch.conv_workspace``, on meta
tensors laid out as the GPU's were) and the bound's bytes for it. A backward's two calls are charged one block, the
larger of the two calls' measurements here. MiB.

    PYTHONPATH=src python benchmarks/estimate/conv_grid_check.py > \\
        benchmarks/results/estimate/conv_grid_h200_torch2.11_20261129_s34.md
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from memfit.estimate.kernel_scratch import conv_workspace
from memfit.estimate.trace_record import Trace
from memfit.estimate.workspaces import INT32_LIMIT

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "results" / "estimate"
GRIDS = {name: f"conv_grid_{name}_h200_torch2.11_20261129_s34.json" for name in ("first", "second", "strided")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def charges(r: dict) -> dict[bool, tuple[float, float, bool]]:
    """(charged, the bound's bytes for the call, widened by a fraction) in MiB for the forward and the backward."""
    dims, n, k, s = r["dims"], r["batch"], r["kernel"], r.get("stride", 1)
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}[dims] if r["layout"] == "channels_last" else (
        torch.contiguous_format)
    side = (r["side"] + 2 * (k // 2) - k) // s + 1
    x, w, y = (torch.empty(shape, dtype=DTYPES[r["dtype"]], device="meta").contiguous(memory_format=fmt)
               for shape in ((n, r["cin"]) + (r["side"],) * dims, (r["cout"], r["cin"]) + (k,) * dims,
                             (n, r["cout"]) + (side,) * dims))
    out = {}
    for backward in (False, True):
        trace = Trace()
        charged = conv_workspace(trace, "grid", x, w, y, (s,) * dims, False, 1, backward=backward)
        out[backward] = (charged / MiB, trace.uncertain_bytes.get("conv_workspace_erratic", 0) / MiB,
                         "conv_workspace_extrapolated" in trace.uncertain)
    return out


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print("# Convolutions beyond 2^31 - 1 elements, and strided 1x1 ones, against the rule (H200)\n")
    print(f"Grids: {', '.join(f'`{g}`' for g in GRIDS.values())} (`conv_grid.py --cases first|second|strided`; "
          f"torch 2.11, cuDNN 9.19, `benchmark=False`). Rule: commit {commit}. `beyond`: the input has more than "
          f"{INT32_LIMIT:,} elements. `bound`: the charge plus the bound's bytes for the call; `+10 %` where the "
          "trace widens the step's bound by a fraction for it. Calibration data: these grids set the rules they "
          "check.\n")
    print("| set | case | dtype | layout | batch | beyond | in | out | forward took | charged | bound | backward took | "
          "charged | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, grid in GRIDS.items():
        for r in json.loads((RESULTS / grid).read_text())["rows"]:
            item = 4 if r["dtype"] == "fp32" else 2
            c = charges(r)
            back = max(r["dgrad_MiB"], r["wgrad_MiB"])
            bound = {b: f"{c[b][0] + c[b][1]:.1f}{' +10 %' if c[b][2] else ''}" for b in (False, True)}
            print(f"| {name} | {r['case']} | {r['dtype']} | {r['layout']} | {r['batch']} | "
                  f"{'yes' if r['input_elements'] > INT32_LIMIT else ''} | {r['input_elements'] * item / MiB:.0f} | "
                  f"{r['output_elements'] * item / MiB:.0f} | {r['forward_MiB']:.1f} | {c[False][0]:.1f} | "
                  f"{bound[False]} | {back:.1f} | {c[True][0]:.1f} | {bound[True]} |")


if __name__ == "__main__":
    main()
