"""Three real cases for ``memfit explain``, checked on a GPU: does the explanation match what the GPU does?

For each case (examples/explain/*.py with a budget):
1. ``explain()`` on the CPU machine (``predict``): the diagnosis, the fixes, the report and PNGs;
2. a phase profile of the real step (allocated memory at each phase boundary and the peak inside each phase),
   which says measured what the peak is made of and when it happens;
3. the step under the budget (allocator cap = budget - the CUDA context measured in the uncapped run): the
   original must run out of memory, the cheapest fix that the explanation says fits must run;
4. the top fix measured (peak allocated, and the smallest cap by bisection) against its prediction.

    python benchmarks/explain_cases.py predict --out examples/explain/reports   # CPU machine
    python benchmarks/explain_cases.py measure --predictions examples/explain/reports --out $OUT   # GPU

``measure`` writes ``explain_cases_<card>_torch<X.Y>_<yyyymmdd>.json``; committed results go to
``benchmarks/results/explain/`` with a markdown summary beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, stem  # noqa: E402

CASES = [
    ("satellite_unet", "6GiB"),
    ("nnunet_3d", "12GiB"),
    ("gpt_medium", "7GiB"),
]
_TRAINING_COST = {"no": 0, "numerics": 1, "semantics": 2}


def profile_phases(spec: str, changes: dict) -> dict:
    """Run the protocol once and record, per phase, allocated memory at its start and the peak inside it."""
    import torch

    from memfit.estimate.measure import _apply_changes
    from memfit.workload.loading import load_workload
    from memfit.workload.protocol import build, run_steps

    w = load_workload(spec)
    if changes:
        w = _apply_changes(w, changes)
    torch.cuda.init()
    rows: list[dict] = []

    def phase(name: str, step: int) -> None:
        torch.cuda.synchronize()
        if rows:
            rows[-1]["peak_bytes"] = torch.cuda.max_memory_allocated()
            rows[-1]["end_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        rows.append({"phase": name, "step": step, "start_bytes": torch.cuda.memory_allocated()})

    model, optimizer, batch = build(w, "cuda", phase=phase)
    scaler = torch.amp.GradScaler("cuda") if w.precision == "fp16" else None
    run_steps(w, model, optimizer, batch, autocast_device="cuda", scaler=scaler, phase=phase)
    torch.cuda.synchronize()
    rows[-1]["peak_bytes"] = rows[-1]["end_bytes"] = torch.cuda.memory_allocated()
    peak = max(rows, key=lambda r: r["peak_bytes"])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v))
    forward = [r for r in rows if r["phase"] == "forward" and r["step"] == 1]
    loss_end = [r for r in rows if r["phase"] == "loss" and r["step"] == 1]
    return {
        "phases": rows,
        "peak_phase": peak["phase"],
        "peak_step": peak["step"],
        "peak_allocated_bytes": peak["peak_bytes"],
        "params_bytes": params,
        "optimizer_state_bytes": state,
        # what forward leaves alive for backward (step 2: the steady state)
        "activations_bytes": loss_end[0]["end_bytes"] - forward[0]["start_bytes"] if forward and loss_end else None,
    }


def _profile_in_subprocess(spec: str, changes: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "profile", "--spec", spec, "--changes", json.dumps(changes)],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": proc.stderr[-1500:]}
    return json.loads(lines[-1])


def predict_case(name: str, budget: str, out: Path) -> None:
    from memfit.explain.explanation import explain
    from memfit.units import parse_bytes
    from memfit.workload.loading import load_workload

    spec = str(ROOT / "examples" / "explain" / f"{name}.py")
    e = explain(load_workload(spec), gpu="h100", budget_bytes=parse_bytes(budget))
    (out / f"{name}.explanation.json").write_text(e.to_json(indent=1))
    from memfit.report.html import write_pngs, write_report

    write_report(e, out / f"{name}.html")
    write_pngs(e, out / f"{name}_png")
    print(f"{name}: {e.headline} ({e.elapsed_s:.0f} s)", flush=True)


def measure_case(name: str, budget: str, predictions: Path) -> dict:
    from memfit.estimate.measure import measure, run_trial
    from memfit.units import parse_bytes

    spec = str(ROOT / "examples" / "explain" / f"{name}.py")
    budget_bytes = parse_bytes(budget)
    e = json.loads((predictions / f"{name}.explanation.json").read_text())
    profile = _profile_in_subprocess(spec, {})
    base = run_trial(spec)
    cap = budget_bytes - base.outside_allocator_bytes
    base_capped = run_trial(spec, cap_bytes=cap)
    fitting = sorted((f for f in e["fixes"] if f["fits_budget"] and not f["allocator"]),
                     key=lambda f: (_TRAINING_COST[f["changes_training"]], -f["saving_bytes"]))
    fit = fitting[0] if fitting else None
    fit_capped = run_trial(spec, cap_bytes=cap, changes=fit["changes"]) if fit else None
    top = next((f for f in e["fixes"] if not f["allocator"]), None)
    top_measured = measure(spec, changes=top["changes"], hint_bytes=top["fits_in_bytes"]) if top else None
    est = e["estimate"]
    record = {
        "case": name,
        "budget_bytes": budget_bytes,
        "allocator_cap_bytes": cap,
        "predicted": {
            "headline": e["headline"],
            "dominant": e["parts"][0]["category"],
            "parts": {p["category"]: p["nbytes"] for p in e["parts"]},
            "peak_phase": est["peak_phase"],
            "peak_step": est["peak_step"],
            "peak_allocated_bytes": est["peak_allocated_bytes"],
            "fits_in_bytes": est["fits_in_bytes"],
            "device_bytes": est["device_bytes"],
        },
        "measured_profile": profile,
        "base_uncapped": base.__dict__,
        "base_under_budget": base_capped.__dict__,
        "fitting_fix": None if fit is None else {
            "name": fit["name"], "changes": fit["changes"], "predicted_device_bytes": fit["device_bytes"],
            "under_budget": fit_capped.__dict__,
        },
        "top_fix": None if top is None else {
            "name": top["name"], "changes": top["changes"],
            "predicted_peak_allocated_bytes": top["peak_allocated_bytes"],
            "predicted_fits_in_bytes": top["fits_in_bytes"],
            "measured_peak_allocated_bytes": top_measured.peak_allocated_bytes,
            "measured_fits_in_bytes": top_measured.fits_in_bytes,
        },
    }
    print(f"{name}: measured peak {profile.get('peak_phase')} step {profile.get('peak_step')}, base under budget "
          f"ok={base_capped.ok}, fix {fit and fit['name']} under budget ok={fit_capped and fit_capped.ok}",
          flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=("predict", "measure", "profile"))
    parser.add_argument("--out", default="out")
    parser.add_argument("--predictions", default=str(ROOT / "examples" / "explain" / "reports"))
    parser.add_argument("--spec")
    parser.add_argument("--changes", default="{}")
    parser.add_argument("--cases", default=",".join(n for n, _ in CASES))
    args = parser.parse_args()
    if args.stage == "profile":
        print(json.dumps(profile_phases(args.spec, json.loads(args.changes))))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [(n, b) for n, b in CASES if n in args.cases.split(",")]
    if args.stage == "predict":
        for name, budget in chosen:
            predict_case(name, budget, out)
        return
    import torch

    records = [measure_case(name, budget, Path(args.predictions)) for name, budget in chosen]
    props = torch.cuda.get_device_properties(0)
    result = {
        "gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": dt.date.today().isoformat(), "cases": records,
    }
    name = stem("explain_cases", card(props.name), torch.__version__)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
