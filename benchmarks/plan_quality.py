"""Plan quality: memfit's plan against an exhaustive grid of the same knobs, measured on one GPU.

For each model (a CNN, a GPT-style decoder, a 3-D U-Net) and 4 budgets from tight to loose:

    python benchmarks/plan_quality.py predict --out benchmarks/results/plan/plan_predictions_cpu_<date>  # CPU
    python benchmarks/plan_quality.py measure --out $OUT --models resnet50 [--lightning]  # GPU machine
    python benchmarks/plan_quality.py verify|retime|paired|lightning --out $OUT          # GPU machine

``predict`` plans with the roofline speed model and times the planning on this (2-core) CPU; it also writes the
grid: every micro-batch dividing the effective batch × checkpointing (none, the planner's half set, all blocks)
× optimizer implementation (foreach, fused, for-loop) × memory format (channels_last for conv nets).
``measure`` times every grid configuration (one micro-batch forward+backward, and the optimizer step, each the
median of several after warm-up: step time = accumulation × micro-batch time + optimizer time), measures its
peak memory under the protocol, decides for each budget whether it runs under the cap (allocator cap = budget -
the CUDA context), runs each plan's choice under its cap in a fresh process, plans again with a GPU calibration,
and runs Lightning's batch-size finder under each cap. Plain halving until it runs is read off the grid
(``plan_quality_report.py``): micro-batch = effective, effective/2, ... without checkpointing, as people do.

``--predictions`` and ``--grid`` default to the newest ``benchmarks/results/plan/plan_predictions_*`` and
``plan_grid_*`` folders. Each GPU stage writes per-model files into ``--out``; they are committed as
``benchmarks/results/plan/plan_<stage>_<card>_torch<X.Y>_<yyyymmdd>/`` (``measure``'s as ``plan_grid_...``).
``verify`` runs plans made after the grid was measured under their caps in fresh processes; ``retime`` and
``paired`` time a plan against the grid's fastest fitting configurations again, because the grid times each
configuration once and a CPU-bound step's timing varies more than the differences between optimizer variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _results import latest  # noqa: E402

MODELS = {
    # name: (built-in workload, effective batch)
    "resnet50": ("resnet50", 64),
    "gpt2": ("gpt2", 32),
    "unet3d": ("unet3d", 4),
}
BUDGET_FRACTIONS = (0.15, 0.35, 0.6, 1.1)  # of the way from the smallest to the largest configuration's need
IMPLS = ("foreach", "fused", "for-loop")


def _workload(model: str):  # noqa: ANN202
    from memfit.workload.zoo import builtin_workload

    return builtin_workload(MODELS[model][0])


# ------------------------------------------------------------------------------------------------ predict


def predict(args: argparse.Namespace) -> None:
    from memfit.estimate.predict import estimate
    from memfit.explain.fixes import model_facts
    from memfit.plan.search import plan
    from memfit.workload.knobs import checkpoint_choices

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        w = _workload(model)
        eff = MODELS[model][1]
        facts = model_facts(w)
        base = estimate(w.replace(batch_size=max(1, eff // 2), accumulation_steps=2), gpu=args.gpu)
        options = [(), *checkpoint_choices(base.activations_by_module, facts.blocks)]
        biggest_est = estimate(w.replace(batch_size=eff, accumulation_steps=1), gpu=args.gpu)
        biggest = biggest_est.device_bytes
        smallest = estimate(w.replace(batch_size=1, accumulation_steps=eff, checkpoint=options[-1],
                                      optimizer_impl="fused" if "fused" in facts.optimizer_impls else "default"),
                            gpu=args.gpu).device_bytes
        budgets = [int(smallest + f * (biggest - smallest)) for f in BUDGET_FRACTIONS]
        plans = []
        for budget in budgets:
            started = time.perf_counter()
            try:
                p = plan(w, budget_bytes=budget, effective_batch=eff, gpu=args.gpu, calibration="roofline")
                plans.append({"budget_bytes": budget, "plan": p.to_dict(),
                              "planning_s": time.perf_counter() - started})
                print(f"{model} budget {budget / 2**30:.2f} GiB: {p.chosen.config.label()} "
                      f"({time.perf_counter() - started:.1f} s, {p.estimates} traces)", flush=True)
            except Exception as exc:  # an impossible budget is a result too
                plans.append({"budget_bytes": budget, "error": f"{type(exc).__name__}: {exc}",
                              "planning_s": time.perf_counter() - started})
                print(f"{model} budget {budget / 2**30:.2f} GiB: {exc}", flush=True)
        micros = [d for d in range(1, eff + 1) if eff % d == 0]
        formats = [False, True] if facts.has_conv else [False]
        impls = [i for i in IMPLS if i in facts.optimizer_impls]
        grid = [
            {"batch_size": m, "accumulation_steps": eff // m, "checkpoint": list(c), "optimizer_impl": i,
             "channels_last": cl}
            for m in micros for c in options for i in impls for cl in formats
        ]
        record = {"model": model, "workload": MODELS[model][0], "effective_batch": eff, "gpu": args.gpu,
                  "context_bytes": biggest_est.device_bytes - biggest_est.fits_in_bytes,
                  "smallest_bytes": smallest, "biggest_bytes": biggest, "budgets": budgets,
                  "checkpoint_options": [list(o) for o in options], "plans": plans, "grid": grid}
        (out / f"{model}.json").write_text(json.dumps(record, indent=1))


# ------------------------------------------------------------------------------------------------ measure


def _cuda_time(fn, repeats: int) -> float:  # noqa: ANN001
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _changes(config: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


def time_config(w, config: dict, repeats: int | None = None) -> dict:  # noqa: ANN001
    """Micro-batch time and optimizer time of one configuration (in this process)."""
    cw, micro, opt = _micro_and_opt(w, config)
    t_micro = _cuda_time(micro, repeats or (5 if cw.batch_size <= 8 else 3))
    t_opt = _cuda_time(opt, 3)
    return {"micro_s": t_micro, "optimizer_s": t_opt,
            "step_s": cw.accumulation_steps * t_micro + t_opt,
            "samples_per_s": cw.effective_batch_size / (cw.accumulation_steps * t_micro + t_opt)}


def memory_config(w, config: dict, cap_bytes: int | None = None) -> dict:  # noqa: ANN001
    """Peak memory of the protocol (3 steps, up to 2 micro-batches each) in this process, optionally capped."""
    import torch

    from memfit.workload.protocol import build, run_steps

    cw = w.replace(**_changes(config))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total) if cap_bytes else 1.0)
    torch.cuda.reset_peak_memory_stats()
    ok, error = True, ""
    try:
        model, optimizer, batch = build(cw, "cuda")
        scaler = torch.amp.GradScaler("cuda") if cw.precision == "fp16" else None
        run_steps(cw, model, optimizer, batch, autocast_device="cuda", scaler=scaler,
                  micro_batches=min(cw.accumulation_steps, 2))
        torch.cuda.synchronize()
        del model, optimizer, batch, scaler
    except torch.OutOfMemoryError as exc:
        ok, error = False, str(exc).splitlines()[0][:200]
    stats = torch.cuda.memory_stats()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"ok": ok, "error": error, "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0)}


def _clean() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def measure(args: argparse.Namespace) -> None:
    import torch

    from memfit.estimate.measure import run_trial

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    for model in args.models.split(","):
        pred = json.loads((Path(args.predictions) / f"{model}.json").read_text())
        w = _workload(model)
        # the allocator's share of each budget: the budget less the CUDA context the estimates assume
        # (measured on an H200, memfit.estimate.gpus); measuring it here would count this process's own context too
        context = pred["context_bytes"]
        caps = [b - context for b in pred["budgets"]]
        rows = []
        started = time.perf_counter()
        for config in pred["grid"]:
            row = {"config": config}
            try:
                _clean()
                row["memory"] = memory_config(w, config)
                _clean()
                row["time"] = time_config(w, config) if row["memory"]["ok"] else None
            except Exception as exc:  # one bad configuration must not stop the grid
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            fits = []
            for cap in caps:
                mem = row.get("memory")
                if mem is None or not mem["ok"]:
                    fits.append(False)
                elif mem["peak_reserved_bytes"] <= cap:
                    fits.append(True)  # it never asked for more than the cap
                elif mem["peak_allocated_bytes"] > cap:
                    fits.append(False)  # live tensors alone exceed it
                else:
                    _clean()
                    fits.append(memory_config(w, config, cap)["ok"])
            row["fits"] = fits
            rows.append(row)
            t = row.get("time") or {}
            print(f"{model} {config['batch_size']}x{config['accumulation_steps']} ckpt={len(config['checkpoint'])} "
                  f"{config['optimizer_impl']} cl={config['channels_last']}: "
                  f"{t.get('samples_per_s', 0):.1f} samples/s, fits {fits}", flush=True)
        grid_s = time.perf_counter() - started
        _clean()
        chosen = []
        for cap, entry in zip(caps, pred["plans"], strict=True):
            if "plan" not in entry:
                chosen.append(None)
                continue
            changes = entry["plan"]["chosen"]["config"]
            trial = run_trial(MODELS[model][0], cap_bytes=cap, changes=_plan_changes(changes),
                              allocator_conf="expandable_segments:True" if changes["expandable_segments"] else None)
            chosen.append(dataclasses.asdict(trial))
        result = {
            "model": model, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": dt.date.today().isoformat(), "total_bytes": total,
            "context_bytes": context, "caps": caps, "grid": rows, "grid_s": grid_s, "plan_runs": chosen,
            "calibrated": _calibrated_plans(w, pred, caps) if args.calibrate else None,
            "lightning": [_lightning(w, pred["effective_batch"], cap) for cap in caps] if args.lightning else None,
        }
        (out / f"plan_quality_{model}.json").write_text(json.dumps(result, indent=1))


def verify(args: argparse.Namespace) -> None:
    """Run each plan's choice under its budget's cap in a fresh process (plans made after the grid was measured)."""
    import torch

    from memfit.estimate.measure import run_trial

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        pred = json.loads((Path(args.predictions) / f"{model}.json").read_text())
        runs = []
        for budget, entry in zip(pred["budgets"], pred["plans"], strict=True):
            cfg = entry["plan"]["chosen"]["config"]
            trial = run_trial(MODELS[model][0], cap_bytes=budget - pred["context_bytes"], changes=_plan_changes(cfg),
                              allocator_conf="expandable_segments:True" if cfg["expandable_segments"] else None)
            runs.append({"budget_bytes": budget, "config": cfg, "trial": dataclasses.asdict(trial)})
            print(f"{model} {budget / 2**30:.2f} GiB: ok={trial.ok}", flush=True)
        (out / f"plan_verify_{model}.json").write_text(json.dumps(
            {"model": model, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "date": dt.date.today().isoformat(), "runs": runs}, indent=1))


def _predictions_and_grid(args: argparse.Namespace, model: str) -> tuple[dict, list[dict]]:
    pred = json.loads((Path(args.predictions) / f"{model}.json").read_text())
    return pred, json.loads((Path(args.grid) / f"plan_quality_{model}.json").read_text())["grid"]


def _plan_and_fastest(pred: dict, grid: list[dict], i: int, top: int) -> tuple[dict, list[dict]]:
    """Budget ``i``'s plan as a grid configuration, and the grid's ``top`` fastest configurations that fit it."""
    plan_cfg = {k: v for k, v in _plan_changes(pred["plans"][i]["plan"]["chosen"]["config"]).items()
                if k != "precision"}
    fitting = sorted((r for r in grid if r["fits"][i] and r.get("time")), key=lambda r: -r["time"]["samples_per_s"])
    return plan_cfg, [r["config"] for r in fitting[:top]]


def retime(args: argparse.Namespace) -> None:
    """Time each plan's choice again beside the grid's fastest fitting configurations, interleaved.

    The grid times each configuration once (median of 3-5 micro-batches). Where many configurations do the same
    work (the optimizer variants at 8 micro-batches per step), the largest of their noisy timings overstates the
    best; this stage times the plan's choice and the grid's ``--top`` fastest fitting ones per budget again, in
    ``--rounds`` interleaved rounds of ``--repeats`` micro-batches each, in one process, and compares medians.
    """
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        pred, grid = _predictions_and_grid(args, model)
        w = _workload(model)

        def key(cfg: dict) -> str:
            return json.dumps({k: cfg[k] for k in ("batch_size", "accumulation_steps", "checkpoint",
                                                   "optimizer_impl", "channels_last")}, sort_keys=True)

        configs: dict[str, dict] = {}
        budgets = []
        for i in range(len(pred["plans"])):
            plan_cfg, fitting = _plan_and_fastest(pred, grid, i, args.top)
            for cfg in [plan_cfg, *fitting]:
                configs.setdefault(key(cfg), cfg)
            budgets.append({"budget_bytes": pred["budgets"][i], "plan": key(plan_cfg),
                            "grid_top": [key(c) for c in fitting]})
        times: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(args.rounds):
            for k, cfg in configs.items():
                _clean()
                times[k].append(time_config(w, cfg, repeats=args.repeats)["samples_per_s"])
        median = {k: statistics.median(v) for k, v in times.items()}
        for b in budgets:
            best = max(b["grid_top"], key=lambda k: median[k])
            b.update(plan_samples_per_s=median[b["plan"]], best=best, best_samples_per_s=median[best],
                     ratio=median[b["plan"]] / median[best])
            print(f"{model} {b['budget_bytes'] / 2**30:.2f} GiB: plan {median[b['plan']]:.1f} vs best "
                  f"{median[best]:.1f} samples/s ({100 * b['ratio']:.1f} %)", flush=True)
        (out / f"plan_retime_{model}.json").write_text(json.dumps(
            {"model": model, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "cuda": torch.version.cuda, "date": dt.date.today().isoformat(), "rounds": args.rounds,
             "repeats": args.repeats, "configs": configs, "samples_per_s": times, "budgets": budgets}, indent=1))


def _micro_and_opt(w, config: dict):  # noqa: ANN001, ANN202
    """A built configuration's micro-batch and optimizer step, warmed up (as ``time_config`` runs them)."""
    import contextlib

    import torch

    from memfit.workload.protocol import autocast_dtype, build

    cw = w.replace(**_changes(config))
    model, optimizer, batch = build(cw, "cuda")
    scaler = torch.amp.GradScaler("cuda") if cw.precision == "fp16" else None
    dtype = autocast_dtype(cw.precision)

    def micro() -> None:
        ctx = torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = cw.loss(cw.run_forward(model, batch), batch) / cw.accumulation_steps
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def opt() -> None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    micro()
    opt()
    micro()
    torch.cuda.synchronize()
    return cw, micro, opt


