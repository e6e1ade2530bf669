"""memfit's plan against an exhaustive sweep that includes partial checkpointing, timed interleaved on one GPU.

For each workload and budget, every configuration of micro-batch (each divisor of the effective batch) ×
checkpointed blocks (none, a quarter, the planner's half set, three quarters, all; heaviest blocks first, as the
planner ranks them) × optimizer implementation (fused; the default too with no, the planner's and full
checkpointing) × memory format (channels_last too for conv nets) runs its steady state on the GPU: the peak memory of the protocol (the loss-only loop ``TrainStep`` runs),
then "does it run under the cap" for each budget (allocator cap = budget - the CUDA context memfit assumes, set
with ``torch.cuda.set_per_process_memory_fraction`` in a worker process that times nothing: a capped run leaves cuDNN's
fallback algorithms cached in the process that ran it), then one timing (median micro-batch and optimizer step:
step = accumulation × micro-batch + optimizer). Per budget, the plan's pick and the sweep's fastest fitting
configurations are then built together and timed in interleaved rounds, which cancels the host's drift:
``ratio`` = the best step time ÷ the plan's (the plan's throughput as a share of the best; 1.0 when the plan is
the best). A plan with expandable segments is checked under its cap in a fresh process with them on, and timed
without them (the segment mode changes no kernel).

    python benchmarks/plan/sweep_device.py plan --out benchmarks/results/plan/plan_sweep_predictions_cpu_<date>
    python benchmarks/plan/sweep_device.py sweep --plans <that folder> --out $OUT        # on the GPU (H100)

The ``plan`` stage runs on the CPU for ``--gpu`` (default h100) with the roofline speed model (no GPU to calibrate
on), and each plan records the speed model it used (``speed_model``). ``sweep`` judges exactly the plans in
``--plans``, whichever GPU it lands on (a mismatch is recorded, not re-planned), so the CPU-made roofline plans are
the ones judged; only without ``--plans`` does it plan on the device's CPU, and says so (``plans_provenance``). It
writes ``plan_sweep_<workload>.json`` per workload into ``--out`` (commit as
``benchmarks/results/plan/plan_sweep_<card>_torch<X.Y>_<yyyymmdd>/``); ``plan/sweep_report.py`` makes the table.
GPT-2 and the 2-D U-Net took 75 and 73 s each on an H100 (``sweep_s`` in
``results/plan/plan_sweep_h100_torch2.11_20261126/``); ``--deadline-s`` stops a sweep early and keeps what it
measured. ``sweep --dry-run`` (CPU) loads the plans and lists what the GPU would run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as dt
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from plan_quality import _clean, _cuda_time, _micro_and_opt, memory_config, time_config  # noqa: E402

# name: (built-in workload, its changes, effective batch, budgets in GiB of device memory)
WORKLOADS = {
    # the GPT-2 budgets (H200, effective batch 32 × 1024 tokens) and a loose one
    "gpt2": ("gpt2", {}, 32, (5.5, 9.0, 16.0, 24.0)),
    # the 2-D U-Net at 512² tiles: each step a fraction of a second, so the sweep stays short
    "unet2d": ("unet2d", {"patch_size": (512, 512)}, 8, (3.0, 5.0, 8.0, 14.0)),
    # Two models the speed model's constants were not fitted on (GPT-2 and ResNet-50 were). Budgets set before
    # any GPU run, from memfit.estimate's upper bounds on this CPU (device_upper_bytes for an H100, torch 2.13,
    # commit d45188f, loss-only loop, fused optimizer), from just above the least any configuration needs to loose:
    # ViT-B/16 at its built-in batch of 64 (bf16, AdamW): micro-batch 1 plain needs 2.70 GiB (the least: at small
    # micro-batches the model state dominates and checkpointing saves little), 4 plain 2.88, 8 plain 3.22, 8 with
    # every block checkpointed 2.71, 64 plain 6.83; so at 3 GiB micro-batches up to 4 fit plain and larger ones
    # only checkpointed.
    "vit_b16": ("vit_b16", {}, 64, (3.0, 4.0, 5.0, 8.0)),
    # nnU-Net's 3-D U-Net at its 128³ patch and nnU-Net's batch of 2 (fp16, SGD): micro-batch 1 needs 3.66 GiB
    # plain, 3.04 GiB all checkpointed; 2 at once 5.86 GiB plain, 4.88 GiB all checkpointed; so at 3.3 GiB only
    # checkpointed configurations fit.
    "unet3d": ("unet3d", {}, 2, (3.3, 4.0, 5.25, 8.0)),
}
# the models the speed model's constants were fitted on (memfit/speed/step_time.py: SpeedParams); the rest are unseen
SPEED_FIT_MODELS = ("gpt2", "resnet50")
IMPLS = ("fused", "default")
ROUNDS = 8


def _workload(name: str):  # noqa: ANN202
    from memfit.workload.zoo import builtin_workload

    builtin, changes, _, _ = WORKLOADS[name]
    return builtin_workload(builtin).replace(keep_output=False, **changes)


def _key(config: dict) -> str:
    return json.dumps({**{k: config[k] for k in ("batch_size", "accumulation_steps", "checkpoint", "optimizer_impl",
                                                 "channels_last")},
                       "checkpoint_mode": config.get("checkpoint_mode", "full") if config["checkpoint"] else "full",
                       "loss_impl": config.get("loss_impl", "default")}, sort_keys=True)


def grid(name: str, gpu) -> dict:  # noqa: ANN001
    """The sweep's configurations (largest micro-batch first: a deadline cuts the slowest) and the planner's
    checkpointing choices, from one estimate (CPU)."""
    from memfit.estimate.predict import estimate
    from memfit.plan.search_state import DEFAULT_CHECKPOINT_MODES, divisors
    from memfit.workload.knobs import activations_by_block, checkpoint_choices, model_facts

    w = _workload(name)
    eff = WORKLOADS[name][2]
    facts = model_facts(w)
    mid = max(d for d in divisors(eff) if d <= max(1, eff // 2))
    est = estimate(w.replace(batch_size=mid, accumulation_steps=eff // mid), gpu=gpu)
    held = activations_by_block(est.activations_by_module)
    ranked = sorted((b for b in facts.blocks if held.get(b, 0) > 0), key=lambda b: -held[b])
    planner = checkpoint_choices(est.activations_by_module, facts.blocks)
    sets = {()} | {tuple(b for b in facts.blocks if b in ranked[:k])
                   for k in (math.ceil(len(ranked) * f) for f in (0.25, 0.75, 1.0))} | set(planner)
    impls = [i for i in IMPLS if i == "default" or i in facts.optimizer_impls]
    formats = [False, True] if facts.has_conv else [False]
    # the default (non-fused) optimizer with the planner's own checkpointing choices only: it needs more memory
    # and launches more kernels than fused, so the partial sets add nothing with it but GPU-minutes
    # checkpointed sets run both ways the planner considers (memfit.plan.search_state.DEFAULT_CHECKPOINT_MODES), the
    # reentrant one with the fused optimizer only
    configs = [{"batch_size": m, "accumulation_steps": eff // m, "checkpoint": list(s), "optimizer_impl": impl,
                "channels_last": cl, "checkpoint_mode": mode}
               for m in sorted(divisors(eff), reverse=True) for s in sorted(sets, key=len) for impl in impls
               for cl in formats for mode in (DEFAULT_CHECKPOINT_MODES if s else ("full",))
               if (impl == impls[0] or s == () or s in planner) and (mode == "full" or impl == impls[0])]
    return {"configs": configs, "planner_sets": [list(s) for s in planner], "blocks": list(facts.blocks)}


def _provenance(made_on: str) -> dict:
    """Where and with what a set of plans was made: judged results name the code and torch that planned them."""
    import platform
    import subprocess

    import torch

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE).stdout.strip()
        except OSError:  # no git where this runs (the device machine's copy of the tree)
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "src")
    dirty = None if status is None else bool(status)
    return {"made_on": made_on, "torch": torch.__version__, "python": platform.python_version(),
            "memfit_commit": commit or None, "memfit_src_modified": dirty, "date": dt.date.today().isoformat()}


def make_plans(name: str, gpu, made_on: str = "cpu") -> dict:  # noqa: ANN001
    from memfit.plan.search import plan

    w = _workload(name)
    _, _, eff, budgets = WORKLOADS[name]
    plans = []
    for gib in budgets:
        started = time.perf_counter()
        try:
            # calibration="roofline": the roofline, stated rather than left to plan()'s default
            p = plan(w, budget_bytes=int(gib * 2**30), effective_batch=eff, gpu=gpu, calibration="roofline")
            plans.append({"budget_bytes": p.budget_bytes, "plan": p.to_dict(), "speed_model": p.speed_model,
                          "planning_s": time.perf_counter() - started,
                          "context_bytes": p.chosen.device_bytes - p.chosen.fits_in_bytes})
        except Exception as exc:  # a budget nothing fits: the sweep says whether anything runs
            plans.append({"budget_bytes": int(gib * 2**30), "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(f"{name} {gib} GiB: {plans[-1].get('plan', {}).get('chosen', {}).get('config') or plans[-1]['error']} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
    return {"workload": name, "effective_batch": eff, "gpu": gpu.name, "plans": plans,
            "provenance": _provenance(made_on), **grid(name, gpu)}


def plan_stage(args: argparse.Namespace) -> None:
    from memfit.estimate.gpus import gpu_spec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.workloads.split(","):
        (out / f"{name}.json").write_text(json.dumps(make_plans(name, gpu_spec(args.gpu)), indent=1))


# ------------------------------------------------------------------------------------------------ GPU


_CAPPED: concurrent.futures.ProcessPoolExecutor | None = None


def _capped_ok(name: str, config: dict, cap: int) -> bool:
    """The protocol of ``config`` under ``cap``, in a worker process that times nothing. Never in this one: where a
    capped run's cuDNN workspace does not fit, PyTorch falls back to an algorithm with less workspace and caches
    that choice for the convolution's shapes for the rest of the process, so every later timing of those shapes
    here would run it."""
    global _CAPPED
    if _CAPPED is None:
        _CAPPED = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    return _CAPPED.submit(_capped_run, name, config, cap).result()


def _capped_run(name: str, config: dict, cap: int) -> bool:  # in the worker
    from memfit._torch_private import clear_cublas_workspaces

    clear_cublas_workspaces()  # an earlier workload's, held in the allocator, would count against this cap
    _clean()
    return bool(memory_config(_workload(name), config, cap)["ok"])


def _pick(entry: dict) -> tuple[dict, bool]:
    """A plan's configuration as the sweep's rows name them, and whether it turns expandable segments on."""
    return _as_row(entry["plan"]["chosen"]["config"])


def _as_row(chosen: dict) -> tuple[dict, bool]:
    """A ``Config`` (as a dict) as the sweep's rows name it, and whether it turns expandable segments on."""
    return ({"batch_size": chosen["micro_batch"], "accumulation_steps": chosen["accumulation_steps"],
             "checkpoint": chosen["checkpoint"], "optimizer_impl": chosen["optimizer_impl"],
             "channels_last": chosen["channels_last"], "checkpoint_mode": chosen.get("checkpoint_mode", "full"),
             "loss_impl": chosen.get("loss_impl", "default")}, bool(chosen["expandable_segments"]))


