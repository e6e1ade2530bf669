"""How much a second process on this machine's other CPU really gives: the ceiling of the planner's lane.

The planner's lane (``memfit.plan.lanes``) traces in a forked child on the second CPU while the planner traces on
the first. A trace is pure-Python work (fake tensors compute nothing), so its ceiling is how fast two Python
processes run side by side against one alone. On a virtual machine two vCPUs can share one physical core (SMT
siblings) or a busy host, and then the second process slows the first.

    python benchmarks/plan/cpu_parallelism.py --rounds 5 --out benchmarks/results/plan/cpu_parallelism_<date>.json

Each round times one loop alone, then two at once (separate processes, started together); the rounds alternate so
that a drift of the machine falls on both. ``throughput`` is two loops' work over the slower pair's time, against
one loop's work over its time alone: 2.0 where the CPUs are independent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

_LOOP = "import time\nt = time.perf_counter()\nx = 0\nfor i in range({n}): x += i\nprint(time.perf_counter() - t)"


def _start(n: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _LOOP.format(n=n)], stdout=subprocess.PIPE, text=True)


def _seconds(procs: list[subprocess.Popen[str]]) -> list[float]:
    return [float(p.communicate()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20_000_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    rounds = []
    for _ in range(args.rounds):
        alone = _seconds([_start(args.iterations)])[0]
        pair = _seconds([_start(args.iterations), _start(args.iterations)])
        rounds.append({"alone_s": round(alone, 3), "pair_s": [round(s, 3) for s in pair],
                       "throughput": round(2 * alone / max(pair), 2)})
        print(rounds[-1], flush=True)
    report = {
        "what": "a pure-Python loop alone and two at once in separate processes (the ceiling of the plan's lane)",
        "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "iterations": args.iterations, "rounds": rounds,
        "median_throughput": round(statistics.median(r["throughput"] for r in rounds), 2),
    }
    print(f"median throughput of two processes: {report['median_throughput']}x one alone (2.0 = independent CPUs)")
    if args.out:
        from memfit._io import write_atomic

        write_atomic(Path(args.out), json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
