"""Does memfit predict torchao's 8-bit and CPU-offloaded Adam? (issue 15, item 5)

For GPT-2 small (the built-in ``gpt2``: bf16, 8 × 1024 tokens, AdamW) and a conv net (the built-in ``unet2d``:
fp32, AdamW), each with ``optimizer_state`` full, 8bit (torchao's ``AdamW8bit``) and cpu_offload (torchao's
``CPUOffloadOptimizer``):

* **memory**: memfit's protocol (3 steps) in a fresh process per configuration; peak allocated and reserved, and
  the optimizer phase of the last step alone (its peak above what was allocated as it began: the 8-bit update's
  scratch, ``memfit.estimate.optimizer_twins.EIGHT_BIT_SCRATCH_FP32``), against memfit's estimates made on this
  machine's CPU. For 8bit, the buffers inductor's generated code allocates (``TORCH_LOGS=output_code``): what the
  scratch rule should say on this GPU;
* **speed**: the three optimizers of a workload resident in one process, timed in interleaved rounds
  (CUDA-synchronised steps), against memfit's roofline;
* **host**: this machine's fused CPU AdamW rate (``memfit.speed.step_time.HOST_ADAM_BYTES_PER_S``) and pinned
  copy rates each way (``GpuSpec.host_link_gbs``).

torchao is installed from a wheel in ``.whl-optim/`` (into a folder of its own, put on the path) when it is not
importable. About 4 minutes on an H100 (not yet run), most of it torch.compile of the 8-bit updates: one graph
per parameter shape, 9 for GPT-2 and 28 for the U-Net; ``--workloads gpt2`` and ``--workloads unet2d`` split it.

    python benchmarks/plan/optimizer_state_device.py --out $OUT                   # GPU
    python benchmarks/plan/optimizer_state_device.py --out /tmp/os --estimate-only  # CPU: the estimates alone

Writes ``optimizer_state_<card>_torch<X.Y>_<yyyymmdd>.json`` under ``--out``; committed results go to
``benchmarks/results/plan/``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from optimizer_state_cpu import host_adamw  # noqa: E402

from _results import card, stem  # noqa: E402

WORKLOADS = ("gpt2", "unet2d")
STATES = ("full", "8bit", "cpu_offload")
AO_SITE = Path("/tmp/memfit-torchao")
ROUNDS, STEPS_PER_ROUND, WARMUP = 4, 3, 2
_BUFFER = re.compile(r"(buf\d+) = empty_strided_cuda\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")


def ensure_torchao() -> str | None:
    """torchao importable (installing the carried wheel if needed); its version, or None without it."""
    try:
        import torchao

        return str(torchao.__version__)
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(REPO / ".whl-optim" / "torchao-*.whl")))
    if not wheels:
        return None
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(AO_SITE), wheels[-1]], check=True)
    sys.path.insert(0, str(AO_SITE))
    import torchao

    return str(torchao.__version__)


def workload(name: str, state: str) -> Any:
    from memfit.workload.zoo import builtin_workload

    return builtin_workload(name).replace(optimizer_state=state)


def measure_memory(name: str, state: str) -> dict[str, Any]:
    """One configuration in this (fresh) process: the protocol's peaks, and its last optimizer phase alone."""
    import torch

    from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps

    w = workload(name, state)
    marks: dict[str, int] = {}

    def phase(p: str, step: int) -> None:
        if p == "optimizer" and step == DEFAULT_STEPS - 1:
            torch.cuda.synchronize()
            marks["peak_before"] = torch.cuda.max_memory_allocated()
            marks["optimizer_base"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if p == "end":
            torch.cuda.synchronize()
            marks["optimizer_peak"] = torch.cuda.max_memory_allocated()

    torch.cuda.reset_peak_memory_stats()
    model, optimizer, batch = build(w, "cuda")
    scaler = torch.amp.GradScaler("cuda") if w.precision == "fp16" else None
    start = time.perf_counter()
    run_steps(w, model, optimizer, batch, autocast_device="cuda", scaler=scaler, steps=DEFAULT_STEPS, phase=phase)
    torch.cuda.synchronize()
    return {
        "workload": name, "optimizer_state": state, "optimizer": type(optimizer).__name__,
        "peak_allocated_bytes": max(marks["peak_before"], marks["optimizer_peak"]),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "optimizer_phase_rise_bytes": marks["optimizer_peak"] - marks["optimizer_base"],
        "protocol_s": time.perf_counter() - start, "device": torch.cuda.get_device_name(),
    }


def time_states(name: str) -> dict[str, Any]:
    """The three optimizers of ``name`` resident together, timed in interleaved rounds: median ms per step."""
    import torch

    from memfit.workload.protocol import build, run_steps

    built = {s: (workload(name, s), *build(workload(name, s), "cuda")) for s in STATES}

    def steps(s: str, n: int) -> float:
        w, model, optimizer, batch = built[s]
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_steps(w, model, optimizer, batch, autocast_device="cuda", scaler=None, steps=n)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e3

    for s in STATES:
        steps(s, WARMUP)  # the first step creates the states (and compiles the 8-bit updates)
    times: dict[str, list[float]] = {s: [] for s in STATES}
    for r in range(ROUNDS):
        for s in (STATES if r % 2 == 0 else tuple(reversed(STATES))):
            times[s].append(steps(s, STEPS_PER_ROUND))
    return {s: {"median_ms": statistics.median(v), "rounds_ms": v} for s, v in times.items()}


def host_rates() -> dict[str, Any]:
    """Fused CPU AdamW bytes/s (7 tensor passes of 4 bytes per element) and pinned copy GB/s each way."""
    import torch

    adamw = host_adamw(50_000_000)
    out: dict[str, Any] = {"host_adamw_bytes_per_s": adamw["bytes_per_s"], "cpu_threads": adamw["threads"]}
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for label, dst, src in (("d2h_gbs", host, dev), ("h2d_gbs", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[label] = 10 * host.numel() / (time.perf_counter() - start) / 1e9
    return out


def estimates(gpu: str, names: list[str]) -> dict[str, dict[str, Any]]:
    import torch

    from memfit import estimate
    from memfit.speed.step_time import predict_step_time
    from memfit.workload.optimizer_state import EIGHT_BIT_BLOCK, quantized

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        with torch.device("meta"):
            sizes = [p.numel() for p in workload(name, "full").model().parameters()]
        scratch = max((2 * 4 * n + 2 * 4 * (n // EIGHT_BIT_BLOCK) for n in sizes if quantized(n)), default=0)
        for state in STATES:
            start = time.perf_counter()
            e = estimate(workload(name, state), gpu=gpu)
            speed = predict_step_time(e.cost, gpu) if e.cost is not None else None
            out[f"{name}/{state}"] = {
                "peak_allocated_bytes": e.peak_allocated_bytes, "peak_reserved_bytes": e.peak_reserved_bytes,
                "fits_in_bytes": e.fits_in_bytes, "fits_in_upper_bytes": e.fits_in_upper_bytes,
                "optimizer_state_bytes": e.breakdown.get("optimizer_state", 0), "peak_phase": e.peak_phase,
                "uncertainty": [u.reason for u in e.uncertainty],
                "predicted_step_ms": speed.step_time_s * 1e3 if speed else None,
                "predicted_host_ms": speed.host_s * 1e3 if speed else None,
                "rule_8bit_scratch_bytes": scratch if state == "8bit" else 0, "estimate_s": time.perf_counter() - start,
            }
    return out


def _child(args: list[str], env_extra: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    env = {**os.environ, **(env_extra or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(AO_SITE) if AO_SITE.exists() else "",
                                                       os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"}, ""
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def inductor_buffers(log: str) -> list[list[Any]]:
    """(shape, dtype) of every buffer the generated code allocates, once per distinct one."""
    seen: dict[tuple[str, str], None] = {}
    for _, shape, _, dtype in _BUFFER.findall(log):
        seen[(shape.strip().rstrip(","), dtype)] = None
    return [[s, d] for s, d in seen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--estimate-only", action="store_true", help="no GPU: write the estimates alone")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                    help="a subset (one device call each, when time is short)")
    ap.add_argument("--memory", nargs=2, metavar=("WORKLOAD", "STATE"), help=argparse.SUPPRESS)  # a child
    ap.add_argument("--time", metavar="WORKLOAD", help=argparse.SUPPRESS)  # a child
    args = ap.parse_args()
    if args.memory:
        ensure_torchao()
        print(json.dumps(measure_memory(*args.memory)))
        return
    if args.time:
        ensure_torchao()
        print(json.dumps(time_states(args.time)))
        return
    import torch

    ao = ensure_torchao()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.estimate_only else None
    gpu = card(device) if device and card(device) in ("h100", "h200", "a100", "rtx4090") else "h100"
    result: dict[str, Any] = {"schema": 1, "torch": torch.__version__, "torchao": ao, "gpu_for_estimates": gpu,
                              "workloads": args.workloads, "states": list(STATES)}
    start = time.perf_counter()
    result["estimate"] = estimates(gpu, args.workloads)
    result["estimate_wall_s"] = time.perf_counter() - start
    if device is not None:
        if ao is None:
            raise SystemExit("torchao is not importable and no wheel is in .whl-optim/: carry one (see the report).")
        result["host"] = host_rates()
        measured: dict[str, Any] = {}
        for name in args.workloads:
            for state in STATES:
                extra = {"TORCH_LOGS": "output_code"} if state == "8bit" else None
                m, log = _child(["--out", str(args.out), "--memory", name, state], extra)
                if state == "8bit":
                    m["inductor_buffers"] = inductor_buffers(log)
                est = result["estimate"][f"{name}/{state}"]
                if "peak_allocated_bytes" in m:
                    m["estimate_over_measured"] = est["peak_allocated_bytes"] / m["peak_allocated_bytes"]
                    m["upper_over_measured_allocated"] = est["fits_in_upper_bytes"] / m["peak_allocated_bytes"]
                measured[f"{name}/{state}"] = m
            timing, _ = _child(["--out", str(args.out), "--time", name])
            result.setdefault("timing", {})[name] = timing
        result["measured"] = measured
        result["device"] = device
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.workloads == list(WORKLOADS) else "_" + "_".join(args.workloads)
    path = args.out / f"{stem('optimizer_state' + suffix, card(device), torch.__version__)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file
    print(json.dumps({k: v for k, v in result.items() if k not in ("estimate",)}, indent=1)[:6000])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