def _plan_runs(name: str, pick: dict, expandable: bool, cap: int) -> bool:
    """Does the plan run under its cap, in a fresh process as the user's run would start (run_trial: the protocol,
    3 steps, the loss-only loop TrainStep runs)? A process that ran other configurations before holds their
    cuBLAS workspaces and cuDNN choices: on the 2026-11-26 r3 sweep such a worker refused two 3-D U-Net plans."""
    from memfit.estimate.measure import run_trial

    builtin, changes, _, _ = WORKLOADS[name]
    return run_trial(builtin, cap_bytes=cap, allocator_conf="expandable_segments:True" if expandable else None,
                     changes={**changes, "keep_output": False, **pick, "checkpoint": tuple(pick["checkpoint"])}).ok


def verify_stage(args: argparse.Namespace) -> None:
    """Each plan of ``--plans`` under its cap in a fresh process, nothing timed (GPU)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.workloads.split(","):
        pred = _load_plans(args, name)
        if pred is None:
            continue
        context = next((p["context_bytes"] for p in pred["plans"] if p.get("context_bytes")), 768 << 20)
        for entry in pred["plans"]:
            if "plan" not in entry:
                continue
            cap = entry["budget_bytes"] - (entry.get("context_bytes") or context)
            pick, expandable = _pick(entry)
            runs = _plan_runs(name, pick, expandable, cap)
            results.append({"workload": name, "budget_bytes": entry["budget_bytes"], "cap_bytes": cap, "plan": pick,
                            "expandable_segments": expandable, "runs_under_cap": runs})
            print(f"{name} {entry['budget_bytes'] / 2**30:.2f} GiB: plan runs under its cap in a fresh process: "
                  f"{runs}", flush=True)
    (out / "plan_verify.json").write_text(json.dumps(results, indent=1))


def _fits(name: str, config: dict, memory: dict, cap: int) -> bool:
    if not memory["ok"]:
        return False
    if memory["peak_reserved_bytes"] <= cap:
        return True  # it never asked for more than the cap
    if memory["peak_allocated_bytes"] > cap:
        return False  # live tensors alone exceed it
    return _capped_ok(name, config, cap)


def _record(name: str, **fields: Any) -> dict:
    """A result file's contents: the workload, the card, torch and the date, then ``fields``."""
    import torch

    return {"workload": name, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "date": dt.date.today().isoformat(), **fields}


