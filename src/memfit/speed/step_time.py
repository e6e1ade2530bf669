"""Predict how long a training step takes: a roofline of the traced ops, fitted to a few timed steps when a GPU
is at hand.

The trace (``trace.py``) counts, for every op of a steady-state micro-batch and optimizer step, its FLOPs by
dtype, the bytes it moves, the kernels it launches and the CPU dispatches it costs (``memfit.estimate.op_costs.StepCost``,
re-exported here; ``Estimate.cost`` carries one). The speed model runs those rows through two queues, the way
eager PyTorch runs them:

* the **CPU** dispatches each op (``dispatch_s`` per ATen op or module call, by phase, plus ``launch_s`` per
  kernel launch) and enqueues its kernels;
* the **GPU** runs a kernel once it is enqueued and the previous one has finished, for
  ``max(flops / (peak * compute_efficiency), bytes / (bandwidth * memory_efficiency)) + kernel_s`` per kernel.

A phase takes until both queues are done: ``gpu = max(gpu, cpu) + t_gpu`` op by op, so a GPU starved by short
kernels waits for the CPU and a CPU ahead of long kernels costs nothing. This beats both simpler choices: the
maximum of the CPU and GPU totals misses the stretches where each one waits for the other (a network whose
early layers are few large convolutions and whose late layers are many small ops), and the sum of per-op maxima
misses the CPU running ahead during long kernels. Forward, backward and optimizer each start from an idle GPU, as after a host sync, and
``step = accumulation * (forward + backward) + optimizer``.

Ignored: cache reuse between ops (each op streams its tensors through HBM), kernel concurrency, tile and wave
quantisation, clock throttling, data loading, the host-to-device copy of the batch, communication.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from memfit.errors import DeviceError, UsageError
from memfit.estimate.gpus import GpuSpec, detect_gpu, gpu_spec
from memfit.estimate.op_costs import PhaseCost, StepCost
from memfit.estimate.trace import trace_workload
from memfit.guard.oom import is_oom
from memfit.records import JsonRecord
from memfit.workload.protocol import build, run_steps_on_cuda
from memfit.workload.spec import Workload

log = logging.getLogger(__name__)

SCHEMA = 1
__all__ = [
    "Calibration", "CalibrationSample", "PhaseCost", "ROOFLINE", "SpeedParams", "SpeedPrediction", "StepCost",
    "calibrate", "fit_calibration", "predict_step_time",
]


# ------------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True, kw_only=True)
class SpeedParams:
    """The free constants of the speed model. ``ROOFLINE`` holds placeholders until measured; ``calibrate``
    fits them on the GPU at hand."""

    compute_efficiency: float = 0.6
    """Fraction of the datasheet peak that matmuls and convolutions reach. Placeholder until measured: cuBLAS
    reaches 60-80 % of peak on large GEMMs, cuDNN less on convolutions."""
    memory_efficiency: float = 0.75
    """Fraction of the datasheet bandwidth that memory-bound kernels reach. Placeholder until measured: large
    elementwise kernels stream at 80-90 %, small ones and reductions less."""
    kernel_s: float = 3e-6
    """GPU time every kernel takes on top of its roofline time (ramp-up, tail, the gap to the next kernel).
    Placeholder: NVIDIA's "Getting Started with CUDA Graphs" blog measures a 2.9 us kernel at 3.8 us per
    launch back to back."""
    launch_s: float = 2e-6
    """CPU time of one ``cudaLaunchKernel``. Not fitted: 1-3 us on CUDA 12 drivers (same blog; and
    jiahuanglin.xyz, "From PyTorch op to kernel launch")."""
    forward_dispatch_s: float = 12e-6
    """CPU time per ATen op or module call in forward (Python, autograd recording, dispatcher, allocator).
    Placeholder: eager PyTorch spends about 5-25 us of CPU per op before its kernel runs (same lesson)."""
    backward_dispatch_s: float = 12e-6
    """CPU time per ATen op in backward. The autograd engine runs no Python, but per op it costs about what
    forward does: fitted on an H200 (``benchmarks/results/speed/speed_model_h200_torch2.11_20261126.md``) it came
    out at 9.5 us (GPT-2) and 15.4 us (ResNet-50) against forward's 11.4 and 9.3 us, so the placeholder is
    forward's. It decides what checkpointing costs where the CPU is the bottleneck: ResNet-50's checkpointed
    backward dispatches 3.2 times the ops (recompute, saved-tensor detaches), and a micro-batch took 1.84 times as
    long (``benchmarks/results/speed/checkpoint_rng_cost_h200_20261126.json``)."""
    recompute_dispatch_s: float = 29e-6
    """CPU time per op (and module call) of a checkpointed module's recompute in backward: its Python forward
    again, plus ``torch.utils.checkpoint``'s saved-tensor hooks (a Python pack in forward, another in the
    recompute and an unpack in backward for each saved tensor: 29 per ResNet bottleneck). Fitted on the H200
    grid of ``benchmarks/plan_quality.py``
    (``benchmarks/results/plan/plan_grid_h200_torch2.11_20261126/plan_quality_resnet50.json``): with all 16
    bottlenecks checkpointed, a CPU-bound micro-batch of 8 or 16 took 2.3-3.3 times as long, which the model
    reproduces at 29 us (forward: 12). Not fitted by ``calibrate`` (its timings have no checkpointing)."""
    reentrant_recompute_dispatch_s: float = 18e-6
    """``recompute_dispatch_s`` for reentrant checkpointing (``use_reentrant=True``), which runs the recompute and
    the block's backward as one inner backward, with no saved-tensor hooks. Derived, not fitted: of
    ``recompute_dispatch_s`` 12 us is the forward's dispatch and 17 us non-reentrant checkpointing's hooks; on a
    chain of small ops, reentrant checkpointing's Python costs 0.33 of non-reentrant's (2.5 against 7.5 us per op,
    forward and backward, on a 2-core CPU; benchmarks/results/speed/checkpoint_dispatch_cost_cpu_torch2.13_20261126.json),
    so 12 + 0.33 × 17 us."""
    selective_dispatch_s: float = 52e-6
    """CPU time per op of a selectively checkpointed block, once in its forward and once in its recompute, on top of
    what non-reentrant checkpointing costs: torch's Python dispatch modes for selective checkpointing run memfit's
    policy and keep or hand back each output. Fitted on GPT-2 alone (52.3 us: every block selective added 27.7 ms
    to fully checkpointed blocks' 65.7 ms step on an H100), judged on ViT-B/16 (+25.2 ms predicted for +29.1
    measured; 8.7 with the old constant) and ResNet-50 (+8.6 for +31.3: still far under; -2.0 before)
    (benchmarks/plan/selective_fit.py -> benchmarks/results/plan/checkpoint_modes_h100_torch2.11_20261126_
    selective_fit.json). An effective cost: the H100 host's dispatch modes alone took 12-14 us per op
    (benchmarks/results/speed/checkpoint_dispatch_cost_h100_torch2.11_20261126.json), the rest is not yet located.
    ResNet-50's shortfall is host time too: its kernels, profiled, are within 1.4 % of this model's GPU time in
    selective mode, and its checkpointed steps host-bound on that H100's host
    (benchmarks/results/plan/checkpoint_profile_h100_torch2.11_20261128.md).
    Was 17 us, measured on a 2-core CPU on a chain of small ops
    (benchmarks/results/speed/checkpoint_dispatch_cost_cpu_torch2.13_20261126.json)."""
    optimizer_dispatch_s: float = 8e-6
    """CPU time per ATen op in ``zero_grad`` and ``optimizer.step()`` (a Python loop for ``foreach=False``).
    Placeholder until measured."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise UsageError(f"SpeedParams.{f.name} must be a positive number, got {value!r}.")
        for name in _EFFICIENCIES:
            if getattr(self, name) > 1:
                raise UsageError(f"SpeedParams.{name} is a fraction of the datasheet peak: at most 1, got "
                                 f"{getattr(self, name)!r}.")


