"""Three real cases for ``memfit explain``, checked on a GPU (issue "memfit explain", quality bar).

For each case (examples/explain/*.py with a budget):
1. ``explain()`` on this machine's GPU model: the diagnosis, the fixes, the report and PNGs (written to $OUT);
2. a phase profile of the real step (allocated memory at each phase boundary and the peak inside each phase),
   which says measured what the peak is made of and when it happens;
3. the step under the budget (allocator cap = budget - the CUDA context measured in the uncapped run): the
   original must run out of memory, the cheapest fix that the explanation says fits must run;
4. the top fix measured (peak allocated, and the smallest cap by bisection) against its prediction.

    python benchmarks/explain_cases.py --out $OUT          # on the GPU machine
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("satellite_unet", "6GiB"),
    ("nnunet_3d", "12GiB"),
    ("gpt_medium", "7GiB"),
]
_TRAINING_COST = {"no": 0, "numerics": 1, "semantics": 2}


def profile_phases(spec: str, changes: dict) -> dict:
    """Run the protocol once and record, per phase, allocated memory at its start and the peak inside it."""
    import torch

    from memfit.measure import _apply_changes
    from memfit.protocol import build, run_steps
    from memfit.workload import load_workload

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
    proc = subprocess.run([sys.executable, __file__, "--profile", spec, "--changes", json.dumps(changes)],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": proc.stderr[-1500:]}
    return json.loads(lines[-1])


def run_case(name: str, budget: str, out: Path) -> dict:
    from memfit.explain import explain
    from memfit.gpus import detect_gpu
    from memfit.measure import measure, run_trial
    from memfit.units import parse_bytes
    from memfit.workload import load_workload

    spec = str(ROOT / "examples" / "explain" / f"{name}.py")
    budget_bytes = parse_bytes(budget)
    gpu = detect_gpu()
    started = time.perf_counter()
    e = explain(load_workload(spec), gpu=gpu, budget_bytes=budget_bytes)
    explain_s = time.perf_counter() - started
    (out / f"{name}.explanation.json").write_text(e.to_json(indent=1))
    try:
        from memfit.report import write_pngs, write_report

        write_report(e, out / f"{name}.html")
        write_pngs(e, out / f"{name}_png")
    except Exception as exc:  # the pictures are a bonus here; the numbers below are the check
        print(f"{name}: report failed: {exc}", flush=True)

    profile = _profile_in_subprocess(spec, {})
    base = run_trial(spec)
    cap = budget_bytes - base.outside_allocator_bytes
    base_capped = run_trial(spec, cap_bytes=cap)
    fitting = sorted((f for f in e.fixes if f.fits_budget and not f.allocator),
                     key=lambda f: (_TRAINING_COST[f.changes_training], -f.saving_bytes))
    fit = fitting[0] if fitting else None
    fit_capped = run_trial(spec, cap_bytes=cap, changes=fit.changes) if fit else None
    top = next((f for f in e.fixes if not f.allocator), None)
    top_measured = measure(spec, changes=top.changes, hint_bytes=top.fits_in_bytes) if top else None
    record = {
        "case": name,
        "budget_bytes": budget_bytes,
        "allocator_cap_bytes": cap,
        "explain_s": explain_s,
        "predicted": {
            "headline": e.headline,
            "dominant": e.parts[0].category,
            "parts": {p.category: p.nbytes for p in e.parts},
            "peak_phase": e.estimate.peak_phase,
            "peak_step": e.estimate.peak_step,
            "peak_allocated_bytes": e.estimate.peak_allocated_bytes,
            "fits_in_bytes": e.estimate.fits_in_bytes,
            "device_bytes": e.estimate.device_bytes,
        },
        "measured_profile": profile,
        "base_uncapped": base.__dict__,
        "base_under_budget": base_capped.__dict__,
        "fitting_fix": None if fit is None else {
            "name": fit.name, "changes": fit.changes, "predicted_device_bytes": fit.device_bytes,
            "under_budget": fit_capped.__dict__,
        },
        "top_fix": None if top is None else {
            "name": top.name, "changes": top.changes,
            "predicted_peak_allocated_bytes": top.peak_allocated_bytes,
            "predicted_fits_in_bytes": top.fits_in_bytes,
            "measured_peak_allocated_bytes": top_measured.peak_allocated_bytes,
            "measured_fits_in_bytes": top_measured.fits_in_bytes,
        },
    }
    print(json.dumps({k: record[k] for k in ("case", "predicted")}, indent=1), flush=True)
    print(f"  measured peak phase {profile.get('peak_phase')} step {profile.get('peak_step')}, base under budget "
          f"ok={base_capped.ok}, fix {fit.name if fit else None} under budget ok={fit_capped and fit_capped.ok}",
          flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--profile")
    parser.add_argument("--changes", default="{}")
    parser.add_argument("--cases", default=",".join(n for n, _ in CASES))
    args = parser.parse_args()
    if args.profile:
        print(json.dumps(profile_phases(args.profile, json.loads(args.changes))))
        return
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for name, budget in CASES:
        if name in args.cases.split(","):
            records.append(run_case(name, budget, out))
    props = torch.cuda.get_device_properties(0)
    result = {
        "gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": dt.date.today().isoformat(), "cases": records,
    }
    (out / "explain_cases.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