def _chosen(args: argparse.Namespace, gib: float) -> bool:
    """``gib`` is one of ``--budgets`` (every budget is, without it)."""
    return not args.budgets or gib in {float(b) for b in args.budgets.split(",")}


def _interleaved(w, configs: list[dict], rounds: int) -> list[float]:  # noqa: ANN001
    """Step seconds of each configuration, all built at once, one micro-batch each per round, rotated."""
    built = [_micro_and_opt(w, c) for c in configs]
    opt_s = [_cuda_time(opt, 5) for _, _, opt in built]
    micro: list[list[float]] = [[] for _ in configs]
    for r in range(rounds):
        for i in [(r + k) % len(built) for k in range(len(built))]:
            micro[i].append(_cuda_time(built[i][1], 1))
    steps = [cw.accumulation_steps * statistics.median(m) + o for (cw, _, _), m, o in zip(built, micro, opt_s,
                                                                                       strict=True)]
    del built
    _clean()
    return steps


def _repeated(w, configs: list[dict], rounds: int, repeats: int  # noqa: ANN001
              ) -> tuple[list[list[float]], list[float], list[float], float]:
    """``_interleaved`` ``repeats`` times, the models built anew each time: the step seconds of every repeat, each
    configuration's median, and the fastest ÷ the first configuration per repeat and of the medians."""
    runs = [_interleaved(w, configs, rounds) for _ in range(repeats)]
    medians = [statistics.median(r[i] for r in runs) for i in range(len(configs))]
    return runs, medians, [min(r) / r[0] for r in runs], min(medians) / medians[0]


