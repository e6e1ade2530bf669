"""``plan_patch()``: the largest input patch whose training step fits a budget — the nnU-Net question.

nnU-Net's planner walks the patch down from the median image shape with a rough proxy of memory (conv output
elements against a calibrated reference). This walks the same ladder, but decides with the estimator: each
decision is an estimate of exactly that patch (see ``docs/plan.md``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.plan.search import (
    DEFAULT_MARGIN,
    MAX_VERIFY,
    Candidate,
    Config,
    Plan,
    Search,
    check_budget,
    verified,
)
from memfit.units import format_bytes
from memfit.workload.spec import Workload


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
    calibration: Any = None,
    min_batch: int = 2,
) -> Plan:
    """The largest input patch (on ``patch_ladder`` from ``workload.patch_size``) whose step fits the budget at
    a batch of at least ``min_batch``, as nnU-Net's planner picks it, but with the estimator instead of its proxy.

    Memory is close to linear in the patch's voxels: two estimates give the line, the largest patch predicted to
    fit is verified by an estimate of exactly it, and the next larger one too when the line says it is close.
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
    search = Search(workload, spec, config, limit, batch, calibration, False)
    ladder = patch_ladder(workload.patch_size, multiple)
    base = Config(micro_batch=batch, accumulation_steps=1, precision=workload.precision,
                  checkpoint=workload.checkpoint, optimizer_impl=workload.optimizer_impl,
                  channels_last=workload.channels_last)

    def at(patch: tuple[int, ...]) -> Config:
        return dataclasses.replace(base, patch_size=patch)

    def voxels(patch: tuple[int, ...]) -> int:
        return math.prod(patch)

    # memory falls along the ladder: interpolation search between the largest patch known not to fit and the
    # smallest known to fit, on the line through them in voxels
    need: dict[int, int] = {}

    def evaluate(i: int) -> bool:
        need[i] = search.estimate(at(ladder[i])).device_bytes
        return need[i] <= limit

    chosen: Candidate | None = None
    if evaluate(0):
        chosen = verified(search, at(ladder[0]))
    else:
        quarter = min(range(len(ladder)), key=lambda i: abs(voxels(ladder[i]) - voxels(ladder[0]) / 4))
        evaluate(quarter)
        for _ in range(MAX_VERIFY):
            fits = [i for i in need if need[i] <= limit]
            fit = min(fits) if fits else None
            miss = max(i for i in need if need[i] > limit and (fit is None or i < fit))
            if fit is not None and fit - miss == 1:
                break
            a, b = (miss, fit) if fit is not None else sorted(need)[-2:]
            per_voxel = (need[a] - need[b]) / max(voxels(ladder[a]) - voxels(ladder[b]), 1)
            target = voxels(ladder[b]) + (limit - need[b]) / per_voxel if per_voxel > 0 else 0
            upper = fit if fit is not None else len(ladder)
            inside = [i for i in range(miss + 1, upper) if voxels(ladder[i]) <= target]
            if not inside:
                inside = [min(miss + 1, len(ladder) - 1)] if fit is None else [fit - 1]
            nxt = inside[0]
            if fit is not None and len(need) > 3:
                # memory rises in allocator-sized steps, so the line creeps towards the end of the bracket that
                # fits: once the line has had its try, halve the bracket instead
                nxt = (miss + fit) // 2
            if nxt in need:
                break
            evaluate(nxt)
        fits = [i for i in need if need[i] <= limit]
        if fits:
            chosen = verified(search, at(ladder[min(fits)]))
    scored = [verified(search, at(ladder[i])) for i in sorted(need)]
    if chosen is None:
        smallest = min(search.estimates.values(), key=lambda e: e.device_bytes)
        raise BudgetTooSmallError(
            f"no patch fits {format_bytes(budget_bytes)} at batch {batch}: the smallest tried needs "
            f"{format_bytes(smallest.device_bytes)}. Try a smaller batch (min_batch), a larger GPU or bf16/fp16."
        )
    return Plan(
        workload=workload.name, gpu=spec.name, budget_bytes=budget_bytes, margin=margin, effective_batch=batch,
        chosen=chosen, frontier=scored, considered=len(scored), estimates=search.runs,
        speed_model="calibrated" if calibration is not None else "roofline",
        notes=[f"largest patch on the ladder from {'×'.join(map(str, workload.patch_size))} that fits at batch "
               f"{batch}"],
        elapsed_s=time.perf_counter() - started,
    )
