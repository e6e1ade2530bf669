"""``plan()``: the fastest training configuration whose predicted memory fits a budget.

The search turns the knobs that keep the training mathematics (micro-batch × gradient accumulation with the
same effective batch, activation checkpointing of chosen blocks, the optimizer's implementation, channels_last,
expandable segments) and, only when allowed, the precision. Memory comes from ``estimate()``: a few estimates
per structure give a line ``fits_in(micro_batch)``, and every configuration the plan can choose is verified by
an estimate of exactly that configuration before it is chosen. Speed comes from ``memfit.speed.step_time``: a roofline of
the traced ops, or its calibration on this machine's GPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from memfit._io import check_output_path, write_atomic
from memfit.errors import BudgetTooSmallError, MemfitError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.bound import BASE_MARGIN
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.predict import Estimate, estimate
from memfit.estimate.trace import trace_workload
from memfit.guard.step import TrainStep
from memfit.records import JsonRecord
from memfit.speed.step_time import Calibration, PhaseCost, predict_step_time
from memfit.units import format_bytes
from memfit.workload.knobs import (
    ModelFacts,
    apply_checkpointing,
    checkpoint_choices,
    model_facts,
    set_optimizer_impl,
)
from memfit.workload.spec import (
    CHECKPOINT_MODES,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    CheckpointMode,
    OptimizerImpl,
    Precision,
    Workload,
)

logger = logging.getLogger(__name__)

SCHEMA = 1
DEFAULT_MARGIN = 0.02
"""The plan keeps ``device_bytes <= budget × (1 - margin)``. On top of the estimator's own 1.5 % placement
margin (``memfit.estimate.predict.FITS_IN_MARGIN``), it absorbs the estimator's measured error (peak allocated within
2.1 %, benchmarks/results/estimate/estimate_accuracy_h200_torch2.11_20261126.md)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One training configuration: what ``Workload.replace`` and the guarded step need to run it."""

    micro_batch: int
    accumulation_steps: int
    precision: Precision
    checkpoint: tuple[str, ...] = ()
    optimizer_impl: OptimizerImpl = "default"
    channels_last: bool = False
    expandable_segments: bool = False
    patch_size: tuple[int, ...] | None = None
    checkpoint_mode: CheckpointMode = "full"

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Config.{name} must be a positive integer, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise UsageError(f"Config.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise UsageError(f"Config.optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, "
                             f"got {self.optimizer_impl!r}.")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise UsageError(f"Config.checkpoint_mode must be one of {', '.join(CHECKPOINT_MODES)}, "
                             f"got {self.checkpoint_mode!r}.")
        if self.patch_size is not None and not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.patch_size
        ):
            raise UsageError(f"Config.patch_size must be positive integers, got {self.patch_size!r}.")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    def changes(self) -> dict[str, Any]:
        """The ``Workload`` fields this configuration sets."""
        out: dict[str, Any] = {
            "batch_size": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "precision": self.precision,
            "checkpoint": self.checkpoint,
            "checkpoint_mode": self.checkpoint_mode,
            "optimizer_impl": self.optimizer_impl,
            "channels_last": self.channels_last,
        }
        if self.patch_size is not None:
            out["patch_size"] = self.patch_size
        return out

    def label(self) -> str:
        parts = [f"micro-batch {self.micro_batch} × {self.accumulation_steps}", self.precision]
        if self.checkpoint:
            parts.append(f"checkpoint {len(self.checkpoint)} blocks"
                         + ("" if self.checkpoint_mode == "full" else f" ({self.checkpoint_mode})"))
        if self.optimizer_impl != "default":
            parts.append(f"{self.optimizer_impl} optimizer")
        if self.channels_last:
            parts.append("channels_last")
        if self.expandable_segments:
            parts.append("expandable_segments")
        if self.patch_size is not None:
            parts.append("patch " + "×".join(map(str, self.patch_size)))
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """A configuration with its predicted memory and speed."""

    config: Config
    device_bytes: int
    """The predicted upper bound on the cap (``Estimate.fits_in_upper_bytes``) + CUDA context: what "fits" is
    decided with."""
    fits_in_bytes: int
    step_time_s: float | None
    """Predicted time of one optimizer step (all micro-batches); None without a speed model."""
    samples_per_s: float | None
    verified: bool
    """True: memory from an estimate of exactly this configuration; False: from the line through two others."""
    fits: bool
    """``device_bytes <= budget × (1 - margin)``."""


@dataclass(frozen=True)
class Plan(JsonRecord):
    """The chosen configuration and the frontier of alternatives (memory vs step time)."""

    _schema: ClassVar[int] = SCHEMA

    workload: str
    gpu: str
    budget_bytes: int
    margin: float
    effective_batch: int
    chosen: Candidate
    frontier: list[Candidate]
    """Pareto-optimal candidates: none is both smaller and faster than another, by memory. For a patch plan:
    the patches estimated, largest first."""
    considered: int
    """Configurations scored."""
    estimates: int
    """Estimator runs (traces) the search made."""
    speed_model: str
    """``roofline`` or ``calibrated`` (timed on this machine's GPU), or ``none``."""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    schema: int = SCHEMA


    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as versioned JSON, atomically: on any failure the file at ``path`` is left as it was.

        Raises:
            UsageError: ``path`` is a directory or in a folder that does not exist, or the write failed (a full
                disk); the message names the path.
        """
        return write_atomic(check_output_path(path, "the plan"), self.to_json(indent=2), what="the plan")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by ``save`` (plain JSON; nothing is unpickled).

        Raises:
            UsageError: the file is missing, unreadable, not JSON, or not a plan of this schema (every field is
                checked: its presence, its type, its range).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UsageError(f"plan file not found: {path}.") from None
        except IsADirectoryError:
            raise UsageError(f"cannot read the plan {path}: it is a directory. Name the .json file.") from None
        except OSError as exc:
            raise UsageError(f"cannot read the plan {path}: {exc.strerror or exc}.") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"cannot read the plan {path}: not UTF-8 text ({exc.reason} at byte {exc.start}). "
                             "Re-run `memfit plan ... --save`.") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"cannot read the plan {path}: not JSON ({exc.msg}, line {exc.lineno}). "
                             "Re-run `memfit plan ... --save`.") from None
        except RecursionError:
            raise UsageError(f"cannot read the plan {path}: its JSON nests too deeply to be a plan.") from None
        try:
            return cls.from_dict(data)
        except UsageError as exc:
            raise UsageError(f"{path} is not a memfit plan: {exc}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan of a ``to_dict()``, every field checked.

        Raises:
            UsageError: one line naming the first field that is missing, extra, of the wrong type or out of range.
        """
        if not isinstance(data, dict):
            raise UsageError(f"a plan is a JSON object, got {_json_kind(data)}. Re-run `memfit plan ... --save`.")
        if data.get("schema") != SCHEMA:
            raise UsageError(f"plan schema {data.get('schema')!r} is not {SCHEMA}: re-run `memfit plan`.")
        plan = _decode(cls, data, "plan")
        if not 0 <= plan.margin < 0.5 or plan.budget_bytes <= 0 or plan.effective_batch < 1:
            raise UsageError(f"plan.margin, budget_bytes or effective_batch out of range ({plan.margin!r}, "
                             f"{plan.budget_bytes!r}, {plan.effective_batch!r}). Re-run `memfit plan ... --save`.")
        return plan

    def workload_for(self, workload: Workload) -> Workload:
        """``workload`` configured as planned (estimate or measure it to check)."""
        return workload.replace(**self.chosen.config.changes())

    def apply(self, model: Any, optimizer: Any, loss_fn: Any, **train_step_kwargs: Any) -> Any:
        """Configure the guarded step as planned: checkpoint wrappers, optimizer implementation, memory format,
        precision and micro-batch size. Returns a ``memfit.TrainStep``; its ``optimizer`` is the one to use.

        Feed it batches of ``effective_batch`` samples; it runs them as ``accumulation_steps`` micro-batches.
        """
        import torch

        c = self.chosen.config
        if c.checkpoint:
            apply_checkpointing(model, c.checkpoint, c.checkpoint_mode)
        if c.channels_last:  # .to keeps the Parameter objects, so the optimizer still holds them
            is_3d = any(p.dim() == 5 for p in model.parameters())
            model.to(memory_format=torch.channels_last_3d if is_3d else torch.channels_last)
        optimizer = set_optimizer_impl(optimizer, c.optimizer_impl)
        if c.expandable_segments:
            _enable_expandable_segments()
        return TrainStep(
            model, optimizer, loss_fn, precision=c.precision, micro_batch_size=c.micro_batch, **train_step_kwargs
        )


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as the type ``tp`` of a results dataclass field, or a UsageError naming ``where``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise UsageError(f"{where} must be an object, got {_json_kind(value)}.")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        extra = sorted(set(value) - set(fields))
        missing = sorted(n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if extra or missing:
            what = "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                             + ([f"unknown {', '.join(map(str, extra))}"] if extra else []))
            raise UsageError(f"{where} does not match this memfit's plan format ({what}). Re-run `memfit plan`.")
        return tp(**{k: _decode(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), value, where)
    if origin is list:
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list, got {_json_kind(value)}.")
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list, got {_json_kind(value)}.")
        return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is Any:
        return value
    if origin is typing.Literal:  # a fixed vocabulary (precision, optimizer implementation): one of its words
        if value not in args:
            raise UsageError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}.")
        return value
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str)}[tp]
    if not ok(value):
        raise UsageError(f"{where} must be {_json_kind(tp())}, got {value!r:.60}.")
    return float(value) if tp is float else value