def sweep_workload(name: str, pred: dict, args: argparse.Namespace) -> dict:
    w = _workload(name)
    started = time.perf_counter()
    contexts = [p.get("context_bytes") for p in pred["plans"]]
    context = next((c for c in contexts if c), 768 << 20)
    caps = [p["budget_bytes"] - (p.get("context_bytes") or context) for p in pred["plans"]]
    rows: dict[str, dict] = {}
    for config in pred["configs"]:
        if time.perf_counter() - started > args.deadline_s:
            print(f"{name}: deadline reached after {len(rows)} of {len(pred['configs'])} configurations", flush=True)
            break
        row: dict = {"config": config}
        try:
            _clean()
            row["memory"] = memory_config(w, config)
            row["fits"] = [_fits(name, config, row["memory"], cap) for cap in caps]
            _clean()
            row["time"] = time_config(w, config) if any(row["fits"]) else None
        except Exception as exc:  # one bad configuration must not stop the sweep
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row.setdefault("fits", [False] * len(caps))
        rows[_key(config)] = row
        t = row.get("time") or {}
        print(f"{name} {config['batch_size']}x{config['accumulation_steps']} ckpt={len(config['checkpoint'])} "
              f"{config.get('checkpoint_mode', 'full')} "
              f"{config['optimizer_impl']} cl={config['channels_last']}: step {t.get('step_s', 0) * 1e3:.1f} ms, "
              f"fits {row['fits']}", flush=True)
    budgets = []
    for i, entry in enumerate(pred["plans"]):
        fitting = sorted((r for r in rows.values() if r["fits"][i] and r.get("time")),
                         key=lambda r: r["time"]["step_s"])
        result: dict = {"budget_bytes": entry["budget_bytes"], "cap_bytes": caps[i],
                        "sweep_fitting": len(fitting),
                        "sweep_best": fitting[0]["config"] if fitting else None}
        if "plan" not in entry:
            result["plan_error"] = entry["error"]
            budgets.append(result)
            continue
        pick, expandable = _pick(entry)
        runs = _plan_runs(name, pick, expandable, caps[i])
        finalists = [pick] + [r["config"] for r in fitting if _key(r["config"]) != _key(pick)][:args.top]
        steps = _interleaved(w, finalists, args.rounds)
        best = min(range(len(steps)), key=steps.__getitem__)
        result.update({
            "plan": pick, "plan_speed_model": entry.get("speed_model", entry["plan"].get("speed_model")),
            "plan_expandable_segments": expandable, "plan_runs_under_cap": runs,
            "plan_predicted_step_s": entry["plan"]["chosen"]["step_time_s"],
            "plan_predicted_device_bytes": entry["plan"]["chosen"]["device_bytes"],
            "finalists": [{"config": c, "step_s": s} for c, s in zip(finalists, steps, strict=True)],
            "best": finalists[best], "ratio": steps[best] / steps[0],
        })
        print(f"{name} {entry['budget_bytes'] / 2**30:.2f} GiB: plan runs={runs}, best/plan step ratio "
              f"{result['ratio']:.3f} (plan {steps[0] * 1e3:.1f} ms, best {steps[best] * 1e3:.1f} ms)", flush=True)
        budgets.append(result)
    return _record(name, effective_batch=pred["effective_batch"], caps=caps, context_bytes=context,
                   plans_gpu=pred["gpu"], plans_provenance=pred.get("provenance"),
                   speed_fit_model=name in SPEED_FIT_MODELS, configurations=len(pred["configs"]),
                   rows=list(rows.values()), budgets=budgets, sweep_s=time.perf_counter() - started)


