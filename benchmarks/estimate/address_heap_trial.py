"""A trial model of the CUDA driver's segment placement, tried on recorded streams and not kept (session 35).

    PYTHONPATH=src python benchmarks/estimate/address_heap_trial.py STREAM.json.gz ...

The model: one address space; a new segment goes top-down at the highest free range that holds it, at a 32 MiB-aligned
address when it is 32 MiB or more (2 MiB otherwise); a freed segment's range is free again (``small_up``: segments
under 32 MiB go bottom-up instead). For each stream (``trace_entries.py``'s ``ID.json.gz`` or ``ID@CAP.json.gz``, and
``replay_capped.py``'s ``*_cap<N>.json.gz``): the replay under the stream's cap with the recorded addresses, memfit's
fake ones (below) and the model's, and the share of segment pairs whose address order the model gets right
(streams of fewer than 600 segments). Results: ``capped_placement_h200_torch2.11_20261129_s35.md``.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_capped import _events  # noqa: E402

MiB = 1 << 20
BIG = 32 * MiB


class Heap:
    def __init__(self, small_up: bool = False) -> None:
        self.free = [(1 << 40, 1 << 46)]  # [start, end), sorted
        self.small_up = small_up
        self.live: dict[int, int] = {}

    def alloc(self, size: int) -> int:
        align = BIG if size >= BIG else 2 * MiB
        start = None
        if self.small_up and size < BIG:
            for s, e in sorted(self.free):
                st = -(-s // align) * align
                if st + size <= e:
                    start = st
                    break
        else:
            for s, e in sorted(self.free, key=lambda r: -r[1]):
                st = (e - size) // align * align
                if st >= s:
                    start = st
                    break
        assert start is not None
        self.free = [piece for s, e in self.free for piece in ((s, min(e, start)), (max(s, start + size), e))
                     if piece[0] < piece[1]]
        self.live[start] = size
        return start

    def release(self, start: int) -> None:
        self.free.append((start, start + self.live.pop(start)))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self.free:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self.free = merged


def model_addresses(raw: list, small_up: bool = False) -> list[int]:
    heap, out, by_real = Heap(small_up), [], {}
    for e in raw:
        if e[0] == "segment_alloc":
            by_real[e[1]] = heap.alloc(e[2])
            out.append(by_real[e[1]])
        elif e[0] == "segment_free":
            heap.release(by_real.pop(e[1]))
    return out


def order_agreement(real: list[int], model: list[int]) -> float:
    pairs = [(i, j) for i in range(len(real)) for j in range(i + 1, len(real))]
    return sum((real[i] < real[j]) == (model[i] < model[j]) for i, j in pairs) / max(len(pairs), 1)


def main() -> None:
    from memfit.estimate.allocator import replay

    for path in map(Path, sys.argv[1:]):
        name = path.name.removesuffix(".json.gz")
        found = re.search(r"@(\d+)$|_cap(\d+)$", name)
        cap = int(found.group(1) or found.group(2)) if found else None
        if cap is not None and cap < 10**6:  # replay_capped.py's names give MB
            cap *= 10**6
        raw = json.loads(gzip.open(path, "rt").read())["events"]
        events = _events(raw)
        real = [e[1] for e in raw if e[0] == "segment_alloc"]
        cells = [name]
        for label, addresses in (("recorded", real), ("below", None), ("heap", model_addresses(raw)),
                                 ("heap, small up", model_addresses(raw, small_up=True))):
            r = replay(events, capacity_bytes=cap, segment_addresses=addresses)
            order = (f", order {order_agreement(real, addresses):.2f}"
                     if addresses is not None and addresses is not real and len(real) < 600 else "")
            cells.append(f"{label}: {'runs' if r.oom_index is None else 'OOM'} {r.peak_reserved_bytes / 1e9:.4f}{order}")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