def _enable_expandable_segments() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        logger.warning(
            "the plan uses expandable_segments, but CUDA is already initialised; set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts."
        )
        return
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))


# ------------------------------------------------------------------------------------------------- search

_FB_PHASES = ("forward", "loss", "backward")


@dataclass(frozen=True)
class _Structure:
    """Everything but the micro-batch size."""

    precision: Precision
    checkpoint: tuple[str, ...] = ()
    optimizer_impl: OptimizerImpl = "default"
    channels_last: bool = False
    checkpoint_mode: CheckpointMode = "full"
    """How ``checkpoint`` runs; ``full`` when nothing is checkpointed, so that structure is one."""

    def config(self, micro: int, effective: int, expandable: bool = False) -> Config:
        return Config(
            micro_batch=micro, accumulation_steps=effective // micro, precision=self.precision,
            checkpoint=self.checkpoint, optimizer_impl=self.optimizer_impl, channels_last=self.channels_last,
            expandable_segments=expandable, checkpoint_mode=self.checkpoint_mode,
        )


def _phase_peaks(est: Estimate) -> tuple[int, int]:
    """Peak allocated in forward/backward, and elsewhere (optimizer step, zero_grad): they scale differently."""
    fb = max((p.allocated_bytes for p in est.timeline if p.phase in _FB_PHASES), default=0)
    other = max((p.allocated_bytes for p in est.timeline if p.phase not in _FB_PHASES), default=0)
    return fb, other


