"""How long ``plan()`` takes on this CPU, with its second lane of traces and without, and whether the plans agree.

    python benchmarks/plan/planning_time.py --out benchmarks/results/plan/planning_time_cpu_<torch>_<date>.json

For each workload of ``sweep_device.WORKLOADS`` (GPT-2, the 2-D U-Net, ViT-B/16, the 3-D U-Net: the issue's
planner benchmark) and each of its four budgets, and two budgets at the edge of what fits (``EDGE``), plans with
the roofline, once in a fresh process with
the lane (``memfit.plan.lanes``) and once with ``MEMFIT_PLAN_PROCESSES=1``; the order alternates from workload to
workload so that a drift of the machine does not favour one. Each record: seconds per budget, estimates, and the
chosen configuration; ``same_plan`` compares everything the plan returns but its elapsed time.

``--trees BEFORE/src,AFTER/src`` times two source trees instead (``git worktree add /tmp/before <commit>``), with
the lane, alternating workload by workload: a change's effect on the same machine at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from _child import child_json  # noqa: E402

EDGE = {"resnet50@edge": ("resnet50", 64, (1.2,)), "vit_b16@edge": ("vit_b16", 64, (2.0,))}
"""Budgets at the edge of what fits (the built-in workloads, H100 as ``memfit plan`` defaults): ResNet-50 where
only micro-batch 1 fits, ViT-B/16 where nothing does; the costliest plans, every structure settled rung by rung."""


def plans_here(name: str) -> list[dict]:
    """Plan every budget of ``name`` in this process (a fresh one: run by ``main`` through a subprocess)."""
    sys.path.insert(0, str(HERE))
    import sweep_device

    from memfit.errors import BudgetTooSmallError
    from memfit.estimate.gpus import gpu_spec
    from memfit.plan.search import plan
    from memfit.workload.zoo import builtin_workload

    if name in EDGE:
        builtin, effective, budgets = EDGE[name]
        workload, gpu = builtin_workload(builtin), gpu_spec(None)
    else:
        _, _, effective, budgets = sweep_device.WORKLOADS[name]
        workload, gpu = sweep_device._workload(name), gpu_spec("h200")
    out = []
    for gib in budgets:
        started = time.perf_counter()
        try:
            p = plan(workload, budget_bytes=int(gib * 2**30), effective_batch=effective, gpu=gpu,
                     calibration="roofline")
        except BudgetTooSmallError as exc:
            out.append({"budget_gib": gib, "seconds": round(time.perf_counter() - started, 2), "estimates": None,
                        "chosen": None, "plan": str(exc)})
            continue
        seconds = time.perf_counter() - started
        record = p.to_dict()
        record.pop("elapsed_s", None)
        out.append({"budget_gib": gib, "seconds": round(seconds, 2), "estimates": p.estimates,
                    "chosen": p.chosen.config.label(), "plan": record})
    return out


def plans_in_child(name: str, src: Path, *, alone: bool = False) -> list[dict]:
    """``plans_here(name)`` in a fresh process that imports memfit from ``src``; ``alone``: without the lane."""
    return child_json(__file__, "--out", "-", "--one", name, paths=[str(src)],
                      env={"MEMFIT_PLAN_PROCESSES": "1"} if alone else None)


def compare_trees(trees: list[str], names: list[str], rounds: int) -> dict:
    """Plan each workload with each source tree in a fresh process, the trees alternating, ``rounds`` times: a
    before/after of a change on the same machine at the same time (this VM's speed drifts by 2x from day to day)."""
    rows = []
    for r in range(rounds):
        for name in names:
            for tree in trees:
                for got in plans_in_child(name, Path(tree).resolve()):
                    row = {"round": r, "tree": tree, "workload": name, "budget_gib": got["budget_gib"],
                           "seconds": got["seconds"], "estimates": got["estimates"], "chosen": got["chosen"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return {"what": "plan() wall seconds of two source trees, alternating (the lane on), budgets as planning_time.py "
            "plans them (H200; the edge budgets H100), roofline speed model", "trees": trees, "rows": rows}


def lane_and_alone(names: list[str]) -> dict:
    """Plan each workload with the lane and without, in fresh processes, the order alternating."""
    from memfit.plan.lanes import lane_is_useful

    results = []
    for i, name in enumerate(names):
        runs = {mode: plans_in_child(name, ROOT / "src", alone=mode == "alone")
                for mode in (("lane", "alone") if i % 2 == 0 else ("alone", "lane"))}
        for lane, alone in zip(runs["lane"], runs["alone"], strict=True):
            row = {"workload": name, "budget_gib": lane["budget_gib"], "seconds_lane": lane["seconds"],
                   "seconds_alone": alone["seconds"], "estimates": lane["estimates"], "chosen": lane["chosen"],
                   "same_plan": lane["plan"] == alone["plan"]}
            results.append(row)
            print(json.dumps(row), flush=True)
    return {"what": "plan() wall seconds on this CPU, H200 budgets, roofline speed model",
            "lane_used": lane_is_useful(), "rows": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="gpt2,unet2d,vit_b16,unet3d,resnet50@edge,vit_b16@edge")
    parser.add_argument("--trees", help="BEFORE_SRC,AFTER_SRC: time two source trees instead (the lane on), "
                        "workload by workload, alternating, --rounds times")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: plan one workload, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(plans_here(args.one)))
        return
    import torch

    from memfit._io import write_atomic

    names = args.workloads.split(",")
    report = compare_trees(args.trees.split(","), names, args.rounds) if args.trees else lane_and_alone(names)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report.update(cpus=cpus, processor=platform.processor() or platform.machine(),
                  python=platform.python_version(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    write_atomic(args.out, json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