def retime_stage(args: argparse.Namespace) -> None:
    """Each budget's plan and the finalists a sweep timed beside it, timed again in more interleaved rounds and
    several repeats, each repeat building the models anew: how far apart the plan and the best really are, and how
    much one repeat moves (a sweep's single ``ratio`` came from 8 rounds)."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    for name in args.workloads.split(","):
        swept = json.loads((Path(args.sweep) / f"plan_sweep_{name}.json").read_text())
        w = _workload(name)
        budgets = []
        for b in swept["budgets"]:
            if "finalists" not in b:
                continue
            configs = [f["config"] for f in b["finalists"]]  # the plan first
            repeats, medians, ratios, of_medians = _repeated(w, configs, args.rounds, args.repeats)
            row = {"budget_bytes": b["budget_bytes"], "sweep_ratio": b["ratio"],
                   "finalists": [{"config": c, "step_s": [r[i] for r in repeats], "median_step_s": m}
                                 for i, (c, m) in enumerate(zip(configs, medians, strict=True))],
                   "ratio_per_repeat": ratios, "ratio_of_medians": of_medians}
            budgets.append(row)
            print(f"{name} {b['budget_bytes'] / 2**30:.2f} GiB: sweep ratio {b['ratio']:.3f}; {args.repeats} repeats "
                  f"x {args.rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)}; of medians "
                  f"{row['ratio_of_medians']:.3f} (plan {medians[0] * 1e3:.1f} ms, "
                  f"best {min(medians) * 1e3:.1f} ms)", flush=True)
        (out / f"plan_retime_{name}.json").write_text(json.dumps(_record(
            name, sweep=str(args.sweep), rounds=args.rounds, repeats=args.repeats, budgets=budgets), indent=1))


def control_stage(args: argparse.Namespace) -> None:
    """The plan of a ``calibrated`` run, its fastest contender and a second copy of the plan, built separately
    (an A/A control), timed in the same interleaved rounds: how far apart two copies of one configuration time on
    this harness, beside how far the plan and the contender do (GPU)."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    judged = json.loads(Path(args.judged).read_text())
    name = judged["workload"]
    w = _workload(name)
    budgets = []
    for b in judged["budgets"]:
        if not _chosen(args, b["budget_bytes"] / 2**30):
            continue
        plan, *others = b["contenders"]
        fastest = min(others, key=lambda c: c["median_step_s"])
        configs = [plan["config"], fastest["config"], plan["config"]]
        repeats, medians, _, _ = _repeated(w, configs, args.rounds, args.repeats)
        row = {"budget_bytes": b["budget_bytes"], "plan": plan["config"], "contender": fastest["config"],
               "step_s": repeats, "median_step_s": medians,
               "contender_over_plan": [r[1] / r[0] for r in repeats],
               "copy_over_plan": [r[2] / r[0] for r in repeats]}
        # each repeat builds all three anew and times them in the same rounds: its ratio is paired (the host's and
        # the card's drift between repeats cancels), and the median over repeats averages the models' own placement
        row.update(median_contender_over_plan=statistics.median(row["contender_over_plan"]),
                   median_copy_over_plan=statistics.median(row["copy_over_plan"]))
        budgets.append(row)
        print(f"{name} {b['budget_bytes'] / 2**30:.2f} GiB, {args.repeats} repeats x {args.rounds} rounds: contender / "
              f"plan {', '.join(f'{x:.3f}' for x in row['contender_over_plan'])} (median "
              f"{row['median_contender_over_plan']:.3f}); the plan's copy / the plan "
              f"{', '.join(f'{x:.3f}' for x in row['copy_over_plan'])} (median {row['median_copy_over_plan']:.3f})",
              flush=True)
    (out / f"plan_control_{name}.json").write_text(json.dumps(_record(
        name, judged=str(args.judged), rounds=args.rounds, repeats=args.repeats, budgets=budgets), indent=1))