HOST_ADAM_BYTES_PER_S = 17.5e9
"""Bytes per second a host's fused ``torch.optim.AdamW`` streams (7 passes of the element size per parameter
element: parameter, gradient and two moments read, three written), for an offloaded optimizer. Measured on a
2-core CPU VM shared with other jobs, torch 2.13: 17.49e9 (benchmarks/results/plan/host_adamw_cpu_torch2.13_20261126.json,
``benchmarks/plan/optimizer_state_cpu.py``; another run the same day gave 13.99e9); a GPU server's host has more
cores and memory channels, so this is on the slow side. ``benchmarks/plan/optimizer_state_device.py`` measures the device's host."""

OFFLOAD_S_PER_TENSOR = 3.0e-3
"""Host seconds per offloaded parameter beyond its bytes: torchao's ``CPUOffloadOptimizer`` steps one host optimizer
per parameter, each waiting on its gradient's copy. Fitted on GPT-2 alone (3.015 ms: the offloaded step added
354.5 ms to its 42.8 ms bf16 step on an H200, 50 offloaded parameters), judged on the 2-D U-Net: it added 128.0 ms,
predicted 114.1 (was 50.8 without this cost) (benchmarks/plan/optimizer_state_fit.py ->
benchmarks/results/plan/optimizer_state_h200_torch2.11_20261127_fit.json)."""