class Search:
    """The estimates of one planning run, and the memory/speed models built from them."""

    def __init__(self, workload: Workload, gpu: GpuSpec, allocator: AllocatorConfig, limit_bytes: int,
                 effective: int, calibration: Calibration | None, allow_precision_change: bool,
                 checkpoint_modes: tuple[CheckpointMode, ...] = CHECKPOINT_MODES) -> None:
        self.workload, self.gpu, self.allocator = workload, gpu, allocator
        self.checkpoint_modes = checkpoint_modes
        """How the chosen blocks may be checkpointed (``Workload.checkpoint_mode``)."""
        self.notes: list[str] = []
        self.allow_precision_change = allow_precision_change
        self.limit_bytes, self.effective, self.calibration = limit_bytes, effective, calibration
        self.estimates: dict[Config, Estimate] = {}
        self.context_bytes = gpu.cuda_context_bytes  # until an estimate says whether the step calls cuBLAS
        self.traces: dict[Config, Any] = {}
        self.runs = 0
        self._times: dict[tuple[Any, ...], float] = {}
        self._floors: dict[int, int] = {}  # by id() of the trace, which self.traces keeps alive
        self.facts: ModelFacts | None = None
        """What the model offers (blocks to checkpoint, optimizer implementations), once the search has looked."""

    def estimate(self, config: Config) -> Estimate:
        if config not in self.estimates:
            plain = dataclasses.replace(config, expandable_segments=False)
            w = self.workload.replace(**config.changes())
            if plain not in self.traces:
                self.traces[plain] = trace_workload(w, self.gpu)
                self.runs += 1
            # a configuration asks for expandable segments; an allocator that has them already keeps them
            allocator = dataclasses.replace(
                self.allocator, expandable_segments=self.allocator.expandable_segments or config.expandable_segments)
            est = estimate(w, gpu=self.gpu, allocator=allocator, reuse_trace=self.traces[plain])
            self.estimates[config] = est
            self.context_bytes = est.device_bytes - est.fits_in_bytes
        return self.estimates[config]

    def need_floor(self, config: Config) -> int:
        """A number no exact estimate of a configuration whose every tensor is at least as large as ``config``'s
        can come in under, with or without expandable segments: the least ``device_upper_bytes`` such a
        configuration can have. ``config`` must have been estimated.

        Why it is safe: with the same op sequence, a larger micro-batch (or patch) makes every tensor at least as
        large, so the bytes requested and alive after every allocation, and their peak, are at least ``config``'s.
        The allocator gives each request a block at least as large, in either segment mode, and "fits" is decided
        with the upper bound: the replayed cap (never below the allocated peak) widened by at least
        ``memfit.estimate.bound.BASE_MARGIN``, plus a CUDA context of at least ``GpuSpec.context_bytes(False)``.
        Optional allocations (a cuDNN workspace that may fail and fall back) are not counted. It assumes the traced
        op sequence does not depend on the batch size (no branch on ``x.shape[0]``).
        """
        trace = self.traces[dataclasses.replace(config, expandable_segments=False)]
        if id(trace) not in self._floors:
            live, peak, sizes = 0, 0, {}
            for op, key, nbytes in trace.events():
                if op == 1:  # a required allocation (op 2 is optional, -1 a free)
                    sizes[key] = nbytes
                    live += nbytes
                    peak = max(peak, live)
                elif op < 0:
                    live -= sizes.pop(key, 0)
            self._floors[id(trace)] = int(peak * (1 + BASE_MARGIN)) + self.gpu.context_bytes(False)
        return self._floors[id(trace)]

    def step_time(self, config: Config) -> float | None:
        """Predicted optimizer-step time of ``config``, monotone by construction: never below the prediction for a
        configuration that does no more work. Those are the same configuration with a micro-batch at least as large
        (the same samples in fewer micro-batches: the same FLOPs with fewer kernel launches, dispatches and weight
        reads) or with a subset of its checkpointed blocks under the same checkpoint mode (less recompute). Each such prediction comes from its own
        traces (``raw_step_time``), and traces of two structures differ in ways the roofline prices without
        physics (a checkpointed block's first forward runs without autograd recording, so the roofline can price
        it below the plain forward); the largest of them is the prediction. Precision, the optimizer's
        implementation and the memory format are different computations, so they are never compared: a fused
        optimizer may well be faster. None when no estimate of ``config``'s structure has a cost yet.
        """
        own = self.raw_step_time(config)
        if own is None:
            return None
        (key, patch), eff = _structure(config), config.effective_batch
        mode = config.checkpoint_mode
        # fewer blocks under the same checkpoint mode, or none at all. The modes are not compared with each other:
        # selective recomputes less on the GPU but runs every op of its blocks through Python dispatch modes, and
        # reentrant recomputes more with fewer hooks
        fewer = {c.checkpoint for c in self.estimates
                 if set(c.checkpoint) <= set(config.checkpoint) and (c.checkpoint_mode == mode or not c.checkpoint)
                 and _structure(dataclasses.replace(c, checkpoint=config.checkpoint, checkpoint_mode=mode))
                 == (key, patch)}
        others = (self.raw_step_time(dataclasses.replace(config, checkpoint=blocks, micro_batch=m,
                                                         accumulation_steps=eff // m,
                                                         checkpoint_mode=mode if blocks else "full"))
                  for blocks in fewer for m in divisors(eff) if m >= config.micro_batch)
        return max([own, *(t for t in others if t is not None)])

    def raw_step_time(self, config: Config) -> float | None:
        """The speed model (``predict_step_time``) on the op costs of ``config``'s structure, interpolated op by
        op between the two estimated micro-batch sizes around it; None when no estimate of it has a cost."""
        key = _structure(config)
        same = sorted(((c.micro_batch, e.cost) for c, e in self.estimates.items()
                       if _structure(c) == key and not c.expandable_segments and e.cost is not None),
                      key=lambda mc: mc[0])
        if not same:
            return None
        # the walk re-ranks every candidate after each estimate: the roofline runs once per (config, costs known)
        memo = (config.micro_batch, config.accumulation_steps, key, tuple(m for m, _ in same))
        if memo not in self._times:
            cost = _cost_at(same, config.micro_batch)
            self._times[memo] = predict_step_time(cost, self.gpu, accumulation=config.accumulation_steps,
                                                  calibration=self.calibration).step_time_s
        return self._times[memo]


