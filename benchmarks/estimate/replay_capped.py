"""Replay allocator streams recorded under a memory cap, with fake and with the recorded segment addresses.

A capped GPU run that memfit's replay of its own stream says cannot run shows where the replay departs from the
GPU. The streams come from ``python -m memfit.estimate.measure SPEC --cap-bytes N --trace FILE`` (H200); the file
name ends in ``_cap<bytes>.json.gz`` (or ``_cap<MB>.json.gz``, read as 10^6 bytes).

    python benchmarks/estimate/replay_capped.py benchmarks/results/estimate/capped_streams_h200_torch2.11_20261127/*.gz

Prints, per stream: the cap, whether the replay runs under it with memfit's fake segment addresses and with the
addresses cudaMalloc returned (which decide the best fit among free blocks of one size), and the peak reserved.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from memfit.estimate.allocator import CachingAllocator, SimulatedOOM  # noqa: E402


def replay_under_cap(events: list, cap: int, addresses: list[int] | None) -> tuple[bool, int]:
    """(ran, peak reserved) of the stream's alloc/free events under ``cap``."""
    allocator = CachingAllocator(capacity_bytes=cap, segment_addresses=addresses)
    live: dict[int, int] = {}
    for key, (action, addr, size, *_) in enumerate(events):
        if action == "alloc":
            live[addr] = key
            try:
                allocator.malloc(key, size)
            except SimulatedOOM:
                return False, allocator.peak_reserved_bytes
        elif action == "free_completed" and addr in live:
            allocator.free(live.pop(addr))
    return True, allocator.peak_reserved_bytes


def main() -> None:
    for path in map(Path, sys.argv[1:]):
        cap_text = re.search(r"_cap(\d+)\.json\.gz$", path.name).group(1)
        cap = int(cap_text) if len(cap_text) > 6 else int(cap_text) * 10**6
        events = json.loads(gzip.open(path, "rt").read())["events"]
        addresses = [e[1] for e in events if e[0] == "segment_alloc"]
        fake = replay_under_cap(events, cap, None)
        real = replay_under_cap(events, cap, addresses)
        print(f"{path.name}: cap {cap:,}; fake addresses: {'runs' if fake[0] else 'OOM'} (peak reserved "
              f"{fake[1]:,}); recorded addresses: {'runs' if real[0] else 'OOM'} (peak reserved {real[1]:,})")


if __name__ == "__main__":
    main()