_EFFICIENCIES = ("compute_efficiency", "memory_efficiency")
ROOFLINE = SpeedParams()
FITTED = ("compute_efficiency", "memory_efficiency", "kernel_s", "forward_dispatch_s", "backward_dispatch_s",
          "optimizer_dispatch_s")
"""What ``calibrate`` fits; ``launch_s`` stays at its default (at small batches it trades off exactly against the
dispatch costs, so the data cannot tell them apart)."""


@dataclass(frozen=True, kw_only=True)
class SpeedPrediction(JsonRecord):
    """The predicted time of one training step."""

    _schema: ClassVar[int] = SCHEMA
    _json_properties: ClassVar[tuple[str, ...]] = ("bound",)

    model: Literal["roofline", "calibrated"]
    """``roofline``: datasheet peaks and placeholder constants; ``calibrated``: constants fitted on a GPU."""
    gpu: str
    step_time_s: float
    """``accumulation * micro_batch_s + optimizer_s``."""
    micro_batch_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    """What the optimizer step adds after the last backward: its CPU work overlaps backward's last GPU kernels."""
    recompute_s: float
    """GPU time of the checkpointed modules' second forward, inside ``backward_s``."""
    gpu_busy_s: float
    """GPU time of one micro-batch's kernels; ``micro_batch_s`` minus this is time the GPU waits for the CPU."""
    cpu_s: float
    """CPU time to dispatch one micro-batch."""
    accumulation: int
    micro_batch_size: int
    samples_per_s: float
    params: SpeedParams
    host_s: float = 0.0
    """Of ``step_time_s``, what an offloaded optimizer adds: the host update and the copies (``_offload_s``)."""

    @property
    def bound(self) -> str:
        """``gpu`` when the kernels take longer than dispatching them, else ``cpu``."""
        return "gpu" if self.gpu_busy_s >= self.cpu_s else "cpu"


@dataclass(frozen=True)
class _Rows:
    """A phase's ops as the model's inner loop reads them: seconds at full peak, counts."""

    compute_s: list[float]
    memory_s: list[float]
    kernels: list[int]
    dispatches: list[int]
    sync: list[bool]
    recompute: list[bool]
    selective: list[bool]
    reentrant: list[bool]


def _rows(phase: PhaseCost, gpu: GpuSpec, matmul_tf32: bool, conv_tf32: bool) -> _Rows:
    peak = {
        "fp32_matmul": gpu.tf32_tflops if matmul_tf32 else gpu.fp32_tflops,
        "fp32_conv": gpu.tf32_tflops if conv_tf32 else gpu.fp32_tflops,
        "bf16": gpu.bf16_tflops,
        "fp16": gpu.fp16_tflops,
    }
    if not all(v > 0 for v in peak.values()) or gpu.memory_bandwidth_gbs <= 0:
        raise UsageError(
            f"GpuSpec {gpu.name!r} has no peak FLOPS or bandwidth; set bf16_tflops, fp16_tflops, tf32_tflops, "
            "fp32_tflops and memory_bandwidth_gbs from its datasheet."
        )
    bandwidth = gpu.memory_bandwidth_gbs * 1e9
    return _Rows(
        compute_s=[r.flops / (peak[r.flop_class] * 1e12) if r.flop_class else 0.0 for r in phase.ops],
        memory_s=[r.bytes / bandwidth for r in phase.ops],
        kernels=[r.kernels for r in phase.ops],
        dispatches=[r.dispatches for r in phase.ops],
        sync=[r.sync for r in phase.ops],
        recompute=[r.recompute for r in phase.ops],
        selective=[r.selective for r in phase.ops],
        reentrant=[r.reentrant for r in phase.ops],
    )


