"""Run one zoo entry's protocol several times under each of a few memory caps: whether a cap runs can depend on the
addresses cudaMalloc returns (best-fit ties between equal free blocks), so one bisection is one draw.

    python benchmarks/estimate/cap_repeats.py monai_swin_unetr_issue13 --caps 10995116277,11344208646 --repeats 3 \
        --out $OUT/cap_repeats.json        # GPU machine

Each trial is a fresh process (``memfit.estimate.measure.run_trial``); ``--jobs`` of them side by side (each caps only
its own allocator). Writes the outcome of every trial and, per cap, how many ran.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("entry")
    parser.add_argument("--caps", required=True, help="comma-separated caps in bytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch

    from memfit.estimate.measure import run_trial

    sys.path.insert(0, str(HERE.parent / "zoo"))
    from registry import entries

    spec = entries([args.entry])[0].spec
    caps = [int(c) for c in args.caps.split(",")]
    runs = [cap for _ in range(args.repeats) for cap in caps]  # interleaved: each cap's trials spread in time
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        trials = list(pool.map(lambda cap: run_trial(spec, cap_bytes=cap), runs))
    summary = {str(cap): sum(t.ok for c, t in zip(runs, trials) if c == cap) for cap in caps}
    Path(args.out).write_text(json.dumps({
        "entry": args.entry, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "ran_of_repeats": summary, "repeats": args.repeats,
        "trials": [{"cap_bytes": c, "ok": t.ok, "peak_reserved_bytes": t.peak_reserved_bytes,
                    "num_alloc_retries": t.num_alloc_retries, "error": t.error[:160]} for c, t in zip(runs, trials)],
    }, indent=1) + "\n")
    print(args.entry, summary)


if __name__ == "__main__":
    main()