def paired(args: argparse.Namespace) -> None:
    """The plan against each of the grid's fastest fitting rivals, both built at once and timed alternately.

    For each budget and rival: ``--repeats`` pairs of one plan micro-batch then one rival micro-batch (CUDA
    events), so drifts of the host's speed over seconds hit both alike; each pair gives a throughput ratio
    (step = accumulation × micro-batch + the optimizer's median), and the result is the median over pairs.
    """
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        pred, grid = _predictions_and_grid(args, model)
        w = _workload(model)
        budgets = []
        for i in range(len(pred["plans"])):
            plan_cfg, fastest = _plan_and_fastest(pred, grid, i, args.top)
            rivals = [c for c in fastest if _changes(c) != _changes(plan_cfg)]
            _clean()
            pw, p_micro, p_opt = _micro_and_opt(w, plan_cfg)
            p_opt_s = _cuda_time(p_opt, 5)
            rows = []
            for rival in rivals:
                rw, r_micro, r_opt = _micro_and_opt(w, rival)
                r_opt_s = _cuda_time(r_opt, 5)
                ratios = []
                for _ in range(args.repeats):
                    tp, tr = _cuda_time(p_micro, 1), _cuda_time(r_micro, 1)
                    sp = pw.effective_batch_size / (pw.accumulation_steps * tp + p_opt_s)
                    sr = rw.effective_batch_size / (rw.accumulation_steps * tr + r_opt_s)
                    ratios.append(sp / sr)
                rows.append({"rival": rival, "ratio_median": statistics.median(ratios),
                             "ratio_quartiles": statistics.quantiles(ratios, n=4), "pairs": len(ratios)})
                del rw, r_micro, r_opt
                _clean()
            worst = min(rows, key=lambda r: r["ratio_median"]) if rows else None
            budgets.append({"budget_bytes": pred["budgets"][i], "plan": plan_cfg, "rivals": rows,
                            "worst_ratio": worst["ratio_median"] if worst else 1.0})
            print(f"{model} {pred['budgets'][i] / 2**30:.2f} GiB: plan / fastest rival, paired: "
                  f"{100 * budgets[-1]['worst_ratio']:.1f} %", flush=True)
            del pw, p_micro, p_opt
        (out / f"plan_paired_{model}.json").write_text(json.dumps(
            {"model": model, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "cuda": torch.version.cuda, "date": dt.date.today().isoformat(), "repeats": args.repeats,
             "budgets": budgets}, indent=1))