def _simulate(rows: _Rows, p: SpeedParams, dispatch_s: float, backlog_s: float = 0.0
              ) -> tuple[float, float, float, float, float]:
    """(wall time, GPU busy time, CPU time, recompute GPU time, backlog) of one phase, from an idle GPU or, with
    ``backlog_s``, from a GPU still running the previous phase's kernels for that long (the wall time then counts
    from when the CPU starts this phase, less that backlog: what the phase adds). The backlog returned is how long
    the GPU still runs this phase's kernels after the CPU launched the last one (0 when CPU-bound)."""
    cpu = busy = cpu_total = recompute = 0.0
    gpu = backlog_s
    ce, me, ks, ls = p.compute_efficiency, p.memory_efficiency, p.kernel_s, p.launch_s
    rec_s, reent_s, sel_s = p.recompute_dispatch_s, p.reentrant_recompute_dispatch_s, p.selective_dispatch_s
    for c, m, k, d, sync, rec, sel, reent in zip(
        rows.compute_s, rows.memory_s, rows.kernels, rows.dispatches, rows.sync, rows.recompute, rows.selective,
        rows.reentrant, strict=True
    ):
        # a recomputed module runs its Python forward again inside backward, through checkpoint's hooks; a
        # selectively checkpointed one also runs each op through torch's Python dispatch mode, in both passes
        t_cpu = d * ((reent_s if reent else rec_s) if rec else dispatch_s) + k * ls + (sel_s if sel else 0.0)
        t_gpu = max(c / ce, m / me) + k * ks if k else 0.0  # no kernel (a host-side read): no GPU time
        cpu += t_cpu
        cpu_total += t_cpu
        # the kernel starts once the CPU has launched it and the GPU is free
        gpu = max(gpu, cpu) + t_gpu
        busy += t_gpu
        if rec:
            recompute += t_gpu
        if sync:
            cpu = gpu
    return max(cpu, gpu) - backlog_s, busy, cpu_total, recompute, max(0.0, gpu - cpu)


def predict_step_time(
    cost: StepCost,
    gpu: GpuSpec | str | None = None,
    accumulation: int = 1,
    calibration: Calibration | None = None,
    *,
    matmul_tf32: bool = False,
    conv_tf32: bool = True,
) -> SpeedPrediction:
    """Predict the time of one step of ``accumulation`` micro-batches of ``cost.micro_batch_size``.

    Args:
        cost: from ``estimate(workload).cost`` (or ``StepCost.from_trace``).
        gpu: the GPU (``GpuSpec`` or name); default H100. A calibration's parameters belong to its GPU.
        accumulation: micro-batches per optimizer step.
        calibration: constants fitted by ``calibrate`` on this GPU; without it, the roofline's placeholders.
        matmul_tf32: ``torch.backends.cuda.matmul.allow_tf32`` (PyTorch's default: False).
        conv_tf32: ``torch.backends.cudnn.allow_tf32`` (PyTorch's default: True).

    Example:
        >>> from memfit.workload.zoo import builtin_workload
        >>> from memfit.estimate.predict import estimate
        >>> cost = estimate(builtin_workload("mlp").replace(batch_size=8)).cost
        >>> p = predict_step_time(cost, "h100", accumulation=4)
        >>> p.model, round(p.step_time_s / (4 * p.micro_batch_s + p.optimizer_s), 6)
        ('roofline', 1.0)
    """
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise UsageError(f"accumulation must be a positive integer, got {accumulation!r}.")
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    if calibration is not None and calibration.gpu and calibration.gpu != spec.name:
        log.warning("calibration was fitted on %s but the prediction is for %s", calibration.gpu, spec.name)
    p = calibration.params if calibration is not None else ROOFLINE
    phases = {name: _rows(getattr(cost, name), spec, matmul_tf32, conv_tf32)
              for name in ("forward", "backward", "optimizer")}
    return _predict(cost, phases, p, spec.name, accumulation, "calibrated" if calibration else "roofline",
                    spec.host_link_gbs)