def calibrated_stage(args: argparse.Namespace) -> None:
    """The plans a GPU user gets by default, judged on the GPU (``plan(calibration="auto")``: this card timed).

    Per workload the speed model is chosen as ``plan``'s default chooses it (``choose_speed_model(..., "auto")``:
    micro-batches ``calibration_sizes`` timed on this card), once, and every budget is planned with that
    calibration. Each plan then runs under its cap in a fresh process, and is timed in interleaved rounds beside
    the CPU's roofline plan for the same budget (``--plans``) and the fastest configurations an earlier sweep found
    running under the same cap (``--sweeps``: its capped checks decided which fit; the caps are that sweep's).
    ``--repeats`` builds every configuration anew each time. ``ratio`` = the fastest of them ÷ the calibrated
    plan, per repeat and of the medians. With ``--race`` (the default, as ``plan``'s on the GPU) the plan settles
    the near-ties of its speed model by timing them (``memfit.plan.race``): what it timed is kept (``race``), and
    its pick before the race is timed as a contender too."""
    import torch

    from memfit.estimate.gpus import detect_gpu
    from memfit.plan.race import time_on_this_gpu
    from memfit.plan.search import plan
    from memfit.speed.model_choice import choose_speed_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    gpu = detect_gpu()
    sweeps = dict(item.split("=", 1) for item in args.sweeps.split(","))
    for name in args.workloads.split(","):
        swept = json.loads((Path(sweeps[name]) / f"plan_sweep_{name}.json").read_text())
        roofline = _load_plans(args, name)
        w = _workload(name)
        _, _, eff, gibs = WORKLOADS[name]
        started = time.perf_counter()
        given = _given_calibration(args.calibration, name)
        speed = choose_speed_model(w, gpu, given if given is not None else "auto", effective_batch=eff)
        calibration_s = time.perf_counter() - started
        print(f"{name}: {speed.reason} ({calibration_s:.1f} s)", flush=True)
        budgets = []
        for index, (gib, sweep_budget, roof_entry) in enumerate(zip(gibs, swept["budgets"], roofline["plans"],
                                                                    strict=True)):
            budget = int(gib * 2**30)
            assert sweep_budget["budget_bytes"] == budget == roof_entry["budget_bytes"], (name, gib)
            if not _chosen(args, gib):
                continue
            cap = sweep_budget["cap_bytes"]
            row: dict = {"budget_bytes": budget, "cap_bytes": cap}
            raced: list[tuple[list, list]] = []  # the near-ties the plan timed (``--race``), as it timed them
            timer = time_on_this_gpu(w)

            def racer(configs, timer=timer, raced=raced):  # noqa: ANN001, ANN202
                times = timer(configs)
                raced.append((list(configs), times))
                return times

            started = time.perf_counter()
            try:
                p = plan(w, budget_bytes=budget, effective_batch=eff, gpu=gpu,
                         calibration=speed.calibration if speed.calibration is not None else "roofline",
                         race=racer if args.race else False)
            except Exception as exc:  # a budget nothing fits: said, and the next budget planned
                row["plan_error"] = f"{type(exc).__name__}: {exc}"[:300]
                budgets.append(row)
                print(f"{name} {gib} GiB: {row['plan_error']}", flush=True)
                continue
            row["planning_s"] = time.perf_counter() - started
            pick, expandable = _pick({"plan": p.to_dict()})
            row.update({"plan": pick, "plan_expandable_segments": expandable,
                        "plan_context_bytes": p.chosen.device_bytes - p.chosen.fits_in_bytes,
                        "plan_predicted_step_s": p.chosen.step_time_s,
                        "plan_runs_under_cap": _plan_runs(name, pick, expandable, cap)})
            if raced:
                (field, times), = raced
                row["race"] = [{"config": _as_row(dataclasses.asdict(c))[0],
                                "predicted_step_s": next((f.step_time_s for f in [p.chosen, *p.frontier]
                                                          if f.config == c), None),
                                "race_step_s": t} for c, t in zip(field, times, strict=True)]
                row["race_note"] = next((n for n in p.notes if "took the fastest measured" in n), None)
            unraced = row["race"][0]["config"] if raced else None  # the speed model's own pick
            roof_pick = _pick(roof_entry)[0] if "plan" in roof_entry else None
            fitting = sorted((r for r in swept["rows"] if r["fits"][index] and r.get("time")),
                             key=lambda r: r["time"]["step_s"])
            contenders: dict[str, tuple[str, dict]] = {}  # by _key: the first role a configuration comes with
            for role, config in [("calibrated plan", pick),
                                 *([("calibrated plan before the race", unraced)] if unraced else []),
                                 *([("roofline plan", roof_pick)] if roof_pick else []),
                                 *(("sweep", r["config"]) for r in fitting)]:
                contenders.setdefault(_key(config), (role, config))
            timed = list(contenders.values())[:1 + args.top + (unraced is not None and _key(unraced) != _key(pick))]
            repeats, medians, ratios, of_medians = _repeated(w, [c for _, c in timed], args.rounds, args.repeats)
            row.update({
                "contenders": [{"role": role, "config": c, "step_s": [r[i] for r in repeats], "median_step_s": m}
                               for i, ((role, c), m) in enumerate(zip(timed, medians, strict=True))],
                "ratio_per_repeat": ratios,
                "ratio_of_medians": of_medians,
                "same_as_roofline_plan": roof_pick is not None and _key(roof_pick) == _key(pick),
            })
            budgets.append(row)
            print(f"{name} {gib} GiB: {p.chosen.config.label()}; runs under cap {row['plan_runs_under_cap']}; "
                  f"ratio per repeat {', '.join(f'{r:.3f}' for r in row['ratio_per_repeat'])}, of medians "
                  f"{row['ratio_of_medians']:.3f} (plan {medians[0] * 1e3:.1f} ms, best {min(medians) * 1e3:.1f} "
                  f"ms; same as the roofline plan: {row['same_as_roofline_plan']})", flush=True)
        (out / f"plan_calibrated_{name}.json").write_text(json.dumps(_record(
            name, speed_model=speed.name, speed_reason=speed.reason, calibration_s=calibration_s,
            sweep=sweeps[name], roofline_plans=str(args.plans), rounds=args.rounds, repeats=args.repeats,
            speed_fit_model=name in SPEED_FIT_MODELS, race=args.race,
            calibration=speed.calibration.to_dict() if speed.calibration is not None else None, budgets=budgets),
            indent=1))