def _cost_at(known: list[tuple[int, Any]], micro: int) -> Any:
    """The ``StepCost`` of one micro-batch of ``micro`` samples from costs traced at other sizes.

    FLOPs and bytes of each op are linear in the micro-batch (a weight read is the intercept), so two traces of
    the same op sequence give every op exactly; with one trace, or sequences that differ, they are scaled.
    """
    sizes = [m for m, _ in known]
    if micro in sizes:
        return known[sizes.index(micro)][1]
    below = [k for k in known if k[0] < micro]
    above = [k for k in known if k[0] > micro]
    (m0, c0), (m1, c1) = (below[-1], above[0]) if below and above else (known[0], known[-1]) if len(known) > 1 else (
        known[0], known[0])

    def phase(p0: Any, p1: Any) -> Any:
        rows0, rows1 = p0.ops, p1.ops
        if m0 == m1 or len(rows0) != len(rows1):
            near = rows0 if abs(micro - m0) <= abs(micro - m1) else rows1
            scale = micro / (m0 if near is rows0 else m1)
            return PhaseCost.of([r._replace(flops=int(r.flops * scale), bytes=int(r.bytes * scale)) for r in near])
        t = (micro - m0) / (m1 - m0)
        return PhaseCost.of([
            a._replace(flops=max(0, round(a.flops + t * (b.flops - a.flops))),
                       bytes=max(0, round(a.bytes + t * (b.bytes - a.bytes))))
            for a, b in zip(rows0, rows1, strict=True)
        ])

    return dataclasses.replace(
        c0, micro_batch_size=micro, forward=phase(c0.forward, c1.forward), backward=phase(c0.backward, c1.backward),
    )


