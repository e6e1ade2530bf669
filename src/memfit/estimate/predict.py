"""``estimate()``: predict a training step's peak GPU memory without a GPU.

Three stages: trace the protocol on fake tensors with CUDA semantics (``trace.py``), replay the allocation stream
through a model of PyTorch's caching allocator (``allocator.py``), and read the answers off the replay: peak
allocated, peak reserved, the smallest memory cap that runs without OOM, and what is alive at the peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memfit.estimate.allocator import (
    ALLOC,
    SOFT_ALLOC,
    AllocatorConfig,
    CachingAllocator,
    replay,
    smallest_fitting_capacity,
)
from memfit.estimate.bound import Uncertainty, upper_bound
from memfit.estimate.categories import TRACED_CATEGORIES, MemoryCategory, TracedCategory
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.op_costs import StepCost
from memfit.estimate.trace import OldObjectsFrozen, trace_workload
from memfit.estimate.trace_record import Trace
from memfit.records import JsonRecord, json_as
from memfit.workload.protocol import DEFAULT_STEPS
from memfit.workload.spec import Workload

SCHEMA = 1
_TIMELINE_POINTS = 1500
# Where cudaMalloc places each segment decides best-fit ties and so fragmentation; no CPU trace knows it. Real
# H200 traces replayed without their addresses were off by up to 4 % in reserved bytes (docs/allocator.md), and
# fits_in without a margin came out 3.4 % low on the worst of 14 suite workloads
# (benchmarks/results/estimate/estimate_accuracy_h200_torch2.11_20261126.md, fits_in_replay): fits_in carries this
# margin on top of the replay.
FITS_IN_MARGIN = 0.015
_SEGMENT = 2 << 20
_LARGEST = 12


@dataclass(frozen=True)
class TensorAtPeak:
    """A tensor alive at the peak."""

    nbytes: int
    category: TracedCategory
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    phase: str
    step: int


@dataclass(frozen=True)
class TimelinePoint:
    """Allocated bytes just after one allocator event (the largest in its stretch of the downsampled timeline)."""

    event: int
    allocated_bytes: int
    phase: str
    step: int
    by_category: dict[TracedCategory, int] = field(default_factory=dict)
    """``allocated_bytes`` split by category (every ``TracedCategory``); the values sum to it."""


def _cost_totals(cost: StepCost | None) -> dict[str, Any] | None:
    """The cost as ``Estimate.to_dict`` writes it: the totals a report needs, not the per-op rows (thousands)."""
    if cost is None:
        return None
    d = cost.to_dict()
    for phase in ("forward", "backward", "optimizer"):
        del d[phase]["ops"]
    return d


@dataclass(frozen=True)
class Estimate(JsonRecord):
    """The predicted memory of one training step (3 steps of the protocol, maximum over them)."""

    _schema: ClassVar[int] = SCHEMA

    workload: str
    batch_size: int
    precision: str
    gpu: str
    peak_allocated_bytes: int
    """What ``torch.cuda.max_memory_allocated()`` would report."""
    peak_reserved_bytes: int
    """What ``torch.cuda.max_memory_reserved()`` would report, with no memory cap."""
    fits_in_bytes: int
    """The smallest caching-allocator cap (``set_per_process_memory_fraction``) that runs without OOM, with a
    1.5 % margin for segment placement (see ``FITS_IN_MARGIN``)."""
    fits_in_replay_bytes: int
    """The same cap as the allocator replay finds it, before the margin."""
    device_bytes: int
    """``fits_in_bytes`` plus the CUDA context and other memory outside the allocator: what the GPU must have."""
    breakdown: dict[MemoryCategory, int]
    """Bytes by category at the allocated peak, plus ``fragmentation`` (fits_in - peak allocated)."""
    activations_by_module: dict[str, int]
    """Activation bytes held for backward at the end of the last forward, by module (qualified name)."""
    peak_phase: str
    peak_step: int
    peak_op: str
    peak_module: str
    largest_tensors: list[TensorAtPeak]
    timeline: list[TimelinePoint]
    # keyword-only so it can sit beside the timeline it indexes without reordering the fields after it
    phases: list[tuple[int, str, int]] = field(default_factory=list, kw_only=True)
    """Where each phase begins: (event index, phase, step), phases as the protocol names them (``data``,
    ``zero_grad``, ``forward``, ``loss``, ``backward``, ``optimizer``, ``end``); the indices match
    ``TimelinePoint.event``."""
    param_count: int
    steps: int
    warnings: list[str] = field(default_factory=list)
    cost: StepCost | None = field(default=None, metadata=json_as(_cost_totals))
    """FLOPs, bytes, kernels and dispatches of one steady-state micro-batch and optimizer step, for
    ``memfit.speed.step_time.predict_step_time``. ``to_dict`` keeps its totals, not its per-op rows."""
    keep_output: bool = field(default=True, kw_only=True)
    """The loop predicted: True, the plain loop that keeps the output alive through backward; False, the
    loss-only step (``Workload.keep_output``)."""
    fits_in_upper_bytes: int = field(kw_only=True)
    """A cap the step runs under with high confidence: ``fits_in`` widened by the method's base margin and by each
    reason in ``uncertainty`` (``memfit.estimate.bound``). "Fits" is decided with this number."""
    device_upper_bytes: int = field(kw_only=True)
    """``fits_in_upper_bytes`` plus the CUDA context: the GPU memory a "fits" verdict promises is enough."""
    uncertainty: list[Uncertainty] = field(default_factory=list, kw_only=True)
    """What widened the upper bound beyond the base margin, with where it happened."""
    elapsed_s: float = 0.0
    method: str = "fake-tensor trace + caching-allocator replay"
    schema: int = SCHEMA

    def margin_bytes(self, budget_bytes: int) -> int:
        """Budget minus ``device_upper_bytes``: positive means it fits, with that much to spare."""
        return budget_bytes - self.device_upper_bytes

    def fits(self, budget_bytes: int) -> bool:
        """Whether a GPU with ``budget_bytes`` for this process runs the step: decided with the upper bound."""
        return self.device_upper_bytes <= budget_bytes


def estimate(
    workload: Workload,
    *,
    gpu: str | GpuSpec | None = None,
    allocator: AllocatorConfig | None = None,
    steps: int = DEFAULT_STEPS,
    reuse_trace: Trace | None = None,
) -> Estimate:
    """Predict the peak GPU memory of ``workload``'s training step, on any machine, without touching a GPU.

    Args:
        workload: the training step.
        gpu: the GPU to predict for (name such as ``"h100"`` or a ``GpuSpec``); it sets library workspace sizes
            and the CUDA context. Default: H100.
        allocator: caching-allocator settings; default: read ``PYTORCH_CUDA_ALLOC_CONF`` from the environment.
        steps: training steps to simulate (optimizer state appears in step 1, the steady peak from step 2).
        reuse_trace: a ``Trace`` of this same workload and GPU (``memfit.estimate.trace.trace_workload``), to replay it
            under other allocator settings without tracing again.

    Example:
        >>> from memfit.workload.zoo import builtin_workload
        >>> est = estimate(builtin_workload("mlp").replace(batch_size=8))
        >>> est.peak_allocated_bytes > 0
        True
    """
    started = time.perf_counter()
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    trace = reuse_trace if reuse_trace is not None else trace_workload(workload, spec, steps=steps)
    with OldObjectsFrozen():  # no walk over every object in the process: see OldObjectsFrozen
        events = trace.events()
        analysis = _analyse(trace, events, config)
        # a cap below the allocated peak can never work; the search starts from there
        replayed = max(smallest_fitting_capacity(events, config), analysis["peak_allocated"])
        taken = _with_workspaces_taken(events, config, replayed)
    fits_in = -(-int(replayed * (1 + FITS_IN_MARGIN)) // _SEGMENT) * _SEGMENT
    breakdown = dict(analysis["breakdown"])
    breakdown["fragmentation"] = fits_in - analysis["peak_allocated"]
    reasons, extra = dict(trace.uncertain), dict(trace.uncertain_bytes)
    if taken > replayed:
        reasons["workspace_fallback"] = (
            f"the replay lets cuDNN do without a workspace where memory is short, as PyTorch falls back to an "
            f"algorithm that needs less; the fallback may need one too, so the bound assumes each is taken "
            f"({(taken - replayed) / 2**20:.0f} MiB more)")
        extra["workspace_fallback"] = taken - replayed
    upper, uncertainty = upper_bound(replayed, reasons, extra)
    upper = max(upper, fits_in)
    context = spec.context_bytes(trace.uses_cublas)
    return Estimate(
        workload=workload.name,
        batch_size=workload.batch_size,
        precision=workload.precision,
        gpu=spec.name,
        peak_allocated_bytes=analysis["peak_allocated"],
        peak_reserved_bytes=analysis["peak_reserved"],
        fits_in_bytes=fits_in,
        fits_in_replay_bytes=replayed,
        device_bytes=fits_in + context,
        breakdown=breakdown,
        activations_by_module=analysis["activations_by_module"],
        peak_phase=analysis["peak_phase"],
        peak_step=analysis["peak_step"],
        peak_op=analysis["peak_op"],
        peak_module=analysis["peak_module"],
        largest_tensors=analysis["largest"],
        timeline=analysis["timeline"],
        phases=[(int(at), str(name), int(step)) for at, name, step in trace.phase_marks],
        param_count=trace.param_count,
        steps=steps,
        warnings=list(trace.warnings),
        cost=StepCost.from_trace(trace, workload.batch_size),
        elapsed_s=time.perf_counter() - started,
        keep_output=workload.keep_output,
        fits_in_upper_bytes=upper,
        device_upper_bytes=upper + context,
        uncertainty=uncertainty,
    )


def _with_workspaces_taken(events: list[tuple[int, int, int]], config: AllocatorConfig, replayed: int) -> int:
    """The smallest cap at which ``events`` run with every optional allocation (a cuDNN workspace) taken; ``replayed``
    where the stream has none.

    ``smallest_fitting_capacity`` lets a workspace fail without an OOM, as PyTorch's cuDNN code catches it and tries
    the next algorithm (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``try_configs``). What the next one takes is not
    known: under a cap, smp's U-Net at 2048² on an H200 tried eighteen times a workspace of 1 GiB and ran one that took
    833 MiB, U-Net++ at 1536² forty and ran one that took nothing (entry_traces_capped9_h200_torch2.11_20261129_s35).
    And whether a workspace is refused can turn on a few MiB elsewhere: U-Net++'s own H200 stream needs 11.77 GB
    with its workspaces optional, memfit's trace of it 10.95 GB, and setting nine of the trace's forward workspaces
    to the GPU's sizes (13 -> 21 MiB, 216 -> 180 MiB, ...) moves it to 11.77 GB, none of them alone
    (op_blocks_h200_torch2.11_20261130_s36). The bound takes the larger of the two."""
    if not any(op == SOFT_ALLOC for op, _, _ in events):
        return replayed
    taken = [(ALLOC if op == SOFT_ALLOC else op, key, nbytes) for op, key, nbytes in events]
    if replay(taken, config, capacity_bytes=replayed).oom_index is None:
        return replayed  # no workspace was refused at the replayed cap: one replay instead of a search
    return max(smallest_fitting_capacity(taken, config, fails_at=replayed), replayed)


def _analyse(trace: Any, events: list[tuple[int, int, int]], config: AllocatorConfig) -> dict[str, Any]:
    """One replay for the peaks and the timeline, a second up to the peak for what is alive there."""
    sim = CachingAllocator(config)
    sizes: dict[int, int] = {}
    allocated_after: list[int] = []
    peak, peak_index = -1, 0
    for i, (op, key, nbytes) in enumerate(events):
        if op > 0:
            sizes[key] = sim.malloc(key, nbytes)
        else:
            sim.free(key)
        allocated_after.append(sim.allocated_bytes)
        if sim.allocated_bytes > peak:
            peak, peak_index = sim.allocated_bytes, i
    live = _live_before(events, sizes, peak_index + 1)

    allocs = trace.allocs
    breakdown: dict[TracedCategory, int] = dict.fromkeys(TRACED_CATEGORIES, 0)
    for key, size in live.items():
        cat = allocs[key].category
        breakdown[cat] = breakdown.get(cat, 0) + size
    largest = [
        TensorAtPeak(size, a.category, a.module, a.op, a.shape, a.dtype, a.phase, a.step)
        for key, size in sorted(live.items(), key=lambda kv: -kv[1])[:_LARGEST]
        for a in (allocs[key],)
    ]
    peak_alloc = allocs[events[peak_index][1]]
    phase, step = trace.phase_at(peak_index)
    return {
        "peak_allocated": sim.peak_allocated_bytes,
        "peak_reserved": sim.peak_reserved_bytes,
        "breakdown": breakdown,
        "largest": largest,
        "peak_phase": phase,
        "peak_step": step,
        "peak_op": peak_alloc.op,
        "peak_module": peak_alloc.module,
        "activations_by_module": _activations_at_end_of_forward(trace, events, sizes),
        "timeline": _timeline(trace, events, sizes, allocated_after),
    }


def _live_before(events: list[tuple[int, int, int]], sizes: dict[int, int], end: int) -> dict[int, int]:
    """Block size of every allocation alive after ``events[:end]``, by key."""
    live: dict[int, int] = {}
    for op, key, _ in events[:end]:
        if op > 0:
            live[key] = sizes[key]
        else:
            live.pop(key, None)
    return live


def _activations_at_end_of_forward(trace: Any, events: list[tuple[int, int, int]], sizes: dict[int, int]) -> dict[str, int]:
    last_backward = max((at for at, name, _ in trace.phase_marks if name == "backward"), default=len(events))
    live = _live_before(events, sizes, last_backward)
    by_module: dict[str, int] = {}
    for key, size in live.items():
        a = trace.allocs[key]
        if a.category == "activations":
            by_module[a.module or "(model)"] = by_module.get(a.module or "(model)", 0) + size
    return dict(sorted(by_module.items(), key=lambda kv: -kv[1]))


def _timeline(
    trace: Any, events: list[tuple[int, int, int]], sizes: dict[int, int], allocated_after: list[int]
) -> list[TimelinePoint]:
    """Downsample to at most _TIMELINE_POINTS, keeping each bucket's maximum so the peak survives.

    A second pass over the events keeps a running sum of block bytes per category and snapshots it at the kept
    points: block sizes (not requests) so the parts add up to ``allocated_bytes`` exactly.
    """
    n = len(allocated_after)
    bucket = max(1, -(-n // _TIMELINE_POINTS))
    kept = []
    for start in range(0, n, bucket):
        chunk = allocated_after[start : start + bucket]
        kept.append(start + max(range(len(chunk)), key=chunk.__getitem__))
    allocs = trace.allocs
    running = dict.fromkeys(TRACED_CATEGORIES, 0)
    points = []
    marks = trace.phase_marks
    m = 0
    phase, step = "init", 0
    i = 0
    for index in kept:
        for op, key, _ in events[i : index + 1]:
            cat = allocs[key].category
            running[cat] = running.get(cat, 0) + (sizes[key] if op > 0 else -sizes[key])
        i = index + 1
        while m < len(marks) and marks[m][0] <= index:
            _, phase, step = marks[m]
            m += 1
        points.append(TimelinePoint(index, allocated_after[index], phase, step, dict(running)))
    return points