def _predict(cost: StepCost, phases: dict[str, _Rows], p: SpeedParams, gpu: str, accumulation: int,
             model: Literal["roofline", "calibrated"], gpu_link_gbs: float = 0.0, *,
             overlap_optimizer: bool = True) -> SpeedPrediction:
    fwd, fwd_busy, fwd_cpu, _, _ = _simulate(phases["forward"], p, p.forward_dispatch_s)
    bwd, bwd_busy, bwd_cpu, recompute, backlog = _simulate(phases["backward"], p, p.backward_dispatch_s)
    # loss.backward() returns once its kernels are launched: the optimizer's Python and launches run while the GPU
    # finishes backward. A GPU-bound backward hides a CPU-bound optimizer step (torchao's 8-bit AdamW, one compiled
    # call per parameter, added 0.2 ms to a 2-D U-Net's fp32 step and 45 ms to GPT-2's bf16 one on an H200:
    # benchmarks/results/plan/optimizer_state_h200_torch2.11_20261127.json). Calibration times the phases apart.
    opt, _, _, _, _ = _simulate(phases["optimizer"], p, p.optimizer_dispatch_s,
                                backlog if overlap_optimizer else 0.0)
    d2h_wait, host = _offload_s(cost, gpu_link_gbs, bwd)
    micro = fwd + bwd + d2h_wait
    opt += host
    step = accumulation * micro + opt
    return SpeedPrediction(
        model=model, gpu=gpu, step_time_s=step, micro_batch_s=micro, forward_s=fwd, backward_s=bwd,
        optimizer_s=opt, recompute_s=recompute, gpu_busy_s=fwd_busy + bwd_busy, cpu_s=fwd_cpu + bwd_cpu,
        accumulation=accumulation, micro_batch_size=cost.micro_batch_size,
        samples_per_s=accumulation * cost.micro_batch_size / step if step > 0 else math.inf, params=p,
        host_s=accumulation * d2h_wait + host,
    )


def _offload_s(cost: StepCost, link_gbs: float, backward_s: float) -> tuple[float, float]:
    """(per micro-batch, per step) seconds an offloaded optimizer adds (``StepCost.offload_d2h_bytes``...).

    The gradient copies run on a side stream during backward, each once its gradient is final: they cost only what
    outlasts backward. The optimizer step then updates each parameter on the host and copies it back on the
    side stream while the host goes on to the next one: the host update and the copies back add up (the last copy
    waits for the last update; the copies are not assumed hidden, which makes the step a little slow).
    """
    if not (cost.offload_d2h_bytes or cost.offload_h2d_bytes or cost.host_update_bytes):
        return 0.0, 0.0
    if link_gbs <= 0:
        raise UsageError("this GpuSpec has no host_link_gbs (PCIe bandwidth): set it from the datasheet to predict "
                         "an offloaded optimizer's speed.")
    link = link_gbs * 1e9
    d2h = max(0.0, cost.offload_d2h_bytes / link - backward_s)
    host = cost.host_update_bytes / HOST_ADAM_BYTES_PER_S + cost.offload_tensors * OFFLOAD_S_PER_TENSOR
    return d2h, host + cost.offload_h2d_bytes / link


# ------------------------------------------------------------------------------------------------ calibration
@dataclass(frozen=True, kw_only=True)
class CalibrationSample:
    """Measured phase times of one micro-batch size, with the cost the trace gives for it."""

    cost: StepCost
    forward_s: float
    backward_s: float
    optimizer_s: float