def _structure(c: Config) -> tuple[_Structure, tuple[int, ...] | None]:
    return _Structure(c.precision, c.checkpoint, c.optimizer_impl, c.channels_last, c.checkpoint_mode), c.patch_size


@dataclass
class _MemoryModel:
    """``fits_in(b) ≈ ratio × max(fb_at_1 + fb_per_sample × (b - b_lo), other)`` for one structure."""

    fb_intercept: float
    fb_slope: float
    other: float
    ratio: float
    b_lo: int

    def fits_in(self, micro: int) -> int:
        fb = self.fb_intercept + self.fb_slope * (micro - self.b_lo)
        return int(self.ratio * max(fb, self.other))


def plan(
    workload: Workload,
    *,
    budget_bytes: int,
    effective_batch: int | None = None,
    gpu: str | GpuSpec | None = None,
    allocator: AllocatorConfig | None = None,
    margin: float = DEFAULT_MARGIN,
    allow_precision_change: bool = False,
    calibration: Calibration | None = None,
    checkpoint_modes: tuple[CheckpointMode, ...] = CHECKPOINT_MODES,
) -> Plan:
    """The fastest configuration of ``workload`` that fits ``budget_bytes`` of device memory.

    Args:
        workload: the training step (its batch_size × accumulation_steps is the default effective batch). The plan
            runs through ``TrainStep``, which drops each micro-batch's output before its backward, so every
            configuration is estimated that way (``keep_output=False``) whatever the workload says.
        budget_bytes: the GPU memory this process may use, CUDA context included (a 24 GB card: ``24e9``).
        effective_batch: samples per optimizer step; every plan keeps it exactly (micro-batch × accumulation).
        gpu: the GPU to plan for (memory workspaces, context size, roofline speeds); default H100.
        allocator: caching-allocator settings; default ``PYTORCH_CUDA_ALLOC_CONF`` from the environment.
        margin: the plan keeps ``device_bytes <= budget_bytes × (1 - margin)``.
        allow_precision_change: also consider bf16 autocast (changes numerics).
        calibration: a ``memfit.speed.step_time.Calibration`` timed on the GPU; None uses the roofline.
        checkpoint_modes: how the chosen blocks may be checkpointed (``Workload.checkpoint_mode``): each block set
            is estimated in each mode, and the speed model picks (``selective`` keeps more memory and recomputes
            less; ``reentrant`` keeps what ``full`` keeps with fewer hooks). ``("full",)`` plans as before.

    Raises:
        BudgetTooSmallError: nothing fits; the message gives the smallest configuration found and its need.

    Example:
        >>> from memfit.workload.zoo import builtin_workload
        >>> p = plan(builtin_workload("mlp"), budget_bytes=4 << 30, effective_batch=64)
        >>> p.chosen.config.micro_batch * p.chosen.config.accumulation_steps
        64
    """
    started = time.perf_counter()
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    eff = workload.effective_batch_size if effective_batch is None else effective_batch
    if isinstance(eff, bool) or not isinstance(eff, int) or eff < 1:
        raise UsageError(f"effective batch must be a positive integer, got {eff!r}.")
    check_budget(budget_bytes, margin)
    if isinstance(checkpoint_modes, str) or not checkpoint_modes or any(
            m not in CHECKPOINT_MODES for m in checkpoint_modes):
        raise UsageError(f"checkpoint_modes must be a non-empty tuple of {', '.join(CHECKPOINT_MODES)}, "
                         f"got {checkpoint_modes!r}.")
    limit = int(budget_bytes * (1 - margin))
    workload = workload.replace(keep_output=False)  # the loop Plan.apply runs: TrainStep
    search = Search(workload, spec, config, limit, eff, calibration, allow_precision_change, tuple(checkpoint_modes))
    structures, models = _memory_models(search)
    configs = [s.config(m, eff) for s in structures for m in divisors(eff)]
    chosen, notes = _walk(search, configs, models)
    notes = search.notes + notes
    scored = [_score(search, models[s], c) for c in configs for s in (_structure(c)[0],)]
    if chosen is None:
        # every configuration of the search was estimated or ruled out: try the smallest with every optimizer
        # implementation and with every block checkpointed, before saying nothing fits
        chosen, smallest = _smallest_exactly(search, structures)
        if chosen is None:
            raise BudgetTooSmallError(
                f"nothing fits {format_bytes(budget_bytes)} (with the {margin:.0%} margin: {format_bytes(limit)}): "
                f"the smallest configuration found needs {format_bytes(smallest.device_bytes)} "
                f"({smallest.config.label()}: the least of {len(search.estimates)} configurations estimated "
                "exactly, micro-batch 1 and full checkpointing with every optimizer implementation among them). "
                "Try a budget of at least "
                f"{format_bytes(math.ceil(smallest.device_bytes / (1 - margin)))}, a larger GPU, "
                + ("--allow-precision-change, " if not allow_precision_change and workload.precision == "fp32" else "")
                + "sharding across GPUs, or a smaller model or input."
            )
        notes.append(f"only {chosen.config.label()} fits, found by estimating the smallest configurations exactly")
    frontier = _frontier([c for c in scored if c.step_time_s is not None] + [chosen])
    return Plan(
        workload=workload.name,
        gpu=spec.name,
        budget_bytes=budget_bytes,
        margin=margin,
        effective_batch=eff,
        chosen=chosen,
        frontier=frontier,
        considered=len(scored),
        estimates=search.runs,
        speed_model="calibrated" if calibration is not None else "roofline",
        notes=notes,
        elapsed_s=time.perf_counter() - started,
    )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (an effective batch may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _smallest_exactly(search: Search, structures: list[_Structure]) -> tuple[Candidate | None, Candidate]:
    """Estimate exactly the configurations most likely to need the least memory; the fastest that fits (or None)
    and the smallest.

    For each precision the search has: micro-batch 1 and the whole effective batch at once (no accumulation, so
    no gradients alive in forward), each without checkpointing and with every block checkpointed; then the
    smallest of those with every optimizer implementation the optimizer has. Each is also tried with expandable
    segments when fragmentation is what keeps it out. The memory format stays the workload's: channels_last is a
    speed knob, and each format would double the traces of a path that can already take minutes on a large model.
    """
    facts = search.facts
    eff = search.effective
    full = tuple(facts.blocks) if facts is not None else ()
    configs = []
    for precision, impl in dict.fromkeys((s.precision, s.optimizer_impl) for s in structures):
        for checkpoint in dict.fromkeys(((), full)):
            for micro in dict.fromkeys((1, eff)):
                structure = _Structure(precision, checkpoint, impl, search.workload.channels_last)
                configs.append(structure.config(micro, eff))
    found = [verified(search, c) for c in configs]
    smallest = min(found, key=lambda c: c.device_bytes)
    impls = ["default", *(facts.optimizer_impls if facts is not None else ())]
    for other in dict.fromkeys(impls):
        if other != smallest.config.optimizer_impl:
            found.append(verified(search, dataclasses.replace(smallest.config, optimizer_impl=other)))
    if not search.allocator.expandable_segments:
        # each with expandable segments too: where fragmentation is the gap that fits, and where nothing does, the
        # least of them is the need the error reports
        found += [verified(search, dataclasses.replace(c.config, expandable_segments=True))
                  for c in list(found) if not c.fits]
    fitting = [c for c in found if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (c.step_time_s if c.step_time_s is not None else float("inf"),
                                           c.device_bytes)), smallest
    return None, min(found, key=lambda c: c.device_bytes)


def check_budget(budget_bytes: int, margin: float) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise UsageError(f"budget must be a positive number of bytes, got {budget_bytes!r}.")
    if not 0 <= margin < 0.5:
        raise UsageError(f"margin must be in [0, 0.5), got {margin!r}.")


def _memory_models(search: Search) -> tuple[list[_Structure], dict[_Structure, _MemoryModel]]:
    """Estimate each structure at one or two micro-batch sizes and fit its memory line.

    Per (precision, memory format): micro-batch 1 and the largest divisor of the effective batch up to half of it
    (both run with accumulation, so the gradients are alive in forward, as in every plan but the one without
    accumulation), then each checkpointing choice at the larger size, in each of the search's checkpoint modes (a
    mode the blocks cannot run in is left out, with a note). The optimizer is fused where the optimizer
    supports it: fused needs no temporaries and launches the fewest kernels, so it dominates foreach and for-loop.
    """
    w, eff = search.workload, search.effective
    facts = search.facts = model_facts(w)
    opt: OptimizerImpl = w.optimizer_impl
    if opt in ("default", "foreach") and "fused" in facts.optimizer_impls:
        opt = "fused"
    precisions: list[Precision] = [w.precision] + (["bf16"] if search.allow_precision_change and w.precision == "fp32" else [])
    formats = [w.channels_last] + ([True] if facts.has_conv and not w.channels_last else [])
    b_lo = 1
    b_mid = max(d for d in divisors(eff) if d <= max(1, eff // 2))
    modes = list(dict.fromkeys(search.checkpoint_modes))
    structures: list[_Structure] = []
    models: dict[_Structure, _MemoryModel] = {}
    for precision in precisions:
        for channels_last in formats:
            base = _Structure(precision, (), opt, channels_last)
            lo = search.estimate(base.config(b_lo, eff))
            mid = search.estimate(base.config(b_mid, eff))
            fb_lo, other_lo = _phase_peaks(lo)
            fb_mid, other_mid = _phase_peaks(mid)
            span = max(b_mid - b_lo, 1)
            models[base] = _MemoryModel(fb_lo, (fb_mid - fb_lo) / span, max(other_lo, other_mid),
                                        mid.fits_in_upper_bytes / mid.peak_allocated_bytes, b_lo)
            structures.append(base)
            for blocks in checkpoint_choices(mid.activations_by_module, facts.blocks):
                for mode in modes:
                    s = dataclasses.replace(base, checkpoint=blocks, checkpoint_mode=mode)
                    try:
                        e = search.estimate(s.config(b_mid, eff))
                    except MemfitError as exc:
                        if mode == "full":
                            raise
                        # the blocks cannot run this way (a keyword tensor that needs a gradient under reentrant
                        # checkpointing, an in-place op on an output selective checkpointing keeps): leave it out
                        modes.remove(mode)
                        search.notes.append(f"{mode} checkpointing left out: {exc}")
                        continue
                    fb, other = _phase_peaks(e)
                    # the line through base at b_lo (an upper bound: checkpointing shrinks it too) and this estimate
                    models[s] = _MemoryModel(fb_lo, (fb - fb_lo) / span, other,
                                             e.fits_in_upper_bytes / e.peak_allocated_bytes, b_lo)
                    structures.append(s)
    return structures, models


def _score(search: Search, model: _MemoryModel, config: Config) -> Candidate:
    """The candidate with the memory line's prediction, or the estimate's where this exact config has one."""
    est = search.estimates.get(config)
    if est is not None:
        return verified(search, config)
    return _candidate(search, config, model.fits_in(config.micro_batch), search.context_bytes, verified=False)


def verified(search: Search, config: Config) -> Candidate:
    """The candidate from an estimate of exactly ``config`` (run now if it was not yet)."""
    est = search.estimate(config)
    return _candidate(search, config, est.fits_in_upper_bytes, est.device_upper_bytes - est.fits_in_upper_bytes,
                      verified=True)


def _candidate(search: Search, config: Config, fits_in: int, context: int, *, verified: bool) -> Candidate:
    device = fits_in + context
    t = search.step_time(config)
    return Candidate(
        config=config, device_bytes=device, fits_in_bytes=fits_in, step_time_s=t,
        samples_per_s=config.effective_batch / t if t else None, verified=verified,
        fits=device <= search.limit_bytes,
    )


def _floor_of(search: Search, config: Config) -> int:
    """The largest ``Search.need_floor`` of an estimated configuration of the same structure with gradients alive in
    forward (accumulation) and a micro-batch no larger than ``config``'s; 0 when none. Only configurations with
    accumulation compare: without it, no gradients are alive in forward, so it can need less."""
    if config.accumulation_steps == 1:
        return 0
    key = _structure(config)
    return max((search.need_floor(c) for c in search.estimates
                if c.accumulation_steps > 1 and c.micro_batch <= config.micro_batch and _structure(c) == key),
               default=0)


def _probe(search: Search, model: _MemoryModel, config: Config) -> Config:
    """What to estimate to settle ``config``: the smallest micro-batch of its structure above every one known to
    fit that the memory line puts over the limit, when that is below ``config``'s. If it misses, its floor rules
    out ``config`` and everything larger in one estimate; if it fits, the line was wrong there and the next probe
    is larger. Without accumulation (no floor to use), or when the line says ``config`` fits: ``config`` itself."""
    if config.accumulation_steps == 1:
        return config
    key = _structure(config)
    same = {c.micro_batch: search.estimates[c] for c in search.estimates
            if _structure(c) == key and c.accumulation_steps > 1 and not c.expandable_segments}
    fit = max((m for m, e in same.items() if e.device_upper_bytes <= search.limit_bytes), default=0)
    eff = search.effective
    for m in divisors(eff):
        if fit < m <= config.micro_batch and m != eff and m not in same \
                and model.fits_in(m) + search.context_bytes > search.limit_bytes:
            return dataclasses.replace(config, micro_batch=m, accumulation_steps=eff // m)
    return config


def _speed_key(c: Candidate) -> tuple[float, int]:
    return (c.step_time_s if c.step_time_s is not None else float("inf"), c.device_bytes)


def _walk(search: Search, configs: list[Config], models: dict[_Structure, _MemoryModel]
          ) -> tuple[Candidate | None, list[str]]:
    """The fastest configuration that fits, by an estimate of exactly it.

    Candidates are taken from the fastest (the speed model on the costs known so far). The fastest left is
    estimated exactly, or ruled out by ``need_floor`` of a smaller configuration of its structure, or settled by a
    probe the memory line picks (``_probe``); the walk stops when the fastest left is an exact estimate that fits.
    So nothing predicted faster than the plan was ruled out by the line: the line only chooses what to estimate
    first. A miss whose floor (its requested bytes) fits is retried with expandable segments: fragmentation is
    the gap.
    None when every configuration was estimated or ruled out, the smallest of each structure estimated.
    """
    notes: list[str] = []
    out: set[Config] = set()
    while True:
        pending = [_score(search, models[_structure(c)[0]], c) for c in configs if c not in out]
        if not pending:
            return None, notes
        best = min(pending, key=_speed_key)
        c = best.config
        if best.verified:
            if best.fits:
                return best, notes
            out.add(c)
            if not search.allocator.expandable_segments and search.need_floor(c) <= search.limit_bytes:
                ex = verified(search, dataclasses.replace(c, expandable_segments=True))
                if ex.fits:
                    notes.append(f"{c.label()} fits only with expandable segments (less fragmentation)")
                    return ex, notes
            continue
        if _floor_of(search, c) > search.limit_bytes:
            out.add(c)
            continue
        search.estimate(_probe(search, models[_structure(c)[0]], c))


def _frontier(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on both memory and time, by memory."""
    out: list[Candidate] = []
    best_time = float("inf")
    for c in sorted(candidates, key=lambda c: (c.device_bytes, c.step_time_s or 0.0)):
        if c.step_time_s is not None and c.step_time_s < best_time:
            out.append(c)
            best_time = c.step_time_s
    return out
