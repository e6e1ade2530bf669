"""The zoo's CPU estimates against its GPU measurements: peak allocated, ``fits_in`` and the upper bound.

    python benchmarks/zoo/report_zoo.py \
        --predictions benchmarks/results/estimate/zoo_predictions_cpu_torch2.14_20261127.json \
        --measurements benchmarks/results/estimate/zoo_measurements_h100_torch2.11_20261127 \
        --logs benchmarks/results/estimate/zoo_measurements_h100_torch2.11_20261127_r1 \
        --out benchmarks/results/estimate/zoo_accuracy_h100_torch2.11_20261127

Measurements come from ``measure_corpus.py --zoo`` (``benchmarks/estimate/device_zoo.sh``): one JSON per entry,
in bytes. ``--logs`` folders hold the printed lines of a call whose JSON files were lost (``peak X GiB, fits in Y
GiB`` to 0.01 GiB): an entry with no JSON is taken from there, and its row says so. Predictions are a
``trace_coverage.py`` JSON (the estimates, made on the CPU). Error = (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from measure_corpus import DONE_LINE  # noqa: E402
from report_corpus import recomputed_upper  # noqa: E402

GIB = 2**30


def _from_logs(folders: list[Path]) -> dict[str, dict[str, Any]]:
    """name -> {peak, fits_in} in bytes from printed lines (a peaks-only line's "fits in" is its peak reserved,
    not a bisection: only a line from a bisecting run, ``zoo_bisect*.log``, gives fits_in)."""
    found: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for log in sorted(folder.glob("*.log")):
            for line in log.read_text().splitlines():
                m = DONE_LINE.match(line)
                if not m:
                    continue
                row = found.setdefault(m.group(1), {"source": f"{folder.name}/{log.name} (0.01 GiB)"})
                row["peak_allocated_bytes"] = round(float(m.group(2)) * GIB)
                if log.name.startswith("zoo_bisect"):
                    row["fits_in_bytes"] = round(float(m.group(3)) * GIB)
    return found


def _measured(folders: list[Path], logs: list[Path]) -> dict[str, dict[str, Any]]:
    """name -> measured peaks from the folders' per-entry JSONs (a later folder's win) or, failing those, logs."""
    found = _from_logs(logs)
    for path in [p for folder in folders for p in sorted(folder.glob("*.json"))]:
        folder = path.parent
        if path.name.endswith(".partial.json"):
            continue
        rec = json.loads(path.read_text())
        row = {"source": f"{folder.name}/{path.name}", "error": rec.get("error") or ""}
        if rec.get("peak_allocated_bytes"):
            row["peak_allocated_bytes"] = rec["peak_allocated_bytes"]
        if rec.get("fits_in_bytes"):
            row["fits_in_bytes"] = rec["fits_in_bytes"]
        elif "fits_in_bytes" in found.get(rec["id"], {}):  # this JSON is peaks only; an earlier log bisected it
            row["fits_in_bytes"] = found[rec["id"]]["fits_in_bytes"]
            row["source"] += " + fits_in from " + found[rec["id"]]["source"]
        found[rec["id"]] = row
    return found


def _err(pred: int | None, meas: int | None) -> float | None:
    return None if not pred or not meas else (pred - meas) / meas


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_abs": statistics.median(abs(v) for v in values),
            "max_abs": max(abs(v) for v in values), "most_negative": min(values), "median_signed": statistics.median(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictions", required=True)
    parser.add_argument("--measurements", required=True)
    parser.add_argument("--also", action="append", default=[],
                        help="another folder of per-entry JSONs, read after --measurements (its entries win)")
    parser.add_argument("--logs", action="append", default=[])
    parser.add_argument("--out", required=True, help="path without suffix: .md and .json are written")
    parser.add_argument("--title", default="")
    parser.add_argument("--only", default="", help="only entries whose name starts with this (e.g. h2_: one draw)")
    parser.add_argument("--note", default="", help="a paragraph under the header (which set, which code)")
    parser.add_argument("--rebound", action="store_true",
                        help="recompute each upper bound with the installed memfit's constants (memfit.estimate.bound)")
    args = parser.parse_args()

    preds = json.loads(Path(args.predictions).read_text())
    measured = _measured([Path(args.measurements), *map(Path, args.also)], [Path(p) for p in args.logs])
    card = (Path(args.measurements) / "card.txt").read_text().split("\n")[0] \
        if (Path(args.measurements) / "card.txt").exists() else "?"
    rows = []
    for r in [r for r in preds["rows"] if r["name"].startswith(args.only)]:
        est, meas = r.get("estimate") or {}, measured.get(r["name"], {})
        if args.rebound and est.get("fits_in_replay_bytes"):
            est = {**est, "fits_in_upper_bytes": recomputed_upper(est)}
        rows.append({
            "name": r["name"], "library": r["library"],
            "reasons": [u["reason"] for u in est.get("uncertainty", [])],
            "pred_peak": est.get("peak_allocated_bytes"), "meas_peak": meas.get("peak_allocated_bytes"),
            "pred_fits_in": est.get("fits_in_bytes"), "meas_fits_in": meas.get("fits_in_bytes"),
            "pred_upper": est.get("fits_in_upper_bytes"),
            "peak_err": _err(est.get("peak_allocated_bytes"), meas.get("peak_allocated_bytes")),
            "fits_in_err": _err(est.get("fits_in_bytes"), meas.get("fits_in_bytes")),
            "upper_err": _err(est.get("fits_in_upper_bytes"), meas.get("fits_in_bytes")),
            "source": meas.get("source", "not measured"), "gpu_error": meas.get("error", ""),
        })
    summary = {
        "card": card, "predictions": args.predictions, "measurements": args.measurements, "also": args.also, "logs": args.logs,
        "entries": len(rows), "peak_allocated": _stats([r["peak_err"] for r in rows if r["peak_err"] is not None]),
        "fits_in": _stats([r["fits_in_err"] for r in rows if r["fits_in_err"] is not None]),
        "upper": {"holds": sum(1 for r in rows if r["upper_err"] is not None and r["upper_err"] >= 0),
                  "n": sum(1 for r in rows if r["upper_err"] is not None),
                  "median_above": statistics.median([r["upper_err"] for r in rows if r["upper_err"] is not None]
                                                    or [0.0])},
        "failed_on_gpu": {r["name"]: r["gpu_error"][:200] for r in rows if r["gpu_error"]},
        "note": args.note,
    }
    Path(f"{args.out}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(_markdown(summary, rows, args.title))
    print(Path(f"{args.out}.md").read_text()[:3000])


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


def _gib(x: int | None) -> str:
    return "—" if not x else f"{x / GIB:.2f}"


def _markdown(s: dict[str, Any], rows: list[dict[str, Any]], title: str) -> str:
    p, f, u = s["peak_allocated"], s["fits_in"], s["upper"]
    out = [f"# {title or 'memfit estimate on the zoo'} ({s['card']})", "",
           f"Predictions: `{s['predictions']}`. Measurements: `{s['measurements']}`"
           + "".join(f", then `{a}` (its entries win)" for a in s.get("also", []))
           + (f", and the printed lines of `{'`, `'.join(s['logs'])}` where an entry has no JSON" if s["logs"] else "")
           + ". Error = (predicted − measured) / measured.", "",
           *([s["note"], ""] if s.get("note") else []),
           "| metric | n | median abs | max abs | most negative | median signed |", "|---|---|---|---|---|---|"]
    for label, st in (("peak allocated", p), ("fits_in", f)):
        if st["n"]:
            out.append(f"| {label} | {st['n']} | {_pct(st['median_abs'])} | {_pct(st['max_abs'])} | "
                       f"{_pct(st['most_negative'])} | {_pct(st['median_signed'])} |")
    out += ["", f"Upper bound (`fits_in_upper_bytes`) at or above the measured fits_in on {u['holds']} of {u['n']}; "
            f"median {_pct(u['median_above'])} above.", ""]
    if s["failed_on_gpu"]:
        out += ["Failed on the GPU (not a memory error):", ""]
        out += [f"- `{k}`: {v}" for k, v in s["failed_on_gpu"].items()] + [""]
    out += ["| entry | library | reasons | alloc pred / meas GiB | err | fits-in pred / meas GiB | err | upper err | "
            "measured from |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["peak_err"] is None, r["peak_err"] or 0)):
        out.append(f"| {r['name']} | {r['library']} | {', '.join(r['reasons'])} | {_gib(r['pred_peak'])} / "
                   f"{_gib(r['meas_peak'])} | {_pct(r['peak_err'])} | {_gib(r['pred_fits_in'])} / "
                   f"{_gib(r['meas_fits_in'])} | {_pct(r['fits_in_err'])} | {_pct(r['upper_err'])} | {r['source']} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
