"""Accuracy of ``memfit estimate`` against ``memfit measure`` on a real GPU.

Three stages, because estimates must be timed on the 2-core CPU machine and measurements need the GPU:

    python benchmarks/estimate_accuracy.py predict        # CPU machine
    python benchmarks/estimate_accuracy.py measure        # GPU machine
    python benchmarks/estimate_accuracy.py report         # any machine: merge the two into the results files

``predict`` writes ``results/estimate/predictions_cpu_torch<X.Y>_<yyyymmdd>/<name>.json``; ``measure`` reads the
newest such folder (for each workload's bisection start) and writes
``results/estimate/measurements_<card>_torch<X.Y>_<yyyymmdd>/measured_<name>.json`` (into ``$OUT`` when set, as on
the device machine: copy it there); ``report`` reads the newest of each (``--predictions``/``--measurements`` pick
others) and writes ``results/estimate/estimate_accuracy_<card>_torch<X.Y>_<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import RESULTS, card, latest, stem  # noqa: E402


def _suite(names: str | None) -> list[str]:
    from workloads import SUITE

    chosen = SUITE if not names else names.split(",")
    return chosen


def predict(args: argparse.Namespace) -> None:
    """Estimate every workload in a fresh process; record the estimate and its wall time."""
    out = Path(args.out or RESULTS / "estimate" / stem("predictions", "cpu", _torch_version()))
    out.mkdir(parents=True, exist_ok=True)
    for name in _suite(args.names):
        spec = f"{HERE / 'workloads.py'}:{name}"
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "memfit.cli", "estimate", spec, "--json", "--gpu", args.gpu],
            capture_output=True, text=True,
        )
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            print(f"{name}: FAILED {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            (out / f"{name}.json").write_text(json.dumps({"name": name, "error": proc.stderr[-2000:]}))
            continue
        est = json.loads(proc.stdout)
        record = {
            "name": name,
            "wall_s": wall,
            "estimate_s": est["elapsed_s"],
            "torch": _torch_version(),
            "machine": f"{os.cpu_count()} CPU cores",
            "estimate": {k: est[k] for k in (
                "peak_allocated_bytes", "peak_reserved_bytes", "fits_in_bytes", "fits_in_replay_bytes",
                "device_bytes", "breakdown",
                "peak_phase", "peak_step", "peak_op", "batch_size", "precision", "param_count", "warnings")},
        }
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
        print(f"{name}: allocated {est['peak_allocated_bytes'] / 2**20:.1f} MiB, fits in "
              f"{est['fits_in_bytes'] / 2**20:.1f} MiB, {est['elapsed_s']:.1f} s in-process, {wall:.1f} s wall",
              flush=True)


def _torch_version() -> str:
    import torch

    return torch.__version__


def measure(args: argparse.Namespace) -> None:
    """Measure every workload on the GPU: uncapped run (+ snapshot), then cap bisection."""
    import torch

    from memfit.estimate.measure import measure as run_measure

    out = Path(args.out or os.environ.get("OUT") or RESULTS / "estimate" / stem(
        "measurements", card(torch.cuda.get_device_name(0)), torch.__version__))
    out.mkdir(parents=True, exist_ok=True)
    for name in _suite(args.names):
        spec = f"{HERE / 'workloads.py'}:{name}"
        hint = None
        pred_file = Path(args.predictions) / f"{name}.json" if args.predictions else None
        if pred_file and pred_file.exists():
            hint = json.loads(pred_file.read_text()).get("estimate", {}).get("fits_in_bytes")
        started = time.perf_counter()
        try:
            trace = str(out / f"trace_{name}.json.gz") if args.traces else None
            m = run_measure(spec, bisect=not args.no_bisect, hint_bytes=hint, tolerance=args.tolerance,
                            trace=trace)
        except Exception as exc:  # record and go on: one broken workload must not lose the others
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            (out / f"measured_{name}.json").write_text(json.dumps({"name": name, "error": str(exc)}))
            continue
        record = {"name": name, "measure_wall_s": time.perf_counter() - started, **m.to_dict()}
        (out / f"measured_{name}.json").write_text(json.dumps(record, indent=1))
        print(f"{name}: allocated {m.peak_allocated_bytes / 2**20:.1f} MiB reserved "
              f"{m.peak_reserved_bytes / 2**20:.1f} MiB fits in "
              f"{(m.fits_in_bytes or 0) / 2**20:.1f} MiB outside {m.outside_allocator_bytes / 2**20:.1f} MiB "
              f"({len(m.trials)} trials, {time.perf_counter() - started:.0f} s)", flush=True)


def _err(pred: int, meas: int | None) -> float | None:
    return None if not meas else (pred - meas) / meas


def report(args: argparse.Namespace) -> None:
    preds = {p.stem: json.loads(p.read_text()) for p in Path(args.predictions).glob("*.json")}
    meas = {p.stem.removeprefix("measured_"): json.loads(p.read_text())
            for p in Path(args.measurements).glob("measured_*.json")}
    rows = []
    for name in _suite(args.names):
        p, m = preds.get(name), meas.get(name)
        if not p or not m or "error" in p or "error" in m:
            rows.append({"name": name, "missing": True,
                         "error": (p or {}).get("error", "")[-300:] or (m or {}).get("error", "")})
            continue
        e = p["estimate"]
        rows.append({
            "name": name,
            "precision": e["precision"],
            "batch_size": e["batch_size"],
            "predicted_allocated": e["peak_allocated_bytes"],
            "measured_allocated": m["peak_allocated_bytes"],
            "error_allocated": _err(e["peak_allocated_bytes"], m["peak_allocated_bytes"]),
            "predicted_reserved": e["peak_reserved_bytes"],
            "measured_reserved": m["peak_reserved_bytes"],
            "error_reserved": _err(e["peak_reserved_bytes"], m["peak_reserved_bytes"]),
            "predicted_fits_in": e["fits_in_bytes"],
            "measured_fits_in": m["fits_in_bytes"],
            "error_fits_in": _err(e["fits_in_bytes"], m["fits_in_bytes"]),
            "predicted_fits_in_replay": e["fits_in_replay_bytes"],
            "error_fits_in_replay": _err(e["fits_in_replay_bytes"], m["fits_in_bytes"]),
            "measured_outside_allocator": m["outside_allocator_bytes"],
            "estimate_s": p["estimate_s"],
            "estimate_wall_s": p["wall_s"],
            "estimate_torch": p["torch"],
        })
    ok = [r for r in rows if not r.get("missing")]

    def stats(key: str) -> dict[str, float | None]:
        vals = [abs(r[key]) for r in ok if r.get(key) is not None]
        signed = [r[key] for r in ok if r.get(key) is not None]
        if not vals:
            return {"median_abs": None, "max_abs": None, "min_signed": None, "n": 0}
        return {"median_abs": statistics.median(vals), "max_abs": max(vals), "min_signed": min(signed),
                "n": len(vals)}

    any_m = next(iter(meas.values()), {})
    summary = {
        "gpu": any_m.get("gpu"), "gpu_total_bytes": any_m.get("total_bytes"),
        "torch_measure": any_m.get("torch_version"), "cuda": any_m.get("cuda_version"),
        "date": dt.date.today().isoformat(),
        "allocated": stats("error_allocated"), "reserved": stats("error_reserved"), "fits_in": stats("error_fits_in"),
        "fits_in_replay": stats("error_fits_in_replay"),
        "max_estimate_s": max((r["estimate_s"] for r in ok), default=None),
        "max_estimate_wall_s": max((r["estimate_wall_s"] for r in ok), default=None),
    }
    name = stem("estimate_accuracy", card(summary["gpu"]), summary["torch_measure"] or "")
    (Path(args.results) / f"{name}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    text = _markdown(summary, rows) + (f"\n{args.note}\n" if args.note else "")
    (Path(args.results) / f"{name}.md").write_text(text)
    print(text)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _mib(x: int | None) -> str:
    return "—" if not x else f"{x / 2**20:,.0f}"


def _markdown(summary: dict, rows: list[dict]) -> str:
    s = summary
    lines = [
        f"# memfit estimate accuracy on {s['gpu']} ({s['date']})",
        "",
        f"Measured with torch {s['torch_measure']} (CUDA {s['cuda']}); estimates on a 2-core CPU machine without "
        "a GPU (torch version per row). Protocol: model + optimizer built on the GPU from an empty allocator, "
        "3 training steps; `fits in` = smallest `set_per_process_memory_fraction` cap that ran, by bisection "
        "(0.5 % of peak), each try in a fresh process. Error = (predicted - measured) / measured. "
        "`fits_in` is memfit's answer (replay + 1.5 % placement margin); `fits_in_replay` is the allocator replay "
        "alone. The margin was set after seeing this suite's replay errors, so the suite does not test it "
        "independently. The cuDNN/kernel scratch rules were fitted on a separate shape grid "
        "(cudnn_calibration_*.json) and on per-op transients of these same workloads (transients_*.json); "
        "docs/estimate.md gives the errors before those rules.",
        "",
        "| metric | median abs error | max abs error | most negative (under-prediction) | n |",
        "|---|---|---|---|---|",
    ]
    for key in ("allocated", "reserved", "fits_in", "fits_in_replay"):
        st = s[key]
        lines.append(f"| peak {key} | {_pct(st['median_abs'])} | {_pct(st['max_abs'])} | "
                     f"{_pct(st['min_signed'])} | {st['n']} |")
    lines += [
        "",
        f"Slowest estimate: {s['max_estimate_s'] or 0:.1f} s in-process, {s['max_estimate_wall_s'] or 0:.1f} s "
        "as a fresh `memfit estimate` process including imports.",
        "",
        "| workload | prec | batch | alloc pred MiB | alloc meas MiB | err | reserved pred | reserved meas | err | "
        "fits-in pred | fits-in meas | err | est s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['name']} | failed: {str(r.get('error', ''))[:80]} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['name']} | {r['precision']} | {r['batch_size']} | {_mib(r['predicted_allocated'])} | "
            f"{_mib(r['measured_allocated'])} | {_pct(r['error_allocated'])} | {_mib(r['predicted_reserved'])} | "
            f"{_mib(r['measured_reserved'])} | {_pct(r['error_reserved'])} | {_mib(r['predicted_fits_in'])} | "
            f"{_mib(r['measured_fits_in'])} | {_pct(r['error_fits_in'])} | {r['estimate_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--out", help="default: results/estimate/predictions_cpu_torch<X.Y>_<today>")
    p.add_argument("--names")
    p.add_argument("--gpu", default="h100")
    m = sub.add_parser("measure")
    m.add_argument("--out", help="default: $OUT, else results/estimate/measurements_<card>_torch<X.Y>_<today>")
    m.add_argument("--predictions", default=str(latest("estimate", "predictions_")))
    m.add_argument("--names")
    m.add_argument("--no-bisect", action="store_true")
    m.add_argument("--tolerance", type=float, default=0.005)
    m.add_argument("--traces", action="store_true", help="also save the allocator trace of the uncapped run")
    r = sub.add_parser("report")
    r.add_argument("--predictions", default=str(latest("estimate", "predictions_")))
    r.add_argument("--measurements", default=str(latest("estimate", "measurements_")),
                   help="default: the newest measurements folder of any card; name the card's folder to pick one")
    r.add_argument("--results", default=str(RESULTS / "estimate"))
    r.add_argument("--names")
    r.add_argument("--note", help="a paragraph to add under the table (e.g. what was measured when)")
    args = parser.parse_args()
    {"predict": predict, "measure": measure, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
