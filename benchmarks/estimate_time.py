"""Cold estimate time of the accuracy suite, before and after a change, and proof that predictions did not move.

Each estimate runs as ``benchmarks/estimate_accuracy.py predict`` runs it: a fresh ``python -m memfit.cli estimate
benchmarks/workloads.py:NAME --json`` process, so the time includes memfit's first-use costs and the model's own
imports. ``estimate_s`` is the in-process time the CLI reports (``Estimate.elapsed_s``), ``wall_s`` the whole
process. The two source trees run alternately, workload by workload, so that load from other jobs on a shared
machine falls on both alike; the table keeps the fastest repetition of each.

    git archive BASE src | tar -x -C /tmp/base        # the source tree before the change
    python benchmarks/estimate_time.py --before /tmp/base/src --after src --reps 2 --out estimate_time.json

``--zoo`` takes the names from the zoo (``benchmarks/zoo/``) instead of the suite; a ``PYTHONPATH`` already set
comes after the source tree (a library version the GPU has, e.g. timm 1.0.29 in a folder of its own).
``--before src --after src`` times the current tree alone (both columns are then the same code). Committed
results go to ``benchmarks/results/estimate/estimate_time_cpu_torch<X.Y>_<yyyymmdd>.{json,md}``.

Exits with status 1 if any prediction (everything in the Estimate JSON but ``elapsed_s``) differs. A zoo step may
differ in the few-byte events of its model's construction from run to run of the same code (when Python's garbage
collector frees a constructor's temporaries): with ``--zoo`` such a step reads "same peaks", and passes, when its
peaks and bounds agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


_PEAKS = ("peak_allocated_bytes", "peak_reserved_bytes", "fits_in_bytes", "fits_in_upper_bytes")


def _run(src: str, name: str, spec: str, gpu: str) -> dict:
    paths = [str(Path(src).resolve()), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "memfit.cli", "estimate", spec, "--json", "--gpu", gpu],
        capture_output=True, text=True, env=env,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with {src}: {proc.stderr.strip().splitlines()[-1:]}")
    est = json.loads(proc.stdout)
    elapsed = est.pop("elapsed_s")
    return {
        "estimate_s": elapsed, "wall_s": wall, "load_1min": load_before,
        **{k: est.get(k) for k in _PEAKS},
        # everything else the estimate says (breakdown, peak op, timeline...), compared by digest
        "estimate_sha256": hashlib.sha256(json.dumps(est, sort_keys=True).encode()).hexdigest(),
    }


def main() -> None:
    from workloads import SUITE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="src/ directory of the tree before the change")
    parser.add_argument("--after", required=True, help="src/ directory of the tree after the change")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--names", help="comma-separated workloads (default: the whole suite)")
    parser.add_argument("--zoo", action="store_true", help="--names are zoo entries (benchmarks/zoo/)")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--out", help="write every run as JSON here")
    args = parser.parse_args()

    import torch

    if args.zoo:
        if not args.names:
            parser.error("--zoo needs --names")
        sys.path.insert(0, str(HERE / "zoo"))
        from registry import entries

        specs = {e.name: e.spec for e in entries(args.names.split(","))}
    else:
        specs = {name: f"{HERE / 'workloads.py'}:{name}" for name in SUITE}
    names = args.names.split(",") if args.names else SUITE
    runs: dict[str, dict[str, list[dict]]] = {}
    changed = []
    for name in names:
        runs[name] = {"before": [], "after": []}
        for rep in range(args.reps):
            # alternate which tree goes first: the first run of a workload warms the page cache for the second
            for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                runs[name][side].append(_run(getattr(args, side), name, specs[name], args.gpu))
        every = [r for side in ("before", "after") for r in runs[name][side]]
        same = len({r["estimate_sha256"] for r in every}) == 1
        same_peaks = len({tuple(r[k] for k in _PEAKS) for r in every}) == 1
        if not (same_peaks if args.zoo else same):
            changed.append(name)
        best = {side: min(runs[name][side], key=lambda r: r["estimate_s"]) for side in ("before", "after")}
        print(f"| {name} | {best['before']['estimate_s']:.1f} | {best['after']['estimate_s']:.1f} | "
              f"{best['before']['wall_s']:.1f} | {best['after']['wall_s']:.1f} | "
              f"{'identical' if same else 'same peaks' if same_peaks else 'CHANGED'} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "torch": torch.__version__, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "before": args.before, "after": args.after, "gpu": args.gpu, "reps": args.reps, "runs": runs,
        }, indent=1))
    if changed:
        raise SystemExit(f"predictions changed: {', '.join(changed)}")


if __name__ == "__main__":
    main()