@dataclass(frozen=True, kw_only=True)
class Calibration(JsonRecord):
    """Speed-model constants fitted to timed steps on one GPU; pass it to ``predict_step_time``."""

    _schema: ClassVar[int] = SCHEMA

    params: SpeedParams
    gpu: str
    """``GpuSpec.name`` of the GPU it was fitted on."""
    workload: str
    micro_batches: tuple[int, ...]
    """The micro-batch sizes that were timed (OOMs left out)."""
    measured: tuple[tuple[float, float, float], ...]
    """(forward_s, backward_s, optimizer_s) medians per micro-batch size."""
    rms_log_error: float
    """Root-mean-square of log(predicted / measured) over the fitted phase times: 0.05 is about 5 %."""
    schema: int = SCHEMA

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(
            params=SpeedParams(**d["params"]), gpu=d["gpu"], workload=d["workload"],
            micro_batches=tuple(d["micro_batches"]), measured=tuple(tuple(m) for m in d["measured"]),
            rms_log_error=d["rms_log_error"],
        )


def fit_calibration(
    samples: Sequence[CalibrationSample],
    gpu: GpuSpec | str | None = None,
    *,
    workload: str = "workload",
    fit: Sequence[str] = FITTED,
    prior: SpeedParams = ROOFLINE,
    prior_weight: float = 1e-3,
    matmul_tf32: bool = False,
    conv_tf32: bool = True,
) -> Calibration:
    """Fit the speed model's constants to measured phase times by least squares on log time.

    A weak pull towards ``prior`` (``prior_weight`` per squared log-ratio) keeps constants the samples cannot
    see (say, the compute efficiency when every sample is CPU-bound) at their defaults instead of anywhere.
    Pure Python: Nelder-Mead on the logs of the constants.
    """
    if len(samples) < 2:
        raise UsageError(f"calibration needs timings of at least 2 micro-batch sizes, got {len(samples)}.")
    for name in fit:
        if name not in {f.name for f in dataclasses.fields(SpeedParams)}:
            raise UsageError(f"unknown speed-model constant {name!r}; choose from {', '.join(FITTED)}.")
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    prepared = [
        ({n: _rows(getattr(s.cost, n), spec, matmul_tf32, conv_tf32) for n in ("forward", "backward", "optimizer")},
         s)
        for s in samples
    ]
    start = [math.log(getattr(prior, n)) for n in fit]

    def params_at(x: Sequence[float]) -> SpeedParams:
        # efficiencies are fractions of the datasheet peak: capped at 1 (the fit sees a flat loss beyond)
        return dataclasses.replace(prior, **{
            n: min(math.exp(v), 1.0) if n in _EFFICIENCIES else math.exp(v) for n, v in zip(fit, x, strict=True)
        })

    def residuals(p: SpeedParams) -> list[float]:
        out = []
        for phases, s in prepared:
            pred = _predict(s.cost, phases, p, spec.name, 1, "calibrated", spec.host_link_gbs,
                            overlap_optimizer=False)
            for predicted, measured in ((pred.forward_s, s.forward_s), (pred.backward_s, s.backward_s),
                                        (pred.optimizer_s, s.optimizer_s)):
                out.append(math.log(predicted / measured))
        return out

    def loss(x: Sequence[float]) -> float:
        r = residuals(params_at(x))
        return sum(v * v for v in r) + prior_weight * sum((a - b) ** 2 for a, b in zip(x, start, strict=True))

    best = _nelder_mead(loss, start)
    params = params_at(best)
    r = residuals(params)
    return Calibration(
        params=params, gpu=spec.name, workload=workload,
        micro_batches=tuple(s.cost.micro_batch_size for s in samples),
        measured=tuple((s.forward_s, s.backward_s, s.optimizer_s) for s in samples),
        rms_log_error=math.sqrt(sum(v * v for v in r) / len(r)),
    )


