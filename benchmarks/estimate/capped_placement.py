"""How much of a step's smallest fitting cap the CUDA driver's segment placement decides, from recorded streams.

    PYTHONPATH=src python benchmarks/estimate/capped_placement.py \
        benchmarks/results/estimate/entry_traces_capped_h200_torch2.11_20261129_s35.tar.gz --out FILE.md

For each stream of a ``trace_entries.py`` archive (``ID.json.gz`` uncapped, ``ID@BYTES.json.gz`` under a cap of BYTES):
the GPU's peaks; its replay through memfit's allocator under its own cap with the segment addresses cudaMalloc
returned and with memfit's fake ones (each new segment below all earlier); and ``smallest_fitting_capacity`` of the
stream with fake addresses below, above, and in six seeded random orders. The spread of the last column is how far
the cap can move with nothing but where the driver put the segments. CPU only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_capped import _events  # noqa: E402

ORDERS = 6
"""Seeded random address orders tried per stream."""

_SEGMENTS = 4096  # more than any stream here creates; an address list may be longer than the segments made


def _orders() -> dict[str, list[int] | None]:
    """Segment addresses by order: ``below`` (memfit's default, None), ``above`` (each new segment above all earlier),
    and random permutations: 16 GiB apart, more than any segment, and below 2**48, as real device addresses are."""
    spacing = 1 << 34
    orders: dict[str, list[int] | None] = {"below": None, "above": [(i + 1) * spacing for i in range(_SEGMENTS)]}
    for seed in range(ORDERS):
        slots = random.Random(seed).sample(range(1, 2 * _SEGMENTS), _SEGMENTS)
        orders[f"random {seed}"] = [s * spacing for s in slots]
    return orders


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive", help="a trace_entries.py tar.gz")
    parser.add_argument("--out", required=True, help="a Markdown file")
    args = parser.parse_args()
    from memfit.estimate.allocator import replay, smallest_fitting_capacity

    orders = _orders()
    lines = [
        "| stream | cap (B) | GPU peak allocated / reserved (GB) | replay under its cap, recorded addresses | "
        "the same, fake addresses | smallest fitting cap by address order (GB) |",
        "|---|---|---|---|---|---|",
    ]
    with tarfile.open(args.archive) as tar:
        for member in sorted((m for m in tar.getmembers() if m.name.endswith(".json.gz")), key=lambda m: m.name):
            name = member.name.removesuffix(".json.gz")
            recorded = json.loads(gzip.decompress(tar.extractfile(member).read()))  # type: ignore[union-attr]
            raw, stats = recorded["events"], recorded["stats"]
            cap = int(name.partition("@")[2]) if "@" in name else None
            events = _events(raw)
            addresses = [e[1] for e in raw if e[0] == "segment_alloc"]

            def outcome(r: object) -> str:
                oom = r.oom_index  # type: ignore[attr-defined]
                reserved = r.peak_reserved_bytes / 1e9  # type: ignore[attr-defined]
                return f"runs, {reserved:.4f} GB reserved" if oom is None else f"OOM at event {oom}"

            real = replay(events, capacity_bytes=cap, segment_addresses=addresses)
            fake = replay(events, capacity_bytes=cap)
            caps = {label: smallest_fitting_capacity(events, segment_addresses=order) / 1e9
                    for label, order in orders.items()}
            spread = ", ".join(f"{label} {v:.3f}" for label, v in caps.items())
            lines.append(f"| {name} | {cap if cap is not None else 'none'} | "
                         f"{stats['allocated_bytes.all.peak'] / 1e9:.4f} / {stats['reserved_bytes.all.peak'] / 1e9:.4f}"
                         f" | {outcome(real)} | {outcome(fake)} | {spread} |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
