"""How well memfit's speed model ranks training configurations: measured step times against its predictions.

For ResNet-50, a GPT-2-style decoder and a 3-D U-Net (memfit's built-ins, no downloads), a grid of
configurations: micro-batch sizes, precision, channels_last, optimizer implementation (foreach, for-loop, fused),
activation checkpointing of the first half of the blocks, gradient accumulation. For each:

* **measured**: median of 5 timed steps after 3 warm-up steps, CUDA events between host syncs (a training loop
  that logs its loss each step), plus the peak memory;
* **roofline**: ``predict_step_time`` with datasheet peaks and the default constants;
* **calibrated**: the same after ``fit_calibration`` on the model's default configuration at 3 micro-batch sizes
  (timed per phase as ``memfit.speed.step_time.calibrate`` does).

It reports per-config errors, Spearman rank correlations of samples/s, and for memory budgets at the 25/50/75/100th
percentile of the measured peaks, how fast the configuration each model picks really is against the fastest
that fits (the planner's acceptance test: at least 95 %).

    PYTHONPATH=src python benchmarks/speed_model.py            # on the GPU machine; writes to $OUT (./out)
    PYTHONPATH=src python benchmarks/speed_model.py --only gpt2 --costs out/speed_costs.json

Costs are traced first, on the CPU, in a process pool (before CUDA starts, so it cannot disturb the timings) and
saved to ``$OUT/speed_costs.json``; ``--costs`` reuses such a file. Under 4 minutes on one H100. The report is
``$OUT/speed_model_<card>_torch<X.Y>_<yyyymmdd>.{json,md}``; committed results go to ``benchmarks/results/speed/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import gc
import inspect
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _results import card, stem  # noqa: E402

MODELS = ("resnet50", "gpt2", "unet3d")
UNET_PATCH = 64  # 64^3 patches instead of the built-in's 128^3: an eighth of the time per step


@dataclass(frozen=True)
class Config:
    """One point of the grid."""

    model: str
    micro: int
    precision: str
    channels_last: bool = False
    optimizer: str = "foreach"  # foreach | for-loop | fused
    checkpoint_half: bool = False
    accumulation: int = 1

    @property
    def key(self) -> str:
        return (f"{self.model}/b{self.micro}x{self.accumulation}/{self.precision}"
                f"{'/cl' if self.channels_last else ''}/{self.optimizer}{'/ckpt-half' if self.checkpoint_half else ''}")

    @property
    def trace_key(self) -> str:
        """Configs that differ only in accumulation share a trace (one micro-batch's cost)."""
        return dataclasses.replace(self, accumulation=1).key


def grid() -> list[Config]:
    r, g, u = "resnet50", "gpt2", "unet3d"
    return [
        # ResNet-50: fp32 (TF32 convolutions) and bf16, NCHW and channels_last
        *(Config(r, b, "fp32") for b in (8, 32, 96)),
        *(Config(r, b, "bf16", channels_last=True) for b in (8, 32, 96)),
        Config(r, 32, "bf16"),
        Config(r, 32, "bf16", channels_last=True, optimizer="for-loop"),
        Config(r, 32, "bf16", channels_last=True, optimizer="fused"),
        Config(r, 96, "bf16", channels_last=True, checkpoint_half=True),
        Config(r, 32, "bf16", channels_last=True, accumulation=3),
        # GPT-2 small, 1024 tokens: bf16 autocast, fp32 matmuls (TF32 off, PyTorch's default)
        *(Config(g, b, "bf16") for b in (1, 4, 12)),
        Config(g, 4, "fp32"),
        Config(g, 4, "bf16", optimizer="for-loop"),
        Config(g, 4, "bf16", optimizer="fused"),
        Config(g, 12, "bf16", checkpoint_half=True),
        Config(g, 4, "bf16", accumulation=3),
        # 3-D U-Net, 64^3 patches: fp16 + GradScaler (nnU-Net's), bf16, fp32, channels_last_3d
        *(Config(u, b, "fp16") for b in (1, 2, 6)),
        Config(u, 2, "bf16"),
        Config(u, 2, "fp32"),
        Config(u, 2, "fp16", channels_last=True),
        Config(u, 2, "fp16", optimizer="for-loop"),
        Config(u, 2, "fp16", optimizer="fused"),
        Config(u, 6, "fp16", checkpoint_half=True),
    ]


def calibration_sizes(model: str) -> tuple[Config, ...]:
    """The default configuration of each model at 3 micro-batch sizes (what a planner would time)."""
    default = {"resnet50": ("fp32", (8, 32, 96)), "gpt2": ("bf16", (1, 4, 12)), "unet3d": ("fp16", (1, 2, 6))}
    precision, sizes = default[model]
    return tuple(Config(model, b, precision) for b in sizes)


# ------------------------------------------------------------------------------------------------- workloads
class _Checkpointed:
    """Built lazily (needs torch): an nn.Module that runs its inner block under non-reentrant checkpointing."""

    cls: Any = None

    @classmethod
    def wrap(cls, block: Any) -> Any:
        if cls.cls is None:
            import torch
            from torch.utils.checkpoint import checkpoint

            class Checkpointed(torch.nn.Module):
                def __init__(self, inner: torch.nn.Module) -> None:
                    super().__init__()
                    self.inner = inner

                def forward(self, *args: Any) -> Any:
                    # the block's inputs are kept; everything inside is recomputed in backward
                    return checkpoint(self.inner, *args, use_reentrant=False)

            cls.cls = Checkpointed
        return cls.cls(block)


def _checkpoint_first_half(model: Any, name: str) -> Any:
    if name == "gpt2":
        containers = [(model.blocks, i) for i in range(len(model.blocks))]
    elif name == "resnet50":
        containers = [(layer, i) for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                      for i in range(len(layer))]
    else:  # U-Net: encoder stages, then decoder stages
        containers = [(model.encoder, i) for i in range(len(model.encoder))]
        containers += [(model.decoder, i) for i in range(len(model.decoder))]
    for parent, i in containers[: len(containers) // 2]:
        parent[i] = _Checkpointed.wrap(parent[i])
    return model


def workload(c: Config) -> Any:

    from memfit.workload.zoo import builtin_workload

    w = builtin_workload(c.model)
    if c.model == "unet3d":
        p = UNET_PATCH
        w = w.replace(patch_size=(p, p, p))  # 64³ keeps the run short
    base_optimizer = w.optimizer
    if c.optimizer != "foreach":
        flag = {"for-loop": {"foreach": False}, "fused": {"fused": True}}[c.optimizer]

        def optimizer(params: Any) -> Any:
            opt = base_optimizer(params)
            # same hyperparameters, other implementation: rebuild with the flag (defaults can hold more keys than
            # __init__ takes, e.g. AdamW's decoupled_weight_decay)
            accepted = inspect.signature(type(opt).__init__).parameters
            kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}
            return type(opt)(opt.param_groups[0]["params"], **{**kwargs, **flag})

        w = w.replace(optimizer=optimizer)
    # "foreach" is torch.optim's default on CUDA when neither flag is set (and what the trace assumes)
    if c.checkpoint_half:
        base_model = w.model
        w = w.replace(model=lambda: _checkpoint_first_half(base_model(), c.model))
    return w.replace(batch_size=c.micro, precision=c.precision, channels_last=c.channels_last,
                     name=c.trace_key)


# --------------------------------------------------------------------------------------------- stage 1: costs
def _trace_one(c: Config) -> tuple[str, dict[str, Any] | None, str]:
    import torch

    torch.set_num_threads(1)
    try:
        from memfit.estimate.gpus import gpu_spec
        from memfit.estimate.trace import trace_workload
        from memfit.speed.step_time import StepCost

        started = time.perf_counter()
        cost = StepCost.from_trace(trace_workload(workload(c), gpu_spec("h100"), steps=2), c.micro)
        return c.trace_key, cost.to_dict(), f"{time.perf_counter() - started:.1f}s"
    except Exception as exc:  # one failing trace must not stop the run
        return c.trace_key, None, f"{type(exc).__name__}: {exc}"


def trace_costs(configs: list[Config], workers: int) -> dict[str, Any]:
    unique = {c.trace_key: c for c in configs}
    costs: dict[str, Any] = {}
    ctx = mp.get_context("spawn")  # CUDA is not started yet in this process, and never in the workers
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for key, cost, note in pool.map(_trace_one, unique.values()):
            print(f"  traced {key}: {note}", flush=True)
            costs[key] = cost if cost is not None else {"error": note}
    return costs


# ------------------------------------------------------------------------------------------ stage 2: measure
def _is_oom(exc: BaseException) -> bool:
    from memfit.guard.oom import is_oom

    return is_oom(exc)


def time_steps(c: Config, *, warmup: int = 3, repeats: int = 5) -> dict[str, Any]:
    """Median step time of the real loop (k micro-batches, then the optimizer), and the peak memory."""
    import torch

    from memfit.workload.protocol import autocast_dtype, build

    w = workload(c)
    torch.cuda.reset_peak_memory_stats()
    model, optimizer, batch = build(w, "cuda")
    scaler = torch.amp.GradScaler("cuda") if w.precision == "fp16" else None
    dtype = autocast_dtype(w.precision)
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        start.record()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(c.accumulation):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = w.run_forward(model, batch)
                loss = w.loss(out, batch)
            del out
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    peak = torch.cuda.max_memory_reserved()
    del model, optimizer, batch, scaler
    return {"step_s": statistics.median(times), "all_s": times, "peak_reserved_bytes": peak}


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def measure(configs: list[Config], deadline: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for c in configs:
        if time.perf_counter() > deadline:
            results[c.key] = {"status": "skipped", "reason": "time budget"}
            continue
        try:
            r = time_steps(c)
            results[c.key] = {"status": "ok", **r}
            print(f"  {c.key}: {r['step_s'] * 1e3:.1f} ms, peak {r['peak_reserved_bytes'] / 2**30:.1f} GiB",
                  flush=True)
        except Exception as exc:
            status = "oom" if _is_oom(exc) else "error"
            results[c.key] = {"status": status, "error": f"{type(exc).__name__}: {exc}"[:500]}
            if status == "error":
                traceback.print_exc()
            print(f"  {c.key}: {status}", flush=True)
        _free()
    return results


def calibrate_models(models: list[str], costs: dict[str, Any], deadline: float) -> dict[str, Any]:
    from memfit.estimate.gpus import detect_gpu
    from memfit.speed.step_time import CalibrationSample, StepCost, _time_phases, fit_calibration

    spec = detect_gpu()
    out: dict[str, Any] = {}
    for model in models:
        samples = []
        for c in calibration_sizes(model):
            if time.perf_counter() > deadline or "error" in (costs.get(c.trace_key) or {"error": 1}):
                continue
            try:
                f, b, o = _time_phases(workload(c), "cuda", warmup=2, repeats=5)
                samples.append(CalibrationSample(cost=StepCost.from_dict(costs[c.trace_key]), forward_s=f,
                                                 backward_s=b, optimizer_s=o))
            except Exception as exc:
                print(f"  calibration {c.key}: {'oom' if _is_oom(exc) else exc}", flush=True)
            _free()
        if len(samples) < 2:
            out[model] = None
            continue
        cal = fit_calibration(samples, spec, workload=model)
        out[model] = cal
        print(f"  calibrated {model}: rms log error {cal.rms_log_error:.3f}, {cal.params}", flush=True)
    return out


# ------------------------------------------------------------------------------------------- stage 3: report
def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def report(configs: list[Config], costs: dict[str, Any], measured: dict[str, Any],
           calibrations: dict[str, Any]) -> dict[str, Any]:
    from memfit.estimate.gpus import detect_gpu
    from memfit.speed.step_time import StepCost, predict_step_time

    spec = detect_gpu()
    rows = []
    for c in configs:
        m = measured.get(c.key, {})
        cost_d = costs.get(c.trace_key)
        row: dict[str, Any] = {"config": c.key, **dataclasses.asdict(c), "status": m.get("status", "missing")}
        if m.get("status") == "ok":
            row.update(measured_step_s=m["step_s"], measured_samples_per_s=c.micro * c.accumulation / m["step_s"],
                       peak_reserved_bytes=m["peak_reserved_bytes"])
        if cost_d and "error" not in cost_d:
            cost = StepCost.from_dict(cost_d)
            for label, cal in (("roofline", None), ("calibrated", calibrations.get(c.model))):
                if label == "calibrated" and cal is None:
                    continue
                p = predict_step_time(cost, spec, c.accumulation, cal)
                row[f"{label}_step_s"] = p.step_time_s
                row[f"{label}_samples_per_s"] = p.samples_per_s
                row[f"{label}_bound"] = p.bound
                if "measured_step_s" in row:
                    row[f"{label}_error"] = p.step_time_s / row["measured_step_s"] - 1
        elif cost_d:
            row["trace_error"] = cost_d["error"]
        rows.append(row)
    summary: dict[str, Any] = {}
    for model in sorted({c.model for c in configs}):
        ok = [r for r in rows if r["model"] == model and "measured_samples_per_s" in r]
        entry: dict[str, Any] = {}
        for label in ("roofline", "calibrated"):
            have = [r for r in ok if f"{label}_samples_per_s" in r]
            if not have:
                continue
            entry[f"{label}_spearman"] = spearman([r["measured_samples_per_s"] for r in have],
                                                  [r[f"{label}_samples_per_s"] for r in have])
            entry[f"{label}_median_abs_error"] = statistics.median(abs(r[f"{label}_error"]) for r in have)
            entry[f"{label}_choice"] = _choices(have, label)
        summary[model] = entry
    return {"rows": rows, "summary": summary}


def _choices(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """Budgets at quartiles of the measured peaks: the model's pick against the measured best that fits."""
    peaks = sorted(r["peak_reserved_bytes"] for r in rows)
    out = []
    for q in (0.25, 0.5, 0.75, 1.0):
        budget = peaks[min(len(peaks) - 1, max(0, round(q * len(peaks)) - 1))]
        fits = [r for r in rows if r["peak_reserved_bytes"] <= budget]
        best = max(fits, key=lambda r: r["measured_samples_per_s"])
        pick = max(fits, key=lambda r: r[f"{label}_samples_per_s"])
        out.append({"budget_bytes": budget, "candidates": len(fits), "best": best["config"], "pick": pick["config"],
                    "pick_vs_best": pick["measured_samples_per_s"] / best["measured_samples_per_s"]})
    return out


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# Speed model vs measured step times: {result['gpu']}, torch {result['torch']}, {result['date']}", "",
             "| config | status | measured ms | roofline ms | err | calibrated ms | err | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]

    def ms(v: Any) -> str:
        return f"{v * 1e3:.1f}" if isinstance(v, float) else "-"

    def pct(v: Any) -> str:
        return f"{v:+.0%}" if isinstance(v, float) else "-"

    for r in result["rows"]:
        peak = r.get("peak_reserved_bytes")
        lines.append(f"| {r['config']} | {r['status']} | {ms(r.get('measured_step_s'))} | {ms(r.get('roofline_step_s'))}"
                     f" | {pct(r.get('roofline_error'))} | {ms(r.get('calibrated_step_s'))} | "
                     f"{pct(r.get('calibrated_error'))} | {peak / 2**30 if peak else 0:.1f} |")
    lines += ["", "| model | model kind | Spearman | median abs error | pick vs best at budgets (25/50/75/100 %) |",
              "|---|---|---|---|---|"]
    for model, entry in result["summary"].items():
        for label in ("roofline", "calibrated"):
            if f"{label}_spearman" not in entry:
                continue
            rho = entry[f"{label}_spearman"]
            picks = " / ".join(f"{c['pick_vs_best']:.0%}" for c in entry[f"{label}_choice"])
            lines.append(f"| {model} | {label} | {rho:.2f} | {entry[f'{label}_median_abs_error']:.0%} | {picks} |"
                         if rho is not None else f"| {model} | {label} | - | - | {picks} |")
    for name, cal in result["calibrations"].items():
        if cal:
            lines.append(f"\n{name}: fitted {cal['params']} (rms log error {cal['rms_log_error']:.3f})")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated models (resnet50,gpt2,unet3d)")
    ap.add_argument("--costs", help="reuse a speed_costs.json from an earlier run instead of tracing")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop measuring after this many seconds")
    ap.add_argument("--trace-only", action="store_true", help="trace the costs and stop (no GPU needed)")
    args = ap.parse_args()
    started = time.perf_counter()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    models = args.only.split(",") if args.only else list(MODELS)
    configs = [c for c in grid() if c.model in models]
    if args.costs:
        costs = json.loads(Path(args.costs).read_text())
    else:
        print(f"tracing {len({c.trace_key for c in configs})} configurations on {args.workers} CPU workers",
              flush=True)
        costs = trace_costs(configs + [c for m in models for c in calibration_sizes(m)], args.workers)
        (out / "speed_costs.json").write_text(json.dumps(costs))
    print(f"traced in {time.perf_counter() - started:.0f}s", flush=True)
    if args.trace_only:
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --trace-only here, or on the GPU machine")
    deadline = started + args.budget_s
    print("calibrating", flush=True)
    calibrations = calibrate_models(models, costs, deadline)
    print("measuring", flush=True)
    measured = measure(configs, deadline)
    result = report(configs, costs, measured, calibrations)
    gpu = torch.cuda.get_device_name()
    result.update(gpu=gpu, torch=torch.__version__, cuda=str(torch.version.cuda),
                  date=dt.date.today().isoformat(), elapsed_s=time.perf_counter() - started,
                  calibrations={k: (v.to_dict() if v else None) for k, v in calibrations.items()})
    name = stem("speed_model", card(gpu), torch.__version__)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    md = _markdown(result)
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"wrote {out / name}.{{json,md}} in {result['elapsed_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
