"""A twelfth draw, written down on 2026-11-30 (session 37) before memfit estimated or measured any of it: zoo steps
already measured with PyTorch's default allocator, run again under the allocator settings users set after an OOM.

PyTorch's own OOM message suggests ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, older versions suggested
``max_split_size_mb``, and image-generation guides pass ``garbage_collection_threshold:0.6,max_split_size_mb:128``
around. memfit reads the setting (``AllocatorConfig.from_env``) and replays the step's allocations under it, but its
replay of these settings had been checked against recorded allocator traces of the benchmark suite only
(``docs/allocator.md``), never on a real model's measured cap. Every number from this draw is validation: nothing in
``src`` is fitted to it.

The steps are drawn with a fixed seed from the fresh draws' steps that the H200 measured (``rescore_s36``'s rows)
with a measured ``fits_in`` under 16 GB, so that a dozen trials share the GPU. Each group is estimated (on the CPU)
and measured (on the GPU) with its setting in the environment of both.

    python benchmarks/zoo/allocator_draw.py          # prints each group's setting and its comma-separated steps
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROWS = Path(__file__).resolve().parents[1] / "results/estimate/rescore_s36/rescore_after_cpu_torch2.14_20261130.jsonl"
SEED = 20261130
MAX_MEASURED_FIT = 16e9
GROUPS = {
    "expandable": ("expandable_segments:True", 12),
    "max_split": ("max_split_size_mb:128", 6),
    "gc_max_split": ("garbage_collection_threshold:0.6,max_split_size_mb:128", 6),
}
"""Group -> (the ``PYTORCH_CUDA_ALLOC_CONF`` it runs under, how many steps)."""


def candidates() -> list[str]:
    """Zoo steps (not corpus entries) measured on the H200 with a ``fits_in`` under ``MAX_MEASURED_FIT``, sorted."""
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    return sorted({r["name"] for r in rows if not r["corpus"] and r["gpu"] == "h200" and r.get("meas_fit")
                   and r["meas_fit"] < MAX_MEASURED_FIT})


def draw() -> dict[str, list[str]]:
    """Each group's steps: one seeded shuffle of the candidates, dealt out in ``GROUPS``' order."""
    names = candidates()
    random.Random(SEED).shuffle(names)
    groups, at = {}, 0
    for group, (_, count) in GROUPS.items():
        groups[group] = sorted(names[at:at + count])
        at += count
    return groups


if __name__ == "__main__":
    for group, steps in draw().items():
        print(f"{group}\t{GROUPS[group][0]}\t{','.join(steps)}")
