"""``plan_patch()``: the largest input patch whose training step fits a budget — the nnU-Net question.

nnU-Net's planner walks the patch down from the median image shape with a rough proxy of memory (conv output
elements against a calibrated reference). This walks the same ladder, but decides with the estimator: each
decision is an estimate of exactly that patch (see ``docs/plan.md``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.predict import Estimate
from memfit.plan.records import Candidate, Config, Plan
from memfit.plan.search import DEFAULT_MARGIN, check_budget
from memfit.plan.search_state import Search
from memfit.plan.walk import verified
from memfit.speed.model_choice import CalibrationChoice, choose_speed_model
from memfit.units import format_bytes
from memfit.workload.spec import Workload

Settle = Callable[[Config, int], bool]
"""``settle(config, cap_bytes)``: does ``config``'s step run under an allocator cap of ``cap_bytes`` (bytes the
caching allocator may reserve, the CUDA context not included) on the GPU the plan is for."""


def trials_on_this_gpu(spec: str, *, timeout_s: float = 600) -> Settle:
    """A ``settle`` that runs the workload ``spec`` (a built-in name or ``file.py[:name]``, as the CLI takes it)
    with a configuration's changes in a fresh process under the cap: the protocol of ``memfit measure``, three
    steps (``memfit.estimate.measure.run_trial``); it ran if no step ran out of memory."""
    from memfit.estimate.measure import run_trial

    def settle(config: Config, cap_bytes: int) -> bool:
        changes = {k: list(v) if isinstance(v, tuple) else v for k, v in config.changes().items()}
        return run_trial(spec, cap_bytes=cap_bytes, changes=changes, timeout_s=timeout_s).ok

    return settle


def patch_ladder(start: tuple[int, ...], multiple: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Patch sizes from ``start`` down, nnU-Net's way: each step shrinks the axis that is largest relative to
    ``start`` (so the aspect ratio of the data is kept) by one divisibility step, never below one step.

    Example:
        >>> patch_ladder((64, 64, 32), (16, 16, 16))[:4]
        [(64, 64, 32), (48, 64, 32), (48, 48, 32), (48, 48, 16)]
    """
    patch = tuple(max(m, p // m * m) for p, m in zip(start, multiple, strict=True))
    ladder = [patch]
    while True:
        shrinkable = [i for i, (p, m) in enumerate(zip(patch, multiple, strict=True)) if p > m]
        if not shrinkable:
            return ladder
        axis = max(shrinkable, key=lambda i: (patch[i] / start[i], -i))
        patch = tuple(p - multiple[i] if i == axis else p for i, p in enumerate(patch))
        ladder.append(patch)


def plan_patch(
    workload: Workload,
    *,
    budget_bytes: int,
    effective_batch: int | None = None,
    gpu: str | GpuSpec | None = None,
    allocator: AllocatorConfig | None = None,
    margin: float = DEFAULT_MARGIN,
    calibration: CalibrationChoice = "roofline",
    min_batch: int = 2,
    settle: Settle | None = None,
) -> Plan:
    """The largest input patch (on ``patch_ladder`` from ``workload.patch_size``) whose step fits the budget at
    a batch of at least ``min_batch``, as nnU-Net's planner picks it, but with the estimator instead of its proxy.

    Each rung's verdict is an estimate of exactly it, or a floor from a smaller rung (``Search.need_floor``: a rung inside
    another needs no more). The line through two estimates (memory in voxels) only picks which rung to estimate
    next, so the chosen patch is the first from the top that fits, and every larger rung was estimated not to fit
    or lies above one whose floor is over the budget.

    Speed decides nothing here (the largest patch that fits is the answer), so ``calibration`` defaults to the
    roofline, which only annotates the candidates' step times; ``"auto"`` or a ``Calibration`` as for ``plan``.

    "Fits" is decided with the upper bound. ``settle(config, cap_bytes)`` (on the GPU the plan is for: see
    ``trials_on_this_gpu``) is asked about a rung only the bound keeps out, one whose best estimate fits: whether
    its step runs under an allocator cap of the limit less the CUDA context the plan assumes. A rung that ran is
    chosen like one whose bound fits, and the plan says so.
    """
    started = time.perf_counter()
    check_budget(budget_bytes, margin)
    if workload.patch_size is None:
        raise UsageError(
            f"{workload.name} has no patch_size: set Workload.patch_size (the largest patch, e.g. the median image "
            "shape) and patch_multiple (the network's downsampling), and make batch(n, patch_size) use it."
        )
    multiple = workload.patch_multiple or (1,) * len(workload.patch_size)
    batch = max(min_batch, workload.batch_size) if effective_batch is None else effective_batch
    if batch < min_batch:
        raise UsageError(f"the patch search keeps the batch at {min_batch} or more, got effective batch {batch}.")
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    limit = int(budget_bytes * (1 - margin))
    speed = choose_speed_model(workload, spec, calibration, effective_batch=batch)
    search = Search(workload, spec, config, limit, batch, speed.calibration, False)
    ladder = patch_ladder(workload.patch_size, multiple)
    base = Config(micro_batch=batch, accumulation_steps=1, precision=workload.precision,
                  checkpoint=workload.checkpoint, checkpoint_mode=workload.checkpoint_mode,
                  optimizer_impl=workload.optimizer_impl,
                  channels_last=workload.channels_last)

    def at(patch: tuple[int, ...]) -> Config:
        return dataclasses.replace(base, patch_size=patch)

    # Each rung lies inside the one above it (no axis larger), so every tensor of its step is no larger: a rung
    # whose floor (Search.need_floor) is over the limit rules out every rung above it without estimating them.
    # The answer is the first rung from the top that an exact estimate says fits, every rung above it an exact
    # miss or ruled out so: the largest patch on the ladder that fits, whatever the line through the estimates
    # predicted.
    known: dict[int, Estimate] = {}
    ran: dict[int, bool] = {}  # settle's verdicts: rungs only the bound keeps out, run under the cap

    def fits(k: int) -> bool:
        e = known[k]
        if e.device_upper_bytes <= limit:
            return True
        if settle is None or e.device_bytes > limit:
            return False
        if k not in ran:
            ran[k] = settle(at(ladder[k]), limit - (e.device_bytes - e.fits_in_bytes))
        return ran[k]

    def candidate(k: int) -> Candidate:
        c = verified(search, at(ladder[k]))
        return dataclasses.replace(c, fits=True) if ran.get(k) else c

    def floor(patch: tuple[int, ...]) -> int:
        # settling takes a rung whose best estimate fits: the floor must then hold for best estimates too
        return search.need_floor(at(patch), bound=settle is None)

    chosen: Candidate | None = None
    while True:
        out = max((k for k, e in known.items() if floor(ladder[k]) > limit), default=-1)
        first = next((k for k in range(out + 1, len(ladder)) if k not in known or fits(k)), None)
        if first is None:
            break
        if first in known:
            chosen = candidate(first)
            break
        k = _probe_rung(ladder, first, limit, known, floor)
        known[k] = search.estimate(at(ladder[k]))
    scored = [candidate(k) for k in sorted(known)]
    if chosen is None:
        smallest = min(search.estimates.values(), key=lambda e: e.device_upper_bytes)
        raise BudgetTooSmallError(
            f"no patch fits {format_bytes(budget_bytes)} at batch {batch}: the smallest tried needs "
            f"{format_bytes(smallest.device_upper_bytes)}. Try a smaller batch (min_batch), a larger GPU or "
            "bf16/fp16."
        )
    notes = [speed.reason, f"largest patch on the ladder from {'×'.join(map(str, workload.patch_size))} that fits "
             f"at batch {batch}"]
    k = ladder.index(tuple(chosen.config.patch_size or ()))
    if ran.get(k):
        e = known[k]
        notes.append(
            f"its upper bound, {format_bytes(e.device_upper_bytes)}, is over the {format_bytes(limit)} allowed, but "
            f"its step ran under a cap of {format_bytes(limit - (e.device_bytes - e.fits_in_bytes))} on this GPU "
            f"(best estimate {format_bytes(e.device_bytes)})")
    above = known.get(k - 1)
    if above is not None and ran.get(k - 1) is False:
        notes.append(f"the next larger patch, {'×'.join(map(str, ladder[k - 1]))}, did not run under the cap "
                     "on this GPU")
    elif above is not None and above.device_bytes <= limit:
        # "fits" is decided with the upper bound; where only its margin rules the next rung out, say so
        notes.append(
            f"the next larger patch, {'×'.join(map(str, ladder[k - 1]))}, may fit too: its best estimate "
            f"needs {format_bytes(above.device_bytes)} of the {format_bytes(limit)} allowed, its upper bound "
            f"{format_bytes(above.device_upper_bytes)}; `memfit measure` on the GPU settles it")
    return Plan(
        workload=workload.name, gpu=spec.name, budget_bytes=budget_bytes, margin=margin, effective_batch=batch,
        chosen=chosen, frontier=scored, considered=len(scored), estimates=search.runs,
        speed_model=speed.name,
        notes=notes,
        elapsed_s=time.perf_counter() - started,
    )


def _probe_rung(ladder: list[tuple[int, ...]], first: int, limit: int, known: dict[int, Estimate],
                floor: Callable[[tuple[int, ...]], int]) -> int:
    """The rung to estimate next while ``first`` (the largest rung not ruled out) has no estimate: the smallest
    rung from ``first`` down to the largest known to fit that the line through two estimates (``floor`` in voxels)
    puts over the limit, so that one estimate can rule out all of them; ``first`` itself when the line says it
    fits. With no estimate yet, ``first``; with one, the rung nearest a quarter of its voxels (activations,
    most of a segmentation network's memory, scale with the voxels)."""
    if not known:
        return first
    upper = min((k for k, e in known.items() if k > first and e.device_upper_bytes <= limit), default=len(ladder))
    if len(known) == 1:
        (top,) = known
        return min(range(first, upper), key=lambda k: abs(math.prod(ladder[k]) - math.prod(ladder[top]) / 4))
    # the two estimates nearest ``first`` (by voxels) give the line
    a, b = sorted(known, key=lambda k: abs(math.prod(ladder[k]) - math.prod(ladder[first])))[:2]
    va, vb = math.prod(ladder[a]), math.prod(ladder[b])
    per_voxel = (floor(ladder[a]) - floor(ladder[b])) / (va - vb) if va != vb else 0.0

    def predicted(k: int) -> float:
        return floor(ladder[a]) + per_voxel * (math.prod(ladder[k]) - va)

    over = [k for k in range(first, upper) if predicted(k) > limit and k not in known]
    return max(over) if over else first