def _given_calibration(path: str | None, name: str):  # noqa: ANN202 - a memfit Calibration, or None
    """``--calibration``: a workload's calibration from an earlier run (``calibration_dump.py``'s file, or a
    ``plan_calibrated_<workload>.json``), to plan with it instead of calibrating again."""
    from memfit.speed.step_time import Calibration

    if path is None:
        return None
    d = json.loads(Path(path).read_text())
    return Calibration.from_dict(d["calibrations"][name]["calibration"] if "calibrations" in d else d["calibration"])


def _load_plans(args: argparse.Namespace, name: str) -> dict | None:
    if not args.plans:
        return None
    path = Path(args.plans) / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no plans for {name} in {args.plans} ({path.name} missing): run the plan stage first.")
    pred = json.loads(path.read_text())
    if pred.get("effective_batch") != WORKLOADS[name][2]:
        raise SystemExit(f"{path} was planned for effective batch {pred.get('effective_batch')}, this script sweeps "
                         f"{WORKLOADS[name][2]}: run the plan stage again.")
    return pred


def _describe(name: str, pred: dict) -> str:
    lines = [f"{name}: {len(pred['configs'])} configurations, plans for {pred['gpu']} made on "
             f"{(pred.get('provenance') or {}).get('made_on', '?')}"]
    for entry in pred["plans"]:
        chosen = entry.get("plan", {}).get("chosen", {}).get("config")
        label = (f"{chosen['micro_batch']}x{chosen['accumulation_steps']} ckpt={len(chosen['checkpoint'])} "
                 f"{chosen.get('checkpoint_mode', 'full')} "
                 f"{chosen['optimizer_impl']} cl={chosen['channels_last']} "
                 f"expandable={chosen['expandable_segments']}" if chosen else entry.get("error"))
        lines.append(f"  {entry['budget_bytes'] / 2**30:.2f} GiB [{entry.get('speed_model', '-')}]: {label}")
    return "\n".join(lines)


