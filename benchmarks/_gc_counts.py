"""Python's cyclic garbage collections in this process while a block runs (``benchmarks/plan/planning_gc.py``,
``benchmarks/estimate/estimate_gc.py``), and the machine a count was taken on."""

from __future__ import annotations

import gc
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Any


class Collections:
    """Counts the collections this process runs while the block runs (a forked child's are not counted), with
    their seconds, by generation. ``where``: also, for each full (generation 2) collection, the three innermost
    memfit frames it started in, its seconds and the objects it freed."""

    def __init__(self, *, where: bool = False) -> None:
        self.where = where
        self.stats = {g: [0, 0.0] for g in range(3)}
        self.full: list[dict[str, Any]] = []
        self._pid = os.getpid()
        self._started = 0.0
        self._frames = ""

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if os.getpid() != self._pid:
            return
        full = info["generation"] == 2
        if phase == "start":
            self._started = time.perf_counter()
            if full and self.where:
                frames = [f"{Path(f.filename).name}:{f.name}" for f in traceback.extract_stack()[:-1]
                          if "memfit" in f.filename]
                self._frames = " < ".join(reversed(frames[-3:]))
            return
        took = time.perf_counter() - self._started
        self.stats[info["generation"]][0] += 1
        self.stats[info["generation"]][1] += took
        if full and self.where:
            self.full.append({"seconds": round(took, 3), "where": self._frames, "freed": info["collected"]})

    def by_generation(self) -> dict[str, dict[str, Any]]:
        return {str(g): {"count": n, "seconds": round(s, 3)} for g, (n, s) in self.stats.items()}


def machine() -> dict[str, Any]:
    """What a count was taken on: CPUs, Python, torch, the date."""
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