def lightning(args: argparse.Namespace) -> None:
    """Only Lightning's batch-size finder, under each budget's cap (the peers' row of the report)."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        pred = json.loads((Path(args.predictions) / f"{model}.json").read_text())
        caps = [b - pred["context_bytes"] for b in pred["budgets"]]
        runs = [_lightning(_workload(model), pred["effective_batch"], cap) for cap in caps]
        for budget, run in zip(pred["budgets"], runs, strict=True):
            print(f"{model} {budget / 2**30:.2f} GiB: {run}", flush=True)
        (out / f"plan_lightning_{model}.json").write_text(json.dumps(
            {"model": model, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "date": dt.date.today().isoformat(), "budgets": pred["budgets"], "caps": caps, "lightning": runs},
            indent=1))


def _plan_changes(config: dict) -> dict:
    """The workload fields a plan's configuration sets (those a configuration of the grid, made before checkpoint
    modes, loss implementations and optimizer-state options, leaves at their defaults), in the plan's loop."""
    changes = {"batch_size": config["micro_batch"], "accumulation_steps": config["accumulation_steps"],
               "checkpoint": list(config["checkpoint"]), "optimizer_impl": config["optimizer_impl"],
               "channels_last": config["channels_last"], "precision": config["precision"]}
    # until session 30 these were dropped: a plan that chose reentrant checkpointing ran non-reentrant under its cap
    for key in ("checkpoint_mode", "loss_impl", "optimizer_state"):
        if key in config:
            changes[key] = config[key]
    # the loop a plan is made for and applied in (memfit.plan.search: TrainStep drops each micro-batch's output
    # before its backward); the workload's own, the plain loop, keeps it (GPT-2's 0.8 GB of bf16 logits)
    changes["keep_output"] = False
    return changes


