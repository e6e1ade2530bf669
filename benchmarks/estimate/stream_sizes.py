"""A GPU's allocator stream of a zoo entry beside memfit's traced stream: the smallest cap each fits in, and the
allocation sizes (rounded to 512 B, as the allocator rounds them) that one has more often than the other.

    PYTHONPATH=<the entry's libraries>:src python benchmarks/estimate/stream_sizes.py STREAMS.tar.gz NAME [--gpu h200]

``STREAMS.tar.gz`` comes from ``benchmarks/estimate/trace_entries.py --zoo NAME`` (GPU, uncapped). Where the two
streams' caps differ and their peaks allocated agree, the sizes listed say which allocations the trace made
otherwise (a data-dependent size drawn from another batch, a kernel's scratch block).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "zoo"))

from replay_capped import _events  # noqa: E402


def _sizes(events: list[tuple[int, int, int]]) -> collections.Counter[int]:
    counts: collections.Counter[int] = collections.Counter()
    for op, _, nbytes in events:
        if op > 0:
            counts[nbytes if nbytes < 512 else -(-nbytes // 512) * 512] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("streams")
    parser.add_argument("name")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    from registry import entries

    from memfit.estimate.allocator import replay, smallest_fitting_capacity
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.loading import load_workload

    with tarfile.open(args.streams) as tar:
        member = tar.extractfile(f"{args.name}.json.gz")
        assert member is not None
        gpu_events = _events(json.loads(gzip.decompress(member.read()))["events"])
    traced = trace_workload(load_workload(entries([args.name])[0].spec), gpu_spec(args.gpu)).events()
    print(f"{args.name}: GPU stream {len(gpu_events)} events, peak allocated "
          f"{replay(gpu_events).peak_allocated_bytes:,} B, smallest cap {smallest_fitting_capacity(gpu_events):,} B")
    print(f"{args.name}: memfit's trace {len(traced)} events, peak allocated {replay(traced).peak_allocated_bytes:,} B, "
          f"smallest cap {smallest_fitting_capacity(traced):,} B")
    gpu, ours = _sizes(gpu_events), _sizes(traced)
    differ = sorted(((s, gpu[s], ours[s]) for s in set(gpu) | set(ours) if gpu[s] != ours[s]),
                    key=lambda row: -row[0] * abs(row[1] - row[2]))
    print("| size B | GPU's count | memfit's count |\n|---|---|---|")
    for size, a, b in differ[: args.top]:
        print(f"| {size:,} | {a} | {b} |")


if __name__ == "__main__":
    main()
