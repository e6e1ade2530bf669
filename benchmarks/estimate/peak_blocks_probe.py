"""What is alive at a zoo step's peak on the GPU: one uncapped trial with the allocator's history recorded
(``memfit.estimate.measure.run_trial``, a memory snapshot), replayed to its peak, and the largest live blocks there
with the Python frames that allocated them. For a step the estimate misses and no rule explains.

    python benchmarks/estimate/peak_blocks_probe.py NAME[,NAME] > $OUT/peak_blocks.json   # on a CUDA machine
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))

from registry import entries  # noqa: E402

from memfit.estimate.measure import run_trial  # noqa: E402

TOP = 25


def _where(frames: list[dict]) -> list[str]:
    """The first frames outside torch's autograd and memfit: who asked for the block."""
    kept = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
            if "torch/autograd" not in f["filename"] and "memfit/" not in f["filename"]]
    return kept[:4]


def peak_blocks(snapshot: dict) -> dict:
    """Replay the device trace: the peak's allocated bytes and its largest live blocks."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed":
            gone = live.pop(event["addr"], None)
            if gone is not None:
                total -= gone["size"]
    at_peak.sort(key=lambda e: -e["size"])
    return {"peak_traced_bytes": peak, "blocks_at_peak": len(at_peak),
            "top": [{"bytes": e["size"], "where": _where(e.get("frames", []))} for e in at_peak[:TOP]]}


def main() -> None:
    found = {}
    for entry in entries(sys.argv[1].split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "snapshot.pickle")
            trial = run_trial(entry.spec, snapshot=path, timeout_s=300)
            if not trial.ok:
                found[entry.name] = {"error": trial.error}
                continue
            with open(path, "rb") as f:
                found[entry.name] = {"peak_allocated_bytes": trial.peak_allocated_bytes,
                                     **peak_blocks(pickle.load(f))}
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
