"""Checkpoint modes on a GPU: does memfit predict the memory of each, and which is fastest? (issue 15 item 3)

Three models, every block checkpointed in each ``Workload.checkpoint_mode`` (and none): memfit's GPT-2 (12 blocks,
1024 tokens, bf16, micro-batch 8), ViT-B/16 (12 blocks, bf16, 64 images) and ResNet-50 (16 bottlenecks, fp32, 64
images), each in TrainStep's loss-only loop (``keep_output=False``), as ``plan`` predicts them.

* **Memory**: each (model, mode) runs memfit's protocol (``memfit.workload.protocol``, 3 steps) in a fresh process,
  so no allocator cache or cuBLAS handle carries over: ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` against the estimate of exactly that configuration (``peak_allocated_bytes``,
  ``peak_reserved_bytes``; ``fits_in_bytes`` alongside).
* **Speed**: per model, one process builds the four variants and times ``--steps`` optimizer steps of each in
  ``--rounds`` interleaved rounds (CUDA-synchronised wall time; the median per variant), against the speed
  model's prediction of the same configuration (roofline, for the card).

The estimates come from a CPU run committed beforehand (``--predict``, about 2 minutes on a 2-core CPU), so the
GPU machine only measures:

    python benchmarks/plan/checkpoint_modes_device.py --predict --out benchmarks/results/plan        # CPU
    python benchmarks/plan/checkpoint_modes_device.py --out $OUT                                      # GPU, ~3 min
    python benchmarks/plan/checkpoint_modes_device.py --tiny --predict --out /tmp/ck && \\
        python benchmarks/plan/checkpoint_modes_device.py --tiny --out /tmp/ck                        # CPU dry run

Writes ``checkpoint_modes_predictions_cpu_torch<X.Y>_<date>.json`` (``--predict``) and
``checkpoint_modes_<card>_torch<X.Y>_<date>.json``; committed results go to ``benchmarks/results/plan/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE.parent))

from _results import card, latest, stem  # noqa: E402

MODES = ("none", "full", "selective", "reentrant")
MODELS = {"gpt2": 8, "vit_b16": 64, "resnet50": 64}  # built-in workload -> micro-batch


def workload(name: str, mode: str, tiny: bool) -> Any:
    """The built-in ``name`` at its micro-batch, every block checkpointed in ``mode`` (``none``: no block)."""
    import torch

    from memfit.workload.knobs import checkpoint_candidates
    from memfit.workload.models import GPT, ResNet, ViT
    from memfit.workload.zoo import builtin_workload

    w = builtin_workload(name).replace(batch_size=MODELS[name], accumulation_steps=1, keep_output=False)
    if tiny:  # the same code paths, small enough for a CPU
        small = {"gpt2": lambda: GPT(vocab=512, seq_len=128, dim=128, layers=2, heads=4),
                 "vit_b16": lambda: ViT(image=64, patch=8, dim=128, layers=2, heads=4, classes=10),
                 "resnet50": lambda: ResNet(layers=(1, 1, 1, 1), num_classes=10)}[name]
        batch = {"gpt2": lambda n: (torch.randint(0, 512, (n, 128)), torch.randint(0, 512, (n, 128))),
                 "vit_b16": lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))),
                 "resnet50": lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,)))}[name]
        w = w.replace(model=small, batch=batch, batch_size=2)
    if mode == "none":
        return w
    with torch.device("meta"):
        blocks = tuple(checkpoint_candidates(w.model()))
    return w.replace(checkpoint=blocks, checkpoint_mode=mode)


def predict(tiny: bool) -> dict[str, Any]:
    """memfit's estimate and predicted step time of every (model, mode), on this machine's CPU."""
    from memfit import estimate
    from memfit.speed.step_time import predict_step_time

    out: dict[str, Any] = {}
    for name in MODELS:
        for mode in MODES:
            started = time.perf_counter()
            e = estimate(workload(name, mode, tiny), gpu="h100")
            out[f"{name}/{mode}"] = {
                "peak_allocated_bytes": e.peak_allocated_bytes, "peak_reserved_bytes": e.peak_reserved_bytes,
                "fits_in_bytes": e.fits_in_bytes, "fits_in_upper_bytes": e.fits_in_upper_bytes,
                "peak_phase": e.peak_phase, "peak_op": e.peak_op,
                # memfit's H100 and H200 differ in no allocator rule: one memory estimate, a time per card
                "step_ms": {g: predict_step_time(e.cost, g).step_time_s * 1e3 for g in ("h100", "h200")},
                "estimate_s": time.perf_counter() - started,
            }
            print(name, mode, out[f"{name}/{mode}"]["peak_allocated_bytes"], flush=True)
    return out


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def measure_memory(name: str, mode: str, tiny: bool) -> dict[str, Any]:
    """Peak allocated and reserved over the protocol, in this (fresh) process."""
    import torch

    from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps

    w, device = workload(name, mode, tiny), _device()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, optimizer, batch = build(w, device)
    scaler = torch.amp.GradScaler(device) if w.precision == "fp16" else None
    run_steps(w, model, optimizer, batch, autocast_device=device, scaler=scaler, steps=DEFAULT_STEPS)
    if not cuda:  # a dry run: the code paths, no memory to read
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    torch.cuda.synchronize()
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def measure_speed(name: str, tiny: bool, rounds: int, steps: int) -> dict[str, Any]:
    """Median ms per optimizer step of each mode of ``name``, timed in interleaved rounds in this process."""
    import torch

    from memfit.workload.protocol import build, run_steps

    device = _device()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    built = {}
    for mode in MODES:
        w = workload(name, mode, tiny)
        built[mode] = (w, *build(w, device))
        run_steps(w, *built[mode][1:], autocast_device=device, scaler=None, steps=2)  # optimizer state, warm-up
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            w, model, optimizer, batch = built[mode]
            sync()
            start = time.perf_counter()
            run_steps(w, model, optimizer, batch, autocast_device=device, scaler=None, steps=steps)
            sync()
            times[mode].append((time.perf_counter() - start) / steps * 1e3)
    return {m: {"median_ms": statistics.median(t), "rounds_ms": t} for m, t in times.items()}


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--predict", action="store_true", help="CPU: write memfit's estimates for the GPU run to read")
    ap.add_argument("--predictions", type=Path, help="the --predict file (default: the newest under --out, then "
                    "benchmarks/results/plan/)")
    ap.add_argument("--tiny", action="store_true", help="small models: a dry run of every code path on a CPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed round")
    ap.add_argument("--memory", nargs=2, help=argparse.SUPPRESS)  # child: NAME MODE
    ap.add_argument("--speed", help=argparse.SUPPRESS)  # child: NAME
    args = ap.parse_args()
    if args.memory:
        print(json.dumps(measure_memory(*args.memory, args.tiny)))
        return
    if args.speed:
        print(json.dumps(measure_speed(args.speed, args.tiny, args.rounds, args.steps)))
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    tag = "checkpoint_modes_tiny" if args.tiny else "checkpoint_modes"
    if args.predict:
        result = {"schema": 1, "tiny": args.tiny, "torch": torch.__version__, "predictions": predict(args.tiny)}
        path = args.out / f"{stem(tag + '_predictions', 'cpu', torch.__version__)}.json"
        _write(path, result)
        return
    source = args.predictions or next(
        (p for p in sorted(args.out.glob(f"{tag}_predictions_*.json"))[::-1]), latest("plan", f"{tag}_predictions_"))
    predictions = json.loads(Path(source).read_text())["predictions"]
    flags = ["--tiny"] if args.tiny else []
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    for name in MODELS:
        for mode in MODES:
            measured = _child(["--out", str(args.out), *flags, "--memory", name, mode])
            est = predictions[f"{name}/{mode}"]
            row = {"estimate": est, "measured": measured}
            if measured.get("peak_allocated_bytes"):
                row["allocated_est_over_measured"] = est["peak_allocated_bytes"] / measured["peak_allocated_bytes"]
                row["reserved_est_over_measured"] = est["peak_reserved_bytes"] / measured["peak_reserved_bytes"]
            rows[f"{name}/{mode}"] = row
            print(name, mode, {k: v for k, v in row.items() if k != "estimate"}, flush=True)
        speed = _child(["--out", str(args.out), *flags, "--speed", name, "--rounds", str(args.rounds),
                        "--steps", str(args.steps)])
        for mode in MODES:
            rows[f"{name}/{mode}"]["step_ms"] = speed.get(mode, speed)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    gpu = card(device)
    for row in rows.values():  # the speed model's ranking against the measured one, per model
        row["predicted_step_ms"] = row["estimate"]["step_ms"].get(gpu if gpu in ("h100", "h200") else "h100")
    result = {"schema": 1, "tiny": args.tiny, "device": device or "cpu", "torch": torch.__version__,
              "predictions_file": str(source), "elapsed_s": time.perf_counter() - started, "rows": rows}
    _write(args.out / f"{stem(tag, gpu, torch.__version__)}.json", result)


def _write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
