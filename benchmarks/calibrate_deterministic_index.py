"""Measure what PyTorch's deterministic implementations of accumulating index ops allocate on CUDA beyond the
kernels' default ones: ``scatter_add_``, ``index_add_``, ``index_put_(accumulate=True)`` and ``scatter_reduce_``
(sum), each with deterministic algorithms off and on, over a few shapes (1-D to 4-D, int64 indices).

Under ``torch.use_deterministic_algorithms(True)`` a CUDA ``scatter_add_`` runs as an ``index_put_`` over flattened
coordinates it builds (aten/src/ATen/native/TensorAdvancedIndexing.cpp, ``_scatter_via_index_put``), and
``index_put_`` with accumulation sorts its indices: blocks a CPU trace cannot see. Data for a rule, not a rule.

    python benchmarks/calibrate_deterministic_index.py --out $OUT     # on a CUDA machine; seconds

Writes ``deterministic_index_<card>_torch<X.Y>_<yyyymmdd>.json`` into ``--out``: one row per op, shape and setting
with the transient bytes (the peak during the call minus what is allocated after it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import RESULTS, card, stem  # noqa: E402


def _transient(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated())


def _cases() -> list[tuple[str, tuple[int, ...], int, Callable[[], Callable[[], object]]]]:
    """(op, self's shape, index elements, a builder of the call) for each case."""
    cases = []
    for shape, dim in (((1 << 22,), 0), ((4096, 256), 0), ((64, 128, 512), 1), ((8, 32, 128, 128), 2),
                       ((4, 64, 256, 256), 3)):
        def scatter_add(shape: tuple[int, ...] = shape, dim: int = dim) -> Callable[[], object]:
            out = torch.zeros(shape, device="cuda")
            src = torch.randn(shape, device="cuda")
            index = torch.randint(0, shape[dim], shape, device="cuda")
            return lambda: out.scatter_add_(dim, index, src)

        def scatter_sum(shape: tuple[int, ...] = shape, dim: int = dim) -> Callable[[], object]:
            out = torch.zeros(shape, device="cuda")
            src = torch.randn(shape, device="cuda")
            index = torch.randint(0, shape[dim], shape, device="cuda")
            return lambda: out.scatter_reduce_(dim, index, src, "sum")

        numel = 1
        for s in shape:
            numel *= s
        cases += [("scatter_add_", shape, numel, scatter_add), ("scatter_reduce_sum", shape, numel, scatter_sum)]
    for rows, width in ((1 << 16, 256), (1 << 18, 64), (1 << 20, 16)):
        def index_add(rows: int = rows, width: int = width) -> Callable[[], object]:
            out = torch.zeros(rows // 4, width, device="cuda")
            src = torch.randn(rows, width, device="cuda")
            index = torch.randint(0, rows // 4, (rows,), device="cuda")
            return lambda: out.index_add_(0, index, src)

        def index_put(rows: int = rows, width: int = width) -> Callable[[], object]:
            out = torch.zeros(rows // 4, width, device="cuda")
            src = torch.randn(rows, width, device="cuda")
            index = torch.randint(0, rows // 4, (rows,), device="cuda")
            return lambda: out.index_put_((index,), src, accumulate=True)

        cases += [("index_add_", (rows, width), rows, index_add), ("index_put_accumulate", (rows, width), rows,
                                                                     index_put)]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "estimate"))
    args = parser.parse_args()
    rows = []
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        for op, shape, index_numel, build in _cases():
            call = build()
            call()  # once to set up
            rows.append(dict(op=op, shape=list(shape), index_numel=index_numel, deterministic=deterministic,
                             transient_bytes=_transient(call)))
            del call
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": dt.date.today().isoformat(), "rows": rows}
    path = Path(args.out) / f"{stem('deterministic_index', card(props.name), torch.__version__)}.json"
    path.write_text(json.dumps(result, indent=0))
    for r in rows:
        print(r["op"], r["shape"], "det" if r["deterministic"] else "default", r["transient_bytes"],
              f"{r['transient_bytes'] / r['index_numel']:.1f} B/index")
    print(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
