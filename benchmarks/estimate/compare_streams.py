"""memfit's allocation stream of zoo entries beside the stream an H100 recorded for them.

    PYTHONPATH=src python benchmarks/estimate/compare_streams.py \
        --streams benchmarks/results/estimate/zoo_traces_h100_torch2.11_20261127.tar.gz --out FILE.md

For each entry: the GPU's peak allocated and reserved (its memory_stats), its stream replayed through memfit's
allocator (which reproduces the reserved peak when the allocator model is right), and memfit's own traced stream
replayed (what the estimate's ``peak_allocated_bytes`` / ``peak_reserved_bytes`` are made of). The difference between
the last two is the trace's (the ops, their order and sizes), not the allocator's. Streams come from
``benchmarks/estimate/trace_entries.py --zoo`` (GPU). CPU, the zoo's libraries installed (transformers as on the GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "zoo"))

from replay_capped import _events  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", required=True, help="a tar.gz of NAME.json.gz streams (trace_entries.py)")
    parser.add_argument("--out", required=True, help="a Markdown file")
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    import torch
    from registry import entries

    from memfit.estimate.allocator import replay
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.loading import load_workload

    rows = []
    with tarfile.open(args.streams) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith(".json.gz")), key=lambda m: m.name)
        for member in members:
            name = member.name.removesuffix(".json.gz")
            recorded = json.loads(gzip.decompress(tar.extractfile(member).read()))  # type: ignore[union-attr]
            stats = recorded["stats"]
            gpu_replay = replay(_events(recorded["events"]))
            trace = trace_workload(load_workload(entries([name])[0].spec), gpu_spec(args.gpu))
            ours = replay(trace.events())
            rows.append((name, stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"],
                         gpu_replay.peak_reserved_bytes, ours.peak_allocated_bytes, ours.peak_reserved_bytes))
            print(name, rows[-1][1:], flush=True)

    def pct(a: int, b: int) -> str:
        return f"{100 * (a / b - 1):+.2f} %"

    lines = [
        f"# memfit's traced streams beside H100 streams (zoo entries; torch {torch.__version__} on the CPU)",
        "",
        f"Streams: `{args.streams}`. Produced by `benchmarks/estimate/compare_streams.py`.",
        "",
        "| entry | GPU peak allocated | GPU peak reserved | GPU stream replayed: reserved | memfit allocated "
        "| memfit reserved (uncapped) |",
        "|---|---|---|---|---|---|",
    ]
    for name, alloc, reserved, gpu_reserved, our_alloc, our_reserved in rows:
        lines.append(f"| {name} | {alloc:,} | {reserved:,} | {pct(gpu_reserved, reserved)} | {pct(our_alloc, alloc)} "
                     f"| {pct(our_reserved, reserved)} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
