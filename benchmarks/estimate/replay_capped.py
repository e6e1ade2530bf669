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

from memfit.estimate.allocator import replay  # noqa: E402


def _events(recorded: list) -> list[tuple[int, int, int]]:
    """The recorded stream's allocs and completed frees as ``replay``'s (op, key, nbytes) events."""
    events: list[tuple[int, int, int]] = []
    live: dict[int, int] = {}  # address -> key of the block allocated there
    for key, (action, addr, size, *_) in enumerate(recorded):
        if action == "alloc":
            live[addr] = key
            events.append((1, key, size))
        elif action == "free_completed" and addr in live:
            events.append((-1, live.pop(addr), size))
    return events


def short_lived(recorded: list) -> set[int]:
    """The recorded stream's allocs (their index, the key ``_events`` gives them) whose completed free came within
    two events: a library's workspace or a kernel's scratch."""
    made: dict[int, int] = {}  # address -> index of the alloc there
    found = set()
    for i, (action, addr, *_) in enumerate(recorded):
        if action == "alloc":
            made[addr] = i
        elif action == "free_completed" and addr in made:
            at = made.pop(addr)
            if i - at <= 2:
                found.add(at)
    return found


def main() -> None:
    for path in map(Path, sys.argv[1:]):
        cap_text = re.search(r"_cap(\d+)\.json\.gz$", path.name).group(1)
        cap = int(cap_text) if len(cap_text) > 6 else int(cap_text) * 10**6
        recorded = json.loads(gzip.open(path, "rt").read())["events"]
        events = _events(recorded)
        addresses = [e[1] for e in recorded if e[0] == "segment_alloc"]
        fake = replay(events, capacity_bytes=cap)
        real = replay(events, capacity_bytes=cap, segment_addresses=addresses)
        print(f"{path.name}: cap {cap:,}; " + "; ".join(
            f"{name} addresses: {'runs' if r.oom_index is None else 'OOM'} (peak reserved {r.peak_reserved_bytes:,})"
            for name, r in (("fake", fake), ("recorded", real))))


if __name__ == "__main__":
    main()