def sweep_stage(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # the CPU's check of what the GPU would judge: the plans and the grid, nothing run
        for name in args.workloads.split(","):
            pred = _load_plans(args, name)
            print(_describe(name, pred) if pred else f"{name}: no --plans, the device would plan itself", flush=True)
        return

    import torch

    from memfit.estimate.gpus import detect_gpu

    torch.cuda.init()
    for name in args.workloads.split(","):
        pred = _load_plans(args, name)
        gpu = detect_gpu()
        if pred is None:
            print(f"{name}: planning for {gpu.name if gpu else 'this GPU'} on the device's CPU", flush=True)
            pred = make_plans(name, gpu, made_on="device_cpu")
        elif gpu is None or pred["gpu"] != gpu.name:
            # the plans judged are the ones given: their roofline and CUDA context are the planned GPU's, which
            # the result records (plans_gpu) beside the card that ran them
            print(f"{name}: judging plans made for {pred['gpu']} on {gpu.name if gpu else 'an unknown GPU'}",
                  flush=True)
        print(_describe(name, pred), flush=True)
        result = sweep_workload(name, pred, args)
        (out / f"plan_sweep_{name}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("plan", help="plans and the sweep's grid, on the CPU")
    p.add_argument("--out", required=True)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--gpu", default="h100", help="the GPU the sweep will run on (h100, h200)")
    p.set_defaults(func=plan_stage)
    s = sub.add_parser("sweep", help="the sweep and the interleaved timings, on the GPU")
    s.add_argument("--out", required=True)
    s.add_argument("--plans", default=None, help="the plan stage's folder; default: plan here first")
    s.add_argument("--workloads", default=",".join(WORKLOADS))
    s.add_argument("--rounds", type=int, default=ROUNDS)
    s.add_argument("--top", type=int, default=3, help="the sweep's fastest fitting configurations timed with the plan")
    s.add_argument("--deadline-s", type=float, default=150.0, help="per workload: stop sweeping after this long")
    s.add_argument("--dry-run", action="store_true", help="on the CPU: load the plans, print what would run")
    s.set_defaults(func=sweep_stage)
    v = sub.add_parser("verify", help="each plan under its cap in a fresh process, nothing timed (GPU)")
    v.add_argument("--out", required=True)
    v.add_argument("--plans", required=True, help="the plan stage's folder")
    v.add_argument("--workloads", default=",".join(WORKLOADS))
    v.set_defaults(func=verify_stage)
    r = sub.add_parser("retime", help="on the GPU: a sweep's plans and finalists timed again, longer")
    r.add_argument("--out", required=True)
    r.add_argument("--sweep", required=True, help="a sweep stage's output folder (plan_sweep_<workload>.json)")
    r.add_argument("--workloads", default="vit_b16")
    r.add_argument("--rounds", type=int, default=60)
    r.add_argument("--repeats", type=int, default=3)
    r.set_defaults(func=retime_stage)
    k = sub.add_parser("control", help="on the GPU: a calibrated run's plan, its fastest contender and a second "
                                       "copy of the plan timed together (an A/A control of the harness's noise)")
    k.add_argument("--out", required=True)
    k.add_argument("--judged", required=True, help="a calibrated stage's plan_calibrated_<workload>.json")
    k.add_argument("--budgets", help="comma-separated GiB: only these budgets")
    k.add_argument("--rounds", type=int, default=60)
    k.add_argument("--repeats", type=int, default=3)
    k.set_defaults(func=control_stage)
    c = sub.add_parser("calibrated", help="on the GPU: plans made with the default (calibrated) speed model, "
                                          "run under their caps and timed against a sweep's finalists")
    c.add_argument("--out", required=True)
    c.add_argument("--plans", required=True, help="the plan stage's folder (the CPU's roofline plans)")
    c.add_argument("--sweeps", required=True, help="WORKLOAD=FOLDER,...: the sweep each workload is judged against")
    c.add_argument("--workloads", default=",".join(WORKLOADS))
    c.add_argument("--rounds", type=int, default=20)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--top", type=int, default=4, help="contenders timed beside the calibrated plan")
    c.add_argument("--calibration", help="plan with this earlier calibration (a calibration_dump.py file)")
    c.add_argument("--budgets", help="comma-separated GiB: only these of the workload's budgets")
    c.add_argument("--race", action=argparse.BooleanOptionalAction, default=True,
                   help="let the plan settle its near-ties by timing them (plan()'s default on the GPU)")
    c.set_defaults(func=calibrated_stage)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
