"""Python's cyclic garbage collector in ``memfit estimate``, for two source trees side by side.

    PYTHONPATH=<library folders> python benchmarks/estimate/estimate_gc.py --trees BEFORE/src,AFTER/src \
        --specs benchmarks/zoo/holdout.py:ho_hf_detr,... --out benchmarks/results/estimate/estimate_gc_cpu_<torch>_<date>.json

Each spec is estimated (``--gpu h100 --json``) in a fresh process per tree, the trees alternating, with
``gc.callbacks`` counting the collections and their seconds by generation; for each full (generation 2)
collection, where in memfit it started and how many objects it freed. A full collection walks every object in the
process (torch, the model's libraries, the trace), so its cost is the heap's size, not the garbage's. A
``PYTHONPATH`` already set comes after the tree (the model libraries the GPU has).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _child import child_json  # noqa: E402
from _gc_counts import Collections, machine  # noqa: E402


def estimate_counting_collections(spec: str) -> dict:
    with Collections(where=True) as seen:  # from the imports on
        from memfit.estimate.gpus import gpu_spec
        from memfit.estimate.predict import estimate
        from memfit.workload.loading import load_workload

        t = time.perf_counter()
        est = estimate(load_workload(spec), gpu=gpu_spec("h100"))
    return {"seconds": round(time.perf_counter() - t, 2), "fits_in_bytes": est.fits_in_bytes,
            "collections": seen.by_generation(), "full": seen.full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees")
    parser.add_argument("--specs")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(estimate_counting_collections(args.one)))
        return
    rows = []
    for spec in args.specs.split(","):
        for tree in args.trees.split(","):
            paths = [str(Path(tree).resolve()), str(ROOT / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]
            row = {"spec": spec, "tree": tree,
                   **child_json(__file__, "--one", spec, paths=paths, env={"THP_MEM_ALLOC_ENABLE": "1"})}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("spec", "tree", "seconds", "collections")}), flush=True)
    report = {"what": "memfit estimate (H100, in-process): the process's garbage collections, by generation",
              "trees": args.trees.split(","), "rows": rows, **machine()}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
