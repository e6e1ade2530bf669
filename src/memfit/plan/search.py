"""``plan()``: the fastest training configuration whose predicted memory fits a budget.

The search turns the knobs that keep the training mathematics (micro-batch × gradient accumulation with the
same effective batch, activation checkpointing of chosen blocks, the optimizer's implementation, channels_last,
expandable segments, the chunked cross-entropy of a causal LM) and, only when allowed, the precision and where
Adam keeps its states (torchao's 8-bit states, or offloaded to the CPU). Memory comes from ``estimate()``: a few estimates
per structure give a line ``fits_in(micro_batch)``, and every configuration the plan can choose is verified by
an estimate of exactly that configuration before it is chosen. Speed comes from ``memfit.speed.step_time``: a roofline of
the traced ops, or its calibration on this machine's GPU. What it returns (``Config``, ``Candidate``, ``Plan``)
is in ``memfit.plan.records``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit.errors import BudgetTooSmallError, DeviceError, MemfitError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.bound import BASE_SLACK_BYTES, structural_widening, widening
from memfit.estimate.gpus import GpuSpec, detect_gpu, gpu_spec
from memfit.estimate.predict import Estimate, estimate
from memfit.estimate.trace import trace_workload
from memfit.plan.lanes import TraceLane, lane_is_useful
from memfit.plan.race import Racer, time_on_this_gpu
from memfit.plan.race import race as race_near_ties
from memfit.plan.records import Candidate, Config, Plan
from memfit.speed.model_choice import CalibrationChoice, choose_speed_model, same_card
from memfit.speed.step_time import Calibration, PhaseCost, predict_step_time
from memfit.units import format_bytes
from memfit.workload.knobs import ModelFacts, checkpoint_choices, model_facts
from memfit.workload.spec import (
    CHECKPOINT_MODES,
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

DEFAULT_MARGIN = 0.0
"""The plan keeps ``device_bytes <= budget × (1 - margin)``, where ``device_bytes`` is already the estimate's upper
bound (``Estimate.device_upper_bytes``: the estimator's error, its placement margin and every named uncertainty),
the number ``memfit estimate --budget`` and ``explain`` decide "fits" with. A second 2 % on top only hid
configurations that run: on an H100 it kept the patch search for the 3-D U-Net at 12 GB one rung short (160³, its
bound 0.6 % over the limit, ran under the cap: benchmarks/results/plan/patch_caps_h100_*_r2 and _r3), while the
bound held on 60 of 60 validation steps on the H100 and the H200 (corpus_accuracy_*_torch2.11_20261126.md), and
every plan of the sweep made without it ran under its cap in a fresh process but one, which the bound then answered
(a 3-D U-Net with reentrant checkpointing: plan_verify_h100_*_r3, plan_sweep_h100_*_r4). Raise it where
memory the estimate does not see is in play (``cudnn.benchmark``'s trial workspaces: the nnU-Net planner keeps 2 %)."""


_FB_PHASES = ("forward", "loss", "backward")


@dataclass(frozen=True)
class _Structure:
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


def _phase_peaks(est: Estimate) -> tuple[int, int]:
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
        (key, patch), eff = _structure(config), config.effective_batch
        losses = {"default", config.loss_impl}  # the default loss does no more work than the chunked one
        mode = config.checkpoint_mode
        fewer = {(c.checkpoint, c.loss_impl) for c in self.estimates
                 if set(c.checkpoint) <= set(config.checkpoint) and c.loss_impl in losses
                 and (c.checkpoint_mode == mode or not c.checkpoint)
                 and _structure(dataclasses.replace(c, checkpoint=config.checkpoint, loss_impl=config.loss_impl,
                                                    checkpoint_mode=mode)) == (key, patch)}
        others = (self.raw_step_time(dataclasses.replace(config, checkpoint=blocks, loss_impl=loss, micro_batch=m,
                                                         accumulation_steps=eff // m,
                                                         checkpoint_mode=mode if blocks else "full"))
                  for blocks, loss in fewer for m in divisors(eff) if m >= config.micro_batch)
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
    return (_Structure(c.precision, c.checkpoint, c.optimizer_impl, c.channels_last, c.loss_impl, c.checkpoint_mode,
                       c.optimizer_state),
            c.patch_size)


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
    calibration: CalibrationChoice = "auto",
    checkpoint_modes: tuple[CheckpointMode, ...] = DEFAULT_CHECKPOINT_MODES,
    allow_optimizer_state_change: bool = False,
    race: bool | Racer | None = None,
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
        allow_optimizer_state_change: also consider torchao's 8-bit Adam states (changes numerics) and its
            CPU-offloaded Adam (much slower steps), for a ``torch.optim.Adam``/``AdamW``; running them needs torchao.
        calibration: the speed model that ranks the configurations. ``"auto"``: calibrated (a few micro-batches
            timed, seconds) when CUDA is available and this machine's GPU is ``gpu``, else the roofline;
            ``"roofline"`` (or None): never time anything; a ``memfit.speed.step_time.Calibration``: that one.
            The plan's ``speed_model`` and its first note say which and why (``memfit.speed.model_choice``).
        checkpoint_modes: how the chosen blocks may be checkpointed (``Workload.checkpoint_mode``): each block set
            is estimated in each mode, and the speed model picks (``selective`` keeps more memory and recomputes
            less; ``reentrant`` keeps what ``full`` keeps with fewer hooks). Default: full and reentrant
            (``DEFAULT_CHECKPOINT_MODES``); add ``"selective"`` to try op-level checkpointing too.
        race: settle a near-tie by timing (``memfit.plan.race``): the configurations verified to fit and predicted
            within ``RACE_WITHIN`` of the pick (at most ``RACE_SIZE``) run a few steps each on this machine's GPU,
            and the fastest measured is the plan. None (default): where the speed model is calibrated and this
            machine's GPU is ``gpu``; True: on this machine's GPU (a ``DeviceError`` without one); False: never; a
            ``Racer``: its timings.

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
    speed = choose_speed_model(workload, spec, calibration, effective_batch=eff)
    search = Search(workload, spec, config, limit, eff, speed.calibration, allow_precision_change,
                    tuple(checkpoint_modes), allow_optimizer_state_change=allow_optimizer_state_change)
    with search.side_lane():
        structures, models = _memory_models(search)
        configs = [s.config(m, eff) for s in structures for m in divisors(eff)]
        chosen, notes = _walk(search, configs, models)
        finer = _finer_checkpointing(search, chosen) if chosen is not None else []
        for candidate in finer:
            if candidate.fits and chosen is not None and _speed_key(candidate, workload.channels_last) < _speed_key(
                    chosen, workload.channels_last):
                chosen = candidate
        notes = [speed.reason, *search.notes, *notes]
        scored = [_score(search, models[s], c) for c in configs for s in (_structure(c)[0],)] + finer
        racer = _racer(race, workload, spec, speed.name)
        if chosen is not None and racer is not None:
            chosen, timed, note = race_near_ties(
                chosen, scored, rank=lambda c: _speed_key(c, workload.channels_last)[0],
                verify=lambda config: verified(search, config), racer=racer)
            if note:
                notes.append(note)
            again = {c.config for c in timed}
            scored = [c for c in scored if c.config not in again] + timed
        if chosen is None:
            # every configuration of the search was estimated or ruled out: try the smallest with every optimizer
            # implementation and with every block checkpointed, before saying nothing fits
            chosen, smallest = _smallest_exactly(search, structures)
            if chosen is None:
                raise _nothing_fits(search, smallest, budget_bytes, margin)
            notes.append(f"only {chosen.config.label()} fits, found by estimating the smallest configurations exactly")
    if chosen.config.optimizer_state != workload.optimizer_state:
        notes.append({"8bit": "Adam's states are torchao's 8-bit ones (AdamW8bit): numerics change slightly",
                      "cpu_offload": "Adam runs on the CPU (torchao's CPUOffloadOptimizer): GPU memory for speed",
                      "full": "Adam's states are kept in full precision"}[chosen.config.optimizer_state]
                     + "; Plan.apply swaps the optimizer (needs torchao: pip install torchao)")
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
        speed_model=speed.name,
        notes=notes,
        elapsed_s=time.perf_counter() - started,
    )


def _racer(race: bool | Racer | None, workload: Workload, planned: GpuSpec, speed_model: str) -> Racer | None:
    """What settles near-ties (``plan(race=...)``): None where nothing is timed."""
    if callable(race):
        return race
    if race is False:
        return None
    here = detect_gpu() if race or speed_model == "calibrated" else None
    if race and here is None:
        raise DeviceError("race=True times configurations on this machine's GPU, and there is no CUDA GPU here; "
                          "pass race=False (or leave it None) to plan without timing.")
    if here is None or not (race or same_card(planned, here)):
        return None
    return time_on_this_gpu(workload)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (an effective batch may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _smallest_exactly(search: Search, structures: list[_Structure]) -> tuple[Candidate | None, Candidate]:
    """Estimate exactly the configurations most likely to need the least memory; the fastest that fits (or None)
    and the smallest.

    For each precision and loss the search has: micro-batch 1 and the whole effective batch at once (no accumulation, so
    no gradients alive in forward), each without checkpointing and with every block checkpointed; then the
    smallest of those with every optimizer implementation the optimizer has. Each is also tried with expandable
    segments when fragmentation is what keeps it out. The memory format stays the workload's: channels_last is a
    speed knob, and each format would double the traces of a path that can already take minutes on a large model.
    """
    facts = search.facts
    eff = search.effective
    full = tuple(facts.blocks) if facts is not None else ()
    configs = []
    for precision, impl, loss, state in dict.fromkeys((s.precision, s.optimizer_impl, s.loss_impl, s.optimizer_state)
                                                      for s in structures):
        for checkpoint in dict.fromkeys(((), full)):
            for micro in dict.fromkeys((1, eff)):
                structure = _Structure(precision, checkpoint, impl, search.workload.channels_last, loss,
                                       optimizer_state=state)
                configs.append(structure.config(micro, eff))
    search.guess(configs)
    found = [verified(search, c) for c in configs]
    smallest = min(found, key=lambda c: c.device_bytes)
    impls = ["default", *(facts.optimizer_impls if facts is not None else ())]

    def runs(impl: OptimizerImpl) -> OptimizerImpl:  # "default" is one of the others where memfit can tell which
        return facts.default_impl if impl == "default" and facts is not None and facts.default_impl else impl

    tried = {runs(smallest.config.optimizer_impl)}
    others = []
    for other in impls if smallest.config.optimizer_state == "full" else ():
        if runs(other) not in tried:
            tried.add(runs(other))
            others.append(dataclasses.replace(smallest.config, optimizer_impl=other))
    search.guess(others)  # the lane traces the second while this process traces the first
    found += [verified(search, c) for c in others]
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


def _nothing_fits(search: Search, smallest: Candidate, budget_bytes: int, margin: float) -> BudgetTooSmallError:
    """The error of a plan that found nothing to fit: the smallest configuration estimated, and what to try."""
    w, facts = search.workload, search.facts
    return BudgetTooSmallError(
        f"nothing fits {format_bytes(budget_bytes)} (with the {margin:.0%} margin: {format_bytes(search.limit_bytes)}): "
        f"the smallest configuration found needs {format_bytes(smallest.device_bytes)} "
        f"({smallest.config.label()}: the least of {len(search.estimates)} configurations estimated "
        "exactly, micro-batch 1 and full checkpointing with every optimizer implementation among them). "
        "Try a budget of at least "
        f"{format_bytes(math.ceil(smallest.device_bytes / (1 - margin)))}, a larger GPU, "
        + ("--allow-precision-change, " if not search.allow_precision_change and w.precision == "fp32" else "")
        + ("--allow-optimizer-state-change, " if not search.allow_optimizer_state_change
           and facts is not None and len(facts.optimizer_states) > 1 else "")
        + "sharding across GPUs, or a smaller model or input."
    )


def _fastest_impl(w: Workload, facts: ModelFacts) -> OptimizerImpl:
    """The optimizer implementation the search gives every structure: fused where the optimizer has it (no
    temporaries, the fewest kernel launches: it dominates foreach and the for-loop), else the workload's."""
    if w.optimizer_impl in ("default", "foreach") and "fused" in facts.optimizer_impls:
        return "fused"
    return w.optimizer_impl


def check_budget(budget_bytes: int, margin: float) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise UsageError(f"budget must be a positive number of bytes, got {budget_bytes!r}.")
    if not 0 <= margin < 0.5:
        raise UsageError(f"margin must be in [0, 0.5), got {margin!r}.")


def _memory_models(search: Search) -> tuple[list[_Structure], dict[_Structure, _MemoryModel]]:
    """Estimate each structure at one or two micro-batch sizes and fit its memory line.

    Per (precision, memory format): micro-batch 1 and the largest divisor of the effective batch up to half of it
    (both run with accumulation, so the gradients are alive in forward, as in every plan but the one without
    accumulation), then each checkpointing choice at the larger size. The optimizer is fused where the optimizer
    supports it: fused needs no temporaries and launches the fewest kernels, so it dominates foreach and for-loop.
    Each structure is tried with every loss the model takes (``ModelFacts.loss_impls``: the chunked cross-entropy
    where memfit finds a causal LM's output layer); a loss other than the workload's whose trace fails (a loss
    function that reads the logits the chunked loss never makes) is left out, with a note. With
    ``allow_optimizer_state_change``, each is also tried with every ``ModelFacts.optimizer_states`` (torchao's 8-bit
    and CPU-offloaded Adam, whose kernels and copies the speed model charges).
    """
    w, eff = search.workload, search.effective
    facts = search.facts = model_facts(w)
    opt = _fastest_impl(w, facts)
    precisions: list[Precision] = [w.precision] + (["bf16"] if search.allow_precision_change and w.precision == "fp32" else [])
    formats = [w.channels_last] + ([True] if facts.has_conv and not w.channels_last else [])
    b_lo = 1
    b_mid = _b_mid(eff)
    structures: list[_Structure] = []
    models: dict[_Structure, _MemoryModel] = {}
    losses: list[LossImpl] = list(dict.fromkeys([w.loss_impl, *facts.loss_impls]))
    modes = list(dict.fromkeys(search.checkpoint_modes))
    # torchao's states bring their own update: the optimizer implementation stays "default" with them
    states: list[OptimizerState] = list(dict.fromkeys(
        [w.optimizer_state, *(facts.optimizer_states if search.allow_optimizer_state_change else ())]))
    for precision, channels_last, loss, state in itertools.product(precisions, formats, losses, states):
        base = _Structure(precision, (), opt if state == "full" else "default", channels_last, loss,
                          optimizer_state=state)
        search.guess([base.config(b_mid, eff)])
        try:
            lo = search.estimate(base.config(b_lo, eff))
            mid = search.estimate(base.config(b_mid, eff))
        except Exception as exc:  # noqa: BLE001 - any failure of the other loss only rules that knob out
            if loss == w.loss_impl:  # the workload as given: its errors are the user's to see
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            note = (f"the {loss} loss was not tried: tracing it failed ({type(exc).__name__}: {first:.200}); the "
                    "loss function must take the model's loss (out.loss), as the chunked loss makes no logits")
            if note not in search.notes:
                search.notes.append(note)
            continue
        if channels_last != w.channels_last and not _format_may_pay(search, base, mid, b_mid, eff):
            continue
        fb_lo, other_lo = _phase_peaks(lo)
        fb_mid, other_mid = _phase_peaks(mid)
        span = max(b_mid - b_lo, 1)
        models[base] = _MemoryModel(fb_lo, (fb_mid - fb_lo) / span, max(other_lo, other_mid),
                                    mid.fits_in_upper_bytes / mid.peak_allocated_bytes, b_lo)
        structures.append(base)
        choices = checkpoint_choices(mid.activations_by_module, facts.blocks)
        search.guess([dataclasses.replace(base, checkpoint=blocks, checkpoint_mode=mode).config(b_mid, eff)
                      for blocks in choices for mode in modes])
        for blocks in choices:
            for mode in list(modes):
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


FINER_CHECKPOINT_SHARE = 0.75
"""Where the plan checkpoints more blocks than this share of the activations needs, it also tries the fewest blocks
holding it, at the plan's own micro-batch and checkpoint mode: with half and all only, ViT-B/16 at a 4 GiB
budget checkpointed all 12 blocks where 9 ran under the cap 10 % faster (H100 sweep:
plan_sweep_h100_torch2.11_20261126_final, 0.907 of the best; r5: 1.000). Tried only there it costs one trace;
as a structure of its own in every walk, 10-13 s of GPT-2's plan at 5.5 GiB."""


def _b_mid(effective: int) -> int:
    """The larger micro-batch the memory models are fitted at: the largest divisor up to half the batch."""
    return max(d for d in divisors(effective) if d <= max(1, effective // 2))


def _finer_checkpointing(search: Search, chosen: Candidate) -> list[Candidate]:
    """The chosen configuration with the fewest blocks holding ``FINER_CHECKPOINT_SHARE`` of the activations
    checkpointed instead, in the plan's checkpoint mode, estimated exactly; none when the chosen plan does not
    checkpoint more blocks than that. At the same micro-batch fewer recomputed blocks can only be faster."""
    c, b_mid = chosen.config, _b_mid(search.effective)
    base = dataclasses.replace(c, checkpoint=(), checkpoint_mode="full", expandable_segments=False,
                               micro_batch=b_mid, accumulation_steps=search.effective // b_mid)
    mid = search.estimates.get(base)
    if not c.checkpoint or mid is None or search.facts is None:
        return []
    finer = checkpoint_choices(mid.activations_by_module, search.facts.blocks, (FINER_CHECKPOINT_SHARE,))[0]
    if not set(finer) < set(c.checkpoint):
        return []
    try:
        return [verified(search, dataclasses.replace(c, checkpoint=finer))]
    except MemfitError:
        return []  # these blocks cannot run in the plan's mode (a first pass would have said why)


def _format_may_pay(search: Search, other: _Structure, estimate: Estimate, micro: int, effective: int) -> bool:
    """Whether the memory format the workload does not use is worth its checkpointing choices: predicted
    ``LAYOUT_CHANGE_GAIN`` faster than the workload's own format, or smaller, without checkpointing at ``micro``
    (cuDNN's layout conversions). Otherwise the walk would never pick it (``_speed_key``), and its checkpointed
    structures only cost traces (ViT-B/16: 12 of its 29)."""
    own = dataclasses.replace(other, channels_last=search.workload.channels_last).config(micro, effective)
    own_estimate = search.estimates.get(own)
    t_own, t_other = search.step_time(own), search.step_time(other.config(micro, effective))
    if own_estimate is None or t_own is None or t_other is None:
        return True
    faster = t_other * (1 + LAYOUT_CHANGE_GAIN) < t_own
    return faster or estimate.fits_in_upper_bytes < own_estimate.fits_in_upper_bytes


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


def _expandable_floor(search: Search, config: Config) -> int:
    """The least ``device_upper_bytes`` ``config`` (estimated) can have with expandable segments: its required peak
    widened by the base margin and the reasons its own trace recorded, plus their bytes and the context. The replay
    with expandable segments reuses that trace, so the same reasons widen its bound
    (``memfit.estimate.bound.upper_bound``), over a replayed cap never below the required peak."""
    est = search.estimates[dataclasses.replace(config, expandable_segments=False)]
    widen, extra = widening(est.uncertainty)
    return int(search.required_peak(config) * (1 + widen)) + extra + search.context_of(config)


def _floor_of(search: Search, config: Config) -> int:
    """The largest floor an estimated configuration of the same structure with accumulation and a micro-batch no
    larger than ``config``'s puts under it; 0 when none. With accumulation, ``Search.need_floor``: gradients are
    alive in forward in both. Without (``config`` runs the whole batch at once, no gradients alive in forward, so
    it can need less), ``Search.whole_batch_floor``: one steady micro-batch's window."""
    key = _structure(config)
    floor = search.need_floor if config.accumulation_steps > 1 else search.whole_batch_floor
    return max((floor(c) for c in search.estimates
                if c.accumulation_steps > 1 and c.micro_batch <= config.micro_batch and _structure(c) == key),
               default=0)


def _probe(search: Search, model: _MemoryModel, config: Config) -> Config:
    """What to estimate to settle ``config``: the smallest micro-batch of its structure above every one known to
    fit that the memory line puts over the limit, when that is below ``config``'s. If it misses, its floor rules
    out ``config`` and everything larger in one estimate; if it fits, the line was wrong there and the next probe
    is larger. Without accumulation (no floor to use), or when the line says ``config`` fits: ``config`` itself."""
    if config.accumulation_steps == 1:
        return config
    same = _exact_rungs(search, _structure(config))
    fit = max((m for m, e in same.items() if e.device_upper_bytes <= search.limit_bytes), default=0)
    for m in _line_misses(search, model, fit, config.micro_batch):
        if m not in same:
            return _at_micro(config, m, search.effective)
    return config


def _exact_rungs(search: Search, key: tuple[_Structure, tuple[int, ...] | None]) -> dict[int, Estimate]:
    """The exact estimates of structure ``key`` with accumulation and without expandable segments, by micro-batch."""
    return {c.micro_batch: e for c, e in search.estimates.items()
            if _structure(c) == key and c.accumulation_steps > 1 and not c.expandable_segments}


def _line_misses(search: Search, model: _MemoryModel, above: int, up_to: int) -> list[int]:
    """The micro-batches in (``above``, ``up_to``], with accumulation, that the memory line puts over the limit."""
    eff = search.effective
    return [m for m in divisors(eff) if above < m <= up_to and m != eff
            and model.fits_in(m) + search.context_bytes > search.limit_bytes]


def _at_micro(config: Config, micro: int, effective: int) -> Config:
    return dataclasses.replace(config, micro_batch=micro, accumulation_steps=effective // micro)


LAYOUT_CHANGE_GAIN = 0.02
"""How much faster the speed model must call another memory format than the workload's own before the plan
changes it. The roofline prices convolutions' layouts, not what the layout does to the ops around them: on ViT-B/16
(one convolution, the patch embedding) it called channels_last 0.08 % faster at a 3 GiB budget, and the step ran
8 % slower (H100, interleaved: plan_sweep_h100_torch2.11_20261127_r5, 48.5 against 44.7 ms). The 2-D U-Net's
predicted gain is far above this: its plans keep channels_last at all four budgets, the configurations its sweep
found fastest (plan_sweep_h100_torch2.11_20261126_r2)."""


def _speed_key(c: Candidate, channels_last: bool = False) -> tuple[float, int]:
    """What the walk ranks by: the step time, with a change of memory format charged ``LAYOUT_CHANGE_GAIN``."""
    if c.step_time_s is None:
        return (float("inf"), c.device_bytes)
    changed = c.config.channels_last != channels_last
    return (c.step_time_s * (1 + LAYOUT_CHANGE_GAIN if changed else 1.0), c.device_bytes)


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
        best = min(pending, key=lambda c: _speed_key(c, search.workload.channels_last))
        c = best.config
        if best.verified:
            if best.fits:
                return best, notes
            out.add(c)
            if not search.allocator.expandable_segments and _expandable_floor(search, c) <= search.limit_bytes:
                ex = verified(search, dataclasses.replace(c, expandable_segments=True))
                if ex.fits:
                    notes.append(f"{c.label()} fits only with expandable segments (less fragmentation)")
                    return ex, notes
            continue
        if _floor_of(search, c) > search.limit_bytes:
            out.add(c)
            continue
        probe = _probe(search, models[_structure(c)[0]], c)
        search.guess(_next_probes(search, pending, best, probe, models, out))
        search.estimate(probe)


LANE_GUESSES = 2
"""How many estimates the walk guesses ahead for the lane: with two, this process makes the first while the lane
traces the second (``TraceLane.guess`` starts from the last)."""


def _next_probes(search: Search, pending: list[Candidate], best: Candidate, probe: Config,
                 models: dict[_Structure, _MemoryModel], out: set[Config]) -> list[Config]:
    """What the walk will probably estimate after ``probe``, in order: if ``probe`` is expected to fit, the
    micro-batches of its structure above it up to ``best``'s that the memory line puts over the limit (each a probe
    in turn); then the probes of the next-fastest candidates of other structures. At most ``LANE_GUESSES``.
    ``probe`` is expected to fit unless two exact estimates of its structure below it, extended along their line,
    put it over the limit (the memory line through micro-batch 1 and the middle is too coarse to tell)."""
    key = _structure(probe)
    below = sorted((m, e.device_upper_bytes) for m, e in _exact_rungs(search, key).items() if m < probe.micro_batch)
    expected_to_fit = True  # else the walk moves on to another structure after it
    if len(below) >= 2:
        (m0, b0), (m1, b1) = below[-2:]
        expected_to_fit = b1 + (b1 - b0) / (m1 - m0) * (probe.micro_batch - m1) <= search.limit_bytes
    model = models[_structure(best.config)[0]]
    guesses = [_at_micro(probe, m, search.effective) for m in _line_misses(
        search, model, probe.micro_batch, best.config.micro_batch)] if expected_to_fit else []
    for c in sorted(pending, key=lambda c: _speed_key(c, search.workload.channels_last)):
        if len(guesses) >= LANE_GUESSES:
            break
        if c is best or c.verified or c.config in out or _structure(c.config) == key \
                or _floor_of(search, c.config) > search.limit_bytes:
            continue
        guesses.append(_probe(search, models[_structure(c.config)[0]], c.config))
    return [g for g in dict.fromkeys(guesses) if g not in search.estimates][:LANE_GUESSES]


def _frontier(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on both memory and time, by memory."""
    out: list[Candidate] = []
    best_time = float("inf")
    for c in sorted(candidates, key=lambda c: (c.device_bytes, c.step_time_s or 0.0)):
        if c.step_time_s is not None and c.step_time_s < best_time:
            out.append(c)
            best_time = c.step_time_s
    return out
