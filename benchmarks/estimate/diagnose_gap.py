"""Measure the issue-13 gap cases on a GPU with the allocator's event stream, to compare with their traces.

    python benchmarks/estimate/diagnose_gap.py --out $OUT -j 4       # on the GPU machine

For each case (``gap_cases.py``) and loop (plain, loss-only): the uncapped run with its compact allocator trace
(``memfit.estimate.measure``'s ``--trace``: action, address, size and the top Python frame of every event) and
the bisected smallest cap. Cases run side by side, each in its own processes (each caps only its own allocator).
Writes ``gap_<gpu>.json`` and ``gap_traces_<gpu>.tar.gz``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import json
import os
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES: list[tuple[str, bool | None]] = [
    ("smp_unet_r34_ce2", False), ("swin_unetr_ce14", False), ("bigru_1000", False),
    ("lstm_lm_plain_loop", True), ("lstm_lm_plain_loop", False),
]


def _one(name: str, keep: bool | None, folder: Path, cases: str) -> dict:
    from memfit.estimate.measure import measure

    trace = folder / f"{name}_{'own' if keep is None else 'plain' if keep else 'lossonly'}.json.gz"
    try:
        changes = None if keep is None else {"keep_output": keep}
        m = measure(f"{HERE / cases}:{name}", trace=str(trace), changes=changes)
    except Exception as exc:  # a case that cannot run here is reported, not fatal
        return {"name": name, "keep_output": keep, "error": f"{type(exc).__name__}: {exc}"}
    d = dataclasses.asdict(m)
    d.pop("trials", None)
    return {"name": name, "keep_output": keep, **d, "trials": len(m.trials)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("-j", type=int, default=4)
    parser.add_argument("--cases", default="gap_cases.py",
                        help="probe_cases.py: its probes, each in its own loop (the files' output names say which)")
    parser.add_argument("--only", help="comma-separated probe names")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.get_device_properties(0).name
    slug = gpu.lower().replace("nvidia", "").strip().split()[0]
    folder = Path(tempfile.mkdtemp())
    with cf.ThreadPoolExecutor(args.j) as pool:
        if args.cases == "gap_cases.py":
            cases: list[tuple[str, bool | None]] = list(CASES)
        else:
            from probe_cases import PROBES  # noqa: PLC0415 (the probes only)

            cases = [(name, None) for name in PROBES if not args.only or name in args.only.split(",")]
        rows = list(pool.map(lambda c: _one(c[0], c[1], folder, args.cases), cases))
    out = Path(args.out)
    slug = slug if args.cases == "gap_cases.py" else f"probes_{slug}"
    result = {"gpu": gpu, "torch": torch.__version__, "date": dt.date.today().isoformat(), "rows": rows}
    (out / f"gap_{slug}.json").write_text(json.dumps(result, indent=1))
    with tarfile.open(out / f"gap_traces_{slug}.tar.gz", "w:gz") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f.name)
    for r in rows:
        print(r["name"], r["keep_output"], r.get("peak_allocated_bytes"), r.get("fits_in_bytes"), r.get("error", ""))


if __name__ == "__main__":
    main()
