"""Does the plan take the chunked cross-entropy exactly when it is the fastest configuration that fits? (issue 15,
item 4: "the plan uses it when that is fastest under the budget")

The Llama-3-shaped decoder of ``chunked_ce_device.py`` (vocabulary 128256, width 1024, 4 layers, bf16 autocast,
AdamW, the loss-only step), effective batch 8 × 2048 tokens, planned for an H100 at four budgets. Per budget three
configurations are run on the GPU:

* ``plan``: memfit's plan (the chunked loss is one of its knobs);
* ``no_knob``: the plan of the same step whose loss is computed from the logits (the same loss; the chunked one
  cannot serve it, so the planner plans the default loss alone), or none where nothing else fits;
* ``other_loss``: where the plan kept the default loss, the fastest chunked configuration the plan scored as
  fitting (from its frontier).

Each runs the protocol in a fresh process under the allocator cap (budget - the CUDA context the plan assumed),
then all are timed in this process, in two interleaved passes (step = accumulation × micro-batch + optimizer,
``plan_quality.time_config``). The check: the plan ran under its cap, and no other configuration that ran under
the cap was measurably faster (``TOLERANCE``).

    python benchmarks/plan/chunked_plan_device.py plan --out benchmarks/results/plan       # CPU, ~2 min
    python benchmarks/plan/chunked_plan_device.py measure --plans <that json> --out $OUT   # GPU, ~3 min on an H100

Writes ``chunked_plan_predictions_cpu_torch<X.Y>_<date>.json`` (plan) and ``chunked_plan_<card>_torch<X.Y>_<date>.json``
(measure); committed results go to ``benchmarks/results/plan/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import card, stem  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, SEQ = 128_256, 1024, 4, 16, 2048  # chunked_ce_device.py's decoder
EFFECTIVE = 8
# GiB of device memory. From the CPU estimates of micro-batch 1/2/4/8 without checkpointing, fused AdamW
# (torch 2.13): default loss 10.5/13.5/22.3/33.8 GiB, chunked 7.5/7.8/8.8/8.8 GiB. 9: only the chunked loss fits;
# 12: the default loss fits only at micro-batch 1 (the roofline puts it level with the chunked loss at 8);
# 16: the default at micro-batch 2; 40: the default at the whole batch
BUDGETS_GIB = (9.0, 12.0, 16.0, 40.0)
TOLERANCE = 0.03  # step times of one configuration in two passes differ by about 1-2 % (plan_quality's retimes)


def workload(*, loss_from_logits: bool = False) -> Any:
    import torch

    from memfit.workload.chunked_cross_entropy import causal_lm_loss
    from memfit.workload.models import CausalLM
    from memfit.workload.spec import Workload

    def loss(out: Any, batch: dict) -> Any:
        return causal_lm_loss(out.logits, batch["labels"]) if loss_from_logits else out.loss

    return Workload(
        name="causal-lm-128k" + ("-loss-from-logits" if loss_from_logits else ""),
        model=lambda: CausalLM(vocab=VOCAB, seq_len=SEQ, dim=DIM, layers=LAYERS, heads=HEADS),
        batch=lambda n: {"input_ids": torch.randint(0, VOCAB, (n, SEQ)), "labels": torch.randint(0, VOCAB, (n, SEQ))},
        loss=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), batch_size=1, accumulation_steps=EFFECTIVE,
        precision="bf16", keep_output=False,
    )


def _pick(c: Any) -> dict:
    """A candidate as JSON: its Workload changes, what the plan predicted, and the cap it is run under."""
    changes = {k: list(v) if isinstance(v, tuple) else v for k, v in c.config.changes().items()}
    return {"changes": changes, "label": c.config.label(), "expandable_segments": c.config.expandable_segments,
            "predicted_device_bytes": c.device_bytes, "predicted_step_s": c.step_time_s,
            "context_bytes": c.device_bytes - c.fits_in_bytes}


def plan_stage(args: argparse.Namespace) -> None:
    import torch

    from memfit.errors import BudgetTooSmallError
    from memfit.plan.search import plan

    budgets = []
    for gib in BUDGETS_GIB:
        budget = int(gib * 2**30)
        p = plan(workload(), budget_bytes=budget, effective_batch=EFFECTIVE, gpu=args.gpu, calibration="roofline")
        entry: dict[str, Any] = {"budget_gib": gib, "budget_bytes": budget, "plan": _pick(p.chosen),
                                 "notes": p.notes, "elapsed_s": p.elapsed_s}
        try:
            twin = plan(workload(loss_from_logits=True), budget_bytes=budget, effective_batch=EFFECTIVE, gpu=args.gpu,
                        calibration="roofline")
            entry["no_knob"] = _pick(twin.chosen)
        except BudgetTooSmallError as exc:
            entry["no_knob"], entry["no_knob_error"] = None, str(exc)
        if p.chosen.config.loss_impl == "default":
            chunked = [c for c in p.frontier if c.fits and c.config.loss_impl == "chunked" and c.step_time_s]
            entry["other_loss"] = _pick(min(chunked, key=lambda c: c.step_time_s)) if chunked else None
        budgets.append(entry)
        print(gib, "GiB:", entry["plan"]["label"], "| no knob:", (entry["no_knob"] or {}).get("label"), flush=True)
    out = {"schema": 1, "gpu": args.gpu, "torch": torch.__version__, "effective_batch": EFFECTIVE,
           "model": {"vocab": VOCAB, "dim": DIM, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "precision": "bf16"},
           "budgets": budgets}
    _write(Path(args.out), stem("chunked_plan_predictions", "cpu", torch.__version__), out)


def run_one(changes: dict, cap_bytes: int, expandable: bool) -> dict:
    """In a fresh process: the protocol under the cap (does it run?), its peaks."""
    from plan_quality import memory_config

    return memory_config(workload(), changes, cap_bytes) | {"expandable_segments": expandable}


def measure_stage(args: argparse.Namespace) -> None:
    import torch
    from plan_quality import _clean, time_config

    pred = json.loads(Path(args.plans).read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parents[1] / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    runs: dict[str, dict] = {}  # by (changes, cap)
    for entry in pred["budgets"]:
        for role in ("plan", "no_knob", "other_loss"):
            pick = entry.get(role)
            if not pick:
                continue
            cap = entry["budget_bytes"] - pick["context_bytes"]
            key = json.dumps([pick["changes"], cap], sort_keys=True)
            if key not in runs:
                conf = "expandable_segments:True" if pick["expandable_segments"] else ""
                child = subprocess.run(
                    [sys.executable, __file__, "one", "--changes", json.dumps(pick["changes"]), "--cap", str(cap),
                     *(["--expandable"] if pick["expandable_segments"] else [])],
                    capture_output=True, text=True, env={**env, "PYTORCH_CUDA_ALLOC_CONF": conf})
                runs[key] = (json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0
                             else {"ok": False, "error": child.stderr.strip().splitlines()[-1:]})
            pick["under_cap"] = runs[key]
            pick["cap_bytes"] = cap
    # time every distinct configuration, two interleaved passes (each built alone: they do not all fit at once)
    distinct = {json.dumps(p["changes"], sort_keys=True): p["changes"] for e in pred["budgets"]
                for p in (e.get("plan"), e.get("no_knob"), e.get("other_loss")) if p}
    times: dict[str, list[float]] = {k: [] for k in distinct}
    for _ in range(2):
        for key, changes in distinct.items():
            # the model's own loss: with the default loss it is the loss computed from the logits
            times[key].append(time_config(workload(), changes)["step_s"])
            _clean()
    for entry in pred["budgets"]:
        ran = {}
        for role in ("plan", "no_knob", "other_loss"):
            pick = entry.get(role)
            if pick:
                pick["measured_step_s"] = min(times[json.dumps(pick["changes"], sort_keys=True)])
                if pick["under_cap"].get("ok"):
                    ran[role] = pick["measured_step_s"]
        best = min(ran.values()) if ran else None
        entry["plan_runs_under_cap"] = bool(entry["plan"]["under_cap"].get("ok"))
        entry["plan_is_fastest_that_ran"] = ("plan" in ran and best is not None
                                             and ran["plan"] <= best * (1 + TOLERANCE))
        entry["best_over_plan"] = best / ran["plan"] if "plan" in ran and best else None
    device = torch.cuda.get_device_name()
    out = {**pred, "device": device, "device_torch": torch.__version__, "tolerance": TOLERANCE}
    _write(Path(args.out), stem("chunked_plan", card(device), torch.__version__), out)


def _write(folder: Path, name: str, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("plan", help="plan every budget (CPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--gpu", default="h100")
    m = sub.add_parser("measure", help="run and time the plans on this GPU")
    m.add_argument("--plans", required=True)
    m.add_argument("--out", required=True)
    one = sub.add_parser("one", help=argparse.SUPPRESS)  # the child process of measure
    one.add_argument("--changes", required=True)
    one.add_argument("--cap", type=int, required=True)
    one.add_argument("--expandable", action="store_true")
    args = ap.parse_args()
    if args.stage == "plan":
        plan_stage(args)
    elif args.stage == "measure":
        measure_stage(args)
    else:
        print(json.dumps(run_one(json.loads(args.changes), args.cap, args.expandable)))


if __name__ == "__main__":
    main()
