"""What the plan's search knows: the exact estimate of each configuration it asked for, the floors those put
under larger configurations of the same structure, and the predicted step time of any configuration.

A structure (``Structure``) is everything of a configuration but its micro-batch and accumulation; estimates of one
structure at two micro-batches give the speed model every op's cost at any other (``cost_at``). ``Search`` also
holds the lane that traces the search's next guesses beside this process (``memfit.plan.lanes``). The walk that
decides what to ask next is ``memfit.plan.walk``; ``memfit.plan.search.plan`` drives both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.bound import BASE_SLACK_BYTES, structural_widening
from memfit.estimate.gpus import GpuSpec
from memfit.estimate.predict import Estimate, estimate
from memfit.estimate.trace import trace_workload
from memfit.plan.lanes import TraceLane, lane_is_useful
from memfit.plan.records import Config
from memfit.speed.step_time import Calibration, PhaseCost, predict_step_time
from memfit.workload.knobs import ModelFacts
from memfit.workload.spec import (
    CheckpointMode,
    LossImpl,
    OptimizerImpl,
    OptimizerState,
    Precision,
    Workload,
)

DEFAULT_CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("full", "reentrant")
"""The checkpoint modes a plan tries unless told otherwise. Measured on an H100 (torch 2.11; GPT-2 micro-batch 8,
ViT-B/16 and ResNet-50 micro-batch 64, every block checkpointed; benchmarks/results/plan/
checkpoint_modes_h100_torch2.11_20261126.json): every mode's peak allocated within 0.22 % of its estimate;
reentrant 19-26 % faster than full in all three, as the speed model ranks it; selective 1.4-1.5 x *slower* than full
in all three, where the speed model predicted it faster for ResNet-50 (54 ms against 56; measured 95 against 63).
Until the speed model prices it right, op-level checkpointing is tried only on request."""


_FB_PHASES = ("forward", "loss", "backward")


@dataclass(frozen=True)
class Structure:
    """Everything but the micro-batch size."""

    precision: Precision
    checkpoint: tuple[str, ...] = ()
    optimizer_impl: OptimizerImpl = "default"
    channels_last: bool = False
    loss_impl: LossImpl = "default"
    checkpoint_mode: CheckpointMode = "full"
    """How ``checkpoint`` runs; ``full`` when nothing is checkpointed, so that structure is one."""
    optimizer_state: OptimizerState = "full"

    def config(self, micro: int, effective: int, expandable: bool = False) -> Config:
        return Config(
            micro_batch=micro, accumulation_steps=effective // micro, precision=self.precision,
            checkpoint=self.checkpoint, optimizer_impl=self.optimizer_impl, channels_last=self.channels_last,
            expandable_segments=expandable, loss_impl=self.loss_impl, checkpoint_mode=self.checkpoint_mode,
            optimizer_state=self.optimizer_state,
        )


def phase_peaks(est: Estimate) -> tuple[int, int]:
    """Peak allocated in forward/backward, and elsewhere (optimizer step, zero_grad): they scale differently."""
    fb = max((p.allocated_bytes for p in est.timeline if p.phase in _FB_PHASES), default=0)
    other = max((p.allocated_bytes for p in est.timeline if p.phase not in _FB_PHASES), default=0)
    return fb, other


def _required_peak(events: list[tuple[int, int, int]], begin: int, end: int) -> int:
    """The most bytes the required allocations (op 1; op 2 is optional, -1 a free) keep alive after any of
    ``events[begin:end]``, counting those made before ``begin`` that are still alive."""
    live, peak, sizes = 0, 0, {}
    for i, (op, key, nbytes) in enumerate(events[:end]):
        if op == 1:
            sizes[key] = nbytes
            live += nbytes
        elif op < 0:
            live -= sizes.pop(key, 0)
        if i >= begin:
            peak = max(peak, live)
    return peak


WHOLE_BATCH_SLACK = 1 << 20
"""Taken off the window a whole-batch floor is read from (``Search.whole_batch_floor``): the scalar the loss divided
by the accumulation steps makes there, which a step without accumulation does not (512 bytes as the allocator
rounds it; a MiB leaves room for a few such)."""


class Search:
    """The estimates of one planning run, and the memory/speed models built from them."""

    def __init__(self, workload: Workload, gpu: GpuSpec, allocator: AllocatorConfig, limit_bytes: int,
                 effective: int, calibration: Calibration | None, allow_precision_change: bool,
                 checkpoint_modes: tuple[CheckpointMode, ...] = DEFAULT_CHECKPOINT_MODES, *,
                 allow_optimizer_state_change: bool = False) -> None:
        self.workload, self.gpu, self.allocator = workload, gpu, allocator
        self.checkpoint_modes = checkpoint_modes
        """How the chosen blocks may be checkpointed (``Workload.checkpoint_mode``)."""
        self.allow_precision_change = allow_precision_change
        self.allow_optimizer_state_change = allow_optimizer_state_change
        self.limit_bytes, self.effective, self.calibration = limit_bytes, effective, calibration
        self.estimates: dict[Config, Estimate] = {}
        self.context_bytes = gpu.cuda_context_bytes  # until an estimate says whether the step calls cuBLAS
        self.traces: dict[Config, Any] = {}
        self.runs = 0
        self._times: dict[tuple[Any, ...], float] = {}
        self._floors: dict[int, int] = {}  # required peaks, by id() of the trace, which self.traces keeps alive
        self._window_peaks: dict[int, int] = {}  # the same, over one steady micro-batch (``whole_batch_floor``)
        self.facts: ModelFacts | None = None
        """What the model offers (blocks to checkpoint, optimizer implementations), once the search has looked."""
        self.notes: list[str] = []
        """What the plan says about knobs the search could not try."""
        self.lane: TraceLane[Config, tuple[Any, Estimate]] | None = None
        """Where traces the search will probably want are made side by side with this process's (``plan`` opens
        one where a second CPU is free); None: every trace is made here."""

    def trace(self, config: Config) -> Any:
        """The trace of ``config`` (expandable segments off: the allocator setting does not change the trace)."""
        return trace_workload(self.workload.replace(**config.changes()), self.gpu)

    def _replay(self, config: Config, trace: Any) -> Estimate:
        # a configuration asks for expandable segments; an allocator that has them already keeps them
        allocator = dataclasses.replace(
            self.allocator, expandable_segments=self.allocator.expandable_segments or config.expandable_segments)
        return estimate(self.workload.replace(**config.changes()), gpu=self.gpu, allocator=allocator,
                        reuse_trace=trace)

    def trace_and_estimate(self, config: Config) -> tuple[Any, Estimate]:
        """The trace of ``config`` and its estimate: what the lane makes (``config`` has expandable segments off)."""
        trace = self.trace(config)
        return trace, self._replay(config, trace)

    @contextlib.contextmanager
    def side_lane(self) -> Iterator[None]:
        """A lane for the search's guesses while the block runs, where one pays (``lane_is_useful``)."""
        if self.lane is not None or not lane_is_useful():
            yield
            return
        self.lane = TraceLane(self.trace_and_estimate)
        try:
            yield
        finally:
            self.lane.close()
            self.lane = None

    def guess(self, configs: list[Config]) -> None:
        """Configurations the search will probably estimate next, in the order it will ask for them: their traces
        start in the lane, if there is one, while this process works on."""
        if self.lane is not None:
            plain = [dataclasses.replace(c, expandable_segments=False) for c in configs]
            self.lane.guess(plain, skip=lambda key: key in self.traces)

    def estimate(self, config: Config) -> Estimate:
        if config not in self.estimates:
            plain = dataclasses.replace(config, expandable_segments=False)
            made = None  # the lane's estimate of ``plain``, made beside its trace
            if plain not in self.traces:
                both = self.lane.take(plain) if self.lane is not None else None
                self.traces[plain], made = both if both is not None else (self.trace(plain), None)
                self.runs += 1
            est = made if made is not None and config == plain else self._replay(config, self.traces[plain])
            self.estimates[config] = est
            self.context_bytes = est.device_bytes - est.fits_in_bytes
        return self.estimates[config]

    def need_floor(self, config: Config, *, bound: bool = True) -> int:
        """A number no exact estimate of a configuration of the same structure whose every tensor is at least as
        large as ``config``'s can come in under, with or without expandable segments: the least
        ``device_upper_bytes`` such a configuration can have. ``config`` must have been estimated.

        Why it is safe: with the same op sequence, a larger micro-batch (or patch) makes every tensor at least as
        large, so the bytes requested and alive after every allocation, and their peak, are at least ``config``'s.
        The allocator gives each request a block at least as large, in either segment mode, so the replayed cap is
        never below that peak; "fits" is decided with the upper bound, which is the replayed cap widened by the
        base margin and the width of each reason its trace recorded, plus the base slack and the reasons' bytes
        (``memfit.estimate.bound.upper_bound``), plus the CUDA context, which holds cuBLAS's handles where the ops
        call cuBLAS, as ``config``'s do. The same op sequence records the same ``STRUCTURAL`` reasons (reentrant
        checkpointing of convolutions, an RNN); the others, and every reason's bytes, may come and go with sizes,
        and only add. The floor is that peak widened by the base margin and ``config``'s structural reasons, plus the
        base slack and that context. Optional allocations (a cuDNN workspace that may fail and fall back) are not
        counted. It assumes the traced op sequence does not depend on the batch size (no branch on
        ``x.shape[0]``); another structure (a checkpoint mode, a precision) runs other ops and is not compared.
        With the least context and the peak unwidened instead, ResNet-50's plan at 1.2 GiB (effective batch 64),
        where only micro-batch 1 fits, settled every structure rung by rung: 59 traces; with the base margin and
        not the structural widths, 33 (its reentrant structures' micro-batch 2 and 4 estimated, though reentrant
        checkpointing's width already put micro-batch 1's floor over the budget).

        ``bound=False``: a floor for the best estimate (``device_bytes``) instead, for a search that may take a
        configuration whose best estimate fits (``plan_patch`` settling rungs on the GPU): the peak unwidened, as
        ``fits_in`` is the replayed cap widened by less than the bound's margin.
        """
        peak = self.required_peak(config)
        if not bound:
            return peak + self.context_of(config)
        return self._widened(config, peak) + self.context_of(config)

    def _widened(self, config: Config, peak: int) -> int:
        """``peak`` widened as every upper bound of ``config``'s op sequence is at least (``need_floor``)."""
        return int(peak * (1 + structural_widening(self._trace_of(config).uncertain))) + BASE_SLACK_BYTES

    def _trace_of(self, config: Config) -> Any:
        """The trace ``config`` was estimated from (expandable segments do not change it)."""
        return self.traces[dataclasses.replace(config, expandable_segments=False)]

    def context_of(self, config: Config) -> int:
        """The CUDA context of ``config``'s step: with cuBLAS's handles where its ops call cuBLAS."""
        return self.gpu.context_bytes(self._trace_of(config).uses_cublas)

    def required_peak(self, config: Config) -> int:
        """The peak of the bytes ``config``'s required allocations (not the optional workspaces) ask for and keep
        alive, unrounded: what no allocator can serve in less. ``config`` must have been estimated."""
        trace = self._trace_of(config)
        if id(trace) not in self._floors:
            self._floors[id(trace)] = _required_peak(trace.events(), 0, len(trace.ops))
        return self._floors[id(trace)]

    def whole_batch_floor(self, config: Config) -> int:
        """A floor like ``need_floor`` for the configurations *without* accumulation of ``config``'s structure
        whose micro-batch is at least ``config``'s (which must have accumulation and have been estimated).

        Why it is safe: the first micro-batch of a steady step (step 1: optimizer state alive, the grads just set to
        None by ``zero_grad``) runs the op sequence of a whole step's forward and backward without accumulation, on
        fewer samples, with nothing alive before it that such a step lacks or has smaller (the held output of the
        last micro-batch, the batch of one micro-batch). So the required bytes alive over that window, and their
        peak, are at most such a step's. The one op accumulation adds there, the loss divided by the steps, makes
        a scalar: ``WHOLE_BATCH_SLACK`` is taken off for it. The rest is ``need_floor``'s argument.
        """
        trace = self._trace_of(config)
        if id(trace) not in self._window_peaks:
            steady = max(step for _, name, step in trace.phase_marks if name == "forward")
            starts = [at for at, name, step in trace.phase_marks if name == "forward" and step == steady]
            # a step of one micro-batch has no window without the grads alive: no floor from it
            begin, end = (starts[0], starts[1]) if len(starts) > 1 else (0, 0)
            self._window_peaks[id(trace)] = max(0, _required_peak(trace.events(), begin, end) - WHOLE_BATCH_SLACK)
        return self._widened(config, self._window_peaks[id(trace)]) + self.context_of(config)

    def step_time(self, config: Config) -> float | None:
        """Predicted optimizer-step time of ``config``, monotone by construction: never below the prediction for a
        configuration that does no more work. Those are the same configuration with a micro-batch at least as large
        (the same samples in fewer micro-batches: the same FLOPs with fewer kernel launches, dispatches and weight
        reads), with a subset of its checkpointed blocks under the same checkpoint mode (less recompute; the modes
        are not compared with each other: selective recomputes less on the GPU but runs every op of its blocks through
        Python dispatch modes, and reentrant recomputes more with fewer hooks), or, for the chunked cross-entropy, with
        the default loss (the chunked loss runs the same ops over chunks of tokens, more kernel launches, and one
        more output-layer matmul to recompute each chunk's logits in backward). Each such prediction comes from its own
        traces (``raw_step_time``), and traces of two structures differ in ways the roofline prices without
        physics (a checkpointed block's first forward runs without autograd recording, so the roofline can price
        it below the plain forward); the largest of them is the prediction. Precision, the optimizer's
        implementation and the memory format are different computations, so they are never compared: a fused
        optimizer may well be faster. None when no estimate of ``config``'s structure has a cost yet.
        """
        own = self.raw_step_time(config)
        if own is None:
            return None
        (key, patch), eff = structure_of(config), config.effective_batch
        losses = {"default", config.loss_impl}  # the default loss does no more work than the chunked one
        mode = config.checkpoint_mode
        fewer = {(c.checkpoint, c.loss_impl) for c in self.estimates
                 if set(c.checkpoint) <= set(config.checkpoint) and c.loss_impl in losses
                 and (c.checkpoint_mode == mode or not c.checkpoint)
                 and structure_of(dataclasses.replace(c, checkpoint=config.checkpoint, loss_impl=config.loss_impl,
                                                    checkpoint_mode=mode)) == (key, patch)}
        others = (self.raw_step_time(dataclasses.replace(config, checkpoint=blocks, loss_impl=loss, micro_batch=m,
                                                         accumulation_steps=eff // m,
                                                         checkpoint_mode=mode if blocks else "full"))
                  for blocks, loss in fewer for m in divisors(eff) if m >= config.micro_batch)
        return max([own, *(t for t in others if t is not None)])

    def raw_step_time(self, config: Config) -> float | None:
        """The speed model (``predict_step_time``) on the op costs of ``config``'s structure, interpolated op by
        op between the two estimated micro-batch sizes around it; None when no estimate of it has a cost."""
        key = structure_of(config)
        same = sorted(((c.micro_batch, e.cost) for c, e in self.estimates.items()
                       if structure_of(c) == key and not c.expandable_segments and e.cost is not None),
                      key=lambda mc: mc[0])
        if not same:
            return None
        # the walk re-ranks every candidate after each estimate: the roofline runs once per (config, costs known)
        memo = (config.micro_batch, config.accumulation_steps, key, tuple(m for m, _ in same))
        if memo not in self._times:
            cost = cost_at(same, config.micro_batch)
            self._times[memo] = predict_step_time(cost, self.gpu, accumulation=config.accumulation_steps,
                                                  calibration=self.calibration).step_time_s
        return self._times[memo]


def cost_at(known: list[tuple[int, Any]], micro: int) -> Any:
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


def structure_of(c: Config) -> tuple[Structure, tuple[int, ...] | None]:
    return (Structure(c.precision, c.checkpoint, c.optimizer_impl, c.channels_last, c.loss_impl, c.checkpoint_mode,
                       c.optimizer_state),
            c.patch_size)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (an effective batch may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
