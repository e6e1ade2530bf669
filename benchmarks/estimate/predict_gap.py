"""Estimate the issue-13 gap cases in both loops (or the fit-side probes) and compare with their H200 measurements.

    python benchmarks/estimate/predict_gap.py      # CPU; needs segmentation-models-pytorch and MONAI installed
    python benchmarks/estimate/predict_gap.py --cases probe_cases.py   # the probes, each in its own loop

Reads ``results/estimate/gap_cases_h200_*.json`` (``diagnose_gap.py``) and writes
``results/estimate/gap_cases_predictions_cpu_torch<x.y>_<date>.json``. These cases are *fit* data: the RNN rules
were checked against them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import RESULTS, card, stem  # noqa: E402


def _probe_measurements() -> tuple[list[str], list[dict]]:
    """Every probe's H200 measurement: diagnose_gap.py's rows, and `memfit measure` JSON for one whose allocator
    trace could not be recorded (p_enc_fp32_ckpt: the trace's run stopped in backward with a SystemError)."""
    files = sorted((RESULTS / "estimate").glob("gap_probes*_h200_*.json"))
    rows = [r for f in files for r in json.loads(f.read_text())["rows"] if not r.get("error")]
    for f in sorted((RESULTS / "estimate").glob("probe_*_measure_h200_*.json")):
        m = json.loads(f.read_text())
        rows.append({**m, "name": m["workload"].rpartition(":")[2], "keep_output": None})
        files.append(f)
    return [f.name for f in files], rows


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gap_cases.py", choices=("gap_cases.py", "probe_cases.py"))
    args = parser.parse_args()
    if args.cases == "gap_cases.py":
        measured_file = sorted((RESULTS / "estimate").glob("gap_cases_h200_*.json"))[-1]
        names, measured_rows = [measured_file.name], json.loads(measured_file.read_text())["rows"]
    else:
        names, measured_rows = _probe_measurements()
    rows = []
    for m in measured_rows:
        loop = [] if m["keep_output"] in (None, True) else ["--drop-output"]  # None: the probe's own loop
        cmd = [sys.executable, "-m", "memfit.cli", "estimate", f"{HERE / args.cases}:{m['name']}", "--json",
               "--gpu", "h200", *loop]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"name": m["name"], "keep_output": m["keep_output"], "error": proc.stderr.strip()[-300:]})
            continue
        e = json.loads(proc.stdout)
        row = {"name": m["name"], "keep_output": m["keep_output"], "elapsed_s": e["elapsed_s"],
               "uncertainty": [u["reason"] for u in e["uncertainty"]]}
        for key, field in (("allocated", "peak_allocated_bytes"), ("fits_in", "fits_in_bytes")):
            row[f"predicted_{key}"], row[f"measured_{key}"] = e[field], m[field]
            row[f"error_{key}"] = e[field] / m[field] - 1
        row["predicted_upper"] = e["fits_in_upper_bytes"]
        row["error_upper"] = e["fits_in_upper_bytes"] / m["fits_in_bytes"] - 1
        rows.append(row)
        print(m["name"], m["keep_output"], {k: round(v, 3) for k, v in row.items() if k.startswith("error")})
    kind = "gap_cases" if args.cases == "gap_cases.py" else "probes"
    out = RESULTS / "estimate" / f"{stem(kind + '_predictions', card(None), torch.__version__)}.json"
    out.write_text(json.dumps({"measured": names, "torch": torch.__version__, "set": "fit", "rows": rows}, indent=1))
    print("->", out)


if __name__ == "__main__":
    main()
