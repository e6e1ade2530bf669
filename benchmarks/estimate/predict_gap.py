"""Estimate the issue-13 gap cases in both loops and compare with their H200 measurements.

    python benchmarks/estimate/predict_gap.py      # CPU; needs segmentation-models-pytorch and MONAI installed

Reads ``results/estimate/gap_cases_h200_*.json`` (``diagnose_gap.py``) and writes
``results/estimate/gap_cases_predictions_cpu_torch<x.y>_<date>.json``. These cases are *fit* data: the RNN rules
were checked against them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import RESULTS, card, stem  # noqa: E402


def main() -> None:
    import torch

    measured_file = sorted((RESULTS / "estimate").glob("gap_cases_h200_*.json"))[-1]
    measured = json.loads(measured_file.read_text())
    rows = []
    for m in measured["rows"]:
        cmd = [sys.executable, "-m", "memfit.cli", "estimate", f"{HERE / 'gap_cases.py'}:{m['name']}", "--json",
               "--gpu", "h200"] + ([] if m["keep_output"] else ["--drop-output"])
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
    out = RESULTS / "estimate" / f"{stem('gap_cases_predictions', card(None), torch.__version__)}.json"
    out.write_text(json.dumps({"measured": measured_file.name, "torch": torch.__version__, "set": "fit",
                               "rows": rows}, indent=1))
    print("->", out)


if __name__ == "__main__":
    main()