def _nelder_mead(f: Callable[[Sequence[float]], float], x0: Sequence[float], *, step: float = 0.5,
                 max_evals: int = 4000, tol: float = 1e-12) -> list[float]:
    """Minimise ``f`` from ``x0`` (standard coefficients: reflect 1, expand 2, contract 1/2, shrink 1/2)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    evals = n + 1
    while evals < max_evals:
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = _towards(centroid, worst, -1.0)
        fr = f(reflected)
        evals += 1
        if fr < values[0]:
            expanded = _towards(centroid, worst, -2.0)
            fe = f(expanded)
            evals += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = _towards(centroid, worst, 0.5 if fr >= values[-1] else -0.5)
            fc = f(contracted)
            evals += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, s, strict=True)] for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
                evals += n
    return simplex[min(range(n + 1), key=values.__getitem__)]


def _towards(centroid: Sequence[float], worst: Sequence[float], t: float) -> list[float]:
    """The point ``centroid + t * (worst - centroid)``: t = -1 reflects the worst vertex, 1/2 contracts."""
    return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]


def calibrate(
    workload: Workload,
    *,
    device: str = "cuda",
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    gpu: GpuSpec | str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    costs: Mapping[int, StepCost] | None = None,
) -> Calibration:
    """Time a few training steps of ``workload`` per micro-batch size on a real GPU and fit the speed model.

    Each size is built with ``memfit.workload.protocol.build`` and run for ``warmup + repeats`` steps; forward, backward
    and optimizer are timed with CUDA events between host syncs (the model's assumption) and the medians are
    fitted. Sizes that run out of memory are skipped. Seconds in total for ordinary models: the steps run at
    the given sizes and the traces of those sizes run on the CPU.

    Args:
        workload: the training step; its ``batch_size`` is replaced by each of ``micro_batches``.
        device: the CUDA device to time on.
        micro_batches: sizes to time; spread them from CPU-bound (1) to GPU-bound.
        gpu: the spec to fit against; default: detected from the device.
        warmup: untimed steps first (the first step also creates the optimizer state).
        repeats: timed steps; their median is fitted.
        costs: ``StepCost`` by micro-batch size where the caller has them already (``Estimate.cost``); the
            other sizes are traced here, on the CPU.
    """
    spec = gpu if isinstance(gpu, GpuSpec) else (gpu_spec(gpu) if gpu else detect_gpu())
    if spec is None:
        raise DeviceError("calibrate needs a CUDA GPU and none is visible; predict with the roofline instead.")
    samples = []
    for b in micro_batches:
        w = workload.replace(batch_size=b)
        try:
            forward_s, backward_s, optimizer_s = _time_phases(w, device, warmup=warmup, repeats=repeats)
        except Exception as exc:
            if not is_oom(exc):
                raise
            log.info("calibrate: micro-batch %d ran out of memory; skipped", b)
            continue
        cost = costs[b] if costs is not None and b in costs else _trace_cost(w, spec)
        samples.append(CalibrationSample(cost=cost, forward_s=forward_s, backward_s=backward_s,
                                         optimizer_s=optimizer_s))
    return fit_calibration(samples, spec, workload=workload.name)


def _trace_cost(workload: Workload, spec: GpuSpec) -> StepCost:
    # two steps: the second is the steady state the cost is read from; no allocator replay is needed
    return StepCost.from_trace(trace_workload(workload, spec, steps=2), workload.batch_size)


def _time_phases(workload: Workload, device: str, *, warmup: int, repeats: int) -> tuple[float, float, float]:
    """Median (forward, backward, optimizer) seconds of ``repeats`` steps after ``warmup`` on a CUDA device."""
    import torch

    events: dict[tuple[int, str], Any] = {}

    def mark(name: str, step: int) -> None:
        if name in ("forward", "backward", "optimizer", "end"):
            # a host sync before each phase: every phase starts from an idle GPU, as the model assumes
            torch.cuda.synchronize(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            events[(step, name)] = event

    model, optimizer, batch = build(workload, device)
    try:
        # fp16: past the fresh GradScaler's skipped steps, whose optimizer does nothing
        steps = run_steps_on_cuda(workload, model, optimizer, batch, steps=warmup + repeats, phase=mark)
        torch.cuda.synchronize(device)
        times: list[tuple[float, float, float]] = []
        for s in range(steps - repeats, steps):
            # the optimizer phase runs until the next step's forward: zero_grad belongs to it, as in StepCost
            opt_end = events.get((s + 1, "forward"), events[(steps, "end")])
            times.append(tuple(  # type: ignore[arg-type]
                events[(s, a)].elapsed_time(b) / 1e3
                for a, b in (("forward", events[(s, "backward")]), ("backward", events[(s, "optimizer")]),
                             ("optimizer", opt_end))
            ))
    finally:
        del model, optimizer, batch
        torch.cuda.empty_cache()
    return tuple(statistics.median(t[i] for t in times) for i in range(3))  # type: ignore[return-value]
