"""Where a plan's time goes to Python's cyclic garbage collector, for two source trees side by side.

    python benchmarks/plan/planning_gc.py --trees BEFORE/src,AFTER/src --rounds 2 \
        --out benchmarks/results/plan/planning_gc_cpu_<torch>_<date>.json

Plans GPT-2 at 5.5 GiB (H200, roofline; the lane on where this machine has one) in a fresh process per tree and
round, the trees alternating, and counts the collections the planning process itself runs (``gc.callbacks``;
the lane's children are not counted) with the seconds they take, by generation. A full (generation 2) collection
walks every object in the process: torch, the model's libraries and every trace the plan holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _child import child_json  # noqa: E402
from _gc_counts import Collections, machine  # noqa: E402


def plan_counting_collections() -> dict:
    sys.path.insert(0, str(HERE))
    with Collections() as seen:  # from the imports on; the lane's children are forks, not counted
        import sweep_device

        from memfit.estimate.gpus import gpu_spec
        from memfit.plan.search import plan

        t = time.perf_counter()
        p = plan(sweep_device._workload("gpt2"), budget_bytes=int(5.5 * 2**30), effective_batch=32,
                 gpu=gpu_spec("h200"), calibration="roofline")
    return {"seconds": round(time.perf_counter() - t, 2), "estimates": p.estimates, "chosen": p.chosen.config.label(),
            "collections": seen.by_generation()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", help="BEFORE_SRC,AFTER_SRC")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(plan_counting_collections()))
        return
    rows = []
    for r in range(args.rounds):
        for tree in args.trees.split(","):
            row = {"round": r, "tree": tree, **child_json(__file__, "--one", paths=[str(Path(tree).resolve())])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"what": "GPT-2 plan at 5.5 GiB (H200, roofline): the planning process's own garbage collections",
              "trees": args.trees.split(","), "rows": rows, **machine()}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
