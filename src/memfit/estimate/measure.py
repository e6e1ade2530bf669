"""``measure()``: run the protocol for real on a CUDA GPU and report the same fields as ``estimate()``.

The smallest memory cap that runs without OOM is found by bisection over
``torch.cuda.set_per_process_memory_fraction``, each try in a fresh process so no allocator cache carries over, and
checked at a few caps above it: a larger cap can run out of memory where a smaller one ran.
Run ``python -m memfit.estimate.measure SPEC [--cap-bytes N]`` to get one try as JSON (what the bisection calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memfit import _torch_private as tp
from memfit._io import atomic_open
from memfit.errors import DeviceError
from memfit.records import JsonRecord
from memfit.workload.loading import load_workload
from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps_on_cuda

SCHEMA = 1
TRIAL_MODULE = "memfit.estimate.measure"
"""What ``run_trial`` runs with ``python -m``: this module, whose ``__main__`` block runs one trial."""


@dataclass(frozen=True)
class Trial(JsonRecord):
    """One run of the protocol in its own process, optionally under a memory cap."""

    # a part of a Measurement, versioned by it; the line a trial process prints is read by its parent, the same memfit
    _schema: ClassVar[int | None] = None

    ok: bool
    cap_bytes: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    outside_allocator_bytes: int
    num_alloc_retries: int
    elapsed_s: float
    error: str = ""
    cudnn_benchmark: bool = False
    """Whether ``torch.backends.cudnn.benchmark`` was on when the run ended (the step's code turned it on)."""


@dataclass(frozen=True)
class Measurement(JsonRecord):
    """Measured memory of the protocol on a real GPU."""

    _schema: ClassVar[int] = SCHEMA

    workload: str
    batch_size: int
    precision: str
    gpu: str
    total_bytes: int
    torch_version: str
    cuda_version: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits_in_bytes: int | None
    """Smallest cap found by bisection (None when the bisection was skipped)."""
    device_bytes: int | None
    """fits_in_bytes plus what lived outside the allocator (context, handles) in the uncapped run."""
    outside_allocator_bytes: int
    trials: list[Trial] = field(default_factory=list)
    snapshot_path: str | None = None
    schema: int = SCHEMA
    cudnn_benchmark: bool = False
    """The step ran with cuDNN's benchmark mode on: its peaks count the algorithm search's workspaces, which take
    what memory the GPU has free; ``fits_in_bytes`` is what the step needs (``measure`` bisects it from 0)."""


def _spec_args(spec: str, batch_size: int | None, precision: str | None,
               changes: dict[str, Any] | None = None) -> list[str]:
    args = [spec]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    if precision is not None:
        args += ["--precision", precision]
    if changes:
        args += ["--changes", json.dumps(changes)]
    return args


def _apply_changes(workload: Any, changes: dict[str, Any]) -> Any:
    """``Workload.replace`` from JSON, where tuples arrive as lists."""
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
    return workload.replace(**fixed)


def run_trial(
    spec: str, *, batch_size: int | None = None, precision: str | None = None, cap_bytes: int | None = None,
    snapshot: str | None = None, trace: str | None = None, timeout_s: float = 600,
    changes: dict[str, Any] | None = None, allocator_conf: str | None = None,
) -> Trial:
    """One protocol run in a fresh Python process (``allocator_conf``: its ``PYTORCH_CUDA_ALLOC_CONF``)."""
    cmd = [sys.executable, "-m", TRIAL_MODULE, *_spec_args(spec, batch_size, precision, changes)]
    if cap_bytes is not None:
        cmd += ["--cap-bytes", str(cap_bytes)]
    if snapshot:
        cmd += ["--snapshot", snapshot]
    if trace:
        cmd += ["--trace", trace]
    env = os.environ.copy()
    if allocator_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator_conf
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return Trial(False, cap_bytes, 0, 0, 0, 0, 0.0, error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    return Trial(**json.loads(lines[-1]))


ABOVE_TRIALS = 3
"""Capped runs ``measure`` adds above its bisection's answer (``memfit.estimate.allocator`` walks every cap above
its own; a GPU run costs seconds, so here a few evenly spaced ones). On an H200 they found PVT-v2's out-of-memory
window (3.80 -> 3.93 GB) and missed FCN-ResNet50's and Video Swin-T's, narrower than their spacing
(benchmarks/results/estimate/measure_check_above_h200_torch2.11_20261129_s27/)."""


def measure(
    spec: str,
    *,
    batch_size: int | None = None,
    precision: str | None = None,
    bisect: bool = True,
    tolerance: float = 0.005,
    snapshot: str | None = None,
    hint_bytes: int | None = None,
    trace: str | None = None,
    changes: dict[str, Any] | None = None,
) -> Measurement:
    """Measure ``spec`` (a built-in name or ``file.py[:name]``) on the current GPU.

    Args:
        bisect: also find the smallest cap that runs, and check ``ABOVE_TRIALS`` caps above it (several fresh
            processes).
        tolerance: stop the bisection when the bracket is narrower than this fraction of the peak.
        snapshot: write a memory snapshot (pytorch.org/memory_viz) of the uncapped run to this path.
        hint_bytes: a predicted cap (e.g. ``Estimate.fits_in_bytes``) to start the bracket near.
        changes: ``Workload`` fields to change first (a fix or a plan's configuration), as JSON-able values.
    """
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("memfit measure needs a CUDA GPU and none is visible. Use `memfit estimate` instead.")
    props = torch.cuda.get_device_properties(0)
    first = run_trial(spec, batch_size=batch_size, precision=precision, snapshot=snapshot, trace=trace,
                      changes=changes)
    if not first.ok:
        raise DeviceError(f"the uncapped run of {spec} failed: {first.error}")
    trials = [first]
    fits_in = None
    if bisect:
        # invariant: `hi` runs, `lo` does not. The cap can never be below the allocated peak, unless the step takes
        # what memory it is given. cuDNN's benchmark mode times each new convolution's algorithms with a workspace as
        # large as the largest of them asks, halved until the caching allocator grants it, then runs the fastest whose
        # workspace it can allocate (aten/src/ATen/native/cudnn/Conv_v8.cpp: get_plans_from_find, try_plans). On an
        # H200 torchvision's FCN-ResNet101 (fp32) so peaked at 83.6 GB uncapped and ran under a 15.4 GB cap (14 steps:
        # benchmarks/results/estimate/cudnn_benchmark_draw_h200_torch2.11_20261130_s37.md). Then the bracket starts
        # at 0 and narrows to a fraction of its top
        greedy = first.cudnn_benchmark
        lo, hi = (0 if greedy else first.peak_allocated_bytes - 1), first.peak_reserved_bytes

        def step_at(hi: int) -> int:
            return max(int(tolerance * (hi if greedy else first.peak_allocated_bytes)), 2 << 20)
        if hint_bytes is not None and lo < hint_bytes < hi:
            t = run_trial(spec, batch_size=batch_size, precision=precision, cap_bytes=hint_bytes, changes=changes)
            trials.append(t)
            lo, hi = (lo, hint_bytes) if t.ok else (hint_bytes, hi)

        def runs(cap: int) -> bool:
            t = run_trial(spec, batch_size=batch_size, precision=precision, cap_bytes=cap, changes=changes)
            trials.append(t)
            return t.ok

        def narrow(lo: int, hi: int) -> int:
            while hi - lo > step_at(hi):
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if runs(mid) else (mid, hi)
            return hi

        fits_in = narrow(lo, hi)
        # a larger cap can run out of memory where a smaller one ran (FCN-ResNet50 on an H200: ran under 4.76 and
        # 4.80 GB, out of memory under 4.84, ran under 4.88): try caps above the answer, up to the uncapped peak
        # reserved (which runs), from the top down, and go above the highest that fails
        top = first.peak_reserved_bytes
        spacing = (top - fits_in) // (ABOVE_TRIALS + 1)
        if spacing > step_at(fits_in):
            passing = top
            for cap in range(top - spacing, fits_in, -spacing):
                if not runs(cap):
                    fits_in = narrow(cap, passing)
                    break
                passing = cap
    return Measurement(
        workload=spec,
        batch_size=batch_size or 0,
        precision=precision or "",
        gpu=props.name,
        total_bytes=props.total_memory,
        torch_version=torch.__version__,
        cuda_version=str(torch.version.cuda),
        peak_allocated_bytes=first.peak_allocated_bytes,
        peak_reserved_bytes=first.peak_reserved_bytes,
        fits_in_bytes=fits_in,
        device_bytes=None if fits_in is None else fits_in + first.outside_allocator_bytes,
        outside_allocator_bytes=first.outside_allocator_bytes,
        trials=trials,
        snapshot_path=snapshot,
        cudnn_benchmark=first.cudnn_benchmark,
    )


def _write_snapshot(snap: dict, path: str) -> None:
    """The allocator's snapshot as the pickle pytorch.org/memory_viz reads, written atomically."""
    import pickle

    with atomic_open(path, what="the memory snapshot") as f:
        pickle.dump(snap, f)


def _write_compact_trace(snap: dict, path: str, stats: dict) -> None:
    """(action, addr, size, top python frame) per allocator event, gzip JSON: small enough to keep. Written
    atomically, so a trial killed mid-write leaves no truncated gzip for the allocator replays to choke on."""
    import gzip

    keep = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}
    events = []
    for entry in snap["device_traces"][0]:
        if entry["action"] not in keep:
            continue
        frames = entry.get("frames") or []
        where = next((f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames
                      if f["filename"].endswith(".py")), "")
        # an out-of-memory entry carries the device's free bytes where others carry an address
        # (torch/csrc/cuda/memory_snapshot.cpp): a capped run that ran out of memory, or retried, has one
        events.append((entry["action"], entry.get("addr", entry.get("device_free", 0)), entry["size"], where))
    with atomic_open(path, what="the allocator trace") as raw, gzip.open(raw, "wt") as f:
        json.dump({"events": events, "stats": {k: v for k, v in stats.items() if k.endswith("peak")}}, f)


def _trial_main(argv: list[str] | None = None) -> None:
    """The body of one trial process: run the protocol, print one JSON line."""
    parser = argparse.ArgumentParser(prog=f"python -m {TRIAL_MODULE}")
    parser.add_argument("spec")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--precision")
    parser.add_argument("--cap-bytes", type=int)
    parser.add_argument("--snapshot")
    parser.add_argument("--trace", help="write the allocator's alloc/free stream as gzip JSON (calibration)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--changes", help="JSON object of Workload fields to change (a fix or a plan)")
    args = parser.parse_args(argv)

    import torch

    workload = load_workload(args.spec)
    changes = {k: v for k, v in (("batch_size", args.batch_size), ("precision", args.precision)) if v}
    workload = workload.replace(**changes) if changes else workload
    if args.changes:
        workload = _apply_changes(workload, json.loads(args.changes))
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    if args.cap_bytes:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total))
    if args.snapshot or args.trace:
        tp.record_memory_history(True)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    ok, error = True, ""
    try:
        model, optimizer, batch = build(workload, "cuda")
        # fp16: until the optimizer really stepped (a fresh GradScaler skips it while its scale overflows)
        run_steps_on_cuda(workload, model, optimizer, batch, steps=args.steps)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as exc:
        ok, error = False, str(exc).splitlines()[0]
    stats = torch.cuda.memory_stats()
    free, total_now = torch.cuda.mem_get_info()
    outside = total_now - free - torch.cuda.memory_reserved()
    # a failed capped run's trace too: it shows how the allocator met the cap (segments freed, the OOM)
    if (args.snapshot and ok) or args.trace:
        snap = tp.memory_snapshot()
        if args.snapshot and ok:
            _write_snapshot(snap, args.snapshot)
        if args.trace:
            _write_compact_trace(snap, args.trace, stats)
        tp.record_memory_history(False)
    print(Trial(
        ok=ok,
        cap_bytes=args.cap_bytes,
        peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
        peak_reserved_bytes=stats.get("reserved_bytes.all.peak", 0),
        outside_allocator_bytes=outside,
        num_alloc_retries=stats.get("num_alloc_retries", 0),
        elapsed_s=time.perf_counter() - started,
        error=error,
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
    ).to_json())


if __name__ == "__main__":
    _trial_main()
