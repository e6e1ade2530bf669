"""How much the smallest cap a GPU's own allocator stream fits in depends on where cudaMalloc puts each segment.

The caching allocator's best fit takes, among free blocks of one size, the one at the lowest address; which block
it takes decides which segments fall wholly free, and only those go back when a capped run flushes its cache. A
trace has no addresses, so memfit's replay gives each new segment a fake base below every earlier one
(``allocator.CachingAllocator._segment_base``). Here every recorded GPU stream (``trace_entries.py``: action,
address, size of each event, ``segment_alloc`` among them) is replayed three ways and its smallest fitting cap
found by ``smallest_fitting_capacity``'s bisection: with the addresses the GPU's cudaMalloc returned (later segments
fake), with memfit's fake bases growing down, and with fake bases growing up. The difference between the first and
the others is what the unknown addresses alone move the cap by: the stream is the GPU's, so nothing of the trace
is in it. A capped replay can hold a segment that the uncapped run had freed and whose address cudaMalloc handed
out again: the recorded addresses then collide, and the stream is left out (said on stderr).

    PYTHONPATH=src python benchmarks/estimate/segment_addresses.py benchmarks/results/estimate/*traces*.tar.gz \
        --out benchmarks/results/estimate/segment_addresses_<card>_torch2.11_<date>.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from replay_capped import _events  # noqa: E402

from memfit.estimate import allocator as alloc  # noqa: E402

MiB = 2**20


class _Upward(alloc.CachingAllocator):
    """Fake segment bases that grow up: each new segment above every earlier one."""

    def _segment_base(self, alloc_size: int) -> int:
        index = self._segments_created
        self._segments_created += 1
        if index < len(self._real_addresses):
            return self._real_addresses[index]
        base = getattr(self, "_up", alloc._FAKE_TOP)
        self._up = base + -(-alloc_size // alloc.ROUND_LARGE) * alloc.ROUND_LARGE
        return base


def smallest_cap(events: list[tuple[int, int, int]], addresses: list[int] | None, upward: bool = False) -> int:
    """``smallest_fitting_capacity`` (2 MiB steps) with the given first segment bases, or fake ones up or down."""
    original = alloc.CachingAllocator
    if upward:
        alloc.CachingAllocator = _Upward  # type: ignore[misc]  # replay builds the allocator by this name
    try:
        return alloc.smallest_fitting_capacity(events, segment_addresses=addresses)
    finally:
        alloc.CachingAllocator = original  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tarballs", nargs="+", help="tar.gz files of NAME.json.gz streams (trace_entries.py)")
    parser.add_argument("--out", required=True, help="a Markdown file (a JSON beside it)")
    args = parser.parse_args()
    rows = []
    for tarball in map(Path, args.tarballs):
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                if not member.name.endswith(".json.gz") or "@" in member.name:  # capped runs stop early
                    continue
                recorded = json.loads(gzip.decompress(tar.extractfile(member).read()))["events"]
                addresses = [e[1] for e in recorded if e[0] == "segment_alloc"]
                events = _events(recorded)
                if not addresses or not events:
                    continue
                try:
                    recorded_cap = smallest_cap(events, addresses)
                except KeyError:  # the GPU reused a freed segment's address, which a capped replay still holds
                    print(f"left out: {tarball.name}:{member.name} (recorded addresses collide)", file=sys.stderr)
                    continue
                caps = {"recorded": recorded_cap, "down": smallest_cap(events, None),
                        "up": smallest_cap(events, None, upward=True)}
                rows.append({"stream": f"{tarball.name}:{member.name.removesuffix('.json.gz')}",
                             "events": len(events), "segments": len(addresses), **caps})
                print(rows[-1], flush=True)

    def pct(a: int, b: int) -> float:
        return 100.0 * (a - b) / b

    lines = [
        "# Smallest fitting cap of GPU-recorded allocator streams: recorded segment addresses against fake ones",
        "",
        "`benchmarks/estimate/segment_addresses.py` (CPU). Each stream is the GPU's own (uncapped runs of "
        "`trace_entries.py`), so the columns differ only by the segment bases the replay gives cudaMalloc's "
        "segments. `down`: memfit's fake bases (each new segment below the others); `up`: each above. Error = "
        "(fake - recorded) / recorded.",
        "",
        "| stream | events | segments | recorded MiB | down MiB | down err | up MiB | up err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['stream']} | {r['events']} | {r['segments']} | {r['recorded'] / MiB:.0f} | "
                     f"{r['down'] / MiB:.0f} | {pct(r['down'], r['recorded']):+.1f}% | {r['up'] / MiB:.0f} | "
                     f"{pct(r['up'], r['recorded']):+.1f}% |")
    for side in ("down", "up"):
        errs = [pct(r[side], r["recorded"]) for r in rows]
        if errs:
            lines.append("")
            lines.append(f"{side}: {sum(e == 0 for e in errs)} of {len(errs)} the same, {sum(e > 0 for e in errs)} "
                         f"over, {sum(e < 0 for e in errs)} under; median |error| "
                         f"{statistics.median(abs(e) for e in errs):.2f} %, range {min(errs):+.1f} … {max(errs):+.1f} %")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
