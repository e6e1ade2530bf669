"""Estimate time and result of the zoo's detectors before and after a change to memfit's real forward.

Each detector is estimated by ``python -m memfit.cli estimate SPEC --json`` in a fresh process, one at a time, the
two source trees alternating round by round (``--before`` is a ``src`` folder, e.g. from ``git archive``; the
other is this checkout's). Reports the in-process seconds (the estimate's ``elapsed_s``, which includes building
the model) and the numbers the change may move: peak allocated, fits_in and its upper bound.

    python benchmarks/estimate/detection_stand_ins.py --before /tmp/base/src --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
from _results import RESULTS, stem  # noqa: E402

DETECTORS = tuple(f"benchmarks/zoo/torchvision_models.py:{name}" for name in (
    "tv_fasterrcnn_resnet50_fpn", "tv_fasterrcnn_mobilenet", "tv_maskrcnn_resnet50_fpn", "tv_retinanet_resnet50_fpn",
    "tv_ssdlite"))


def estimate(spec: str, src: Path, gpu: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", spec, "--json", "--gpu", gpu],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    est = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"process_wall_s": round(wall, 2), "elapsed_s": round(est["elapsed_s"], 2),
            "peak_allocated_bytes": est["peak_allocated_bytes"], "fits_in_bytes": est["fits_in_bytes"],
            "fits_in_upper_bytes": est.get("fits_in_upper_bytes"),
            "sized_from": [w for w in est["warnings"] if "whose output size depends" in w][:1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the src folder of the tree to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--specs", help="comma-separated FILE:NAME (default: the zoo's five detectors)")
    parser.add_argument("--out", type=Path, default=RESULTS / "estimate")
    args = parser.parse_args()
    import torch

    specs = args.specs.split(",") if args.specs else DETECTORS
    trees = {"before": args.before.resolve(), "after": REPO / "src"}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for spec in specs:
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for tree in order:
                row = {"spec": spec, "tree": tree, "round": r, **estimate(spec, trees[tree], args.gpu)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    lines = [
        "# Detectors' estimate time, before and after (2-core CPU, no GPU)", "",
        f"torch {torch.__version__}; one estimate at a time, fresh process each, trees alternating round by round "
        f"({args.rounds} rounds). `elapsed_s` is the estimate's in-process time (building the model included); "
        "MB = 10⁶ bytes. Script: `benchmarks/estimate/detection_stand_ins.py`.", "",
        "| detector | before s (median) | after s (median) | before peak / fits_in / bound MB | "
        "after peak / fits_in / bound MB |", "|---|---|---|---|---|",
    ]
    for spec in specs:
        cells = []
        for tree in ("before", "after"):
            done = [x for x in rows if x["spec"] == spec and x["tree"] == tree and "error" not in x]
            cells.append(done)
        if not all(cells):
            lines.append(f"| {spec.split(':')[1]} | failed | | | |")
            continue

        def numbers(done: list[dict[str, Any]]) -> str:
            last = done[-1]
            return " / ".join(f"{last[k] / 1e6:,.0f}" for k in ("peak_allocated_bytes", "fits_in_bytes",
                                                                  "fits_in_upper_bytes"))

        lines.append(f"| {spec.split(':')[1]} | {statistics.median(x['elapsed_s'] for x in cells[0]):.1f} | "
                     f"{statistics.median(x['elapsed_s'] for x in cells[1]):.1f} | {numbers(cells[0])} | "
                     f"{numbers(cells[1])} |")
    name = stem("detection_stand_ins", "cpu", torch.__version__)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / name}.{{json,md}}")


if __name__ == "__main__":
    main()