def _calibrated_plans(w, pred: dict, caps: list[int]) -> dict:  # noqa: ANN001
    """Calibrate the speed model on this GPU (timed), then plan each budget with it (planning timed too)."""
    from memfit.estimate.gpus import detect_gpu
    from memfit.plan.search import plan
    from memfit.speed.step_time import calibrate

    started = time.perf_counter()
    calibration = calibrate(w.replace(accumulation_steps=1))
    calibration_s = time.perf_counter() - started
    plans = []
    for budget in pred["budgets"]:
        started = time.perf_counter()
        try:
            p = plan(w, budget_bytes=budget, effective_batch=pred["effective_batch"], gpu=detect_gpu(),
                     calibration=calibration)
            plans.append({"budget_bytes": budget, "plan": p.to_dict(), "planning_s": time.perf_counter() - started})
        except Exception as exc:
            plans.append({"budget_bytes": budget, "error": f"{type(exc).__name__}: {exc}"})
    return {"calibration_s": calibration_s, "calibration": calibration.to_dict(), "plans": plans}


def _lightning(w, effective: int, cap: int) -> dict:  # noqa: ANN001
    """Lightning's batch-size finder (power mode, its defaults) under the cap: the size it picks, the time."""
    try:
        import pytorch_lightning as pl
        import torch
        from pytorch_lightning.tuner import Tuner
    except ImportError as exc:
        return {"error": f"lightning not importable: {exc}"}

    from memfit.workload.protocol import autocast_dtype

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model()
            self.batch_size = 2

        def training_step(self, batch, _):  # noqa: ANN001, ANN202
            return w.loss(w.run_forward(self.net, batch), batch)

        def configure_optimizers(self):  # noqa: ANN202
            return w.optimizer(self.parameters())

        def train_dataloader(self):  # noqa: ANN202
            one = w.make_batch(1)

            class Data(torch.utils.data.Dataset):
                def __len__(self) -> int:
                    return 1 << 16

                def __getitem__(self, i: int):  # noqa: ANN202
                    return tuple(t[0] for t in one)

            return torch.utils.data.DataLoader(Data(), batch_size=self.batch_size)

    total = torch.cuda.get_device_properties(0).total_memory
    _clean()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[w.precision]
    assert autocast_dtype(w.precision) is not None or precision == "32-true"
    started = time.perf_counter()
    try:
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        module = Module()
        found = Tuner(trainer).scale_batch_size(module, mode="power")
        result = {"batch_size": found, "seconds": time.perf_counter() - started}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:300], "seconds": time.perf_counter() - started}
    torch.cuda.set_per_process_memory_fraction(1.0)
    _clean()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=("predict", "measure", "verify", "retime", "paired", "lightning"))
    parser.add_argument("--out", default="out")
    parser.add_argument("--predictions", default=str(latest("plan", "plan_predictions_")))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--lightning", action="store_true")
    parser.add_argument("--grid", default=str(latest("plan", "plan_grid_")))
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    {"predict": predict, "measure": measure, "verify": verify, "retime": retime, "paired": paired,
     "lightning": lightning}[args.stage](args)


if __name__ == "__main__":
    main()
