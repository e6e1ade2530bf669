"""How many of the lane's traces a plan uses: children forked (guesses started) and traces taken from them, for
given workloads and budgets, each plan in a fresh process importing memfit from each source tree in turn.

    python benchmarks/plan/lane_use.py --trees BEFORE/src,AFTER/src --out FILE.json

Deterministic where the planning time is not (the same guesses whatever the machine's load, but for a child that
finishes before or after the planner asks: a guess in flight is waited for, so the counts move little). The
workloads are ``planning_time.py``'s: GPT-2 at 5.5 GiB (H200) and the two edge budgets (H100).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _child import child_json  # noqa: E402

CASES = {"gpt2@5.5": ("gpt2", 32, 5.5, "h200"), "resnet50@edge": ("resnet50", 64, 1.2, None),
         "vit_b16@edge": ("vit_b16", 64, 2.0, None)}


def one(case: str) -> dict:
    """Plan ``case`` here and count the lane's children (run by ``main`` in a fresh process)."""
    sys.path.insert(0, str(HERE))
    from memfit.errors import BudgetTooSmallError
    from memfit.estimate.gpus import gpu_spec
    from memfit.plan import lanes
    from memfit.plan.search import plan
    from memfit.workload.zoo import builtin_workload

    counts = {"forked": 0, "used": 0}
    close = lanes.TraceLane.close

    def counted_close(self) -> None:  # noqa: ANN001
        counts["forked"] += self.forked
        counts["used"] += self.used
        close(self)

    lanes.TraceLane.close = counted_close  # type: ignore[method-assign]
    name, effective, gib, gpu = CASES[case]
    if name == "gpt2":
        import sweep_device

        workload = sweep_device._workload("gpt2")
    else:
        workload = builtin_workload(name)
    started = time.perf_counter()
    try:
        p = plan(workload, budget_bytes=int(gib * 2**30), effective_batch=effective, gpu=gpu_spec(gpu),
                 calibration="roofline")
        estimates, chosen = p.estimates, p.chosen.config.label()
    except BudgetTooSmallError:
        estimates, chosen = None, None
    return {"case": case, **counts, "estimates": estimates, "chosen": chosen,
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", required=True, help="BEFORE_SRC,AFTER_SRC")
    parser.add_argument("--out", required=True)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    rows = []
    for case in CASES:
        for tree in args.trees.split(","):
            rows.append({"tree": tree, **child_json(__file__, "--trees", args.trees, "--out", "-", "--one", case,
                                                    paths=[str(Path(tree).resolve())])})
            print(rows[-1], flush=True)
    import torch

    Path(args.out).write_text(json.dumps({"what": "lane children forked and used per plan", "rows": rows,
                                          "torch": torch.__version__, "cpus": os.cpu_count(),
                                          "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
