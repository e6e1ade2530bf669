"""Where a larger cap runs out of memory where a smaller one ran: the bisection's answer beside the walked one.

    PYTHONPATH=src python benchmarks/estimate/monotone_caps.py --gpu h100 --zoo --out FILE.jsonl \
        --measured benchmarks/results/estimate/zoo_measurements_h100_* ...
    PYTHONPATH=src python benchmarks/estimate/monotone_caps.py --gpu h200 --corpus validation --out FILE.jsonl \
        --measured benchmarks/results/estimate/corpus_measurements_h200_torch2.11_20261126

Each step is traced once (in this process, one after another) and its stream searched twice: by bisection alone
(``smallest_fitting_capacity`` before session 27, which assumed that a larger cap never hurts) and by
``smallest_fitting_capacity`` (the bisection, then every cap above it walked). One JSON line per step, appended as it
is done (a run can be resumed: steps already in ``--out`` are skipped), with the measured ``fits_in`` beside when a
``--measured`` folder has the step. CPU only; a failing step is a line with its error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "zoo"))
sys.path.insert(0, str(HERE.parent / "corpus"))
sys.path.insert(0, str(HERE))

from ab_accuracy import _measured  # noqa: E402


def _bisection_only(events: list, replays: list[int]) -> int:
    """The answer as ``smallest_fitting_capacity`` gave it before the walk (default allocator settings)."""
    allocator = importlib.import_module("memfit.estimate.allocator")
    granularity = 2 * 2**20
    uncapped = allocator.replay(events)

    def fits(steps: int) -> bool:
        replays[0] += 1
        return allocator.replay(events, capacity_bytes=steps * granularity).oom_index is None

    hi = -(-uncapped.peak_reserved_bytes // granularity)
    lo = max(uncapped.peak_allocated_bytes // granularity - 1, 0)
    if lo > 0 and fits(lo):
        lo = 0
    return allocator._bisect(fits, lo, hi) * granularity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--zoo", action="store_true", help="every zoo entry (or --names)")
    which.add_argument("--corpus", choices=["fit", "validation"], help="one half of the corpus")
    parser.add_argument("--names", default="", help="comma-separated zoo names or corpus ids (a subset)")
    parser.add_argument("--measured", nargs="+", default=[], help="measurement folders, later ones win")
    parser.add_argument("--out", required=True, help="a JSON-lines file, appended to")
    args = parser.parse_args()

    allocator = importlib.import_module("memfit.estimate.allocator")
    trace_workload = importlib.import_module("memfit.estimate.trace").trace_workload
    from memfit.estimate.gpus import gpu_spec
    from memfit.workload.loading import load_workload

    wanted = set(filter(None, args.names.split(",")))
    if args.zoo:
        from registry import entries

        specs = {e.name: e.spec for e in entries() if not e.missing() and (not wanted or e.name in wanted)}
    else:
        import corpus

        specs = {e["id"]: f"{HERE.parent / 'corpus' / 'corpus.py'}:{e['id']}" for e in corpus.entries(args.corpus)
                 if not wanted or e["id"] in wanted}
    out = Path(args.out)
    done = {json.loads(line)["name"] for line in out.read_text().splitlines()} if out.exists() else set()
    spec = gpu_spec(args.gpu)
    for name, where in specs.items():
        if name in done:
            continue
        row: dict = {"name": name, "gpu": args.gpu, "measured": _measured(name, args.measured)}
        try:
            started = time.perf_counter()
            events = trace_workload(load_workload(where), spec).events()
            row["trace_s"] = round(time.perf_counter() - started, 2)
            replays = [0]
            started = time.perf_counter()
            row["bisection_bytes"] = _bisection_only(events, replays)
            row["bisection_s"], row["bisection_replays"] = round(time.perf_counter() - started, 2), replays[0]
            counted = [0]
            real = allocator._replay

            def counting(*a, _real=real, _counted=counted):  # noqa: ANN002, ANN202
                _counted[0] += 1
                return _real(*a)

            allocator._replay = counting
            try:
                started = time.perf_counter()
                row["walked_bytes"] = allocator.smallest_fitting_capacity(events)
                row["walked_s"], row["walked_replays"] = round(time.perf_counter() - started, 2), counted[0]
            finally:
                allocator._replay = real
            row["events"] = len(events)
        except Exception as exc:  # noqa: BLE001 (a failing step is a row)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(name, row.get("bisection_bytes"), row.get("walked_bytes"), row.get("error", ""), flush=True)


if __name__ == "__main__":
    main()
