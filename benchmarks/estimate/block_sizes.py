"""A zoo step's large blocks in a GPU's allocator stream against memfit's traced stream, by size (CPU).

    PYTHONPATH=src:benchmarks python benchmarks/estimate/block_sizes.py ARCHIVE NAME [--min-mib 64]

ARCHIVE is a ``trace_entries.py`` tar.gz holding ``NAME.json.gz`` (an uncapped run). Prints the smallest cap each
stream needs (``smallest_fitting_capacity``, memfit's fake addresses), then every block size of at least ``--min-mib``
MiB whose count differs between the streams, and how many of the GPU's blocks of that size were freed within two
events of being made (a library's workspace). Needs the zoo's model libraries.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "zoo"))
from replay_capped import _events, short_lived  # noqa: E402

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    parser.add_argument("name")
    parser.add_argument("--min-mib", type=int, default=64)
    parser.add_argument("--gpu", default="h200")
    args = parser.parse_args()
    from registry import entries

    from memfit.estimate.allocator import smallest_fitting_capacity
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.loading import load_workload

    with tarfile.open(args.archive) as tar:
        raw = json.loads(gzip.decompress(tar.extractfile(f"{args.name}.json.gz").read()))["events"]  # type: ignore[union-attr]
    gpu = _events(raw)
    ours = list(trace_workload(load_workload(entries([args.name])[0].spec), gpu_spec(args.gpu)).events())
    print(f"smallest fitting cap: GPU stream {smallest_fitting_capacity(gpu) / 1e9:.4f} GB, "
          f"memfit's trace {smallest_fitting_capacity(ours) / 1e9:.4f} GB")
    brief = Counter(raw[key][2] >> 20 for key in short_lived(raw))
    floor = args.min_mib * MiB
    g = Counter(n >> 20 for op, _, n in gpu if op == 1 and n >= floor)
    o = Counter(n >> 20 for op, _, n in ours if op in (1, 2) and n >= floor)
    print("| MiB | GPU blocks | of them freed within 2 events | memfit's blocks |\n|---|---|---|---|")
    for size in sorted(set(g) | set(o), reverse=True):
        if g[size] != o[size]:
            print(f"| {size} | {g[size]} | {brief[size]} | {o[size]} |")


if __name__ == "__main__":
    main()
