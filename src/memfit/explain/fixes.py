"""The fixes ``explain`` and ``plan`` try: the workload with one knob turned, re-estimated.

Each fix is the same workload with some fields changed (``Workload.replace``) or another allocator setting,
estimated by the same ``estimate()`` the user runs, so a fix's predicted peak is exactly what
``memfit estimate`` prints for the changed workload.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch

from memfit.errors import MemfitError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.cuda_emulation import deterministic_algorithms
from memfit.estimate.gpus import GpuSpec
from memfit.estimate.predict import Estimate, estimate
from memfit.explain.logits import logits_at_peak
from memfit.plan.patch import patch_ladder, plan_patch
from memfit.speed.step_time import predict_step_time
from memfit.workload.knobs import ModelFacts, checkpoint_choices, model_facts
from memfit.workload.spec import Workload

logger = logging.getLogger(__name__)

FixKind = Literal[
    "micro_batch", "precision", "checkpointing", "channels_last", "optimizer", "expandable_segments", "patch",
    "loss", "deterministic", "combined",
]
"""Which knob a fix turns (``combined``: several fixes together)."""
TrainingChange = Literal["no", "numerics", "semantics"]
"""How much a fix changes training: ``no`` (same mathematics), ``numerics`` (same algorithm, other rounding) or
``semantics`` (e.g. BatchNorm statistics over smaller batches, less context per patch)."""
FIX_KINDS: tuple[FixKind, ...] = get_args(FixKind)
TRAINING_CHANGES: tuple[TrainingChange, ...] = get_args(TrainingChange)
"""From the least change to the most."""


@dataclass(frozen=True)
class Fix:
    """One change to the step, re-estimated."""

    name: str
    """Short, imperative: ``micro-batch 2 × 4 accumulation``."""
    knob: FixKind
    changes: dict[str, Any]
    """The Workload fields changed (``Workload.replace(**changes)`` reproduces it, with ``allocator``; the
    ``deterministic`` fix changes none: it is the process's setting)."""
    allocator: str | None
    """The ``PYTORCH_CUDA_ALLOC_CONF`` it needs, if any."""
    peak_allocated_bytes: int
    fits_in_bytes: int
    device_bytes: int
    device_upper_bytes: int
    """The upper bound on the device memory it needs (``Estimate.device_upper_bytes``): "fits" is decided with it."""
    saving_bytes: int
    """Base ``fits_in_bytes`` minus this one's: positive saves memory."""
    time_factor: float | None
    """Predicted step time relative to the current step (1.25 = 25 % slower); None where no model says."""
    speed_cost: str
    """What it costs in speed, in words."""
    changes_training: TrainingChange
    caveat: str = ""
    fits_budget: bool | None = None



@dataclass
class FixContext:
    workload: Workload
    gpu: GpuSpec
    allocator: AllocatorConfig
    base: Estimate
    budget_bytes: int | None
    cache: dict[str, Estimate] = field(default_factory=dict)

    def estimate(self, changes: dict[str, Any], allocator: AllocatorConfig | None = None) -> Estimate:
        """The estimate of the workload with ``changes``: the same call ``memfit estimate`` makes."""
        key = json.dumps([changes, allocator is not None and asdict(allocator)], sort_keys=True, default=str)
        if key not in self.cache:
            self.cache[key] = estimate(
                self.workload.replace(**changes), gpu=self.gpu, allocator=allocator or self.allocator
            )
        return self.cache[key]

    @functools.cached_property
    def base_step_s(self) -> float | None:
        """Predicted step time of the workload as it is (once, not per fix)."""
        if self.base.cost is None:
            return None
        return predict_step_time(self.base.cost, self.gpu, accumulation=self.workload.accumulation_steps).step_time_s


_COST_ORDER = {change: rank for rank, change in enumerate(TRAINING_CHANGES)}


def _make_fix(ctx: FixContext, est: Estimate, **fields: Any) -> Fix:
    budget = ctx.budget_bytes
    return Fix(
        peak_allocated_bytes=est.peak_allocated_bytes,
        fits_in_bytes=est.fits_in_bytes,
        device_bytes=est.device_bytes,
        device_upper_bytes=est.device_upper_bytes,
        saving_bytes=ctx.base.fits_in_bytes - est.fits_in_bytes,
        time_factor=_time_factor(ctx, est, fields.get("changes", {})),
        fits_budget=None if budget is None else est.fits(budget),
        **fields,
    )


def _time_factor(ctx: FixContext, est: Estimate, changes: dict[str, Any]) -> float | None:
    """Predicted step time with the fix over the current one's, from the speed model (same effective batch)."""
    t0 = ctx.base_step_s
    if t0 is None or est.cost is None:
        return None
    w = ctx.workload
    acc = changes.get("accumulation_steps", w.accumulation_steps)
    t1 = predict_step_time(est.cost, ctx.gpu, accumulation=acc).step_time_s
    if "patch_size" in changes:  # per voxel: a smaller patch does less work per step for the same data
        import math

        t1 *= math.prod(w.patch_size or ()) / math.prod(changes["patch_size"])
    return t1 / t0 if t0 > 0 else None


def find_fixes(ctx: FixContext, trace: Any) -> list[Fix]:
    w = ctx.workload
    facts = model_facts(w)
    fixes: list[Fix] = []

    def attempt(changes: dict[str, Any], **fields: Any) -> Fix | None:
        try:
            est = ctx.estimate(changes)
        except MemfitError as exc:  # a knob the model cannot take (e.g. fused for this optimizer): skip it
            logger.info("fix %s skipped: %s", fields.get("name"), exc)
            return None
        fix = _make_fix(ctx, est, changes=changes, allocator=None, **fields)
        fixes.append(fix)
        return fix

    # 1. smaller micro-batch, same effective batch; with a budget, keep halving until it fits
    micro = w.batch_size
    while micro > 1:
        micro = max(d for d in range(1, micro) if w.batch_size % d == 0 and d <= micro // 2) if micro > 1 else 1
        acc = w.accumulation_steps * (w.batch_size // micro)
        fix = attempt(
            {"batch_size": micro, "accumulation_steps": acc},
            name=f"micro-batch {micro} × {acc} accumulation (effective batch {w.effective_batch_size})",
            knob="micro_batch",
            speed_cost="smaller kernels use the GPU less well and launch overhead repeats per micro-batch",
            changes_training="semantics" if facts.has_batchnorm else "no",
            caveat=f"BatchNorm statistics come from {micro} samples instead of {w.batch_size}"
            if facts.has_batchnorm else "the loss is averaged over the effective batch, as before",
        )
        if fix is None or ctx.budget_bytes is None or fix.fits_budget:
            break
    # 2. mixed precision
    if w.precision == "fp32":
        attempt(
            {"precision": "bf16"},
            name="bf16 autocast",
            knob="precision",
            speed_cost="usually faster: matmuls and convolutions run on tensor cores",
            changes_training="numerics",
            caveat="bf16 needs compute capability 8.0+ (A100, H100, RTX 30xx+); use fp16 + GradScaler before that",
        )
    # 3. activation checkpointing of the blocks that hold the most
    if facts.blocks and not w.checkpoint:
        _checkpoint_fixes(ctx, facts, attempt)
    # 4. channels_last for convolutional nets
    if facts.has_conv and not w.channels_last:
        attempt(
            {"channels_last": True},
            name="channels_last memory format",
            knob="channels_last",
            speed_cost="often faster for convolutions under autocast (cuDNN's NHWC kernels); measure for fp32",
            changes_training="no",
        )
    # 5. optimizer implementation: same mathematics, other temporaries
    if w.optimizer_impl in ("default", "foreach"):
        for impl, speed in (("fused", "faster: one kernel per parameter group"),
                            ("for-loop", "slower: several kernels per parameter")):
            if impl in facts.optimizer_impls:
                attempt(
                    {"optimizer_impl": impl},
                    name=f"{impl} optimizer",
                    knob="optimizer",
                    speed_cost=speed,
                    changes_training="no",
                    caveat="the same update up to floating-point rounding",
                )
    # 6. expandable segments: the same allocations, placed without fragmentation
    if not ctx.allocator.expandable_segments:
        expandable = dataclasses.replace(ctx.allocator, expandable_segments=True)
        est = estimate(w, gpu=ctx.gpu, allocator=expandable, reuse_trace=trace)
        fixes.append(_make_fix(
            ctx, est, changes={}, allocator="expandable_segments:True",
            name="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            knob="expandable_segments",
            speed_cost="about none",
            changes_training="no",
            caveat="set it before CUDA starts; avoid with CUDA graphs + NCCL buffer registration",
        ))
    # 7. a smaller patch, where the workload says how to make one
    if w.patch_size is not None:
        smaller = _smaller_patch(ctx)
        if smaller is not None:
            attempt(
                {"patch_size": smaller},
                name=f"patch {'×'.join(map(str, smaller))} instead of {'×'.join(map(str, w.patch_size))}",
                knob="patch",
                speed_cost="more steps per epoch for the same data",
                changes_training="semantics",
                caveat="each sample sees less context; segmentation quality can change",
            )
    # 8. the chunked cross-entropy, where the logits of a large vocabulary are at the peak and the model exposes
    # its output layer (an HF-shaped causal LM): memfit cannot find the loss inside an arbitrary model
    if w.loss_impl == "default" and facts.output_vocab is not None and logits_at_peak(ctx.base, facts.output_vocab):
        attempt(
            {"loss_impl": "chunked"},
            name="chunked cross-entropy (no full logits)",
            knob="loss",
            speed_cost="one more output-layer matmul in backward (about a third more of its FLOPs) and a loop "
            "over chunks of tokens",
            changes_training="no",
            caveat="the same loss up to floating-point rounding; the model must be called with labels",
        )
    # 9. deterministic algorithms off: under them some ops run another, larger way on CUDA (bilinear upsampling's
    # decomposition, torchvision's compiled roi_align, index ops' sorts), which the trace follows
    if torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic:
        with deterministic_algorithms(False):
            est = estimate(w, gpu=ctx.gpu, allocator=ctx.allocator)
        fixes.append(_make_fix(
            ctx, est, changes={}, allocator=None,
            name="deterministic algorithms off",
            knob="deterministic",
            speed_cost="usually faster: the ops' default kernels",
            changes_training="numerics",
            caveat="runs are no longer bit-for-bit reproducible (torch.use_deterministic_algorithms(False); Lightning: "
                   "Trainer(deterministic=False))",
        ))
    return sorted(fixes, key=lambda f: -f.saving_bytes)


def _checkpoint_fixes(ctx: FixContext, facts: ModelFacts, attempt: Any) -> None:
    choices = checkpoint_choices(ctx.base.activations_by_module, facts.blocks)
    for order in choices:
        label = f"all {len(order)} blocks" if order == choices[-1] else _list_names(list(order))
        attempt(
            {"checkpoint": order},
            name=f"activation checkpointing of {label}",
            knob="checkpointing",
            speed_cost="one more forward of the checkpointed blocks; much more where the CPU is the bottleneck "
            "(all of ResNet-50's blocks at small micro-batches: 2.3-3.5x a micro-batch on an H200)",
            changes_training="no",
            caveat="BatchNorm inside a checkpointed block updates its running statistics twice"
            if facts.has_batchnorm else "",
        )


def _list_names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _smaller_patch(ctx: FixContext) -> tuple[int, ...] | None:
    """With a budget, the largest patch on nnU-Net's ladder whose step fits it at the workload's batch
    (``memfit.plan.patch.plan_patch``); without one, or when none fits, the first rung with at most half the voxels."""
    import math

    w = ctx.workload
    assert w.patch_size is not None
    if ctx.budget_bytes is not None:
        try:
            found = plan_patch(w, budget_bytes=ctx.budget_bytes, effective_batch=w.batch_size, gpu=ctx.gpu,
                               allocator=ctx.allocator, min_batch=1).chosen.config.patch_size
        except MemfitError as exc:  # no patch on the ladder fits: offer the half-volume one
            logger.info("no patch fits the budget: %s", exc)
        else:
            if found is not None and found != w.patch_size:
                return found
    ladder = patch_ladder(w.patch_size, w.patch_multiple or (1,) * len(w.patch_size))
    return next((p for p in ladder if math.prod(p) <= math.prod(w.patch_size) / 2), None)


def combine_fixes(ctx: FixContext, fixes: list[Fix]) -> Fix | None:
    """The cheapest set of fixes that fits the budget: free ones first, then by cost, re-estimated together."""
    assert ctx.budget_bytes is not None
    if ctx.base.fits(ctx.budget_bytes):
        return None
    singles = [f for f in fixes if f.fits_budget]
    if singles:
        return None  # one fix alone is enough; the table says which
    pick: dict[str, Fix] = {}
    # one choice per knob: the largest saving of that knob; not the process-wide deterministic setting, which the
    # workload's fields cannot carry into the combined estimate (the table lists it alone)
    for f in (f for f in fixes if f.saving_bytes > 0 and f.knob != "deterministic"):
        if f.knob not in pick or f.saving_bytes > pick[f.knob].saving_bytes:
            pick[f.knob] = f
    ordered = sorted(pick.values(), key=lambda f: (_COST_ORDER[f.changes_training], f.time_factor or 1.0))
    changes: dict[str, Any] = {}
    allocator: AllocatorConfig | None = None
    names: list[str] = []
    for f in ordered:
        changes.update(f.changes)
        if f.allocator:
            allocator = dataclasses.replace(ctx.allocator, expandable_segments=True)
        names.append(f.name)
        try:
            est = ctx.estimate(dict(changes), allocator)
        except MemfitError:
            continue
        if est.device_bytes <= ctx.budget_bytes:
            worst = max((x.changes_training for x in ordered[: len(names)]), key=_COST_ORDER.__getitem__)
            return _make_fix(
                ctx, est, name=" + ".join(names), knob="combined", changes=dict(changes),
                allocator="expandable_segments:True" if allocator else None,
                speed_cost="the sum of its parts", changes_training=worst,
            )
    return None
