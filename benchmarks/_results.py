"""Where benchmark results go and what they are called (benchmarks/README.md, "Naming").

A result is ``results/<feature>/<benchmark>_<machine>_torch<major.minor>_<yyyymmdd>.{md,json}``: ``machine`` is
the card that measured (``h200``, ``h100``, ``2xh200`` for two of them) or ``cpu`` for a run without a GPU, and
torch is the version on that machine, so two runs of one benchmark on different cards or torch versions never
share a name. A folder of raw per-workload files that a report is made from is named the same way.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def card(device_name: str | None, count: int = 1) -> str:
    """``'NVIDIA H200'`` -> ``h200``, ``'NVIDIA H100 80GB HBM3'`` -> ``h100``, ``'NVIDIA A100-SXM4-80GB'`` ->
    ``a100``, ``'NVIDIA GeForce RTX 4090'`` -> ``rtx4090``; ``count`` cards -> ``2xh200``; no device -> ``cpu``."""
    if not device_name:
        return "cpu"
    words = [w for w in re.split(r"[\s\-_]+", device_name) if w and w.lower() not in ("nvidia", "geforce", "tesla")]
    if not words:
        return "gpu"
    slug = words[0].lower()
    if slug.isalpha() and len(words) > 1:  # "RTX 4090": the family word alone says nothing
        slug += words[1].lower()
    slug = re.sub(r"[^a-z0-9]+", "", slug) or "gpu"
    return f"{count}x{slug}" if count > 1 else slug


def torch_tag(version: str) -> str:
    """``'2.11.0+cu130'`` -> ``torch2.11``: the minor version decides kernels and allocator behaviour; the CUDA
    build is in the file."""
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    return f"torch{major_minor}"


def stem(benchmark: str, machine: str, torch_version: str, date: dt.date | str | None = None) -> str:
    """``estimate_accuracy_h200_torch2.11_20261126``. ``date``: a date, an ISO date string, or today."""
    if date is None:
        date = dt.date.today()
    elif isinstance(date, str):
        date = dt.date.fromisoformat(date[:10])
    return f"{benchmark}_{machine}_{torch_tag(torch_version)}_{date:%Y%m%d}"


def latest(feature: str, prefix: str) -> Path:
    """The newest ``results/<feature>/<prefix>*`` by the date its name ends with (a default input for a stage
    that reads an earlier stage's output); ``results/<feature>/<prefix>`` if there is none, so the error names it."""
    found = [p for p in (RESULTS / feature).glob(f"{prefix}*") if re.search(r"_(\d{8})(\.\w+)?$", p.name)]
    if not found:
        return RESULTS / feature / prefix
    return max(found, key=lambda p: (re.search(r"_(\d{8})(\.\w+)?$", p.name).group(1), p.name))


def write_gpu_json(folder: Path, benchmark: str, payload: dict, tag: str = "") -> Path:
    """``payload`` with this machine's first GPU and torch version, written as
    ``<folder>/<benchmark>_<card>_torch<X.Y>_<yyyymmdd><tag>.json``; returns the path."""
    import json

    import torch

    device = torch.cuda.get_device_name(0)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem(benchmark, card(device), torch.__version__)}{tag}.json"
    path.write_text(json.dumps({"device": device, "torch": torch.__version__, **payload}, indent=1))
    return path
