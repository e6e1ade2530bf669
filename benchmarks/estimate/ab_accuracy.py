"""Predictions of two source trees beside GPU measurements: did a change move the estimate toward the GPU?

    git worktree add /tmp/before HEAD                      # the tree before the change
    python benchmarks/estimate/ab_accuracy.py --before /tmp/before/src --after src --gpu h100 \
        --names timm_convnext_tiny,hf_wav2vec2_ctc --measured benchmarks/results/estimate/zoo_measurements_h100_* \
        --out ab.json
    python benchmarks/estimate/ab_accuracy.py ... --corpus --names c012_...,c077_...    # corpus ids

Each entry is estimated once per tree (``python -m memfit.cli estimate SPEC --json --gpu GPU``, a fresh process,
the two trees side by side), and set beside the measured peak allocated and ``fits_in`` of the last
``--measured`` folder that has ``NAME.json``. A ``PYTHONPATH`` already set comes after the source tree (the GPU's
timm and transformers). CPU only.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path.insert(0, str(BENCH))

from estimate_time import _run  # noqa: E402


def _estimate(src: str, spec: str, gpu: str) -> dict:
    """One fresh ``memfit estimate`` process (``estimate_time._run``, which also times it); a failure is a row."""
    try:
        return _run(src, spec, spec, gpu)
    except SystemExit as exc:
        return {"error": str(exc)}


def _measured(name: str, folders: list[str]) -> dict | None:
    found = None
    for folder in folders:
        path = Path(folder) / f"{name}.json"
        if path.exists():
            m = json.loads(path.read_text())
            if m.get("fits_in_bytes"):
                found = {"peak_allocated_bytes": m["peak_allocated_bytes"], "fits_in_bytes": m["fits_in_bytes"],
                         "from": str(path)}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--names", required=True, help="comma-separated zoo entries or corpus ids")
    parser.add_argument("--corpus", action="store_true", help="the names are corpus ids (benchmarks/corpus/)")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--measured", nargs="+", default=[], help="measurement folders, later ones win")
    parser.add_argument("--out", required=True, help="a JSON file")
    args = parser.parse_args()
    names = args.names.split(",")
    if args.corpus:
        specs = {n: f"{BENCH / 'corpus' / 'corpus.py'}:{n}" for n in names}
    else:
        sys.path.insert(0, str(BENCH / "zoo"))
        from registry import entries

        specs = {e.name: e.spec for e in entries(names)}
    rows = {}
    with cf.ThreadPoolExecutor(2) as pool:
        for name in names:
            before, after = pool.map(_estimate, (args.before, args.after), [specs[name]] * 2, [args.gpu] * 2)
            measured = _measured(name, args.measured)
            row = {"before": before, "after": after, "measured": measured}
            if measured and "error" not in before and "error" not in after:
                for key in ("peak_allocated_bytes", "fits_in_bytes"):
                    for side in ("before", "after"):
                        row[f"{side}_{key}_err"] = row[side][key] / measured[key] - 1
                row["before_upper_covers"] = before["fits_in_upper_bytes"] >= measured["fits_in_bytes"]
                row["after_upper_covers"] = after["fits_in_upper_bytes"] >= measured["fits_in_bytes"]
            rows[name] = row
            errs = " ".join(f"{k}={100 * v:+.2f}%" for k, v in row.items() if k.endswith("_err"))
            print(name, errs or {k: v for k, v in row.items()}, flush=True)
            Path(args.out).write_text(json.dumps({"gpu": args.gpu, "before": args.before, "after": args.after,
                                                  "rows": rows}, indent=1))
    done = [r for r in rows.values() if "after_fits_in_bytes_err" in r]
    for key in ("peak_allocated_bytes", "fits_in_bytes"):
        for side in ("before", "after"):
            errs = [abs(r[f"{side}_{key}_err"]) for r in done]
            if errs:
                print(f"{side} {key}: median |err| {100 * statistics.median(errs):.2f} %, max {100 * max(errs):.2f} %")


if __name__ == "__main__":
    main()
