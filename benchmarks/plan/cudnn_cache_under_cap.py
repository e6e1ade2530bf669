"""Does a capped run slow later runs of the same convolutions in its process? (the 3-D U-Net's micro-batch 2)

The plan sweep of 2026-11-26 (``results/plan/plan_sweep_h100_torch2.11_20261126/``) timed the 3-D U-Net at
micro-batch 2 at 70-86 ms in its first configurations and 250 ms from the first configuration whose "does it run
under the cap" check ran capped in the same process. The suspect: where a workspace does not fit, PyTorch's cuDNN
code falls back to an algorithm with less workspace and caches the choice per convolution for the process.

One process, in order: time configuration A (2 x 1, 2 blocks checkpointed, the default Adam: the sweep's first slow row)
fresh; run A's protocol under the 5.25 GiB budget's cap; time A again; time B (2 x 1, no checkpointing: the same
convolutions) after it. Then B alone in a fresh process. Timings are medians of 5 micro-batches.

    python benchmarks/plan/cudnn_cache_under_cap.py --out $OUT        # GPU; writes cudnn_cache_under_cap_<card>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from plan_quality import _clean, memory_config, time_config  # noqa: E402

CAP = 4_966_055_936  # the sweep's cap at 5.25 GiB: 5.25 GiB - the 640 MiB of CUDA context its plan assumed
A = {"batch_size": 2, "accumulation_steps": 1, "checkpoint": ["encoder.0", "decoder.4"],
     "optimizer_impl": "default", "channels_last": False}
B = {"batch_size": 2, "accumulation_steps": 1, "checkpoint": [], "optimizer_impl": "fused", "channels_last": False}


def _workload():  # noqa: ANN202
    from memfit.workload.zoo import builtin_workload

    return builtin_workload("unet3d").replace(keep_output=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--alone", action="store_true", help="(internal) time B in this fresh process and print it")
    args = parser.parse_args()
    import torch

    w = _workload()
    names = {name for name, _ in w.model().named_modules()}
    missing = [b for b in A["checkpoint"] if b not in names]
    if missing:
        raise SystemExit(f"unet3d has no module {missing}: pick blocks from {sorted(names)[:20]}")
    if args.alone:
        print(json.dumps(time_config(w, B, repeats=5)))
        return
    rows = {}
    rows["A fresh"] = time_config(w, A, repeats=5)
    _clean()
    capped = memory_config(w, A, CAP)
    rows["A capped run"] = {"ok": capped["ok"], "peak_reserved_bytes": capped["peak_reserved_bytes"]}
    _clean()
    rows["A after the capped run"] = time_config(w, A, repeats=5)
    _clean()
    rows["B after the capped run"] = time_config(w, B, repeats=5)
    alone = subprocess.run([sys.executable, __file__, "--alone"], capture_output=True, text=True, check=False)
    rows["B alone, fresh process"] = json.loads(alone.stdout.strip().splitlines()[-1]) if alone.returncode == 0 \
        else {"error": alone.stderr[-500:]}
    card = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().split()[0]
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cap_bytes": CAP, "A": A, "B": B,
              "rows": rows}
    (Path(args.out) / f"cudnn_cache_under_cap_{card}.json").write_text(json.dumps(result, indent=1))
    for k, v in rows.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
